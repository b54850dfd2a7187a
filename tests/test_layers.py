"""The package's shape, by package: each part imports only the parts below it, never upward, and no cycle.

Read from the source with ``ast`` (module-level and function-level imports alike, since an import inside a
function is the usual way to hide a cycle; ``TYPE_CHECKING`` imports too), so the test needs no process group
and fails naming the edge. The layers, bottom up (docs/development.md draws the same map):

0. ``runtime`` (and ``_version``): group state, store, bounded collectives, errors, logging, topology;
1. ``config``;
2. ``init``, ``parallel``, ``data`` and the stand-alone ``bf16``: each imports the floors below, never its peers;
3. ``checkpoint``; 4. ``health``; 5. ``ray``, ``frameworks`` (Accelerate) and ``recovery``, peers;
6. ``launcher`` (``robustdist run``: its spare warms what a worker imports, every part);
7. the facade at the top level: ``harden``, ``_hardened``, ``cli``, ``doctor``, ``__main__``, ``ray_setup``.

``testing`` (``run_ranks``, the node lab) imports only ``runtime`` and is never imported by the product.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path
from typing import Any

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "robustdist"
ROOT = PACKAGE.parent

LAYER = {"runtime": 0, "config": 1, "init": 2, "parallel": 2, "data": 2, "bf16": 2, "checkpoint": 3, "health": 4,
         "ray": 5, "frameworks": 5, "recovery": 5, "launcher": 6, "facade": 7}
# Top-level modules that belong to a floor: the version sits with the runtime; the rest is the facade.
TOP_LEVEL = {"_version": "runtime", "harden": "facade", "_hardened": "facade", "cli": "facade", "doctor": "facade",
             "__main__": "facade", "ray_setup": "facade"}
# Inside the runtime: what everything stands on. Each may import only the modules listed for it.
FLOORS = {
    "robustdist.runtime.errors": set(),
    "robustdist._version": set(),
    "robustdist.runtime.log": {"robustdist.runtime.errors", "robustdist.runtime.dist"},
    "robustdist.runtime.dist": {"robustdist.runtime.errors", "robustdist.runtime._torch_compat",
                                "robustdist.runtime.store_barrier"},
    # The coordination primitives: the store barrier, the deadline helper, the reader of stored values and the
    # liveness rule, on the standard library only.
    "robustdist.runtime.store_barrier": {"robustdist.runtime.stored"},
    "robustdist.runtime.stored": set(),
    "robustdist.runtime.deadline": set(),
    "robustdist.runtime.liveness": set(),  # the liveness rule
    # The private-API fences: the record type, and the torch fence below the group state that uses it.
    "robustdist.runtime.private_api": set(),
    "robustdist.runtime._torch_compat": {"robustdist.runtime.private_api"},
    "robustdist.runtime._serialization_compat": {"robustdist.runtime._torch_compat", "robustdist.runtime.errors",
                                                 "robustdist.runtime.private_api"},
    "robustdist.runtime._amp_compat": {"robustdist.runtime._torch_compat", "robustdist.runtime.private_api"},
    "robustdist.runtime._data_compat": {"robustdist.runtime._torch_compat", "robustdist.runtime.private_api"},
    "robustdist.runtime._ray_train_compat": {"robustdist.runtime._ray_compat", "robustdist.runtime.private_api"},
    "robustdist.runtime._tune_compat": {"robustdist.runtime._ray_compat", "robustdist.runtime.private_api"},
    "robustdist.runtime.node": set(),  # which node this is: the standard library only
    "robustdist.runtime.lazy": set(),  # every package __init__ imports it: the standard library only
}


def _part(module: str) -> str:
    """``robustdist.health.watchdog`` -> ``health``; ``robustdist.harden`` -> ``facade``."""
    if module == "robustdist":
        return "robustdist (the top level, which exports every part)"
    name = module.split(".")[1]
    return TOP_LEVEL.get(name, name)


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _lazy_table(path: Path) -> dict[str, str]:
    """``{name: module}`` of a package ``__init__``'s lazy exports (``_LAZY = {...}`` or ``attach(__name__,
    {...})``), read from the source: the table's expression is evaluated with ``dict`` alone in scope."""
    for node in ast.walk(ast.parse(path.read_text())):
        table = None
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_LAZY" for t in node.targets):
            table = node.value
        elif isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "_LAZY":
            table = node.value
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("attach", "_attach") and \
                len(node.args) == 2:
            table = node.args[1]
        if table is not None:
            return eval(compile(ast.Expression(table), str(path), "eval"), {"__builtins__": {}, "dict": dict})
    return {}


