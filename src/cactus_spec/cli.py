"""The `cactus-spec` command line: generate, demo, bench, serve, models fetch.

Every argument that can be checked without a model is checked before any model loads, and
bad input ends with one line, ``error: ...``, and exit status 2. The method flags come from
the registry in ``core.methods`` and are read by ``core.spec.parse_spec``; the sampling
defaults come from ``SamplingConfig``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from cactus_spec import isa
from cactus_spec.backends.quant import QUANTS
from cactus_spec.core.budget import ALLOCATIONS
from cactus_spec.core.checks import check_int, flag
from cactus_spec.core.methods import DEFAULT_METHOD, DEFAULT_NUM_DRAFT_TOKENS, METHODS
from cactus_spec.core.sampling import SamplingConfig, check_seed
from cactus_spec.core.spec import AUTO_K, DRAFTERS, VERIFICATIONS, DecodeSpec, parse_spec
from cactus_spec.loading.options import BACKENDS, LOAD_KEYS, LoadOptions, parse_load
from cactus_spec.runtime.grammar import GrammarLimits
from cactus_spec.runtime.policy import POLICIES
from cactus_spec.runtime.scheduler import PREFILL_CHUNK

_SAMPLING = SamplingConfig()
_ARG_TYPES: dict[type, type[int] | type[float]] = {int: int, float: float}  # bool: a switch

stderr = Console(stderr=True)


def _method_flags() -> dict[str, list]:
    """Every method parameter, once, with the methods that take it: name -> [Param, ...]."""
    flags: dict[str, list] = {}
    for method in METHODS.values():
        for param in method.params:
            flags.setdefault(param.name, []).append((method.name, param))
    return flags


def _k_value(text: str) -> int | str:
    """--num-draft-tokens: an integer, or auto (a policy picks K); anything else is left for
    the spec parser to refuse in one line."""
    try:
        return int(text)
    except ValueError:
        return text.strip()


def _add_method_args(p: argparse.ArgumentParser, k_help: str) -> None:
    """--method, its parameters, --num-draft-tokens, --drafter, --verification, --branches
    and --kl-budget: the decoding spec."""
    p.add_argument(
        "--method",
        default=DEFAULT_METHOD,
        help="; ".join(f"{m.name}: {m.help}" for m in METHODS.values()),
    )
    p.add_argument("--num-draft-tokens", type=_k_value, help=k_help)
    p.add_argument("--drafter", choices=DRAFTERS, help="where drafts come from (default model)")
    p.add_argument(
        "--verification",
        choices=VERIFICATIONS,
        help="how drafts are judged: chain (token by token, default), block (the chain as "
        "a whole: more tokens kept), tree (up to --branches nodes per depth, given to the "
        "likeliest paths, in one verifier forward, judged top down) or traversal (that tree "
        "judged leaf to root, each path as a whole, as block judges a chain); all but chain: "
        "methods sps, cactus",
    )
    p.add_argument(
        "--branches",
        type=int,
        help="a tree's nodes per depth (--verification tree or traversal; default 2)",
    )
    p.add_argument(
        "--kl-budget",
        type=float,
        help="cactus: the whole answer's divergence budget in nats (KL of the answer's law "
        "to the verifier's <= it; any metric moves by at most sqrt(budget/2)); --delta caps "
        "each position",
    )
    p.add_argument(
        "--allocation",
        help=f"with --kl-budget, each position's share, one of {', '.join(ALLOCATIONS)}: "
        "greedy (all that is left, default), paced (what is left spread over the tokens "
        "still to come) or marginal (all that is left, for the positions whose acceptance "
        "per nat is highest)",
    )
    for name, takers in _method_flags().items():
        first = takers[0][1]
        words = "; ".join(f"{m}: {p.help} ({p.allowed}, default {p.default})" for m, p in takers)
        if isinstance(first.default, bool):
            p.add_argument(f"--{name}", action="store_const", const=True, help=words)
        else:
            p.add_argument(f"--{name}", type=_ARG_TYPES[type(first.default)], help=words)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=_SAMPLING.temperature)
    p.add_argument("--top-p", type=float, default=_SAMPLING.top_p)
    p.add_argument("--top-k", type=int, default=_SAMPLING.top_k)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with speculative decoding")
    p.add_argument("prompt")
    _add_method_args(
        p,
        "K, tokens drafted per iteration, or auto: chosen each iteration from the models' "
        f"measured costs and the draft's confidence, up to {DEFAULT_NUM_DRAFT_TOKENS} "
        f"(default auto with a draft model, else {DEFAULT_NUM_DRAFT_TOKENS})",
    )
    _add_model_args(p)
    _add_sampling_args(p)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0, help="an integer in [0, 2**64 - 1]")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p in [0, 1] (0: off)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2]")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="in (0, 10] (1: off)")
    p.add_argument(
        "--logprobs",
        type=int,
        help="with --json: each new token's log q and this many alternatives (0-20)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", help="output matching this JSON schema")
    shape.add_argument("--json-object", action="store_true", help="output: any JSON object")
    shape.add_argument("--regex", help="output matching this regular expression")
    shape.add_argument(
        "--grammar", metavar="FILE", help="output matching this grammar (.lark or .gbnf)"
    )


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark a grid of methods on a task: speed, acceptance, divergence, accuracy",
        description="Run a grid of configurations side by side on a task and write "
        "results.jsonl, summary.json, summary.md and PNG plots into --out. A rerun into the "
        "same directory resumes; one with a different grid, task or models is refused.",
    )
    p.add_argument("--quick", action="store_true", help="SmolLM2-135M, n-gram drafter, small run")
    p.add_argument("--task", help="gsm (default), humaneval or prompts")
    p.add_argument("--prompts", help="JSONL prompt file (the prompts task)")
    p.add_argument("--n", type=int, help="number of items (gsm: 50; others: all)")
    p.add_argument("--task-seed", type=int, default=0, help="gsm data seed")
    p.add_argument("--grid", help="TOML or JSON grid file")
    p.add_argument(
        "--method",
        action="append",
        help="grid entry NAME[:KEY=V1,V2...] (repeatable), e.g. cactus:delta=0.5,1:exact=true",
    )
    p.add_argument(
        "--num-draft-tokens", help=f"K values, comma-separated (default {DEFAULT_NUM_DRAFT_TOKENS})"
    )
    p.add_argument("--drafter", help="model, ngram or model,ngram (default model)")
    p.add_argument("--max-new-tokens", type=int, help="per item (default 256)")
    _add_sampling_args(p)
    p.add_argument("--seed", type=int, default=0, help="sampling seed of item i: seed + i")
    p.add_argument("--out", help="output directory (default bench-out/TASK or bench-out/quick)")
    p.add_argument(
        "--max-batch",
        type=int,
        default=1,
        help="items our engine decodes at once (default 1: one at a time, for speed ratios)",
    )
    p.add_argument(
        "--rescore",
        action="store_true",
        help="grade the recorded texts in --out again and rewrite its summaries (no decoding)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_model_args(p)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server with batched speculative decoding",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and "
        "/metrics. Requests are decoded together (continuous batching); a request picks its "
        'method with "speculative": {"method": ..., "num_draft_tokens": ...}, else the '
        "server's --method is used and the policy picks K.",
    )
    _add_method_args(
        p,
        f"with --policy fixed: K for requests that give none; with --policy auto: the largest "
        f"K the policy picks (default {DEFAULT_NUM_DRAFT_TOKENS})",
    )
    p.add_argument(
        "--policy",
        choices=POLICIES,
        help="how K is chosen for requests that give none (default auto)",
    )
    _add_model_args(p)
    p.add_argument("--host", help="address to bind (default loopback only)")
    p.add_argument("--port", type=int)
    p.add_argument("--max-batch", type=int, help="rows decoded at once")
    p.add_argument("--max-queue", type=int, help="waiting requests before HTTP 429")
    p.add_argument(
        "--prefill-chunk",
        type=int,
        help="prompt tokens read per iteration and per token a row verified, so running "
        f"rows are not stalled by a long prompt (default {PREFILL_CHUNK})",
    )
    p.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="read every prompt from its first token (default: reuse the longest prefix a "
        "row still holds)",
    )
    p.add_argument("--default-max-tokens", type=int, help="max_tokens when a request has none")
    p.add_argument(
        "--max-request-bytes",
        type=int,
        help="the largest request body read; larger ones get 413 (default 4 MiB)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        help="seconds a request body may take to arrive; slower ones get 408 (default 30)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        help="seconds a connection may take to send a request's head; slower ones get 408 "
        "(default 10)",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        help="on SIGTERM, seconds in-flight requests may run on (new ones get 503) before they "
        "are ended (default 30)",
    )
    p.add_argument("--served-model-name", help="model id in the API (default: --verifier)")
    limits = GrammarLimits()
    p.add_argument(
        "--max-grammar-bytes",
        type=int,
        help="the largest grammar a request may bring (a JSON schema, regex, Lark or GBNF "
        f"text), in bytes; larger ones get 400 (default {limits.max_bytes})",
    )
    p.add_argument(
        "--max-grammar-symbols",
        type=int,
        help="the most symbols a request's compiled grammar may have; more get 400 "
        f"(default {limits.max_symbols})",
    )
    p.add_argument(
        "--grammar-step-fuel",
        type=int,
        help="the grammar engine's lexer work per token; a request whose grammar needs more "
        f"is ended with 400 (default {limits.step_fuel})",
    )
    p.add_argument(
        "--chat-template",
        help="a Jinja chat template file to use instead of the tokenizer's (e.g. one that "
        "defines tool calls)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("CACTUS_SPEC_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health "
        "(default: $CACTUS_SPEC_API_KEY)",
    )


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verifier", help="verifier: known name, hub id, model dir or .gguf")
    p.add_argument(
        "--draft",
        help="draft model: known name, hub id, model dir or .gguf (one with another tokenizer "
        "drafts text the verifier's tokenizer encodes again)",
    )
    p.add_argument("--dtype", default=None, help="bfloat16, float32 or float16 (auto)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (>= 1)")
    p.add_argument("--backend", choices=BACKENDS, default="auto", help="model code (auto)")
    p.add_argument(
        "--draft-quant",
        choices=QUANTS,
        default="int8",
        help="draft weights (any of them keeps the output law; int8 and int4 are level end "
        "to end where measured)",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="keep the N most frequent tokens in the draft's LM head (a cheaper draft step; "
        "the output law is unchanged; default: all)",
    )
    p.add_argument(
        "--verifier-quant",
        choices=(*QUANTS, "auto"),
        default="auto",
        help="verifier weights (int8/int4 change the output law: its measured KL from bfloat16 "
        "is reported); auto (default): none where the CPU computes in bfloat16, else int8",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cactus-spec", description="Speculative decoding with constrained acceptance."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    demo = sub.add_parser("demo", help="AR vs SpS vs Cactus(delta=1) on the default pair")
    _add_model_args(demo)
    demo.add_argument("--max-new-tokens", type=int, default=128)
    demo.add_argument(
        "--num-draft-tokens",
        type=_k_value,
        default=AUTO_K,
        help=f"K, or auto (default): the policy's K each iteration, up to "
        f"{DEFAULT_NUM_DRAFT_TOKENS}",
    )
    demo.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="rounds of the three methods in turn; each shows its fastest (default 2)",
    )
    _add_bench(sub)
    _add_serve(sub)
    lm_eval = sub.add_parser(
        "lm-eval",
        help="lm-evaluation-harness with the cactus-spec model (needs cactus-spec[eval])",
        description="lm-eval's own command line with --model cactus-spec registered, e.g. "
        "cactus-spec lm-eval run --model cactus-spec --model_args "
        "method=cactus,delta=1.0,num_draft_tokens=8 --tasks gsm8k",
        add_help=False,
    )
    lm_eval.add_argument("lm_eval_args", nargs=argparse.REMAINDER)
    models = sub.add_parser("models", help="manage models")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    fetch = models_sub.add_parser("fetch", help="install, verify and convert known models")
    fetch.add_argument("names", nargs="*", help="default: the default pair")
    return parser


def _load_options(args: argparse.Namespace, needs_draft: bool) -> LoadOptions:
    """The model flags, read by the one loading parser (``loading.options``): --verifier and
    --draft default to the default pair (known names load only once fetched)."""
    return parse_load(
        {key: getattr(args, key) for key in LOAD_KEYS}, needs_draft=needs_draft, label=flag
    )


def _check_drafting(args: argparse.Namespace, spec: DecodeSpec) -> LoadOptions:
    """The model flags read against ``spec``, and the drafting flags that cannot go
    together whatever the models are, refused before any model loads."""
    options = _load_options(args, spec.drafts and spec.drafter == "model")
    if spec.drafts and spec.trees and spec.drafter != "model":
        raise ValueError(
            f"--verification {spec.verification} needs a draft model (--drafter model), "
            f"got --drafter {spec.drafter}; use chain or block"
        )
    if spec.drafts and spec.trees and options.backend == "hf":
        raise ValueError(
            f"--verification {spec.verification} needs token-tree attention, which "
            "--backend hf lacks; use --backend lean or auto"
        )
    return options


def _spec(args: argparse.Namespace) -> DecodeSpec:
    """The decoding spec of --method, its parameters, --num-draft-tokens, --drafter,
    --verification, --branches, --kl-budget and --allocation."""
    given = {name: getattr(args, name) for name in _method_flags()}
    given |= {"num_draft_tokens": args.num_draft_tokens, "drafter": args.drafter}
    given |= {"verification": args.verification, "branches": args.branches}
    given |= {"kl_budget": args.kl_budget, "allocation": args.allocation}
    return parse_spec({"method": args.method, **given}, label=flag)


def _k_left_open(args: argparse.Namespace, spec: DecodeSpec) -> DecodeSpec:
    """``spec`` with K auto where a draft model drafts and --num-draft-tokens is not given:
    a fixed K loses to the verifier alone where a verification block costs too much (an
    11-token block is about 5 AR steps on AVX2), the policy's K does not."""
    if args.num_draft_tokens is None and spec.drafts and spec.drafter == "model":
        return spec.with_num_draft_tokens(None)
    return spec


