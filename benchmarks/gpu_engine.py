"""The engine on a GPU at the default pair's shapes: forward costs and batched throughput.

    python benchmarks/gpu_engine.py --verifier-config V.json --draft-config D.json

The default pair's weights cannot travel to a lent GPU machine (no network there, a 64 MiB
limit on what travels), so both models are built from their ``config.json`` with random
bfloat16 weights: speed does not depend on the weights' values, acceptance does, so this
measures costs, not speedups. Prints, one line each:

- verifier forward of B rows x T tokens (T = 1 and 11) after a 256-token context: ms;
- verifier forward of B rows x a draft tree of N nodes (``branches`` chains of 6 from the
  root, as ``verification = "tree"`` drafts them; N = 12, 24, 48) with its tree mask: ms;
- one draft step over B rows: ms, and c = draft step / verifier step at the same B;
- batched autoregressive decoding through the engine's rows, B rows x 128 new tokens: tokens/s;
- Hugging Face ``generate`` (greedy, static shapes off) at B = 1 for comparison: tokens/s.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.loading.backend import make_backend
from cactus_spec.loading.models import as_loaded
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.runtime.generation import Request

BATCHES = (1, 4, 8, 16)
CONTEXT = 256


def random_model(path: str) -> torch.nn.Module:
    with open(path, encoding="utf-8") as f:
        config = AutoConfig.for_model(**json.load(f))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def least_ms(backend, rows: int, feed, undo) -> float:
    """The least of five timed ``feed()`` calls after a CONTEXT-token prefix in each of
    ``rows`` rows, ``undo(row)`` after each."""
    for row in range(rows):
        backend.append_ragged([[1] * CONTEXT], [row], last_only=True)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        feed()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        for row in range(rows):
            undo(row)
    backend.reset()
    return 1000 * min(times)


def forward_ms(backend, tokens: int, rows: int) -> float:
    """One forward of ``tokens`` tokens in each row."""
    ids, at = [[1] * tokens for _ in range(rows)], list(range(rows))
    return least_ms(
        backend,
        rows,
        lambda: backend.append_ragged(ids, at),
        lambda row: backend.rollback(CONTEXT, row),
    )


def tree_ms(backend, branches: int, rows: int, depth: int = 6) -> float:
    """One forward of ``branches`` chains of ``depth`` nodes from the root in each row."""
    parents = [j - 1 if j % depth else -1 for j in range(branches * depth)]
    ids, at = [[2] * len(parents)] * rows, list(range(rows))
    return least_ms(
        backend, rows, lambda: backend.append_tree(ids, [parents] * rows, at),
        lambda row: backend.commit_path([], row),
    )  # fmt: skip


def ar_tokens_per_s(engine: SpeculativeDecoder, rows: int, new: int) -> float:
    ar = DecodeSpec.of("ar")
    gens = [
        engine.new_generation(
            Request(
                prompt_ids=[1 + r] * 32,
                max_new_tokens=new,
                sampling=SamplingConfig(),
                seed=r,
                spec=ar,
            ),
            r,
        )
        for r in range(rows)
    ]
    engine.prefill(gens)
    torch.cuda.synchronize()
    start = time.perf_counter()
    while active := [g for g in gens if not g.done]:
        engine.step(active, [0] * len(active))
    torch.cuda.synchronize()
    return sum(len(g.new_ids) for g in gens) / (time.perf_counter() - start)


def hf_tokens_per_s(model, new: int) -> float:
    ids = torch.full((1, 32), 1, device="cuda")
    model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=new, do_sample=False, min_new_tokens=new)
    torch.cuda.synchronize()
    return new / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verifier-config", required=True)
    parser.add_argument("--draft-config", required=True)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    verifier, draft = random_model(args.verifier_config), random_model(args.draft_config)
    verifier = as_loaded("verifier", verifier, device="cuda")
    draft = as_loaded("draft", draft, device="cuda")
    v_backend = make_backend(verifier, "auto", max(BATCHES))
    d_backend = make_backend(draft, "auto", max(BATCHES))
    for rows in BATCHES:
        one = forward_ms(v_backend, 1, rows)
        block = forward_ms(v_backend, 11, rows)
        step = forward_ms(d_backend, 1, rows)
        print(
            f"B={rows:>2}: verifier T=1 {one:6.2f} ms, T=11 {block:6.2f} ms "
            f"(v = {block / one:.2f}); draft step {step:6.2f} ms (c = {step / one:.2f})"
        )
    for rows in (1, 8):
        one = forward_ms(v_backend, 1, rows)
        trees = ", ".join(f"N={6 * b} {tree_ms(v_backend, b, rows):6.2f} ms" for b in (2, 4, 8))
        print(f"B={rows:>2}: verifier on draft trees: {trees} (T=1 {one:6.2f} ms)")
    del v_backend, d_backend
    engine = SpeculativeDecoder(verifier, spec=DecodeSpec.of("ar"), max_batch=max(BATCHES))
    for rows in BATCHES:
        rate = ar_tokens_per_s(engine, rows, args.new_tokens)
        print(f"AR through the engine's rows, B={rows:>2}: {rate:7.1f} tokens/s")
    rate = hf_tokens_per_s(verifier.model, args.new_tokens)
    print(f"HF generate, B= 1: {rate:7.1f} tokens/s")


if __name__ == "__main__":
    main()
