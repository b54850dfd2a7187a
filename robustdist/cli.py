"""The ``robustdist`` command line (also ``python -m robustdist``).

* ``robustdist info [--json]`` prints the installed versions, the CUDA picture and the detected topology of
  this process. It reads only; it initialises nothing. Exit code 0, or 1 when the topology is inconsistent
  (the error and its fix are printed).
* ``robustdist doctor [--json]`` checks this machine for known failure modes, and under torchrun every
  rank (see :mod:`robustdist.doctor`). Exit code 0 when no check found an error, 1 otherwise.
* ``robustdist verify-checkpoint DIR [--json]`` verifies every committed checkpoint with the checks ``load()``
  runs short of the live objects (:mod:`robustdist.checkpoint._verify`) and prints step, files, bytes, status and
  reason. Exit code 1 if any is not "ok": "corrupt" exactly where a load would fall back past it, "another torch"
  where a load stops at it (only a newer torch reads it).
* ``robustdist clean [--dir BASE] [--dry-run] [--force] [--json]`` removes this user's in-memory checkpoint
  directories under ``BASE`` (``/dev/shm``) that no running process uses (:mod:`robustdist.checkpoint.local.
  leftovers`), and lists those it kept. Exit code 0, or 2 when ``BASE`` cannot be listed.
* ``robustdist run [torchrun's flags] SCRIPT [ARGS]`` is torchrun whose agent starts a worker killed by a signal
  again alone when the script recovers in process (:mod:`robustdist.launcher.launch`); otherwise exactly torchrun.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from importlib import metadata
from typing import Any

from robustdist._version import __version__

__all__ = ["main"]

_PACKAGES = ("torch", "numpy", "packaging", "ray", "pyyaml", "pytest", "hypothesis")


def _version(dist_name: str) -> str | None:
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


def collect_info() -> dict[str, Any]:
    """Versions, CUDA and topology, as plain JSON types. Topology errors are reported, not raised."""
    import torch
    import torch.distributed as dist

    from robustdist.runtime.errors import TopologyError
    from robustdist.runtime.topology import detect_topology

    info: dict[str, Any] = {
        "versions": {"python": platform.python_version(), "robustdist": __version__,
                     **{name: _version(name) for name in _PACKAGES}},
        "platform": {"system": platform.system(), "machine": platform.machine(), "hostname": platform.node()},
    }
    cuda_ok = torch.cuda.is_available()
    info["cuda"] = {
        "available": cuda_ok,
        "torch_cuda": torch.version.cuda,
        "device_count": torch.cuda.device_count() if cuda_ok else 0,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda_ok else [],
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    info["distributed"] = {
        "available": dist.is_available(),
        "backends": [b for b in ("gloo", "nccl", "mpi", "ucc") if dist.is_available()
                     and getattr(dist, f"is_{b}_available", lambda: False)()],
    }
    try:
        topo = detect_topology()
    except TopologyError as e:
        info["topology"] = {"error": str(e)}
    else:
        info["topology"] = {
            "launcher": topo.launcher, "rank": topo.rank, "world_size": topo.world_size,
            "local_rank": topo.local_rank, "local_world_size": topo.local_world_size,
            "node_rank": topo.node_rank, "num_nodes": topo.num_nodes, "device": str(topo.device),
            "master_addr": topo.master_addr, "master_port": topo.master_port,
            "visible_devices": None if topo.visible_devices is None else list(topo.visible_devices),
        }
    return info


def _print_table(info: dict[str, Any]) -> None:
    rows: list[tuple[str, str]] = []
    for section, values in info.items():
        for key, value in values.items():
            shown = "not installed" if value is None and section == "versions" else value
            if isinstance(shown, list):
                shown = ", ".join(str(x) for x in shown) or "-"
            rows.append((f"{section}.{key}", "-" if shown is None else str(shown)))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key.ljust(width)}  {value}")


def _cmd_info(args: argparse.Namespace) -> int:
    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
    else:
        _print_table(info)
    return 1 if "error" in info["topology"] else 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from robustdist.doctor import run_doctor

    return run_doctor(as_json=args.json, sysfs=args.sysfs_root, timeout=args.timeout)


def _cmd_verify(args: argparse.Namespace) -> int:
    from robustdist.checkpoint import verify_all

    if not os.path.isdir(args.directory):
        print(f"robustdist verify-checkpoint: {args.directory} is not a directory; expected a checkpoint.dir",
              file=sys.stderr)
        return 2
    from robustdist.runtime.errors import RobustDistError

    try:
        rows = verify_all(args.directory)
    except (RobustDistError, OSError) as e:  # the directory itself is unreadable: say so, no traceback
        print(f"robustdist verify-checkpoint: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rows, indent=2))
    elif not rows:
        print(f"no checkpoints in {args.directory}")
    else:
        table = [["step", "files", "bytes", "status", "reason"]]
        table += [[str(r["step"]), "-" if r["files"] is None else str(r["files"]),
                   "-" if r["bytes"] is None else str(r["bytes"]), r["status"], r["reason"]] for r in rows]
        widths = [max(len(row[i]) for row in table) for i in range(5)]
        for row in table:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 1 if any(r["status"] != "ok" for r in rows) else 0


def _cmd_clean(args: argparse.Namespace) -> int:
    from robustdist.checkpoint.local.leftovers import clean
    from robustdist.runtime.errors import CheckpointError

    try:
        found = clean(args.dir, dry_run=args.dry_run, force=args.force)
    except CheckpointError as e:
        print(f"robustdist clean: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([vars(f) for f in found], indent=2))
        return 0
    if not found:
        print(f"no in-memory checkpoint directories of this user (uid {os.getuid()}) in {args.dir}")
    for f in found:
        print(f"{f.state:8}  {f.bytes / 2**20:10.1f} MiB  {f.path}" + (f"  ({f.why})" if f.why else ""))
    gone = sum(f.bytes for f in found if f.state in ("removed", "unused"))
    if found:
        print(f"{'would free' if args.dry_run else 'freed'} {gone / 2**20:.1f} MiB")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="robustdist", description="Hardening for PyTorch distributed and Ray.")
    parser.add_argument("--version", action="version", version=f"robustdist {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser("info", help="print versions, CUDA and the detected topology")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(func=_cmd_info)
    doctor = sub.add_parser("doctor", help="check this machine (and, under torchrun, every rank) for known failure modes")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument("--timeout", type=float, default=120.0, help="seconds for the cross-rank init (default 120)")
    doctor.add_argument("--sysfs-root", default="/sys", help=argparse.SUPPRESS)  # tests point it at a fake tree
    doctor.set_defaults(func=_cmd_doctor)
    verify = sub.add_parser("verify-checkpoint", help="verify every committed checkpoint in a directory")
    verify.add_argument("directory")
    verify.add_argument("--json", action="store_true", help="machine-readable output")
    verify.set_defaults(func=_cmd_verify)
    cleaner = sub.add_parser("clean", help="remove in-memory checkpoints (/dev/shm) that no running job uses")
    cleaner.add_argument("--dir", default="/dev/shm", help="the base the jobs' checkpoint.local_dir named "
                         "(default /dev/shm)")
    cleaner.add_argument("--dry-run", action="store_true", help="remove nothing; say what would go")
    cleaner.add_argument("--force", action="store_true", help="also remove directories without a lock file "
                         "(made by an older robustdist; make sure their jobs are over)")
    cleaner.add_argument("--json", action="store_true", help="machine-readable output")
    cleaner.set_defaults(func=_cmd_clean)
    sub.add_parser("run", add_help=False, help="torchrun whose agent replaces a killed worker alone "
                   "(robustdist run --help: torchrun's flags)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:  # torchrun's own parser reads the rest (its flags, the script and its arguments)
        from robustdist.launcher.launch import main as run_main

        return run_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    return int(args.func(args))
