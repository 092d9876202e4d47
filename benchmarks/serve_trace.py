"""Where a server's time goes under load, turn by turn, beside the policy's forecast.

    python benchmarks/serve_trace.py --clients 8 --methods ar,sps,cactus --rounds 2 \\
        --out bench-out/serve-trace.jsonl

Drives the scheduler in process, as ``cactus-spec serve --verifier-quant int8 --draft-quant
int8 --draft-vocab 32768 --no-prefix-cache --max-batch C`` does but with no HTTP: C clients,
each sending ``--per-client`` HumanEval chats one after another (96 new tokens, the paper's
sampling). The policy is timed, then warmed on one run of SpS at half the clients (past its
probe; ``--no-warm``: cold, as a fresh server); then each round runs every method once (the
order rotating, so the machine's drift falls on each alike), each run on a fresh scheduler
over the same engine and policy. Every turn is timed: the prompts' reads by the verifier,
the drafters' catch-up between iterations, and the iteration's drafting, verification and
host work, beside the policy's forecast of the iteration's seconds at the K it ran
(K t_draft(R) + t_block(n), the costs ``SpeculationPolicy`` weighs), its reads per token
(rho) and its catch-up cost per token (c). Prints a line per run (tokens/s, where the seconds
went, mean K and rows) and the forecast's median error by K; appends every turn to ``--out``
(JSONL).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from cactus_spec.bench.tasks import humaneval_items
from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.loading.catalog import DEFAULT_PAIR
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.runtime.generation import Generation, GenerationResult, Request
from cactus_spec.runtime.policy import SpeculationPolicy
from cactus_spec.runtime.scheduler import PREFILL_CHUNK, Scheduler

SPECS = {
    "ar": DecodeSpec.of("ar"),
    "sps": DecodeSpec.of("sps").with_num_draft_tokens(None),
    "cactus": DecodeSpec.of("cactus", delta=1.0).with_num_draft_tokens(None),
}
NEW_TOKENS = 96


@dataclass
class Turn:
    """One turn of the scheduler's loop: what it read, and the iteration it ran (if any)."""

    prompt_tokens: int = 0
    prompt_s: float = 0.0
    catch_up_s: float = 0.0
    rows: int = 0
    k: float = 0.0  # mean K of the iteration's rows
    draft_s: float = 0.0
    verify_s: float = 0.0
    host_s: float = 0.0
    step_s: float = 0.0
    emitted: int = 0
    forecast_s: float = 0.0  # the policy's K t_draft(R) + t_block(n) for the K it ran
    rho: float = 0.0
    c_ms: float = 0.0
    turn_s: float = 0.0


