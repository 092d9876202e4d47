"""Every instruction-set level this CPU can run (``isa``): the native kernels built for each
lower level pass the kernel and block checks there, the AVX2 products are the bits of the
CPU's own, the engine's token-for-token checks hold on AVX2, and a level the CPU lacks or does
not exist is a one-line error naming what it has."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cactus_spec import isa
from cactus_spec.backends import native

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not native.available(), reason="the native kernels could not be built"),
]

TESTS = Path(__file__).parent
#: The levels below this CPU's own that it can run (each builds its own kernels, ~1 min).
LOWER = [level for level in isa.available() if level in ("avx2", "portable")]
#: What the int8 and int4 products take at each level.
SIMD = {"avx2": "AVX2", "portable": "portable C++"}

PRODUCTS = """
import sys, torch
from cactus_spec.backends import native
m = native.load()
g = torch.Generator().manual_seed(0)
out = {"simd": m.int_simd()}
for n, k in [(896, 896), (151, 200), (37, 101)]:
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale, sums = torch.rand(n, generator=g) / 100, w.sum(1, dtype=torch.int32)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    groups = (k + 63) // 64
    s4 = (torch.rand(n, groups, generator=g) / 100).half()
    low = (-torch.rand(n, groups, generator=g) / 20).half()
    packed4, scales4 = m.pack_int4(codes, s4, low)
    for rows in (1, 2, 3, 5, 11):
        x = torch.randn(rows, k, generator=g) * 3 + 0.5
        out[f"int8 {n}x{k} {rows}"] = m.int8_linear(x, m.pack_int8(w), scale, sums, None)
        out[f"int4 {n}x{k} {rows}"] = m.int4_linear(x, packed4, scales4, torch.zeros(n))
torch.save(out, sys.argv[1])
"""


def _at(level: str | None, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("CACTUS_SPEC_ISA",)}
    env |= {"CACTUS_SPEC_ISA": level} if level else {}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True)


@pytest.mark.parametrize("level", LOWER)
def test_kernels_and_blocks_pass_their_checks_at_each_lower_level(level) -> None:
    run = _at(level, "-m", "pytest", "-q", "-p", "no:cacheprovider",
              str(TESTS / "test_native.py"), str(TESTS / "test_native_block.py"))  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    passed = int(run.stdout.split(" passed")[0].split()[-1])
    assert passed >= 30, run.stdout  # every int8, int4 and block check (bf16 needs AVX512)


@pytest.mark.skipif("avx2" not in LOWER, reason="this CPU has no AVX2")
def test_avx2_products_are_the_bits_of_the_cpus_own(tmp_path) -> None:
    outputs = {}
    for level in (None, "avx2"):
        path = tmp_path / f"{level}.pt"
        run = _at(level, "-c", PRODUCTS, str(path))
        assert run.returncode == 0, run.stderr[-2000:]
        outputs[level] = torch.load(path)
    assert outputs["avx2"].pop("simd") == "AVX2"
    own = outputs[None].pop("simd")
    assert own != "AVX2" or isa.available()[0] == "avx2"
    for key, value in outputs[None].items():
        assert torch.equal(value, outputs["avx2"][key]), key


@pytest.mark.skipif("avx2" not in LOWER, reason="this CPU has no AVX2")
def test_the_engines_token_checks_hold_on_avx2() -> None:
    tests = [str(TESTS / name) for name in ("test_quant.py", "test_tree_decode.py")]
    run = _at("avx2", "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]


@pytest.mark.parametrize(
    ("level", "words"),
    [("avx3", "CACTUS_SPEC_ISA must be native or one of amx, avx512, avx2, portable"),
     *([("amx", "CACTUS_SPEC_ISA=amx: this CPU lacks amx_tile")]
       if "amx" not in isa.available() else [])],
)  # fmt: skip
def test_a_level_the_cpu_cannot_run_is_one_line_naming_what_it_has(level, words) -> None:
    cli = Path(sys.executable).with_name("cactus-spec")
    run = _at(level, str(cli), "generate", "hi", "--verifier", "no-such-model")
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], run.stderr


@pytest.mark.skipif(not isa.available(), reason="not an x86 CPU")
def test_the_levels_follow_the_cpus_flags() -> None:
    avx2 = frozenset({"avx2", "fma", "f16c"})
    assert isa.available(avx2) == ["avx2", "portable"]
    avx512 = avx2 | {"avx512f", "avx512bw", "avx512_vnni"}
    assert isa.available(avx512) == ["avx512", "avx2", "portable"]
    assert isa.available(avx2 - {"fma"}) == ["portable"]  # control: one flag missing


@pytest.mark.skipif("avx2" not in LOWER, reason="this CPU has no AVX2")
def test_the_command_lines_verifier_is_int8_without_bfloat16_arithmetic() -> None:
    code = "from cactus_spec.loading.models import resolve_verifier_quant as r; print(r('auto'))"
    assert _at("avx2", "-c", code).stdout.strip() == "int8"
    fast_bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert _at(None, "-c", code).stdout.strip() == ("none" if fast_bf16 else "int8")
