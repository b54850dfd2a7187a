"""harden(): single-process no-ops, 2-rank equivalence with the hand-composed parts, checkpoints and resume,
FSDP, and the resilient-training demo under torchrun with a real SIGKILL."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from robustdist import harden
from robustdist.data.dataloader import SafeDataLoader, safe_dataloader
from robustdist.harden import Hardened
from robustdist.init.process_group import destroy_process_group_if_owned, safe_init_process_group
from robustdist.parallel.ddp import DistributedDataParallel, wrap_ddp
from robustdist.runtime.errors import ConfigError
from robustdist.testing.ranks import run_ranks
from tests import _training as tr

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_PROCID",
                "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


# ---------------------------------------------------------------------------------------------- single process
def test_single_process_is_a_no_op_around_model_and_loader(single_process):
    model, plain = tr.make_model(), tr.make_loader()
    h = harden(model, plain, {"health": {"hang_timeout": 30}})
    try:
        assert isinstance(h, Hardened) and not dist.is_initialized()
        assert h.model is model and not h.init_report.distributed and h.checkpointer is None
        again_model, loader = h  # the drop-in shape
        assert again_model is model and isinstance(loader, SafeDataLoader)
        torch.manual_seed(3)
        mine = [b[1].tolist() for b in loader]
        torch.manual_seed(3)
        theirs = [b[1].tolist() for b in plain]
        assert mine == theirs  # same batches, same order
        assert h.guard.agreement == "local" and h.guard.divergence_interval is None
    finally:
        h.close()
    assert not h.watchdog._thread.is_alive()
    h.close()  # idempotent


def test_single_process_trains_checkpoints_and_resumes_bit_identically(single_process, tmp_path):
    cfg = {"checkpoint": {"dir": str(tmp_path / "ckpt"), "every_n_steps": 5}, "health": {"hang_timeout": None}}
    # straight through, 17 steps (48 samples / 4 = 12 batches per epoch: crosses an epoch boundary)
    with harden(tr.make_model(), tr.make_loader(), {"health": {"hang_timeout": None}}) as ref:
        opt = torch.optim.SGD(ref.model.parameters(), lr=0.1, momentum=0.9)
        tr.loop(ref, opt, 17)
        expected = tr.state_of(ref.model)
    # interrupted after step 13 (the last checkpoint is step 10, mid-epoch), then resumed in a new harden()
    with harden(tr.make_model(), tr.make_loader(), cfg) as first:
        opt = torch.optim.SGD(first.model.parameters(), lr=0.1, momentum=0.9)
        assert first.resume(optimizer=opt) is None
        tr.loop(first, opt, 13)
        assert first.checkpointer.steps() == [5, 10]
    with harden(tr.make_model(seed=99), tr.make_loader(), cfg) as second:
        opt = torch.optim.SGD(second.model.parameters(), lr=0.1, momentum=0.9)
        torch.manual_seed(12345)  # the checkpoint's RNG state must win
        step = second.resume(optimizer=opt)
        assert step == 10
        tr.loop(second, opt, 17, start=step)
        assert tr.bitwise_equal(tr.state_of(second.model), expected)


def test_save_only_on_its_steps_and_force_needs_a_directory(single_process, tmp_path):
    with harden(tr.make_model(), None, {"health": {"hang_timeout": None}}) as h:
        assert h.loader is None
        assert h.save(10) is None  # no directory: nothing to do
        with pytest.raises(ConfigError, match=r"save\(force=True\).*checkpoint.dir is None.*Fix: set checkpoint.dir"):
            h.save(3, force=True)
        assert h.resume() is None
    cfg = {"checkpoint": {"dir": str(tmp_path), "every_n_steps": 4}, "health": {"hang_timeout": None}}
    with harden(tr.make_model(), tr.make_loader(), cfg) as h:
        assert h.save(3) is None
        assert h.save(4).step == 4
        assert h.save(5, force=True, note={"a": 1}).step == 5
        assert h.checkpointer.steps() == [4, 5]


def test_config_forms_and_bad_config(single_process, tmp_path):
    (tmp_path / "cfg.yaml").write_text("health:\n  hang_timeout: null\n  nan_policy: warn\n")
    with harden(tr.make_model(), tr.make_loader(), tmp_path / "cfg.yaml") as h:
        assert h.config.health.nan_policy == "warn" and h.watchdog is None
    with pytest.raises(ConfigError, match="nan_policy"):
        harden(tr.make_model(), tr.make_loader(), {"health": {"nan_policy": "explode"}})


# ---------------------------------------------------------------------------------------------- 2 real ranks
def _hardened_run(rank):
    h = harden(tr.make_model(), tr.make_loader(), {"health": {"hang_timeout": 60, "interval_steps": 4}})
    opt = torch.optim.SGD(h.model.parameters(), lr=0.1, momentum=0.9)
    actions = tr.loop(h, opt, 14)
    out = (tr.state_of(h.model), type(h.model) is DistributedDataParallel, h.init_report.created,
           h.guard.agreement, {a for _, a in actions})
    h.close()
    return out + (dist.is_initialized(),)


def _manual_run(rank):
    cfg = {"health": {"hang_timeout": 60}}
    report = safe_init_process_group(cfg)
    model = wrap_ddp(tr.make_model(), cfg)
    loader = safe_dataloader(tr.make_loader(), cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tr.loop(tr.Plain(model, loader), opt, 14, guard=False)
    state = tr.state_of(model)
    destroy_process_group_if_owned(report)  # safe_init_process_group's pair: a plain destroy_process_group() here,
    return state, report.created  # then the return that frees the DDP model, can hang in torch's group destructor


@pytest.mark.processes
def test_harden_trains_exactly_like_the_parts_composed_by_hand():
    hardened = run_ranks(_hardened_run, 2, init=False, timeout=120)
    manual = run_ranks(_manual_run, 2, init=False, timeout=120)
    for rank in range(2):
        state, is_ddp, created, agreement, actions, still_initialised = hardened[rank]
        assert is_ddp and created and agreement == "gradients" and actions == {"ok"} and not still_initialised
        assert tr.bitwise_equal(state, manual[rank][0])
    assert tr.bitwise_equal(hardened[0][0], hardened[1][0])


def _existing_group(rank):
    h = harden(tr.make_model(), tr.make_loader(), {"health": {"hang_timeout": None}})
    created = h.init_report.created
    h.close()
    return created, dist.is_initialized()


@pytest.mark.processes
def test_an_existing_group_is_used_and_left_alone():
    assert run_ranks(_existing_group, 2, timeout=60) == [(False, True), (False, True)]


def _full(model):
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v.detach().clone()
            for k, v in model.state_dict().items()}


def _fsdp_cfg(directory):
    return {"distributed": {"strategy": "fsdp"}, "health": {"hang_timeout": 60},
            "checkpoint": {"dir": directory, "every_n_steps": 3}}


def _fsdp_train(rank, directory):
    from torch.distributed.fsdp import FSDPModule

    cfg = _fsdp_cfg(directory)
    with pytest.raises(ConfigError, match="fully_shard replaces the model.s parameters.*Fix: h = harden"):
        harden(tr.make_model(), tr.make_loader(), cfg, optimizer=torch.optim.SGD(tr.make_model().parameters(), lr=1))
    h = harden(tr.make_model(), tr.make_loader(), cfg)
    h.optimizer = torch.optim.SGD(h.model.parameters(), lr=0.1, momentum=0.9)
    actions = tr.loop(h, h.optimizer, 6)
    out = (isinstance(h.model, FSDPModule), h.guard.agreement, h.guard.divergence_interval, {a for _, a in actions},
           _full(h.model))
    h.close()
    return out


def _fsdp_resume(rank, directory):
    h = harden(tr.make_model(seed=5), tr.make_loader(), _fsdp_cfg(directory))  # other weights, then the checkpoint
    h.optimizer = torch.optim.SGD(h.model.parameters(), lr=0.1, momentum=0.9)
    resumed = h.resume()
    restored = _full(h.model)
    h.close()
    return resumed, restored


@pytest.mark.processes
def test_fsdp_strategy_shards_trains_with_the_allreduce_guard_and_resumes(fsdp_cpu, tmp_path):
    trained = run_ranks(_fsdp_train, 2, args=(str(tmp_path),), init=False, timeout=120)
    resumed = run_ranks(_fsdp_resume, 2, args=(str(tmp_path),), init=False, timeout=120)
    for rank in range(2):
        assert trained[rank][:4] == (True, "allreduce", None, {"ok"})
        assert resumed[rank][0] == 6 and tr.bitwise_equal(trained[rank][4], resumed[rank][1])


# ---------------------------------------------------------------------------------------------- the demo
@pytest.mark.processes
@pytest.mark.timeout(240)
def test_demo_resumes_bit_identically_after_a_real_sigkill_under_torchrun(tmp_path):
    work = tmp_path / "demo"  # empty, as `make demo` leaves it (rm -rf): the script itself never deletes anything
    work.mkdir()
    (work / "mine.txt").write_text("the user's file")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                "--max-restarts=1"]
    proc = subprocess.run([*torchrun, str(ROOT / "examples" / "resilient_training.py"), "--workdir", str(work),
                           "--steps", "40", "--every", "8", "--kill-step", "21"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=220)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    fault = json.loads((work / "fault.json").read_text())
    assert {k: fault[k] for k in ("rank", "step", "signal")} == {"rank": 1, "step": 21, "signal": "SIGKILL"}
    # torchrun saw a worker fail and restarted: it names the first failed worker it polls, which under load can be
    # rank 0 (exit 1: its gloo peer vanished) rather than the SIGKILLed rank 1 (-9); fault.json proves the kill
    assert re.search(r"failed \(exitcode: (-9|1)\) local_rank: [01]", out), out[-4000:]
    assert "resumed from step        16" in out and "torchrun attempts        2" in out
    assert "BITWISE EQUAL" in out
    final = torch.load(work / "final.pt", weights_only=True)
    reference = torch.load(work / "reference.pt", weights_only=True)
    assert tr.bitwise_equal(final, reference)
    assert (work / "saves.log").read_text().split() == ["8", "16", "24", "32", "40"]
    assert (work / "mine.txt").read_text() == "the user's file"  # attempt 0 did not wipe the workdir


@pytest.mark.processes
@pytest.mark.timeout(400)
def test_make_demo_recovers_one_kill_by_torchruns_restart_and_by_robustdist_run_both_bitwise(tmp_path):
    """scripts/demo.py (make demo): the same in-process job straight, under torchrun with rank 1 SIGKILLed at step 21
    (every worker restarted), and under robustdist run with the same kill once the warm spare is ready (only rank 1
    started again, forked from the spare; rank 0 keeps its process). The summary gives both kill-to-next-step times
    and bitwise verdicts and names the logs, which hold the killed rank's output, not the screen."""
    work = tmp_path / "demo"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py"), "--workdir", str(work), "--steps", "30",
                           "--every", "8", "--kill-step", "21", "--timeout", "150"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=380)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:] + "".join(
        (work / f"{n}.log").read_text()[-3000:] for n in ("torchrun", "robustdist") if (work / f"{n}.log").exists())
    gaps = re.findall(r"killed at step +21\n  kill -> next step +([\d.]+) s \(on every rank\)\n  vs the straight run"
                      r" +BITWISE EQUAL\n  wall time, log +[\d.]+ s, (\S+)", out)
    assert [Path(log).name for _, log in gaps] == ["torchrun.log", "robustdist.log"], out
    assert "Traceback" not in out and "SIGKILL" not in proc.stdout.split("==")[0]  # the fault's output is in the logs
    torchrun_log, robustdist_log = ((work / n).read_text() for n in ("torchrun.log", "robustdist.log"))
    assert re.search(r"rank 1 \(local rank 1, pid \d+\) died \(signal 9 \(SIGKILL\)\); started it again alone as pid "
                     r"\d+ \(replacement 1, forked by the warm spare", robustdist_log), robustdist_log[-3000:]
    assert "Stopping worker group" not in robustdist_log and "torchrun attempts        1" in robustdist_log
    assert "torchrun attempts        2" in torchrun_log, torchrun_log[-3000:]
    for rank in (0, 1):  # robustdist run: rank 0 one process throughout, rank 1 two (the killed one, its fork)
        pids = {json.loads(line)["pid"] for line in (work / "robustdist" / f"steps-rank{rank}.jsonl").read_text()
                .splitlines()}
        assert len(pids) == 1 + rank, (rank, pids)
