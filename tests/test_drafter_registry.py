"""A drafter registered here and nowhere else: the engine, the server and the bench decode
with it by name, and SpS at temperature 0 emits the verifier's own greedy tokens whatever it
proposes. The negative control: an unregistered name is one line naming the parameter and
the allowed values, before any model loads."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import openai
import pytest
from test_smollm import assert_same_greedy_tokens, smollm  # noqa: F401 (a fixture)

from cactus_spec.bench.grid import expand, parse_entry
from cactus_spec.bench.runner import BenchSettings, run_bench
from cactus_spec.bench.store import RESULTS_FILE
from cactus_spec.bench.tasks import TaskSpec, load_items
from cactus_spec.cli import main
from cactus_spec.cli_args import parser
from cactus_spec.core.drafters import DRAFTERS
from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.loading.models import LoadedModel
from cactus_spec.loading.options import LoadOptions
from cactus_spec.runtime.drafters import Draft, DraftRequest, StatelessDrafter
from cactus_spec.runtime.drafting import BUILDERS, register_drafter
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.server.build import build_server
from cactus_spec.server.options import ServeOptions

NAME = "repeat"
K = 3
PROMPT = "Count in words: one, two, three, four, five, six, seven,"
MODEL_ID = "smollm2-135m"
BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


class RepeatLast(StatelessDrafter):
    """Proposes the context's last token K times: no model, no state, mostly wrong."""

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        return [Draft([r.context[-1]] * r.num_draft_tokens, None) for r in requests]


@pytest.fixture
def repeat() -> Iterator[str]:
    """``RepeatLast`` registered as ``NAME`` for one test; the registries as they were after."""
    before = dict(DRAFTERS), dict(BUILDERS)
    register_drafter(NAME, lambda parts: RepeatLast(), help="the last token, K times")
    yield NAME
    for registry, saved in zip((DRAFTERS, BUILDERS), before, strict=True):
        registry.clear()
        registry.update(saved)  # type: ignore[arg-type]  # each its own saved copy


def greedy_ar(verifier: LoadedModel, prompt: str, tokens: int, chat: bool = True) -> list[int]:
    ar = SpeculativeDecoder(verifier, spec=DecodeSpec.of("ar"))
    return ar.generate(prompt, tokens, temperature=0, chat=chat).token_ids


def test_an_unregistered_drafter_is_one_line_before_any_model_loads(tmp_path, capsys) -> None:
    with pytest.raises(ValueError, match=r"^drafter must be one of model, ngram, got 'repeat'$"):
        DecodeSpec.of("sps", drafter=NAME)
    out = str(tmp_path / "out")
    argv = ["bench", "--method", "sps", "--drafter", NAME, "--verifier", "/no/model", "--out", out]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "error: sps: drafter must be one of model, ngram, got 'repeat'\n"
    )
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "hi", "--drafter", NAME, "--verifier", "/no/model"])
    assert exit_.value.code == 2
    assert "--drafter: invalid choice: 'repeat'" in capsys.readouterr().err


def test_a_registered_drafter_is_every_interfaces_name(repeat: str, monkeypatch) -> None:
    """The spec, the command line's choices, the soak benchmark's and the bench's grid take
    it; it needs no draft model and drafts no trees, so a tree with it is refused."""
    spec = DecodeSpec.of("sps", drafter=repeat, num_draft_tokens=K)
    assert spec.drafter == repeat and not spec.needs_draft_model
    assert parser().parse_args(["generate", "hi", "--drafter", repeat]).drafter == repeat
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import soak

    assert soak.arguments().parse_args(["--out", "x", "--drafter", repeat]).drafter == repeat
    (config,) = expand([parse_entry(f"sps:drafter={repeat}")], [K])
    assert config.id == f"sps/K{K}/{repeat}" and config.label == f"sps K{K} {repeat}"
    with pytest.raises(ValueError, match=f"needs a draft model .*, got drafter {repeat}"):
        DecodeSpec.of("sps", drafter=repeat, verification="tree").check_trees()
    with pytest.raises(ValueError, match="is registered already"):
        register_drafter(repeat, lambda parts: RepeatLast())


@pytest.mark.slow
def test_the_engine_decodes_with_a_registered_drafter(smollm, repeat: str) -> None:  # noqa: F811
    spec = DecodeSpec.of("sps", drafter=repeat, num_draft_tokens=K)
    result = SpeculativeDecoder(smollm, None, spec).generate(PROMPT, 40, temperature=0)
    assert result.stats.drafted > 0 and result.stats.accepted < result.stats.drafted
    assert_same_greedy_tokens(smollm, PROMPT, greedy_ar(smollm, PROMPT, 40), result.token_ids)


@pytest.mark.slow
def test_the_server_decodes_with_a_registered_drafter(smollm, repeat: str) -> None:  # noqa: F811
    spec = DecodeSpec.of("sps", drafter=repeat, num_draft_tokens=K)
    fields = {"max_batch": 2, "default_max_tokens": 24, "port": 0}
    options = ServeOptions(spec, LoadOptions(verifier=smollm), served_model_name=MODEL_ID, **fields)
    with build_server(options).running() as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        answer = client.completions.create(
            model=MODEL_ID, prompt=PROMPT, max_tokens=24, temperature=0, seed=0
        )
    drafted = answer.usage.model_extra["speculative"]["drafted_tokens"]
    assert drafted > 0
    ar = SpeculativeDecoder(smollm, spec=DecodeSpec.of("ar"))
    assert answer.choices[0].text == ar.generate(PROMPT, 24, temperature=0, chat=False).text


@pytest.mark.slow
def test_the_bench_decodes_with_a_registered_drafter(smollm, repeat: str, tmp_path) -> None:  # noqa: F811
    prompts = [PROMPT, "The days of the week are Monday, Tuesday,"]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    grid = expand([parse_entry("ar"), parse_entry(f"sps:drafter={repeat}")], [K])
    task = TaskSpec("prompts", len(prompts), path=str(path))
    settings = BenchSettings(task, grid, SamplingConfig(temperature=0), max_new_tokens=24)
    run_bench(settings, load_items(task), smollm, None, tmp_path / "out", progress=False)
    rows = [json.loads(line) for line in (tmp_path / "out" / RESULTS_FILE).read_text().splitlines()]
    by = {(r["config"], r["index"]): r for r in rows}
    for index, prompt in enumerate(prompts):
        sps = by[(f"sps/K{K}/{repeat}", index)]
        assert sps["drafted"] > 0
        assert_same_greedy_tokens(smollm, prompt, by[("ar", index)]["token_ids"], sps["token_ids"])
