"""What a run ran on: library versions, machine, threads, dtype and model identities."""

from __future__ import annotations

import platform
from pathlib import Path

import torch
import transformers

import cactus_spec
from cactus_spec import isa
from cactus_spec.backends.packed import bf16_kernel
from cactus_spec.backends.quant import int4_kernel, quant_kernel
from cactus_spec.loading.model_store import file_sha256
from cactus_spec.loading.models import LoadedModel


def model_identity(loaded: LoadedModel | None) -> dict | None:
    """Path and sha256 of a loaded model: of its GGUF file, else of its weight files
    (a model directory), else None (a model object built in memory)."""
    if loaded is None:
        return None
    sha = loaded.sha256
    path = Path(loaded.identity)
    if sha is None and path.is_dir():
        weights = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
        sha = ",".join(file_sha256(w) for w in weights) or None
    found: dict[str, object] = {"path": loaded.identity, "sha256": sha, "quant": loaded.quant}
    if loaded.head_tokens is not None:  # a truncated head: another draft
        found["head_vocab"] = len(loaded.head_tokens)
    return found


def environment(device: torch.device, dtype: torch.dtype) -> dict:
    """Versions, machine and settings that timings depend on."""
    accelerator = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "cactus_spec": cactus_spec.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": isa.cpu_name(),
        "isa": isa.level(),
        "accelerator": accelerator,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "cpu_kernels": {"int8": quant_kernel(), "int4": int4_kernel(), "bf16": bf16_kernel()},
    }
