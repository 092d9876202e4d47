"""Single Cactus requests after 8 and 16 SpS clients on a fresh server (REPORT: "What limits
the AVX512-BF16 duel"); run from the repository root."""

import argparse
import sys
from pathlib import Path

import openai

sys.path.insert(0, "benchmarks")
import serve_bench as sb  # noqa: E402

from cactus_spec.bench.tasks import humaneval_items  # noqa: E402


def main() -> None:
    args = argparse.Namespace(
        verifier=sb.DEFAULT_PAIR[0], draft=sb.DEFAULT_PAIR[1], verifier_quant="int8", max_k=10,
        server_args="--no-prefix-cache",
    )  # fmt: skip
    *prompts, spare = [item.prompt for item in humaneval_items(33)]
    with sb.served(args, 16, Path("policy-after-load-server.log")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=3600)
        for method in ("ar", "sps", "cactus"):
            sb.one_request(client, "bench", spare, sb.METHODS[method], 96, 0)
        for method, clients in (("sps", 8), ("sps", 16), ("cactus", 1), ("cactus", 1)):
            row = sb.run_config(client, "bench", prompts, sb.METHODS[method], clients, 96)
            print(method, clients, round(row["tokens_per_s"], 1), "ITL",
                  round(row["itl_p50_s"] * 1e3, 1), "mean K", round(row["mean_k"], 2), "acc",
                  row["acceptance"], flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
