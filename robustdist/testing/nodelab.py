"""A fault lab of real nodes on one Linux machine: network namespaces, veth links, private disks.

Each simulated node is a network namespace with its own ``eth0`` and address (``10.213.0.<i+1>/24``), joined
to the others through a bridge that lives in a namespace of its own (the "switch"), a hostname of its own
(``node<i>``, a UTS namespace) with its own ``/etc/hosts``, and a private mount namespace, so a directory
given as ``local_disk`` is a tmpfs that the other nodes cannot see. A node may get
a second interface, ``eth1`` (``10.214.0.<i+1>/24``, a veth whose other end is on no bridge), that reaches
no other node.

Faults are operations: :meth:`NodeLab.kill_node` (every process in the node, agent included),
:meth:`NodeLab.link_down`/:meth:`NodeLab.link_up` (the node's switch port leaves the bridge: its packets
vanish, no connection is reset, a true partition), :meth:`NodeLab.fill_disk`. Processes run in a node with
:meth:`NodeLab.popen`, and :meth:`NodeLab.torchrun` starts that node's torchrun agent (c10d rendezvous on node
0, ``--local_addr`` the node's address, ``GLOO_SOCKET_IFNAME=eth0``).

Needs Linux, root, iproute2 (``ip``), ``nsenter`` and ``unshare``: :func:`unavailable` says why not.
Everything is torn down by :meth:`NodeLab.close` (and the context manager) on success, failure or timeout:
processes, namespaces (links go with them), mounts (they go with the last process of their namespace).
Every namespace name starts with :data:`PREFIX` and carries the creating pid, so
:func:`remove_stale` can clear what a crashed run left. No address outside the lab's own namespaces is used.

    with NodeLab(2, local_disk="/tmp/ckpt") as lab:
        agents = [lab.torchrun(i, "train.py", nproc=1) for i in range(2)]
        lab.link_down(1); ...; lab.link_up(1)
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from robustdist.runtime.errors import RobustDistError
from robustdist.runtime.log import get_logger

__all__ = ["PREFIX", "LabError", "Node", "NodeLab", "delete_namespace", "leftover_namespaces", "remove_stale", "unavailable"]

log = get_logger(__name__)
PREFIX = "rdlab-"
MAX_NODES = 16
RDZV_PORT = 29400
_OP_TIMEOUT = 15.0
_counter = itertools.count()


class LabError(RobustDistError):
    """The lab could not be built, used or torn down; the message names the fix."""


@dataclass
class Node:
    """One simulated node. ``address`` is on ``eth0``; ``alt_address`` on ``eth1`` when the lab made one."""

    index: int
    netns: str
    address: str
    alt_address: str | None = None
    holder: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    linked: bool = True


def unavailable() -> str | None:
    """Why the lab cannot run here (not Linux, not root, a missing tool), or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"the node lab needs Linux network namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return "the node lab needs root (network and mount namespaces); run the multi-node tests as root"
    missing = [tool for tool in ("ip", "nsenter", "unshare", "mount") if shutil.which(tool) is None]
    if missing:
        return f"the node lab needs {', '.join(missing)} (iproute2, util-linux) on PATH"
    return None


def _run(argv: Sequence[str], *, timeout: float = _OP_TIMEOUT, check: bool = True) -> str:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise LabError(f"`{' '.join(argv)}` did not finish within {timeout:g} s; expected a quick kernel "
                       "operation. Fix: check the machine (dmesg) and remove_stale().") from e
    if check and done.returncode != 0:
        raise LabError(f"`{' '.join(argv)}` failed (exit {done.returncode}): {done.stderr.strip()[:400]}")
    return done.stdout


def leftover_namespaces(owner: int | None = None) -> list[str]:
    """Lab namespaces that exist now (only those created by process ``owner`` when given)."""
    try:
        names = sorted(n for n in os.listdir("/run/netns") if n.startswith(PREFIX))  # where `ip netns` keeps them
    except OSError:
        return []
    return [n for n in names if owner is None or n.startswith(f"{PREFIX}{owner}-")]


def delete_namespace(name: str) -> None:
    """Kill every process in lab namespace ``name`` and delete it (links inside go with it)."""
    if not name.startswith(PREFIX):
        raise LabError(f"{name!r} is not a lab namespace (expected the prefix {PREFIX!r}); refusing to delete it.")
    _kill_netns_processes(name)
    _run(["ip", "netns", "delete", name], check=False)


