"""What one lean forward costs: a model at each quantisation and int8 kernel, T new tokens
for each of --rows rows after a context of cached tokens each (200, or --context; 0 times a
prefill), with the cache in each of --caches (the model's dtype, or bfloat16 as a draft's),
median and spread over repetitions, configurations alternating; the logits of every new
token, or of the last --keep (1: what a prompt read asks).

    python benchmarks/forward_cost.py --model qwen-coder-0.5b --tokens 1,11 \\
        --configs int8:native,int8:vnni,int8:fbgemm,int4,none:native,none:onednn,int8:native@32768
    python benchmarks/forward_cost.py --configs int8:native@32768 --tokens 1 --rows 8 \\
        --context 1000 --caches model,bfloat16                   # a draft step at 8 rows

A configuration is a quantisation (none, int8, int4) and the kernel: ``native``
(cactus_spec.backends.native: int8 on AMX tiles where the CPU has them, bfloat16 on AMX
for none), ``vnni`` (the native int8 kernel built without AMX, CACTUS_SPEC_ISA=avx512) or torch's
fallback (``fbgemm`` for int8, ``onednn`` for bfloat16); ``@N`` keeps only the N most
frequent tokens in the LM head (``loading.head_vocab``, a truncated draft head). Each configuration
loads its own copy of the model; the rounds run every configuration once per repetition,
so drifts of a shared machine fall on all of them alike.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch

from cactus_spec import isa
from cactus_spec.backends import native
from cactus_spec.backends.lean import KVCache, LeanModel
from cactus_spec.loading.models import load_model

CONTEXT = 200
CACHES = {"model": None, "bfloat16": torch.bfloat16}  # None: the model's dtype


def environment(config: str) -> dict[str, str]:
    """The switches a configuration's kernel needs while it loads and runs."""
    kernel = config.partition("@")[0].partition(":")[2]
    return {
        "CACTUS_SPEC_NATIVE": "0" if kernel in ("fbgemm", "onednn") else "1",
        "CACTUS_SPEC_ISA": "avx512" if kernel == "vnni" else os.environ.get("CACTUS_SPEC_ISA", ""),
    }


@contextlib.contextmanager
def switched(config: str):
    """Run the block with the configuration's kernel switches, then restore them."""
    saved = {name: os.environ.get(name) for name in environment(config)}
    os.environ.update(environment(config))
    isa.chosen.cache_clear()
    native.load.cache_clear()
    native.load()  # found again here, not inside a timed forward
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value
        isa.chosen.cache_clear()
        native.load.cache_clear()  # the native models find the kernels again


def load(model: str, config: str) -> LeanModel:
    weights, _, head = config.partition("@")
    with switched(config):
        quant = weights.partition(":")[0]
        return LeanModel(
            load_model(model, quant=quant, head_vocab=int(head) if head else None).model
        )


def filled(lean: LeanModel, config: str, rows: int, size: int, context: int, dtype) -> KVCache:
    """A cache in ``dtype`` (None: the model's) for ``rows`` rows of ``size`` tokens, each
    holding ``context`` tokens read."""
    cache = lean.new_cache(rows, size, dtype)
    with switched(config):
        if context:
            lean(torch.randint(0, 1000, (rows, context)), cache, keep=1)
    return cache


def forward_ms(lean: LeanModel, config: str, tokens: int, cache: KVCache, context: int,
               keep: int = 0) -> float:  # fmt: skip
    """One forward of ``tokens`` new tokens a row after ``context`` cached ones, in ms."""
    cache.lengths[:] = context
    with switched(config):
        start = time.perf_counter()
        lean(torch.randint(0, 1000, (cache.lengths.shape[0], tokens)), cache, keep=keep)
        return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen-coder-0.5b")
    parser.add_argument("--tokens", default="1,11", help="new tokens per forward, e.g. 1,11")
    parser.add_argument("--configs", default="int8:native,int8:fbgemm")
    parser.add_argument("--context", type=int, default=CONTEXT, help="cached tokens (0: prefill)")
    parser.add_argument("--keep", type=int, default=0, help="logits of the last N (0: all)")
    parser.add_argument("--rows", type=int, default=1, help="rows fed together")
    parser.add_argument("--caches", default="model", help=f"cache dtypes: {', '.join(CACHES)}")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    unknown = set(args.caches.split(",")) - set(CACHES)
    if unknown:
        parser.error(
            f"--caches: unknown {', '.join(sorted(unknown))}; choose from {', '.join(CACHES)}"
        )
    configs = args.configs.split(",")
    models = {c: load(args.model, c) for c in configs}
    sizes = [int(t) for t in args.tokens.split(",")]
    runs = [(c, d) for c in configs for d in args.caches.split(",")]
    size = args.context + max(sizes)
    caches = {
        (c, d): filled(models[c], c, args.rows, size, args.context, CACHES[d]) for c, d in runs
    }
    times: dict[tuple[str, str, int], list[float]] = {(*run, t): [] for run in runs for t in sizes}
    for rep in range(args.reps + 1):
        for c, d in runs:
            for t in sizes:
                ms = forward_ms(models[c], c, t, caches[c, d], args.context, args.keep)
                if rep:  # the first round warms up
                    times[c, d, t].append(ms)
    print(f"{args.model}, {args.threads} threads, {args.rows} rows after {args.context} tokens, "
          f"median [min, max] ms over {args.reps}")  # fmt: skip
    for (c, d, t), values in times.items():
        print(
            f"  {c:14s} {d:8s} cache T={t:3d}: {statistics.median(values):7.1f} "
            f"[{min(values):.1f}, {max(values):.1f}]"
        )


if __name__ == "__main__":
    main()
