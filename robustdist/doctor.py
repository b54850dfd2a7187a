"""``robustdist doctor``: check this machine and, under a launcher, the whole job, before a run burns hours.

Each :class:`Finding` has a level (``ok``, ``warn``, ``error``) and a remedy. Single-process checks:
versions against the supported and tested ranges, CUDA and ``CUDA_VISIBLE_DEVICES``, ``NCCL_*``/``GLOO_*``
socket interfaces, which of this host's interfaces reach ``MASTER_ADDR:MASTER_PORT`` (and whether the
``*_SOCKET_IFNAME`` variables pick one that does), ``/dev/shm`` size and free space, ``ulimit -n``, NUMA nodes
and each GPU's NUMA node (sysfs), the detected topology, and a Ray cluster's resources when ``RAY_ADDRESS``
is set.

Under torchrun (``torchrun --nproc_per_node=2 -m robustdist doctor``) every rank also runs
:func:`~robustdist.init.process_group.safe_init_process_group`; rank 0 prints the cross-rank table (one row per
rank, ``*`` marks a value that differs from the most common one) and the other ranks' findings that are not
ok. Every rank exits with the same code: 0 when no rank found an error, 1 otherwise.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from robustdist.init import reach as _reach
from robustdist.runtime import netenv, versions

__all__ = ["Finding", "collect_findings", "run_doctor"]

# Python, torch, Ray and numpy are judged by the version matrix's data (robustdist.runtime.versions): tested,
# untested inside the range, or unsupported (numpy: tested, or untested; pyproject leaves it to torch).
_LEVELS = {"tested": "ok", "untested": "warn", "unsupported": "error"}
SHM_WARN_BYTES = 1 << 30
NOFILE_WARN = 4096


@dataclass
class Finding:
    check: str
    level: str  # "ok" | "warn" | "error"
    value: str
    remedy: str = ""


def _installed(name: str) -> str | None:
    if name == "python":
        return platform.python_version()
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check_versions() -> list[Finding]:
    out = []
    found_all: dict[str, str] = {}
    for name in versions.DEPENDENCIES:
        found = _installed(name)
        if found is None:
            out.append(Finding(f"version.{name}", "ok", "not installed", "optional: pip install 'robustdist[ray]'"))
            continue
        found_all[name] = found
        try:
            verdict = versions.classify(name, found)
        except versions.MatrixDataError as e:  # a damaged install: no verdict can be trusted
            out.append(Finding(f"version.{name}", "error", found, str(e)))
            continue
        out.append(Finding(f"version.{name}", _LEVELS[verdict.status], f"{found} ({verdict.status})",
                           "" if verdict.status == "tested" else verdict.message))
    if len(found_all) == len(versions.DEPENDENCIES):
        try:
            lane = versions.combination(found_all)
        except versions.MatrixDataError:
            lane = None
        shown = ", ".join(f"{k} {v}" for k, v in found_all.items())
        out.append(Finding("version.combination", "ok", f"tested together (matrix lane {lane})" if lane else
                           "not a matrix lane", "" if lane else f"{shown}: each version is judged above on its own; "
                           "no lane ran these minors together (docs/status.md lists the lanes)"))
    out.append(_numpy_finding())
    return out


def _numpy_finding() -> Finding:
    found = _installed("numpy")
    if found is None:
        return Finding("version.numpy", "error", "not installed", "pip install numpy (a robustdist dependency)")
    try:
        minor = Version(found).release[:2]
        tested = sorted({str(lane["numpy"]) for lane in versions.matrix()["lanes"]
                         if lane["ok"] and isinstance(lane.get("numpy"), str)}, key=Version)
    except (InvalidVersion, versions.MatrixDataError) as e:
        return Finding("version.numpy", "warn", found, f"cannot check it against the tested matrix ({e})")
    if any(Version(t).release[:2] == minor for t in tested):
        return Finding("version.numpy", "ok", f"{found} (tested)")
    return Finding("version.numpy", "warn", f"{found} (untested)",
                   f"no matrix lane ran numpy {minor[0]}.{minor[1]} (tested: {', '.join(tested)})")


def check_cuda() -> list[Finding]:
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not torch.cuda.is_available():
        return [Finding("cuda", "ok", f"not available: CPU only, gloo backend (CUDA_VISIBLE_DEVICES={visible!r})")]
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return [Finding("cuda", "ok", f"{len(names)} device(s): {', '.join(names)}; CUDA_VISIBLE_DEVICES={visible!r}")]


def check_network_env() -> list[Finding]:
    out = []
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        value = os.environ.get(var)
        problem = netenv.check_socket_ifname(var, value)
        if problem:
            out.append(Finding(f"env.{var}", "error", repr(value), problem))
        else:
            out.append(Finding(f"env.{var}", "ok", "unset" if value is None else f"{value!r} (interfaces exist)"))
    others = sorted(k for k in os.environ if k.startswith(("NCCL_", "GLOO_")) and not k.endswith("SOCKET_IFNAME"))
    if others:
        out.append(Finding("env.nccl_gloo", "ok", ", ".join(f"{k}={os.environ[k]}" for k in others)))
    return out


def check_reach(env: Mapping[str, str] | None = None, timeout: float = _reach.CONNECT_TIMEOUT_S) -> list[Finding]:
    """Which of this host's interfaces reach ``MASTER_ADDR:MASTER_PORT`` (a TCP connect from each one's
    address, in parallel; a refused connection still proves the route), and whether ``GLOO_SOCKET_IFNAME`` /
    ``NCCL_SOCKET_IFNAME`` pick one that does not while another does. Run it on every node but the master's:
    there every interface reaches the master through the host itself."""
    env = os.environ if env is None else env
    host, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
    if not host or not port.isdigit():
        return [Finding("reach", "ok", "skipped: MASTER_ADDR/MASTER_PORT are not set (export them or use a launcher)")]
    addresses, error = netenv.resolve_addresses(host, 5.0)
    if error or not addresses:
        return [Finding("reach", "warn", f"MASTER_ADDR={host!r} does not resolve ({error})",
                        "use the master node's IP address or a name every node resolves")]
    master = next((a for a in addresses if ":" not in a), addresses[0])
    ifaces = _reach.local_interfaces()
    if netenv.local_only(master) or master in ifaces.values():
        return [Finding("reach", "ok", f"skipped: MASTER_ADDR {master} is on this host (every interface reaches it "
                        "here); run the doctor on the other nodes")]
    names = sorted(ifaces)
    with ThreadPoolExecutor(max(1, min(16, len(names)))) as pool:
        outcomes = dict(zip(names, pool.map(lambda n: _reach.reaches(ifaces[n], master, int(port), timeout), names)))
    target = f"MASTER_ADDR {master}:{port}"
    out = [Finding(f"reach.{n}", "ok", f"{ifaces[n]} -> {target}: {'reaches' if ok else 'does not reach'}: {how}")
           for n, (ok, how) in outcomes.items()]
    good = [n for n in names if outcomes[n][0]]
    if not good:
        out.append(Finding("reach", "warn", f"no interface here reaches {target}",
                           "check that the master node is up, the link, and that its firewall lets TCP in"))
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if (problem := _ifname_problem(var, env.get(var, ""), ifaces, outcomes, good, target)) is not None:
            out.append(problem)
    return out


def _ifname_problem(var: str, value: str, ifaces: dict[str, str], outcomes: dict[str, tuple[bool, str]],
                    good: list[str], target: str) -> Finding | None:
    """gloo listens on every interface GLOO_SOCKET_IFNAME names; NCCL takes the first interface (in the host's
    order) that NCCL_SOCKET_IFNAME matches. Either failing while another interface works is an error (for NCCL
    a warning when another match works: the order is the kernel's)."""
    if not value:
        return None
    names = ([n.strip() for n in value.split(",") if n.strip()] if var == "GLOO_SOCKET_IFNAME"
             else netenv._nccl_matches(value, list(ifaces)))
    named = [n for n in names if n in outcomes]
    bad = [n for n in (named if var == "GLOO_SOCKET_IFNAME" else named[:1]) if not outcomes[n][0]]
    if not bad or not good:
        state = "no IPv4 interface of it to test" if not named else f"reaches {target}" if not bad else "no reach"
        return Finding(f"reach.{var}", "ok", f"{value!r}: {state}")
    level = "warn" if var == "NCCL_SOCKET_IFNAME" and any(outcomes[n][0] for n in named) else "error"
    listed = ", ".join(f"{n} ({ifaces[n]})" for n in bad)
    works = ", ".join(f"{n} ({ifaces[n]})" for n in good)
    default = _reach.gloo_default_address(2.0)[0] if var == "GLOO_SOCKET_IFNAME" else None
    unset = " (or unset it)" if default is not None and default in {ifaces[n] for n in good} else ""
    return Finding(f"reach.{var}", level, f"{bad[0]} does not reach {target}",
                   f"{var}={value} names {listed}, which does not reach {target} ({outcomes[bad[0]][1]}); "
                   f"interfaces here that reach it: {works}. Fix: set {var}={good[0]}{unset}")


def check_shm(path: str = "/dev/shm") -> list[Finding]:
    try:
        usage = shutil.disk_usage(path)
    except OSError as e:
        return [Finding("shm", "warn", f"{path}: {e}", "DataLoader workers pass batches through /dev/shm; mount it")]
    value = f"{usage.total / 2**30:.2f} GiB total, {usage.free / 2**30:.2f} GiB free"
    if usage.total < SHM_WARN_BYTES:
        return [Finding("shm", "warn", value, "Docker's default 64 MB gives 'DataLoader worker is killed by signal: "
                        "Bus error'; run with --shm-size=8g or --ipc=host")]
    return [Finding("shm", "ok", value)]


def check_nofile() -> list[Finding]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    value = f"soft {soft}, hard {hard}"
    if 0 <= soft < NOFILE_WARN:
        return [Finding("ulimit.nofile", "warn", value, f"DataLoader workers and sockets need descriptors; "
                        f"raise it: ulimit -n {min(hard, 65536) if hard > 0 else 65536}")]
    return [Finding("ulimit.nofile", "ok", value)]


def check_numa(sysfs: str = "/sys", gpu_bus_ids: list[str] | None = None) -> list[Finding]:
    nodes_dir = Path(sysfs, "devices/system/node")
    nodes = sorted(p.name for p in nodes_dir.glob("node[0-9]*")) if nodes_dir.is_dir() else []
    out = [Finding("numa.nodes", "ok", f"{len(nodes)} ({', '.join(nodes)})" if nodes else "no NUMA info in sysfs")]
    for i, bus in enumerate(gpu_bus_ids if gpu_bus_ids is not None else _gpu_bus_ids()):
        node_file = Path(sysfs, "bus/pci/devices", bus.lower(), "numa_node")
        try:
            node = int(node_file.read_text().strip())
        except (OSError, ValueError):
            out.append(Finding(f"numa.gpu{i}", "warn", f"{bus}: no numa_node in sysfs", "cannot pin CPUs near this GPU"))
            continue
        out.append(Finding(f"numa.gpu{i}", "ok", f"{bus}: node {node}" if node >= 0 else f"{bus}: no affinity (-1)"))
    return out


def _gpu_bus_ids() -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return []
    ids = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        if all(hasattr(p, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
            ids.append(f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0")
    return ids


def check_topology() -> tuple[list[Finding], Any]:
    from robustdist.runtime.errors import TopologyError
    from robustdist.runtime.topology import detect_topology

    try:
        topo = detect_topology()
    except TopologyError as e:
        return [Finding("topology", "error", "inconsistent", str(e))], None
    value = (f"launcher {topo.launcher}, rank {topo.rank}/{topo.world_size}, local {topo.local_rank}/"
             f"{topo.local_world_size}, node {topo.node_rank}/{topo.num_nodes}, device {topo.device}")
    return [Finding("topology", "ok", value)], topo


def check_ray(timeout: float = 60.0) -> list[Finding]:
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        return [Finding("ray.cluster", "ok", "skipped: RAY_ADDRESS is not set")]
    if _installed("ray") is None:
        return [Finding("ray.cluster", "warn", f"RAY_ADDRESS={address!r} but ray is not installed",
                        "pip install 'robustdist[ray]'")]
    unreachable = _probe(address)
    if unreachable:
        return [Finding("ray.cluster", "warn", f"{address}: unreachable ({unreachable})",
                        "check that the head node is up and RAY_ADDRESS points at it (host:6379 or ray://host:10001)")]
    code = ("import json, ray; ray.init(address=__import__('os').environ['RAY_ADDRESS'], log_to_driver=False, "
            "configure_logging=False); print('RESOURCES=' + json.dumps(ray.cluster_resources())); ray.shutdown()")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [Finding("ray.cluster", "warn", f"{address}: no answer within {timeout:g} s",
                        "check that the head node is up and RAY_ADDRESS points at it")]
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESOURCES=")), None)
    if proc.returncode != 0 or line is None:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return [Finding("ray.cluster", "warn", f"{address}: unreachable ({tail[:200]})",
                        "check that the head node is up and RAY_ADDRESS points at it")]
    res = json.loads(line[len("RESOURCES="):])
    shown = ", ".join(f"{k}={v:g}" for k, v in sorted(res.items()) if not k.startswith("node:"))
    return [Finding("ray.cluster", "ok", f"{address}: {shown}")]


def _probe(address: str, timeout: float = 3.0) -> str | None:
    """A bounded TCP connect to ``host:port`` (``ray://`` stripped); None when it connects or is not host:port."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return None  # e.g. "auto": let ray resolve it
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        return str(e) or type(e).__name__
    return None


def collect_findings(*, sysfs: str = "/sys") -> tuple[list[Finding], Any]:
    """Every single-process finding, and the topology (None when it is inconsistent)."""
    topo_findings, topo = check_topology()
    findings = (check_versions() + check_cuda() + check_network_env() + check_reach() + check_shm() + check_nofile()
                + check_numa(sysfs) + topo_findings + check_ray())
    return findings, topo


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip() for row in [headers, *rows]]
    return "\n".join(lines)


def findings_table(findings: list[Finding]) -> str:
    return _table(["check", "level", "value", "remedy"], [[f.check, f.level, f.value, f.remedy] for f in findings])


RANK_COLUMNS = ["rank", "hostname", "pid", "python", "torch", "robustdist", "config", "backend",
                "cuda_visible_devices", "device", "gpu", "env"]


def cross_rank_table(fingerprints: list[dict[str, Any]]) -> str:
    """One row per rank; ``*`` marks a value that differs from the most common value of its column."""
    def cell(fp: dict[str, Any], col: str) -> str:
        value = fp.get(col)
        if col == "config":
            return str(value)[:12]
        if col == "env":
            return ";".join(f"{k}={v}" for k, v in sorted((value or {}).items())) or "-"
        return "-" if value is None else str(value)

    varying = {"rank", "pid"}
    rows = [[cell(fp, c) for c in RANK_COLUMNS] for fp in fingerprints]
    for j, col in enumerate(RANK_COLUMNS):
        if col in varying or col == "hostname":
            continue
        common = Counter(row[j] for row in rows).most_common(1)[0][0]
        for row in rows:
            if row[j] != common:
                row[j] += " *"
    return _table(RANK_COLUMNS, rows)


def _emit(findings: list[Finding], *, as_json: bool, extra: dict[str, Any] | None = None) -> None:
    if as_json:
        print(json.dumps({"findings": [asdict(f) for f in findings], **(extra or {})}, indent=2, default=str))
        return
    print(findings_table(findings))
    for title, text in (extra or {}).get("_sections", []):
        print(f"\n{title}\n{text}")


def run_doctor(*, as_json: bool = False, sysfs: str = "/sys", timeout: float = 120.0) -> int:
    """Run every check (and, under a launcher, the cross-rank ones); print; return the exit code."""
    findings, topo = collect_findings(sysfs=sysfs)
    if topo is None or not topo.is_distributed:
        _emit(findings, as_json=as_json)
        return 1 if any(f.level == "error" for f in findings) else 0
    return _run_distributed(findings, topo, as_json=as_json, timeout=timeout)


def _run_distributed(findings: list[Finding], topo: Any, *, as_json: bool, timeout: float) -> int:
    import torch
    import torch.distributed as dist

    from robustdist.init.process_group import destroy_process_group_if_owned, safe_init_process_group
    from robustdist.runtime import dist as _dist
    from robustdist.runtime.errors import RobustDistError

    try:
        report = safe_init_process_group(
            {"distributed": {"timeout": timeout, "barrier_timeout": min(timeout, 60.0)}}, topology=topo)
    except RobustDistError as e:  # every rank reaches this on its own; all exit 1
        findings.append(Finding("init", "error", "failed", str(e)))
        _emit(findings, as_json=as_json, extra={"rank": topo.rank})
        return 1
    try:
        timings = ", ".join(f"{k} {v:.3f}s" for k, v in report.timings.items())
        findings.append(Finding("init", "ok", f"backend {report.backend}, world {report.world_size}: {timings}"))
        findings += [Finding("agreement", "warn", w, "see the cross-rank table") for w in report.warnings]
        everyone = _dist.gather_objects([asdict(f) for f in findings], report.side_group)
        flag = torch.tensor([float(any(f.level == "error" for f in findings))])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=report.side_group)
        code = int(flag.item())
        if report.rank == 0:
            others = [{"rank": r, **f} for r, fs in enumerate(everyone) if r != 0 for f in fs if f["level"] != "ok"]
            other_rows = [[str(o["rank"]), o["check"], o["level"], o["value"], o["remedy"]] for o in others]
            sections = [("cross-rank (* marks a value that differs from the most common one):",
                         cross_rank_table(report.fingerprints)),
                        ("other ranks' findings that are not ok:",
                         _table(["rank", "check", "level", "value", "remedy"], other_rows) if others else "none")]
            extra = {"ranks": report.fingerprints, "other_findings": others, "exit_code": code}
            _emit(findings, as_json=as_json, extra=extra if as_json else {"_sections": sections})
        return code
    finally:
        destroy_process_group_if_owned(report)
