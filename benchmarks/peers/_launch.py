"""Launching one peer variant, bounded, and leaving nothing behind.

Every launch (:func:`launch`):

* runs the variant the way :mod:`_common` says: ``python -m torch.distributed.run --standalone
  --nproc_per_node=2 --max-restarts=R v_<name>.py <flags>``, or ``python v_ray_train.py <flags> --restarts R``
  for the Ray Train driver. Inside :func:`ray_cluster` the driver connects to that run's own Ray head
  (``RAY_ADDRESS`` and a token of its own); outside, it starts its own local Ray (``RAY_ADDRESS=local``, a
  private ``RAY_TMPDIR``). Either way it never joins another cluster on this machine, such as the test suite's;
* starts it in a session of its own, with ``OMP_NUM_THREADS=1`` and a marker variable unique to the launch;
* stamps every line of its output with the time it arrived (and copies it to ``<workdir>/launch.log``);
* ends at the first of: the process exiting, ``until(result)`` becoming true (polled), or ``timeout`` seconds;
* when it has to stop it: SIGTERM to the session's process group, SIGKILL after a grace period, then SIGKILL to
  every process still carrying the launch's marker (a process that left the group, such as a Ray daemon), by
  pid. Nothing else is ever signalled.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PEERS = Path(__file__).resolve().parent
VARIANTS = ("plain", "accelerate", "fabric", "ray_train", "robustdist", "rd_accelerate", "rd_fabric")
DRIVERS = ("ray_train",)  # launched as a plain driver process, not under torchrun
MARKER = "ROBUSTDIST_PEERS_LAUNCH"
JOB_MARKER = "ROBUSTDIST_PEERS_RAY_JOB"  # a launch's marker on its Ray workers (which keep the cluster's MARKER)
TERM_GRACE = 5.0
_RAY_ENV: dict[str, str] = {}  # set by ray_cluster(): how the Ray Train launches reach that run's cluster
_RAY_HEAD: subprocess.Popen[bytes] | None = None  # and its `ray start --block` process
_RAY_HEAD_LOG: Path | None = None  # and what that process printed
CLUSTER_MARKERS: list[str] = []  # of every ray_cluster() this process started (the tests check none is left)


def script(variant: str) -> Path:
    return PEERS / f"v_{variant}.py"


def command(variant: str, flags: list[str], restarts: int = 0) -> list[str]:
    """The command line that launches ``variant`` with the contract's ``flags``."""
    path = str(script(variant))
    if variant in DRIVERS:
        return [sys.executable, path, *flags, "--restarts", str(restarts)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            f"--max-restarts={restarts}", path, *flags]


@dataclass
class Result:
    """One launch: its exit, timing, output lines ``(time, text)`` and the events its ranks wrote."""

    variant: str
    workdir: Path
    command: list[str]
    started: float
    ended: float = 0.0
    rc: int | None = None
    timed_out: bool = False
    stopped: bool = False
    stalled: bool = False
    lines: list[tuple[float, str]] = field(default_factory=list)

    def events(self, rank: int | None = None) -> list[dict[str, Any]]:
        """Every event of every rank (or of ``rank``), in time order; a torn last line is skipped."""
        out: list[dict[str, Any]] = []
        for path in sorted(self.workdir.glob("events-rank*.jsonl")):
            for line in path.read_text(errors="replace").splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if rank is None or record.get("rank") == rank:
                    out.append(record)
        return sorted(out, key=lambda r: r.get("t", 0.0))

    def named(self, event: str, rank: int | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events(rank) if e.get("event") == event]

    @property
    def final(self) -> Path:
        return self.workdir / "final.pt"

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.timed_out and not self.stopped and not self.stalled

    def last_activity(self) -> float:
        """When the launch last printed a line or wrote an event."""
        times = [self.started] + [t for t, _ in self.lines[-1:]]
        times += [p.stat().st_mtime for p in self.workdir.glob("events-rank*.jsonl")]
        return max(times)

    def describe(self) -> str:
        if self.stalled:
            return "stopped: no output and no event for the stall bound (stacks dumped to launch.log)"
        if self.timed_out:
            return f"did not finish within its bound ({self.ended - self.started:.0f} s); stopped"
        if self.stopped:
            return "stopped by the runner once measured"
        return f"exit code {self.rc}"

    def tail(self, n: int = 15) -> str:
        return "\n".join(text for _, text in self.lines[-n:])


