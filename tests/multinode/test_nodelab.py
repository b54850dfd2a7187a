"""The lab itself: nodes are real (own addresses, private disks), faults are real, teardown is complete."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from robustdist.testing import nodelab
from robustdist.testing.nodelab import LabError, NodeLab

pytestmark = pytest.mark.timeout(120)

# A TCP echo pair across nodes: node 0 listens, node 1 connects and sends when told through a file.
SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 7001)); s.listen(1); print("listening", flush=True)
c, _ = s.accept(); c.settimeout(60)
data = b""
while len(data) < 10:
    chunk = c.recv(100)
    if not chunk:
        break
    data += chunk
print("got", data.decode(), flush=True)
"""
CLIENT = """
import os, socket, sys, time
c = socket.create_connection((sys.argv[1], 7001), timeout=10)
print("connected", flush=True)
while not os.path.exists(sys.argv[2]):
    time.sleep(0.05)
c.settimeout(60)
c.sendall(b"0123456789")  # sent while the link is down: must arrive after link_up, not reset the connection
print("sent", flush=True)
time.sleep(30)
"""


def _require_lab():
    """As the node_lab fixture: skip with the reason where the lab cannot run, but fail in CI."""
    reason = nodelab.unavailable()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the multi-node lab must run in CI: {reason}", pytrace=False)
        pytest.skip(reason)


def _wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.mark.processes
def test_nodes_have_their_own_addresses_and_reach_each_other(node_lab):
    lab = node_lab(3)
    assert [n.address for n in lab.nodes] == ["10.213.0.1", "10.213.0.2", "10.213.0.3"]
    assert lab.exec(1, ["ip", "-4", "-o", "addr", "show", "eth0"]).split()[3] == "10.213.0.2/24"
    assert all(lab.reachable(a, b) for a in range(3) for b in range(3) if a != b)
    # The host's own interfaces are not in a node: only lo and eth0 exist there.
    names = {line.split(":")[1].strip().split("@")[0] for line in lab.exec(0, ["ip", "-o", "link"]).splitlines()}
    assert names == {"lo", "eth0"}
    # Each node has its own hostname and /etc/hosts, in the stock shape: its own name on 127.0.1.1.
    assert lab.exec(2, ["hostname"]).strip() == "node2"
    hosts = lab.exec(2, ["cat", "/etc/hosts"])
    assert "127.0.1.1 node2" in hosts and "10.213.0.1 node0" in hosts
    assert socket.gethostname() != "node2"  # the host's own name is untouched


@pytest.mark.processes
def test_link_down_is_a_partition_without_reset(node_lab, tmp_path):
    lab = node_lab(2)
    (tmp_path / "server.py").write_text(SERVER)
    (tmp_path / "client.py").write_text(CLIENT)
    go = tmp_path / "go"
    server = lab.popen(0, [sys.executable, str(tmp_path / "server.py"), "10.213.0.1"], name="server")
    _wait_for(lambda: "listening" in lab.log("server"), 30, "the server to listen")
    client = lab.popen(1, [sys.executable, str(tmp_path / "client.py"), "10.213.0.1", str(go)], name="client")
    _wait_for(lambda: "connected" in lab.log("client"), 30, "the client to connect")
    lab.link_down(1)
    assert not lab.reachable(1, 0) and not lab.reachable(0, 1)
    go.touch()
    _wait_for(lambda: "sent" in lab.log("client"), 30, "the client to send into the partition")
    time.sleep(2)
    assert "got" not in lab.log("server"), "data crossed a partition"
    lab.link_up(1)
    assert server.wait(timeout=60) == 0
    assert "got 0123456789" in lab.log("server")  # the same connection survived: packets vanished, none reset
    assert client.poll() is None
    client.kill()
    client.wait(timeout=10)


@pytest.mark.processes
def test_local_disk_is_private_to_each_node(node_lab, tmp_path):
    disk = tmp_path / "ckpt"
    lab = node_lab(2, local_disk=disk, disk_size="8m")
    lab.exec(0, ["sh", "-c", f"echo zero > {disk}/from-node0"])
    lab.exec(1, ["sh", "-c", f"echo one > {disk}/from-node1"])
    assert lab.exec(0, ["ls", str(disk)]).split() == ["from-node0"]
    assert lab.exec(1, ["ls", str(disk)]).split() == ["from-node1"]
    assert os.listdir(disk) == []  # the test process (the "outside") sees neither
    lab.fill_disk(1)
    write = ("import errno, sys\ntry:\n    open(sys.argv[1], 'wb').write(b'x' * 65536)\nexcept OSError as e:\n"
             "    print(errno.errorcode[e.errno])")
    assert lab.exec(1, [sys.executable, "-c", write, f"{disk}/more"]).strip() == "ENOSPC"
    assert lab.exec(0, ["sh", "-c", f"echo x > {disk}/more && echo ok"]).strip() == "ok"  # node 0's disk is not full


