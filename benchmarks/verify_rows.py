"""Verifying a batch's rows one at a time against one ``verify`` call over stacked rows.

    python benchmarks/verify_rows.py --rows 8,16

For B rows of the default pair's shape (K = 10 drafts, V = 151,936 tokens, the paper's
sampling) it times, alternating the two in one process (medians of 12 rounds):

- ``verify`` per row, each row's q [K+1, V] and p [K, V] as the stepper holds them;
- ``torch.stack`` of every row's q and p into [B, K+1, V] / [B, K, V], then one ``verify``
  with a generator per row (the same tokens: each row draws from its own generator);
- ``logits_to_probs`` per row against once over the block's logits (bitwise equal).

The stepper keeps the loop where stacking costs more than it saves.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cactus_spec.core.rules import Cactus, SpS
from cactus_spec.core.sampling import SamplingConfig, logits_to_probs
from cactus_spec.core.verification import verify

V, K = 151_936, 10
SAMPLING = SamplingConfig()


def rows(batch: int) -> tuple[list, list, list]:
    """q [K+1, V], p [K, V] and drafted ids [K] per row, from random logits."""
    g = torch.Generator().manual_seed(0)
    qs = [logits_to_probs(torch.randn(K + 1, V, generator=g) * 3, SAMPLING) for _ in range(batch)]
    ps = [logits_to_probs(torch.randn(K, V, generator=g) * 3, SAMPLING) for _ in range(batch)]
    ids = [torch.multinomial(p, 1, generator=g)[:, 0] for p in ps]
    return qs, ps, ids


def per_row(qs, ps, ids, rule) -> list[list[int]]:
    out = []
    for q, p, i in zip(qs, ps, ids, strict=True):
        gen = torch.Generator().manual_seed(1)
        result = verify(i[None], q[None], rule, p[None], gen, validate=False)
        out.append(result.tokens[0].tolist())
    return out


def stacked(qs, ps, ids, rule) -> list[list[int]]:
    gens = [torch.Generator().manual_seed(1) for _ in qs]
    result = verify(torch.stack(ids), torch.stack(qs), rule, torch.stack(ps), gens, validate=False)
    return result.tokens.tolist()


def timed(work, rounds: int = 12) -> dict[str, float]:
    """Median ms of each named callable, alternating their order every round."""
    times: dict[str, list[float]] = {name: [] for name in work}
    for r in range(rounds):
        for name in work if r % 2 == 0 else reversed(list(work)):
            start = time.perf_counter()
            work[name]()
            times[name].append(time.perf_counter() - start)
    return {name: 1000 * statistics.median(values) for name, values in times.items()}


def report(batch: int) -> None:
    """Print the three comparisons at ``batch`` rows."""
    qs, ps, ids = rows(batch)
    for rule in (SpS(), Cactus(1.0)):
        assert per_row(qs, ps, ids, rule) == stacked(qs, ps, ids, rule)
        ms = timed(
            {"per row": lambda r=rule: per_row(qs, ps, ids, r),
             "stacked": lambda r=rule: stacked(qs, ps, ids, r)}
        )  # fmt: skip
        print(f"B={batch} {rule!r}: " + ", ".join(f"{n} {v:.1f} ms" for n, v in ms.items()))
    flat = torch.randn(batch * (K + 1), V) * 3
    split = list(flat.split([K + 1] * batch))
    ms = timed(
        {"probs per row": lambda: [logits_to_probs(x, SAMPLING) for x in split],
         "probs once": lambda: logits_to_probs(flat.view(batch, K + 1, V), SAMPLING)}
    )  # fmt: skip
    print(f"B={batch}: " + ", ".join(f"{n} {v:.1f} ms" for n, v in ms.items()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="8,16")
    args = parser.parse_args()
    print(f"torch threads {torch.get_num_threads()}, V = {V}, K = {K}")
    for batch in (int(b) for b in args.rows.split(",")):
        report(batch)


if __name__ == "__main__":
    main()