def _check_counts(args: argparse.Namespace, flags: tuple[str, ...] = ("max_new_tokens",)) -> None:
    """ValueError naming the first of ``flags`` below 1."""
    for key in flags:
        check_int(flag(key), getattr(args, key))


def run_generate(args: argparse.Namespace) -> int:
    from cactus_spec.runtime.engine import SpeculativeDecoder, check_prompt_text
    from cactus_spec.runtime.generation import check_stops
    from cactus_spec.runtime.logprobs import check_logprobs

    # Cheap checks first, so a typo fails before any model loads.
    spec = _k_left_open(args, _spec(args))
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.min_p)
    penalties = _penalties(args)
    check_logprobs(args.logprobs, "--logprobs")
    check_stops(args.stop)
    _check_counts(args)
    check_seed(args.seed, "--seed")
    check_prompt_text(args.prompt)
    grammar = _grammar(args)
    options = _check_drafting(args, spec)
    decoder = SpeculativeDecoder(**options.as_kwargs(), spec=spec)

    divergence = decoder.verifier_divergence()  # measured before any output, never silent

    def stream(piece: str) -> None:
        if not args.json:
            sys.stdout.write(piece)
            sys.stdout.flush()

    result = decoder.generate(
        args.prompt,
        args.max_new_tokens,
        sampling.temperature,
        sampling.top_k,
        sampling.top_p,
        args.seed,
        args.stop,
        chat=not args.no_chat,
        on_text=stream,
        logprobs=args.logprobs,
        penalties=penalties,
        min_p=sampling.min_p,
        grammar=grammar,
    )
    if args.json:
        payload = {
            "text": result.text,
            "token_ids": result.token_ids,
            "logprobs": None if result.logprobs is None else [asdict(e) for e in result.logprobs],
            "interrupted": result.interrupted,
            "spec": spec.as_dict(),
            "stats": result.stats.as_dict(),
            "verifier": {
                "quant": options.verifier_quant,
                "divergence": divergence.as_dict() if divergence else None,
            },
        }
        print(json.dumps(payload))
    else:
        print()
        Console().print(_stats_table(result, divergence))
    return 130 if result.interrupted else 0


