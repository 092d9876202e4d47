"""The instruction set cactus-spec runs on: the CPU's own, or a lower one it is held to.

``CACTUS_SPEC_ISA`` names a level (``ISAS``) on an x86 CPU that has it: ``amx`` (AMX tiles
and AVX512), ``avx512`` (AVX512-VNNI, and AVX512-BF16 where the CPU has it; no AMX),
``avx2`` (AVX2 with FMA and F16C: what most laptops and desktops run) or ``portable`` (plain
C++ for the native kernels). Unset, or ``native``, is the CPU's own. Held to a level, the
native kernels are built for it (``native.load``: its own build, its own compiler flags),
torch's kernels are held to it too (``ATEN_CPU_CAPABILITY`` and ``ONEDNN_MAX_CPU_ISA``, set
when ``cactus_spec`` is imported unless already set: import it before torch runs anything),
and every choice that reads the CPU (the verifier's dtype, the int8 path, the policy's costs,
which are timed) reads ``allows`` instead, so a run held to AVX2 on a larger machine behaves
as an AVX2 CPU would, at that machine's memory speed. A level the CPU lacks, or a name not
in ``ISAS``, is a ValueError naming what the CPU has.

An ARM CPU builds its native kernels for itself (``-march=native``) and takes the portable
C++ path of every kernel; a NEON path would be one more ``#elif`` beside each AVX2 one (16
bytes a vector: ``vdotq_s32`` where the CPU has the dot-product extension for the int8 and
int4 sums, exact in int32 as the others) and one more level here.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

#: Levels a run may be held to, highest first.
ISAS = ("amx", "avx512", "avx2", "portable")
#: The CPU flags (/proc/cpuinfo) a level needs.
NEEDS: dict[str, tuple[str, ...]] = {
    "amx": ("amx_tile", "amx_int8", "amx_bf16", "avx512bw", "avx512_vnni"),
    "avx512": ("avx512f", "avx512bw", "avx512_vnni"),
    "avx2": ("avx2", "fma", "f16c"),
    "portable": (),
}
#: Compiler flags of the native kernels per level (beside -O3 and the rest).
COMPILER_FLAGS: dict[str, tuple[str, ...]] = {
    "native": ("-march=native",),
    "amx": ("-march=native",),
    "avx512": ("-march=native", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"),
    "avx2": ("-march=haswell", "-mtune=native"),
    "portable": ("-march=x86-64", "-mtune=native"),
}
#: torch's own kernels per level: (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA).
_TORCH = {
    "avx512": ("avx512", "AVX512_CORE_BF16"),
    "avx2": ("avx2", "AVX2"),
    "portable": ("default", "SSE41"),
}


@functools.cache
def _cpuinfo() -> list[str]:
    """The lines of /proc/cpuinfo, read once (none where it is not there)."""
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def _cpuinfo_field(*names: str) -> str | None:
    """The value of the first /proc/cpuinfo line naming one of ``names``."""
    line = next((x for x in _cpuinfo() if x.startswith(names)), None)
    return None if line is None else line.partition(":")[2].strip()


def cpu_flags() -> frozenset[str]:
    """The CPU's flags as /proc/cpuinfo lists them (none where it is not there)."""
    return frozenset((_cpuinfo_field("flags", "Features") or "").split())


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform says."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def available(flags: frozenset[str] | None = None) -> list[str]:
    """The levels this CPU can run (``portable`` only off x86)."""
    flags = cpu_flags() if flags is None else flags
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    return [isa for isa in ISAS if all(f in flags for f in NEEDS[isa])]


@functools.cache
def chosen() -> str:
    """The level of this process: ``CACTUS_SPEC_ISA``, checked, else ``native``."""
    name = os.environ.get("CACTUS_SPEC_ISA", "native").strip().lower() or "native"
    if name == "native":
        return name
    have = available()
    if name not in ISAS:
        raise ValueError(
            f"CACTUS_SPEC_ISA must be native or one of {', '.join(ISAS)}, got {name!r} "
            f"(this CPU has: {', '.join(have) or 'none of them'})"
        )
    if name not in have:
        missing = [f for f in NEEDS[name] if f not in cpu_flags()]
        raise ValueError(
            f"CACTUS_SPEC_ISA={name}: this CPU lacks {', '.join(missing) or 'x86'}; "
            f"it has: {', '.join(have) or 'none of them'}"
        )
    return name


def level() -> str:
    """The level this process runs at by name: the chosen one, or for ``native`` the highest
    the CPU has (``native`` itself off x86)."""
    name = chosen()
    return (available() or [name])[0] if name == "native" else name


def allows(flag: str) -> bool:
    """Whether code of this process may use the CPU feature ``flag`` (a /proc/cpuinfo name):
    the CPU has it and the chosen level includes it."""
    if flag not in cpu_flags():
        return False
    level = chosen()
    if level in ("native", "amx"):
        return True
    if level == "avx512":  # whatever AVX512 the CPU has, no AMX
        return not flag.startswith("amx")
    return flag in {f for isa in ISAS[ISAS.index(level) :] for f in NEEDS[isa]}


def hold_torch() -> None:
    """Hold torch's kernels to the chosen level, where the caller has not set them."""
    name = os.environ.get("CACTUS_SPEC_ISA", "").strip().lower()
    if name in _TORCH:
        capability, onednn = _TORCH[name]
        os.environ.setdefault("ATEN_CPU_CAPABILITY", capability)
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", onednn)
