"""The cost of judging one draft tree: top down (``verify_tree``) against leaf to root
(``verify_traversal``), on rows of the default pair's vocabulary.

    python benchmarks/tree_walks.py --device cpu --branches 2,4 --k 6

For each width b a tree of depth K with b nodes per depth (the root's b children, then b
chains below them) gets random target and draft rows [N+1, V] / [N, V] (V = 151,936, the
paper's sampling applied to random logits, so the walks reject often); both walks judge it
``--rounds`` times, alternating, and the median milliseconds of each are printed. Set it
beside a verifier forward's cost (``forward_cost.py``, ``gpu_engine.py``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from cactus_spec.core.sampling import SamplingConfig, logits_to_probs
from cactus_spec.core.traversal_verification import verify_traversal
from cactus_spec.core.tree_verification import ROOT, TokenTree, verify_tree

V = 151_936


def tree_of(branches: int, k: int) -> TokenTree:
    """b children of the root, each the head of a chain of K nodes (b K nodes)."""
    tokens, parents = [], []
    for b in range(branches):
        parent = ROOT
        for _ in range(k):
            tokens.append(b)
            parents.append(parent)
            parent = len(tokens) - 1
    return TokenTree(tuple(tokens), tuple(parents))


def rows(tree: TokenTree, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets [N+1, V] and draft rows [N, V] with each node's token likely under both."""
    g = torch.Generator().manual_seed(0)
    n, sampling = len(tree.tokens), SamplingConfig()
    q_logits = torch.randn(n + 1, V, generator=g) * 3
    p_logits = q_logits[1:] + torch.randn(n, V, generator=g)
    for j, token in enumerate(tree.tokens):  # node j's token likely in its parent's rows
        for logits, row in ((q_logits, tree.parents[j] + 1), (p_logits, siblings_row(tree, j))):
            logits[row, token] = logits[row].max() + 0.5
    q = logits_to_probs(q_logits, sampling).to(device)
    p = logits_to_probs(p_logits, sampling).to(device)
    return q, p


def siblings_row(tree: TokenTree, node: int) -> int:
    """The draft row node's siblings were all drawn from (the first sibling's)."""
    return tree.children[tree.parents[node]][0]


def timed(work: dict, device: str, rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in work}
    for r in range(rounds):
        for name in work if r % 2 == 0 else reversed(list(work)):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            work[name]()
            if device == "cuda":
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) * 1000)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--branches", default="2,4")
    parser.add_argument("--k", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    for branches in [int(b) for b in args.branches.split(",")]:
        tree = tree_of(branches, args.k)
        q, p = rows(tree, args.device)
        g = torch.Generator(args.device).manual_seed(0)
        work = {
            "top-down": partial(verify_tree, tree, q, p, g),
            "leaf-to-root": partial(verify_traversal, tree, q, p, g),
        }
        medians = timed(work, args.device, args.rounds)
        cells = ", ".join(f"{name} {ms:.2f} ms" for name, ms in medians.items())
        print(f"{args.device} b={branches} K={args.k} ({len(tree.tokens)} nodes): {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
