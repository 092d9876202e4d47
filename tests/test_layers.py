"""The package's layers, read from the source: no module imports a layer above its own, and
no two modules import each other, directly or around a circle (lazy imports inside
functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "src" / "cactus_spec"

#: Bottom to top; a module may import its own layer and those below it.
LAYERS = {
    "paths": 0,
    "files": 0,
    "isa": 0,
    "core": 0,
    "backends": 1,
    "loading": 2,
    "runtime": 3,
    "server": 4,
    "lm_eval": 4,
    "bench": 4,
    "integrations": 4,
    "cli": 5,
    "cli_args": 5,
    "__main__": 5,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The cactus_spec modules ``path`` imports, anywhere in its body."""
    found = set()
    package = (
        module_name(path) if path.name == "__init__.py" else module_name(path).rsplit(".", 1)[0]
    )
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
    return {name for name in found if name.startswith("cactus_spec.") and _is_module(name)}


def _is_module(name: str) -> bool:
    relative = Path(*name.split(".")[1:])
    return (ROOT / relative).with_suffix(".py").exists() or (
        ROOT / relative / "__init__.py"
    ).exists()


def layer(module: str) -> int:
    return LAYERS[module.split(".")[1]]


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = [p for p in root.rglob("*.py") if p.parent != root or p.name != "__init__.py"]
    return {module_name(p): imports(p) - {module_name(p)} for p in modules}


def upward_edges(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in edges.items() for b in targets if layer(b) > layer(a))


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_every_module_has_a_layer():
    assert {module.split(".")[1] for module in graph()} <= set(LAYERS)


def test_no_module_imports_a_layer_above_its_own():
    assert upward_edges(graph()) == []


def test_no_import_circle():
    assert circles(graph()) == []


def test_core_imports_only_torch_and_itself():
    for path in (ROOT / "core").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                assert top in {"torch", "__future__", "cactus_spec"} or _stdlib(top), (path, name)
                assert not name.startswith("cactus_spec.") or name.startswith("cactus_spec.core"), (
                    path,
                    name,
                )


def _stdlib(name: str) -> bool:
    import sys

    return name in sys.stdlib_module_names


@pytest.mark.parametrize(
    ("files", "upward", "circle"),
    [
        ({"core/a.py": "from cactus_spec.runtime import b", "runtime/b.py": ""}, True, False),
        (
            {
                "runtime/a.py": "import cactus_spec.runtime.b",
                "runtime/b.py": "import cactus_spec.runtime.a",
            },
            False,
            True,
        ),
        ({"runtime/a.py": "from cactus_spec.core import b", "core/b.py": ""}, False, False),
    ],
)
def test_the_checks_catch_an_upward_import_and_a_circle(
    tmp_path, monkeypatch, files, upward, circle
):
    """Negative control: the same checks over a made-up package find what was planted."""
    package = tmp_path / "cactus_spec"
    for name, text in files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
        (package / name).parent.joinpath("__init__.py").touch()
    monkeypatch.setattr(__import__(__name__), "ROOT", package)
    edges = graph(package)
    assert bool(upward_edges(edges)) == upward
    assert bool(circles(edges)) == circle
