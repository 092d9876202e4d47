"""Decode a fixed grid and write every token, to show a refactor changed no output.

The grid: two model pairs (SmolLM2-135M verifying its own int8 copy, and the default pair),
the methods AR, SpS, Cactus(delta = 0.5) in closed form and exact, and TAS, each with every
registered drafter (``core.drafters.DRAFTERS``: model and n-gram); every configuration alone
(one row) and five rows of mixed methods decoded together; seeds 0, 1, 2; 64 new tokens at
the default sampling.

    python benchmarks/token_grid.py --out A.jsonl            # decode (resumes a partial file)
    python benchmarks/token_grid.py --compare A.jsonl B.jsonl

``--compare`` exits 1 and names the first differing case unless both files hold the same
cases with the same tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cactus_spec.core.drafters import DEFAULT_DRAFTER, DRAFTERS

PAIRS = {
    "smollm2": ("smollm2-135m", "smollm2-135m"),
    "default": ("qwen-coder-1.5b", "qwen-coder-0.5b"),
}
METHODS = {
    "ar": ("ar", {}),
    "sps": ("sps", {}),
    "cactus-0.5": ("cactus", {"delta": 0.5}),
    "cactus-0.5-exact": ("cactus", {"delta": 0.5, "exact": True}),
    "tas": ("tas", {}),
}
SEEDS = (0, 1, 2)
NEW_TOKENS = 64
K = 6
PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 100 and say why each is prime.",
    "def quicksort(xs):",
    "Translate 'good morning, friends' into French and Spanish.",
)
#: The five rows of a mixed batch: one method each, in row order.
MIXED = ("sps", "cactus-0.5", "ar", "tas", "cactus-0.5-exact")


def cases() -> list[dict]:
    """Every case of the grid, in the order it is decoded."""
    out = []
    for pair in PAIRS:
        for drafter in DRAFTERS:
            for seed in SEEDS:
                for method in METHODS:
                    if method == "ar" and drafter != DEFAULT_DRAFTER:
                        continue  # AR drafts nothing: the default drafter's case covers it
                    out.append({"pair": pair, "drafter": drafter, "seed": seed, "rows": [method]})
                out.append({"pair": pair, "drafter": drafter, "seed": seed, "rows": list(MIXED)})
    return out


def key(case: dict) -> str:
    return f"{case['pair']}/{case['drafter']}/seed{case['seed']}/{'+'.join(case['rows'])}"


def spec_of(method: str, drafter: str):
    from cactus_spec.core.spec import DecodeSpec

    name, params = METHODS[method]
    if name == "ar":
        return DecodeSpec.of("ar")
    return DecodeSpec.of(name, **params, num_draft_tokens=K, drafter=drafter)


def decode(engine, case: dict) -> list[list[int]]:
    """The new tokens of every row of ``case``, all rows decoded together."""
    from cactus_spec.core.sampling import SamplingConfig
    from cactus_spec.runtime.generation import Request

    requests = [
        Request(
            prompt_ids=engine.encode(PROMPTS[row]),
            max_new_tokens=NEW_TOKENS,
            seed=case["seed"] + 1000 * row,
            spec=spec_of(method, case["drafter"]),
        )
        for row, method in enumerate(case["rows"])
    ]
    return [r.token_ids for r in engine.decode_many(requests, SamplingConfig())]


def run(out: Path) -> None:
    from cactus_spec.runtime.engine import SpeculativeDecoder

    done = set()
    if out.exists():
        lines = out.read_text().splitlines()
        done = {json.loads(line)["case"] for line in lines if line.strip()}
    todo = [c for c in cases() if key(c) not in done]
    engines: dict[tuple[str, str], object] = {}
    with out.open("a") as sink:
        for case in todo:
            target, draft = PAIRS[case["pair"]]
            slot = (case["pair"], case["drafter"])
            if slot not in engines:
                engines.clear()
                model_draft = draft if DRAFTERS[case["drafter"]].needs_draft_model else None
                spec = spec_of("sps", case["drafter"])
                engines[slot] = SpeculativeDecoder(target, model_draft, spec, max_batch=len(MIXED))
            tokens = decode(engines[slot], case)
            sink.write(json.dumps({"case": key(case), "tokens": tokens}) + "\n")
            sink.flush()
            print(key(case), [len(t) for t in tokens], file=sys.stderr)


def compare(a: Path, b: Path) -> int:
    def load(path: Path) -> dict[str, list]:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return {row["case"]: row["tokens"] for row in rows}

    left, right = load(a), load(b)
    if set(left) != set(right):
        print(f"different cases: {sorted(set(left) ^ set(right))[:5]}")
        return 1
    for name in left:
        if left[name] != right[name]:
            print(f"tokens differ in {name}")
            return 1
    tokens = sum(len(t) for rows in left.values() for t in rows)
    print(f"identical: {len(left)} cases, {tokens} tokens")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="JSONL file of every case's tokens")
    parser.add_argument("--compare", type=Path, nargs=2, metavar=("A", "B"))
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    if args.out is None:
        parser.error("--out or --compare is required")
    run(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
