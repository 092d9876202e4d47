"""The command line's arguments: one sub-parser per command (generate, demo, bench and its
subcommands that read finished runs, serve, lm-eval, models fetch), read by ``cli``.

The method flags come from the registry in ``core.methods`` (``method_flags``), the sampling
defaults from ``SamplingConfig``. The serve flags given no default here (None) take
``server.options.ServeOptions``' own.
"""

from __future__ import annotations

import argparse
import os

from cactus_spec.backends.quant import QUANTS
from cactus_spec.core.budget import ALLOCATIONS
from cactus_spec.core.drafters import DEFAULT_DRAFTER, DRAFTERS
from cactus_spec.core.methods import DEFAULT_METHOD, DEFAULT_NUM_DRAFT_TOKENS, METHODS
from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.core.spec import AUTO_K, VERIFICATIONS
from cactus_spec.loading.options import BACKENDS
from cactus_spec.runtime.grammar import GrammarLimits
from cactus_spec.runtime.policy import POLICIES
from cactus_spec.runtime.scheduler import PREFILL_CHUNK

_SAMPLING = SamplingConfig()
_ARG_TYPES: dict[type, type[int] | type[float]] = {int: int, float: float}  # bool: a switch


def method_flags() -> dict[str, list]:
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
    p.add_argument(
        "--drafter",
        choices=list(DRAFTERS),
        help="; ".join(f"{d.name}: {d.help}" for d in DRAFTERS.values())
        + f" (default {DEFAULT_DRAFTER})",
    )
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
    for name, takers in method_flags().items():
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
        "same directory resumes; one with a different grid, task or models is refused. The "
        "subcommands read finished runs and run nothing.",
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
    p.add_argument(
        "--drafter",
        help=f"drafters, comma-separated ({', '.join(DRAFTERS)}; default {DEFAULT_DRAFTER})",
    )
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
    _add_bench_reads(p)


def _add_bench_reads(bench: argparse.ArgumentParser) -> None:
    """``bench ratio``, ``diff`` and ``quality-table``: finished runs read back, no model."""
    sub = bench.add_subparsers(
        dest="bench_command",
        title="reading finished runs (RUN: a bench run's --out folder)",
        metavar="{ratio,diff,quality-table}",
    )
    ratio = sub.add_parser(
        "ratio",
        help="per-item tokens/s of one configuration of a run over another's: median [min, max]",
    )
    ratio.add_argument("run", metavar="RUN")
    ratio.add_argument("config", metavar="CONFIG", help="a configuration id of the run's grid")
    ratio.add_argument("reference", metavar="REFERENCE", help="the configuration id it divides")
    diff = sub.add_parser(
        "diff",
        help="runs of one grid compared: identical tokens, tokens/s side by side (exit 1 when "
        "tokens differ)",
    )
    diff.add_argument("before", metavar="BEFORE")
    diff.add_argument("after", metavar="AFTER")
    diff.add_argument(
        "before_again",
        metavar="BEFORE_AGAIN",
        nargs="?",
        help="BEFORE run again after AFTER (an A/B/A sitting): its ratio to BEFORE is the noise",
    )
    table = sub.add_parser(
        "quality-table",
        help="accuracy and acceptance of scored runs of one grid (one per task) side by side",
    )
    table.add_argument("runs", metavar="RUN", nargs="+")


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
        help="prompt tokens read per iteration for each prompt waiting, per token a row "
        f"verified, so running rows are not stalled by a long prompt (default {PREFILL_CHUNK})",
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
    p.add_argument("--device", default=None, help="cpu (default), cuda, cuda:N or mps")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (>= 1)")
    p.add_argument("--backend", choices=BACKENDS, default=None, help="model code (auto)")
    p.add_argument(
        "--draft-quant",
        choices=(*QUANTS, "auto"),
        default=None,
        help="draft weights (any of them keeps SpS exact and Cactus within its budget); auto "
        "(default): int4 (its one-row step reads half the bytes), int8 where AMX runs "
        "several rows at once, dense off the CPU, the GGUF's own with --backend ggml",
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


def parser() -> argparse.ArgumentParser:
    """``cactus-spec``'s parser: a sub-parser per command."""
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
    fetch.add_argument(
        "--dense",
        action="store_true",
        help="make the dense Hugging Face copy (the third column, what vLLM loads) even where "
        "backend auto runs the models on ggml, which reads the GGUF itself",
    )
    return parser
