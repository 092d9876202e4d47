"""Tests of the vLLM plugin, run in vLLM's own environment (`make test-vllm`): vLLM's CPU build
pins a transformers that cactus-spec's environment does not, so it lives in .venv-vllm."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # lawcheck


@pytest.fixture(scope="session")
def plugin():
    """The plugin registered in this process, with vLLM's CPU kernels in place."""
    from vllm.platforms import current_platform

    from cactus_spec.integrations.vllm import plugin

    plugin.register()
    current_platform.register_triton_kernel_overrides()
    return plugin
