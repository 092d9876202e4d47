"""Giving memory back after a model's linear layers were rewritten (packed or quantised).

Two things keep memory that a rewritten model no longer uses:

- a checkpoint loaded from safetensors is a memory map of the file, and every page read
  stays resident while any tensor of the map lives: the few tensors left after the linear
  layers got their own copies (embedding, norms, biases) would keep the whole file mapped,
  about the model's size again;
- the C allocator keeps freed blocks (the float32 copies made while quantising) for reuse,
  so the resident set stays up to a gigabyte above what is in use.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import TypeVar

from torch import nn

Model = TypeVar("Model", bound=nn.Module)


def own_memory(model: Model) -> Model:
    """Copy ``model``'s parameters and buffers into fresh memory (in place), then
    ``trim_heap``: the checkpoint's memory map, if any, is released."""
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor.data = tensor.data.clone()
    trim_heap()
    return model


def trim_heap() -> None:
    """Return the C allocator's free blocks to the system (glibc ``malloc_trim``; a no-op
    where the C library has none)."""
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is not None:
        trim(0)
