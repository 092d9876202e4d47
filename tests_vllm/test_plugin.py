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
