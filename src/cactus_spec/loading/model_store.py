"""The model cache: a digest index, GGUF checks, and dense copies that are complete or absent.

Layout under ``cache_dir()``::

  sha256.json                 digest index: path -> size, mtime, ctime, inode and sha256
  gguf/<name>.gguf            joined GGUF of a known model (written by ``fetch``)
  dense/<sha256>/             dense bfloat16 transformers copy of the GGUF with that sha256
  dense/<sha256>/complete.json   written last: every file of the copy with size and sha256

Nothing damaged is ever loaded. A known model's GGUF must match its pinned sha256. A dense
copy is used only when its completion record lists files that are all present with the
recorded size and sha256; the index makes that check cheap (a file is rehashed only when
its size, mtime, ctime or inode changed, and ctime cannot be set back by a user). A damaged
copy is rebuilt from the GGUF; a conversion builds in a temporary directory that replaces
the destination atomically and never outlives the process that made it.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from cactus_spec.loading.catalog import get_spec
from cactus_spec.paths import cache_dir

FETCH_HINT = "run: cactus-spec models fetch"
COMPLETE_FILE = "complete.json"
#: Files above this size print a line while they are hashed.
_ANNOUNCE_HASH_BYTES = 64 << 20


class ModelNotFoundError(ValueError):
    """A model source that does not exist or cannot be loaded."""


class CorruptModelError(ValueError):
    """A model file in or given to the cache is truncated, damaged or not what it should be."""


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


# --- the digest index -------------------------------------------------------------------


def _index_path() -> Path:
    return cache_dir() / "sha256.json"


def _read_index() -> dict[str, dict]:
    """The digest index; a damaged one is treated as empty (everything is rehashed)."""
    path = _index_path()
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (UnicodeDecodeError, ValueError, OSError) as err:
        _warn(f"ignoring the damaged digest index {path} ({type(err).__name__}); rehashing")
        return {}
    if not isinstance(index, dict) or not all(isinstance(v, dict) for v in index.values()):
        _warn(f"ignoring the damaged digest index {path} (not a JSON object); rehashing")
        return {}
    return index


def _stat_key(path: Path) -> dict:
    st = path.stat()
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "inode": st.st_ino,
    }


def record_sha256(path: str | Path, digest: str) -> None:
    """Remember ``digest`` as the sha256 of ``path`` while its stat key stays unchanged."""
    _store(_read_index(), Path(path).resolve(), digest)


def _store(index: dict[str, dict], path: Path, digest: str) -> None:
    """Write ``index`` with the entry of ``path`` added, atomically."""
    index[str(path)] = {**_stat_key(path), "sha256": digest}
    _index_path().parent.mkdir(parents=True, exist_ok=True)
    tmp = _index_path().with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, _index_path())


def hash_file(path: Path) -> str:
    """The sha256 of a file, read in 4 MiB chunks."""
    if path.stat().st_size >= _ANNOUNCE_HASH_BYTES:
        print(f"hashing {path.name}...", file=sys.stderr)
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file, from the index while the file is untouched, else hashed anew."""
    path = Path(path).resolve()
    index = _read_index()
    entry = index.get(str(path))
    key = _stat_key(path)
    if entry and {k: entry.get(k) for k in key} == key and isinstance(entry.get("sha256"), str):
        return entry["sha256"]
    digest = hash_file(path)
    _store(index, path, digest)
    return digest


# --- GGUF files --------------------------------------------------------------------------


def known_gguf_path(name: str) -> Path:
    """Where the verified GGUF of a known model lies (whether fetched yet or not)."""
    return cache_dir() / "gguf" / f"{get_spec(name).name}.gguf"


def verified_known_gguf(name: str) -> Path:
    """The cached GGUF of a known model, after checking it against its pinned sha256."""
    spec = get_spec(name)
    path = known_gguf_path(name)
    if not path.is_file():
        raise ModelNotFoundError(f"model {name!r} is not fetched yet; {FETCH_HINT} {name}")
    if path.stat().st_size != spec.size or file_sha256(path) != spec.sha256:
        raise CorruptModelError(
            f"{path} does not match the pinned sha256 of {name} (the file is damaged); "
            f"repair it: cactus-spec models fetch {name}"
        )
    return path


class _GGUFLayout(GGUFReader):
    """A GGUFReader that parses the header and the tensor table but maps no tensor data,
    so a truncated file gives the size it should have instead of a reshape error."""

    expected_size: int

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        ends = [start_offs]
        for field in fields:
            _, _, _, dims, raw_type, offset = field.parts
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
            n_bytes = int(np.prod(dims, dtype=np.int64)) * type_size // block
            ends.append(start_offs + int(offset[0]) + n_bytes)
        self.expected_size = max(ends)
        self.tensors = []


def check_gguf(path: Path) -> None:
    """Raise CorruptModelError when ``path`` is not a complete GGUF file."""
    actual = path.stat().st_size
    try:
        expected = _GGUFLayout(path).expected_size
    except Exception as err:  # the reader fails in many ways on bad bytes; all mean corrupt
        raise CorruptModelError(
            f"{path} is truncated or corrupt: its GGUF header cannot be read "
            f"({type(err).__name__}: {err}; the file has {actual:,} bytes)"
        ) from None
    if actual < expected:
        raise CorruptModelError(
            f"{path} is truncated: its tensors need {expected:,} bytes, the file has {actual:,}"
        )


# --- dense copies ------------------------------------------------------------------------