def _grammar(args: argparse.Namespace):
    """What the output must match (--json-schema, --json-object, --regex, --grammar), or
    None; ValueError naming the flag."""
    from cactus_spec.runtime.grammar import Grammar

    try:
        if args.json_schema:
            return Grammar.json_schema(_read_text(args.json_schema, "--json-schema"))
        if args.json_object:
            return Grammar("json_object")
        if args.regex is not None:
            return Grammar("regex", args.regex)
    except ValueError as err:
        flag = "--json-schema" if args.json_schema else "--regex"
        raise ValueError(f"{flag}: {err}") from None
    if not args.grammar:
        return None
    syntax = Path(args.grammar).suffix.lstrip(".")
    if syntax not in ("lark", "gbnf"):
        raise ValueError(f"--grammar: the file must end in .lark or .gbnf, got {args.grammar!r}")
    return Grammar(syntax, _read_text(args.grammar, "--grammar"))


def _penalties(args: argparse.Namespace):
    """The penalty flags as ``Penalties``; ValueError naming the flag."""
    from cactus_spec.core.penalties import Penalties

    try:
        return Penalties(args.presence_penalty, args.frequency_penalty, args.repetition_penalty)
    except ValueError as err:
        raise ValueError(f"--{str(err).replace('_', '-', 1)}") from None


