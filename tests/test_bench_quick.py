"""`cactus-spec bench --quick` on the real SmolLM2-135M: the CI check that the harness
runs end to end and writes every output file (about a minute on two CPU cores)."""

from __future__ import annotations

import json
import time

import pytest
from test_bench_run import OUTPUTS

from cactus_spec.cli import main

pytestmark = pytest.mark.slow


def test_quick_bench_writes_every_output(tmp_path, capsys) -> None:
    from cactus_spec.loading.fetch import fetch

    fetch("smollm2-135m")
    start = time.perf_counter()
    assert main(["bench", "--quick", "--out", str(tmp_path), "--no-progress"]) == 0
    print(f"bench --quick took {time.perf_counter() - start:.0f} s")
    for name in OUTPUTS:
        assert (tmp_path / name).stat().st_size > 0, name
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["scored"] and summary["n_items"] == 4
    assert all(c["n"] == 4 for c in summary["configs"])
    methods = {c["method"] for c in summary["configs"]}
    assert {"ar", "hf", "hf_assisted", "sps", "tas", "cactus"} <= methods
    assert summary["run"]["models"]["target"]["sha256"]
    assert "## Accuracy" in capsys.readouterr().out
