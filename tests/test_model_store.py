"""The model cache never serves a wrong model and recovers from every damaged state.

Each case works on a copy of the cache in a temporary directory (``CACTUS_SPEC_CACHE``),
never on the real one. The slow cases use the real SmolLM2 GGUF and its dense copy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cactus_spec.loading import model_store as cache
from cactus_spec.loading.catalog import REGISTRY
from cactus_spec.loading.model_store import (
    COMPLETE_FILE,
    CorruptModelError,
    check_gguf,
    dense_copy_problem,
    ensure_dense_copy,
    file_sha256,
    hash_file,
)

SMOL = "smollm2-135m"


@pytest.fixture
def empty_cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("CACTUS_SPEC_CACHE", str(root))
    return root


# --- the digest index ----------------------------------------------------------------------


def test_a_garbled_index_is_ignored_with_a_warning_that_names_it(empty_cache, tmp_path, capsys):
    blob = tmp_path / "blob.bin"
    blob.write_bytes(b"weights" * 1000)
    expected = file_sha256(blob)
    (empty_cache / "sha256.json").write_bytes(b"\x80\xff\xfe garbage \x00\x9c")
    assert file_sha256(blob) == expected  # rehashed, not blocked
    err = capsys.readouterr().err
    assert f"ignoring the damaged digest index {empty_cache / 'sha256.json'}" in err
    assert err.count("\n") == 1
    assert file_sha256(blob) == expected  # the index was rewritten and works again
    assert capsys.readouterr().err == ""


def test_the_index_notices_a_change_even_with_the_mtime_set_back(empty_cache, tmp_path):
    blob = tmp_path / "blob.bin"
    blob.write_bytes(b"a" * 10_000)
    before = file_sha256(blob)
    stat = blob.stat()
    with blob.open("r+b") as f:
        f.seek(5000)
        f.write(b"b" * 100)
    os.utime(blob, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size, same mtime
    after = file_sha256(blob)
    assert after != before and after == hash_file(blob)


# --- dense copies: detection and atomic replacement, without a model -----------------------


def _fake_copy(directory: Path, files: dict[str, bytes]) -> None:
    directory.mkdir(parents=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    cache._write_completion_record(directory)


def test_dense_copy_problems_are_all_detected(empty_cache):
    dest = empty_cache / "dense" / "abc"
    assert dense_copy_problem(dest) == "absent"
    _fake_copy(dest, {"config.json": b"{}", "model.safetensors": b"x" * 4096})
    assert dense_copy_problem(dest) is None
    data = (dest / "model.safetensors").read_bytes()
    (dest / "model.safetensors").write_bytes(data[:1000])
    assert "has 1,000 bytes, expected 4,096" in dense_copy_problem(dest)
    (dest / "model.safetensors").write_bytes(b"y" * 4096)  # same size, other bytes
    assert "does not match its recorded sha256" in dense_copy_problem(dest)
    (dest / "model.safetensors").write_bytes(data)
    assert dense_copy_problem(dest) is None
    (dest / "config.json").unlink()
    assert dense_copy_problem(dest) == "config.json is missing"
    (dest / COMPLETE_FILE).write_bytes(b"\xff\x00")
    assert dense_copy_problem(dest) == f"{COMPLETE_FILE} is damaged"
    (dest / COMPLETE_FILE).unlink()
    assert dense_copy_problem(dest) == "no completion record"


def test_install_replaces_an_incomplete_destination_atomically(empty_cache):
    dest = empty_cache / "dense" / "abc"
    dest.mkdir(parents=True)
    (dest / "model.safetensors").write_bytes(b"half")  # no config, no record
    tmp = empty_cache / "dense" / ".abc.tmp-1-x"
    _fake_copy(tmp, {"config.json": b"{}", "model.safetensors": b"whole"})
    assert cache._install(tmp, dest)
    assert dense_copy_problem(dest) is None
    assert (dest / "model.safetensors").read_bytes() == b"whole"
    assert sorted(p.name for p in dest.parent.iterdir()) == ["abc"]


def test_install_keeps_a_complete_copy_made_by_another_process(empty_cache):
    dest = empty_cache / "dense" / "abc"
    _fake_copy(dest, {"config.json": b"{}"})
    tmp = empty_cache / "dense" / ".abc.tmp-1-x"
    _fake_copy(tmp, {"config.json": b"{}"})
    assert not cache._install(tmp, dest)
    assert dense_copy_problem(dest) is None


def test_temp_dirs_of_dead_processes_are_removed_and_live_ones_kept(empty_cache):
    dest = empty_cache / "dense" / "abc"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    orphan = dest.parent / f".abc.tmp-{dead.stdout.strip()}-x"
    alive = dest.parent / f".abc.tmp-{os.getpid()}-y"
    for directory in (orphan, alive):
        directory.mkdir(parents=True)
    cache._remove_orphan_temps(dest)
    assert not orphan.exists() and alive.exists()


# --- real GGUF files ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_cache() -> Path:
    """The real cache with SmolLM2 fetched (and its dense copy complete)."""
    from cactus_spec.loading.fetch import fetch

    fetch(SMOL)
    return cache.cache_dir()


@pytest.fixture
def cache_copy(real_cache, empty_cache) -> Path:
    """A private copy of SmolLM2's GGUF and dense copy, in an empty cache."""
    sha = REGISTRY[SMOL].sha256
    (empty_cache / "gguf").mkdir(parents=True)
    shutil.copy2(real_cache / "gguf" / f"{SMOL}.gguf", empty_cache / "gguf" / f"{SMOL}.gguf")
    shutil.copytree(real_cache / "dense" / sha, empty_cache / "dense" / sha)
    return empty_cache


