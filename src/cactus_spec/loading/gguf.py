"""What the ggml backend reads: a GGUF file, by a known model's name or a ``.gguf`` path.

The checks run before anything loads and raise one line naming the backend and what it
reads (``check_ggml``); ``read_gguf`` loads the file with llama.cpp (``backends.ggml``) and
its tokenizer through transformers from the same file, with no dense copy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from cactus_spec.backends.ggml import INSTALL_HINT, GgufModel, available
from cactus_spec.loading.catalog import REGISTRY
from cactus_spec.loading.model_store import file_sha256, verified_known_gguf

__all__ = ["READS", "check_ggml", "check_gguf_source", "read_gguf"]

#: What the ggml backend reads, as its errors say it.
READS = "a GGUF file (a known model name or a .gguf path)"


def check_ggml(options: Mapping[str, object], label: Callable[[str], str] = str) -> None:
    """ValueError unless llama-cpp-python is installed and each of ``options`` (by its key:
    a quantisation, ``draft_vocab``, ``head_vocab``, ``dtype``, ``device``) leaves the GGUF's
    own weights as llama.cpp runs them: no quantisation of ours, no cut head, no dtype, the
    CPU. ``label`` names a key as its user wrote it."""
    backend = f"{label('backend')} ggml"
    if not available():
        raise ValueError(f"{backend} needs llama-cpp-python; {INSTALL_HINT}")
    for key, value in options.items():
        allowed = _GGML_ALLOWS.get(key)
        if value is None or value == allowed:
            continue
        fix = f"use {allowed}" if allowed else "leave it out"
        raise ValueError(
            f"{label(key)} {value} does not apply to {backend}, which runs the GGUF's own "
            f"weights on the CPU; {fix}"
        )


#: The one value an option may take on the ggml backend (the others: none given).
_GGML_ALLOWS = {"quant": "none", "verifier_quant": "none", "draft_quant": "none", "device": "cpu"}


def check_gguf_source(source: str | Path, label: str, backend: str = "backend ggml") -> Path | str:
    """``source`` if ``backend`` can read it: a known name, or a ``.gguf`` file that exists;
    ValueError naming ``label``, the backend and what it reads otherwise."""
    if isinstance(source, str) and source in REGISTRY:
        return source
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        found = sorted(p.name for p in path.glob("*.gguf"))
        what = (
            f"a directory; name its GGUF file ({', '.join(found)})"
            if found
            else ("a directory without a GGUF file")
        )
    else:
        what = "not a .gguf file" if path.exists() else "neither a known model nor a file"
    raise ValueError(f"{backend} reads {READS}; {label} {str(source)!r} is {what}")


def read_gguf(
    source: str | Path, threads: int | None
) -> tuple[GgufModel, PreTrainedTokenizerBase, str, str]:
    """The GGUF of ``source`` loaded by llama.cpp (run with ``threads``), its tokenizer, its
    path and its sha256. A known name loads only while its file matches the pinned sha256."""
    checked = check_gguf_source(source, "model")
    path = verified_known_gguf(checked) if isinstance(checked, str) else checked
    tokenizer = AutoTokenizer.from_pretrained(
        path.parent, gguf_file=path.name, local_files_only=True
    )
    return GgufModel(path, threads), tokenizer, str(path), file_sha256(path)
