"""The installed `cactus-spec` command as a user runs it: a real process, real argv bytes,
a real SIGINT while it is still importing torch."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

COMMAND = Path(sys.executable).with_name("cactus-spec")
#: Importing torch and transformers takes seconds; this is well inside it.
EARLY_S = 0.5


def _interrupt_early(argv: list[str], *, until_ended: bool = False) -> subprocess.CompletedProcess:
    """SIGINT EARLY_S after the start; with until_ended, again every EARLY_S until it ends.
    The process starts with SIGINT's default disposition, as from a terminal: a shell that
    runs the tests in the background ignores SIGINT, and children inherit that."""
    process = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 60
    while True:
        time.sleep(EARLY_S)
        process.send_signal(signal.SIGINT)
        if not until_ended or process.poll() is not None or time.monotonic() > deadline:
            break
    out, err = process.communicate(timeout=60)
    return subprocess.CompletedProcess(argv, process.returncode, out, err)


@pytest.mark.skipif(not COMMAND.exists(), reason="cactus-spec is not installed in this venv")
def test_ctrl_c_while_importing_exits_130_with_one_line() -> None:
    done = _interrupt_early([str(COMMAND), "generate", "hello", "--method", "ar"])
    assert done.returncode == 130, done.stderr
    assert done.stderr.decode() == "interrupted\n"


def test_negative_control_a_bare_import_interrupted_is_not_clean() -> None:
    """Without the launcher, Ctrl-C gives a traceback (or, inside a C++ extension's
    initialisation, an abort): never the one clean line. One Ctrl-C can also be lost (a
    library's optional-import probe with a bare `except` swallows it, and the import runs on
    to exit 0), so this one is pressed until the process ends."""
    done = _interrupt_early([sys.executable, "-c", "import cactus_spec.cli"], until_ended=True)
    assert done.returncode != 130 and done.stderr != b"interrupted\n"
    assert b"Traceback" in done.stderr or b"terminate called" in done.stderr


@pytest.mark.skipif(not COMMAND.exists(), reason="cactus-spec is not installed in this venv")
def test_invalid_utf8_bytes_in_argv_are_one_line_and_exit_2() -> None:
    done = subprocess.run([str(COMMAND), "generate", b"abc\xff\xfe"], capture_output=True)
    assert done.returncode == 2
    assert done.stderr.decode(errors="replace").count("\n") == 1
    assert b"error: prompt is not valid UTF-8 text" in done.stderr