def _flip_middle(path: Path, size: int = 4096) -> None:
    with path.open("r+b") as f:
        f.seek(path.stat().st_size // 2)
        block = f.read(size)
        f.seek(-len(block), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in block))


def _no_temps(root: Path) -> bool:
    return not [p for p in (root / "dense").iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_a_corrupted_known_gguf_is_refused_with_a_repair_hint(cache_copy, capsys):
    from cactus_spec.cli import main
    from cactus_spec.loading.models import load_model

    assert load_model(SMOL).sha256 == REGISTRY[SMOL].sha256  # positive control
    _flip_middle(cache_copy / "gguf" / f"{SMOL}.gguf")
    with pytest.raises(CorruptModelError, match=f"repair it: cactus-spec models fetch {SMOL}"):
        load_model(SMOL)
    argv = ["generate", "Say hi", "--verifier", SMOL, "--draft", SMOL, "--max-new-tokens", "8"]
    assert main([*argv, "--seed", "1"]) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("error: ") and "does not match the pinned sha256" in last
    assert [p.name for p in (cache_copy / "dense").iterdir()] == [REGISTRY[SMOL].sha256]


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["delete config.json", "truncate model.safetensors"])
def test_a_damaged_dense_copy_is_rebuilt_never_loaded(cache_copy, damage, capsys):
    from cactus_spec.loading.fetch import main_fetch
    from cactus_spec.loading.models import load_model

    dense = cache_copy / "dense" / REGISTRY[SMOL].sha256
    if damage == "delete config.json":
        (dense / "config.json").unlink()
        loaded = load_model(SMOL)  # repairs on load
        assert loaded.model.config.vocab_size == 49152
    else:
        weights = dense / "model.safetensors"
        os.truncate(weights, weights.stat().st_size // 2)
        assert main_fetch([SMOL]) == 0  # `models fetch` repairs it too
    err = capsys.readouterr().err
    assert "is damaged" in err
    # one bar of our own, none of transformers' (its GGUF reader's, its loading stages')
    assert f"converting {SMOL}.gguf: done" in err
    assert "de-quantizing" not in err and "Loading weights" not in err
    assert dense_copy_problem(dense) is None
    assert _no_temps(cache_copy)


@pytest.mark.slow
def test_a_truncated_gguf_by_path_names_expected_and_actual_size(cache_copy, tmp_path):
    from cactus_spec.loading.models import load_model

    source = cache_copy / "gguf" / f"{SMOL}.gguf"
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(source.read_bytes()[:50_000_000])
    message = f"truncated: its tensors need {REGISTRY[SMOL].size:,} bytes, the file has 50,000,000"
    with pytest.raises(CorruptModelError, match=message):
        load_model(truncated)
    assert _no_temps(cache_copy)


@pytest.mark.slow
@pytest.mark.parametrize("cut", [3000, None])
def test_a_gguf_with_a_damaged_header_is_called_corrupt(cache_copy, tmp_path, cut):
    source = (cache_copy / "gguf" / f"{SMOL}.gguf").read_bytes()
    damaged = tmp_path / "damaged.gguf"
    if cut is None:  # an absurd tensor count in the header
        damaged.write_bytes(source[:8] + b"\xff" * 8 + source[16:])
    else:
        damaged.write_bytes(source[:cut])
    with pytest.raises(CorruptModelError, match="is truncated or corrupt: its GGUF header"):
        check_gguf(damaged)
    with pytest.raises(CorruptModelError):
        ensure_dense_copy(damaged)


@pytest.mark.slow
def test_a_sound_gguf_passes_the_check(cache_copy):
    check_gguf(cache_copy / "gguf" / f"{SMOL}.gguf")  # negative control: no false alarm


def test_record_lists_every_file(empty_cache):
    dest = empty_cache / "d"
    _fake_copy(dest, {"a": b"1", "b": b"22"})
    files = json.loads((dest / COMPLETE_FILE).read_text())["files"]
    assert {name: entry["size"] for name, entry in files.items()} == {"a": 1, "b": 2}