def _lazy_tables() -> dict[str, dict[str, str]]:
    return {_module_name(init): _lazy_table(init) for init in PACKAGE.rglob("__init__.py")}


def _imports(path: Path, tables: dict[str, dict[str, str]] | None = None, root: Path = ROOT) -> set[str]:
    """Every ``robustdist.*`` module ``path`` imports, anywhere in the file: ``import``, ``from ... import``
    (a name a package exports lazily is an edge to the module that defines it), the modules a package's own
    lazy table names, and literal ``importlib.import_module("robustdist...")`` calls."""
    tables = _lazy_tables() if tables is None else tables
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set(_lazy_table(path).values()) if path.name == "__init__.py" else set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("robustdist")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if not base.startswith("robustdist"):
                continue
            for alias in node.names:  # `from robustdist import _dist` imports a module, not a name
                candidate = f"{base}.{alias.name}"
                found.add(candidate if _exists(candidate, root) else tables.get(base, {}).get(alias.name, base))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == \
                "import_module" and node.args and isinstance(node.args[0], ast.Constant) and \
                str(node.args[0].value).startswith("robustdist"):
            found.add(node.args[0].value)
    return found - {name}


def _exists(module: str, root: Path = ROOT) -> bool:
    rel = Path(*module.split("."))
    return (root / rel).with_suffix(".py").exists() or (root / rel / "__init__.py").exists()


def _graph() -> dict[str, set[str]]:
    """Module -> the robustdist modules it imports. A bare ``robustdist`` edge (``import robustdist``, or a name
    the top level exports that is not in its table) is kept: no module below the top level may make one."""
    graph, tables = {}, _lazy_tables()
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "__init__.py":  # the lazy export table names everything, and imports nothing eagerly
            continue
        graph[_module_name(path)] = _imports(path, tables)
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


def test_every_module_sits_in_a_known_part():
    """A new top-level module or package must be given a floor here (and a room in docs/development.md)."""
    unknown = sorted({_part(m) for m in _graph()} - set(LAYER) - {"testing"})
    assert not unknown, f"robustdist/{unknown} has no floor in tests/test_layers.py LAYER; put it in a package " \
                        "(docs/development.md says which) or give it a floor"


def test_each_part_imports_only_the_floors_below_it():
    upward = []
    for module, imported in _graph().items():
        part = _part(module)
        if part == "testing":
            continue
        for target in sorted(imported):
            other = _part(target)
            if other == part:
                continue
            if other == "testing" or LAYER.get(other, 8) >= LAYER[part]:
                upward.append(f"{module} (floor {LAYER[part]}) imports {target} "
                              f"(floor {LAYER.get(other, 'testing')})")
    assert not upward, "imports that run sideways or upward:\n" + "\n".join(upward)


