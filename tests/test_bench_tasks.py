"""Task items and answer scoring, all offline."""

from __future__ import annotations

import json

import pytest

from cactus_spec.bench.grading import grade
from cactus_spec.bench.tasks import (
    Item,
    TaskSpec,
    extract_answer,
    gsm_items,
    humaneval_items,
    is_correct,
    load_items,
    prompt_items,
    stated_answer,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 42.", "42"),
        ("3 apples and 4 pears: 7 fruits. The answer is 1,234.", "1234"),
        ("It costs $12.50 in total.", "12.50"),
        ("The temperature drops to -3 degrees.", "-3"),
        ("first 1,2,3", "3"),
        ("no number here", None),
    ],
)
def test_extract_answer_takes_the_last_number(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


def test_is_correct_compares_numbers() -> None:
    assert is_correct("so the answer is 70.", "70")
    assert is_correct("The answer is 70.0", "70")
    assert is_correct("The answer is 1,200.", "1200")
    assert not is_correct("The answer is 71.", "70")
    assert not is_correct("I do not know.", "70")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3 + 4 = 7.\nThe answer is 42.", "42"),
        ("**The answer is 1,234.**", "1234"),
        ("So the final answer is: $\\boxed{-3.5}$", "-3.5"),
        ("The answer is 3. On reflection, the answer is 9.", "9"),
        ("The answer is:\n\\[\n\\boxed{40}\n\\]", "40"),
        ("Answer: 42", None),  # not the form asked for
        ("The answer is unclear, maybe 4.", None),
    ],
)
def test_stated_answer_reads_the_last_answer_form(text: str, expected: str | None) -> None:
    assert stated_answer(text) == expected


def test_gsm_grading_reads_the_form_and_reports_the_last_number_beside_it() -> None:
    item = Item("q", "prompt", "42")
    texts = ["The answer is 42. Check: 40 + 2.", "6 * 7 = 42", "The answer is 41.", None]
    stated, unstated, wrong, missing = grade("gsm", [(item, text) for text in texts])
    assert stated["correct"] and not stated["correct_fallback"]  # last number is 2
    assert not unstated["correct"] and unstated["correct_fallback"]
    assert unstated["prediction"] is None and unstated["prediction_fallback"] == "42"
    assert not wrong["correct"] and not wrong["correct_fallback"]
    assert missing == {}


def test_prompt_items_with_answers_are_graded_by_the_last_number() -> None:
    fields = grade("prompts", [(Item("a", "p", "7"), "It is 7."), (Item("b", "p"), "7")])
    assert fields == [{"prediction": "7", "correct": True}, {}]


def test_gsm_items_are_fixed_by_the_seed() -> None:
    first, again = gsm_items(3, seed=7), gsm_items(3, seed=7)
    assert first == again
    assert [item.id for item in first] == [f"gsm_symbolic/7/{i}" for i in range(3)]
    assert all("The answer is N." in item.prompt and item.answer for item in first)
    assert gsm_items(3, seed=8) != first


def test_humaneval_items() -> None:
    items = humaneval_items(2)
    assert [item.id for item in items] == ["HumanEval/0", "HumanEval/1"]
    assert "def has_close_elements" in items[0].prompt
    assert items[0].answer is None


def test_prompt_file_text_ids_and_answers(tmp_path) -> None:
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "hello", "id": "a"}, {"prompt": [1, 2, 3], "answer": 4}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    items = prompt_items(path, None)
    assert [(i.id, i.prompt, i.answer) for i in items] == [
        ("a", "hello", None),
        ("line2", (1, 2, 3), "4"),
    ]
    assert len(load_items(TaskSpec("prompts", 1, path=str(path)))) == 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "holds no prompts"),
        ("\n  \n", "holds no prompts"),
        ("not json\n", "line 1|:1: not JSON"),
        ('{"text": "x"}\n', 'expected an object with a "prompt" key'),
        ('{"prompt": "  "}\n', "non-empty text or a list of token ids"),
        ('{"prompt": [1, -2]}\n', "non-empty text or a list of token ids"),
        ('{"prompt": "a", "id": "x"}\n{"prompt": "b", "id": "x"}\n', "repeats ids: x"),
    ],
)
def test_bad_prompt_files_are_refused(tmp_path, content: str, message: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        prompt_items(path, None)


def test_bad_task_specs_are_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="task must be one of gsm, humaneval, prompts"):
        TaskSpec("mmlu")
    with pytest.raises(ValueError, match="goes with the prompts task only"):
        TaskSpec("prompts")
    with pytest.raises(ValueError, match="goes with the prompts task only"):
        TaskSpec("gsm", path="x.jsonl")
    with pytest.raises(ValueError, match=">= 1"):
        TaskSpec("gsm", n=0)
    with pytest.raises(ValueError, match="does not exist"):
        load_items(TaskSpec("prompts", path=str(tmp_path / "missing.jsonl")))
