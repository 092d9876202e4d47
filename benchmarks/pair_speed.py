"""Decode speed of the default pair through the engine, configurations alternating prompt by
prompt.

    python benchmarks/pair_speed.py --draft-quant int8,int4 --n 8

Loads the verifier (dtype and weight format as given) and the draft in each format given
once, warms them up, then runs AR and, for each draft, SpS and Cactus(delta = 1), K = 10,
on the first N HumanEval prompts, 128 new tokens at the paper's sampling settings, every
configuration on one prompt before the next prompt. Tokens/s include the prefill, as in
``cactus-spec bench``; draft per token is the draft's time per drafted token. For
side-by-side figures with peers use ``cactus-spec bench``.
"""

from __future__ import annotations

import argparse
import resource

import torch

from cactus_spec import DecodeSpec, SpeculativeDecoder
from cactus_spec.backends.quant import QUANTS
from cactus_spec.bench.tasks import humaneval_items
from cactus_spec.loading.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verifier-dtype", default="bfloat16")
    parser.add_argument("--verifier-quant", default="none", choices=QUANTS)
    parser.add_argument("--draft-quant", default="int8", help=f"comma-separated, of {QUANTS}")
    parser.add_argument("--n", type=int, default=2, help="HumanEval prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(2)
    target = load_model("qwen-coder-1.5b", dtype=args.verifier_dtype, quant=args.verifier_quant)
    drafts = {q: load_model("qwen-coder-0.5b", quant=q) for q in args.draft_quant.split(",")}
    print(f"peak RSS after loading: {peak_rss_gb():.2f} GB")
    prompts = [item.prompt for item in humaneval_items(args.n)]
    sps = DecodeSpec.of("sps", num_draft_tokens=10)
    cactus = DecodeSpec.of("cactus", delta=1.0, num_draft_tokens=10)
    decoders = {"AR": SpeculativeDecoder(target, spec=DecodeSpec.of("ar"))}
    for quant, draft in drafts.items():
        decoders[f"SpS K10, {quant} draft"] = SpeculativeDecoder(target, draft, sps)
        decoders[f"Cactus(1) K10, {quant} draft"] = SpeculativeDecoder(target, draft, cactus)
    for decoder in decoders.values():
        decoder.generate(prompts[0], 8)  # page weights in
    setup = f"verifier {args.verifier_dtype}/{args.verifier_quant}"
    for index, prompt in enumerate(prompts):
        for name, decoder in decoders.items():
            s = decoder.generate(prompt, args.max_new_tokens, seed=index).stats
            per_draft = 1e3 * s.time_draft_s / max(s.drafted, 1)
            print(
                f"{setup} | {name} | prompt {index} | {s.tokens_per_s:.2f} tok/s | "
                f"mean accepted {s.mean_accepted:.2f} | draft {per_draft:.1f} ms/token | "
                f"verify {s.time_verify_s:.1f} s | total {s.time_total_s:.1f} s",
                flush=True,
            )
    print(f"peak RSS after decoding ({setup}): {peak_rss_gb():.2f} GB")


def peak_rss_gb() -> float:
    """The process's peak resident set so far, in GB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


if __name__ == "__main__":
    main()
