"""`cactus-spec` and `python -m cactus_spec`: the command line, quiet when interrupted.

The command line imports torch and transformers, which takes seconds; this launcher imports
nothing heavy itself, so Ctrl-C at any moment (importing included) ends with one line and
exit status 130 instead of a traceback.
"""

from __future__ import annotations

import sys

INTERRUPTED = 130


def main() -> int:
    """Import and run the command line; exit 130 with one line on Ctrl-C."""
    try:
        from cactus_spec.cli import main as cli_main

        return cli_main()
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
