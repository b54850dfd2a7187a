"""What the launcher's environment variables say, each integer parsed with a range check.

The environment is input robustdist does not control (a stale shell, a hand-written sbatch script), so
every integer is checked before use and a bad one is a :class:`~robustdist.runtime.errors.TopologyError` naming the
variable, its value, the accepted range and the fix:

* ranks and ids (``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``, ``NODE_RANK``, ``SLURM_PROCID``, ``SLURM_LOCALID``,
  ``SLURM_NODEID``) lie in ``0 .. MAX_COUNT - 1``;
* sizes and counts (``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_WORLD_SIZE``, ``SLURM_NTASKS``,
  ``SLURM_NNODES``, ``SLURM_NTASKS_PER_NODE``, each count and ``(xN)`` repeat of ``SLURM_TASKS_PER_NODE``)
  lie in ``1 .. MAX_COUNT``;
* a node rank is below the node count when both are set (``GROUP_RANK``/``NODE_RANK`` vs
  ``GROUP_WORLD_SIZE``, ``SLURM_NODEID`` vs ``SLURM_NNODES``).

Digit strings are length-checked before ``int()`` and ``SLURM_TASKS_PER_NODE`` is walked group by group,
never expanded, so no value costs more than a pass over its text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from robustdist.runtime.errors import TopologyError

MAX_COUNT = 2**24  # 16,777,216 ranks or nodes: more than any job has
_MAX_DIGITS = len(str(MAX_COUNT))
_INT_RE = re.compile(r"[+-]?[0-9]+")
_GROUP_RE = re.compile(r"\s*([0-9]+)(?:\(x([0-9]+)\))?\s*")
_FIX = "Fix: unset {name}, or let the launcher set it (torchrun sets RANK, WORLD_SIZE, LOCAL_* and GROUP_*; srun sets SLURM_*)."


def shown(raw: str, limit: int = 40) -> str:
    """``repr`` of an environment value, cut to ``limit`` characters before formatting."""
    return repr(raw) if len(raw) <= limit else repr(raw[:limit]) + "..."


@dataclass
class Raw:
    """What one source says; None means "this source does not say"."""

    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    local_world_size: int | None = None
    node_rank: int | None = None
    num_nodes: int | None = None


def int_env(env: Mapping[str, str], name: str, *, minimum: int, rank_hint: int | None = None) -> int | None:
    """``env[name]`` as an int in ``minimum .. MAX_COUNT`` (``MAX_COUNT - 1`` for ids), or None when unset/empty."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    text = raw.strip()
    if not _INT_RE.fullmatch(text):
        raise TopologyError(
            f"{name}={shown(raw)} is not an integer; expected a whole number set by the launcher. "
            f"Fix: unset {name} or launch with torchrun, which sets it.",
            rank=rank_hint,
        )
    maximum = MAX_COUNT - 1 if minimum == 0 else MAX_COUNT
    digits = text.lstrip("+-").lstrip("0")
    value = int(text) if len(digits) <= _MAX_DIGITS else None  # never int() a huge digit string
    if value is None or not minimum <= value <= maximum:
        what = "a rank or id counts from 0" if minimum == 0 else "a size or count is at least 1"
        raise TopologyError(
            f"{name}={shown(raw)} is out of range; expected an integer in {minimum}..{maximum} ({what}). "
            + _FIX.format(name=name),
            rank=rank_hint,
        )
    return value


def from_torch_env(env: Mapping[str, str]) -> Raw:
    """The torchrun / torch-elastic variables."""
    rank = int_env(env, "RANK", minimum=0)
    group_rank = int_env(env, "GROUP_RANK", minimum=0, rank_hint=rank)
    node_rank = int_env(env, "NODE_RANK", minimum=0, rank_hint=rank)
    num_nodes = int_env(env, "GROUP_WORLD_SIZE", minimum=1, rank_hint=rank)
    node_var = "GROUP_RANK" if group_rank is not None else "NODE_RANK"
    node = group_rank if group_rank is not None else node_rank
    _check_node(node_var, node, "GROUP_WORLD_SIZE", num_nodes, rank,
                "give each node a distinct rank below the node count (torchrun --node_rank < --nnodes)")
    return Raw(
        rank=rank,
        world_size=int_env(env, "WORLD_SIZE", minimum=1, rank_hint=rank),
        local_rank=int_env(env, "LOCAL_RANK", minimum=0, rank_hint=rank),
        local_world_size=int_env(env, "LOCAL_WORLD_SIZE", minimum=1, rank_hint=rank),
        node_rank=node,
        num_nodes=num_nodes,
    )


def from_slurm(env: Mapping[str, str]) -> Raw:
    """The SLURM variables ``srun`` sets for each task."""
    rank = int_env(env, "SLURM_PROCID", minimum=0)
    node = int_env(env, "SLURM_NODEID", minimum=0, rank_hint=rank)
    num_nodes = int_env(env, "SLURM_NNODES", minimum=1, rank_hint=rank)
    _check_node("SLURM_NODEID", node, "SLURM_NNODES", num_nodes, rank,
                "unset the stale SLURM_* variables, or start the job with srun, which sets them")
    return Raw(
        rank=rank,
        world_size=int_env(env, "SLURM_NTASKS", minimum=1, rank_hint=rank),
        local_rank=int_env(env, "SLURM_LOCALID", minimum=0, rank_hint=rank),
        local_world_size=slurm_tasks_on_node(env, node, rank),
        node_rank=node,
        num_nodes=num_nodes,
    )


def _check_node(node_var: str, node: int | None, count_var: str, count: int | None, rank: int | None,
                fix: str) -> None:
    if node is not None and count is not None and node >= count:
        raise TopologyError(
            f"{node_var}={node} but {count_var}={count}; expected {node_var} < {count_var} (node ranks count "
            f"from 0). Fix: {fix}.",
            rank=rank,
        )


def slurm_tasks_on_node(env: Mapping[str, str], node: int | None, rank: int | None) -> int | None:
    """Tasks on node ``node`` (0 when None), from ``SLURM_TASKS_PER_NODE`` (e.g. ``"2(x3),1"``).

    Falls back to ``SLURM_NTASKS_PER_NODE`` when the spec is unset; None when the spec has an unknown
    syntax or no group for ``node``. The groups are walked arithmetically: ``"1(x1000000000000)"`` is
    refused by the repeat bound, never expanded into a list.
    """
    spec = env.get("SLURM_TASKS_PER_NODE")
    if not spec or not spec.strip():
        return int_env(env, "SLURM_NTASKS_PER_NODE", minimum=1, rank_hint=rank)
    index, found = (0 if node is None else node), None
    for part in spec.split(","):
        m = _GROUP_RE.fullmatch(part)
        if not m:
            return None  # a syntax this parser does not know: this source does not say
        count = _spec_number(spec, m.group(1), "task count", rank)
        repeat = 1 if m.group(2) is None else _spec_number(spec, m.group(2), "repeat (xN)", rank)
        if found is None and index < repeat:
            found = count
        index -= repeat
    return found


def _spec_number(spec: str, text: str, what: str, rank: int | None) -> int:
    value = int(text) if len(text.lstrip("0")) <= _MAX_DIGITS else None
    if value is None or not 1 <= value <= MAX_COUNT:
        raise TopologyError(
            f"SLURM_TASKS_PER_NODE={shown(spec)} has the {what} {shown(text, 20)}; expected every task count and "
            f"(xN) repeat in 1..{MAX_COUNT}. Fix: unset SLURM_TASKS_PER_NODE, or start the job with srun, which "
            "sets it (e.g. '4(x2),3').",
            rank=rank,
        )
    return value
