"""Checks of plain values shared by every layer, so a bad count reads the same everywhere:
``max_batch must be an integer >= 1, got 0``."""

from __future__ import annotations

from typing import TypeGuard


def is_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an int and not a bool (True is an int in Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: object, low: int = 1) -> int:
    """``value`` if it is an integer >= ``low``, else ValueError naming ``name``."""
    if not is_int(value) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def flag(key: str) -> str:
    """How the command line names the option ``key``: ``--num-draft-tokens``."""
    return f"--{key.replace('_', '-')}"
