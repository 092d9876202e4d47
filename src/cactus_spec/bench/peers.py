"""Hugging Face transformers' own decoding: the peer a user would pick today.

- ``hf``: ``model.generate(do_sample=True)`` on the verifier alone.
- ``hf_assisted``: ``generate(assistant_model=draft, do_sample=True)``, Hugging Face's
  speculative sampling, with ``num_assistant_tokens = K`` on a constant schedule; with the
  n-gram drafter, ``prompt_lookup_num_tokens = K`` (Hugging Face's prompt lookup). Its
  other defaults stay as a user gets them (e.g. the assistant's confidence early stop).

Both use the same prompt ids, temperature, top-k and top-p as the engine (temperature 0:
greedy), and stop at the model's generation-config EOS. The seed goes to torch's global
generator, so runs repeat but do not share random numbers with the engine.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.utils import logging as hf_logging

from cactus_spec.bench.grid import Config
from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.loading.models import LoadedModel


@dataclass(frozen=True)
class PeerResult:
    """New token ids (EOS included when reached) and the wall time of ``generate``."""

    token_ids: list[int]
    seconds: float


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence Hugging Face's per-call deprecation and generation warnings."""
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


@contextlib.contextmanager
def _assistant_settings(assistant: PreTrainedModel, k: int) -> Iterator[None]:
    """K drafts per iteration on a constant schedule, restored afterwards (Hugging Face
    reads these from the assistant's own generation config)."""
    config = assistant.generation_config
    saved = (config.num_assistant_tokens, config.num_assistant_tokens_schedule)
    config.num_assistant_tokens, config.num_assistant_tokens_schedule = k, "constant"
    try:
        yield
    finally:
        config.num_assistant_tokens, config.num_assistant_tokens_schedule = saved


def _sampling_kwargs(sampling: SamplingConfig) -> dict:
    if sampling.greedy:
        return {"do_sample": False}
    return {
        "do_sample": True,
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
    }


def _pad_id(model: PreTrainedModel) -> int | None:
    """The padding id generate wants: the configured one, else the (first) EOS id."""
    config = model.generation_config
    if config.pad_token_id is not None:
        return config.pad_token_id
    eos = config.eos_token_id
    return eos[0] if isinstance(eos, list) else eos


def hf_generate(
    config: Config,
    verifier: LoadedModel,
    draft: LoadedModel | None,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingConfig,
    seed: int,
) -> PeerResult:
    """Run one ``hf`` or ``hf_assisted`` configuration on one prompt."""
    model = verifier.transformers("the hf peers")
    ids = torch.tensor([list(prompt_ids)], device=model.device)  # [1, L]
    kwargs = _sampling_kwargs(sampling)
    settings: contextlib.AbstractContextManager = contextlib.nullcontext()
    if config.prompt_lookup:
        kwargs["prompt_lookup_num_tokens"] = config.num_draft_tokens
    elif config.method == "hf_assisted":
        if draft is None:
            raise ValueError(f"hf_assisted with the {config.drafter} drafter needs a draft model")
        kwargs["assistant_model"] = assistant = draft.transformers("hf_assisted")
        assert config.num_draft_tokens is not None  # a peer's K is given (auto is refused)
        settings = _assistant_settings(assistant, config.num_draft_tokens)
    torch.manual_seed(seed)
    with _quiet(), settings, torch.inference_mode():
        start = time.perf_counter()
        # a causal LM: its class mixes in GenerationMixin, which PreTrainedModel's types lack
        out = model.generate(  # type: ignore[operator]
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            pad_token_id=_pad_id(model),
            **kwargs,
        )
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return PeerResult(out[0, ids.shape[1] :].tolist(), seconds)
