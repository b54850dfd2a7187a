"""Bad rendezvous addresses fail fast, on every rank, naming the address, what it resolved to, the node and the fix.

Real rank processes on one host (run_ranks), real stores, and real misbehaving servers started by the test, all
on 127.0.0.0/8. A loopback MASTER_ADDR on a "2-node" job is faked with the launcher's variables
(LOCAL_WORLD_SIZE=1, GROUP_RANK, GROUP_WORLD_SIZE): that check runs before any connection. Multi-node cases that
need real interfaces (an address nobody owns, a hostname that is loopback on one node only) run elsewhere, in
network namespaces.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from robustdist.config.schema import DistributedConfig, HardenConfig
from robustdist.init import rendezvous
from robustdist.init.process_group import destroy_process_group_if_owned, safe_init_process_group
from robustdist.runtime.errors import ConfigError, InitError
from robustdist.testing.ranks import free_port, run_ranks
from tests import _procs

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
INIT = 3.0  # distributed.init_timeout in these tests
MARGIN = 4.0  # what a bounded failure may take past init_timeout: a socket probe, a store retry, process noise
AGENT = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "rdzv-test", "TORCHELASTIC_MAX_RESTARTS": "0"}


def _init(rank: int, init_method: str = "env://", init_timeout: float = INIT) -> tuple[str | None, tuple | None, float]:
    """One rank's safe_init_process_group: (error text or None, named ranks, seconds it took)."""
    cfg = DistributedConfig(timeout=60, barrier_timeout=30, init_timeout=init_timeout, init_method=init_method)
    start = time.monotonic()
    try:
        report = safe_init_process_group(cfg)
    except InitError as e:
        return str(e), e.ranks, time.monotonic() - start
    destroy_process_group_if_owned(report)
    return None, None, time.monotonic() - start


