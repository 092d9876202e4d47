"""What ``backend="auto"`` runs the models on: our own kernels where they measure faster than
llama.cpp's, llama.cpp's (the ggml backend, over the GGUF files themselves) elsewhere.

Measured server against server, 2 threads, every prompt read (``docs/RESULTS.md``, "Speed
against peers, one client"), by the instruction set the process runs at (``isa.level``):

- ``amx``, ``avx512``: ours. Our AR decodes 1.32x / 0.92x llama.cpp plain and our Cactus
  2.81x / 1.65x, where ggml's AR reads 1.02x and its speculation less.
- ``avx2``: ggml where nothing is drafted by a model, ours where a draft model drafts. ggml's
  AR is 0.95x llama.cpp plain against our 0.81x (a Q4_K_M forward reads 1.0 GB, our int8 one
  1.5 GB); but an 11-token Q4_K_M block costs 4.77 of its AR steps, so speculation cannot
  pay through ggml there (0.89x with the policy's K), and on our kernels it does not lose
  (Cactus 0.99x).
- no x86 level (ARM, or ``CACTUS_SPEC_ISA=portable``): ggml, whose NEON kernels are built
  for the CPU, where ours are portable C++ (about 6x slower than AVX2 on the head).

ggml is taken only where it runs what was asked as asked: llama-cpp-python installed (with a
build for the level a process is held to), both models GGUF files (a known name or a
``.gguf`` path), the CPU, no draft trees, and no option that changes the weights of ours: a
verifier quantisation left to ``auto`` (the command line's default; the library's ``none``
asks for the dense model's law), and no draft quantisation, cut draft head or dtype given.
Otherwise ``auto`` stays ours (lean, or transformers for a model lean lacks), and the reason
names what kept ggml out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from cactus_spec import isa
from cactus_spec.backends import ggml
from cactus_spec.loading.gguf import check_gguf_source

#: Levels where our kernels are the faster ones whatever is drafted.
_OURS = ("amx", "avx512")
#: The options that ask for weights of ours, which ggml leaves as the GGUF stores them.
_OUR_WEIGHTS = ("draft_quant", "draft_vocab", "dtype")


@dataclass(frozen=True)
class BackendChoice:
    """``backend``: ``auto`` (ours) or ``ggml``; ``why``: one line saying so."""

    backend: str
    why: str


def choose_backend(level: str, drafts: bool, blocker: str | None) -> BackendChoice:
    """The module docstring's rule at instruction set ``level`` (``isa.level``), a draft
    model drafting or not; ``blocker``: what keeps ggml from running what was asked (None:
    nothing)."""
    if level in _OURS:
        return BackendChoice("auto", f"our kernels: on {level} they measure faster than ggml")
    if level == "avx2" and drafts:
        return BackendChoice(
            "auto", "our kernels: on avx2 speculation pays on them, not through ggml"
        )
    where = (
        "on avx2 with nothing drafted by a model"
        if level == "avx2"
        else "where our kernels are portable C++"
    )
    if blocker is not None:
        return BackendChoice("auto", f"our kernels: {where} ggml measures faster, but {blocker}")
    return BackendChoice("ggml", f"ggml: {where} llama.cpp's kernels measure faster than ours")


def auto_backend(given: Mapping[str, object], drafts: bool, trees: bool) -> BackendChoice:
    """``choose_backend`` for this process (its level, llama.cpp's library) and the loading
    options ``given`` (by key, as ``loading.options.parse_load`` reads them; absent or None:
    not given), a draft model drafting or not, draft trees or not."""
    level = isa.level()
    if level not in isa.ISAS:  # off x86
        level = "portable"
    return choose_backend(level, drafts, _blocker(given, trees))


def _blocker(given: Mapping[str, object], trees: bool) -> str | None:
    """What keeps ggml from running what ``given`` asks, or None."""
    if not ggml.available():
        return f"llama-cpp-python is not installed ({ggml.INSTALL_HINT})"
    held = isa.chosen()
    if held != "native" and ggml.held_library(held) is None:
        return f"llama.cpp has no build for {held} (make ggml-{held})"
    if trees:
        return "draft trees need token-tree attention, which ggml lacks"
    if str(given.get("device") or "cpu") != "cpu":
        return f"device {given['device']} was asked"
    quant = given.get("verifier_quant", "none")  # parse_load's default: the dense law
    if quant != "auto":
        return f"verifier_quant is {quant}, not auto"
    asked = [key for key in _OUR_WEIGHTS if given.get(key) is not None]
    if asked:
        return f"{asked[0]} {given[asked[0]]} was asked"
    for key in ("verifier", "draft"):
        source = given.get(key)
        try:
            if source is not None:
                check_gguf_source(source, key)  # type: ignore[arg-type]
        except (ValueError, TypeError):
            return f"the {key} is not a GGUF file"
    return None
