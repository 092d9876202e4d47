"""The lm-evaluation-harness backend: ``--model cactus-spec`` evaluates our engine.

``generate_until`` decodes through the engine (``decode_many``: continuous batching over
``max_batch`` rows, each request with its own seed, sampling and stop strings).
``loglikelihood`` and ``loglikelihood_rolling`` score with the verifier alone: speculation
changes how tokens are produced, never the verifier's likelihoods.

lm-eval 0.4.13 finds models only in its own registry (no entry points), so importing this
module registers ``CactusSpecLM`` as ``cactus-spec``, and ``main(argv)`` runs lm-eval's own
command line with it registered (``cactus-spec lm-eval run --model cactus-spec ...``).
Only this module and ``args`` (model args and gen_kwargs) import lm_eval, and only the
command line's hook imports this module.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
import lm_eval.models  # noqa: F401 - lm-eval's models first: it imports them only into an empty registry
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from cactus_spec.core.methods import (
    DEFAULT_METHOD,
)
from cactus_spec.core.sampling import MAX_SEED
from cactus_spec.core.spec import parse_spec
from cactus_spec.lm_eval import args as lm_eval_args
from cactus_spec.loading.models import ModelSource
from cactus_spec.loading.options import parse_load
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.runtime.generation import GenerationResult, Request

__all__ = ["CactusSpecLM", "main"]

log = logging.getLogger(__name__)

#: Rows decoded (and scored) at once unless ``max_batch`` says otherwise.
DEFAULT_MAX_BATCH = 8
#: Tokens scored per forward: bounds the float32 logits held at once ([SCORE_CHUNK, V]).
SCORE_CHUNK = 256


@dataclass(frozen=True)
class _Window:
    """One scoring item: the verifier reads ``prefix`` then ``continuation[:-1]`` and scores
    ``continuation``; ``key`` is what lm-eval's cache records (None: not recorded)."""

    key: tuple | None
    prefix: tuple[int, ...]
    continuation: list[int]


