"""What the gloo reachability check (:mod:`robustdist.init.reach`) reads back from the job's store, checked.

The store is input (torch's has no authentication; another job on the same port, a stale key): every value is
checked by type and bounded by the world size before use, and anything else is an :class:`InitError` naming the
key, what was expected, and the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from robustdist.runtime.errors import InitError
from robustdist.runtime.stored import Unreadable, json_value

__all__ = ["count", "descriptions", "failures_of", "items", "member_ranks", "rep_ranks", "stored"]

_MAX_VALUE = 1 << 16  # bytes of one description or failure list (a real one is a few hundred)
_MAX_TEXT = 2000
_MAX_NICS = 256


def _hostile(key: str, found: Any, expected: str) -> InitError:
    shown = found[:200] if isinstance(found, (bytes, str)) else str(found)[:200]
    return InitError(f"the gloo reachability check read {shown!r} from the c10d store's key {key!r}; expected "
                     f"{expected}, as a rank of this job writes it. Nothing was probed from it. Fix: another process "
                     "writes into this job's store (a second job on the same MASTER_ADDR:MASTER_PORT, or a stale "
                     "one): give each job its own port.")


def count(store: Any, key: str, limit: int) -> int:
    """The counter ``key``: at most ``limit`` (the world size bounds every list the check keeps)."""
    count = int(store.add(key, 0))
    if not 0 <= count <= limit:
        raise _hostile(key, str(count), f"a count from 0 to {limit} (the world size)")
    return count


def items(store: Any, key: str, limit: int) -> list[bytes]:
    n = count(store, f"{key}/n", limit)
    return list(store.multi_get([f"{key}/{i}" for i in range(1, n + 1)])) if n else []


def _ranks(store: Any, key: str, world_size: int) -> list[int]:
    out = []
    for i, raw in enumerate(items(store, key, world_size), 1):
        text = bytes(raw).decode("ascii", "replace")
        if not (text.isdigit() and len(text) <= 9 and int(text) < world_size):
            raise _hostile(f"{key}/{i}", raw, f"a rank from 0 to {world_size - 1}")
        out.append(int(text))
    if len(set(out)) != len(out):
        raise _hostile(key, str(out), "each rank once")
    return sorted(out)


def rep_ranks(store: Any, prefix: str, world_size: int) -> list[int]:
    return _ranks(store, f"{prefix}/reps", world_size)


def member_ranks(store: Any, prefix: str, group: str, world_size: int) -> list[int]:
    return _ranks(store, f"{prefix}/members/{group}", world_size)


class _Unlike(ValueError):
    """A value read from the store is not what a rank of this job writes (its message: what was expected)."""


def stored(key: str, raw: bytes, check: Callable[[Any], Any]) -> Any:
    """``check(the JSON in raw)``, or the InitError naming ``key``."""
    try:
        value = json_value(raw, _MAX_VALUE)
    except Unreadable as e:
        raise _hostile(key, raw, f"JSON of at most {_MAX_VALUE} bytes ({e})") from None
    try:
        return check(value)
    except _Unlike as e:
        raise _hostile(key, raw, str(e)) from None


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise _Unlike(what)


def _text(value: Any, limit: int = _MAX_TEXT) -> bool:
    return isinstance(value, str) and len(value) <= limit


def _nics(value: Any, *, least: int = 0) -> bool:
    return isinstance(value, list) and least <= len(value) <= _MAX_NICS and all(
        isinstance(i, dict) and (i.get("if") is None or _text(i["if"], 64)) and _text(i.get("addr"), 64)
        and (i.get("port") is None or (type(i["port"]) is int and 0 < i["port"] < 65536)) for i in value)


def _description(d: Any, rank: int) -> dict[str, Any]:
    _need(isinstance(d, dict) and d.get("rank") == rank and type(d["rank"]) is int,
          f"a description of rank {rank}")
    _need(all(_text(d.get(k)) for k in ("node", "label", "how", "group")), "a description with text fields")
    _need(d.get("node_rank") is None or type(d["node_rank"]) is int, "a description whose node_rank is an int")
    _need(d.get("default") is None or _text(d["default"], 64), "a description whose default address is text")
    _need(d.get("error") is None or _text(d["error"]), "a description whose error is text")
    _need(_nics(d.get("binds"), least=1) and _nics(d.get("ifaces")), "a description with lists of interfaces")
    return d


def descriptions(store: Any, prefix: str, ranks: list[int], world_size: int) -> dict[int, dict[str, Any]]:
    keys = [f"{prefix}/desc/{r}" for r in ranks]
    return {r: stored(k, v, lambda d, r=r: _description(d, r)) for r, k, v in zip(ranks, keys,
                                                                                    store.multi_get(keys))}


def failures_of(f: Any, ranks: list[int]) -> dict[str, Any]:
    _need(isinstance(f, dict) and f.get("prober") in ranks and type(f["prober"]) is int,
          f"a failure list of one of ranks {ranks}")
    items = f.get("failures")
    _need(isinstance(items, list) and len(items) <= _MAX_NICS * len(ranks), "a list of failures")
    for item in items:
        _need(isinstance(item, dict) and item.get("target") in ranks and type(item["target"]) is int
              and _text(item.get("addr"), 64) and _text(item.get("detail"))
              and isinstance(item.get("diagnosed", True), bool)
              and all(isinstance(item.get(side), list) and len(item[side]) <= _MAX_NICS
                      and all(_text(n, 64) for n in item[side]) for side in ("theirs", "mine")),
              "failures naming a probed rank, its address, the error, and interface names")
    return f
