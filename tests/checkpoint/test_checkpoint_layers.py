"""The layers of ``robustdist/checkpoint/``: its import graph has no cycle, and it stands only on the floor.

The graph is read from the source with ``ast``, not by importing: every ``import robustdist...`` and
``from robustdist... import ...`` (and relative import), at module level and inside functions or
``if TYPE_CHECKING:`` blocks alike, so a cycle cannot hide inside a function. ``from package import name``
is an edge to ``package.name`` when that is a module, else to the package. Importing a submodule also runs
its parents' ``__init__``; those implicit edges are not drawn (Python handles them, and every package would
otherwise sit in a cycle with its own modules).
"""

from __future__ import annotations

import ast
from pathlib import Path

import robustdist

ROOT = Path(robustdist.__file__).parent
PACKAGE = "robustdist.checkpoint"
# What checkpoint modules may import from the rest of robustdist: the floor (runtime base, errors, logging,
# version) and state_dict (how a module's state is taken and given back, which save and load share).
ALLOWED_OUTSIDE = ("robustdist.runtime.dist", "robustdist.runtime.errors", "robustdist.runtime.log",
                   "robustdist._version", "robustdist.parallel.state_dict", "robustdist.runtime.node",
                   "robustdist.runtime._torch_compat",  # the private-torch fences: state-dict metadata,
                   "robustdist.runtime._serialization_compat",  # pickles of tensors and DCP internals
                   "robustdist.runtime.exit_drain",  # at exit, let the gloo workers of the groups it makes finish
                   "robustdist.runtime.store_barrier", "robustdist.runtime.deadline",  # the coordination primitives
                   "robustdist.runtime.stored")  # the one reader of JSON read back (manifests, records)
# TrainState (what a run checkpoints) stands on top of the checkpointer: it also holds the loader's position.
TRAIN_STATE = f"{PACKAGE}.train_state"
ALLOWED_TO_TRAIN_STATE = ("robustdist.data.dataloader",)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(source: str, module: str, *, is_package: bool = False) -> list[tuple[str, int]]:
    """``(imported robustdist module, line)`` for every import in ``module``'s source, wherever it sits."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source, module)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *([base] if base else [])])
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.append((target if _is_module(target) else base, node.lineno))
    return sorted({(target, line) for target, line in found
                   if target == "robustdist" or target.startswith("robustdist.")}, key=lambda edge: (edge[1], edge[0]))


def _graph() -> dict[str, list[tuple[str, int]]]:
    files = sorted((ROOT / "checkpoint").rglob("*.py"))
    assert len(files) > 5, f"expected the checkpoint package's modules under {ROOT / 'checkpoint'}"
    return {_module_name(path): _imports(path.read_text(encoding="utf-8"), _module_name(path),
                                         is_package=path.name == "__init__.py") for path in files}


def _cycle(graph: dict[str, list[tuple[str, int]]]) -> list[str] | None:
    """One cycle among the package's modules, as the list of modules along it, or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for target, _ in graph.get(node, []):
            if target not in graph:
                continue
            if state.get(target) == "open":
                return [*stack[stack.index(target):], target]
            if target not in state and (found := visit(target)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _edge_text(graph: dict[str, list[tuple[str, int]]], cycle: list[str]) -> str:
    lines = [f"{a} -> {b} (line {line})" for a, b in zip(cycle, cycle[1:])
             for target, line in graph[a] if target == b]
    return "; ".join(lines)


def test_the_checkpoint_import_graph_has_no_cycle():
    graph = _graph()
    cycle = _cycle(graph)
    assert cycle is None, (f"import cycle in {PACKAGE}: {' -> '.join(cycle)} ({_edge_text(graph, cycle)}); "
                           "expected a DAG, function-level imports included. Fix: move the shared name down a "
                           "layer (types into _types, helpers into the lower module) or pass it in as an argument.")


def test_checkpoint_modules_import_only_the_floor_from_the_rest_of_robustdist():
    bad = [f"{module} -> {target} (line {line})" for module, edges in sorted(_graph().items())
           for target, line in edges
           if not (target == PACKAGE or target.startswith(PACKAGE + ".")) and target not in ALLOWED_OUTSIDE
           and not (module == TRAIN_STATE and target in ALLOWED_TO_TRAIN_STATE)]
    assert not bad, (f"{PACKAGE} imports from above its floor: {'; '.join(bad)}; expected only {PACKAGE} itself "
                     f"and {', '.join(ALLOWED_OUTSIDE)}. Fix: take what is needed as an argument, or move it into "
                     "one of those floor modules.")


def test_only_the_facade_and_the_package_init_import_the_facade():
    importers = sorted(module for module, edges in _graph().items()
                       if any(target in (f"{PACKAGE}.checkpointer", PACKAGE) for target, _ in edges)
                       and module not in (PACKAGE, f"{PACKAGE}.checkpointer", TRAIN_STATE))
    assert not importers, (f"{', '.join(importers)} import the facade ({PACKAGE}.checkpointer or the package "
                           "itself); expected the mechanisms to know nothing of it. Fix: import the type from "
                           f"{PACKAGE}._types, or take the value as an argument.")


PROBE = """
import os
from robustdist.runtime.errors import CheckpointError
from . import _io
from ._types import SaveJob
from ..runtime import dist


def f():
    from robustdist.checkpoint import AtomicCheckpointer, checkpointer
    import robustdist.harden
"""


def test_the_reader_sees_every_kind_of_import_and_the_checker_names_the_edges():
    edges = _imports(PROBE, f"{PACKAGE}._probe")
    assert edges == [("robustdist.runtime.errors", 3), (f"{PACKAGE}._io", 4), (f"{PACKAGE}._types", 5),
                     ("robustdist.runtime.dist", 6), (PACKAGE, 10), (f"{PACKAGE}.checkpointer", 10),
                     ("robustdist.harden", 11)]
    graph = {"a": [("b", 3)], "b": [("c", 5), ("robustdist.runtime.errors", 6)], "c": [("a", 7)]}
    cycle = _cycle(graph)
    assert cycle == ["a", "b", "c", "a"]
    assert _edge_text(graph, cycle) == "a -> b (line 3); b -> c (line 5); c -> a (line 7)"
    assert _cycle({"a": [("b", 1)], "b": [("robustdist.runtime.errors", 2)]}) is None