def _stats_table(result, divergence=None) -> Table:
    s = result.stats
    table = Table(title="interrupted" if result.interrupted else None, show_header=False)
    by_pos = " ".join(f"{a:.2f}" for a in s.acceptance_by_position) or "-"
    rows = [
        ("new tokens", f"{s.new_tokens}"),
        ("tokens/s", f"{s.tokens_per_s:.2f}"),
        ("iterations", f"{s.iterations}"),
        ("accepted / drafted", f"{s.accepted} / {s.drafted}"),
        ("mean accepted per iteration", f"{s.mean_accepted:.2f}"),
        ("acceptance by position", by_pos),
        (
            "time draft / verify / meter / other (s)",
            f"{s.time_draft_s:.2f} / {s.time_verify_s:.2f} / {s.time_audit_s:.2f} "
            f"/ {s.time_other_s:.2f}",
        ),
        ("divergence (nats, per token)", f"{s.kl_nats:.4f}, {s.kl_nats_per_token:.5f}"),
    ]
    if divergence is not None:
        rows.append(
            (
                f"{divergence.quant} verifier vs {divergence.reference} (KL nats/token)",
                f"{divergence.kl_one_row:.4f} one row, {divergence.kl_block:.4f} in "
                f"blocks of {divergence.block}",
            )
        )
    for name, value in rows:
        table.add_row(name, value)
    return table