def remove_stale() -> list[str]:
    """Delete lab namespaces whose creating process is gone (a crashed run); returns what it removed."""
    removed = []
    for name in leftover_namespaces():
        pid = name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            delete_namespace(name)
            removed.append(name)
    return removed


def _netns_pids(netns: str) -> list[int]:
    try:
        out = _run(["ip", "netns", "pids", netns], check=False)
    except LabError:
        return []
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_netns_processes(netns: str, *, spare: int | None = None, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    killed: list[int] = []
    while time.monotonic() < deadline:
        pids = [p for p in _netns_pids(netns) if p != spare and p != os.getpid()]
        if not pids:
            return killed
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    raise LabError(f"processes {_netns_pids(netns)} in {netns} survived SIGKILL for {timeout:g} s (stuck in the "
                   "kernel, D state?). Fix: check `ps -o pid,stat,wchan -p <pid>`.")


class NodeLab:
    """``nodes`` simulated nodes; see the module docstring.

    Args:
        nodes: how many (2 to :data:`MAX_NODES`).
        local_disk: a directory path that becomes a private tmpfs in every node (created if missing).
        disk_size: the tmpfs size (``mount -o size=``), e.g. ``"64m"``.
        alt_interface: give every node a second interface ``eth1`` that reaches no other node.
        log_dir: where :meth:`popen` writes each process's output (default: a temporary directory).
    """

    def __init__(self, nodes: int = 2, *, local_disk: str | os.PathLike[str] | None = None, disk_size: str = "64m",
                 alt_interface: bool = False, log_dir: str | os.PathLike[str] | None = None):
        if isinstance(nodes, bool) or not isinstance(nodes, int) or not 2 <= nodes <= MAX_NODES:
            raise LabError(f"NodeLab(nodes={nodes!r}); expected an int from 2 to {MAX_NODES} (one namespace, "
                           f"address and torchrun agent each). Fix: simulate at most {MAX_NODES} nodes.")
        if (reason := unavailable()) is not None:
            raise LabError(f"{reason}. Fix: skip the multi-node tests where this cannot run.")
        self.local_disk = os.path.abspath(os.fspath(local_disk)) if local_disk is not None else None
        if self.local_disk in ("/", "/proc", "/sys", "/dev", "/run", "/etc", "/usr"):
            raise LabError(f"local_disk={self.local_disk!r} would hide a system directory in every node; expected "
                           "a directory of the test's own. Fix: pass a path under a temporary directory.")
        self.disk_size = disk_size
        self.alt_interface = alt_interface
        import tempfile

        self.log_dir = os.fspath(log_dir) if log_dir is not None else tempfile.mkdtemp(prefix="rdlab-logs-")
        os.makedirs(self.log_dir, exist_ok=True)
        tag = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        self.switch = f"{tag}-sw"
        self.nodes = [Node(i, f"{tag}-n{i}", f"10.213.0.{i + 1}",
                           f"10.214.0.{i + 1}" if alt_interface else None) for i in range(nodes)]
        self._procs: list[subprocess.Popen[bytes]] = []
        self._files: list[IO[bytes]] = []
        self._closed = False
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ building and tearing down
    def _build(self) -> None:
        _run(["ip", "netns", "add", self.switch])
        sw = ["ip", "-n", self.switch]
        _run([*sw, "link", "add", "br0", "type", "bridge"])
        _run([*sw, "link", "set", "br0", "up"])
        if self.local_disk is not None:
            try:
                os.makedirs(self.local_disk, exist_ok=True)
            except OSError as e:
                raise LabError(f"local_disk={self.local_disk!r} cannot be a mount point ({e}); expected a directory "
                               "(or a path where one can be made). Fix: check that the path can be mounted on.") from e
        for node in self.nodes:
            _run(["ip", "netns", "add", node.netns])
            port = f"p{node.index}"
            _run([*sw, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", node.netns])
            _run([*sw, "link", "set", port, "master", "br0", "up"])
            nn = ["ip", "-n", node.netns]
            _run([*nn, "addr", "add", f"{node.address}/24", "dev", "eth0"])
            _run([*nn, "link", "set", "eth0", "up"])
            _run([*nn, "link", "set", "lo", "up"])
            if node.alt_address is not None:
                # A veth whose other end sits in the switch namespace, up but on no bridge: packets vanish.
                _run([*nn, "link", "add", "eth1", "type", "veth", "peer", "name", f"d{node.index}", "netns",
                      self.switch])
                _run([*nn, "addr", "add", f"{node.alt_address}/24", "dev", "eth1"])
                _run([*nn, "link", "set", "eth1", "up"])
                _run([*sw, "link", "set", f"d{node.index}", "up"])
            node.holder = self._start_holder(node)

    def _start_holder(self, node: Node) -> subprocess.Popen[bytes]:
        """A process that owns the node's mount and UTS namespaces; everything else in the node joins them.

        The node gets its own hostname (``node<i>``), ``/etc/hosts`` and an empty ``/etc/resolv.conf`` (no DNS
        server: lookups fail at once instead of timing out). Its ``/etc/hosts`` has the shape a stock Debian
        install writes: its own name on ``127.0.1.1`` (so a hostname is not a routable address, the classic
        multi-node trap), the other nodes' names on their lab addresses."""
        etc = os.path.join(self.log_dir, f".etc-n{node.index}")
        os.makedirs(etc, exist_ok=True)
        with open(os.path.join(etc, "hosts"), "w") as f:
            f.write(f"127.0.0.1 localhost\n127.0.1.1 node{node.index}\n")
            f.writelines(f"{other.address} node{other.index}\n" for other in self.nodes if other is not node)
        with open(os.path.join(etc, "resolv.conf"), "w") as f:
            f.write("options timeout:1 attempts:1\n")
        script = (f"set -e; hostname node{node.index}; mount --bind {_shell_word(etc)}/hosts /etc/hosts; "
                  f"mount --bind {_shell_word(etc)}/resolv.conf /etc/resolv.conf; ")
        if self.local_disk is not None:
            script += f"mount -t tmpfs -o size={_shell_word(self.disk_size)} tmpfs {_shell_word(self.local_disk)}; "
        script += "echo ready; exec sleep 86400"
        holder = subprocess.Popen(["ip", "netns", "exec", node.netns, "unshare", "-m", "-u", "--propagation", "private",
                                   "sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  start_new_session=True)
        self._procs.append(holder)
        line = _readline(holder, _OP_TIMEOUT)
        if line != "ready":
            err = holder.stderr.read().decode(errors="replace")[:400] if holder.poll() is not None and holder.stderr else ""
            raise LabError(f"node {node.index}'s namespace holder did not start (got {line!r}; {err}); expected a "
                           f"private mount namespace{' with a tmpfs at ' + self.local_disk if self.local_disk else ''}. "
                           "Fix: check that the path can be mounted on (a directory, not inside /proc or /sys).")
        return holder

    def close(self) -> None:
        """Kill every process the lab started or that runs in a node, delete every namespace. Idempotent once it
        has succeeded; a teardown that failed or was interrupted (a test's timeout) is done again in full."""
        if self._closed:
            return
        errors = []
        for node in self.nodes:
            try:
                _kill_netns_processes(node.netns)
            except LabError as e:
                errors.append(str(e))
        for proc in self._procs:
            if proc.poll() is None:
                _killpg(proc)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                errors.append(f"pid {proc.pid} did not exit")
        for f in self._files:
            f.close()
        for name in [n.netns for n in self.nodes] + [self.switch]:
            if name in leftover_namespaces():
                try:
                    _run(["ip", "netns", "delete", name])
                except LabError as e:
                    errors.append(str(e))
        if errors:
            raise LabError("the lab was not fully torn down: " + " | ".join(errors))
        self._closed = True

    def __enter__(self) -> NodeLab:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ running things in a node
    def node(self, index: int) -> Node:
        if not 0 <= index < len(self.nodes):
            raise LabError(f"node {index} does not exist; expected 0 to {len(self.nodes) - 1}.")
        return self.nodes[index]

    def popen(self, index: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None, name: str | None = None,
              cwd: str | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside node ``index`` (its network and mount namespaces); output goes to
        ``log_dir/<name>.log`` (see :meth:`log`)."""
        node = self.node(index)
        if node.holder is None or node.holder.poll() is not None:
            raise LabError(f"node {index}'s namespace holder is gone; expected it alive. Fix: do not kill it.")
        label = name or f"n{index}-{len(self._procs)}"
        out = open(os.path.join(self.log_dir, f"{label}.log"), "ab")  # noqa: SIM115 - closed by close()
        self._files.append(out)
        proc = subprocess.Popen(["nsenter", "-t", str(node.holder.pid), "-n", "-m", "-u", "--", *argv],
                                env=dict(os.environ if env is None else env), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=cwd, start_new_session=True)
        self._procs.append(proc)
        return proc

    def exec(self, index: int, argv: Sequence[str], *, timeout: float = _OP_TIMEOUT, check: bool = True) -> str:
        """Run ``argv`` to completion inside node ``index``; returns its stdout."""
        node = self.node(index)
        assert node.holder is not None
        return _run(["nsenter", "-t", str(node.holder.pid), "-n", "-m", "-u", "--", *argv], timeout=timeout, check=check)

    def log(self, name: str) -> str:
        path = os.path.join(self.log_dir, f"{name}.log")
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")

    def torchrun(self, index: int, script: str, args: Sequence[str] = (), *, nproc: int = 1, nnodes: str | None = None,
                 max_restarts: int = 0, env: Mapping[str, str] | None = None, name: str | None = None,
                 rdzv_id: str = "lab", rdzv_conf: Mapping[str, object] | None = None, local_addr: bool = True,
                 extra: Sequence[str] = (), launcher: Sequence[str] = ("torch.distributed.run",)
                 ) -> subprocess.Popen[bytes]:
        """Start node ``index``'s torchrun agent for ``script`` (c10d rendezvous hosted on node 0), by ``python -m
        <launcher>`` (``("robustdist", "run")`` for robustdist's launcher).

        ``local_addr=False`` leaves out ``--local_addr``: torchrun then advertises the hostname, which on this
        machine (as on many) resolves to a loopback address, the classic multi-node trap."""
        node = self.node(index)
        conf = {**({"is_host": 1} if index == 0 else {}), **(rdzv_conf or {})}
        argv = [sys.executable, "-m", *launcher, f"--nnodes={nnodes or len(self.nodes)}",
                f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
                f"--rdzv_endpoint={self.nodes[0].address}:{RDZV_PORT}", f"--rdzv_id={rdzv_id}",
                f"--max-restarts={max_restarts}", "--monitor-interval=0.5",
                *([f"--local_addr={node.address}"] if local_addr else []),
                *([f"--rdzv_conf={','.join(f'{k}={v}' for k, v in conf.items())}"] if conf else []),
                *extra, script, *args]
        full = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1", **(env or {})}
        return self.popen(index, argv, env=full, name=name or f"agent-n{index}")

    # ------------------------------------------------------------------ faults
    def kill_node(self, index: int) -> list[int]:
        """SIGKILL every process in node ``index`` (agent and workers), keeping the node itself. Returns pids."""
        node = self.node(index)
        killed = _kill_netns_processes(node.netns, spare=node.holder.pid if node.holder else None)
        log.info("lab: killed node %d (%d processes)", index, len(set(killed)))
        return sorted(set(killed))

    def link_down(self, index: int) -> None:
        """Partition node ``index``: its switch port leaves the bridge, so its packets vanish (no reset)."""
        _run(["ip", "-n", self.switch, "link", "set", f"p{self.node(index).index}", "nomaster"])
        self.nodes[index].linked = False

    def link_up(self, index: int) -> None:
        """Reconnect node ``index`` to the bridge."""
        _run(["ip", "-n", self.switch, "link", "set", f"p{self.node(index).index}", "master", "br0"])
        self.nodes[index].linked = True

    def fill_disk(self, index: int) -> None:
        """Fill node ``index``'s private tmpfs (``local_disk``) to the last byte."""
        if self.local_disk is None:
            raise LabError("fill_disk() needs a lab made with local_disk=<path>; there is no node-local disk.")
        self.exec(index, ["sh", "-c", f"cat /dev/zero > {_shell_word(self.local_disk)}/.lab-fill 2>/dev/null; true"],
                  timeout=60)

    def reachable(self, src: int, dst: int, port: int = RDZV_PORT, timeout: float = 1.0) -> bool:
        """Whether a TCP connection from node ``src`` to ``dst``'s address gets any answer (refused counts)."""
        code = ("import socket,sys\ntry:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), "
                f"timeout={timeout}).close()\nexcept ConnectionRefusedError:\n pass\nexcept OSError:\n sys.exit(3)")
        out = subprocess.run(["nsenter", "-t", str(self.node(src).holder.pid), "-n", "--", sys.executable, "-c", code,  # type: ignore[union-attr]
                              self.node(dst).address, str(port)], capture_output=True, timeout=timeout + 10)
        return out.returncode == 0


def _shell_word(value: str) -> str:
    import shlex

    return shlex.quote(value)


def _readline(proc: subprocess.Popen[bytes], timeout: float) -> str:
    import selectors

    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            return ""
    return proc.stdout.readline().decode(errors="replace").strip()


def _killpg(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass
