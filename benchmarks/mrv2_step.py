"""What does the plugin add to one verification in vLLM's Model Runner V2? On a CUDA GPU.

Times MRV2's own ``rejection_sample`` (vLLM's Triton kernels) against the plugin's
(``sampler_v2``) on one synthetic batch: B requests x K drafts over a V-token vocabulary,
bf16 logits (``--support top20``: cut to their top 20, as the paper's sampling leaves them;
``full``: full support), drafts the verifier's argmax, every row asking for the named rule.
Median [min, max] of ``--calls`` calls, ms. Needs vLLM's ``rejection_sampler_utils`` importable
(an installed vLLM, or its kernel file and ``sample/gumbel.py`` on ``PYTHONPATH``).

    python benchmarks/mrv2_step.py --batch 8 64 256 --support top20
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

import torch

from cactus_spec.core.spec import DecodeSpec
from cactus_spec.integrations.vllm import sampler_v2
from cactus_spec.integrations.vllm.meter import Meter

KERNELS = "vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils"
CACTUS = DecodeSpec.of("cactus", delta=1.0)
ROWS = (  # label, plugin?, spec, draft logits?
    ("vLLM's own, one-hot drafts", False, None, False),
    ("plugin, nobody asks", True, None, False),
    ("plugin, SpS rows (metered)", True, DecodeSpec.of("sps"), False),
    ("plugin, Cactus chains, one-hot", True, CACTUS, False),
    ("vLLM's own, draft logits", False, None, True),
    ("plugin, Cactus chains, draft logits", True, CACTUS, True),
    ("plugin, Cactus blocks, draft logits", True,
     DecodeSpec.of("cactus", delta=1.0, verification="block"), True),
)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--support", choices=("top20", "full"), default="top20")
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--meter-off", action="store_true", help="the plugin without its meter")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("MRV2's kernels are Triton kernels: this needs a CUDA GPU")
    kernels = importlib.import_module(KERNELS).rejection_sample
    print(f"{torch.cuda.get_device_name(0)}, K = {args.k}, V = {args.vocab}, {args.support}")
    for batch in args.batch:
        inputs = synthetic(batch, args.k, args.vocab, args.support)
        meter = Meter()
        meter.active = not args.meter_off
        plugin = sampler_v2.make_rejection_sample(kernels, meter)
        for label, ours, spec, probabilistic in ROWS:
            ms = timed(plugin if ours else kernels, inputs, spec, probabilistic, batch, args.calls)
            median, low, high = statistics.median(ms), min(ms), max(ms)
            print(f"B = {batch:4d}  {label:38s} {median:8.2f} [{low:.2f}, {high:.2f}]")


def synthetic(batch: int, k: int, vocab: int, support: str) -> dict:
    """The arguments of one call, on the GPU (draft logits under ``draft_logits_keep``)."""
    device = "cuda"
    gen = torch.Generator(device=device).manual_seed(0)
    lines = batch * (k + 1)
    logits = 3 * torch.randn(lines, vocab, device=device, generator=gen)  # [L, V]
    if support == "top20":
        logits[logits < logits.topk(20, -1).values[:, -1:]] = -torch.inf
    drafts = logits.view(batch, k + 1, vocab)[:, :k].argmax(-1)  # [B, K]
    first = torch.zeros(batch, 1, dtype=torch.long, device=device)
    rows = torch.arange(batch, dtype=torch.int32, device=device)
    return {
        "target_logits": logits.to(torch.bfloat16),
        "draft_logits_keep": torch.randn(batch, k, vocab, device=device, generator=gen).bfloat16(),
        "draft_sampled": torch.cat([first, drafts], 1).flatten(),
        "cu_num_logits": torch.arange(0, lines + 1, k + 1, dtype=torch.int32, device=device),
        "pos": torch.arange(k + 1, device=device).repeat(batch) + 100,
        "idx_mapping": rows,
        "expanded_idx_mapping": rows.repeat_interleave(k + 1),
        "expanded_local_pos": torch.arange(k + 1, dtype=torch.int32, device=device).repeat(batch),
        "temperature": torch.ones(batch, device=device),
        "seed": torch.arange(batch, device=device),
        "num_speculative_steps": k,
    }


def timed(call, inputs: dict, spec, probabilistic: bool, batch: int, calls: int) -> list[float]:
    arguments = {key: value for key, value in inputs.items() if key != "draft_logits_keep"}
    arguments["draft_logits"] = inputs["draft_logits_keep"] if probabilistic else None
    block = spec is not None and spec.verification == "block"
    sampler_v2.Current.requests = {i: (f"r{i}", spec) for i in range(batch)}
    try:
        times = []
        for _ in range(calls + 5):
            torch.cuda.synchronize()
            start = time.perf_counter()
            call(**arguments, use_block_verification=block)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
    finally:
        sampler_v2.Current.requests = None
    return times[5:]  # the first calls compile


if __name__ == "__main__":
    main()
