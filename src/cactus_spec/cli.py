"""The `cactus-spec` command line: each command's arguments (``cli_args``) read into the
options the layers below take, and the command run: generate here, demo (``bench.demo``),
bench (``bench.command``; ``bench.post`` for its subcommands that read finished runs), serve
(``server.build``), lm-eval (``lm_eval.model``) and models fetch (``loading.fetch``).

Every argument that can be checked without a model is checked before any model loads, and
bad input ends with one line, ``error: ...``, and exit status 2. The method flags are read
by ``core.spec.parse_spec``, the model flags by ``loading.options.parse_load`` and the serve
flags by ``server.options.ServeOptions``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from cactus_spec import isa
from cactus_spec.cli_args import method_flags, parser
from cactus_spec.core.checks import check_int, flag
from cactus_spec.core.sampling import SamplingConfig, check_seed
from cactus_spec.core.spec import DecodeSpec, parse_spec
from cactus_spec.loading.backend import reads_trees
from cactus_spec.loading.options import LOAD_KEYS, LoadOptions, parse_load

stderr = Console(stderr=True)


def _load_options(
    args: argparse.Namespace, needs_draft: bool, trees: bool = False, rows: int = 1
) -> LoadOptions:
    """The model flags, read by the one loading parser (``loading.options``) for a command
    that decodes at most ``rows`` rows at once: --verifier and --draft default to the default
    pair (known names load only once fetched)."""
    given = {key: getattr(args, key) for key in LOAD_KEYS}
    return parse_load(given, needs_draft=needs_draft, trees=trees, rows=rows, label=flag)


def _check_drafting(args: argparse.Namespace, spec: DecodeSpec, rows: int = 1) -> LoadOptions:
    """The model flags read against ``spec`` for ``rows`` rows at once, and the drafting
    flags that cannot go together whatever the models are, refused before any model loads."""
    options = _load_options(args, spec.needs_draft_model, spec.trees, rows)
    spec.check_trees(flag)
    if spec.trees and not reads_trees(options.backend):
        raise ValueError(
            f"--verification {spec.verification} needs token-tree attention, which "
            f"--backend {options.backend} lacks; use --backend lean or auto"
        )
    return options


def _spec(args: argparse.Namespace) -> DecodeSpec:
    """The decoding spec of --method, its parameters, --num-draft-tokens, --drafter,
    --verification, --branches, --kl-budget and --allocation."""
    given = {name: getattr(args, name) for name in method_flags()}
    given |= {"num_draft_tokens": args.num_draft_tokens, "drafter": args.drafter}
    given |= {"verification": args.verification, "branches": args.branches}
    given |= {"kl_budget": args.kl_budget, "allocation": args.allocation}
    return parse_spec({"method": args.method, **given}, label=flag)


def _k_left_open(args: argparse.Namespace, spec: DecodeSpec) -> DecodeSpec:
    """``spec`` with K auto where a draft model drafts and --num-draft-tokens is not given:
    a fixed K loses to the verifier alone where a verification block costs too much (an
    11-token block is about 5 AR steps on AVX2), the policy's K does not."""
    if args.num_draft_tokens is None and spec.needs_draft_model:
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
                "quant": decoder.verifier.weight_format,
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
    """``cactus-spec demo``: its flags checked before any model loads, then ``bench.demo``."""
    from cactus_spec.bench import demo

    started = time.monotonic()
    _check_counts(args, ("max_new_tokens", "rounds"))
    given = {"method": "sps", "num_draft_tokens": args.num_draft_tokens}
    parse_spec(given, label=flag)  # a bad K refused by its flag's name, before loading
    options = _load_options(args, needs_draft=True)
    demo.run_demo(options, args.num_draft_tokens, args.max_new_tokens, args.rounds, started)
    return 0


def run_serve(args: argparse.Namespace) -> int:
    """``cactus-spec serve``: its options checked before any model loads, then the server
    ``server.build.build_server`` assembles, in the foreground until a signal."""
    from cactus_spec.server.build import build_server
    from cactus_spec.server.options import SERVE_KEYS, ServeOptions

    started = time.monotonic()
    spec = _spec(args)
    given = {key: getattr(args, key) for key in SERVE_KEYS if getattr(args, key) is not None}
    models = _check_drafting(args, spec, given.get("max_batch", ServeOptions.max_batch))
    template = _read_text(args.chat_template, "--chat-template") if args.chat_template else None
    options = ServeOptions(spec, models, chat_template=template, label=flag, **given)
    draft = f", {models.draft} (draft)" if models.draft else ""
    stderr.print(f"loading {models.verifier} (verifier){draft} …")
    server = build_server(options)
    stderr.print(options.describe(server.engine.backend), highlight=False)
    server.serve(started)
    return 0


def _read_text(path: str, option: str) -> str:
    """The UTF-8 text of the file an option names; ValueError naming the option."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{option}: cannot read {path!r} ({err})") from None


def _check_no_run_flags(args: argparse.Namespace) -> None:
    """ValueError naming the first flag of a bench run given beside ``bench ratio``, ``diff``
    or ``quality-table``, which read finished runs and take none."""
    defaults = vars(parser().parse_args(["bench"])) | {"bench_command": args.bench_command}
    given = [key for key, value in defaults.items() if getattr(args, key) != value]
    if given:
        raise ValueError(
            f"{flag(given[0])} is a flag of a bench run; bench {args.bench_command} reads "
            "finished runs and takes none"
        )


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "generate":
        return run_generate(args)
    if args.command == "serve":
        return run_serve(args)
    if args.command == "demo":
        return run_demo(args)
    if args.command == "bench" and args.bench_command:
        from cactus_spec.bench.post import main_post

        _check_no_run_flags(args)
        return main_post(args)
    if args.command == "bench":
        from cactus_spec.bench.command import main_bench

        return main_bench(args)
    if args.command == "lm-eval":
        return run_lm_eval(args.lm_eval_args)
    from cactus_spec.loading.fetch import main_fetch

    return main_fetch(args.names, args.dense)


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
        args = parser().parse_args(argv)
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
