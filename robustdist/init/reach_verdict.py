"""The verdict of :mod:`robustdist.init.reach`: the representatives' failures, grouped into problems and told
as one message. Pure functions of what every rank read from the store, so every rank builds the same text."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["MAX_DIAGNOSED", "build_message", "diagnose", "ranks_phrase"]

MAX_DIAGNOSED = 16  # failed targets per representative whose other addresses are tried
_MAX_PARTS = 6  # problems spelled out in one message


def diagnose(reps: Sequence[dict[str, Any]], results: Mapping[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Group the representatives' failures into problems, deterministically (every rank gets the same list).

    ``bind``: peers cannot reach a group's bind address but reach another of its interfaces (fix: that
    interface); ``route``: a prober reaches the address only from a non-default source (fix: its routes);
    ``cut``: nothing tried connects (a partition or firewall); ``unreached``: not diagnosed (a prober tries
    the alternatives of its first few failures only); ``listen``: a representative could not even listen on
    its bind address. ``bind``, ``cut`` and ``unreached`` gather every prober that failed on one address."""
    problems: dict[tuple[Any, ...], dict[str, Any]] = {}
    for rep in sorted(reps, key=lambda r: r["rank"]):
        if rep.get("error"):
            problems[("listen", rep["rank"])] = {"kind": "listen", "rank": rep["rank"], "detail": rep["error"]}
    for prober in sorted(results):
        for f in results[prober]:
            if not f.get("diagnosed", True):
                key: tuple[Any, ...] = ("unreached", f["target"], f["addr"])
            elif f["theirs"]:
                key = ("bind", f["target"], f["addr"])
            elif f["mine"]:
                key = ("route", prober, f["target"], f["addr"])
            else:
                key = ("cut", f["target"], f["addr"])
            p = problems.setdefault(key, {"kind": key[0], "rank": f["target"], "addr": f["addr"], "peers": {},
                                          "prober": prober, "mine": f["mine"]})
            p["peers"][prober] = {"detail": f["detail"], "theirs": f["theirs"]}
    return list(problems.values())


