"""Int8 weights for every linear layer: fbgemm's dynamic int8 GEMM, per-channel weight scales.

A weight row c is stored as q_w[c] = round(W[c] / s_w[c]) in int8, s_w[c] = max|W[c]| / 127;
each call quantises its input x with one scale s_x for the whole [.., E] block (computed on
the fly) and returns  y[c] = s_x s_w[c] (q_x . q_w[c]) + b[c]  in float32. On this project's
CPUs a one-row product is ~3x faster than bfloat16 and an 11-row block ~10x (the float
GEMMs are compute-bound for blocks without native bfloat16), so the draft is int8 by
default: the output law depends only on the verifier, so SpS stays exact with it.

torch.ao's ``quantize_dynamic`` does the work; the model runs in float32 around it.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from transformers import PreTrainedModel

QUANTS = ("none", "int8")


def check_quant(quant: object, name: str = "quant") -> str:
    """``quant`` if it is one of QUANTS, else ValueError naming ``name``."""
    if quant not in QUANTS:
        raise ValueError(f"{name} must be one of {', '.join(QUANTS)}, got {quant!r}")
    return quant


def quantize_int8(model: PreTrainedModel) -> PreTrainedModel:
    """Replace every nn.Linear of ``model`` (in place) by a dynamic int8 linear with
    per-channel weight scales; the rest of the model becomes float32."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    model.float()
    with warnings.catch_warnings():  # torch.ao announces its move to torchao
        warnings.simplefilter("ignore")
        quantize_dynamic(
            model, {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True
        )
    return model