def _two_nodes(**extra: str) -> list[dict[str, str]]:
    """Two ranks that say they are on two nodes (one rank each), as torchrun --nnodes=2 would tell them."""
    return [{"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(r), "GROUP_WORLD_SIZE": "2", **extra}
            for r in range(2)]


@contextlib.contextmanager
def _server(reply: bytes | None):
    """A TCP server on 127.0.0.1 that is no c10d store: it accepts and stays silent (``reply=None``), closes every
    connection (``b""``) or answers each with ``reply``. Yields its port and the accepted connections; every
    socket is closed on exit."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            accepted.append(conn)
            if reply:
                with contextlib.suppress(OSError):
                    conn.sendall(reply)
            elif reply is not None:
                conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1], accepted
    finally:
        stop.set()
        thread.join(5)
        for conn in accepted:
            conn.close()
        listener.close()


# ---------------------------------------------------------------------------------------------- 1. loopback
@pytest.mark.processes
@pytest.mark.parametrize(("master_addr", "found"), [
    ("127.0.0.1", "'127.0.0.1' is a loopback address"),
    ("localhost", "'localhost' resolves only to loopback (127.0.0.1"),
])
def test_loopback_master_addr_on_two_nodes_is_refused_before_any_connection(master_addr, found):
    with _server(None) as (port, accepted):  # a listener on MASTER_PORT records any connection attempt
        out = run_ranks(_init, 2, init=False, timeout=60,
                        env=_two_nodes(MASTER_ADDR=master_addr, MASTER_PORT=str(port)))
        time.sleep(0.3)  # let the server thread accept anything still in flight
        assert accepted == []  # nothing connected: the check ran before any connection attempt
    for rank, (message, _, elapsed) in enumerate(out):
        assert message.startswith(f"[rank {rank}] MASTER_ADDR='{master_addr}', MASTER_PORT={port}: {found}")
        assert f"on node {rank} (host {socket.gethostname()}" in message
        assert "but the job spans 2 nodes (world size 2, 1 per node)" in message
        assert "Nothing was connected." in message
        assert "--local_addr=<that node's IP>" in message and "export MASTER_ADDR=" in message
        assert "/etc/hosts (not to 127.0.1.1)" in message
        assert elapsed < 2.0  # not INIT: no wait at all


@pytest.mark.processes
def test_loopback_tcp_init_method_on_two_nodes_is_refused_too():
    port = free_port()
    out = run_ranks(_init, 2, init=False, args=(f"tcp://127.0.0.1:{port}",), timeout=60, env=_two_nodes())
    for rank, (message, _, elapsed) in enumerate(out):
        assert message.startswith(f"[rank {rank}] init_method='tcp://127.0.0.1:{port}': '127.0.0.1' is a loopback "
                                  "address on node ")
        assert "the job spans 2 nodes" in message and "--local_addr" in message and elapsed < 2.0


@pytest.mark.processes
def test_loopback_on_one_node_is_fine():
    assert [m for m, _, _ in run_ranks(_init, 2, init=False, timeout=60)] == [None, None]


# ---------------------------------------------------------------------------------------------- 2. nobody listens
@pytest.mark.processes
@pytest.mark.parametrize("restarts", ["0", "1"], ids=["agent-store", "agent-store-with-restarts"])
def test_a_closed_store_port_under_torchrun_is_named_within_init_timeout(restarts):
    """A script under torchrun that sets os.environ["MASTER_PORT"] = "12355": every rank is a client of a port
    nobody listens on (with restarts, the agent store is reached first to find this attempt's store)."""
    port = free_port()
    out = run_ranks(_init, 2, init=False, timeout=60,
                    env={**AGENT, "TORCHELASTIC_MAX_RESTARTS": restarts, "MASTER_PORT": str(port)})
    for rank, (message, _, elapsed) in enumerate(out):
        assert message.startswith(f"[rank {rank}] could not reach the c10d store at 127.0.0.1:{port} "
                                  f"(MASTER_ADDR='127.0.0.1', MASTER_PORT={port}, resolved to 127.0.0.1) from node ")
        assert f"within {INIT:g} s (distributed.init_timeout): connection refused: nothing listens on port {port}" \
            in message
        assert "Expected torchrun's agent on the master node to serve a c10d store there." in message
        assert "sets os.environ['MASTER_PORT'] (old tutorials do)" in message
        assert "--local_addr" in message and "/etc/hosts" in message
        assert INIT - 0.5 < elapsed < INIT + MARGIN


OVERRIDE = textwrap.dedent('''
    """A script as old tutorials write it, under torchrun: it sets MASTER_PORT itself before init."""
    import ctypes, json, os, signal, sys, time
    from pathlib import Path

    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG: never outlive torchrun
    from robustdist.config import DistributedConfig
    from robustdist.runtime.errors import InitError
    from robustdist.init.process_group import safe_init_process_group

    out, port = Path(sys.argv[1]), sys.argv[2]
    os.environ["MASTER_PORT"] = port  # the tutorial's os.environ["MASTER_PORT"] = "12355"
    start = time.monotonic()
    try:
        safe_init_process_group(DistributedConfig(init_timeout=3, timeout=60))
        message = None
    except InitError as e:
        message = str(e)
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps([message, time.monotonic() - start]))
''')


@pytest.mark.processes
def test_a_script_that_sets_master_port_under_real_torchrun_is_named_on_every_rank(tmp_path):
    script, port = tmp_path / "tutorial.py", free_port()
    script.write_text(OVERRIDE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           str(tmp_path), str(port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:  # torchrun starts each worker in a session of its own: kill them by pid
            for pid in _procs.descendants(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out[-4000:]
    for rank in (0, 1):
        message, elapsed = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert message.startswith(f"[rank {rank}] could not reach the c10d store at ")
        assert f"MASTER_PORT={port}" in message and f"nothing listens on port {port} there" in message
        assert "Expected torchrun's agent on the master node to serve a c10d store there." in message
        assert "sets os.environ['MASTER_PORT'] (old tutorials do)" in message
        assert elapsed < INIT + MARGIN


@pytest.mark.processes
def test_a_rank_told_another_port_is_named_by_the_others():
    """Only rank 1 overrides MASTER_PORT: it finds nothing there; rank 0, serving the store, names rank 1."""
    out = run_ranks(_init, 2, init=False, timeout=60, env=[{}, {"MASTER_PORT": str(free_port())}])
    (message0, ranks0, elapsed0), (message1, _, elapsed1) = out
    assert message0.startswith("[rank 0] rank 1 did not arrive at the rendezvous (the c10d store at 127.0.0.1:")
    assert f"within {INIT:g} s (distributed.init_timeout): 1 of 2 ranks did." in message0 and ranks0 == (1,)
    assert "Fix: check that rank 1 (node 0 if every node runs 2 rank(s)) started and reached init" in message0
    assert "[rank 1] could not reach the c10d store" in message1 and "connection refused" in message1
    assert "Expected rank 0 to serve a c10d store there." in message1
    assert elapsed0 < INIT + MARGIN and elapsed1 < INIT + MARGIN


# ---------------------------------------------------------------------------------------------- 3. not a store
@pytest.mark.processes
@pytest.mark.parametrize(("reply", "said"), [
    (None, r"it accepted the connection and sent nothing; it did not answer the store handshake"),
    # torch's handshake fails (its text varies: "Ping failed" on 2.13, a nonce assert on 2.8), or is still
    # retrying at the deadline and a plain read shows the bytes
    (b"HTTP/1.1 400 Bad Request\r\n\r\n", r"(the store handshake failed: \S"
                                          r"|it accepted the connection and sent b'HTTP/1.1 400 Bad Request)"),
    (b"", r"(the store handshake failed: |it accepted the connection and closed it)"),
], ids=["silent", "garbage", "closes"])
def test_a_port_answered_by_something_else_is_not_a_c10d_store(reply, said):
    """Something that accepts and never answers (today's TCPStore waits past its own timeout, seen > 300 s), one
    that answers with garbage, one that closes every connection: each is named within init_timeout."""
    with _server(reply) as (port, _):
        out = run_ranks(_init, 2, init=False, timeout=60, env={**AGENT, "MASTER_PORT": str(port)})
    for rank, (message, _, elapsed) in enumerate(out):
        assert message.startswith(f"[rank {rank}] could not reach the c10d store at 127.0.0.1:{port}")
        assert re.search(r"something listens there but it is not a c10d store \(" + said, message), message
        assert "the port belongs to another service: use a port nothing else listens on" in message
        assert elapsed < INIT + MARGIN


@pytest.mark.processes
def test_master_port_held_by_another_service():
    """Without torchrun's store rank 0 serves it: the port is taken (rank 0 says so), and rank 1 meets the
    other service."""
    with _server(None) as (port, _):
        out = run_ranks(_init, 2, init=False, timeout=60, env={"MASTER_PORT": str(port)})
    (message0, _, elapsed0), (message1, _, elapsed1) = out
    assert message0.startswith(f"[rank 0] rank 0 could not serve the c10d store on port {port} (MASTER_ADDR=")
    assert "choose a free MASTER_PORT (torchrun --master_port)" in message0 and elapsed0 < 2.0
    assert "it is not a c10d store (it accepted the connection and sent nothing" in message1
    assert elapsed1 < INIT + MARGIN


def test_a_store_that_closes_mid_handshake_is_waited_for(monkeypatch):
    """rank 0 re-initialising in its process: its previous store resets this rank's handshake as it closes, and
    its next store comes up only after torch's handshake bound (a harden/close loop hit it: rank 1 reported "not
    a c10d store" and rank 0 waited 300 s). The rank waits for the next store, as for one not yet started."""
    monkeypatch.setattr(rendezvous, "_HANDSHAKE_S", 1.0)
    closing = _server(b"")
    port, accepted = closing.__enter__()
    served: list = []

    def swap() -> None:  # once a handshake met the reset, close; serve again well past the handshake bound
        until = time.monotonic() + 10
        while len(accepted) < 2 and time.monotonic() < until:
            time.sleep(0.01)
        reset = len(accepted)
        closing.__exit__(None, None, None)
        time.sleep(4 * rendezvous._HANDSHAKE_S)
        served.append((reset, dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False,
                                            timeout=timedelta(seconds=30))))

    thread = threading.Thread(target=swap, daemon=True)
    thread.start()
    try:
        store, kind, detail = rendezvous.try_connect("127.0.0.1", port, 2, time.monotonic() + 30)
    finally:
        thread.join(20)
    assert served, "the test's store did not start"
    reset, server = served[0]
    assert reset >= 2, reset  # a handshake really was reset before the store came
    assert store is not None, (kind, detail)
    store.set("from-client", "1")
    assert server.get("from-client") == b"1"


@pytest.mark.parametrize("deadline", [2.0, 30.0])
def test_a_port_that_keeps_failing_the_handshake_is_named_after_a_second_handshake(monkeypatch, deadline):
    """The retry is bounded: something that accepts again and fails the handshake again is no store, named
    with torch's error after the second handshake (long before a 30 s deadline), and as one that spoke also when
    the deadline cuts the second handshake short."""
    monkeypatch.setattr(rendezvous, "_HANDSHAKE_S", 0.5)
    with _server(b"HTTP/1.1 400 Bad Request\r\n\r\n") as (port, accepted):
        start = time.monotonic()
        store, kind, detail = rendezvous.try_connect("127.0.0.1", port, 2, start + deadline)
        elapsed = time.monotonic() - start
    assert store is None and kind == "spoke", (kind, detail)
    assert detail.startswith("the store handshake failed: "), detail  # torch's words vary by version
    assert elapsed < min(deadline, 15) + 1, elapsed  # each handshake bounded (torch 2.13 retries inside it, 2.8 not)
    if deadline > 2:  # probe, handshake, probe, handshake: at least four connections (torch may retry inside)
        assert len(accepted) >= 4, len(accepted)


# ---------------------------------------------------------------------------------------------- 4. file://
@pytest.fixture
def two_ranks_here(monkeypatch):
    for var in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")


def test_file_init_method_in_a_missing_directory_fails_at_once(two_ranks_here, tmp_path):
    path = tmp_path / "no-such-dir" / "store"
    start = time.monotonic()
    with pytest.raises(InitError) as exc:
        safe_init_process_group(DistributedConfig(init_method=f"file://{path}", init_timeout=60))
    assert time.monotonic() - start < 2.0 and not dist.is_initialized()
    message = str(exc.value)
    assert message.startswith(f"[rank 0] init_method='file://{path}': the store file '{path}' is in the directory "
                              f"'{path.parent}', which does not exist on node ")
    assert "torch's FileStore would wait there without a bound" in message
    assert f"Fix: create the directory first (mkdir -p {path.parent})" in message


def test_file_init_method_that_names_a_directory(two_ranks_here, tmp_path):
    with pytest.raises(InitError, match=r"the store file '.*' is a directory .* Fix: create the directory first"):
        safe_init_process_group(DistributedConfig(init_method=f"file://{tmp_path}", init_timeout=60))


@pytest.mark.processes
def test_file_init_method_in_an_existing_directory_works(tmp_path):
    out = run_ranks(_init, 2, init=False, args=(f"file://{tmp_path / 'store'}",), timeout=60)
    assert [m for m, _, _ in out] == [None, None]


# ---------------------------------------------------------------------------------------------- arrival
@pytest.mark.processes
def test_a_rank_that_never_started_is_named_within_init_timeout():
    """WORLD_SIZE=3 but only ranks 0 and 1 run: both name rank 2 (no gloo full mesh waits 30 minutes)."""
    out = run_ranks(_init, 2, init=False, timeout=60, env={"WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3"})
    for rank, (message, ranks, elapsed) in enumerate(out):
        assert message.startswith(f"[rank {rank}] rank 2 did not arrive at the rendezvous (the c10d store at "
                                  "127.0.0.1:")
        assert f"within {INIT:g} s (distributed.init_timeout): 2 of 3 ranks did. Expected all 3 ranks" in message
        assert "raise distributed.init_timeout if nodes start slowly" in message
        assert ranks == (2,)
        assert INIT - 0.5 < elapsed < INIT + MARGIN


def test_a_rank_arriving_after_the_others_gave_up_says_it_was_late():
    """The others waited init_timeout and named the late rank as absent; the late rank (whose store outlived
    the deadline: an agent's, or its own in a process that re-initialises) read that list and said "rank 1 did
    not arrive" about itself. It now says that it came late, and what to look at."""
    import torch

    from robustdist.runtime.topology import Topology

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    topo = Topology(rank=1, world_size=2, local_rank=1, local_world_size=2, node_rank=0, num_nodes=1,
                    launcher="torchrun", device=torch.device("cpu"), master_addr="127.0.0.1", master_port=store.port,
                    visible_devices=None)
    base = "robustdist/rendezvous/77"
    store.set(f"{base}/0", "node 0")
    store.set(f"{base}/abandoned", json.dumps([1]))  # what rank 0 wrote at its deadline
    with pytest.raises(InitError) as info:
        rendezvous.wait_for_arrivals(store, 1, topo, time.monotonic() + 5, where="127.0.0.1:1", init_timeout=INIT,
                                     serves_it=False, generation=77)
    message = str(info.value)
    assert message.startswith("[rank 1] this rank reached the rendezvous (the c10d store at 127.0.0.1:1) after the "
                              "other ranks stopped waiting"), message
    assert "found rank 1 absent, this rank among them" in message and "did not arrive" not in message
    assert info.value.ranks == (1,)
    # a rank that was on time still names the absent one
    topo0 = Topology(**{**topo.__dict__, "rank": 0, "local_rank": 0})
    with pytest.raises(InitError, match=r"^\[rank 0\] rank 1 did not arrive at the rendezvous"):
        rendezvous.wait_for_arrivals(store, 0, topo0, time.monotonic() + 5, where="127.0.0.1:1", init_timeout=INIT,
                                     serves_it=False, generation=77)


@pytest.mark.parametrize("abandoned", ['"1"', "1", '{"1": 1}', "[[1]]", "[true]", "[1, 1]", "[2]", "[-1]",
                                       "[" * 5000, "not json", "[" + "0," * 100 + "0]"])
def test_a_hostile_abandoned_list_is_a_named_error(abandoned):
    """The store is input: what another process wrote under the key the ranks that gave up write is an InitError
    naming the key, never a raw TypeError, a wrong verdict or a list as long as the value says."""
    import torch

    from robustdist.runtime.topology import Topology

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    topo = Topology(rank=1, world_size=2, local_rank=1, local_world_size=2, node_rank=0, num_nodes=1,
                    launcher="torchrun", device=torch.device("cpu"), master_addr="127.0.0.1", master_port=store.port,
                    visible_devices=None)
    base = "robustdist/rendezvous/78"
    store.set(f"{base}/abandoned", abandoned)
    with pytest.raises(InitError) as info:
        rendezvous.wait_for_arrivals(store, 1, topo, time.monotonic() + 5, where="127.0.0.1:1", init_timeout=INIT,
                                     serves_it=False, generation=78)
    message = str(info.value)
    assert message.startswith("[rank 1] the rendezvous read b") and f"from the key '{base}/abandoned'" in message
    assert "expected the JSON list of absent ranks (0 to 1, each once)" in message and "Fix: " in message


# ---------------------------------------------------------------------------------------------- the setting
def test_init_timeout_is_a_validated_seconds_setting_with_an_env_var():
    assert DistributedConfig().init_timeout == 300.0 and DistributedConfig().timeout == 1800.0
    cfg = HardenConfig.from_env(environ={"ROBUSTDIST_DISTRIBUTED_INIT_TIMEOUT": "12.5"})
    assert cfg.distributed.init_timeout == 12.5
    with pytest.raises(ConfigError, match=r"`distributed.init_timeout` is -1 \(int\); expected a positive number of seconds"):
        DistributedConfig(init_timeout=-1)
    with pytest.raises(ConfigError, match=r"distributed.init_timeout"):
        HardenConfig.from_env(environ={"ROBUSTDIST_DISTRIBUTED_INIT_TIMEOUT": "soon"})


STORE_SERVER = textwrap.dedent("""
    import sys, time
    from datetime import timedelta
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    print(store.port, flush=True)
    time.sleep(120)
""")


@pytest.mark.processes
def test_a_store_that_freezes_after_the_handshake_is_named_within_the_bound():
    """Found by review: a TCPStore client's calls ignore its timeout when the server stops answering after the
    handshake (a frozen or cut-off master), so the arrival wait blocked with no bound. Rank 1 (a client of
    torchrun's agent store, as a worker is) connects, arrives, waits for rank 0; then the store freezes."""
    server = subprocess.Popen([sys.executable, "-c", STORE_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        env = {**os.environ, **AGENT, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONPATH": str(ROOT)}
        code = ("import json, sys; from tests.init.test_rendezvous import _init; "
                "print(json.dumps(_init(1, init_timeout=float(sys.argv[1]))[::2]), flush=True)")
        rank1 = subprocess.Popen([sys.executable, "-c", code, str(INIT)], env=env, stdout=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # rank 1 has arrived in the store: freeze the store now
                with contextlib.suppress(Exception):
                    probe = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
                    if probe.check(["robustdist/rendezvous/1/1"]):
                        break
                time.sleep(0.1)
            os.kill(server.pid, signal.SIGSTOP)
            frozen = time.monotonic()
            out, _ = rank1.communicate(timeout=60)
            took = time.monotonic() - frozen
        finally:
            if rank1.poll() is None:
                rank1.kill()
                rank1.wait()
        error, _ = json.loads(out.splitlines()[-1])
        assert error is not None and "stopped answering during the rendezvous" in error, error
        assert "no reply within distributed.init_timeout (3 s)" in error and "Fix: that process is frozen" in error
        assert took < INIT + 10 + 5 + MARGIN + 5  # the peer check's 10 s floor, 5 s to name, and exit
    finally:
        os.kill(server.pid, signal.SIGKILL)
        os.kill(server.pid, signal.SIGCONT)
        server.wait()

