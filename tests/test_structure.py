"""The code's shape, as the design holds it: small modules, no import cycles, few type: ignores."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("proxy", "routing", "tokenization", "bench")
MAX_TYPE_IGNORES = 5


def modules() -> dict[str, Path]:
    """Every module of the packages, by dotted name."""
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports, at any depth of the module: a function-level import counts
    (it runs), and so does one under ``if TYPE_CHECKING`` (a module named only for types still depends
    on what it names: a circle through type imports is a circle of the design)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            # importing a.b.c runs a and a.b first
            while target:
                if target != name and target in known:
                    found.add(target)
                target = target.rpartition(".")[0]
    return found


def test_type_ignores_are_at_most_five() -> None:
    ignores = [
        f"{path.relative_to(ROOT)}:{i}"
        for path in modules().values()
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if "type: ignore" in line
    ]
    assert len(ignores) <= MAX_TYPE_IGNORES, ignores


def test_no_import_cycles() -> None:
    """A module's package ``__init__`` may import its submodules; apart from that, no module reaches
    itself through the modules it imports, type-only imports included."""
    found = modules()
    known = set(found)
    graph = {name: imports_of(name, path, known) for name, path in found.items()}
    cycles = []
    for start in graph:
        stack = [(start, [start])]
        seen = set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node]:
                if nxt == start and not all(t.startswith(start + ".") or t == start for t in trail):
                    cycles.append(" -> ".join([*trail, nxt]))
                elif nxt not in seen and nxt != start:
                    seen.add(nxt)
                    stack.append((nxt, [*trail, nxt]))
    # a package and its own submodules importing each other is how packages re-export
    real = [c for c in cycles if not _within_one_package(c)]
    assert real == [], real[:5]


def _within_one_package(cycle: str) -> bool:
    names = cycle.split(" -> ")
    return any(all(n == p or n.startswith(p + ".") for n in names) for p in names)
