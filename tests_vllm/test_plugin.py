"""The plugin as vLLM finds it: registered by entry point, idempotent, Model Runner V2 refused."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest


def test_vllm_finds_the_plugin_by_its_entry_point() -> None:
    (found,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "cactus_spec"]
    assert found.value == "cactus_spec.integrations.vllm.plugin:register"


def test_register_patches_once(plugin) -> None:
    from vllm.v1.sample import rejection_sampler

    patched = rejection_sampler.rejection_sample
    plugin.register()
    assert rejection_sampler.rejection_sample is patched
    assert patched.__module__ == "cactus_spec.integrations.vllm.sampler"


def test_model_runner_v2_is_refused_with_how_to_run_instead(plugin) -> None:
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler

    with pytest.raises(RuntimeError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        RejectionSampler()


def test_offline_sampling_params_refuse_a_bad_value(plugin) -> None:
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="cactus_k must be an integer >= 1"):
        SamplingParams(extra_args={"cactus_method": "topk", "cactus_k": "0"})
    good = plugin.extra_args("cactus", delta=0.5, exact=True)
    assert good == {"cactus_method": "cactus", "cactus_delta": 0.5, "cactus_exact": True}
    assert SamplingParams(extra_args=good).extra_args == good
    with pytest.raises(ValueError, match="cactus_delta must be a number, got nan"):
        plugin.extra_args("cactus", delta=float("nan"))
