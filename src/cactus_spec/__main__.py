"""`cactus-spec` and `python -m cactus_spec`: the command line, quiet when interrupted.

The command line imports torch and transformers, which takes seconds; this launcher imports
nothing heavy itself, so Ctrl-C at any moment (importing included) ends with one line and
exit status 130 instead of a traceback. While importing, Ctrl-C exits at once from its
signal handler: an exception raised inside a C++ extension's initialisation (pybind11)
would abort the process instead of unwinding.
"""

from __future__ import annotations

import os
import signal
import sys

INTERRUPTED = 130


def _exit_interrupted(signum: int, frame: object) -> None:
    sys.stderr.write("interrupted\n")
    sys.stderr.flush()
    os._exit(INTERRUPTED)  # nothing is written yet: nothing to clean up


def main() -> int:
    """Import and run the command line; exit 130 with one line on Ctrl-C."""
    try:
        previous = signal.signal(signal.SIGINT, _exit_interrupted)
        from cactus_spec.cli import main as cli_main

        signal.signal(signal.SIGINT, previous)
        return cli_main()
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
