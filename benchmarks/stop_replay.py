"""What the single stream's stop (``SpeculationPolicy.keep_drafting``) gains over a fixed K,
on the same acceptance outcomes.

    python benchmarks/stop_replay.py --method cactus --prompts 14 --iterations 60
    python benchmarks/stop_replay.py --method sps --verifier-quant int8 --draft-quant int4 \\
        --draft-vocab 32768

One row decodes each of the first --prompts HumanEval chats for --iterations iterations,
every one drafted to K_max (10), recording each draft's probability and how many the
verifier kept, while a calibrated policy measures the costs. Then every rule is replayed on
the recorded chains: a fixed K cuts each chain at K, the stop where it would have stopped
(a fresh policy on the run's costs, learning from each replayed iteration as the engine's
does). An iteration that drafts j of a chain whose first m drafts were kept emits
min(j, m) + 1 tokens (a draft's verdict does not depend on the drafts after it) in
j t_draft + t_block(j + 1) seconds, the policy's measured costs. Prints tokens per second by
rule: the rules meet the same drafts and verdicts, so the noise of acceptance falls on all
of them alike.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from dataclasses import dataclass

from cactus_spec.bench.tasks import humaneval_items
from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.loading.catalog import DEFAULT_PAIR
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.runtime.generation import Request
from cactus_spec.runtime.policy import SpeculationPolicy
from cactus_spec.runtime.stepper import StepTiming

K_MAX = 10


@dataclass(frozen=True)
class Chain:
    """One recorded iteration: the draft's probability of each of its K_max drafts, and how
    many of them the verifier kept."""

    confidences: tuple[float, ...]
    kept: int


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="cactus", help="sps or cactus (delta 1)")
    parser.add_argument("--prompts", type=int, default=14)
    parser.add_argument("--iterations", type=int, default=60, help="iterations a prompt")
    parser.add_argument("--verifier-quant", default="int8")
    parser.add_argument("--draft-quant", default="int4")
    parser.add_argument("--draft-vocab", type=int, default=32768)
    args = parser.parse_args()
    spec = DecodeSpec.of(args.method)
    engine = SpeculativeDecoder(
        *DEFAULT_PAIR,
        spec,
        max_draft_tokens=K_MAX,
        verifier_quant=args.verifier_quant,
        draft_quant=args.draft_quant,
        draft_vocab=args.draft_vocab,
    )
    measured = engine.calibrated_policy()
    assert measured is not None  # the default pair drafts with a model
    chains = _record(engine, spec, measured, args.prompts, args.iterations)
    print(f"{args.method}, one row, {len(chains)} iterations drafted to K = {K_MAX}; "
          f"draft step {1e3 * measured.draft.estimate(1):.1f} ms, 1- and 11-token blocks "
          f"{1e3 * measured.block(1):.1f} / {1e3 * measured.block(K_MAX + 1):.1f} ms")  # fmt: skip
    for k in range(2, K_MAX + 1, 2):
        print(f"K = {k:2d}: {_replay(chains, measured, lambda j, c, k=k: j < k):5.1f} tokens/s")
    stop = SpeculationPolicy(K_MAX)  # learns acceptance afresh, on the run's costs
    tables = (measured.pace, measured.draft, measured.verify, measured.host)
    stop.pace, stop.draft, stop.verify, stop.host = copy.deepcopy(tables)

    def keeps(j: int, chain: Chain) -> bool:
        return j < K_MAX and stop.keep_drafting(chain.confidences[:j])

    print(f"the stop: {_replay(chains, measured, keeps, stop):5.1f} tokens/s")


def _record(
    engine: SpeculativeDecoder,
    spec: DecodeSpec,
    policy: SpeculationPolicy,
    prompts: int,
    iterations: int,
) -> list[Chain]:
    """Every iteration's chain, each prompt's row drafting K_max every iteration."""
    chains = []
    for i, item in enumerate(humaneval_items(prompts)):
        request = Request(
            prompt_ids=engine.encode_chat([{"role": "user", "content": item.prompt}]),
            max_new_tokens=K_MAX * iterations + K_MAX + 1,
            sampling=SamplingConfig(),
            seed=i,
            spec=spec,
            ignore_eos=True,
        )
        g = engine.new_generation(request, 0)
        engine.prefill([g])
        for _ in range(iterations):
            timing = engine.step([g], [K_MAX])
            policy.observe(timing)
            chains.append(Chain(timing.confidences[0], timing.kept[0]))
        g.finish()
    return chains


def _replay(
    chains: list[Chain],
    costs: SpeculationPolicy,
    keeps: Callable[[int, Chain], bool],
    learner: SpeculationPolicy | None = None,
) -> float:
    """Tokens per second of the chains cut where ``keeps(j, chain)`` first says no, at
    ``costs``' draft step and blocks; ``learner`` observes each replayed iteration."""
    t_draft = costs.draft.estimate(1)
    tokens, seconds = 0, 0.0
    for chain in chains:
        j = 1
        while keeps(j, chain):
            j += 1
        kept = min(j, chain.kept)
        verify, host = costs.verify.estimate(j + 1), costs.host.estimate(j + 1)
        tokens += kept + 1
        seconds += j * t_draft + verify + host
        if learner is not None:
            timing = StepTiming(1, j, j * t_draft, j + 1, verify, kept + 1, 0,
                                (chain.confidences[:j],), (kept,), host)  # fmt: skip
            learner.observe(timing)
    return tokens / seconds


if __name__ == "__main__":
    main()
