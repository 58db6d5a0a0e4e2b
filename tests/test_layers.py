"""The package's modules form layers: none imports, at its top or inside a function, one that imports it
back. A cycle hidden in a function's import (as ``as_source`` once imported ``_tar``) is found too."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "threadloader"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """The package's modules that ``path`` imports anywhere in its code (``from . import x`` included)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            target = f"{base}.{node.module}" if node.module else base
            found.update(f"{target}.{alias.name}" for alias in node.names)
            found.add(target)
        elif isinstance(node, ast.ImportFrom):
            found.add(node.module or "")
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_no_module_imports_one_that_imports_it_back() -> None:
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {name: imports_of(path) & set(modules) - {name} for name, path in modules.items()}
    # A package's __init__ only re-exports the modules below it: it is not followed, or every module
    # that imports a name from its package (``from . import ThreadLoader``) would close a cycle.
    packages = {name for name, path in modules.items() if path.name == "__init__.py"}
    cycles = []
    for start in sorted(set(modules) - packages):
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for nxt in sorted(graph[node] - packages):
                if nxt == start:
                    cycles.append(" -> ".join([*trail, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*trail, nxt]))
    assert cycles == []