class TracingScheduler(Scheduler):
    """A scheduler that records a ``Turn`` per turn of its loop (``turns``)."""

    def __init__(self, engine: SpeculativeDecoder, policy: SpeculationPolicy | None) -> None:
        super().__init__(engine, max_queue=256, policy=policy, prefill_chunk=PREFILL_CHUNK)
        self.turns: list[Turn] = []
        self._now = Turn()

    def _turn(self, admitted: list[tuple[Request, Generation]]) -> None:
        self._now = Turn()
        start, last = time.perf_counter(), self._last_step
        super()._turn(admitted)
        timing = self._last_step
        if timing is not None and timing is not last:
            now = self._now
            now.rows, now.emitted = timing.rows, timing.emitted
            now.draft_s, now.verify_s, now.host_s = timing.draft_s, timing.verify_s, timing.host_s
            now.step_s = timing.draft_s + timing.verify_s + timing.host_s
        self._now.turn_s = time.perf_counter() - start
        self.turns.append(self._now)

    def _read_prompts(self, reading: list[Generation], running: bool) -> None:
        before, start = self.counters.read_prompt_tokens, time.perf_counter()
        super()._read_prompts(reading, running)
        self._now.prompt_s += time.perf_counter() - start
        self._now.prompt_tokens += self.counters.read_prompt_tokens - before

    def _catch_up(
        self, generations: list[Generation], ks: list[int], behind: list[int]
    ) -> list[int]:
        """The catch-up timed, then the policy's forecast of the iteration about to run:
        K t_draft(R) + t_block(n) at the K each row runs (R: the rows drafting, n: the tokens
        verified), its reads per token over the rows that leave K open, and c."""
        start = time.perf_counter()
        ks = super()._catch_up(generations, ks, behind)
        now, policy = self._now, self.policy
        now.catch_up_s = time.perf_counter() - start
        now.k = statistics.mean(ks)
        if policy is not None:
            drafting = sum(k > 0 for k in ks)
            now.forecast_s = policy.block(sum(k + 1 for k in ks)) + max(ks) * (
                policy.draft.estimate(drafting) if drafting else 0.0
            )
            auto = [(g, n) for g, n in zip(generations, behind, strict=False) if g.spec.auto_k]
            now.rho = policy.reads_per_token([g for g, _ in auto], [n for _, n in auto])
            now.c_ms = 1000 * policy.catch_up_token_s
        return ks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--per-client", type=int, default=2, help="chats each client sends")
    parser.add_argument("--methods", default="ar,sps,cactus", help=f"of {', '.join(SPECS)}")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("bench-out/serve-trace.jsonl"))
    parser.add_argument(
        "--warm", action=argparse.BooleanOptionalAction, default=True, help="SpS first, untimed"
    )
    args = parser.parse_args()
    methods = args.methods.split(",")
    unknown = sorted(set(methods) - set(SPECS))
    if unknown:
        parser.error(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(SPECS)}")
    engine = SpeculativeDecoder(
        *DEFAULT_PAIR,
        SPECS["cactus"],
        max_draft_tokens=10,
        max_batch=args.clients,
        prefix_cache=False,
        verifier_quant="int8",
        draft_quant="int8",
        draft_vocab=32768,
    )
    policy = engine.calibrated_policy()
    prompts = [item.prompt for item in humaneval_items(args.clients * args.per_client)]
    ids = [engine.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    if args.warm:  # past the probe
        _run(engine, policy, ids[: args.clients], "sps", max(1, args.clients // 2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print("round method: tokens/s; seconds: wall, prompt reads, catch-up, draft, verify, host; "
          "mean K, mean rows; forecast error by K (median)", flush=True)  # fmt: skip
    for round_ in range(args.rounds):
        turn = round_ % len(methods)
        for method in methods[turn:] + methods[:turn]:
            tokens, wall, turns = _run(engine, policy, ids, method, args.clients)
            run = {"round": round_, "method": method, "clients": args.clients}
            with args.out.open("a") as out:
                out.writelines(json.dumps({**run, **asdict(t)}) + "\n" for t in turns)
            print(f"{round_} {method}: {_summary(tokens, wall, turns)}", flush=True)


def _run(
    engine: SpeculativeDecoder,
    policy: SpeculationPolicy | None,
    ids: Sequence[list[int]],
    method: str,
    clients: int,
) -> tuple[int, float, list[Turn]]:
    """Serve ``ids`` to ``clients`` clients (each its share, one after another) by ``method``
    on a fresh scheduler: (tokens emitted, seconds, the turns)."""
    scheduler = TracingScheduler(engine, policy)
    shares = [list(ids[c::clients]) for c in range(clients)]
    emitted, left = [0], [clients]

    def send(client: int) -> None:
        if not shares[client]:
            left[0] -= 1
            if left[0] == 0:
                scheduler.stop()
            return

        def done(result: GenerationResult) -> None:
            emitted[0] += result.stats.new_tokens
            send(client)

        def failed(err: BaseException) -> None:
            raise SystemExit(f"a request failed: {err}")

        prompt = shares[client].pop(0)
        scheduler.submit(Request(prompt_ids=prompt, max_new_tokens=NEW_TOKENS, seed=client,
                                 spec=SPECS[method], sampling=SamplingConfig(), on_done=done,
                                 on_error=failed))  # fmt: skip

    start = time.perf_counter()
    for client in range(clients):
        send(client)
    scheduler.run()
    return emitted[0], time.perf_counter() - start, scheduler.turns


def _summary(tokens: int, wall: float, turns: list[Turn]) -> str:
    steps = [t for t in turns if t.rows]
    total = {name: sum(getattr(t, name) for t in turns)
             for name in ("prompt_s", "catch_up_s", "draft_s", "verify_s", "host_s")}  # fmt: skip
    errors: dict[int, list[float]] = {}
    for t in steps:
        if t.forecast_s > 0:
            errors.setdefault(round(t.k), []).append(t.forecast_s / t.step_s - 1)
    error = ", ".join(f"K={k} {statistics.median(e):+.0%} ({len(e)})"
                      for k, e in sorted(errors.items()))  # fmt: skip
    seconds = ", ".join(f"{v:.1f}" for v in total.values())
    mean_k = statistics.mean(t.k for t in steps) if steps else 0.0
    mean_rows = statistics.mean(t.rows for t in steps) if steps else 0.0
    return (f"{tokens / wall:.1f}; {wall:.1f}, {seconds}; {mean_k:.1f}, {mean_rows:.1f}; "
            f"{error or '-'}")  # fmt: skip


if __name__ == "__main__":
    main()
