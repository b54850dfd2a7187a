"""robustdist doctor: real subprocess runs, single-process and under torchrun, plus its individual checks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from robustdist import doctor

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME",
               "RAY_ADDRESS")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    return {**env, **extra}


def _doctor(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "robustdist", "doctor", *args], capture_output=True, text=True,
                          timeout=timeout, env=env or _env())


def _torchrun(*args, env=None):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    assert torchrun, "torchrun is not installed next to this interpreter"
    cmd = [torchrun, "--standalone", "--nproc_per_node=2", "-m", "robustdist", "doctor", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env or _env())


def _expected_code() -> int:
    """0 here, unless this environment's Python, torch or Ray is outside the range the version matrix passed (a
    lane of the matrix runs this suite on versions a render may not include yet): then 1, for that reason."""
    from robustdist.runtime import versions

    try:
        verdicts = [versions.classify(f.check.split(".", 1)[1], f.value.split()[0])
                    for f in doctor.check_versions()
                    if f.value != "not installed" and f.check.split(".", 1)[1] in versions.DEPENDENCIES]
    except versions.MatrixDataError:
        return 0
    return 1 if any(v.status == "unsupported" for v in verdicts) else 0


@pytest.mark.processes
def test_doctor_exits_0_here():
    out = _doctor()
    assert out.returncode == _expected_code(), out.stdout + out.stderr
    for check in ("version.torch", "cuda", "env.GLOO_SOCKET_IFNAME", "shm", "ulimit.nofile", "numa.nodes",
                  "topology", "ray.cluster"):
        assert f"\n{check} " in "\n" + out.stdout
    assert "skipped: RAY_ADDRESS is not set" in out.stdout


@pytest.fixture(scope="module")
def json_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """``doctor --json`` with a fake sysfs (NUMA nodes 0 and 3, which only this tree has), read by the two tests
    below: the sysfs root and the finished process. Only the NUMA check reads sysfs."""
    sysfs = tmp_path_factory.mktemp("sysfs")
    (sysfs / "devices/system/node/node0").mkdir(parents=True)
    (sysfs / "devices/system/node/node3").mkdir(parents=True)
    return sysfs, _doctor("--json", "--sysfs-root", str(sysfs))


@pytest.mark.processes
@pytest.mark.xdist_group("doctor_json_run")  # one worker makes the run both tests read
def test_doctor_json_parses(json_run):
    out = json_run[1]
    assert out.returncode == _expected_code(), out.stderr
    findings = json.loads(out.stdout)["findings"]
    assert {f["level"] for f in findings} <= {"ok", "warn", "error"}
    assert all(set(f) == {"check", "level", "value", "remedy"} for f in findings)
    assert any(f["check"] == "topology" and "launcher single" in f["value"] for f in findings)


@pytest.mark.processes
def test_broken_interface_exits_1_with_the_remedy():
    out = _doctor(env=_env(GLOO_SOCKET_IFNAME="nosuch0"))
    assert out.returncode == 1
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("env.GLOO_SOCKET_IFNAME"))
    assert " error " in line and "Fix: set GLOO_SOCKET_IFNAME to one of them" in line


@pytest.mark.processes
@pytest.mark.timeout(200)
def test_torchrun_prints_the_cross_rank_table():
    out = _torchrun()
    assert out.returncode == _expected_code(), out.stdout[-3000:] + out.stderr[-3000:]
    table = out.stdout.split("cross-rank (* marks a value that differs from the most common one):", 1)[1]
    rows = [ln.split() for ln in table.strip().splitlines()[1:3]]
    assert table.strip().splitlines()[0].split()[:5] == ["rank", "hostname", "pid", "python", "torch"]
    assert [r[0] for r in rows] == ["0", "1"]
    assert "*" not in table.split("other ranks'")[0]  # identical ranks: nothing marked
    assert out.stdout.count("cross-rank (") == 1  # only rank 0 prints it


@pytest.mark.processes
@pytest.mark.timeout(200)
def test_torchrun_broken_env_exits_1_on_every_rank():
    out = _torchrun(env=_env(GLOO_SOCKET_IFNAME="nosuch0"))
    assert out.returncode == 1
    assert "GLOO_SOCKET_IFNAME='nosuch0'" in out.stdout


def _launch_ranks(world, env_for_rank):
    """Start the doctor as `world` ranks with torchrun's env, each a process whose exit code we can see
    (torchrun itself stops the other ranks as soon as one fails, hiding their codes)."""
    from robustdist.testing.ranks import free_port

    port = str(free_port())
    procs = []
    for rank in range(world):
        env = _env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, TORCHELASTIC_RUN_ID="doctor-test",
                   OMP_NUM_THREADS="1", **env_for_rank(rank))
        procs.append(subprocess.Popen([sys.executable, "-m", "robustdist", "doctor", "--timeout", "60"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        return [(p.wait(timeout=150), p.stdout.read()) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stdout.close()
            p.stderr.close()


@pytest.mark.processes
@pytest.mark.timeout(200)
def test_every_rank_exits_with_the_same_code():
    broken = _launch_ranks(2, lambda rank: {"GLOO_SOCKET_IFNAME": "nosuch0"})
    assert [code for code, _ in broken] == [1, 1]
    assert all(f"[rank {r}] GLOO_SOCKET_IFNAME='nosuch0'" in out for r, (_, out) in enumerate(broken))
    # An error only rank 1 finds (a bad NCCL_SOCKET_IFNAME: a local check, and gloo init still works) is
    # shared through an all_reduce, so rank 0 exits 1 too and lists it among the other ranks' findings.
    one_bad = _launch_ranks(2, lambda rank: {"NCCL_SOCKET_IFNAME": "nosuch"} if rank == 1 else {})
    assert [code for code, _ in one_bad] == [1, 1]
    assert "other ranks' findings that are not ok:" in one_bad[0][1]
    assert "env.NCCL_SOCKET_IFNAME" in one_bad[0][1].split("other ranks' findings")[1]


def test_cross_rank_table_marks_differences():
    base = {"hostname": "h", "pid": 1, "python": "3.11.7", "torch": "2.13.0", "robustdist": "0.1.0",
            "config": "abc", "backend": "gloo", "cuda_visible_devices": None, "device": "cpu", "gpu": None, "env": {}}
    fps = [{**base, "rank": 0}, {**base, "rank": 1}, {**base, "rank": 2, "torch": "2.12.0"}]
    rows = doctor.cross_rank_table(fps).splitlines()
    assert "2.12.0 *" in rows[3] and "*" not in rows[1] and "*" not in rows[2]


def test_small_shm_and_low_nofile_warn(tmp_path, monkeypatch):
    monkeypatch.setattr(doctor.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(64 << 20, 0, 64 << 20))
    (f,) = doctor.check_shm(str(tmp_path))
    assert f.level == "warn" and "--shm-size=8g or --ipc=host" in f.remedy
    monkeypatch.setattr(doctor.resource, "getrlimit", lambda which: (1024, 4096))
    (g,) = doctor.check_nofile()
    assert (g.level, g.remedy.endswith("ulimit -n 4096")) == ("warn", True)


def test_numa_from_a_fake_sysfs(tmp_path):
    for node in ("node0", "node1"):
        (tmp_path / "devices/system/node" / node).mkdir(parents=True)
    gpu = tmp_path / "bus/pci/devices/0000:3b:00.0"
    gpu.mkdir(parents=True)
    (gpu / "numa_node").write_text("1\n")
    findings = doctor.check_numa(str(tmp_path), gpu_bus_ids=["0000:3B:00.0", "0000:af:00.0"])
    assert [(f.check, f.level, f.value) for f in findings] == [
        ("numa.nodes", "ok", "2 (node0, node1)"),
        ("numa.gpu0", "ok", "0000:3B:00.0: node 1"),
        ("numa.gpu1", "warn", "0000:af:00.0: no numa_node in sysfs"),
    ]


def test_ray_unreachable_address_is_a_warning(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    (f,) = doctor.check_ray(timeout=60)
    assert f.level == "warn" and f.value.startswith("127.0.0.1:1: ")


@pytest.mark.processes
@pytest.mark.ray
@pytest.mark.timeout(200)
def test_ray_cluster_resources_are_reported(ray_cluster, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.get_runtime_context().gcs_address)
    (f,) = doctor.check_ray(timeout=120)
    assert f.level == "ok" and "CPU=2" in f.value, f


@pytest.mark.processes
@pytest.mark.xdist_group("doctor_json_run")
def test_fake_sysfs_via_cli(json_run):
    sysfs, out = json_run
    numa = next(f for f in json.loads(out.stdout)["findings"] if f["check"] == "numa.nodes")
    assert numa["value"] == "2 (node0, node3)" and sysfs.exists()
