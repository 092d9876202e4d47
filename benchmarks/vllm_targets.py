"""Does a vLLM release still hold every attribute the plugin patches? Read, not installed.

Fetches the release's wheel (``pip download --no-deps``, or ``--wheel``), and for every
target of ``plugin.TARGETS`` (V1, Model Runner V2, the CPU fixes) finds the module file in
the wheel and the name in it by parsing the source: a top-level function, class, assignment
or import, then an attribute defined in that class's body. For each function the plugin
replaces or wraps it also compares the parameter names with those of a baseline source tree
(``--baseline``: an installed vLLM's package directory, by default this checkout's
``.venv-vllm`` one). Prints one row per target and exits 1 when one is missing.

    python benchmarks/vllm_targets.py --version 0.33.0
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import zipfile
from pathlib import Path

from cactus_spec.integrations.vllm.plugin import TARGETS

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--version", default="0.33.0", help="vLLM release (default 0.33.0)")
    parser.add_argument("--wheel", type=Path, help="a wheel already fetched")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/vllm-wheels"))
    parser.add_argument("--baseline", type=Path, default=_installed())
    args = parser.parse_args()
    wheel = args.wheel or fetch(args.version, args.cache)
    with zipfile.ZipFile(wheel) as archive:
        release = {
            name: archive.read(name).decode()
            for name in archive.namelist()
            if name.startswith("vllm/") and name.endswith(".py")
        }
    missing = 0
    print(f"{'target':75s} {wheel.name.split('-')[1]:>8s}  parameters vs baseline")
    for module, path in TARGETS:
        found = lookup(release.get(_file(module, release)), path)
        base = None
        if args.baseline is not None:
            source = _read(args.baseline.parent / _file(module, None, args.baseline.parent))
            base = lookup(source, path)
        missing += found is None
        print(
            f"{module + '.' + path:75s} {'found' if found is not None else 'MISSING':>8s}  "
            f"{_compare(found, base)}"
        )
    print(f"{missing} missing of {len(TARGETS)}")
    return 1 if missing else 0


def fetch(version: str, cache: Path) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if not wheels:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                f"vllm=={version}",
                "--no-deps",
                "--only-binary",
                ":all:",
                "-d",
                str(cache),
            ],
            check=True,
        )
        wheels = sorted(cache.glob(f"vllm-{version}-*.whl"))
    return wheels[0]


def _installed() -> Path | None:
    found = sorted((ROOT / ".venv-vllm").glob("lib/python*/site-packages/vllm"))
    return found[0] if found else None


def _file(module: str, release: dict | None, root: Path | None = None) -> str:
    """The module's file inside the wheel (or under ``root``): a module or a package."""
    stem = module.replace(".", "/")
    for name in (f"{stem}.py", f"{stem}/__init__.py"):
        if (release is not None and name in release) or (
            root is not None and (root / name).exists()
        ):
            return name
    return f"{stem}.py"


def _read(path: Path) -> str | None:
    return path.read_text() if path.exists() else None


def lookup(source: str | None, path: str) -> ast.AST | None:
    """The definition of ``path`` ("name" or "Class.attr") in ``source``; None if absent."""
    if source is None:
        return None
    scope: list[ast.stmt] = ast.parse(source).body
    node: ast.AST | None = None
    for name in path.split("."):
        node = next((n for n in scope if name in _names(n)), None)
        if node is None:
            return None
        scope = node.body if isinstance(node, ast.ClassDef) else []
    return node


def _names(node: ast.stmt) -> set[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    if isinstance(node, ast.ImportFrom | ast.Import):
        return {a.asname or a.name.split(".")[0] for a in node.names}
    if isinstance(node, ast.Try | ast.If):
        return set().union(*(_names(n) for n in node.body))
    return set()


def _compare(found: ast.AST | None, base: ast.AST | None) -> str:
    if not isinstance(found, ast.FunctionDef) or not isinstance(base, ast.FunctionDef):
        return "-"
    new, old = _parameters(found), _parameters(base)
    if new == old:
        return "same"
    added = [x for x in new if x not in old]
    removed = [x for x in old if x not in new]
    kept = [x for x in new if x in old]
    order = "" if kept == [x for x in old if x in new] else "; ORDER CHANGED"
    return f"added {added or '-'}, removed {removed or '-'}{order}"


def _parameters(node: ast.FunctionDef) -> list[str]:
    a = node.args
    return [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]


if __name__ == "__main__":
    sys.exit(main())
