"""The package's shape: a runtime base at the bottom, no module importing upward, no import cycle.

Read from the source with ``ast`` (module-level and function-level imports alike, since an import inside a
function is the usual way to hide a cycle), so the test needs no process group and fails naming the edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "robustdist"

# Floor 0 and 1: what everything stands on. Each may import only from the floors listed for it.
FLOORS = {
    "robustdist.errors": set(),
    "robustdist._version": set(),
    "robustdist.log": {"robustdist.errors", "robustdist._dist"},
    "robustdist._dist": {"robustdist.errors"},
    "robustdist._node": set(),  # which node this is: the standard library only
}
# Mechanisms reach the runtime through robustdist._dist, never through the modules that build groups.
NOT_BELOW_THE_FACADE = {"robustdist.harden", "robustdist._hardened", "robustdist.cli", "robustdist.doctor"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every ``robustdist.*`` module ``path`` imports, anywhere in the file."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("robustdist")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if not base.startswith("robustdist"):
                continue
            for alias in node.names:  # `from robustdist import _dist` imports a module, not a name
                candidate = f"{base}.{alias.name}"
                found.add(candidate if _exists(candidate) else base)
    return found - {name}


def _exists(module: str) -> bool:
    rel = Path(*module.split("."))
    return (PACKAGE.parent / rel).with_suffix(".py").exists() or (PACKAGE.parent / rel / "__init__.py").exists()


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "__init__.py":  # the lazy export table names everything, and imports nothing eagerly
            continue
        graph[_module_name(path)] = {m for m in _imports(path) if m != "robustdist"}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_import_graph_has_no_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle (a module imports upward): " + " -> ".join(cycle or [])


@pytest.mark.parametrize("module", sorted(FLOORS))
def test_the_floor_imports_only_what_is_below_it(module):
    imported = _graph()[module]
    assert imported <= FLOORS[module], f"{module} imports {sorted(imported - FLOORS[module])}; its floor allows only " \
                                       f"{sorted(FLOORS[module]) or 'nothing from robustdist'}"


def test_no_mechanism_imports_the_facade_or_reaches_the_store_through_process_group():
    graph = _graph()
    for module, imported in graph.items():
        if module in NOT_BELOW_THE_FACADE or module == "robustdist.__main__":
            continue
        upward = imported & NOT_BELOW_THE_FACADE
        assert not upward, f"{module} imports the facade {sorted(upward)}"
    for module in ("robustdist._watchdog", "robustdist.health", "robustdist.consistency", "robustdist.topology"):
        assert "robustdist.process_group" not in graph[module], f"{module} imports robustdist.process_group"
    for module in [m for m in graph if m.startswith("robustdist.checkpoint")]:
        assert "robustdist.process_group" not in graph[module], f"{module} imports robustdist.process_group"


def test_the_graph_is_read_correctly():
    """Guard against a parser that finds nothing (then every test above would pass vacuously)."""
    graph = _graph()
    assert "robustdist._dist" in graph["robustdist.process_group"]
    assert "robustdist.checkpoint" in graph["robustdist.harden"] or "robustdist.checkpoint.checkpointer" in graph[
        "robustdist._hardened"]
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


def test_is_distributed_is_asked_in_one_place():
    """``dist.is_initialized()`` lives in robustdist._dist; the rest ask it (is_up, is_multi, rank, ...)."""
    offenders = [str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
                 if p.name != "_dist.py" and "dist.is_initialized()" in p.read_text()]
    assert not offenders, f"these modules ask torch.distributed directly instead of robustdist._dist: {offenders}"


def test_every_subpackage_ships_in_the_wheel():
    """An editable install finds every package; a wheel ships only those pyproject lists."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {_module_name(p) for p in PACKAGE.rglob("__init__.py")}
    assert found == listed, f"pyproject.toml [tool.setuptools] packages lists {sorted(listed)}; the tree has {sorted(found)}"
