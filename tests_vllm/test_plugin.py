"""The plugin as vLLM finds it: registered by entry point, idempotent, in both model runners."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest


def test_vllm_finds_the_plugin_by_its_entry_point() -> None:
    (found,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "cactus_spec"]
    assert found.value == "cactus_spec.integrations.vllm.plugin:register"


def test_register_patches_both_runners_once(plugin) -> None:
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler as v2

    patched = rejection_sampler.rejection_sample, v2.rejection_sample
    runner = GPUModelRunner.add_requests, GPUModelRunner.finish_requests
    plugin.register()
    assert (rejection_sampler.rejection_sample, v2.rejection_sample) == patched
    assert (GPUModelRunner.add_requests, GPUModelRunner.finish_requests) == runner
    assert patched[0].__module__ == "cactus_spec.integrations.vllm.sampler"
    assert patched[1].__module__ == "cactus_spec.integrations.vllm.sampler_v2"
    assert v2.RejectionSampler.__call__.__module__ == "cactus_spec.integrations.vllm.plugin"


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
