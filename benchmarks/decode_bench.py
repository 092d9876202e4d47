"""Decode speed on the default pair: our engine vs the verifier alone vs Hugging Face.

Methods, alternated prompt by prompt so machine drift cancels: AR (the verifier
alone through our engine, the denominator of every speedup), SpS, Cactus(1.0)
closed form and exact, TAS, SpS with the n-gram drafter, Hugging Face plain
`generate` and assisted generation (`assistant_model=draft, do_sample=True`).
Sampling: temperature 0.6, top-p 0.95, top-k 20 (the paper's settings).

K is chosen first, per method family, from --ks on the first --k-prompts prompts.
For each method the bound is the i.i.d. speedup (1 - a^(K+1)) / ((1 - a)(K c + v))
from its measured per-position acceptance a, draft cost c (one draft forward over
one verifier AR step) and block cost v (one verifier K+1 pass over one AR step).

    python benchmarks/decode_bench.py --out bench-out/decode [--tokens 128]

Writes results.jsonl (one line per prompt and method, appended as it goes) and
summary.md, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import time
from pathlib import Path

import torch

from cactus_spec.engine import SpeculativeDecoder
from cactus_spec.fetch import default_pair_paths
from cactus_spec.models import load_model
from cactus_spec.rules import TAS, Cactus, SpS

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function `is_palindrome(s)` that ignores case and punctuation.",
    "Implement binary search over a sorted list in Python, returning the index or -1.",
    "Write a Python class `Stack` with push, pop, peek and is_empty methods.",
    "Write a Python function that counts word frequencies in a string and returns a dict.",
    "Implement merge sort in Python with a short docstring.",
    "Write a Python function that flattens a nested list of arbitrary depth.",
    "Write a Python function that parses a CSV line with quoted fields into a list.",
]
SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
RULES = {"sps": SpS(), "cactus": Cactus(1.0), "cactus_exact": Cactus(1.0, exact=True), "tas": TAS()}


def run_engine(decoder: SpeculativeDecoder, prompt: str, tokens: int, seed: int) -> dict:
    result = decoder.generate(prompt, tokens, seed=seed, **SAMPLING)
    s = result.stats
    return {
        "new_tokens": s.new_tokens,
        "seconds": s.time_total_s,
        "tokens_per_s": s.tokens_per_s,
        "iterations": s.iterations,
        "drafted": s.drafted,
        "accepted": s.accepted,
        "reached": sum(s.reached_by_position),
        "mean_accepted": s.mean_accepted,
        "time_draft_s": s.time_draft_s,
        "time_verify_s": s.time_verify_s,
        "time_other_s": s.time_other_s,
        "kl_nats_per_token": s.kl_nats_per_token,
    }


def run_hf(target, draft, tokenizer, prompt: str, tokens: int, seed: int) -> dict:
    messages = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    torch.manual_seed(seed)
    extra = {"assistant_model": draft} if draft is not None else {}
    start = time.perf_counter()
    with torch.inference_mode():
        out = target.generate(
            ids,
            max_new_tokens=tokens,
            do_sample=True,
            pad_token_id=tokenizer.eos_token_id,
            **SAMPLING,
            **extra,
        )
    seconds = time.perf_counter() - start
    new = out.shape[1] - ids.shape[1]
    return {"new_tokens": new, "seconds": seconds, "tokens_per_s": new / seconds}


def iid_bound(row: dict, ar_step_s: float, k: int) -> tuple[float, float, float, float]:
    """(alpha, c, v, bound) from a run's acceptance and forward timings."""
    alpha = row["accepted"] / max(1, row["reached"])  # per-position acceptance
    c = row["time_draft_s"] / max(1, row["drafted"]) / ar_step_s
    v = row["time_verify_s"] / max(1, row["iterations"]) / ar_step_s
    gain = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
    return alpha, c, v, gain / (k * c + v)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        target_path, draft_path = default_pair_paths()
        self.target = load_model(target_path, dtype=args.dtype, threads=args.threads)
        self.draft = load_model(draft_path, dtype=args.dtype, threads=args.threads)
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.results = self.out / "results.jsonl"

    def decoder(self, method: str, k: int) -> SpeculativeDecoder:
        if method == "ar":
            return SpeculativeDecoder(self.target, None)
        if method == "ngram":
            return SpeculativeDecoder(self.target, None, SpS(), k, drafter="ngram")
        return SpeculativeDecoder(self.target, self.draft, RULES[method], k)

    def run(self, method: str, k: int, index: int, phase: str) -> dict:
        prompt, tokens, seed = PROMPTS[index], self.args.tokens, index
        if method in ("hf", "hf_assisted"):
            draft = self.draft.model if method == "hf_assisted" else None
            row = run_hf(self.target.model, draft, self.target.tokenizer, prompt, tokens, seed)
        else:
            row = run_engine(self.decoder(method, k), prompt, tokens, seed)
        row |= {"phase": phase, "method": method, "k": k, "prompt": index}
        with self.results.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
        return row

    def choose_k(self) -> dict[str, int]:
        """Best K by median tokens/s on the first prompts, for the model drafter and n-gram."""
        best: dict[str, int] = {}
        for method in ("sps", "cactus", "ngram"):
            speeds = {}
            for k in self.args.ks:
                rows = [self.run(method, k, i, "choose_k") for i in range(self.args.k_prompts)]
                speeds[k] = statistics.median(r["tokens_per_s"] for r in rows)
            best[method] = max(speeds, key=speeds.get)
        return best

    def main_phase(self, ks: dict[str, int]) -> list[dict]:
        methods = ["ar", "sps", "cactus", "cactus_exact", "tas", "ngram", "hf", "hf_assisted"]
        rows = []
        for index in range(len(PROMPTS)):
            order = methods if index % 2 == 0 else methods[::-1]  # alternate A/B order
            for method in order:
                k = (
                    ks["ngram"]
                    if method == "ngram"
                    else ks["cactus" if "cactus" in method else "sps"]
                )
                rows.append(self.run(method, k, index, "main"))
        return rows