def dense_copy_problem(dest: Path) -> str | None:
    """Why the dense copy at ``dest`` cannot be used, or None when it is complete and intact."""
    record_path = dest / COMPLETE_FILE
    if not record_path.is_file():
        return "no completion record" if dest.exists() else "absent"
    try:
        files = json.loads(record_path.read_text(encoding="utf-8"))["files"]
        expected = {name: (int(v["size"]), str(v["sha256"])) for name, v in files.items()}
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        return f"{COMPLETE_FILE} is damaged"
    for name, (size, sha) in expected.items():
        path = dest / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size:,} bytes, expected {size:,}"
        if file_sha256(path) != sha:
            return f"{name} does not match its recorded sha256"
    return None


def ensure_dense_copy(gguf: str | Path) -> Path:
    """The cached, verified dense copy of a GGUF file, (re)building it first if needed."""
    gguf = Path(gguf)
    dest = cache_dir() / "dense" / file_sha256(gguf)
    problem = dense_copy_problem(dest)
    if problem is None:
        return dest
    if problem != "absent":
        _warn(f"the dense copy {dest} is damaged ({problem}); rebuilding it from {gguf.name}")
    check_gguf(gguf)
    dest.parent.mkdir(parents=True, exist_ok=True)
    _convert_gguf(gguf, dest)
    return dest


def _temp_prefix(dest: Path) -> str:
    return f".{dest.name}.tmp-"


def _remove_orphan_temps(dest: Path) -> None:
    """Delete temp dirs of conversions whose process is gone (killed mid-way)."""
    prefix = _temp_prefix(dest)
    for old in dest.parent.glob(f"{prefix}*"):
        pid = old.name[len(prefix) :].split("-", 1)[0]
        if not pid.isdigit() or not _process_alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _convert_gguf(gguf: Path, dest: Path) -> None:
    """Dequantise ``gguf`` into a dense bfloat16 copy at ``dest``, atomically."""
    print(
        f"converting {gguf.name} to a dense copy (one time, about a minute per GB)...",
        file=sys.stderr,
    )
    start = time.perf_counter()
    _remove_orphan_temps(dest)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_temp_prefix(dest)}{os.getpid()}-", dir=dest.parent))
    try:
        _write_dense(gguf, tmp)
        records = _write_completion_record(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private
        if _install(tmp, dest):
            for name, sha in records.items():
                record_sha256(dest / name, sha)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"converted in {time.perf_counter() - start:.0f} s: {dest}", file=sys.stderr)


def _write_dense(gguf: Path, out: Path) -> None:
    """Load the GGUF through transformers (dequantised) and save a plain dense copy, with
    one progress bar of its own (``_conversion_bar``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    kw = {"gguf_file": gguf.name, "local_files_only": True}
    with _conversion_bar(gguf.name) as stage:
        try:
            quantised = AutoModelForCausalLM.from_pretrained(
                gguf.parent,
                dtype=torch.bfloat16,
                quantization_config=GgufConfig(dequantize=True),  # dense weights, never blocks
                **kw,
            )
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kw)
        except (ValueError, OSError, KeyError, RuntimeError) as err:
            raise CorruptModelError(f"{gguf} could not be converted: {err}") from err
        stage("building the dense model")
        config = copy.deepcopy(quantised.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        dense = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        dense.load_state_dict(quantised.state_dict())
        del quantised
        stage("saving")
        dense.save_pretrained(out)
        tokenizer.save_pretrained(out)
        stage("done")


#: Stages of a conversion after the GGUF's tensors are read: building the model, saving it.
_LATER_STEPS = 2


@contextlib.contextmanager
def _conversion_bar(name: str) -> Iterator[Callable[[str], None]]:
    """One progress bar on stderr for converting ``name``: one step per GGUF tensor read
    (transformers' reader loop advances it), then one per later stage: ``stage(label)``
    names the stage now running and counts the one before it as done. transformers' own
    bars (its reader's, its loading stages') are silenced meanwhile."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=Console(stderr=True)) as bar:
        task = bar.add_task(f"converting {name}: reading tensors", total=None)

        def tensors(items, **_ignored) -> Iterator:
            bar.update(task, total=len(items) + _LATER_STEPS)
            for item in items:
                yield item
                bar.advance(task)

        stages = [0]

        def stage(label: str) -> None:
            bar.update(task, description=f"converting {name}: {label}", advance=min(stages[0], 1))
            stages[0] += 1

        reader_bar, bars_on = gguf_utils.tqdm, hf_logging.is_progress_bar_enabled()
        gguf_utils.tqdm = tensors
        hf_logging.disable_progress_bar()
        try:
            yield stage
        finally:
            gguf_utils.tqdm = reader_bar
            if bars_on:
                hf_logging.enable_progress_bar()


def _write_completion_record(directory: Path) -> dict[str, str]:
    """Hash every file of ``directory`` into its completion record, written last."""
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    records = {str(p.relative_to(directory)): hash_file(p) for p in files}
    listing = {
        name: {"size": (directory / name).stat().st_size, "sha256": sha}
        for name, sha in records.items()
    }
    (directory / COMPLETE_FILE).write_text(json.dumps({"files": listing}, indent=1))
    return records


def _install(tmp: Path, dest: Path) -> bool:
    """Move the finished copy ``tmp`` to ``dest``, replacing an incomplete ``dest``.
    Returns False when another process installed a complete copy first (ours is dropped)."""
    for _ in range(3):
        if dense_copy_problem(dest) is None:
            return False
        if dest.exists():
            trash = dest.with_name(f".{dest.name}.damaged-{os.getpid()}")
            with contextlib.suppress(FileNotFoundError):
                os.rename(dest, trash)
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(tmp, dest)  # atomic: `dest` appears complete or not at all
            return True
        except OSError as err:
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
    raise CorruptModelError(f"could not replace the damaged dense copy {dest}; delete it by hand")
