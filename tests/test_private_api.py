"""Nothing in robustdist touches a private torch or Ray name but the fenced modules, one per area:
``robustdist/runtime/_<area>_compat.py`` (process groups, modules and tensors: ``_torch_compat``; serialisation and
DCP; mixed precision; the DataLoader; torchelastic's agent; Ray). Like the layering test, this reads the source
(ast), so a new private access fails here before a torch or Ray release breaks it silently.

Found as private: an import of a torch/ray module path with a ``_`` segment or of a ``_`` name from one; an
attribute chain with a ``_`` name rooted at a name bound to a torch or Ray import (``dist.distributed_c10d._x``,
``torch._C``); and, anywhere, the distinctive private member names robustdist has used on torch or Ray objects
(as an attribute, a method defined, or a string), which ast cannot tie to a type."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "robustdist"
FENCES = set((PACKAGE / "runtime").glob("_*_compat.py"))
DEPENDENCIES = ("torch", "ray")
# Private members of torch/Ray objects, matched by name: robustdist's own code never uses these names.
MEMBER_NAMES = frozenset({
    "_next_data", "_get_iterator", "_index_sampler", "_iterator", "_num_samples", "_slice_file", "_orig_mod",
    "_buffers", "_version", "_values", "_metadata", "_actor_id", "_get_default_store", "_get_default_group",
    "underlying_store", "_has_storage", "_get_obj_state", "_save", "_legacy_save", "_StorageInfo",
    "_amp_foreach_non_finite_check_and_unscale_", "_foreach_norm", "_connect_and_get_accessor",
    "_BaseDataLoaderIter", "_SingleProcessDataLoaderIter", "_MultiProcessingDataLoaderIter", "_BatchNorm",
    "_NormBase", "_MEM_FORMAT_ENCODING", "_get_layout", "_rebuild_nested_tensor", "_internal", "_private",
    "_per_optimizer_states", "_schedulers",
})

# torch's private methods a subclass could override (robustdist's own functions may share other names above).
OVERRIDES = frozenset({"_next_data", "_get_iterator", "_index_sampler", "_slice_file", "_reset", "_try_get_data"})


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


# a dotted path into a private part of torch or Ray, in a string (importlib.import_module("torch.distributed._x"))
_PRIVATE_PATH = re.compile(r"\b(?:torch|ray)(?:\.\w+)*\._[A-Za-z]")


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    bound: set[str] = set()  # names bound to a torch/ray module or object by an import
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in DEPENDENCIES:
                    bound.add(alias.asname or parts[0])
                    if any(map(_private, parts)):
                        out.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in DEPENDENCIES:
            for alias in node.names:
                bound.add(alias.asname or alias.name)
            names = [a.name for a in node.names]
            if any(map(_private, node.module.split("."))) or any(map(_private, names)):
                out.append(f"{node.lineno}: from {node.module} import {', '.join(names)}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base, chain = node.value, [node.attr]
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound and any(map(_private, chain)):
                out.append(f"{node.lineno}: {ast.unparse(node)}")
            elif node.attr in MEMBER_NAMES:
                out.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in OVERRIDES:
            out.append(f"{node.lineno}: def {node.name}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2 and isinstance(
                node.args[0], ast.Name) and node.args[0].id in bound and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and _private(node.args[1].value):
            out.append(f"{node.lineno}: {ast.unparse(node)}")  # getattr(torch, "_C")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                node.value in MEMBER_NAMES or _PRIVATE_PATH.search(node.value) or any(
                    f"._{p}" in node.value for p in ("internal", "private"))):
            if not _docstring(tree, node):
                out.append(f"{node.lineno}: {node.value!r:.80}")
    return sorted(set(out), key=lambda s: int(s.split(":")[0]))


def _docstring(tree: ast.AST, const: ast.Constant) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and first.value is const:
                return True
    return False


def test_no_private_torch_or_ray_name_outside_the_fences():
    assert len(FENCES) >= 6, f"expected the fences robustdist/runtime/_<area>_compat.py; found {sorted(FENCES)}"
    found = {str(p.relative_to(PACKAGE.parent)): v for p in sorted(PACKAGE.rglob("*.py"))
             if p not in FENCES and (v := _violations(p))}
    assert not found, (
        "private torch/Ray names outside the fences, robustdist/runtime/_<area>_compat.py "
        "(move each access into the fence, with a PrivateAPI entry and the versions it was verified on):\n"
        + "\n".join(f"  {path}:{line}" for path, lines in found.items() for line in lines))


def test_the_check_finds_each_kind_of_access(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch\nimport torch.distributed as dist\nfrom torch.utils.data.dataloader import _BaseDataLoaderIter\n"
        "from ray._private.state import state\n"
        "x = dist.distributed_c10d._get_default_group()\ny = torch._C\nz = loader._iterator\n"
        "def _next_data(self):\n    return getattr(s, '_num_samples')\n"
        "from ray.train.v2._internal.util import f\n"
        "a = getattr(torch, '_dynamo')\nb = importlib.import_module('torch.distributed._tensor')\n")
    found = "\n".join(_violations(sample))
    for expected in ("3: from torch.utils.data.dataloader", "4: from ray._private.state", "5: dist.distributed_c10d",
                     "6: torch._C", "7: ._iterator", "8: def _next_data", "9: '_num_samples'", "10: from ray.train",
                     "11: getattr(torch, '_dynamo')", "12: 'torch.distributed._tensor'"):
        assert expected in found, (expected, found)
    clean = tmp_path / "clean.py"
    clean.write_text('"""Mentions torch._C in a docstring only."""\nimport torch\nself._pos = torch.ones(1)\n')
    assert _violations(clean) == []
