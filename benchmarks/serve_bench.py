"""Serving benchmark: AR, SpS and Cactus(1) behind the OpenAI server at 1-16 concurrent clients.

    python benchmarks/serve_bench.py --out bench-out/serve
    python benchmarks/serve_bench.py --methods ar,sps,cactus,llama.cpp --llama-cpp DIR ...

Starts ``cactus-spec serve`` in its own process on loopback (default pair: bf16 verifier,
the draft's format auto; speculation policy auto, calibrated first; as many rows as the most
clients), then for each method and concurrency c runs c client threads in this process with
the official ``openai`` client, each streaming chat completions of HumanEval prompts one
after another (two per client, at least 4 in all), so requests join and leave a running
batch. Per configuration: total tokens/s (all completion tokens / wall time from the first
request to the last answer), time to first token and inter-token latency (p50, p95 over
requests; ITL = (last chunk - first chunk) / (tokens - 1)), every gap between two chunks of
a stream (p95 and max: what a running stream waits while new requests are read), acceptance,
mean K, KL per token. Before them, each method answers one prompt outside the measured ones
in full (untimed): a server's first requests ran 20% slower a token than later ones (held to
AVX2, 61-66 against 50-52 ms), and the first method measured would carry that. Methods
measured later find the measured prompts in the rows' prefix caches (the verifier's after
AR, both models' after SpS): ``--server-args=--no-prefix-cache`` compares them on unread
prompts.
Then ``--chats`` two-turn conversations at once, the second turn resending the history: the
TTFT of each turn (prefix caching reads only the second turn's new tokens).
The ``llama.cpp`` row is the peer: ``llama-server`` (built from ``--llama-cpp DIR`` as
``server_duel.py`` builds it, ``--llama-build`` level, AVX512 by default) on the verifier's
GGUF, plain decoding, 2 threads, started for each concurrency with as many parallel slots
(``-np``), the same clients and prompts, every prompt read (``cache_prompt: false``).
``--server-args`` passes more flags to the server and ``--label``
names the run, so runs of other code or flags keep their own lines. ``--rounds R`` measures
every configuration R times, the methods alternating at each concurrency within a round (each
round's order starting one method later), and reports each method's ratio to AR in the same
round, median [min, max]: a machine whose
speed drifts over minutes (runs minutes apart differing by up to 1.45x) biases whichever
configuration ran in its slow spell, and only ratios taken side by side cancel it.

Each configuration appends one line to ``results.jsonl`` as it finishes; a rerun skips those
done. ``summary.md`` and ``tokens_per_s.png`` are rewritten from the whole file.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
from launcher import free_port, launched
from server_duel import build

from cactus_spec.bench.tasks import humaneval_items
from cactus_spec.files import write_text_atomic
from cactus_spec.loading.catalog import DEFAULT_PAIR
from cactus_spec.loading.model_store import known_gguf_path

#: The peer's row: llama-server, plain decoding, ``-np`` as many slots as clients.
PEER = "llama.cpp"

#: name -> the request's "speculative" object (no num_draft_tokens: the policy picks K);
#: None: the peer, llama.cpp's ``llama-server`` with as many parallel slots as clients.
METHODS: dict[str, dict | None] = {
    "ar": {"method": "ar"},
    "sps": {"method": "sps"},
    "cactus": {"method": "cactus", "delta": 1.0},
    "cactus K=10 fixed": {"method": "cactus", "delta": 1.0, "num_draft_tokens": 10},
    PEER: None,
}
CONCURRENCY = (1, 4, 8, 16)
#: Requests per configuration: at least this many, and this many per client.
MIN_REQUESTS = 4
REQUESTS_PER_CLIENT = 2


def one_request(
    client, model: str, prompt: str, spec: dict | None, max_tokens: int, seed: int | None
) -> dict:
    """Stream one chat completion; its timings and usage (``spec`` None: to llama-server,
    which reads every prompt, as our server with ``--no-prefix-cache`` does)."""
    sent = time.perf_counter()
    stamps = []
    usage = None
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.6,
        top_p=0.95,
        seed=seed,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={
            "top_k": 20,
            **({"cache_prompt": False} if spec is None else {"speculative": spec}),
        },
    )
    pieces = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    tokens = usage.completion_tokens if usage is not None else len(stamps)
    extra = usage.model_extra.get("speculative", {}) if usage is not None else {}
    itl = (stamps[-1] - stamps[0]) / (tokens - 1) if tokens > 1 and len(stamps) > 1 else None
    return {
        "tokens": tokens,
        "text": "".join(pieces),
        "ttft_s": stamps[0] - sent if stamps else None,
        "itl_s": itl,
        "gaps_s": [b - a for a, b in itertools.pairwise(stamps)],
        "done": time.perf_counter(),
        "sent": sent,
        **{k: extra.get(k, 0) for k in ("iterations", "drafted_tokens", "accepted_tokens")},
        "kl_nats": extra.get("kl_nats", 0.0),
    }


def run_config(client, model, prompts, spec, concurrency, max_tokens) -> dict:
    """``concurrency`` clients, each sending its share of the requests one after another."""
    count = max(REQUESTS_PER_CLIENT * concurrency, MIN_REQUESTS)
    # a seeded request that leaves K open decodes at the server's K (so that it reproduces):
    # the policy's rows go unseeded
    seeded = spec is None or spec["method"] == "ar" or "num_draft_tokens" in spec
    jobs = [(prompts[i % len(prompts)], i if seeded else None) for i in range(count)]
    shares = [jobs[c::concurrency] for c in range(concurrency)]
    results: list[dict] = []
    lock = threading.Lock()

    def client_loop(share):
        for prompt, seed in share:
            result = one_request(client, model, prompt, spec, max_tokens, seed)
            with lock:
                results.append(result)

    threads = [threading.Thread(target=client_loop, args=(share,)) for share in shares]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return summarise(results, wall)


#: The second turn of each benchmark chat: the history (prompt, answer) and this.
FOLLOW_UP = "Now write three assert statements that test it."


def run_chats(client, model: str, prompts: list[str], chats: int, max_tokens: int) -> dict:
    """``chats`` conversations at once, each of two turns (Cactus, policy's K): a HumanEval
    prompt, then the whole history and ``FOLLOW_UP``; the TTFT of each turn, p50 and p95."""
    spec = METHODS["cactus"]
    turns: list[list[dict]] = [[], []]
    lock = threading.Lock()

    def chat(index: int) -> None:
        history = [{"role": "user", "content": prompts[index % len(prompts)]}]
        first = one_request(client, model, history, spec, max_tokens, index)
        history += [
            {"role": "assistant", "content": first["text"]},
            {"role": "user", "content": FOLLOW_UP},
        ]
        second = one_request(client, model, history, spec, 8, index)
        with lock:
            turns[0].append(first)
            turns[1].append(second)

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(chats)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = {}
    for turn, results in enumerate(turns, 1):
        ttft = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
        out[f"turn{turn}_ttft_p50_s"] = percentile(ttft, 50)
        out[f"turn{turn}_ttft_p95_s"] = percentile(ttft, 95)
    return out


def summarise(results: list[dict], wall: float) -> dict:
    tokens = sum(r["tokens"] for r in results)
    drafted = sum(r["drafted_tokens"] for r in results)
    iterations = sum(r["iterations"] for r in results)
    ttft = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    itl = [r["itl_s"] for r in results if r["itl_s"] is not None]
    gaps = [gap for r in results for gap in r["gaps_s"]]
    return {
        "requests": len(results),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p95_s": percentile(ttft, 95),
        "itl_p50_s": percentile(itl, 50),
        "itl_p95_s": percentile(itl, 95),
        "gap_p95_s": percentile(gaps, 95),
        "gap_max_s": max(gaps, default=None),
        "acceptance": sum(r["accepted_tokens"] for r in results) / drafted if drafted else None,
        "mean_k": drafted / iterations if iterations else 0.0,
        "kl_nats_per_token": None  # an unbounded divergence: JSON null (kl_unbounded)
        if any(r["kl_nats"] is None for r in results)
        else sum(r["kl_nats"] for r in results) / tokens,
    }


def rotated(methods: list[str], k: int) -> list[str]:
    """Round ``k``'s order of the methods: each round starts one later, so no method holds
    one place in every round (where nothing differs, the third of three read 2% slower)."""
    shift = k % len(methods)
    return methods[shift:] + methods[:shift]


def merge_rounds(rows: list[dict], ar: dict[tuple[int, int], float]) -> list[dict]:
    """One row per method and concurrency: each figure's median over the rounds, and
    ``vs_ar``, the ratios to AR's tokens/s in the same round."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["method"], r["concurrency"]), []).append(r)
    merged = []
    for (method, c), runs in groups.items():
        row = {"method": method, "concurrency": c, "rounds": len(runs)}
        for key in runs[0]:
            values = [r[key] for r in runs if isinstance(r.get(key), int | float)]
            if values and key not in row:
                row[key] = statistics.median(values)
        row.setdefault("acceptance", None)
        pairs = [(r["tokens_per_s"], ar.get((c, r.get("round", 0)))) for r in runs]
        row["vs_ar"] = [mine / theirs for mine, theirs in pairs if theirs]
        merged.append(row)
    return merged


def _spread(ratios: list[float]) -> str:
    """``1.02x`` for one ratio (or several equal: AR against itself), ``median [min, max]``
    for several."""
    if len(set(ratios)) == 1:
        return f"{ratios[0]:.2f}x"
    return f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]"


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def read_done(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_summary(out: Path, rows: list[dict], settings: dict) -> None:
    chats = [r for r in rows if r["method"] == "chat"]
    rows = [r for r in rows if r["method"] != "chat"]
    ar = {
        (r["concurrency"], r.get("round", 0)): r["tokens_per_s"]
        for r in rows
        if r["method"] == "ar"
    }
    rows = merge_rounds(rows, ar)
    one = {r["method"]: r["tokens_per_s"] for r in rows if r["concurrency"] == 1}
    lines = [
        f"Serving benchmark: {settings}",
        "",
        "| method | clients | tokens/s | vs AR | vs 1 client | TTFT p50 / p95 (s) "
        "| ITL p50 / p95 (ms) | gap p95 / max (ms) | acceptance | mean K | KL nats/token |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in sorted(rows, key=lambda r: (list(METHODS).index(r["method"]), r["concurrency"])):
        c = r["concurrency"]
        vs_ar = _spread(r["vs_ar"]) if r["vs_ar"] else "-"
        vs_one = f"{r['tokens_per_s'] / one[r['method']]:.2f}x" if r["method"] in one else "-"
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        gaps = (
            f"{1000 * r['gap_p95_s']:.0f} / {1000 * r['gap_max_s']:.0f}"
            if "gap_p95_s" in r
            else "-"
        )
        lines.append(
            f"| {r['method']} | {c} | {r['tokens_per_s']:.1f} | {vs_ar} | {vs_one} "
            f"| {r['ttft_p50_s']:.2f} / {r['ttft_p95_s']:.2f} "
            f"| {1000 * r['itl_p50_s']:.0f} / {1000 * r['itl_p95_s']:.0f} | {gaps} "
            f"| {acc} | {r['mean_k']:.1f} | {r['kl_nats_per_token']:.4f} |"
        )
    for r in chats:
        lines.append(
            f"\n{r['concurrency']} two-turn chats at once: TTFT p50 / p95 turn 1 "
            f"{r['turn1_ttft_p50_s']:.2f} / {r['turn1_ttft_p95_s']:.2f} s, turn 2 "
            f"{r['turn2_ttft_p50_s']:.2f} / {r['turn2_ttft_p95_s']:.2f} s"
        )
    write_text_atomic(out / "summary.md", "\n".join(lines) + "\n")
    plot(out, rows)


def plot(out: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in METHODS:
        points = sorted(
            (r["concurrency"], r["tokens_per_s"]) for r in rows if r["method"] == method
        )
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=method)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("total tokens/s")
    ax.set_xticks(CONCURRENCY)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = out / "tokens_per_s.tmp.png"
    fig.savefig(tmp, dpi=120)
    tmp.replace(out / "tokens_per_s.png")


@contextlib.contextmanager
def served(args, max_batch: int, log: Path) -> Iterator[str]:
    """``cactus-spec serve`` in its own process (policy auto), until it answers /health."""
    port = free_port()
    command = [
        sys.executable, "-m", "cactus_spec", "serve", "--verifier", args.verifier,
        "--draft", args.draft, "--verifier-quant", args.verifier_quant,
        "--num-draft-tokens", str(args.max_k), "--max-batch", str(max_batch),
        "--max-queue", "256", "--port", str(port), "--served-model-name", "bench",
        *args.server_args.split(),
    ]  # fmt: skip
    with launched(command, port, log) as server:
        yield server.url


@contextlib.contextmanager
def peer(binary: Path, clients: int, log: Path) -> Iterator[openai.OpenAI]:
    """llama-server on the verifier's GGUF with ``clients`` slots (2,048 tokens each), 2
    threads, until it answers /health; a client for it."""
    port = free_port()
    gguf = str(known_gguf_path(DEFAULT_PAIR[0]))
    command = [str(binary), "-m", gguf, "--port", str(port), "-t", "2",
               "-np", str(clients), "-c", str(2048 * clients)]  # fmt: skip
    with launched(command, port, log, start_timeout_s=900) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=3600)


def run_peer(args, prompts: list[str], spare: str, clients: int, out: Path) -> dict:
    """The peer's row at ``clients`` clients: a server started for it, one untimed answer."""
    binary = build(Path(args.llama_cpp), args.llama_build)
    with peer(binary, clients, out / "llama.log") as client:
        one_request(client, "model", spare, None, args.max_tokens, 0)
        return run_config(client, "model", prompts, None, clients, args.max_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verifier", default=DEFAULT_PAIR[0])
    parser.add_argument("--draft", default=DEFAULT_PAIR[1])
    parser.add_argument("--verifier-quant", default="none", choices=["none", "int8"])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-k", type=int, default=10, help="largest K the policy may pick")
    parser.add_argument("--methods", default=",".join(m for m in METHODS if m != PEER))
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    parser.add_argument("--chats", type=int, default=4, help="two-turn chats at once (0: none)")
    parser.add_argument("--server-args", default="", help="more flags for cactus-spec serve")
    parser.add_argument("--label", default="", help="names this run's code and flags")
    parser.add_argument(
        "--rounds", type=int, default=1, help="times each configuration is measured, alternating"
    )
    parser.add_argument("--out", default="bench-out/serve")
    parser.add_argument("--llama-cpp", help=f"llama.cpp's source folder (the {PEER} row)")
    parser.add_argument("--llama-build", default="avx512", help="llama-server's build level")
    args = parser.parse_args()
    methods = args.methods.split(",")
    for name in methods:
        if name not in METHODS:
            parser.error(f"--methods: {name!r} is not one of {', '.join(METHODS)}")
    if PEER in methods and not args.llama_cpp:
        parser.error(f"--methods: {PEER} needs --llama-cpp (llama.cpp's source folder)")
    levels = [int(c) for c in args.concurrency.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    settings = {
        "verifier": args.verifier,
        "draft": args.draft,
        "verifier_quant": args.verifier_quant,
        "max_tokens": args.max_tokens,
        "max_k": args.max_k,
        "server_args": args.server_args,
        "label": args.label,
    }
    if args.rounds < 1:
        parser.error(f"--rounds: {args.rounds} is not a positive count")
    done = {
        (r["method"], r["concurrency"], r.get("round", 0))
        for r in read_done(results)
        if r["settings"] == settings
    }
    todo = [
        (m, c, k)
        for k in range(args.rounds)
        for c in levels
        for m in rotated(methods, k)
        if (m, c, k) not in done
    ]
    *prompts, spare = [
        item.prompt for item in humaneval_items(REQUESTS_PER_CLIENT * max(levels) + 1)
    ]
    with served(args, max(levels), out / "server.log") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=3600)
        for method in dict.fromkeys(m for m, _, _ in todo if m != PEER):  # warm-up: an answer
            one_request(client, "bench", spare, METHODS[method], args.max_tokens, 0)
        for method, concurrency, k in todo:
            if method == PEER:
                row = run_peer(args, prompts, spare, concurrency, out)
            else:
                spec = METHODS[method]
                row = run_config(client, "bench", prompts, spec, concurrency, args.max_tokens)
            row = {
                "method": method, "concurrency": concurrency, "round": k,
                "settings": settings, **row,
            }  # fmt: skip
            with results.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(
                f"{method:>18} c={concurrency:>2} round {k}: {row['tokens_per_s']:6.1f} "
                f"tok/s, mean K {row['mean_k']:.1f}",
                flush=True,
            )
        if args.chats and ("chat", args.chats, 0) not in done:
            row = run_chats(client, "bench", prompts, args.chats, args.max_tokens)
            row = {"method": "chat", "concurrency": args.chats, "settings": settings, **row}
            with results.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"chats: {row}", flush=True)
    rows = [r for r in read_done(results) if r["settings"] == settings]
    write_summary(out, rows, settings)
    print((out / "summary.md").read_text())


if __name__ == "__main__":
    main()
