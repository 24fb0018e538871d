"""The package's modules import one another without a circle.

Why: the house is layered (ARCHITECTURE.md); a circle, even one closed only by a
type-checking or function-local import, means two modules cannot be read, tested or moved
apart. Every import of a package module counts here, wherever it stands in the file.
"""
from __future__ import annotations

import ast
from pathlib import Path

import megatron_calibclip

PACKAGE = Path(megatron_calibclip.__file__).parent
ROOT = PACKAGE.parent


def _module_file(dotted: str) -> Path | None:
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported_files(path: Path) -> set[Path]:
    """The package's files `path` imports: `import a.b`, `from a.b import c` (c a module
    when it is one, else a.b), relative imports resolved against the file's package."""
    package = path.parent.relative_to(ROOT).parts
    found: set[Path] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ((node.module,) if node.module else ()))
            else:
                base = node.module or ""
            names = []
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                names.append(sub if _module_file(sub) is not None else base)
        else:
            continue
        for name in names:
            if name.split(".")[0] == PACKAGE.name and (target := _module_file(name)) not in (None, path):
                found.add(target)
    return found


def _circles(graph: dict[Path, set[Path]]) -> list[list[Path]]:
    """Strongly connected components of more than one file (Tarjan's algorithm)."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    on_stack: set[Path] = set()
    found: list[list[Path]] = []

    def visit(node: Path) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_circle_finder_finds_a_planted_circle(tmp_path):
    a, b, c = (tmp_path / name for name in "abc")
    assert _circles({a: {b}, b: {c}, c: {a}}) == [sorted([a, b, c])]
    assert _circles({a: {b}, b: {c}, c: set()}) == []


def test_the_package_has_no_import_circle():
    files = sorted(PACKAGE.rglob("*.py"))
    graph = {path: _imported_files(path) for path in files}
    assert sum(len(targets) for targets in graph.values()) > 100  # the reader sees the imports
    circles = [" -> ".join(str(p.relative_to(ROOT)) for p in circle) for circle in _circles(graph)]
    assert circles == []
