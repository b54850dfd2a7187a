"""safe_init_process_group on real gloo ranks: success, barrier, agreement, env checks, existing groups."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from robustdist.config.schema import HardenConfig
from robustdist.init import process_group
from robustdist.init import reach as _reach
from robustdist.init import rendezvous as _rendezvous
from robustdist.init.process_group import destroy_process_group_if_owned, distributed, safe_init_process_group
from robustdist.runtime import agreement
from robustdist.runtime.errors import ConfigError, InitError, RobustDistWarning, TopologyError
from robustdist.runtime.topology import detect_topology
from robustdist.testing.ranks import free_port, run_ranks

FAST = {"distributed": {"timeout": 60, "barrier_timeout": 30}}


def _init_and_report(rank):
    report = safe_init_process_group(FAST)
    out = {
        "created": report.created, "backend": report.backend, "rank": report.rank, "world": report.world_size,
        "timings": sorted(report.timings), "all_positive": all(v >= 0 for v in report.timings.values()),
        "fp_ranks": [fp["rank"] for fp in report.fingerprints],
        "fp_config": {fp["config"] for fp in report.fingerprints},
        "torch": {fp["torch"] for fp in report.fingerprints}, "warnings": report.warnings,
        "group_alive": dist.is_initialized(),
    }
    out["destroyed"] = destroy_process_group_if_owned(report)
    return out


@pytest.mark.processes
@pytest.mark.parametrize("world", [2, 3])
def test_success_report_on_every_rank(world):
    out = run_ranks(_init_and_report, world, init=False, timeout=90)
    fingerprint = HardenConfig.from_dict(FAST).fingerprint()
    for rank, rep in enumerate(out):
        assert rep == {
            "created": True, "backend": "gloo", "rank": rank, "world": world,
            "timings": ["agreement", "barrier", "init", "smoke"], "all_positive": True,
            "fp_ranks": list(range(world)), "fp_config": {fingerprint}, "torch": {torch.__version__},
            "warnings": [], "group_alive": True, "destroyed": True,
        }


def _config_differs_on_last_rank(rank, world):
    seed = 1 if rank == world - 1 else 0
    try:
        safe_init_process_group({**FAST, "data": {"seed": seed}})
    except InitError as e:
        return str(e), e.ranks, dist.is_initialized()
    return None


@pytest.mark.processes
@pytest.mark.parametrize("world", [2, 3])
def test_config_fingerprint_mismatch_names_the_rank_on_every_rank(world):
    out = run_ranks(_config_differs_on_last_rank, world, args=(world,), init=False, timeout=90)
    odd = world - 1
    for rank, (message, ranks, alive) in enumerate(out):
        assert message.startswith(f"[rank {rank}] ranks disagree: the config fingerprint differs across ranks (")
        assert f"rank {odd}: '" in message
        assert "Fix: give every rank the same config" in message
        assert alive is False  # the group this call created is destroyed before raising
        if world == 3:
            assert ranks == (odd,)
    assert len({m.split("] ", 1)[1] for m, _, _ in out}) == 1  # the same error on every rank


def _late_to_the_barrier(rank, late_rank, delay):
    if rank == late_rank:
        time.sleep(delay)
    start = time.monotonic()
    try:
        safe_init_process_group({"distributed": {"timeout": 60, "barrier_timeout": 3}})
    except InitError as e:
        return str(e), e.ranks, time.monotonic() - start
    return None


@pytest.mark.processes
def test_rank_missing_the_barrier_is_named_by_the_others():
    # run_ranks creates the group (init is not a barrier), then rank 2 dawdles past barrier_timeout.
    out = run_ranks(_late_to_the_barrier, 3, args=(2, 8), timeout=90)
    for rank in (0, 1):
        message, ranks, elapsed = out[rank]
        assert ranks == (2,), message
        assert f"[rank {rank}] rank 2 did not reach the barrier 'init' within 3 s; expected all 3 ranks." in message
        assert elapsed < 3 + 10


def _bad_gloo_ifname(rank):
    try:
        safe_init_process_group(FAST)
    except InitError as e:
        return str(e)
    return None


@pytest.mark.processes
def test_bad_gloo_socket_ifname_lists_real_interfaces():
    out = run_ranks(_bad_gloo_ifname, 2, init=False, env={"GLOO_SOCKET_IFNAME": "nosuch0"}, timeout=60)
    import socket

    real = ", ".join(name for _, name in socket.if_nameindex())
    for rank, message in enumerate(out):
        assert message.startswith(f"[rank {rank}] GLOO_SOCKET_IFNAME='nosuch0' names interface(s) nosuch0 that do not exist")
        assert f"interfaces: {real}" in message
        assert "Fix: set GLOO_SOCKET_IFNAME to one of them" in message


def _fake_gpus(rank, gpus):
    """Pretend each rank drives a CUDA device; only the device discovery is replaced."""
    fake = {r: g for r, g in enumerate(gpus)}
    agreement.gpu_identity = lambda device: fake[rank]
    original = agreement.local_fingerprint

    def on_cuda(**kw):
        kw["device"] = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        return original(**kw)

    process_group.local_fingerprint = on_cuda
    try:
        safe_init_process_group(FAST)
    except InitError as e:
        return str(e), e.ranks
    return None


@pytest.mark.processes
def test_duplicate_gpu_on_one_host_is_an_error_on_every_rank():
    out = run_ranks(_fake_gpus, 2, args=(["GPU-aaaa", "GPU-aaaa"],), init=False, env={"CUDA_VISIBLE_DEVICES": "0,1"},
                    timeout=60)
    for message, ranks in out:
        assert "ranks 0, 1 on host" in message and "use the same physical GPU GPU-aaaa" in message
        assert "'Duplicate GPU detected'" in message and ranks == (0, 1)


@pytest.mark.processes
def test_cuda_visible_devices_drift_on_one_host_is_an_error():
    out = run_ranks(_fake_gpus, 2, args=(["GPU-a", "GPU-b"],), init=False,
                    env=[{"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "1,0"}], timeout=60)
    for message, ranks in out:
        assert "CUDA_VISIBLE_DEVICES on host" in message and "differs across ranks (rank 0: '0,1'; rank 1: '1,0')" in message
        assert ranks == (1,)


@pytest.mark.processes
def test_one_gpu_per_rank_isolation_is_fine():
    # srun --gpus-per-task=1 style: each rank sees only its own GPU, so the lists differ legitimately.
    out = run_ranks(_fake_gpus, 2, args=(["GPU-a", "GPU-b"],), init=False,
                    env=[{"CUDA_VISIBLE_DEVICES": "0", "LOCAL_RANK": "0"}, {"CUDA_VISIBLE_DEVICES": "1", "LOCAL_RANK": "0"}],
                    timeout=60)
    assert out == [None, None]


def _nccl_env_differs(rank):
    with pytest.warns(RobustDistWarning) as record:
        report = safe_init_process_group(FAST)
    destroy_process_group_if_owned(report)
    return report.warnings, [str(w.message) for w in record]


@pytest.mark.processes
def test_nccl_env_differing_within_a_host_warns():
    out = run_ranks(_nccl_env_differs, 2, init=False, env=[{"NCCL_IB_DISABLE": "1"}, {"NCCL_IB_DISABLE": "0"}],
                    timeout=60)
    for warnings, emitted in out:
        assert len(warnings) == 1 and "NCCL_IB_DISABLE on host" in warnings[0]
        assert any("NCCL_IB_DISABLE on host" in w for w in emitted)


def _existing_group(rank):
    before = dist.group.WORLD
    with pytest.warns(RobustDistWarning, match="a process group already exists"):
        report = safe_init_process_group({"distributed": {"backend": "gloo", "timeout": 5}})
    same = dist.group.WORLD is before
    return report.created, same, report.backend, destroy_process_group_if_owned(report), dist.is_initialized()


@pytest.mark.processes
def test_existing_group_is_validated_not_reinitialised():
    out = run_ranks(_existing_group, 2, timeout=60)
    assert out == [(False, True, "gloo", False, True)] * 2


def _context_manager(rank):
    with distributed(FAST) as report:
        inside = dist.is_initialized() and report.created
    return inside, dist.is_initialized()


@pytest.mark.processes
def test_distributed_context_manager_destroys_what_it_created():
    assert run_ranks(_context_manager, 2, init=False, timeout=60) == [(True, False)] * 2


# ----------------------------------------------------------------------------- single process, bad input
@pytest.fixture
def single(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "GLOO_SOCKET_IFNAME"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_single_process_is_not_distributed(single):
    report = safe_init_process_group()
    assert (report.distributed, report.created, report.backend, dist.is_initialized()) == (False, False, None, False)


def test_single_process_group_on_request(single):
    with distributed(init_single=True) as report:
        assert report.created and dist.get_world_size() == 1 and report.timings["smoke"] >= 0
    assert not dist.is_initialized()


def test_nccl_without_cuda(single):
    with pytest.raises(InitError, match=r"backend 'nccl' was requested but CUDA is not available .* Fix: use backend 'gloo'"):
        safe_init_process_group(backend="nccl", init_single=True)


def _two_rank_env(mp, **extra):
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", **extra}
    for k, v in env.items():
        mp.setenv(k, v)


def test_unresolvable_master_addr_fails_before_waiting(single):
    _two_rank_env(single, MASTER_ADDR="no-such-host.invalid")
    start = time.monotonic()
    with pytest.raises(InitError, match=r"\[rank 0\] MASTER_ADDR='no-such-host.invalid' does not resolve .* Fix: use"):
        safe_init_process_group(FAST)
    assert time.monotonic() - start < 15 and not dist.is_initialized()


def test_missing_master_addr(single):
    _two_rank_env(single)
    single.delenv("MASTER_ADDR")
    with pytest.raises(InitError, match="MASTER_ADDR is not set; expected the master node's address for env://"):
        safe_init_process_group(FAST)


def test_bad_port_rank_and_world(single):
    _two_rank_env(single, MASTER_PORT="99999")
    with pytest.raises(TopologyError, match="MASTER_PORT='99999' is not a TCP port"):
        safe_init_process_group(FAST)
    _two_rank_env(single, RANK="2")
    with pytest.raises(TopologyError, match="rank 2 is outside world size 2"):
        safe_init_process_group(FAST)
    _two_rank_env(single, WORLD_SIZE="0")
    with pytest.raises(TopologyError, match=r"WORLD_SIZE=.0. is out of range; expected an integer in 1\.\.16777216"):
        safe_init_process_group(FAST)


def test_nccl_ifname_semantics(single):
    from robustdist.runtime.netenv import check_socket_ifname

    names = ["lo", "eth0", "eth1", "ib0"]
    assert check_socket_ifname("NCCL_SOCKET_IFNAME", "eth", names) is None  # prefix
    assert check_socket_ifname("NCCL_SOCKET_IFNAME", "=eth1", names) is None  # exact
    assert check_socket_ifname("NCCL_SOCKET_IFNAME", "^lo,ib", names) is None  # excludes some
    assert check_socket_ifname("NCCL_SOCKET_IFNAME", "=eth", names) is not None  # exact, no such name
    assert "excludes every interface" in check_socket_ifname("NCCL_SOCKET_IFNAME", "^lo,eth,ib", names)
    assert "matches no interface" in check_socket_ifname("NCCL_SOCKET_IFNAME", "enp", names)
    assert check_socket_ifname("GLOO_SOCKET_IFNAME", "eth0,lo", names) is None
    assert "eth" in check_socket_ifname("GLOO_SOCKET_IFNAME", "eth", names)  # gloo wants exact names


def test_bad_timeout_is_a_config_error(single):
    with pytest.raises(ConfigError, match="`timeout` is -1"):
        safe_init_process_group(timeout=-1)


def _serve_as_rank_zero(topology, generation, done, reach_generation):
    """Rank 0 of a 2-rank rendezvous, on a thread: serve the store, arrive and take part in the reachability
    check (what rank 0's init does first)."""
    deadline = time.monotonic() + 30
    ep = _rendezvous.endpoint("env://", topology)
    store, serves = _rendezvous.open_store(ep, topology, deadline, 30)
    _rendezvous.wait_for_arrivals(store, 0, topology, deadline, where="test", init_timeout=30, serves_it=serves,
                                  generation=generation)
    _reach.check_peers(store, 0, 2, timeout_s=30, generation=reach_generation)
    done.wait(30)  # keep serving until rank 1 is through


def test_cuda_device_is_set_before_init_and_passed_as_device_id(single, monkeypatch):
    """Tier (a): only what needs a GPU is faked; the init sequence up to init_process_group is the real one,
    including the rendezvous with a rank 0 (a thread here) that serves the store."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", str(device))))

    def fake_init(**kwargs):
        calls.append(("init", kwargs["backend"], str(kwargs.get("device_id")), kwargs["timeout"].total_seconds()))
        raise RuntimeError("stop here: NCCL needs a real GPU")

    monkeypatch.setattr(dist, "init_process_group", fake_init)
    _two_rank_env(single, RANK="1", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", TORCHELASTIC_RUN_ID="x",
                  MASTER_PORT=str(free_port()))
    rank_zero = dataclasses.replace(detect_topology(), rank=0, local_rank=0)
    done = threading.Event()
    server = threading.Thread(target=_serve_as_rank_zero, args=(rank_zero, _rendezvous._generation + 1, done,
                                                                 _reach._generation + 1),
                              daemon=True)
    server.start()
    try:
        with pytest.raises(InitError, match=r"\[rank 1\] init_process_group\(backend='nccl'.*stop here") as exc:
            safe_init_process_group({"distributed": {"timeout": 42, "init_timeout": 30}})
    finally:
        done.set()
        server.join(30)
    assert isinstance(exc.value.__cause__, RuntimeError)
    assert calls == [("set_device", "cuda:1"), ("init", "nccl", "cuda:1", 42.0)]


class _RankOneInOldStore:
    """Rank 0's previous store (served here) with rank 1 (a thread running the real rendezvous) arrived in it."""

    def __init__(self, mp, init_timeout: float):
        from robustdist.init import elastic_store as _elastic_store
        from robustdist.init import store as _init_store

        _two_rank_env(mp, RANK="1", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_PORT=str(free_port()))
        rank_one = detect_topology()
        self.rank_zero = dataclasses.replace(rank_one, rank=0, local_rank=0)
        dcfg = dataclasses.replace(HardenConfig().distributed, init_timeout=init_timeout)
        self.ep = _rendezvous.endpoint("env://", self.rank_zero)
        self.deadline = time.monotonic() + init_timeout
        self.old, serves = _rendezvous.open_store(self.ep, self.rank_zero, self.deadline, init_timeout)
        assert serves
        self.generation = _rendezvous._generation + 1
        self.result: dict = {}
        mode = _elastic_store.attempt_mode(os.environ, "env://")

        def rank_one_arrives():
            started = time.monotonic()
            try:
                self.result["value"] = _init_store._arrive(self.ep, dcfg, rank_one, mode, self.deadline, "test")
            except BaseException as e:  # the assertions name it
                self.result["error"] = e
            self.result["after"] = time.monotonic() - started

        self.client = threading.Thread(target=rank_one_arrives, daemon=True)
        self.client.start()
        while not self.old.check([f"robustdist/rendezvous/{self.generation}/1"]):  # rank 1 is in the old store
            assert time.monotonic() < self.deadline and self.client.is_alive(), self.result
            time.sleep(0.01)


def test_a_client_whose_store_closes_before_everyone_arrived_connects_to_the_next(single):
    """Rank 1 arrives in rank 0's previous store in the moment before rank 0 frees it (a re-init in one process);
    the store then closes under rank 1, and rank 0 serves the next one on the same port. Rank 1 connects again
    and arrives there, instead of failing with "stopped answering" while rank 0 waits for it."""
    lab = _RankOneInOldStore(single, 30)
    del lab.old  # rank 0 frees its previous store: the server stops under rank 1
    time.sleep(0.3)
    new, serves = _rendezvous.open_store(lab.ep, lab.rank_zero, lab.deadline, 30)  # the next, on the same port
    _rendezvous.wait_for_arrivals(new, 0, lab.rank_zero, lab.deadline, where="test", init_timeout=30,
                                  serves_it=serves, generation=lab.generation)
    lab.client.join(30)
    assert "error" not in lab.result, lab.result
    store, _, client_serves = lab.result["value"]
    assert not client_serves and store.get(f"robustdist/rendezvous/{lab.generation}/0")  # arrived in the new one
    assert new.check([f"robustdist/rendezvous/{lab.generation}/1"])


def test_a_client_whose_rank_zero_is_gone_for_good_says_so_without_waiting_out_the_deadline(single):
    """Rank 0 lost for good (crashed) after rank 1 arrived: rank 1 looks for a next store only briefly, then
    reports the loss itself ("stopped answering ... rank 0 failed or exited"), not a connection refused at the
    end of init_timeout that blames the port setup."""
    from robustdist.init import store as _init_store

    single.setattr(_init_store, "_RECONNECT_S", 1.0)
    lab = _RankOneInOldStore(single, 120)
    del lab.old  # and nothing serves again
    lab.client.join(100)
    assert type(lab.result.get("error")) is InitError and _rendezvous.store_lost(lab.result["error"]), lab.result
    assert "stopped answering" in str(lab.result["error"]) and "rank 0" in str(lab.result["error"])
    assert lab.result["after"] < 60  # well before the 120 s deadline: the reconnect window is 1 s here