@pytest.mark.processes
def test_testing_stands_on_the_runtime_only_and_the_product_never_imports_it():
    graph = _graph()
    for module in [m for m in graph if _part(m) == "testing"]:
        above = {t for t in graph[module] if _part(t) not in ("runtime", "_version", "testing")}
        assert not above, f"{module} imports {sorted(above)}; the test tools may import only robustdist.runtime"
    # Outside the package too: only the tests, the benchmarks, the scripts and the run_ranks example import it.
    found = subprocess.run(["git", "grep", "-lE", r"(import|from) robustdist\.testing|robustdist\.testing import",
                            "--", "*.py"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    outside = [f for f in found if not f.startswith(("tests/", "benchmarks/", "scripts/", "robustdist/testing/"))
               and f not in ("examples/run_ranks_example.py", "robustdist/__init__.py")]
    assert not outside, f"these files import robustdist.testing (the test tools), which the product never does: " \
                        f"{outside}"


@pytest.mark.parametrize("module", sorted(FLOORS))
def test_the_floor_imports_only_what_is_below_it(module):
    imported = _graph()[module]
    assert imported <= FLOORS[module], f"{module} imports {sorted(imported - FLOORS[module])}; its floor allows only " \
                                       f"{sorted(FLOORS[module]) or 'nothing from robustdist'}"


def test_no_mechanism_reaches_the_store_through_init():
    """Mechanisms reach the group and its store through robustdist.runtime.dist, never the modules that build it
    (the floors forbid it below init; health and checkpoint sit above it, so this says it for them)."""
    graph = _graph()
    for module in graph:
        if _part(module) in ("health", "checkpoint", "parallel", "data", "runtime", "config", "bf16"):
            reached = sorted(t for t in graph[module] if t == "robustdist.init" or t.startswith("robustdist.init."))
            assert not reached, f"{module} imports {reached}; expected robustdist.runtime.dist for the group and store"


def test_the_graph_is_read_correctly(tmp_path):
    """Guard against a parser that finds nothing (then every test above would pass vacuously), and show that
    each way of importing upward is an edge: through the top level, a package's lazy export, a lazy table,
    ``importlib.import_module``."""
    probe = tmp_path / "robustdist" / "runtime" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("import robustdist\nfrom robustdist import Hardened\nfrom robustdist.init import distributed\n"
                     "import importlib\nimportlib.import_module('robustdist.ray.actor')\n")
    init = tmp_path / "robustdist" / "runtime" / "__init__.py"
    init.write_text("__getattr__, __dir__, __all__ = attach(__name__, {'X': 'robustdist.health.step_guard'})\n")
    (tmp_path / "robustdist" / "init").mkdir()
    (tmp_path / "robustdist" / "init" / "__init__.py").write_text("")
    tables = {"robustdist": {"Hardened": "robustdist.harden"},
              "robustdist.init": {"distributed": "robustdist.init.process_group"}}
    assert _imports(probe, tables, tmp_path) == {"robustdist", "robustdist.harden", "robustdist.init.process_group",
                                                 "robustdist.ray.actor"}
    assert _imports(init, tables, tmp_path) == {"robustdist.health.step_guard"}
    assert _lazy_table(init) == {"X": "robustdist.health.step_guard"}
    assert _lazy_table(PACKAGE / "__init__.py")["harden"] == "robustdist.harden"
    graph = _graph()
    assert "robustdist.runtime.dist" in graph["robustdist.init.process_group"]
    assert "robustdist.checkpoint.checkpointer" in graph["robustdist.checkpoint.train_state"] or \
        "robustdist.checkpoint" in graph["robustdist.checkpoint.train_state"]
    assert "robustdist.init.rendezvous" in graph["robustdist.init.elastic_store"]
    assert "robustdist.config.validate" in graph["robustdist.config.io"]  # `from robustdist.config import validate`
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert len(graph) > 80, f"expected every module of robustdist/; found {len(graph)}"


def test_the_top_level_shows_the_parts():
    """The parts as packages, and beside them only the facade's modules, the version and the stand-alone bf16 patch
    (dunder files and py.typed aside)."""
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__" and not p.name.startswith("__")
                     and p.name != "py.typed")
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages == {"runtime", "config", "init", "parallel", "data", "checkpoint", "health", "ray", "frameworks",
                        "recovery", "launcher", "testing"}
    modules = sorted(set(entries) - packages)
    assert modules == ["_hardened.py", "_version.py", "bf16.py", "cli.py", "doctor.py", "harden.py", "ray_setup.py"], \
        f"robustdist/ has modules at its top level beyond the facade's: {modules}; put them in a package"


def test_is_distributed_is_asked_in_one_place():
    """``dist.is_initialized()`` lives in robustdist.runtime.dist; the rest ask it (is_up, is_multi, rank, ...)."""
    offenders = [str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
                 if p.name != "dist.py" and "dist.is_initialized()" in p.read_text()]
    assert not offenders, f"these modules ask torch.distributed directly instead of robustdist.runtime.dist: " \
                          f"{offenders}"


def test_every_subpackage_ships_in_the_wheel():
    """An editable install finds every package; a wheel ships only those pyproject lists."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {_module_name(p) for p in PACKAGE.rglob("__init__.py")}
    assert found == listed, f"pyproject.toml [tool.setuptools] packages lists {sorted(listed)}; the tree has " \
                            f"{sorted(found)}"


def test_each_package_exports_what_it_names():
    """Every lazy export of every package resolves, and is the object the module itself defines."""
    import importlib

    for init in sorted(PACKAGE.rglob("__init__.py")):
        package = importlib.import_module(_module_name(init))
        for name in getattr(package, "__all__", ()):
            if name == "__version__":
                continue
            assert getattr(package, name) is not None, f"{package.__name__}.{name} did not resolve"


def _calls(predicate: Any) -> list[str]:
    """``file:line`` of every node of the package's source that ``predicate`` accepts."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if predicate(node):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return found


def test_the_coordination_primitives_each_exist_once():
    """One place makes a TCPStore (``runtime/job_store``), one polls a store for keys and one runs the arrival
    rule (``runtime/store_barrier``), one runs a blocking call with a deadline on a thread (``runtime/deadline``),
    one gathers every rank's object over a group (``runtime/dist.gather_objects``), one parses JSON read back
    (``runtime/stored``), one judges whether a rank is lost (``runtime/liveness``): every other part uses them."""
    def named(node: ast.AST, name: str) -> bool:
        return isinstance(node, ast.Call) and (getattr(node.func, "attr", None) == name
                                                or getattr(node.func, "id", None) == name)

    stores = [s for s in _calls(lambda n: named(n, "TCPStore")) if not s.startswith("robustdist/runtime/job_store.py")]
    assert not stores, f"TCPStore made outside robustdist.runtime.job_store: {stores}"

    def polls_a_store(node: ast.AST) -> bool:  # `while not store.check(...)` / `while ... and not x.check(...)`
        return isinstance(node, ast.While) and any(named(n, "check") for n in ast.walk(node.test))

    polls = [s for s in _calls(polls_a_store) if not s.startswith("robustdist/runtime/store_barrier.py")]
    assert not polls, f"store polls outside robustdist.runtime.store_barrier (use wait_for or barrier): {polls}"

    gathers = [s for s in _calls(lambda n: named(n, "all_gather_object"))
               if not s.startswith("robustdist/runtime/dist.py")]
    assert not gathers, f"all_gather_object outside robustdist.runtime.dist (use gather_objects): {gathers}"

    # JSON read back (a store's values, the environment, checkpoint manifests and records) is input: parsed only
    # by runtime.stored.json_value. Left: JSON robustdist made itself in the same process or its own child.
    own = ("robustdist/runtime/stored.py",
           "robustdist/runtime/versions.py",  # the package's own data file
           "robustdist/checkpoint/_payload.py",  # the round trip that proves metadata is plain JSON
           "robustdist/doctor.py",  # the line its own probe subprocess prints
           "robustdist/launcher/spare.py")  # the orders of the agent that started it, on its own pipe
    parses = [s for s in _calls(lambda n: isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "loads"
                                and getattr(n.func.value, "id", None) == "json") if not s.startswith(own)]
    assert not parses, f"json.loads outside robustdist.runtime.stored (use json_value, bounded): {parses}"

    # A heartbeat record's "alive" (the writer's wall time) is only a token for the liveness rule, handed to
    # runtime.liveness.Changes.see, never a time to compare with this node's clock.
    def alive_reads(tree: ast.AST) -> set[ast.AST]:
        return {n for n in ast.walk(tree) if isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Load)
                and isinstance(n.slice, ast.Constant) and n.slice.value == "alive"}

    def alive_gets(tree: ast.AST) -> list[ast.AST]:  # rec.get("alive")
        return [n for n in ast.walk(tree) if named(n, "get") and n.args and isinstance(n.args[0], ast.Constant)
                and n.args[0].value == "alive"]

    judged = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        handed = {n for call in ast.walk(tree) if named(call, "see") for n in alive_reads(call)}
        judged += [f"{path.relative_to(PACKAGE.parent)}:{n.lineno}"
                   for n in [*(alive_reads(tree) - handed), *alive_gets(tree)]]
    assert not judged, f'a heartbeat\'s "alive" read outside runtime.liveness.Changes.see: {judged}'


def test_only_the_facade_touches_a_hardened_object_s_private_state():
    """In-process recovery goes through ``Hardened.generations()``; its mixins (``RayReporting``,
    ``ProgressMarks``) use ``self``. No other module reads or writes a private attribute of a ``Hardened``."""
    facade = PACKAGE / "_hardened.py"
    private = {node.attr for node in ast.walk(ast.parse(facade.read_text()))
               if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
               and isinstance(node.value, ast.Name) and node.value.id in ("self", "h")}
    assert {"_sockets", "_rebuild", "_pending"} <= private, private

    def reaches_in(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr in private and isinstance(node.value, ast.Name)
                and node.value.id in ("h", "hardened"))

    offenders = [s for s in _calls(reaches_in) if not s.startswith("robustdist/_hardened.py")]
    assert not offenders, f"a Hardened's private attributes used outside robustdist/_hardened.py: {offenders}"