@pytest.mark.processes
def test_kill_node_kills_every_process_in_it_and_keeps_the_node(node_lab, tmp_path):
    lab = node_lab(2)
    sleepers = [lab.popen(1, ["sleep", "300"], name=f"sleep{i}") for i in range(2)]
    other = lab.popen(0, ["sleep", "300"], name="other")
    killed = lab.kill_node(1)
    assert {p.pid for p in sleepers} <= set(killed)
    assert all(p.wait(timeout=10) == -9 for p in sleepers)
    assert other.poll() is None  # another node is untouched
    again = lab.popen(1, ["sh", "-c", "echo alive"], name="again")  # the node can run a new agent
    assert again.wait(timeout=10) == 0 and "alive" in lab.log("again")
    other.kill()
    other.wait(timeout=10)


@pytest.mark.processes
def test_teardown_is_complete_even_when_the_test_body_fails(tmp_path):
    _require_lab()
    before = set(nodelab.leftover_namespaces(owner=os.getpid()))
    with pytest.raises(RuntimeError, match="boom"):
        with NodeLab(2, local_disk=tmp_path / "d", log_dir=tmp_path / "logs") as lab:
            proc = lab.popen(1, ["sleep", "300"])
            raise RuntimeError("boom")
    assert proc.wait(timeout=10) == -9
    assert set(nodelab.leftover_namespaces(owner=os.getpid())) == before
    for node in lab.nodes:
        assert node.holder is not None and node.holder.poll() is not None  # the mount namespaces are gone too


@pytest.mark.processes
def test_a_teardown_that_failed_part_way_is_done_again_by_the_next_close(tmp_path, monkeypatch):
    """A close() that fails (or is interrupted by a test's timeout) after killing the processes but before the
    namespaces are deleted must not leave the lab marked closed: the next close() deletes them."""
    _require_lab()
    before = set(nodelab.leftover_namespaces(owner=os.getpid()))
    lab = NodeLab(2, log_dir=tmp_path / "logs")
    real_run = nodelab._run

    def failing_delete(argv, **kwargs):
        if list(argv[:3]) == ["ip", "netns", "delete"]:
            raise LabError("simulated: interrupted before the namespaces were deleted")
        return real_run(argv, **kwargs)

    monkeypatch.setattr(nodelab, "_run", failing_delete)
    with pytest.raises(LabError, match="the lab was not fully torn down: simulated"):
        lab.close()
    assert set(nodelab.leftover_namespaces(owner=os.getpid())) - before  # still there
    monkeypatch.setattr(nodelab, "_run", real_run)
    lab.close()
    assert set(nodelab.leftover_namespaces(owner=os.getpid())) == before
    lab.close()  # and now idempotent


@pytest.mark.parametrize("nodes", [1, 0, nodelab.MAX_NODES + 1, True, "2"])
def test_bad_node_counts_are_refused(nodes):
    with pytest.raises(LabError, match=r"expected an int from 2 to 16.*Fix: simulate at most 16 nodes"):
        NodeLab(nodes)


def test_a_system_directory_is_refused_as_local_disk(tmp_path):
    _require_lab()
    with pytest.raises(LabError, match="would hide a system directory"):
        NodeLab(2, local_disk="/proc", log_dir=tmp_path)


@pytest.mark.processes
def test_a_path_that_cannot_be_mounted_is_named(tmp_path):
    _require_lab()
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    before = set(nodelab.leftover_namespaces(owner=os.getpid()))
    with pytest.raises(LabError, match="Fix: check that the path can be mounted on"):
        NodeLab(2, local_disk=a_file / "sub", log_dir=tmp_path / "logs")
    assert set(nodelab.leftover_namespaces(owner=os.getpid())) == before  # a failed build leaves nothing


def test_not_root_is_a_named_reason(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in nodelab.unavailable()
    with pytest.raises(LabError, match="needs root.*Fix: skip the multi-node tests"):
        NodeLab(2)


@pytest.mark.processes
def test_remove_stale_clears_a_crashed_runs_namespaces():
    _require_lab()
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"{nodelab.PREFIX}{dead.pid}-0-n0"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
    try:
        assert name in nodelab.remove_stale()
        assert name not in nodelab.leftover_namespaces()
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=10)
    with pytest.raises(LabError, match="not a lab namespace"):
        nodelab.delete_namespace("default")


def test_the_lab_never_uses_addresses_outside_its_namespaces():
    # The host namespace has no route to the lab's subnet: the lab's addresses exist only inside it.
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.213.0.1", 9))
        source = probe.getsockname()[0]
    except OSError:
        source = None
    finally:
        probe.close()
    assert source is None or not source.startswith("10.213."), "the host itself has a 10.213.0.0/24 address"