@register_model("cactus-spec")
class CactusSpecLM(TemplateLM):
    """An lm-eval model over ``SpeculativeDecoder``: ``generate_until`` decodes with the
    method, ``loglikelihood`` and ``loglikelihood_rolling`` score with the verifier alone
    (speculation never changes the verifier's likelihoods, so they are the method's too).

    Model args (lm-eval's ``--model_args key=value,...``; strings are converted, a bad one
    is a one-line ValueError naming it and its allowed values): ``verifier`` (default the
    default pair's verifier), ``draft`` (default the default pair's draft, when the method
    drafts with a model), ``method`` (``core.methods.METHODS``) and its parameters (delta,
    exact, epsilon, alpha, k), ``num_draft_tokens``, ``drafter`` (``core.drafters.DRAFTERS``),
    read by ``core.spec.parse_spec`` as the command line's flags are; ``max_batch``
    (rows decoded and scored at once), ``max_length`` (the longest window the verifier
    reads; default its cache's context length), ``backend``, ``verifier_quant`` (``auto``
    as on the command line), ``draft_quant``, ``draft_vocab`` (the draft head's most
    frequent tokens kept), ``dtype``, ``threads``, read with the models by
    ``loading.options.parse_load`` as the command line's flags are (a draft or a draft
    vocabulary where nothing is drafted by a model is refused), ``seed`` (request i is decoded with
    ``lm_eval_args.request_seed(seed, i)``). lm-eval's ``device`` picks the device (cpu
    when CUDA is absent); its ``batch_size`` and ``max_batch_size`` are ignored
    (``max_batch`` sets the rows). ``verifier`` and ``draft`` may also be a ``LoadedModel``
    or ``PreTrainedModel``.
    """

    def __init__(
        self,
        verifier: ModelSource | None = None,
        draft: ModelSource | None = None,
        method: str = DEFAULT_METHOD,
        num_draft_tokens: int | None = None,
        drafter: str | None = None,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_length: int | None = None,
        backend: str | None = None,
        verifier_quant: str | None = None,
        draft_quant: str | None = None,
        draft_vocab: int | None = None,
        dtype: str | None = None,
        threads: int | None = None,
        seed: int = 0,
        device: str | None = None,
        batch_size: int | str | None = None,
        max_batch_size: int | None = None,
        **method_params: Any,
    ) -> None:
        super().__init__()
        given = {"method": method, "num_draft_tokens": num_draft_tokens, "drafter": drafter}
        spec = parse_spec(lm_eval_args.spec_args({**given, **method_params}), text=True)
        self.seed = lm_eval_args.integer("seed", seed, 0, MAX_SEED)
        max_batch = lm_eval_args.integer("max_batch", max_batch, 1)
        if max_length is not None:  # its upper bound needs the loaded model
            lm_eval_args.integer("max_length", max_length, 1)
        lm_eval_args.ignore_batch_size(batch_size, max_batch_size)
        models: dict[str, Any] = {"verifier": verifier, "draft": draft}
        models["verifier_quant"] = verifier_quant
        models |= {"draft_quant": draft_quant, "draft_vocab": draft_vocab, "backend": backend}
        models |= {"dtype": dtype, "threads": threads, "device": lm_eval_args.device_for(device)}
        load = parse_load(
            lm_eval_args.load_args(models),
            needs_draft=spec.needs_draft_model,
            trees=spec.trees,
            rows=max_batch,
        )
        self.engine = SpeculativeDecoder(**load.as_kwargs(), spec=spec, max_batch=max_batch)
        if self.engine.tokenizer is None:
            raise ValueError("verifier must come with a tokenizer (a name, path or LoadedModel)")
        self.tokenizer = self.engine.tokenizer
        self._max_length = self._check_max_length(max_length)
        self._device = self.engine.device
        self._info = {
            "verifier": lm_eval_args.describe(load.verifier),
            "draft": lm_eval_args.describe(load.draft),
            **spec.as_dict(),
            "rule": repr(spec.rule),
            "max_batch": max_batch,
            "seed": self.seed,
        }

    def _check_max_length(self, max_length: object) -> int:
        limit = self.engine.context_length
        if max_length is None:
            return limit
        return lm_eval_args.integer("max_length", max_length, 1, limit)

    # --- what lm-eval reads ---------------------------------------------------------------

    @property
    def max_length(self) -> int:
        """The longest token window the verifier reads (scoring and prompt + generation)."""
        return self._max_length

    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        return eos if eos is not None else min(self.engine.eos_ids)

    @property
    def prefix_token_id(self) -> int:
        """The token that conditions an empty context: BOS, else EOS (as HFLM)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "") or "cactus-spec").replace("/", "__")

    def get_model_info(self) -> dict[str, Any]:
        """What decoded: recorded under ``config`` in lm-eval's results."""
        return {"cactus_spec": dict(self._info)}

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs: Any
    ) -> list[int]:
        """Text -> ids as ``engine.encode(text, chat=False)``: no special tokens added unless
        ``add_special_tokens`` is True (so scoring and generation see the same ids)."""
        return list(self.tokenizer(string, add_special_tokens=bool(add_special_tokens)).input_ids)

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The chat as text through the tokenizer's template (lm-eval's --apply_chat_template);
        a template that refuses a system turn gets the chat without it, as HFLM does."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("--apply_chat_template needs a tokenizer with a chat template")
        options: dict[str, Any] = {
            "tokenize": False,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": not add_generation_prompt,
        }
        # tokenize=False: the text (transformers types every form it can return)
        try:
            return self.tokenizer.apply_chat_template(chat_history, **options)  # type: ignore[return-value]
        except jinja2.exceptions.TemplateError:
            log.warning("the chat template failed; applying it without the system turn")
            chat = [m for m in chat_history if m["role"] != "system"]
            return self.tokenizer.apply_chat_template(chat, **options)  # type: ignore[return-value]

    # --- generation -----------------------------------------------------------------------

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Decode every request (context, gen_kwargs) through the engine, ``max_batch`` rows at
        a time, request i with seed ``request_seed(seed, i)`` (``lm_eval_args``); the text cut
        before the first stop string of ``until``. Greedy when do_sample is false or the
        temperature is 0."""
        jobs = [self._job(i, *request.args) for i, request in enumerate(requests)]
        texts: list[str] = [""] * len(requests)
        with tqdm(total=len(jobs), disable=disable_tqdm, desc="cactus-spec generate") as bar:

            def done(i: int, result: GenerationResult) -> None:
                texts[i] = result.text or ""
                self.cache_hook.add_partial("generate_until", requests[i].args, texts[i])
                bar.update(1)

            self.engine.decode_many(jobs, on_result=done)
        return texts

    def _job(self, index: int, context: str, gen_kwargs: dict) -> Request:
        """The engine's request of lm-eval's request ``index``: its prompt, budget, seed, stops
        and sampling."""
        sampling, max_new, until = lm_eval_args.parse_gen_kwargs(gen_kwargs)
        return Request(
            prompt_ids=self._fit_prompt(self._encode_prompt(context), max_new),
            max_new_tokens=max_new,
            seed=lm_eval_args.request_seed(self.seed, index),
            sampling=sampling,
            stop=tuple(until),
        )

    def _encode_prompt(self, context: str) -> list[int]:
        if not context.strip():  # nothing to read: condition on BOS/EOS, as scoring does
            return [self.prefix_token_id]
        return self.engine.encode(context, chat=False)

    def _fit_prompt(self, ids: list[int], max_new: int) -> list[int]:
        """``ids`` cut from the left so prompt + max_new (+ one iteration's drafts, a tree's
        every node) fit the window."""
        drafts = self.engine.draft_reserve()  # K left open (auto): the cap
        window = min(self.max_length, self.engine.context_length - drafts)
        room = window - max_new
        if room < 1:
            raise ValueError(
                f"max_gen_toks ({max_new}) leaves no room for a prompt in the verifier's "
                f"window of {window} tokens"
            )
        if len(ids) > room:
            log.warning("prompt of %d tokens cut to its last %d", len(ids), room)
            return ids[-room:]
        return ids

    # --- scoring --------------------------------------------------------------------------

    def loglikelihood_rolling(
        self, requests: list[Instance], disable_tqdm: bool = False
    ) -> list[float]:
        """log P(text) under the verifier, each token predicted once, in disjoint windows of
        ``max_length`` tokens after BOS/EOS (lm-eval's rolling windows, as HFLM)."""
        windows: list[_Window] = []
        owners: list[int] = []
        for i, request in enumerate(requests):
            (text,) = request.args
            tokens = self.tok_encode(text)
            pairs = get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, 1)
            for context, continuation in map(make_disjoint_window, pairs):
                windows.append(self._window(None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._score(windows, disable_tqdm), strict=True):
            totals[owner] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def _loglikelihood_tokens(
        self,
        requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
        disable_tqdm: bool = False,
        **kwargs: Any,
    ) -> list[tuple[float, bool]]:
        """(log P(continuation | context), whether it is the verifier's greedy path) for
        each (key, context ids, continuation ids): the verifier alone, since speculation
        never changes its likelihoods."""
        windows = [self._window(key, ctx, cont) for key, ctx, cont in requests]
        return self._score(windows, disable_tqdm)

    def _window(self, key, context: list[int], continuation: list[int]) -> _Window:
        """The verifier reads (context + continuation)[:-1], cut from the left to
        ``max_length`` tokens (as HFLM), and scores its last len(continuation) positions."""
        count = len(continuation)
        if count > self.max_length:
            raise ValueError(
                f"a continuation of {count} tokens exceeds max_length {self.max_length}"
            )
        fed = (context + continuation)[-(self.max_length + 1) :][:-1]
        if len(context) + count - 1 > self.max_length:
            log.warning("scoring window cut to the last %d tokens", self.max_length)
        return _Window(key, tuple(fed[: len(fed) - count + 1]), continuation)

    def _score(self, windows: list[_Window], disable_tqdm: bool) -> list[tuple[float, bool]]:
        """Score every window with the engine (``runtime.scoring``): windows with the same
        prefix share one prefill."""
        with tqdm(total=len(windows), disable=disable_tqdm, desc="cactus-spec score") as bar:

            def scored(i: int, score: tuple[float, bool]) -> None:
                if windows[i].key is not None:
                    self.cache_hook.add_partial("loglikelihood", windows[i].key, score)
                bar.update(1)

            items = [(w.prefix, w.continuation) for w in windows]
            return self.engine.score(items, on_scored=scored)


# --- command line -------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """lm-eval's own command line (``run``, ``ls``, ``validate``; ``run`` is implied as in
    ``lm-eval``) with ``--model cactus-spec`` registered; returns the exit status."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    args = list(sys.argv[1:] if argv is None else argv)
    setup_logging()
    saved = sys.argv
    sys.argv = ["lm-eval", *args]  # HarnessCLI reads sys.argv (it inserts the implied `run`)
    try:
        cli = HarnessCLI()
        cli.execute(cli.parse_args())
    except SystemExit as stop:  # argparse: --help, usage errors
        return _exit_status(stop.code)
    finally:
        sys.argv = saved
    return 0


def _exit_status(code: object) -> int:
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
