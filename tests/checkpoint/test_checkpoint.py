"""AtomicCheckpointer's API: entries of every kind, refusals, async timing, sharded (FSDP2) state, Ray."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from robustdist.checkpoint import AtomicCheckpointer
from robustdist.runtime.errors import CheckpointCorruptError, CheckpointError
from robustdist.testing.ranks import run_ranks


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


def test_modules_optimizers_schedulers_scalers_tensors_and_data(tmp_path):
    # saved without _orig_mod. prefixes: the eager backend wraps the module as any backend does, without
    # inductor's compile workers and C++ build (the wrapper, not the generated code, is what is saved)
    model = torch.compile(_model(0), backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    scaler = torch.amp.GradScaler("cpu", init_scale=128.0)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    sched.step()
    with AtomicCheckpointer(tmp_path, config_fingerprint="abc") as ckpt:
        info = ckpt.save(3, {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler,
                             "ema": torch.ones(2), "extra": {"epoch": 1, "name": "run"}},
                         per_rank={"sampler_epoch": 1}, metadata={"note": "first"})
        assert (info.step, info.files, info.total_seconds >= info.blocking_seconds > 0) == (3, 2, True)
        fresh = _model(1)
        opt2 = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
        sched2, scaler2 = torch.optim.lr_scheduler.StepLR(opt2, 2), torch.amp.GradScaler("cpu")
        loaded = ckpt.load(state={"model": fresh, "optimizer": opt2, "scheduler": sched2, "scaler": scaler2})
    inner = model._orig_mod
    assert all(torch.equal(a, b) for a, b in zip(inner.state_dict().values(), fresh.state_dict().values()))
    assert opt2.state_dict()["state"][0]["momentum_buffer"].equal(opt.state_dict()["state"][0]["momentum_buffer"])
    assert sched2.last_epoch == 1 and scaler2.get_scale() == 128.0
    assert loaded.state["extra"] == {"epoch": 1, "name": "run"} and torch.equal(loaded.state["ema"], torch.ones(2))
    assert loaded.per_rank == {"sampler_epoch": 1} and loaded.metadata == {"note": "first"}
    manifest = json.loads((tmp_path / "step_0000000003" / "manifest.json").read_text())
    assert manifest["config_fingerprint"] == "abc" and manifest["world_size"] == 1
    assert manifest["entries"] == {"model": "module", "optimizer": "stateful", "scheduler": "stateful",
                                   "scaler": "stateful", "ema": "data", "extra": "data"}
    assert set(manifest["files"]) == {"replicated.pt", "rank_00000.pt"}


def test_rng_state_is_restored(tmp_path):
    import random

    import numpy as np

    with AtomicCheckpointer(tmp_path) as ckpt:
        torch.manual_seed(1), random.seed(1), np.random.seed(1)
        ckpt.save(1, {"x": torch.zeros(1)})
        expected = (torch.rand(2).tolist(), random.random(), np.random.rand())
        torch.manual_seed(2), random.seed(2), np.random.seed(2)
        ckpt.load(state={"x": torch.zeros(1)})
        assert (torch.rand(2).tolist(), random.random(), np.random.rand()) == expected


class Custom:
    pass


def test_unsafe_values_are_refused_at_save(tmp_path):
    with AtomicCheckpointer(tmp_path) as ckpt:
        with pytest.raises(CheckpointError) as exc:
            ckpt.save(1, {"extra": {"obj": Custom()}})
        assert str(exc.value).startswith(
            "checkpoint step 1 was not committed: 1 rank(s) failed (rank 0: robustdist.runtime.errors.CheckpointError: "
            "checkpoint value state['extra']['obj'] is a tests.checkpoint.test_checkpoint.Custom")
        assert "Fix: store its state_dict() or convert it to plain data" in str(exc.value)
        assert ckpt.steps() == [] and os.listdir(tmp_path) == [".lock"]


def test_bad_arguments(tmp_path):
    with pytest.raises(CheckpointError, match=r"keep_last=0; expected an integer >= 1"):
        AtomicCheckpointer(tmp_path, keep_last=0)
    ckpt = AtomicCheckpointer(tmp_path)
    with pytest.raises(CheckpointError, match=r"step=-1; expected a non-negative integer"):
        ckpt.save(-1, {})
    with pytest.raises(CheckpointCorruptError, match="no valid checkpoint in"):
        ckpt.load()
    ckpt.save(1, {"x": torch.zeros(1)})
    with pytest.raises(CheckpointError, match=r"state\['y'\] is not in checkpoint step 1 \(it holds \['x'\]\)"):
        ckpt.load(state={"y": torch.zeros(1)})
    ckpt.close()
    with pytest.raises(CheckpointError, match="this AtomicCheckpointer is closed"):
        ckpt.save(2, {})


@pytest.mark.processes
def test_close_releases_the_lock_and_leaves_no_holder_named(tmp_path):
    import subprocess
    import sys

    ckpt = AtomicCheckpointer(tmp_path)
    ckpt.save(1, {"x": torch.zeros(1)})
    lock = tmp_path / ".lock"
    assert lock.read_text().startswith(f"pid {os.getpid()} on host ")  # held: it names its holder
    with pytest.raises(CheckpointError, match="already being written by another AtomicCheckpointer in this process"):
        AtomicCheckpointer(tmp_path).save(2, {"x": torch.ones(1)})
    ckpt.close()
    assert lock.is_file() and str(os.getpid()) not in lock.read_text() and lock.read_text() == ""
    child = ("import sys, torch; from robustdist.checkpoint import AtomicCheckpointer\n"
             "with AtomicCheckpointer(sys.argv[1]) as c:\n    c.save(2, {'x': torch.ones(1)})\n")
    out = subprocess.run([sys.executable, "-c", child, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr  # another process takes the released lock
    with AtomicCheckpointer(tmp_path) as again:  # and so does this one, again
        assert again.save(3, {"x": torch.ones(1)}).step == 3 and again.steps() == [1, 2, 3]
    assert lock.read_text() == ""


def test_resaving_a_step_replaces_it_atomically(tmp_path):
    with AtomicCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, {"x": torch.zeros(1)})
        ckpt.save(1, {"x": torch.ones(1)})
        assert torch.equal(ckpt.load().state["x"], torch.ones(1)) and ckpt.steps() == [1]
    assert sorted(os.listdir(tmp_path)) == [".lock", "step_0000000001"]


def test_async_blocks_only_for_the_snapshot(tmp_path):
    big = {"w": torch.randn(4_000_000)}
    with AtomicCheckpointer(tmp_path, async_save=True) as ckpt:
        info = ckpt.save(1, big)
        big["w"].zero_()  # the snapshot was taken: later changes do not leak into the checkpoint
        ckpt.wait()
        assert info.done.is_set() and info.total_seconds > info.blocking_seconds
        assert ckpt.load().state["w"].abs().sum() > 0


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # buffers stay plain tensors under FSDP2


def _sharded(rank, directory):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _model(0)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(6, 4)).sum().backward()
    opt.step()
    ckpt = AtomicCheckpointer(directory)
    ckpt.save(2, {"model": model, "optimizer": opt})
    full = {k: _full(v) for k, v in model.state_dict().items()}
    fresh = _model(1)
    fully_shard(fresh, mesh=mesh)
    opt2 = torch.optim.Adam(fresh.parameters(), lr=0.01)
    ckpt.load(state={"model": fresh, "optimizer": opt2})
    reloaded = {k: _full(v) for k, v in fresh.state_dict().items()}
    exp_avg = [_full(s["exp_avg"]) for s in opt.state.values()]
    exp_avg2 = [_full(s["exp_avg"]) for s in opt2.state.values()]
    ckpt.close()
    return (all(torch.equal(full[k], reloaded[k]) for k in full), all(map(torch.equal, exp_avg, exp_avg2)),
            {k: v.tolist() for k, v in full.items()})


@pytest.mark.processes
def test_fsdp2_state_goes_through_dcp_and_reshards(fsdp_cpu, tmp_path):
    out = run_ranks(_sharded, 2, args=(str(tmp_path),), timeout=120)
    assert all(model_ok and optim_ok for model_ok, optim_ok, _ in out)
    manifest = json.loads((tmp_path / "step_0000000002" / "manifest.json").read_text())
    assert manifest["entries"] == {"model": "sharded", "optimizer": "sharded"}
    assert {"sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp"} <= set(manifest["files"])
    plain = _model(7)  # a world of 1, unsharded: DCP reshards into the full tensors
    with AtomicCheckpointer(tmp_path) as ckpt:
        ckpt.load(state={"model": plain})
    assert {k: v.tolist() for k, v in plain.state_dict().items() if k in out[0][2]} == out[0][2]


@pytest.mark.ray
def test_ray_train_checkpoint_round_trip(tmp_path):
    pytest.importorskip("ray")
    with AtomicCheckpointer(tmp_path / "run") as ckpt:
        ckpt.save(4, {"x": torch.arange(3)})
        ray_ckpt = ckpt.ray_checkpoint()
        assert ray_ckpt.path.endswith("step_0000000004")
    other = AtomicCheckpointer(tmp_path / "elsewhere")
    loaded = other.load(ray_ckpt)
    assert loaded.step == 4 and torch.equal(loaded.state["x"], torch.arange(3))
    with pytest.raises(CheckpointError, match="no committed checkpoint step 9"):
        AtomicCheckpointer(tmp_path / "run").ray_checkpoint(9)


def test_async_saves_reuse_their_snapshot_buffers_without_mixing_steps(tmp_path):
    w = torch.zeros(1000)
    model = torch.nn.Linear(4, 2)
    with AtomicCheckpointer(tmp_path, keep_last=3, async_save=True) as ckpt:
        ckpt.save(1, {"w": w, "model": model})
        w.add_(1)  # mutated as soon as save() returns: the snapshot must not see it
        with torch.no_grad():
            model.weight.add_(1)
        first = dict(ckpt._staging)
        ckpt.save(2, {"w": w, "model": model})
        assert all(ckpt._staging[k] is first[k] for k in first) and len(first) == 3  # the same buffers, reused
        ckpt.wait()
        one = ckpt.load(1)
        two = ckpt.load(2)
    assert torch.equal(one.state["w"], torch.zeros(1000)) and torch.equal(two.state["w"], torch.ones(1000))
    assert torch.equal(two.state["model"]["weight"], one.state["model"]["weight"] + 1)


def test_manifests_record_crc32_and_0_1_0_sha256_manifests_still_verify(tmp_path):
    import json

    from robustdist.checkpoint._io import sha256_file
    from robustdist.runtime.errors import CheckpointCorruptError

    with AtomicCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": torch.arange(10.0)})
        step_dir = tmp_path / "step_0000000001"
        manifest = json.loads((step_dir / "manifest.json").read_text())
        entry = manifest["files"]["replicated.pt"]
        assert set(entry) == {"size", "crc32"} and len(entry["crc32"]) == 8
        size, sha = sha256_file(str(step_dir / "replicated.pt"))  # what robustdist 0.1.0 wrote
        manifest["files"]["replicated.pt"] = {"size": size, "sha256": sha}
        (step_dir / "manifest.json").write_text(json.dumps(manifest))
        assert torch.equal(ckpt.load(1).state["w"], torch.arange(10.0))
        manifest["files"]["replicated.pt"] = {"size": size}
        (step_dir / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(CheckpointCorruptError, match="records no checksum"):
            ckpt.load(1)
