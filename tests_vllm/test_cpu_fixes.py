"""The CPU fixes, each against vLLM's own code without it (which must fail)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
import vllm.utils.cpu_triton_utils as live_cpu_kernels


def vllms_expand():
    """vLLM's own ``_expand_kernel_impl``, loaded from its file (the live one is patched)."""
    spec = importlib.util.spec_from_file_location("vllm_cpu_kernels", live_cpu_kernels.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._expand_kernel_impl


def expand_temperatures(expand) -> torch.Tensor:
    out = torch.zeros(5)
    temperatures = torch.tensor([0.6, 0.0])  # 0 (greedy) is replaced by 1
    expand(out, temperatures, torch.tensor([2, 5], dtype=torch.int32), 0, 1)
    return out


def test_expand_writes_float_temperatures(plugin) -> None:
    from cactus_spec.integrations.vllm.cpu_fixes import expand

    expected = torch.tensor([0.6, 0.6, 1.0, 1.0, 1.0])
    assert torch.equal(expand_temperatures(expand), expected)
    assert live_cpu_kernels._expand_kernel_impl is expand
    ints = torch.zeros(4, dtype=torch.int64)
    expand(ints, torch.tensor([7, 0, 3]), torch.tensor([1, 1, 4], dtype=torch.int32), 0, 9)
    assert ints.tolist() == [7, 3, 3, 3]


def test_vllms_expand_leaves_the_temperatures_unwritten(plugin) -> None:
    """The bug the fix is for, shown on vLLM's own function (the negative control)."""
    assert torch.equal(expand_temperatures(vllms_expand()), torch.zeros(5))


def test_a_step_without_drafts_passes_top_k(plugin) -> None:
    from vllm.v1.sample import rejection_sampler

    metadata = SimpleNamespace(
        all_greedy=False, temperature=torch.ones(2), top_k=torch.tensor([20, 20]), top_p=None
    )
    empty, cu = torch.empty(0, 50), torch.zeros(2, dtype=torch.int32)
    apply = rejection_sampler.apply_sampling_constraints
    assert apply(empty, cu, metadata).shape == (0, 50)
    with pytest.raises(RuntimeError):
        apply.__wrapped__(empty, cu, metadata)
