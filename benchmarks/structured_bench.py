"""Structured output's cost on the default pair: the same prompts with a JSON schema and
without, AR, SpS and Cactus, in one run.

    python benchmarks/structured_bench.py --out benchmarks/report/structured

The default pair as the command line loads it (bf16 verifier where the CPU has fast bf16,
else float32; int8 draft), K = 10, the
paper's sampling (temperature 0.6, top-k 20, top-p 0.95), 128 new tokens, seed i for prompt
i. Every prompt asks for a JSON record; the constrained run adds its schema
(``Grammar.json_schema``). Configurations alternate per prompt, so drift on a noisy
machine spreads over all of them. Each generation appends a line to ``OUT/results.jsonl``
(a rerun skips the lines there); ``OUT/summary.md`` gives per configuration the median
tokens/s, the mean accepted length, the grammar's time per token (computing the masks and
applying them to p and q) and how many constrained answers validate against their schema.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import jsonschema_rs
import torch

from cactus_spec.core.spec import DecodeSpec
from cactus_spec.loading.catalog import DEFAULT_PAIR
from cactus_spec.loading.models import load_model
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.runtime.grammar import Grammar

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["name", "age", "email", "skills"],
    "additionalProperties": False,
}
BOOK = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "author": {"type": "string"},
        "year": {"type": "integer"},
        "genres": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "in_print": {"type": "boolean"},
    },
    "required": ["title", "author", "year", "genres", "in_print"],
    "additionalProperties": False,
}
FUNCTION = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "arguments": {"type": "array", "items": {"type": "string"}},
        "returns": {"type": "string"},
        "summary": {"type": "string"},
    },
    "required": ["name", "arguments", "returns", "summary"],
    "additionalProperties": False,
}
PROMPTS = [
    ("Return a JSON record of a fictional software engineer.", PERSON),
    ("Return a JSON record describing a classic science-fiction novel.", BOOK),
    ("Describe Python's built-in sorted function as a JSON record.", FUNCTION),
    ("Return a JSON record of a fictional data scientist in Berlin.", PERSON),
    ("Return a JSON record describing a well-known detective novel.", BOOK),
    ("Describe a Python function that merges two sorted lists as a JSON record.", FUNCTION),
    ("Return a JSON record of a retired astronaut.", PERSON),
    ("Return a JSON record describing a book about the history of mathematics.", BOOK),
]
METHODS = {
    "AR": DecodeSpec.of("ar"),
    "SpS": DecodeSpec.of("sps", num_draft_tokens=10),
    "Cactus(1)": DecodeSpec.of("cactus", delta=1.0, num_draft_tokens=10),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--n", type=int, default=len(PROMPTS), help="prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.jsonl"
    done = {(r["prompt"], r["config"]) for r in read(results)}
    verifier = load_model(DEFAULT_PAIR[0])  # as the command line: bf16 where it is fast
    draft = load_model(DEFAULT_PAIR[1], quant="int8")
    engine = SpeculativeDecoder(verifier, draft, METHODS["SpS"])
    engine.generate(PROMPTS[0][0], 4)  # pages both models in
    configs = [(m, shaped) for m in METHODS for shaped in (False, True)]
    for i, (prompt, schema) in enumerate(PROMPTS[: args.n]):
        order = configs[i % len(configs) :] + configs[: i % len(configs)]
        for method, shaped in order:
            config = f"{method}{' + schema' if shaped else ''}"
            if (i, config) in done:
                continue
            grammar = Grammar.json_schema(schema) if shaped else None
            result = engine.generate(
                prompt, args.max_new_tokens, seed=i, spec=METHODS[method], grammar=grammar
            )
            line = {"prompt": i, "config": config, "text": result.text, **measures(result)}
            if shaped:
                line["valid"] = valid(result.text, schema)
            with results.open("a") as f:
                f.write(json.dumps(line) + "\n")
            print(f"prompt {i} {config}: {line['tokens_per_s']:.2f} tokens/s", file=sys.stderr)
    dtype = str(next(verifier.model.parameters()).dtype).removeprefix("torch.")
    (args.out / "summary.md").write_text(summary(read(results), args, dtype))


def measures(result) -> dict:
    s = result.stats
    return {
        "new_tokens": s.new_tokens,
        "tokens_per_s": s.tokens_per_s,
        "mean_accepted": s.mean_accepted,
        "iterations": s.iterations,
        "kl_nats_per_token": s.kl_nats_per_token,
        "grammar_ms_per_token": 1000 * s.time_grammar_s / max(1, s.new_tokens),
        "finish_reason": result.finish_reason,
    }


def valid(text: str, schema: dict) -> bool:
    try:
        return jsonschema_rs.validator_for(schema).is_valid(json.loads(text))
    except ValueError:
        return False


def cpu() -> str:
    """The CPU's model name and its widest vector extensions (they set the kernels)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name")), platform.machine())  # fmt: skip
    flags = set(next((line for line in info.splitlines() if line.startswith("flags")), "").split())
    wide = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile") if f in flags]
    return f"{name} ({', '.join(wide) or 'no AVX2'})"


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def summary(rows: list[dict], args, verifier_dtype: str) -> str:
    lines = [
        "# Structured output's cost on the default pair",
        "",
        f"{cpu()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}; verifier {verifier_dtype}, int8 draft, K = 10, temperature "
        "0.6, top-k 20, top-p 0.95, "
        f"{args.max_new_tokens} new tokens, {args.n} prompts (seed i for prompt i); "
        "`python benchmarks/structured_bench.py`.",
        "",
        "| configuration | tokens/s median [min, max] | mean accepted | tokens | grammar ms/token "
        "| KL nats/token | valid |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == config]
        speed = [r["tokens_per_s"] for r in mine]
        checked = [r["valid"] for r in mine if "valid" in r]
        lines.append(
            f"| {config} | {statistics.median(speed):.2f} [{min(speed):.2f}, {max(speed):.2f}] "
            f"| {statistics.mean(r['mean_accepted'] for r in mine):.2f} "
            f"| {statistics.mean(r['new_tokens'] for r in mine):.0f} "
            f"| {statistics.median(r['grammar_ms_per_token'] for r in mine):.2f} "
            f"| {statistics.mean(r['kl_nats_per_token'] for r in mine):.4f} "
            f"| {f'{sum(checked)}/{len(checked)}' if checked else '-'} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
