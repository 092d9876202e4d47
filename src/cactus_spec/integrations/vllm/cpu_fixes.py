"""Two fixes that speculative sampling with temperature needs on vLLM's CPU build.

1. ``expand``: the CPU stand-in for the Triton ``expand_kernel``
   (``utils/cpu_triton_utils._expand_kernel_impl``) hands the C++ kernel int64 *copies* of
   its output and input and never copies back. The sampler expands each request's
   temperature, top-k and top-p to its drafted tokens with it, so float temperatures were
   read as integers and never written: acceptance near 0 and garbage text. The fix expands
   with ``repeat_interleave`` for every dtype.
2. ``empty drafts``: the runner builds speculative metadata on steps where no request has a
   draft; ``apply_sampling_constraints`` then reduces an empty tensor in top-k
   (``max(): Expected reduction dim``) or indexes past it with top-p. The fix returns the
   empty logits as they are.

Each is applied only on the versions known to have the bug (``AFFECTED``), the first only
on the CPU platform.
"""

from __future__ import annotations

import functools
import importlib

import torch
from torch import Tensor

SAMPLER = "vllm.v1.sample.rejection_sampler"
CPU_KERNELS = "vllm.utils.cpu_triton_utils"
TARGETS = ((CPU_KERNELS, "_expand_kernel_impl"), (SAMPLER, "apply_sampling_constraints"))
#: vLLM versions (major, minor) whose source has both bugs (read in 0.32.0 and 0.33.0).
AFFECTED = ((0, 32), (0, 33))


def expand(
    output: Tensor,  # [T]
    input_val: Tensor,  # [B]
    cu_num_tokens: Tensor,  # [B]
    replace_from: int,
    replace_to: int,
    MAX_NUM_TOKENS: int | None = None,  # noqa: N803 (the kernel's argument name)
) -> None:
    """output = input_val repeated per request (cu_num_tokens cumulative counts), with
    ``replace_from`` values replaced by ``replace_to``: the Triton kernel's contract."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())  # [B]
    values = torch.where(input_val == replace_from, replace_to, input_val).to(output.dtype)
    output[: int(counts.sum())] = values.repeat_interleave(counts)


def guard_empty(apply_sampling_constraints):
    """``apply_sampling_constraints`` that returns empty logits untouched."""

    @functools.wraps(apply_sampling_constraints)
    def wrapped(logits: Tensor, cu_num_draft_tokens: Tensor, sampling_metadata) -> Tensor:
        if logits.shape[0] == 0:
            return logits
        return apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata)

    return wrapped


def apply(release: tuple[int, ...]) -> list[str]:
    """Apply the fixes vLLM ``release`` (major, minor) needs; the names of those applied."""
    if release not in AFFECTED:
        return []
    from vllm.platforms import current_platform

    applied = []
    if current_platform.is_cpu():
        importlib.import_module(CPU_KERNELS)._expand_kernel_impl = expand
        applied.append("expand")
    sampler = importlib.import_module(SAMPLER)
    sampler.apply_sampling_constraints = guard_empty(sampler.apply_sampling_constraints)
    applied.append("empty drafts")
    return applied