def ranks_phrase(ranks: Sequence[int]) -> str:
    """``rank 3``, ``ranks 0-7, 9``: consecutive ranks folded into ranges."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return ("rank " if len(ranks) == 1 else "ranks ") + (text or "none")


def _who(rep: Mapping[str, Any], members: Mapping[str, list[int]]) -> str:
    return f"{ranks_phrase(members.get(rep['group'], [rep['rank']]))} on {rep['label']}"


def _peers(p: Mapping[str, Any], reps: Mapping[int, dict[str, Any]], members: Mapping[str, list[int]]) -> str:
    probers = sorted(p["peers"])
    if len(probers) <= 3:
        return " and ".join(_who(reps[r], members) for r in probers)
    ranks = [m for r in probers for m in members.get(reps[r]["group"], [r])]
    return (f"{ranks_phrase(ranks)} on {len(probers)} nodes ({reps[probers[0]]['label']}, "
            f"{reps[probers[1]]['label']}, ...)")


def _node_name(rep: Mapping[str, Any]) -> str:
    return f"node {rep['node_rank']}" if rep.get("node_rank") is not None else str(rep["label"])


def _ifaces(rep: Mapping[str, Any], names: Sequence[str]) -> str:
    addrs = {i["if"]: i["addr"] for i in rep["ifaces"]}
    return ", ".join(f"{n} ({addrs.get(n, '?')})" for n in names)


def _bind_text(p: Mapping[str, Any], reps: Mapping[int, dict[str, Any]], members: Mapping[str, list[int]]) -> str:
    rep = reps[p["rank"]]
    verb = "binds" if len(members.get(rep["group"], [1])) == 1 else "bind"
    sets = [set(v["theirs"]) for v in p["peers"].values()]
    good = [n for n in (i["if"] for i in rep["ifaces"]) if n in set.intersection(*sets)] or \
           [n for n in (i["if"] for i in rep["ifaces"]) if n in set.union(*sets)]
    bound = next((b for b in rep["binds"] if b["addr"] == p["addr"]), {"if": None})
    how = f"GLOO_SOCKET_IFNAME={bound['if']} ({p['addr']})" if bound["if"] else rep["how"]
    unset = (" (or unset it)" if rep["binds"][0]["if"] and rep.get("default") in
             {i["addr"] for i in rep["ifaces"] if i["if"] in good} else "")
    fix = (f"set GLOO_SOCKET_IFNAME={good[0]}" if len(good) == 1
           else f"set GLOO_SOCKET_IFNAME to one of {', '.join(good)}")
    return (f"{_who(rep, members)} {verb} gloo to {how}, which {_peers(p, reps, members)} cannot reach "
            f"({p['peers'][min(p['peers'])]['detail']}); interfaces on {_node_name(rep)} that reach them: "
            f"{_ifaces(rep, good)}. Fix: {fix} on {_node_name(rep)}{unset}")


def _problem_text(p: Mapping[str, Any], reps: Mapping[int, dict[str, Any]], members: Mapping[str, list[int]]) -> str:
    rep = reps[p["rank"]]
    if p["kind"] == "listen":
        return (f"{_who(rep, members)} cannot listen on the address gloo would bind ({rep['how']}: {p['detail']}); "
                "expected a local address. Fix: set GLOO_SOCKET_IFNAME to an interface with an IPv4 address")
    if p["kind"] == "bind":
        return _bind_text(p, reps, members)
    prober = reps[p["prober"]]
    detail = p["peers"][p["prober"]]["detail"]
    if p["kind"] == "unreached":
        return (f"{_peers(p, reps, members)} cannot reach {_who(rep, members)} at gloo's address {p['addr']} "
                f"({detail}; not diagnosed: each rank tries the other addresses of its first {MAX_DIAGNOSED} "
                "failures only)")
    if p["kind"] == "route":
        return (f"{_who(prober, members)} cannot reach gloo's address {p['addr']} of {_who(rep, members)} from its "
                f"default source address ({detail}), only from {_ifaces(prober, p['mine'])}; gloo connects from the "
                f"default one. Fix: correct the route to {p['addr']} on {_node_name(prober)} (`ip route get "
                f"{p['addr']}`)")
    return (f"{_peers(p, reps, members)} cannot reach {_who(rep, members)} at gloo's address {p['addr']} "
            f"({detail}), nor at any other address of {_node_name(rep)}, from any of their interfaces: the nodes are "
            "partitioned or a firewall drops TCP between them. Fix: check the link, and allow TCP on all ports "
            "between the nodes (gloo listens on random ports)")


def build_message(problems: list[dict[str, Any]], reps: Mapping[int, dict[str, Any]],
                  members: Mapping[str, list[int]]) -> tuple[str, list[int]]:
    """The error every rank raises, and the ranks it blames."""
    rank_of = {"listen": -1 << 30, "unreached": 1 << 30}  # first what cannot listen, last what was not diagnosed
    ordered = sorted(problems, key=lambda p: rank_of[p["kind"]] if p["kind"] in rank_of else -len(p["peers"]))
    parts = [_problem_text(p, reps, members) for p in ordered]
    if len(parts) > _MAX_PARTS:  # a partition of N nodes makes N problems: the first few tell the story
        parts = parts[:_MAX_PARTS - 1] + [f"and {len(parts) - _MAX_PARTS + 1} more problems of the same kinds"]
    blamed = sorted({r for p in problems for r in members.get(reps[p["prober" if p["kind"] == "route" else "rank"]]
                                                              ["group"], [])})
    return (" | ".join(parts) + ". (Checked before init_process_group, whose full-mesh connect would otherwise "
            "wait for the whole init timeout.)"), blamed