def run_demo(args: argparse.Namespace) -> int:
    from cactus_spec.bench import demo

    _check_counts(args, ("max_new_tokens", "rounds"))
    given = {"method": "sps", "num_draft_tokens": args.num_draft_tokens}
    parse_spec(given, label=flag)  # a bad K refused by its flag's name, before loading
    options = _load_options(args, needs_draft=True)
    demo.run_demo(options, args.num_draft_tokens, args.max_new_tokens, args.rounds)
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from cactus_spec.server.build import build_server
    from cactus_spec.server.options import SERVE_KEYS, ServeOptions

    started = time.monotonic()
    spec = _spec(args)
    models = _check_drafting(args, spec)
    given = {key: getattr(args, key) for key in SERVE_KEYS if getattr(args, key) is not None}
    template = _read_text(args.chat_template, "--chat-template") if args.chat_template else None
    options = ServeOptions(spec, models, chat_template=template, label=flag, **given)
    draft = f", {models.draft} (draft)" if models.draft else ""
    stderr.print(f"loading {models.verifier} (verifier){draft} …")
    server = build_server(options)
    stderr.print(options.describe(), highlight=False)
    server.serve(started)
    return 0


def _read_text(path: str, option: str) -> str:
    """The UTF-8 text of the file an option names; ValueError naming the option."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{option}: cannot read {path!r} ({err})") from None


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "generate":
        return run_generate(args)
    if args.command == "serve":
        return run_serve(args)
    if args.command == "demo":
        return run_demo(args)
    if args.command == "bench":
        from cactus_spec.bench.command import main_bench

        return main_bench(args)
    if args.command == "lm-eval":
        return run_lm_eval(args.lm_eval_args)
    from cactus_spec.loading.fetch import main_fetch

    return main_fetch(args.names)


def run_lm_eval(argv: list[str]) -> int:
    """lm-eval's command line with the cactus-spec model registered (``lm_eval_model``)."""
    try:
        from cactus_spec.lm_eval.model import main as lm_eval_main
    except ImportError as err:
        raise ValueError(
            f"lm-eval needs the eval extra: pip install 'cactus-spec[eval]' ({err})"
        ) from None
    return lm_eval_main(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (2: bad input, 130: interrupted)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["lm-eval"]:  # every later argument, --help included, is lm-eval's
        args = argparse.Namespace(command="lm-eval", lm_eval_args=argv[1:])
    else:
        args = _parser().parse_args(argv)
    try:
        isa.chosen()  # a bad CACTUS_SPEC_ISA is an error before anything loads
        return _dispatch(args)
    except (ValueError, FileNotFoundError) as error:
        message = " ".join(str(error).split())  # one line, whatever the message held
        sys.stderr.write(f"error: {message}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
