"""Native kernels for the decode hot path of int8, int4 and bfloat16 models, compiled for
this CPU at set-up.

``int8_linear(x, packed, scale, code_sums, bias)``: y = x W^T + b for a few rows x [M, K]
(float32) against int8 weights (``pack_int8`` of w [N, K]) with per-row scales,
W[n] ~ scale[n] w[n]. Each input row is quantised to uint8 on its own range,
x[r] ~ lo[r] + step[r] u[r] with u in 0..255, so that

    y[r, n] = scale[n] (step[r] <u[r], w[n]> + lo[r] sum_k w[n, k]) + b[n],

the integer dot product exact in int32 (AMX tiles for blocks of rows where the CPU has
them, AVX512-VNNI's vpdpbusd for one row, AVX-VNNI's vpdpbusd or AVX2's vpmaddubsw on 256
bits, plain C++ elsewhere; computed centred, see int8_linear.cpp). Unlike a GEMM library it
reads the weight once per call whatever the rows and quantises the rows inside the call,
which is where a one-token draft step spent its time.

``int4_linear(x, packed, scales, bias)``: y = x W^T + b against 4-bit weights in groups of
64 inputs, W[n, k] ~ low[n, g] + s[n, g] c[n, k] (``pack_int4`` of codes c [N, K] in 0..15
and float16 s, low [N, G]), each input row quantised symmetrically to int8, x[r] ~ step[r]
v[r]:

    y[r, n] = step[r] sum_g (s[n, g] <v[r], c[n]>_g + low[n, g] sum_{k in g} v[r, k]) + b[n],

each group's sums exact in int32 (AVX512-VNNI, AVX-VNNI or AVX2, plain C++ elsewhere; see
int4_linear.cpp):
half the weight bytes of int8, for the one-row draft step.

``bf16_linear(x, packed, bias)``: y = x W^T + b in bfloat16 (``pack_bf16`` of w [N, K]), the
sums in float32 on AMX tiles (``has_amx()``), else on AVX512-BF16 (see bf16_linear.cpp),
streaming the weight faster than oneDNN's bfloat16 products at one row.

``int8_block(...)``, ``int4_block(...)``, ``bf16_block(...)``: a whole Qwen2/Llama decoder
block of such layers over the lean KV cache in one call (``backends.native_block``), since a
Python block's small tensor operations cost more than its products at one token.

The extension is built with torch's C++ toolchain (a C++ compiler and ninja) into
``$CACTUS_SPEC_CACHE/native/<key>``, the key naming the CPU's flags and torch's version, so
a cache shared between machines never runs code compiled for another CPU; later processes
load it in a fraction of a second. ``CACTUS_SPEC_NATIVE=0`` turns it off; without a
compiler it is off, and callers fall back to torch's kernels (``available()`` says which).
``CACTUS_SPEC_ISA`` builds (and keys) them for a lower level than the CPU's (``isa``): at
``avx512`` without AMX tiles (the int8 kernel then takes VNNI for blocks of rows too); at
``avx2`` the int8 and int4 products take their AVX2 path (AVX-VNNI where the compiler targets
it), which gives the same bits as the AVX512 one. One header, ``simd.h``, decides from the
compiler's target which SIMD every kernel compiles (``int_simd()`` names the int8 and int4 path).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import warnings
from pathlib import Path
from types import ModuleType

import torch

from cactus_spec import isa
from cactus_spec.paths import cache_dir

_HERE = Path(__file__).parent
_SOURCE_NAMES = (
    "amx.cpp", "int8_linear.cpp", "int4_linear.cpp", "bf16_linear.cpp", "block.cpp", "bindings.cpp",
)  # fmt: skip
SOURCES = tuple(_HERE / name for name in _SOURCE_NAMES)
HEADERS = tuple(_HERE / name for name in ("simd.h", "lanes.h", "amx.h", "linear.h", "block.h"))
#: -fopenmp: at::parallel_for runs on torch's own OpenMP runtime (the same libgomp, loaded
#: once); -ffp-contract=off: each float operation rounds as written (no fused multiply-adds);
#: the target is the level ``isa`` holds this process to (the CPU's own: -march=native).
FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")


def compiler_flags() -> tuple[str, ...]:
    """The flags the kernels are built with at this process's level (``isa.chosen``)."""
    return (*FLAGS, *isa.COMPILER_FLAGS[isa.chosen()])


def _cpu_key() -> str:
    """A short hash of what the compiled code depends on: CPU flags, torch, the sources, and
    where they are (the build names their paths: two checkouts sharing one build would
    rebuild it in turn, each waiting on the other's lock)."""
    cpu = " ".join(sorted(isa.cpu_flags())) or platform.processor()
    sources = [str(_HERE), *(s.read_text() for s in SOURCES + HEADERS)]
    parts = [cpu, torch.__version__, *compiler_flags(), *sources]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


@functools.cache
def load() -> ModuleType | None:
    """The compiled extension, building it on first use; None when turned off or unbuildable
    (with a warning that says why)."""
    if os.environ.get("CACTUS_SPEC_NATIVE", "1") == "0":
        return None
    from torch.utils import cpp_extension

    level = isa.chosen()
    build = cache_dir() / "native" / f"{level}-{_cpu_key()}"
    build.mkdir(parents=True, exist_ok=True)
    try:
        return cpp_extension.load(
            name=f"cactus_spec_native_{level}",
            sources=[str(s) for s in SOURCES],
            extra_cflags=list(compiler_flags()),
            build_directory=str(build),
            verbose=False,
        )
    except (OSError, RuntimeError, ImportError) as exc:
        warnings.warn(
            f"native kernels unavailable ({str(exc).splitlines()[0]}); "
            "using torch's int8 kernel (set CACTUS_SPEC_NATIVE=0 to silence this)",
            stacklevel=2,
        )
        return None


def available() -> bool:
    """Whether the native kernels are in use."""
    return load() is not None


def loaded() -> ModuleType:
    """The compiled extension, for callers that checked ``available()``."""
    kernels = load()
    assert kernels is not None, "the native kernels are not available"
    return kernels
