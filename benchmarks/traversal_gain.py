"""What judging a draft tree leaf to root keeps over judging it top down, on the same trees.

    python benchmarks/traversal_gain.py --task gsm --n 4 --k 6 --branches 2,4 --repeats 100

Decodes each item with the default pair (int8 draft, paper sampling, 128 new tokens) by
``--method`` with ``verification = tree``. At every iteration the drafted tree and its judged
rows (q for SpS, the per-node targets for Cactus) are judged ``--repeats`` more times by each
walk, ``verify_tree`` (top down) and ``verify_traversal`` (leaf to root), with fresh uniforms,
and the mean number of drafts each keeps is added up. Both walks see the same trees, so the
ratio's noise is that of verification alone, not of drafting or of the texts the decoding
happens to take.
Prints one line per item and a total per tree width; ``--out FILE`` keeps them as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from cactus_spec.bench.tasks import TaskSpec, load_items
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.core.traversal_verification import verify_traversal
from cactus_spec.core.tree_verification import verify_tree
from cactus_spec.loading.catalog import DEFAULT_PAIR
from cactus_spec.loading.models import load_model
from cactus_spec.runtime import stepper
from cactus_spec.runtime.engine import SpeculativeDecoder


class Rejudge:
    """Wraps the stepper's tree walk: each call is judged again by both walks."""

    def __init__(self, repeats: int) -> None:
        self.repeats, self.kept, self.trees = repeats, {"tree": 0.0, "traversal": 0.0}, 0
        self.generator = torch.Generator().manual_seed(0)

    def __call__(self, tree, q, probs, generator, greedy):
        for name, walk in (("tree", verify_tree), ("traversal", verify_traversal)):
            total = sum(
                len(walk(tree, q, probs, self.generator, greedy).path) for _ in range(self.repeats)
            )
            self.kept[name] += total / self.repeats
        self.trees += 1
        return verify_tree(tree, q, probs, generator, greedy)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="gsm", choices=("gsm", "humaneval"))
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--k", type=int, default=6)
    parser.add_argument("--branches", default="2,4")
    parser.add_argument("--method", default="sps", choices=("sps", "cactus"))
    parser.add_argument("--delta", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    verifier = load_model(DEFAULT_PAIR[0])
    draft = load_model(DEFAULT_PAIR[1], quant="int8")
    items = load_items(TaskSpec(args.task, args.n))
    params = {"delta": args.delta} if args.method == "cactus" else {}
    totals = {}
    for branches in [int(b) for b in args.branches.split(",")]:
        spec = DecodeSpec.of(
            args.method, num_draft_tokens=args.k, verification="tree", branches=branches, **params
        )
        decoder = SpeculativeDecoder(verifier, draft, spec)
        judge = Rejudge(args.repeats)
        stepper.verify_tree = judge  # every tree the stepper judges passes through both walks
        for index, item in enumerate(items):
            before = dict(judge.kept), judge.trees
            decoder.generate(item.prompt, args.max_new_tokens, seed=index)
            line = {
                "method": args.method,
                "branches": branches,
                "item": item.id,
                "iterations": judge.trees - before[1],
                **{name: judge.kept[name] - before[0][name] for name in judge.kept},
            }
            _report(line, args.out)
        totals[branches] = dict(judge.kept), judge.trees
    for branches, (kept, trees) in totals.items():
        gain = kept["traversal"] / kept["tree"]
        print(
            f"{args.method} b={branches}: {trees} trees, kept per iteration "
            f"top-down {kept['tree'] / trees:.3f}, leaf-to-root {kept['traversal'] / trees:.3f} "
            f"({gain:.3f}x)"
        )
    return 0


def _report(line: dict, out: Path | None) -> None:
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()
    if out is not None:
        with out.open("a") as f:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
