"""lm-evaluation-harness on our engine, with SmolLM2-135M and two local tasks (offline).

``tests/data/lm_eval`` holds a generate_until task and a multiple-choice (loglikelihood) task
over local JSONL files. Every score is checked against the engine's own outputs: greedy
responses equal autoregressive decoding token for token (SpS gives the same tokens),
loglikelihoods equal a plain forward of the verifier, and the metrics equal what those give
against the JSONL targets; a wrong target scores 0 and a nonsense choice scores lower.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import AR, spec_of

from cactus_spec.core.rules import SpS
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.loading.models import LoadedModel, load_model
from cactus_spec.runtime.engine import SpeculativeDecoder

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "lm_eval"
GEN, CHOICE = "cactus_spec_tiny_gen", "cactus_spec_tiny_choice"
#: (doc, choice) of a nonsense answer in choice.jsonl: the negative control.
NONSENSE = {0: 1, 1: 2, 2: 2}
#: The generate_until doc whose target is deliberately wrong.
WRONG_TARGET = 3
TOLERANCE = 1e-4


def jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line]


@pytest.fixture(scope="module")
def offline(tmp_path_factory: pytest.TempPathFactory):
    """lm-eval from the repository root (the tasks' data paths are relative to it), datasets
    offline with a cache of its own; the global random states as they were."""
    patch = pytest.MonkeyPatch()
    cache = tmp_path_factory.mktemp("hf_datasets")
    patch.setenv("HF_DATASETS_OFFLINE", "1")
    patch.setenv("HF_DATASETS_CACHE", str(cache))
    patch.chdir(ROOT)
    import datasets.config  # read its settings at import: set them too, whenever that was

    patch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    patch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    yield
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.random.set_rng_state(states[2])
    patch.undo()


@pytest.fixture(scope="module")
def smollm() -> LoadedModel:
    from cactus_spec.loading.fetch import fetch

    return load_model(fetch("smollm2-135m"), dtype="float32")


@pytest.fixture(scope="module")
def sps_lm(smollm: LoadedModel):
    from cactus_spec.lm_eval.model import CactusSpecLM

    return CactusSpecLM(
        verifier=smollm, draft=smollm, method="sps", num_draft_tokens=3, max_batch=3
    )


@pytest.fixture(scope="module")
def sps_results(offline, sps_lm) -> dict:
    """Both tasks through ``lm_eval.simple_evaluate`` on a ready model object."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=sps_lm,
        tasks=[GEN, CHOICE],
        task_manager=TaskManager(include_path=str(DATA), include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
        random_seed=None,
        numpy_random_seed=None,
        torch_random_seed=None,
    )


def samples(results: dict, task: str) -> list[dict]:
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def test_greedy_responses_are_the_engines_tokens(sps_results: dict, smollm: LoadedModel) -> None:
    ar = SpeculativeDecoder(smollm, spec=AR)
    sps = SpeculativeDecoder(smollm, smollm, spec_of(SpS(), 3))
    docs = jsonl("gen.jsonl")
    hits = []
    for sample, doc in zip(samples(sps_results, GEN), docs, strict=True):
        ((context, gen_kwargs),) = sample["arguments"]
        assert context == doc["question"]
        options = {"temperature": 0, "stop": gen_kwargs["until"], "chat": False}
        want = ar.generate(context, gen_kwargs["max_gen_toks"], **options)
        assert sps.generate(context, gen_kwargs["max_gen_toks"], **options).token_ids == (
            want.token_ids
        )
        assert sample["resps"] == [[want.text]]
        hits.append(want.text == doc["answer"])
    em = sps_results["results"][GEN]["exact_match,none"]
    assert em == pytest.approx(sum(hits) / len(hits))
    assert not hits[WRONG_TARGET]  # the negative control: a wrong target scores 0
    assert 0 < em < 1  # both outcomes occur, so the comparison can fail either way


def forward_logprob(model, context_ids: list[int], continuation: list[int]) -> tuple[float, bool]:
    """log P(continuation | context) and greediness from one plain transformers forward."""
    ids = torch.tensor([context_ids + continuation])  # [1, T]
    with torch.no_grad():
        logits = model(ids).logits[0, len(context_ids) - 1 : -1].float()  # [n, V]
    target = torch.tensor(continuation)
    logprob = torch.log_softmax(logits, -1).gather(1, target[:, None]).sum()
    return float(logprob), bool((logits.argmax(-1) == target).all())


def split_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's causal split: the ids of context + continuation after the context's ids."""
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    head = tokenizer(context, add_special_tokens=False).input_ids
    return head, whole[len(head) :]


def test_loglikelihoods_are_the_verifiers(sps_results: dict, smollm: LoadedModel) -> None:
    docs = jsonl("choice.jsonl")
    correct = []
    for sample, doc in zip(samples(sps_results, CHOICE), docs, strict=True):
        scores = []
        for (context, continuation), [(logprob, greedy)] in zip(
            sample["arguments"], sample["resps"], strict=True
        ):
            head, tail = split_pair(smollm.tokenizer, context, continuation)
            want, want_greedy = forward_logprob(smollm.model, head, tail)
            assert logprob == pytest.approx(want, abs=TOLERANCE)
            assert greedy == want_greedy
            # An off-by-one position would not pass: the check is sharp.
            shifted, _ = forward_logprob(smollm.model, head[:-1], head[-1:] + tail[:-1])
            assert abs(shifted - logprob) > 100 * TOLERANCE
            scores.append(want)
        nonsense = NONSENSE[sample["doc_id"]]
        assert scores[nonsense] < scores[doc["label"]] - 5  # the negative control
        correct.append(int(np.argmax(scores)) == doc["label"])
    assert sps_results["results"][CHOICE]["acc,none"] == pytest.approx(np.mean(correct))


def test_the_command_line_runs_ar_by_name_and_agrees(
    offline, sps_results: dict, tmp_path: Path
) -> None:
    from cactus_spec.cli import main  # `cactus-spec lm-eval ...`

    args = "verifier=smollm2-135m,method=ar,dtype=float32,max_batch=2,seed=7"
    status = main(
        ["lm-eval", "run", "--model", "cactus-spec", "--model_args", args, "--tasks", GEN]
        + ["--include_path", str(DATA), "--device", "cpu", "--output_path", str(tmp_path)]
        + ["--log_samples", "--seed", "None,None,None,1234"]
    )
    assert status == 0
    (path,) = tmp_path.rglob(f"samples_{GEN}_*.jsonl")
    got = sorted(map(json.loads, path.read_text().splitlines()), key=lambda s: s["doc_id"])
    want = [s["resps"] for s in samples(sps_results, GEN)]
    assert [s["resps"] for s in got] == want  # AR at temperature 0 == SpS at temperature 0
    (results_path,) = tmp_path.rglob("results_*.json")
    config = json.loads(results_path.read_text())["config"]["cactus_spec"]
    assert (config["method"], config["rule"], config["seed"]) == ("ar", "None", 7)


def test_sampled_requests_are_the_engines_with_derived_seeds(offline, sps_lm) -> None:
    from lm_eval.api.instance import Instance

    from cactus_spec.lm_eval.args import request_seed

    contexts = ["Once upon a time", "The weather today is", "Once upon a time"]
    kwargs = {"until": ["\n"], "max_gen_toks": 6, "do_sample": True, "temperature": 0.8}
    requests = [
        Instance("generate_until", {}, (context, dict(kwargs)), i)
        for i, context in enumerate(contexts)
    ]
    texts = sps_lm.generate_until(requests, disable_tqdm=True)
    for i, context in enumerate(contexts):
        options = {"temperature": 0.8, "top_k": 0, "top_p": 1.0, "stop": ["\n"], "chat": False}
        alone = sps_lm.engine.generate(context, 6, seed=request_seed(0, i), **options)
        assert texts[i] == alone.text
    assert len({request_seed(0, i) for i in range(100)} | {request_seed(1, 0)}) == 101


def test_rolling_loglikelihood_in_windows(
    offline, smollm: LoadedModel, sps_lm, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lm_eval.api.instance import Instance
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from cactus_spec.lm_eval import model as lm_eval_model
    from cactus_spec.lm_eval.model import CactusSpecLM

    monkeypatch.setattr(lm_eval_model, "SCORE_CHUNK", 3)  # long continuations in pieces

    text = "The quick brown fox jumps over the lazy dog while the cat sleeps on the mat."
    request = Instance("loglikelihood_rolling", {}, (text,), 0)
    tokens = sps_lm.tok_encode(text)
    prefix = sps_lm.prefix_token_id
    (whole,) = sps_lm.loglikelihood_rolling([request], disable_tqdm=True)
    assert whole == pytest.approx(forward_logprob(smollm.model, [prefix], tokens)[0], abs=1e-3)
    small = CactusSpecLM(verifier=smollm, method="ar", max_batch=2, max_length=8)
    (windowed,) = small.loglikelihood_rolling([request], disable_tqdm=True)
    pairs = map(make_disjoint_window, get_rolling_token_windows(tokens, prefix, 8, 1))
    want = sum(forward_logprob(smollm.model, ctx, cont)[0] for ctx, cont in pairs)
    assert windowed == pytest.approx(want, abs=1e-3)
    assert abs(windowed - whole) > 0.1  # the windows did cut the context


def test_a_long_prompt_is_cut_to_leave_room_for_a_whole_draft_tree(smollm: LoadedModel) -> None:
    """The prompt is cut so prompt + max_gen_toks + a draft tree's nodes beyond its depth fit
    the cache (what ``check_context`` asks); a chain reserves nothing (the control)."""
    from cactus_spec.lm_eval.model import CactusSpecLM

    tree = {"verification": "tree", "branches": 3, "num_draft_tokens": 4}
    lm = CactusSpecLM(verifier=smollm, draft=smollm, method="sps", max_batch=1, **tree)
    context = lm.engine.context_length
    fitted = lm._fit_prompt(list(range(context)), 10)
    assert len(fitted) == context - 10 - 4 * 2
    lm.engine.check_context(len(fitted), 10)  # no overflow
    with pytest.raises(ValueError, match="context overflow"):
        lm.engine.check_context(len(fitted) + 1, 10)
    assert lm.engine.draft_reserve(DecodeSpec.of("sps", num_draft_tokens=4)) == 0


def test_chat_template_is_the_tokenizers(sps_lm, smollm: LoadedModel) -> None:
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    want = smollm.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert sps_lm.apply_chat_template(chat) == want


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ("method=bogus", "method must be one of ar, sps, cactus"),
        ("method=cactus,delta=abc", "delta must be"),
        ("num_draft_tokens=0", "num_draft_tokens must be an integer >= 1"),
        ("drafter=ngrams", "drafter must be one of model, ngram"),
        ("temprature=0.5", "unknown model arg 'temprature'"),
        ("method=ar,drafter=ngram", "drafter does not apply to method ar"),
    ],
)
def test_a_bad_model_arg_is_one_line_naming_it(args: str, named: str) -> None:
    from cactus_spec.lm_eval.model import CactusSpecLM

    with pytest.raises(ValueError, match=named) as caught:
        CactusSpecLM.create_from_arg_string(f"verifier=nowhere/at-all,{args}")
    assert "\n" not in str(caught.value)


@pytest.fixture(scope="module")
def served_sps(smollm: LoadedModel):
    """A live ``cactus-spec serve`` app: SpS (K = 3) on SmolLM2, two rows."""
    from cactus_spec.loading.options import LoadOptions
    from cactus_spec.server.build import build_server
    from cactus_spec.server.options import ServeOptions

    models = LoadOptions(verifier=smollm, draft=smollm)
    fields = {"max_batch": 2, "max_queue": 16, "default_max_tokens": 32, "port": 0}
    options = ServeOptions(
        spec_of(SpS(), 3), models, "fixed", served_model_name="smollm2-135m", **fields
    )
    server = build_server(options)
    with server.running() as url:
        yield url, server.engine


@pytest.mark.parametrize(
    ("model", "route", "chat"),
    [
        ("local-completions", "completions", False),
        ("local-chat-completions", "chat/completions", True),
    ],
)
def test_lm_evals_api_models_run_a_task_against_the_server(
    offline, served_sps, model: str, route: str, chat: bool
) -> None:
    """lm-eval's own OpenAI-API models pointed at the server: every response is the engine's
    greedy answer, and the metric is what those answers score."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    url, decoder = served_sps
    args = f"model=smollm2-135m,base_url={url}/v1/{route},tokenizer_backend=None"
    results = lm_eval.simple_evaluate(
        model=model,
        model_args=f"{args},tokenized_requests=False,num_concurrent=2,max_retries=1",
        tasks=[GEN],
        task_manager=TaskManager(include_path=str(DATA), include_defaults=False),
        apply_chat_template=chat,
        log_samples=True,
        bootstrap_iters=0,
    )
    hits = []
    for sample, doc in zip(samples(results, GEN), jsonl("gen.jsonl"), strict=True):
        gen_kwargs = sample["arguments"][0][1]
        options = {"temperature": 0, "stop": gen_kwargs["until"], "chat": chat}
        want = decoder.generate(doc["question"], gen_kwargs["max_gen_toks"], **options)
        assert sample["resps"] == [[want.text]]
        hits.append(want.text == doc["answer"])
    assert results["results"][GEN]["exact_match,none"] == pytest.approx(sum(hits) / len(hits))
