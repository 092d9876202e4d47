"""lm-eval's model args and gen_kwargs, turned into the engine's settings.

lm-eval hands model args as text or already typed ("1.0" -> 1.0, "true" -> True, "none" ->
None): each converter accepts both, and a bad value is a one-line ValueError naming the arg
and its allowed values. Generation requests become (sampling, budget, stop strings), and
request i of a run with seed s decodes with ``request_seed(s, i)``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from typing import Any

import torch
from lm_eval.models.utils import normalize_gen_kwargs

from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.core.spec import SPEC_KEYS
from cactus_spec.loading.models import LoadedModel
from cactus_spec.loading.options import LOAD_KEYS

log = logging.getLogger(__name__)

#: Tokens generated when a task's gen_kwargs give no max_gen_toks (lm-eval's HFLM default).
DEFAULT_MAX_GEN_TOKS = 256
#: The gen_kwargs keys the engine honours; any other key is ignored with a warning.
GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")
_GREEDY = SamplingConfig(0.0, 0, 1.0)


def _bad(name: str, allowed: str, value: object) -> ValueError:
    return ValueError(f"{name} must be {allowed}, got {value!r}")


def integer(name: str, value: object, low: int, high: int | None = None) -> int:
    """``value`` (an int, an integral float or its text) as an int in [low, high]."""
    number = as_int(value)
    if number is None or number < low or (high is not None and number > high):
        allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        raise _bad(name, allowed, value)
    return number


def as_int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    try:
        return int(str(value).strip())
    except ValueError:
        return None


def spec_args(given: dict[str, Any]) -> dict[str, Any]:
    """The decoding spec's model args (method, its parameters, num_draft_tokens, drafter),
    for ``core.spec.parse_spec``; an unknown model arg is a ValueError listing those that
    exist."""
    for name in given:
        if name not in SPEC_KEYS:
            known = sorted({*_MODEL_ARGS, *SPEC_KEYS})
            raise ValueError(f"unknown model arg {name!r}; model args: {', '.join(known)}")
    return given


_MODEL_ARGS = (*LOAD_KEYS, "max_batch", "max_length", "seed")


def load_args(given: dict[str, Any]) -> dict[str, Any]:
    """The loading options' model args for ``loading.options.parse_load``, with a model
    name that lm-eval read as a number (``verifier=7``) turned back into its text."""
    return {
        key: str(value) if key in ("verifier", "draft") and _is_number(value) else value
        for key, value in given.items()
    }


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def device_for(device: object) -> str:
    """lm-eval's --device (it defaults to cuda:0): cpu when none is given or CUDA is absent."""
    if device is None:
        return "cpu"
    name = str(device)
    if name.startswith("cuda") and not torch.cuda.is_available():
        log.warning("device %s: CUDA is not available, running on cpu", name)
        return "cpu"
    return name


def ignore_batch_size(batch_size: object, max_batch_size: object) -> None:
    if batch_size not in (None, 1, "1") or max_batch_size is not None:
        log.info("lm-eval's batch sizes are ignored: model arg max_batch sets the rows")


def describe(source: object) -> str | None:
    if source is None or isinstance(source, str):
        return source
    if isinstance(source, LoadedModel):
        return source.identity
    return type(source).__name__


# --- requests -----------------------------------------------------------------------------


def request_seed(seed: int, index: int) -> int:
    """The seed of the ``index``-th request of a run with model arg ``seed``: the first 8
    bytes of sha256("seed:index"), so requests (and runs with other seeds) draw apart."""
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def parse_gen_kwargs(gen_kwargs: dict) -> tuple[SamplingConfig, int, tuple[str, ...]]:
    """lm-eval's gen_kwargs -> (sampling, max new tokens, stop strings).

    Greedy when do_sample is false or temperature is 0; otherwise temperature (1 when only
    do_sample is given), top_k (0 = off) and top_p (1 = off) as given, nothing else
    (no hidden top-k). Keys other than ``GEN_KWARGS`` are ignored with a warning."""
    kwargs = normalize_gen_kwargs(dict(gen_kwargs), DEFAULT_MAX_GEN_TOKS)
    ignored = tuple(sorted(set(kwargs) - set(GEN_KWARGS)))
    if ignored:
        _warn_ignored(ignored)
    max_new = kwargs["max_gen_toks"]
    if max_new < 1:
        raise ValueError(f"gen_kwargs max_gen_toks must be >= 1, got {max_new}")
    until = tuple(str(s) for s in kwargs["until"] if s)
    temperature = kwargs.get("temperature")
    if not kwargs["do_sample"] or temperature == 0:
        return _GREEDY, max_new, until
    top_k = as_int(kwargs.get("top_k", 0))
    if top_k is None:
        raise ValueError(f"gen_kwargs top_k must be an integer >= 0, got {kwargs['top_k']!r}")
    top_p = kwargs.get("top_p")
    sampling = SamplingConfig(
        1.0 if temperature is None else float(temperature),
        top_k,
        1.0 if top_p is None else float(top_p),
    )
    return sampling, max_new, until


@functools.cache
def _warn_ignored(keys: tuple[str, ...]) -> None:
    log.warning("gen_kwargs %s are not supported by cactus-spec and are ignored", keys)