def summarise(rows: list[dict], ks: dict[str, int]) -> str:
    by_prompt_ar = {r["prompt"]: r for r in rows if r["method"] == "ar"}
    lines = [
        "| method | K | tokens/s (median) | speedup vs AR (median [min, max]) | mean accepted "
        "| alpha | c | v | i.i.d. bound | measured / bound | other time | KL nats/token |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for method in ["ar", "sps", "cactus", "cactus_exact", "tas", "ngram", "hf", "hf_assisted"]:
        mine = [r for r in rows if r["method"] == method]
        ratios = [r["tokens_per_s"] / by_prompt_ar[r["prompt"]]["tokens_per_s"] for r in mine]
        speed = statistics.median(r["tokens_per_s"] for r in mine)
        cells = [
            method,
            str(mine[0]["k"]) if method not in ("ar", "hf", "hf_assisted") else "-",
            f"{speed:.2f}",
            f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]",
        ]
        if "drafted" in mine[0] and method != "ar":
            bounds = []
            for r in mine:
                ar = by_prompt_ar[r["prompt"]]
                bounds.append(iid_bound(r, ar["time_verify_s"] / ar["iterations"], r["k"]))
            alpha, c, v, bound = (statistics.median(b[i] for b in bounds) for i in range(4))
            other = sum(r["time_other_s"] for r in mine) / sum(r["seconds"] for r in mine)
            cells += [
                f"{statistics.median(r['mean_accepted'] for r in mine):.2f}",
                f"{alpha:.3f}",
                f"{c:.3f}",
                f"{v:.3f}",
                f"{bound:.2f}x",
                f"{statistics.median(ratios) / bound:.0%}",
                f"{other:.1%}",
                f"{statistics.median(r['kl_nats_per_token'] for r in mine):.4f}",
            ]
        elif method == "ar":
            other = sum(r["time_other_s"] for r in mine) / sum(r["seconds"] for r in mine)
            cells += ["-"] * 6 + [f"{other:.1%}", "0"]
        else:
            cells += ["-"] * 8
        lines.append("| " + " | ".join(cells) + " |")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    lines.append("")
    lines.append(
        f"Machine: {platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; peak RSS {peak:.2f} GB; chosen K: {ks}."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-out/decode")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--ks", type=int, nargs="+", default=[4, 6, 8, 10])
    parser.add_argument("--k-prompts", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    bench = Bench(args)
    ks = bench.choose_k()
    rows = bench.main_phase(ks)
    table = summarise(rows, ks)
    (bench.out / "summary.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
