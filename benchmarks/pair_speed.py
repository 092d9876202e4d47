"""Decode speed of the default pair through the engine, one configuration after another.

    python benchmarks/pair_speed.py --verifier-dtype float32 --verifier-quant int8 --n 2

Loads the verifier (dtype and weight format as given) and the int8 draft once, warms both
up, then runs AR, SpS (K = 6) and Cactus(delta = 1, K = 8 and 10) on the first N HumanEval
prompts, 128 new tokens at the paper's sampling settings. Tokens/s include the prefill,
as in ``cactus-spec bench``. For side-by-side figures with peers use ``cactus-spec bench``.
"""

from __future__ import annotations

import argparse
import resource

import torch

from cactus_spec import Cactus, SpeculativeDecoder, SpS
from cactus_spec.bench.tasks import humaneval_items
from cactus_spec.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verifier-dtype", default="bfloat16")
    parser.add_argument("--verifier-quant", default="none", choices=["none", "int8"])
    parser.add_argument("--n", type=int, default=2, help="HumanEval prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(2)
    target = load_model("qwen-coder-1.5b", dtype=args.verifier_dtype, quant=args.verifier_quant)
    draft = load_model("qwen-coder-0.5b", quant="int8")
    print(f"peak RSS after loading: {peak_rss_gb():.2f} GB")
    prompts = [item.prompt for item in humaneval_items(args.n)]
    SpeculativeDecoder(target, draft, SpS(), 4).generate(prompts[0], 4)  # page weights in
    configs = [
        ("AR", None, SpS(), 1),
        ("SpS K6", draft, SpS(), 6),
        ("Cactus(1) K8", draft, Cactus(1.0), 8),
        ("Cactus(1) K10", draft, Cactus(1.0), 10),
    ]
    setup = f"verifier {args.verifier_dtype}/{args.verifier_quant}, draft int8"
    for name, draft_model, rule, k in configs:
        decoder = SpeculativeDecoder(target, draft_model, rule, k)
        for index, prompt in enumerate(prompts):
            s = decoder.generate(prompt, args.max_new_tokens, seed=index).stats
            print(
                f"{setup} | {name} | prompt {index} | {s.tokens_per_s:.2f} tok/s | "
                f"mean accepted {s.mean_accepted:.2f} | draft {s.time_draft_s:.1f} s | "
                f"verify {s.time_verify_s:.1f} s | total {s.time_total_s:.1f} s",
                flush=True,
            )
    print(f"peak RSS after decoding ({setup}): {peak_rss_gb():.2f} GB")


def peak_rss_gb() -> float:
    """The process's peak resident set so far, in GB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


if __name__ == "__main__":
    main()
