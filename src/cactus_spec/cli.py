"""The `cactus-spec` command line: generate, demo, bench, models fetch."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from cactus_spec.engine import GenerationResult, SpeculativeDecoder
from cactus_spec.rules import TAS, Cactus, Interp, Rule, SpS, TopK
from cactus_spec.sampling import SamplingConfig

#: Best measured K on the default pair (see README's benchmark).
DEFAULT_NUM_DRAFT_TOKENS = 10

#: The parameters each method takes, with their defaults.
METHOD_PARAMS: dict[str, dict[str, object]] = {
    "ar": {},
    "sps": {},
    "cactus": {"delta": 1.0, "exact": False},
    "tas": {"epsilon": 0.09, "alpha": 0.3},
    "interp": {"alpha": 0.5},
    "topk": {"k": 5},
}

DEMO_PROMPT = (
    "Write a Python function `merge_intervals(intervals)` that merges overlapping "
    "intervals, with a docstring and a short example."
)

stderr = Console(stderr=True)


def build_rule(method: str, given: dict[str, object]) -> Rule | None:
    """The rule for ``method`` from the parameters the user gave; None for "ar"."""
    if method not in METHOD_PARAMS:
        raise ValueError(f"method must be one of {', '.join(METHOD_PARAMS)}, got {method!r}")
    allowed = METHOD_PARAMS[method]
    for name, value in given.items():
        if value is not None and name not in allowed:
            takers = [m for m, params in METHOD_PARAMS.items() if name in params]
            raise ValueError(
                f"--{name} does not apply to --method {method} (it applies to {', '.join(takers)})"
            )
    values = {
        name: given.get(name) if given.get(name) is not None else default
        for name, default in allowed.items()
    }
    factories = {
        "ar": None,
        "sps": SpS,
        "cactus": Cactus,
        "tas": TAS,
        "interp": Interp,
        "topk": TopK,
    }
    factory = factories[method]
    return None if factory is None else factory(**values)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with speculative decoding")
    p.add_argument("prompt")
    p.add_argument("--method", default="cactus", help=f"one of {', '.join(METHOD_PARAMS)}")
    p.add_argument("--delta", type=float, help="Cactus KL budget (default 1.0)")
    p.add_argument("--exact", action="store_const", const=True, help="Cactus exact KL bound")
    p.add_argument("--epsilon", type=float, help="TAS threshold cap (default 0.09)")
    p.add_argument("--alpha", type=float, help="TAS entropy factor (0.3) or Interp weight (0.5)")
    p.add_argument("--k", type=int, help="TopK: accept drafts in the verifier's top k (5)")
    p.add_argument("--num-draft-tokens", type=int, default=DEFAULT_NUM_DRAFT_TOKENS)
    p.add_argument("--drafter", choices=["model", "ngram"], default=None)
    _add_model_args(p)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")


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
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--seed", type=int, default=0, help="sampling seed of item i: seed + i")
    p.add_argument("--out", help="output directory (default bench-out/TASK or bench-out/quick)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_model_args(p)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="verifier: known name, hub id, model dir or .gguf")
    p.add_argument("--draft", help="draft model: known name, hub id, model dir or .gguf")
    p.add_argument("--dtype", default=None, help="bfloat16, float32 or float16 (auto)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cactus-spec", description="Speculative decoding with constrained acceptance."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    demo = sub.add_parser("demo", help="AR vs SpS vs Cactus(delta=1) on the default pair")
    _add_model_args(demo)
    demo.add_argument("--max-new-tokens", type=int, default=128)
    demo.add_argument("--num-draft-tokens", type=int, default=DEFAULT_NUM_DRAFT_TOKENS)
    _add_bench(sub)
    models = sub.add_parser("models", help="manage models")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    fetch = models_sub.add_parser("fetch", help="install, verify and convert known models")
    fetch.add_argument("names", nargs="*", help="default: the default pair")
    return parser


def _model_sources(args: argparse.Namespace, needs_draft: bool) -> tuple[str, str | None]:
    """--target/--draft, falling back to the fetched default pair."""
    from cactus_spec.fetch import REGISTRY, default_pair_paths, model_path

    target, draft = args.target, args.draft
    if target is None or (needs_draft and draft is None):
        default_target, default_draft = default_pair_paths()
        target = target or str(default_target)
        draft = draft or str(default_draft)
    target, draft = (str(model_path(s)) if s in REGISTRY else s for s in (target, draft))
    return target, draft if needs_draft else None


def run_generate(args: argparse.Namespace) -> int:
    given = {
        "delta": args.delta,
        "exact": args.exact,
        "epsilon": args.epsilon,
        "alpha": args.alpha,
        "k": args.k,
    }
    rule = build_rule(args.method, given)
    if args.method == "ar" and args.drafter is not None:
        raise ValueError("--drafter does not apply to --method ar (no drafting)")
    # Cheap checks first, so a typo fails before any model loads.
    SamplingConfig(args.temperature, args.top_k, args.top_p)
    if args.num_draft_tokens < 1:
        raise ValueError(f"--num-draft-tokens must be >= 1, got {args.num_draft_tokens}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not args.prompt.strip():
        raise ValueError("prompt must not be empty")
    drafter = args.drafter or "model"
    target, draft = _model_sources(args, needs_draft=rule is not None and drafter == "model")
    decoder = SpeculativeDecoder(
        target,
        draft,
        rule or SpS(),
        args.num_draft_tokens,
        drafter,
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,
    )

    def stream(piece: str) -> None:
        if not args.json:
            sys.stdout.write(piece)
            sys.stdout.flush()

    result = decoder.generate(
        args.prompt,
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        args.top_p,
        args.seed,
        args.stop,
        chat=not args.no_chat,
        on_text=stream,
    )
    if args.json:
        payload = {
            "text": result.text,
            "token_ids": result.token_ids,
            "interrupted": result.interrupted,
            "stats": result.stats.as_dict(),
        }
        print(json.dumps(payload))
    else:
        print()
        Console().print(_stats_table(result))
    return 130 if result.interrupted else 0


def _stats_table(result: GenerationResult) -> Table:
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
    for name, value in rows:
        table.add_row(name, value)
    return table


def run_demo(args: argparse.Namespace) -> int:
    from cactus_spec.models import load_model

    target_src, draft_src = _model_sources(args, needs_draft=True)
    stderr.print("loading the default pair …")
    target = load_model(target_src, dtype=args.dtype, device=args.device, threads=args.threads)
    draft = load_model(draft_src, dtype=args.dtype, device=args.device, threads=args.threads)
    runs = [
        ("AR (verifier alone)", None, SpS()),
        ("SpS", draft, SpS()),
        ("Cactus (delta=1)", draft, Cactus(1.0)),
    ]
    table = Table(
        title=f"demo: {args.max_new_tokens} new tokens, K={args.num_draft_tokens}, "
        "temperature 0.6, top-p 0.95, top-k 20"
    )
    for column in ("method", "tokens/s", "speedup vs AR", "mean accepted", "KL nats/token"):
        table.add_column(column, justify="left" if column == "method" else "right")
    stderr.print("warming up (pages both models' weights in, so AR is not charged for it) …")
    SpeculativeDecoder(target, draft, SpS(), args.num_draft_tokens).generate(DEMO_PROMPT, 2)
    baseline = None
    for name, draft_model, rule in runs:
        stderr.print(f"running {name} …")
        decoder = SpeculativeDecoder(target, draft_model, rule, args.num_draft_tokens)
        result = decoder.generate(DEMO_PROMPT, args.max_new_tokens, seed=0)
        s = result.stats
        baseline = baseline or s.tokens_per_s
        accepted = f"{s.mean_accepted:.2f}" if draft_model is not None else "-"
        table.add_row(
            name,
            f"{s.tokens_per_s:.2f}",
            f"{s.tokens_per_s / baseline:.2f}x",
            accepted,
            f"{s.kl_nats_per_token:.4f}",
        )
    Console().print(table)
    print(f"\nCactus (delta=1) wrote:\n{result.text}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "generate":
            return run_generate(args)
        if args.command == "demo":
            return run_demo(args)
        if args.command == "bench":
            from cactus_spec.bench.command import main_bench

            return main_bench(args)
        from cactus_spec.fetch import main_fetch

        return main_fetch(args.names)
    except (ValueError, FileNotFoundError) as error:
        sys.stderr.write(f"error: {error}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