def launch(variant: str, workdir: Path, flags: list[str], *, restarts: int = 0, timeout: float,
           until: Callable[[Result], bool] | None = None, stall: float | None = None, poll: float = 0.25,
           extra_env: dict[str, str] | None = None) -> Result:
    """Run ``variant`` in ``workdir`` (created) with ``flags`` plus ``--workdir``; see the module docstring.

    ``stall``: stop it when it has printed nothing and written no event for that many seconds (a hang the
    column does not measure, such as a restart that never gets past init), after SIGABRT to its Python
    processes running the variant script, which dump their stacks (``PYTHONFAULTHANDLER``) into the log."""
    ray_env, head = (dict(_RAY_ENV), _RAY_HEAD) if variant in DRIVERS else ({}, None)
    if head is not None and head.poll() is not None:
        said = _RAY_HEAD_LOG.read_text(errors="replace")[-1500:] if _RAY_HEAD_LOG and _RAY_HEAD_LOG.exists() else ""
        raise RuntimeError(f"bench-peers: the run's Ray head exited (code {head.returncode}) before this {variant} "
                           "launch; expected it to run until the run ends, so its Ray Train columns cannot be "
                           "measured (not recorded as Ray Train's result). Fix: re-run `make bench-peers ray_train` "
                           f"(the other variants' records are kept). `ray start` said:\n{said}")
    workdir.mkdir(parents=True, exist_ok=True)
    marker = uuid.uuid4().hex
    ray_tmp = tempfile.mkdtemp(prefix="rp-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", MARKER: marker,
           "RAY_ADDRESS": "local", "RAY_TMPDIR": ray_tmp, **ray_env, **(extra_env or {})}
    cmd = command(variant, [*flags, "--workdir", str(workdir)], restarts)
    result = Result(variant, workdir, cmd, started=time.time())
    log = (workdir / "launch.log").open("a", encoding="utf-8")
    log.write(f"$ {' '.join(cmd)}\n")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, cwd=str(workdir), start_new_session=True)
    reader = threading.Thread(target=_read, args=(proc, result, log), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            if time.monotonic() > deadline:
                result.timed_out = True
                break
            if until is not None and until(result):
                result.stopped = True
                break
            if stall is not None and time.time() - result.last_activity() > stall:
                result.stalled = True
                _dump_stacks(marker, proc.pid, script(variant).name)
                break
            time.sleep(poll)
    finally:
        result.ended = time.time()
        _stop(proc, marker)
        if ray_env:  # its workers, started by the shared head (Ray ends a dead driver's job too, but Ray Train
            _sweep(marker, name=JOB_MARKER, bound=5.0, quiet=3)  # V2's PlacementGroupCleaner is detached)
        reader.join(timeout=10)
        result.rc = proc.returncode
        log.close()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return result


@dataclass(frozen=True)
class RayCluster:
    """A running :func:`ray_cluster`: ``env`` is what a driver needs to connect (it holds the token: not in the
    repr); every process the head started carries ``MARKER=marker``."""

    address: str
    env: dict[str, str] = field(repr=False)
    marker: str
    temp_dir: str


@contextlib.contextmanager
def ray_cluster(cpus: int, timeout: float = 90.0, tries: int = 3) -> Iterator[RayCluster]:
    """One local Ray head for every Ray Train launch inside the ``with`` (``ray start --head --block``, as a
    long-lived cluster is used): ``cpus`` logical CPUs, a free port, no dashboard, a private ``--temp-dir`` and
    token authentication with a token of its own (Ray's servers listen on every interface; the token is what
    keeps other clients out). :func:`launch` gives the Ray Train launches inside the ``with`` the environment to
    connect to it (:attr:`RayCluster.env`), and refuses to launch once the head has exited.

    Why: each driver starting its own cluster cost about 7 s and 6 CPU-seconds per launch on two cores, and
    several clusters at once competed with the launches. A launch stopped by the runner takes its actors with it
    (Ray ends a dead driver's job; the variant also gives its workers the launch's marker as
    :data:`JOB_MARKER`, which :func:`launch` kills). On exit every process the cluster started (they all carry
    its :data:`MARKER`) is killed, by pid, until none has appeared for 2 s; a reaper process does the same if
    this process dies first (SIGKILL, a cancelled CI job). A head that exits while starting (its port taken
    meanwhile) is retried on another port, ``tries`` times in all."""
    global _RAY_ENV, _RAY_HEAD, _RAY_HEAD_LOG
    marker, token = uuid.uuid4().hex, secrets.token_hex(16)
    CLUSTER_MARKERS.append(marker)
    tmp = tempfile.mkdtemp(prefix="rc-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0", MARKER: marker, **auth}
    ray = Path(sys.executable).with_name("ray")
    base = [str(ray)] if ray.exists() else [sys.executable, "-c", "from ray.scripts.scripts import main; main()"]
    previous = (_RAY_ENV, _RAY_HEAD, _RAY_HEAD_LOG)
    reaper = proc = log = None
    try:
        reaper = _start_reaper(marker, tmp)
        for attempt in range(1, tries + 1):
            port = _free_port()
            log = open(Path(tmp) / f"ray-start-{attempt}.log", "wb")  # noqa: SIM115 - closed below
            proc = subprocess.Popen([*base, "start", "--head", "--block", f"--num-cpus={cpus}", "--num-gpus=0",
                                     "--node-ip-address=127.0.0.1", f"--port={port}", "--include-dashboard=false",
                                     f"--temp-dir={tmp}", "--disable-usage-stats"],
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)
            if _head_ready(proc, Path(tmp), timeout):
                break
            log.close()
            _stop(proc, marker)
            _sweep(marker, quiet=3)
            shutil.rmtree(Path(tmp) / "session_latest", ignore_errors=True)
            if attempt == tries:
                tail = (Path(tmp) / f"ray-start-{attempt}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"bench-peers: the Ray head for the Ray Train launches did not start ({tries} "
                                   f"tries, {timeout:g} s each; last exit {proc.returncode}); expected its raylet "
                                   f"socket under {tmp}. Fix: check that `ray start --head` runs on this machine "
                                   f"(free ports, /tmp writable), then re-run. `ray start` said:\n{tail}")
        assert proc is not None
        _RAY_ENV, _RAY_HEAD = {"RAY_ADDRESS": f"127.0.0.1:{port}", **auth}, proc
        _RAY_HEAD_LOG = Path(tmp) / f"ray-start-{attempt}.log"
        yield RayCluster(f"127.0.0.1:{port}", dict(_RAY_ENV), marker, tmp)
    finally:
        _RAY_ENV, _RAY_HEAD, _RAY_HEAD_LOG = previous
        # Killed, not stopped: the cluster's state goes with its directory, and after a SIGTERM to the group the
        # raylet outlives the GCS by over 5 s (TERM_GRACE), to be killed all the same.
        if proc is not None:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        _sweep(marker)  # every process it started, and a worker the raylet was starting as it died
        if log is not None:
            log.close()
        shutil.rmtree(tmp, ignore_errors=True)
        if reaper is not None:
            reaper.kill()
            reaper.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _head_ready(proc: subprocess.Popen[bytes], tmp: Path, timeout: float) -> bool:
    """Wait for the head's raylet socket; False when ``ray start`` exits first or ``timeout`` passes."""
    raylet = tmp / "session_latest" / "sockets" / "raylet"
    deadline = time.monotonic() + timeout
    while not raylet.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.25)
    return proc.poll() is None


def _start_reaper(marker: str, tmp: str) -> subprocess.Popen[bytes]:
    """A process that waits for this one to end, then kills everything carrying ``marker`` and removes ``tmp``:
    the head must not outlive a runner killed before its ``finally`` ran. It carries no marker itself."""
    env = {k: v for k, v in os.environ.items() if k != MARKER}
    code = (f"import sys; sys.path.insert(0, {str(PEERS)!r}); import _launch; "
            f"_launch._reap({os.getpid()}, {_start_time(os.getpid())!r}, {marker!r}, {tmp!r})")
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _start_time(pid: int) -> str | None:
    """``pid``'s start time (from /proc), so that a reused pid is not mistaken for it; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def _reap(runner: int, started: str | None, marker: str, tmp: str) -> None:
    """The reaper's body (:func:`_start_reaper`)."""
    while _start_time(runner) == started:
        time.sleep(1.0)
    _sweep(marker)
    shutil.rmtree(tmp, ignore_errors=True)


def _sweep(marker: str, name: str = MARKER, bound: float = 30.0, quiet: int = 10) -> None:
    """SIGKILL every process carrying ``name=marker`` until ``quiet`` sweeps in a row (0.2 s apart) find none, for
    at most ``bound`` seconds."""
    deadline, calm = time.monotonic() + bound, 0
    while time.monotonic() < deadline:
        left = marked(marker, name)
        calm = 0 if left else calm + 1
        if calm >= quiet:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


def _read(proc: subprocess.Popen[bytes], result: Result, log: Any) -> None:
    assert proc.stdout is not None
    for raw in proc.stdout:
        now = time.time()
        text = raw.decode(errors="replace").rstrip("\n")
        result.lines.append((now, text))
        try:
            log.write(f"{now - result.started:8.2f} {text}\n")
            log.flush()
        except ValueError:  # the log was closed after a bounded join: the rest is still in result.lines
            pass


def _stop(proc: subprocess.Popen[bytes], marker: str) -> None:
    """End the launch's process group (TERM, then KILL), then any straggler carrying ``marker``."""
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=TERM_GRACE)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()
    _sweep(marker, bound=0.7, quiet=1)


def _dump_stacks(marker: str, launcher: int, name: str) -> None:
    for pid in marked(marker):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if pid != launcher and name.encode() in cmdline:
            try:
                os.kill(pid, signal.SIGABRT)
            except ProcessLookupError:
                pass
    time.sleep(2.0)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def marked(marker: str, name: str = MARKER) -> list[int]:
    """Live processes (not zombies) whose environment carries ``name=marker``."""
    needle = f"{name}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        if not stat[stat.rfind(b")") + 2:].startswith(b"Z"):
            found.append(int(entry))
    return found
