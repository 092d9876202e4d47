"""HumanEval scored by execution: completions extracted from chat answers in every shape a
model writes them pass with the canonical solutions, and fail (wrong code, a hang, network
access, a memory bomb) where they must; the tests run in the sandbox, not in this process."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from cactus_spec.bench.grading import grade
from cactus_spec.bench.humaneval import completion_of, extract_code, grade_answers, problems
from cactus_spec.bench.tasks import Item

#: Problems whose prompts hold imports, helper functions or several definitions.
TASKS = ["HumanEval/0", "HumanEval/10", "HumanEval/38", "HumanEval/50", "HumanEval/129"]
REAL_ANSWERS = Path(__file__).parent / "data" / "humaneval_answers.jsonl"


def full_function(task: str) -> str:
    """The problem's prompt and canonical body: a whole definition, as models repeat it."""
    p = problems()[task]
    return p["prompt"] + p["canonical_solution"]


def shapes(task: str) -> list[str]:
    """A chat answer around the canonical solution, in the shapes seen in model outputs."""
    p = problems()[task]
    whole = full_function(task)
    return [
        f"Here is the function:\n\n```python\n{whole}```\n\nIt works as follows: ...",
        f"```python\n{whole}\n\nprint({p['entry_point']}([]))\nassert False, 'example'\n```",
        f"```\n{p['canonical_solution']}```",  # the body alone, in an unlabelled fence
        f"```python\n{textwrap.dedent(p['canonical_solution'])}```",  # the body, not indented
        whole,  # no fence at all
        f"Sure.\n```python\n{whole}",  # cut off by the token budget: no closing fence
        f"```text\nexample\n```\nThe code:\n```py\n{whole}```",  # the code in a later block
    ]


def test_canonical_solutions_pass_in_every_answer_shape() -> None:
    answers = [(task, answer) for task in TASKS for answer in shapes(task)]
    graded = grade_answers(answers)
    failed = [
        (t, a[:60], g["result"])
        for (t, a), g in zip(answers, graded, strict=True)
        if not g["correct"]
    ]
    assert not failed


def test_negative_controls_fail() -> None:
    signature = "def has_close_elements(numbers, threshold):\n"
    bodies = {
        "wrong": "    return False\n",
        "hang": "    while True:\n        pass\n",
        "network": "    import socket\n    socket.create_connection(('1.1.1.1', 80), 1)\n",
        "memory": "    block = bytearray(4 << 30)\n    return True\n",
        "no code": None,
    }
    answers = [
        ("HumanEval/0", "I cannot help." if body is None else f"```python\n{signature}{body}```")
        for body in bodies.values()
    ]
    graded = dict(zip(bodies, grade_answers(answers), strict=True))
    assert not any(g["correct"] for g in graded.values())
    assert graded["hang"]["result"] == "timed out"
    assert "network access is disabled" in graded["network"]["result"]


def test_the_sandbox_sees_no_secret_of_this_process(monkeypatch) -> None:
    monkeypatch.setenv("CACTUS_SPEC_API_KEY", "secret")
    whole = full_function("HumanEval/0")

    def reading(name: str) -> tuple[str, str]:
        return "HumanEval/0", f"```python\nimport os\nvalue = os.environ[{name!r}]\n{whole}```"

    secret, path = grade_answers([reading("CACTUS_SPEC_API_KEY"), reading("PATH")])
    assert "KeyError" in secret["result"] or not secret["correct"]
    assert path["correct"]  # the control: a variable the sandbox keeps is read fine


def test_real_answers_of_the_default_pair_extract_to_code() -> None:
    """Answers the default pair wrote for HumanEval prompts: the extracted completion holds
    no fence or prose, compiles after the prompt, and (re)defines the entry point."""
    rows = [json.loads(line) for line in REAL_ANSWERS.read_text().splitlines()]
    assert len(rows) >= 8
    for row in rows:
        p = problems()[row["item"]]
        completion = completion_of(row["text"], p["entry_point"])
        assert "```" not in completion, row["item"]
        compile(p["prompt"] + completion, row["item"], "exec")
        assert f"def {p['entry_point']}" in extract_code(row["text"], p["entry_point"])


def test_grading_a_humaneval_item_records_what_ran() -> None:
    answer = f"```python\n{full_function('HumanEval/0')}```"
    fields = grade(
        "humaneval", [(Item("HumanEval/0", "prompt"), answer), (Item("HumanEval/0", "p"), None)]
    )
    assert fields[0]["correct"] and fields[0]["result"] == "passed"
    assert "def has_close_elements" in fields[0]["completion"]
    assert fields[1] == {}


def test_an_unknown_task_id_is_refused() -> None:
    with pytest.raises(ValueError, match="not HumanEval task ids: HumanEval/999"):
        grade_answers([("HumanEval/999", "x")])
