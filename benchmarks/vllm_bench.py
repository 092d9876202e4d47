"""The default pair through vLLM's CPU build with the plugin, beside cactus-spec's own engine.

    python benchmarks/vllm_bench.py --out bench-out/vllm          # everything, resumable
    python benchmarks/vllm_bench.py --out bench-out/vllm --only step
    python benchmarks/vllm_bench.py --out bench-out/vllm --k 4 --drafting probabilistic \
        --method SpS --method "SpS, block"                          # a part of the grid
    python benchmarks/vllm_bench.py --out bench-out/vllm --only vllm --tp 2 --k 4 \
        --drafting greedy --method SpS --method "Cactus(0.5)" --method "Cactus(1)"

Run from the project root with cactus-spec's environment (.venv); the vLLM parts run in
.venv-vllm (``make vllm-env``) as child processes, one at a time (two cores: nothing else
may run beside a timed part). Parts, each appending JSON lines to ``OUT/results.jsonl`` and
skipped when its lines are already there:

- ``own``: cactus-spec's engine (bf16 verifier, int8 draft, as RESULTS' runs), AR, then
  SpS and Cactus (delta 0.5, 1) at K = 4 and 10, and SpS and Cactus(1) on blocks, on
  HumanEval's first N prompts (chat template), 128 new tokens, the paper's sampling
  (temperature 0.6, top-k 20, top-p 0.95), seeds 0..N-1. It also writes the prompts' token
  ids for the vLLM parts.
- ``vllm``: one vLLM engine per drafting (greedy, probabilistic) and K (4, 10), both models
  in bf16 from their dense folders, the same token ids and sampling, one request at a time;
  every method through the plugin's extra args (blocks: ``cactus_verification``). Accepted
  length and KL come from the plugin's meter file. ``--tp 2`` runs the verifier with tensor
  parallelism 2 (two worker processes, one core each; config "... TP2").
- ``step``: the plugin's cost: vLLM's ``rejection_sample`` with no rule rows (vLLM's own
  code) against the plugin's with SpS and Cactus rows, on chains and on blocks, on the same
  synthetic batch (B requests x K drafts x 151,936 tokens, target logits cut to their top
  20 as the paper's sampling leaves them; full-support draft probabilities), median of
  repeated calls, alternating.

``OUT/summary.md`` tabulates every line; the raw lines stay in ``results.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SAMPLING = {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
METHODS = {"SpS": ("sps", {}), "Cactus(0.5)": ("cactus", {"delta": 0.5}),
           "Cactus(1)": ("cactus", {"delta": 1.0}),
           "SpS, block": ("sps", {"verification": "block"}),
           "Cactus(1), block": ("cactus", {"delta": 1.0, "verification": "block"})}  # fmt: skip
KS = (4, 10)
DRAFTINGS = ("greedy", "probabilistic")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--n", type=int, default=8, help="HumanEval prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--only", choices=("own", "vllm", "step"), help="one part only")
    parser.add_argument("--eager", action="store_true", help="vLLM without compilation")
    parser.add_argument("--k", type=int, choices=KS, action="append", help="these K only")
    parser.add_argument("--drafting", choices=DRAFTINGS, action="append", help="these only")
    parser.add_argument("--method", choices=METHODS, action="append", help="these only")
    parser.add_argument("--tp", type=int, default=1, help="vLLM's tensor parallelism")
    parser.add_argument("--part-args", help=argparse.SUPPRESS)  # a child's own part
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part_args:
        part = json.loads(args.part_args)
        {"vllm": run_vllm, "step": run_step}[part.pop("part")](args, **part)
        return
    if args.only in (None, "own"):
        run_own(args)
    if args.only in (None, "vllm"):
        for drafting in args.drafting or DRAFTINGS:
            for k in args.k or KS:
                child(args, part="vllm", drafting=drafting, k=k)
    if args.only in (None, "step"):
        child(args, part="step")
    summarise(args.out)


def done(out: Path) -> set[tuple]:
    """The (engine, config, method, prompt) keys already in results.jsonl."""
    path = out / "results.jsonl"
    if not path.exists():
        return set()
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return {(x["engine"], x["config"], x["method"], x.get("prompt")) for x in lines}


def write(out: Path, line: dict) -> None:
    with open(out / "results.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")
    print(json.dumps(line), flush=True)


def child(args, **part) -> None:
    """A vLLM part in .venv-vllm; it skips its own finished lines."""
    command = [
        str(VLLM_PYTHON),
        __file__,
        "--out",
        str(args.out),
        "--n",
        str(args.n),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--part-args",
        json.dumps(part),
    ]
    if args.eager:
        command.append("--eager")
    command += ["--tp", str(args.tp)]
    for label in args.method or ():
        command += ["--method", label]
    meter = args.out / ("meter-" + "-".join(map(str, part.values())) + f"-tp{args.tp}.jsonl")
    env = {**os.environ, "CACTUS_SPEC_VLLM_METER": str(meter)}
    if args.tp > 1:  # one core per worker
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, range(args.tp)))
    subprocess.run(command, check=True, env=env)


def run_own(args) -> None:
    import torch

    from cactus_spec import DecodeSpec, SpeculativeDecoder
    from cactus_spec.bench.tasks import humaneval_items
    from cactus_spec.loading.fetch import fetch
    from cactus_spec.loading.model_store import ensure_dense_copy
    from cactus_spec.loading.models import load_model

    torch.set_num_threads(2)
    # a bf16 verifier and an int8 draft, as RESULTS' runs (any draft format keeps the law)
    verifier = load_model("qwen-coder-1.5b", dtype="bfloat16")
    draft = load_model("qwen-coder-0.5b", dtype="bfloat16", quant="int8")
    decoder = SpeculativeDecoder(verifier, draft)
    prompts = [item.prompt for item in humaneval_items(args.n)]
    ids = [decoder.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    models = {
        name: str(ensure_dense_copy(fetch(name))) for name in ("qwen-coder-1.5b", "qwen-coder-0.5b")
    }
    (args.out / "prompts.json").write_text(json.dumps({"token_ids": ids, "models": models}))
    specs = {("AR", "-"): DecodeSpec.of("ar")}
    for k in args.k or KS:
        for label in args.method or METHODS:
            method, params = METHODS[label]
            specs[(label, f"K{k}")] = DecodeSpec.of(method, num_draft_tokens=k, **params)
    finished = done(args.out)
    decoder.generate(ids[0], 8)  # page the weights in
    for index, prompt in enumerate(ids):  # alternate configurations prompt by prompt
        for (label, config), spec in specs.items():
            if ("cactus-spec", config, label, index) in finished:
                continue
            s = decoder.generate(
                prompt, args.max_new_tokens, seed=index, spec=spec, **SAMPLING
            ).stats
            write(
                args.out,
                {
                    "engine": "cactus-spec",
                    "config": config,
                    "method": label,
                    "prompt": index,
                    "tokens": s.new_tokens,
                    "seconds": s.time_total_s,
                    "tokens_per_s": s.tokens_per_s,
                    "mean_accepted": s.mean_accepted,
                    "kl_nats_per_token": s.kl_nats_per_token,
                },
            )


def run_vllm(args, drafting: str, k: int) -> None:
    from vllm import LLM, SamplingParams

    config = f"{drafting} K{k}" + (f" TP{args.tp}" if args.tp > 1 else "")
    finished = done(args.out)
    todo = [
        (label, i)
        for i in range(args.n)
        for label in args.method or METHODS
        if ("vllm", config, label, i) not in finished
    ]
    if not todo:
        return
    prompts = json.loads((args.out / "prompts.json").read_text())
    verifier, draft = prompts["models"]["qwen-coder-1.5b"], prompts["models"]["qwen-coder-0.5b"]
    meter = Path(os.environ["CACTUS_SPEC_VLLM_METER"])
    meter.unlink(missing_ok=True)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    start = time.perf_counter()
    llm = LLM(
        verifier,
        dtype="bfloat16",
        max_model_len=2048,
        seed=0,
        enforce_eager=args.eager,
        tensor_parallel_size=args.tp,
        distributed_executor_backend="mp" if args.tp > 1 else None,
        speculative_config={
            "method": "draft_model",
            "model": draft,
            "num_speculative_tokens": k,
            "draft_sample_method": drafting,
        },
    )
    print(f"vLLM engine ({config}) started in {time.perf_counter() - start:.0f} s", flush=True)
    warm = SamplingParams(max_tokens=8, **SAMPLING)
    llm.generate([{"prompt_token_ids": prompts["token_ids"][0]}], warm, use_tqdm=False)
    runs = []
    for label, index in todo:
        method, params = METHODS[label]
        xargs = {"cactus_method": method, **{f"cactus_{n}": v for n, v in params.items()}}
        sampling = SamplingParams(
            max_tokens=args.max_new_tokens, seed=index, extra_args=xargs, **SAMPLING
        )
        began = time.perf_counter()
        (result,) = llm.generate(
            [{"prompt_token_ids": prompts["token_ids"][index]}], sampling, use_tqdm=False
        )
        runs.append((label, index, len(result.outputs[0].token_ids), time.perf_counter() - began))
    llm.generate([{"prompt_token_ids": [1]}], SamplingParams(max_tokens=1), use_tqdm=False)
    meters = [json.loads(x) for x in meter.read_text().splitlines()]  # one per run, in order
    for (label, index, tokens, seconds), m in zip(runs, meters[-len(runs) :], strict=True):
        iterations = m["drafted"] / k
        kl = None if m["kl_nats"] is None else m["kl_nats"] / tokens
        write(
            args.out,
            {
                "engine": "vllm",
                "config": config,
                "method": label,
                "prompt": index,
                "tokens": tokens,
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
                "mean_accepted": m["accepted"] / iterations if iterations else 0.0,
                "kl_nats_per_token": kl,
            },
        )


def run_step(args, batches=(1, 8), k: int = 4, vocab: int = 151_936, calls: int = 30) -> None:
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    from cactus_spec.core.spec import DecodeSpec
    from cactus_spec.integrations.vllm import plugin
    from cactus_spec.integrations.vllm.calls import calling

    original = rejection_sampler.rejection_sample
    plugin.register()
    current_platform.register_triton_kernel_overrides()
    patched = rejection_sampler.rejection_sample
    finished = done(args.out)
    torch.manual_seed(0)
    for b in batches:
        for probabilistic in (False, True):
            config = f"B{b} K{k} {'probabilistic' if probabilistic else 'one-hot'} drafts"
            if ("vllm", config, "step", None) in finished:
                continue
            tokens = b * k
            logits = torch.randn(tokens, vocab) * 3  # [T, V], then top-k 20 as sampled
            logits[logits < logits.topk(20, -1).values[:, -1:]] = float("-inf")
            p = torch.softmax(torch.randn(tokens, vocab), -1) if probabilistic else None
            drafts = torch.randint(0, vocab, (tokens,), dtype=torch.int32)
            meta = type(
                "Meta",
                (),
                {
                    "all_greedy": False,
                    "all_random": True,
                    "temperature": torch.full((b,), 0.6),
                    "generators": {},
                },
            )()
            call_args = (
                drafts,
                [k] * b,
                k,
                torch.arange(k, tokens + 1, k, dtype=torch.int32),
                p,
                logits,
                torch.zeros(b, 1, dtype=torch.int64),
                meta,
            )
            specs = {
                "vLLM's own": (original, None),
                "plugin, SpS rows": (patched, DecodeSpec.of("sps")),
                "plugin, Cactus rows": (patched, DecodeSpec.of("cactus")),
                "plugin, SpS blocks": (patched, DecodeSpec.of("sps", verification="block")),
                "plugin, Cactus blocks": (
                    patched,
                    DecodeSpec.of("cactus", verification="block"),
                ),
            }
            times: dict[str, list[float]] = {name: [] for name in specs}
            for _ in range(calls):
                for name, (function, spec) in specs.items():
                    with calling({i: (str(i), spec) for i in range(b)}):
                        began = time.perf_counter()
                        function(*call_args)
                        times[name].append(time.perf_counter() - began)
            plugin.METER.tallies.clear()
            for name, seconds in times.items():
                write(
                    args.out,
                    {
                        "engine": "vllm",
                        "config": config,
                        "method": "step",
                        "prompt": None,
                        "path": name,
                        "median_ms": 1e3 * statistics.median(seconds),
                        "spread_ms": [1e3 * min(seconds), 1e3 * max(seconds)],
                    },
                )


def summarise(out: Path) -> None:
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    rows = [
        "| engine | config | method | prompts | tokens/s (median) | mean accepted | KL/token |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    groups: dict[tuple, list[dict]] = {}
    for x in lines:
        if x["method"] != "step":
            groups.setdefault((x["engine"], x["config"], x["method"]), []).append(x)
    for (engine, config, method), xs in groups.items():
        kls = [x["kl_nats_per_token"] for x in xs if x["kl_nats_per_token"] is not None]
        kl = f"{statistics.mean(kls):.4f}" if kls else "-"
        rows.append(
            f"| {engine} | {config} | {method} | {len(xs)} | "
            f"{statistics.median(x['tokens_per_s'] for x in xs):.2f} | "
            f"{statistics.mean(x['mean_accepted'] for x in xs):.2f} | {kl} |"
        )
    rows += ["", "| step | path | median ms | min-max ms |", "| --- | --- | --- | --- |"]
    rows += [
        f"| {x['config']} | {x['path']} | {x['median_ms']:.2f} | "
        f"{x['spread_ms'][0]:.2f}-{x['spread_ms'][1]:.2f} |"
        for x in lines
        if x["method"] == "step"
    ]
    (out / "summary.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    sys.exit(main())
