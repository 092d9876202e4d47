"""How far a quantised verifier's next-token law is from its bfloat16 original, on real text.

A quantised verifier changes the law every method's output follows: from q (bfloat16) to
q_quant. Quantised by us (int8, int4), its original is the same model in bfloat16; run by
llama.cpp (the ggml backend, a GGUF of type Q4_K_M, Q4_1, ...), its original is the dense
bfloat16 copy of the same file that the lean backend runs (the same dequantised weights:
what differs is llama.cpp's arithmetic on its own blocks). This measures, teacher-forced
along a fixed real text (Python source code), the mean per position

    KL(q_quant || q)  in nats per token, at temperature 1,

the direction of the engine's divergence meter (the law the output follows first), so it can
be read beside Cactus's own KL. It is measured in the two regimes the engine runs: one token
per forward (decoding) and blocks of ``block`` tokens (verification), since a block's rows
are quantised together. Argmax agreement is reported too.

Measuring loads the reference and costs about a minute for the 1.5B verifier, so results are
cached in ``divergence.json`` of the model cache, keyed by what they depend on (the model's
sha256, the format, the text, the block size, torch and the kernels of both sides).
"""

from __future__ import annotations

import hashlib
import json
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from cactus_spec.backends.base import Backend
from cactus_spec.backends.ggml import GgufModel, ggml_kernel
from cactus_spec.backends.packed import bf16_kernel
from cactus_spec.backends.quant import int4_kernel, quant_kernel
from cactus_spec.core.audit import kl
from cactus_spec.files import write_json_atomic
from cactus_spec.loading.backend import make_backend
from cactus_spec.loading.models import LoadedModel, load_model
from cactus_spec.paths import cache_dir

#: Tokens of context before the first measured position, and tokens measured.
PREFIX_TOKENS = 16
MEASURED_TOKENS = 256
#: The verification block the engine uses by default: K = 10 drafts plus the last token.
DEFAULT_BLOCK = 11
REFERENCE_DTYPE = "bfloat16"


@dataclass(frozen=True)
class Divergence:
    """KL(q_quant || q_reference) in nats per token and argmax agreement, per regime."""

    quant: str
    reference: str
    tokens: int
    block: int
    kl_one_row: float
    kl_block: float
    agreement_one_row: float
    agreement_block: float

    @property
    def kl_worst(self) -> float:
        """The larger of the two regimes' KL: the figure to quote."""
        return max(self.kl_one_row, self.kl_block)

    def as_dict(self) -> dict:
        return {**asdict(self), "kl_worst": self.kl_worst}


def reference_text() -> str:
    """Real text for the measurement: the source of Python's ``textwrap`` module."""
    with open(textwrap.__file__, encoding="utf-8") as f:
        return f.read()


def teacher_forced_logits(backend: Backend, token_ids: Sequence[int], block: int) -> torch.Tensor:
    """Logits predicting tokens PREFIX_TOKENS+1 .. of ``token_ids``, fed ``block`` tokens per
    forward after a prefix of PREFIX_TOKENS: [N - PREFIX_TOKENS, V]."""
    backend.reset()
    backend.append(token_ids[:PREFIX_TOKENS], keep=1)
    rows = []
    for start in range(PREFIX_TOKENS, len(token_ids), block):
        rows.append(backend.append(token_ids[start : start + block]))
    backend.reset()
    return torch.cat(rows)


def compare(
    reference: Backend, candidate: Backend, token_ids: Sequence[int], block: int
) -> dict[str, float]:
    """Mean KL(candidate || reference) and argmax agreement over ``token_ids``, fed
    ``block`` tokens per forward to both (the reference's own blocks cannot matter
    beyond rounding, so the regime is the candidate's)."""
    ref = teacher_forced_logits(reference, token_ids, block).float()  # [N, V]
    cand = teacher_forced_logits(candidate, token_ids, block).float()  # [N, V]
    width = min(ref.shape[-1], cand.shape[-1])
    ref, cand = ref[:, :width], cand[:, :width]
    divergence = kl(cand.softmax(-1), ref.softmax(-1))  # [N]
    agreement = (cand.argmax(-1) == ref.argmax(-1)).double()  # [N]
    return {"kl": float(divergence.mean()), "agreement": float(agreement.mean())}


def measure(
    reference: Backend,
    candidate: Backend,
    token_ids: Sequence[int],
    quant: str,
    block: int = DEFAULT_BLOCK,
) -> Divergence:
    """The divergence of ``candidate`` from ``reference`` in both regimes."""
    one = compare(reference, candidate, token_ids, 1)
    blocks = compare(reference, candidate, token_ids, block)
    return Divergence(
        quant=quant,
        reference=REFERENCE_DTYPE,
        tokens=len(token_ids) - PREFIX_TOKENS,
        block=block,
        kl_one_row=one["kl"],
        kl_block=blocks["kl"],
        agreement_one_row=one["agreement"],
        agreement_block=blocks["agreement"],
    )


def _cache_key(loaded: LoadedModel, token_ids: Sequence[int], block: int) -> str:
    """What a measurement depends on, the weight format named (int8, Q4_K_M, ...)."""
    text = hashlib.sha256(json.dumps(list(token_ids)).encode()).hexdigest()[:16]
    model = f"{loaded.sha256 or loaded.identity}|{loaded.weight_format}"
    return f"{model}|{_kernels(loaded)}|torch {torch.__version__}|{text}|{block}"


def _kernels(loaded: LoadedModel) -> str:
    """The kernels measuring ``loaded`` runs: its own (ours or llama.cpp's), the reference's."""
    if isinstance(loaded.model, GgufModel):
        return f"{ggml_kernel()}|bf16 {bf16_kernel()}"
    return f"{quant_kernel()}|{int4_kernel()}|bf16 {bf16_kernel()}"


def _read_cache() -> dict:
    try:
        data = json.loads((cache_dir() / "divergence.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def quant_divergence(loaded: LoadedModel, block: int = DEFAULT_BLOCK) -> Divergence | None:
    """The measured divergence of a quantised model (int8, int4, or a GGUF llama.cpp runs)
    from its bfloat16 original (None for an unquantised one), from the cache or measured now
    (loading the original once)."""
    weights = loaded.weight_format
    if weights == "none":
        return None
    if loaded.tokenizer is None or not Path(loaded.identity).exists():
        raise ValueError(
            "measuring a quantised model's divergence needs its tokenizer and the file or "
            f"directory it was loaded from; {loaded.identity!r} has not both"
        )
    ids = loaded.tokenizer(reference_text()).input_ids[: PREFIX_TOKENS + MEASURED_TOKENS]
    key = _cache_key(loaded, ids, block)
    cached = _read_cache().get(key)
    if isinstance(cached, dict):
        try:
            return Divergence(**{k: v for k, v in cached.items() if k != "kl_worst"})
        except TypeError:
            pass  # an entry of another layout: measure again
    print(
        f"measuring the {weights} verifier's divergence from {REFERENCE_DTYPE} "
        f"(once per model; about a minute)...",
        file=sys.stderr,
    )
    reference = load_model(loaded.identity, dtype=REFERENCE_DTYPE, device=loaded.device)
    result = measure(make_backend(reference), make_backend(loaded), ids, weights, block)
    cache = _read_cache()
    cache[key] = result.as_dict()
    cache_dir().mkdir(parents=True, exist_ok=True)
    write_json_atomic(cache_dir() / "divergence.json", cache)
    return result
