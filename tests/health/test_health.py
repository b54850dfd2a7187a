"""Health guards: the hang watchdog (single process, 2 real ranks, abort), the step guard's NaN policies on
every rank, its agreements, and the divergence check."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from robustdist import harden
from robustdist.checkpoint import AtomicCheckpointer
from robustdist.health.grad_check import check, grads_finite
from robustdist.health.step_guard import HANG_EXIT_CODE, StepGuard, Watchdog
from robustdist.health.watchdog import HangReport, summarise
from robustdist.runtime.errors import ConfigError, HangError, NonFiniteLossError, RankDivergenceError
from robustdist.testing.ranks import run_ranks
from tests import _training as tr


@pytest.fixture
def single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_PROCID",
                "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


# ---------------------------------------------------------------------------------------------- watchdog
def test_summary_names_the_ranks_behind_and_the_silent_ones():
    now = 1000.0
    records = {0: {"step": 121, "seq": 5, "beat_wall": 990.0}, 1: {"step": 120, "seq": 9, "beat_wall": 390.0,
                                                                  "where": "MainThread in load (data.py:3)"},
               2: {"step": 121, "seq": 5, "beat_wall": 991.0}}
    text = summarise(records, 4, now)
    assert "rank 1 last beat at step 120, 610 s ago, training thread MainThread in load (data.py:3)" in text
    assert "ranks 0, 2 at step 121" in text and "rank 3 never published" in text
    assert "Suspect: ranks 1, 3" in text
    same_step = summarise({0: {"step": 4, "seq": 8, "beat_wall": 999.0}, 1: {"step": 4, "seq": 7, "beat_wall": 990.0}},
                          2, now)
    assert "rank 1 last beat at step 4 (earlier in that step: beat #7 vs #8), 10 s ago; rank 0 at step 4" in same_step
    level = summarise({r: {"step": 4, "seq": 8, "beat_wall": 999.0} for r in (0, 1)}, 2, now)
    assert "no rank is behind" in level and "Suspect" not in level
    assert "never did" in summarise({}, 2, now)


def _stuck_here(seconds):
    time.sleep(seconds)


def test_watchdog_dumps_the_hung_thread_and_rearms(single_process, tmp_path, capfd, caplog):
    caplog.set_level(logging.WARNING, logger="robustdist")
    with Watchdog(1.0, dump_dir=tmp_path) as wd:
        wd.beat(7)
        _stuck_here(1.8)
        assert len(wd.reports) == 1
        report = wd.reports[0]
        assert report.step == 7 and report.idle_seconds >= 1.0 and report.summary is None
        dump = open(report.dump_path).read()
        assert os.path.basename(report.dump_path) == f"hang-rank0-{os.getpid()}.txt"
        assert "had no beat for" in dump and "last step 7" in dump and "in _stuck_here" in dump
        assert "in _stuck_here" in capfd.readouterr().err  # also on stderr
        wd.beat(8)
        time.sleep(0.3)
        assert any("beats resumed at step 8" in r.getMessage() for r in caplog.records)
        for _ in range(5):  # steady beats: no new report
            wd.beat(9)
            time.sleep(0.2)
        assert len(wd.reports) == 1
    assert not wd._thread.is_alive()


def test_watchdog_rejects_bad_settings():
    with pytest.raises(ConfigError, match=r"hang_timeout=0; expected seconds > 0.*health.hang_timeout=None disables"):
        Watchdog(0)
    with pytest.raises(ConfigError, match=r"action='kill'; expected one of \('dump', 'abort'\)"):
        Watchdog(5, action="kill")


@pytest.mark.processes
def test_abort_exits_with_the_documented_code(single_process):
    code = ("import time\nfrom robustdist.health import Watchdog\nw = Watchdog(1.0, action='abort')\nw.beat(3)\n"
            "time.sleep(30)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == HANG_EXIT_CODE == 86
    assert time.monotonic() - start < 20
    assert "had no beat for" in proc.stderr and "exiting with code 86" in proc.stderr


@pytest.mark.processes
@pytest.mark.parametrize("close_in_callback", [True, False], ids=["closed-by-recovery", "left-open"])
def test_a_hang_callback_runs_and_abort_waits_for_it(single_process, close_in_callback):
    """``on_hang`` (in-process recovery's hook) is called with the report; with action="abort" the process exits
    86 only if the watchdog is still open hand_over_grace (2 s) later: a recovery that closes it keeps it alive."""
    code = ("import threading, time\nfrom robustdist.health import Watchdog\n"
            "w = Watchdog(1.0, action='abort', hand_over_grace=2.0)\n"
            "def cb(report):\n    print('callback step', report.step, flush=True)\n"
            f"    {'threading.Timer(0.5, w.close).start()' if close_in_callback else 'pass'}\n"
            "w.on_hang(cb)\nw.beat(3)\ntime.sleep(8)\nprint('alive', flush=True)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert "callback step 3" in proc.stdout, proc.stderr[-2000:]
    if close_in_callback:
        assert proc.returncode == 0 and "alive" in proc.stdout, proc.stderr[-2000:]
    else:
        assert proc.returncode == HANG_EXIT_CODE and "alive" not in proc.stdout
        assert "handed to in-process recovery" in proc.stderr


def _handing_over(rank, waiting_on, stop_after=None, beat_after=None):
    """``Watchdog._abort`` with a hand-over that records when it was called and then stops the watchdog (so
    ``_abort`` returns instead of exiting); ``stop_after``: ``close()`` comes that soon instead; ``beat_after``:
    the training thread beats again that soon."""
    calls = []
    w = Watchdog(10, action="abort", rank=rank, world_size=1, grace=0.5, hand_over_grace=30,
                 hand_over=lambda e: (calls.append((time.monotonic(), e)), w._stop.set())[-1] is None)
    report = HangReport(rank, 4, 10.0, None, "summary", time.time(), waiting_on=waiting_on)
    timers = [threading.Timer(stop_after, w._stop.set)] if stop_after is not None else []
    timers += [threading.Timer(beat_after, w.beat)] if beat_after is not None else []
    for t in timers:
        t.start()
    start = time.monotonic()
    try:
        w._abort(report, "header", "summary", w._seq)
    finally:
        for t in timers:
            t.join()
        w.close()
    return [(t - start, e) for t, e in calls]


def test_a_rank_waiting_on_a_stuck_peer_hands_its_hang_over_after_the_peer(single_process):
    # Inside Ray Train the controller shows the first error it sees: a rank waiting on others (behind it and
    # silent as long) defers by grace + 2 ticks (0.5 + 2 s here), so the stuck rank's error comes first.
    (waited, error), = _handing_over(0, waiting_on=(1,))
    assert waited >= 2.5 and isinstance(error, HangError) and error.rank == 0
    (waited, _), = _handing_over(1, waiting_on=())  # the stuck rank itself (or nobody behind): at once
    assert waited < 1.0
    assert _handing_over(0, waiting_on=(1,), stop_after=0.3) == []  # closed meanwhile: nothing to act on
    assert _handing_over(0, waiting_on=(1,), beat_after=0.3) == []  # beats resumed meanwhile: not a hang any more


def test_the_rank_serving_the_store_exits_after_the_other_ranks_reports(single_process, monkeypatch):
    """With action="abort", a rank whose process serves the store waits before exiting until the other ranks'
    reports (which fire within about two ticks of its own and read the store for at most grace + 0.5 s) are done; a rank
    whose store is served elsewhere (here: a store of another kind, which no socket of this process serves) exits at
    once."""
    from datetime import timedelta

    import torch.distributed as dist

    from robustdist.health import watchdog as wdmod

    served = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    slept, exits = [], []
    monkeypatch.setattr(wdmod.time, "sleep", slept.append)
    monkeypatch.setattr(wdmod.os, "_exit", exits.append)
    for store, lingers in ((served, True), (dist.PrefixStore("x", dist.HashStore()), False)):
        w = Watchdog(10, action="abort", rank=0, world_size=1, grace=0.5, store=store)
        try:
            slept.clear()
            w._fired_at = time.monotonic()
            w._exit()
            assert exits[-1] == HANG_EXIT_CODE
            if lingers:  # 2 ticks of 1 s + grace 0.5 s + 0.5 s after its own hang fired
                assert len(slept) == 1 and 2.9 < slept[0] <= 3.0, slept
            else:
                assert slept == []
            w._fired_at = time.monotonic() - 5  # the reports are long done: no wait
            slept.clear()
            w._exit()
            assert slept == []
        finally:
            w.close()
    del served


def _rec(step, seq, beat_wall):
    return {"step": step, "seq": seq, "beat_wall": beat_wall}


def test_which_ranks_a_rank_waits_on():
    from robustdist.health.watchdog_store import waited_on

    # Rank 1 slept at step 4 (beat #22, t=100); rank 0 beat on in its forward (#24, t=101), then waited.
    alive = {0: _rec(4, 24, 101.0), 1: _rec(4, 22, 100.0)}
    assert waited_on(alive, 0) == (1,) and waited_on(alive, 1) == ()
    # Rank 0 ran extra forwards earlier (ahead by beats) and is the one stuck: its last beat is the earlier one,
    # so it waits on nobody and acts at once, and rank 1 (behind by beats) is not behind it in silence either.
    alive = {0: _rec(4, 30, 100.0), 1: _rec(4, 22, 101.0)}
    assert waited_on(alive, 0) == () and waited_on(alive, 1) == ()
    # Three ranks: rank 2 stuck; rank 1 waits on it; rank 0 waits on both.
    alive = {0: _rec(4, 9, 102.0), 1: _rec(4, 6, 101.0), 2: _rec(4, 5, 100.0)}
    assert waited_on(alive, 2) == () and waited_on(alive, 1) == (2,) and waited_on(alive, 0) == (1, 2)
    assert waited_on({1: _rec(None, 0, 1.0)}, 0) == ()  # this rank's own record missing: nothing known


def _sleep_inside_step(seconds):
    time.sleep(seconds)


def _hang(rank, dump_dir):
    h = harden(tr.make_model(), tr.make_loader(), {"health": {"hang_timeout": 3, "dump_dir": dump_dir}})
    opt = torch.optim.SGD(h.model.parameters(), lr=0.1)
    started = []

    def maybe_sleep(step):
        if rank == 1 and step == 3:
            started.append(time.time())
            _sleep_inside_step(9)

    tr.loop(h, opt, 5, before_backward=maybe_sleep)
    reports = [(r.step, r.summary, r.dump_path, r.detected_at) for r in h.watchdog.reports]
    h.close()
    return started, reports


@pytest.mark.processes
def test_rank_zero_names_the_sleeping_rank_and_its_dump_shows_the_frame(tmp_path):
    out = run_ranks(_hang, 2, args=(str(tmp_path),), init=False, timeout=120)
    slept_at = out[1][0][0]
    zero_reports = out[0][1]
    assert len(zero_reports) == 1
    step, summary, _, detected_at = zero_reports[0]
    assert step == 3 and "rank 1 last beat at step 3" in summary and "Suspect: rank 1." in summary
    assert "MainThread in _sleep_inside_step" in summary
    assert detected_at - slept_at <= 3 + 5
    one_dump = out[1][1][0][2]
    assert os.path.basename(one_dump).startswith("hang-rank1-") and "in _sleep_inside_step" in open(one_dump).read()
    assert summary in open(zero_reports[0][2]).read()


# ---------------------------------------------------------------------------------------------- step guard alone
def test_step_guard_alone_single_process(single_process, tmp_path):
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = StepGuard("raise", model=model)
    assert guard.agreement == "local"
    assert guard(torch.tensor(1.0), 0) and guard(0.5, 1).action == "ok"
    with pytest.raises(NonFiniteLossError, match=r"step 2: a non-finite loss \(nan\); expected finite values.*Fix:"):
        guard(torch.tensor(float("nan")), 2)
    model(torch.ones(1, 2)).sum().backward()
    decision = StepGuard("skip", model=model, optimizer=opt)(float("inf"), 3)
    assert not decision and decision.action == "skip" and model.weight.grad is None
    assert StepGuard("warn")(float("nan"), 4).action == "warn"
    with AtomicCheckpointer(tmp_path) as ckpt:
        ckpt.save(5, {"model": model, "optimizer": opt})
        saved = model.weight.detach().clone()
        with torch.no_grad():
            model.weight.add_(1)
        rolled = StepGuard("rollback", model=model, optimizer=opt, checkpointer=ckpt)(float("nan"), 9)
        assert rolled.rolled_back and rolled.resume_step == 5 and torch.equal(model.weight, saved)


def test_step_guard_rejects_bad_settings(single_process):
    with pytest.raises(ConfigError, match="nan_policy='ignore'; expected one of"):
        StepGuard("ignore")
    with pytest.raises(ConfigError, match="agreement='vote'"):
        StepGuard(agreement="vote")
    with pytest.raises(ConfigError, match="needs a checkpoint to roll back to.*Fix: pass the AtomicCheckpointer"):
        StepGuard("rollback")
    with pytest.raises(NonFiniteLossError, match="found no checkpoint to restore.*Fix: save one before"):
        StepGuard("rollback", restore=_no_checkpoint)(float("nan"), 1)
    for bad, shown in (("no", "'no' (str)"), (0, "0 (int)"), (None, "None (NoneType)")):
        with pytest.raises(ConfigError) as exc:
            StepGuard(check_gradients=bad)
        assert str(exc.value) == (f"check_gradients is {shown}; expected True or False. Fix: pass a bool (with "
                                  "harden(), set health.check_gradients: true or false).")
    with pytest.raises(ConfigError, match=r"agreement='gradients' reads the gradients, but check_gradients=False; "
                                          r"expected one or the other. Fix: drop agreement="):
        StepGuard(agreement="gradients", check_gradients=False)
    assert StepGuard(check_gradients=False).agreement == "local"  # one process: the loss alone either way


def _no_checkpoint():
    from robustdist.runtime.errors import CheckpointCorruptError

    raise CheckpointCorruptError("no valid checkpoint")


# ---------------------------------------------------------------------------------------------- NaN on one rank
def _nan_run(rank, policy, directory, poison_step, always, check_gradients=True):
    cfg = {"health": {"nan_policy": policy, "hang_timeout": 60, "max_rollbacks": 2, "check_gradients": check_gradients},
           "checkpoint": {"dir": directory, "every_n_steps": 4},
           "distributed": {"sync_batchnorm": False}}  # with SyncBN, rank 1's NaN batch would reach rank 0's loss
    h = harden(tr.make_model(), tr.make_loader(), cfg)
    opt = torch.optim.SGD(h.model.parameters(), lr=0.1, momentum=0.9)
    h.resume(optimizer=opt)
    fired = []
    before = {}

    def poison(step, x):
        if rank == 1 and step == poison_step and (always or not fired):
            fired.append(step)
            x = x.clone()
            x[0, 0] = float("nan")
        if step == poison_step:
            before.setdefault("state", tr.state_of(h.model))
        return x

    def after_step(step):
        if step == poison_step + 1:
            before["after"] = tr.state_of(h.model)

    try:
        actions = tr.loop(h, opt, 12, poison=poison, after_step=after_step)
    except NonFiniteLossError as e:
        h.close()
        return "raised", str(e), e.ranks
    final = tr.state_of(h.model)
    h.close()
    return "finished", actions, final, before


def _params(state):
    return {k: v for k, v in state.items() if "running_" not in k and "num_batches" not in k}


def _clean_run(rank, directory):
    return _nan_run(rank, "raise", directory, poison_step=-1, always=False)


@pytest.mark.processes
@pytest.mark.parametrize("policy", ["raise", "skip", "warn"])
def test_nan_on_one_rank_acts_identically_on_every_rank(policy, tmp_path):
    out = run_ranks(_nan_run, 2, args=(policy, str(tmp_path), 6, False), init=False, timeout=120)
    if policy == "raise":
        for rank, (kind, message, ranks) in enumerate(out):
            assert kind == "raised" and ranks == (1,)
            assert message.startswith(f"[rank {rank}] step 6: a non-finite loss on rank 1 (rank 1: nan)")
        return
    for kind, actions, _, _ in out:
        assert kind == "finished"
        flagged = [(s, a) for s, a in actions if a != "ok"]
        if policy == "skip":
            assert flagged == [(6, "skip")]
        else:  # stepping with NaN gradients poisons the weights: every later loss is NaN too, on both ranks
            assert flagged == [(s, "warn") for s in range(6, 12)]
    assert tr.bitwise_equal(_params(out[0][2]), _params(out[1][2]))  # buffers are per rank without SyncBN
    finite = all(torch.isfinite(t).all() for t in out[0][2].values() if t.is_floating_point())
    if policy == "skip":
        assert finite  # the NaN batch changed nothing: not the weights, not BatchNorm's running statistics
        assert tr.bitwise_equal(out[0][3]["state"], out[0][3]["after"])
    else:
        assert not finite  # warn steps with the NaN gradients, as asked


@pytest.mark.processes
def test_nan_on_one_rank_is_caught_on_every_rank_without_reading_gradients(tmp_path):
    out = run_ranks(_nan_run, 2, args=("raise", str(tmp_path), 6, False, False), init=False, timeout=120)
    for rank, (kind, message, ranks) in enumerate(out):
        assert kind == "raised" and ranks == (1,)
        assert message.startswith(f"[rank {rank}] step 6: a non-finite loss on rank 1 (rank 1: nan)")


@pytest.mark.processes
def test_rollback_continues_from_the_checkpoint_and_ends_where_a_clean_run_ends(tmp_path):
    clean = run_ranks(_clean_run, 2, args=(str(tmp_path / "clean"),), init=False, timeout=120)
    rolled = run_ranks(_nan_run, 2, args=("rollback", str(tmp_path / "nan"), 6, False), init=False, timeout=120)
    for rank in range(2):
        kind, actions, final, _ = rolled[rank]
        assert kind == "finished" and (6, "rollback") in actions
        steps = [s for s, _ in actions]
        assert steps[:8] == [0, 1, 2, 3, 4, 5, 6, 4]  # back to the step-4 checkpoint, then on
        assert tr.bitwise_equal(final, clean[rank][2])


@pytest.mark.processes
def test_rollback_gives_up_after_max_rollbacks_of_the_same_step(tmp_path):
    out = run_ranks(_nan_run, 2, args=("rollback", str(tmp_path), 6, True), init=False, timeout=120)
    for kind, message, ranks in out:
        assert kind == "raised" and ranks == (1,)
        assert "again after 2 rollback(s) of this step (health.max_rollbacks)" in message


# ---------------------------------------------------------------------------------------------- agreements
def _allreduce_agreement(rank):
    with pytest.raises(ConfigError, match=r"agreement='gradients' needs the DDP model \(model=\).*Fix: pass model="):
        StepGuard(agreement="gradients")
    model = nn.Linear(2, 1)  # not DDP: the guard agrees with one all-reduce
    guard = StepGuard("skip", model=model)
    ok = guard(torch.tensor(1.0), 0)
    skipped = guard(torch.tensor(float("nan") if rank == 1 else 1.0), 1)
    return guard.agreement, bool(ok), skipped.action, skipped.ranks


@pytest.mark.processes
def test_a_model_without_ddp_agrees_by_all_reduce():
    assert run_ranks(_allreduce_agreement, 2, timeout=60) == [("allreduce", True, "skip", (1,))] * 2


def _finite_gradients(rank):
    h = harden(nn.Linear(3, 1), None, {"health": {"hang_timeout": None}})
    out = h.model(torch.ones(2, 3)).sum()
    out.backward()
    loss = out + (math.inf if rank == 1 else 0.0)  # non-finite, but no gradient depends on it
    decision = h.step_guard(loss, 0)
    h.close()
    return h.guard.agreement, decision.action


@pytest.mark.processes
def test_gradients_agreement_lets_a_non_finite_loss_with_finite_gradients_pass():
    assert run_ranks(_finite_gradients, 2, init=False, timeout=60) == [("gradients", "ok")] * 2


def _three_cases(rank, check_gradients):
    """Under nan_policy 'skip': (0) a finite loss whose gradients overflow on every rank (as DDP's all-reduce
    hands them out), (1) a NaN loss on rank 1 that reaches the gradients, (2) a NaN loss on rank 1 that does not."""
    h = harden(nn.Linear(3, 1), None, {"health": {"hang_timeout": None, "nan_policy": "skip",
                                                  "check_gradients": check_gradients}})
    decisions = []
    try:
        for step in range(3):
            x = torch.ones(2, 3)
            if step == 1 and rank == 1:
                x[0, 0] = math.nan
            out = h.model(x).sum()
            out.backward()
            if step == 0:
                with torch.no_grad():
                    h.model.module.weight.grad[0, 1] = math.inf
            loss = out + (math.nan if step == 2 and rank == 1 else 0.0)
            decision = h.step_guard(loss, step)
            decisions.append((decision.action, decision.ranks))
            h.model.zero_grad(set_to_none=True)
    finally:
        h.close()
    return h.guard.agreement, decisions


@pytest.mark.processes
def test_check_gradients_false_agrees_on_the_losses_and_lets_a_finite_loss_overflow_through():
    reading = run_ranks(_three_cases, 2, args=(True,), init=False, timeout=60)
    assert reading == [("gradients", [("skip", ()), ("skip", (1,)), ("ok", ())])] * 2
    losses_only = run_ranks(_three_cases, 2, args=(False,), init=False, timeout=60)
    assert losses_only == [("allreduce", [("ok", ()), ("skip", (1,)), ("skip", (1,))])] * 2


# ---------------------------------------------------------------------------------------------- divergence
def _diverge(rank):
    h = harden(tr.make_model(), tr.make_loader(), {"health": {"interval_steps": 5, "hang_timeout": 60}})
    opt = torch.optim.SGD(h.model.parameters(), lr=0.1)

    def perturb(step):
        if step == 7 and rank == 1:
            with torch.no_grad():
                h.model.module[4].bias[0] += 1e-3

    try:
        tr.loop(h, opt, 14, after_step=perturb)
    except RankDivergenceError as e:
        return str(e), e.ranks
    finally:
        h.close()
    return None


@pytest.mark.processes
def test_divergence_is_detected_at_the_next_interval_on_every_rank():
    for rank, (message, ranks) in enumerate(run_ranks(_diverge, 2, init=False, timeout=120)):
        assert message.startswith(f"[rank {rank}] step 10: ") and "4.bias" in message and ranks == (1,)


def _no_gradients(rank):
    h = harden(nn.Linear(3, 1), None, {"health": {"hang_timeout": None}})
    try:
        h.step_guard(torch.tensor(1.0), 0)
    except ConfigError as e:
        return str(e)
    finally:
        h.close()
    return None


@pytest.mark.processes
def test_calling_the_guard_before_backward_is_a_clear_error():
    for message in run_ranks(_no_gradients, 2, init=False, timeout=60):
        assert "found no gradients on the model; expected it to be called after backward()" in message
        assert "Fix: move the call" in message


@pytest.mark.parametrize("method", ["per_tensor", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gradient_check_finds_every_kind_of_non_finite_value(method, dtype):
    layers = [nn.Linear(4, 3).to(dtype), nn.Linear(3, 2).to(dtype)]
    params = [p for layer in layers for p in layer.parameters()]
    for p in params:
        p.grad = torch.ones_like(p)
    assert grads_finite(params, method=method)
    for bad in (float("nan"), float("inf"), float("-inf")):
        params[2].grad[1, 2] = bad
        assert not grads_finite(params, method=method), bad
        params[2].grad.fill_(1)
    params[0].grad[0, 0], params[3].grad[0] = float("inf"), float("-inf")  # they would cancel in a careless sum
    assert not grads_finite(params, method=method)
    params[1].grad = None  # a parameter without a gradient (unused this step) is skipped
    params[0].grad.fill_(1), params[3].grad.fill_(1)
    assert grads_finite(params, method=method)
    with pytest.raises(ConfigError, match="no gradients"):
        grads_finite([nn.Parameter(torch.ones(2))], method=method)
    with pytest.raises(ConfigError, match=r"method='stacked'; expected one of \('per_tensor', 'fused'\)"):
        grads_finite(params, method="stacked")


# ---------------------------------------------------------------------------------------------- the fused check
MIXED = (torch.float32, torch.bfloat16, torch.float16, torch.float32, torch.bfloat16, torch.float16)
SIZES = (1, 7, 33, 64, 257, 1000)  # shorter and longer than a vector register, with and without a tail


def _mixed_grads(dtypes=MIXED, sizes=SIZES) -> list[nn.Parameter]:
    params = []
    for i, (dtype, n) in enumerate(zip(dtypes, sizes)):
        p = nn.Parameter(torch.zeros(n, dtype=dtype))
        p.grad = (torch.randn(n, generator=torch.Generator().manual_seed(i)) * 100).to(dtype)
        params.append(p)
    return params


def test_fused_check_finds_nan_and_inf_in_any_one_tensor_of_mixed_dtypes():
    params = _mixed_grads()
    assert check(torch.tensor(0.5), params, method="fused") == (True, True)
    for i, p in enumerate(params):
        for where in {0, p.numel() // 2, p.numel() - 1}:
            for bad in (math.nan, math.inf, -math.inf):
                kept = p.grad[where].clone()
                p.grad[where] = bad
                assert not grads_finite(params, method="fused"), (i, p.dtype, where, bad)
                assert check(torch.tensor(1.0), params, method="fused") == (True, False)
                p.grad[where] = kept
    assert grads_finite(params, method="fused")
    assert check(torch.tensor(math.nan), params, method="fused") == (False, True)  # the loss, read in the same sync
    assert check(torch.tensor([1.0, -math.inf]), params, method="fused") == (False, True)
    assert check(math.inf, params, method="fused") == (False, True)  # a Python float needs no device read


_SYNCS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu", "to")


def _count_host_reads(monkeypatch) -> list[str]:
    """Every call that can copy a tensor's value to the host (a host sync on an accelerator), counted.
    ``to`` is counted only for a move to the CPU."""
    seen: list[str] = []
    for name in _SYNCS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            to_host = _name != "to" or any(str(a) == "cpu" for a in (*args, *kwargs.values()))
            if to_host:
                seen.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return seen


@pytest.mark.parametrize("bad", [None, "grad", "loss"])
def test_fused_check_reads_the_host_once_per_step(monkeypatch, bad):
    params = _mixed_grads()
    loss = torch.tensor(math.nan if bad == "loss" else 0.25)
    if bad == "grad":
        params[4].grad[3] = math.inf
    seen = _count_host_reads(monkeypatch)
    assert check(loss, params, method="fused") == (bad != "loss", bad != "grad")
    assert seen == ["tolist"]  # the gradients' flag and the loss's, together
    seen.clear()
    assert grads_finite(params, method="fused") == (bad != "grad")
    assert seen == ["item"]
    seen.clear()
    grads_finite(params, method="per_tensor")
    assert len(seen) == len(params)  # the CPU method reads one float per tensor: free on the CPU


def test_fused_check_leaves_finite_gradients_bit_for_bit():
    """The op it runs is GradScaler's unscale with an inverse scale of 1.0: in place, but it must write back
    exactly what it read, for every finite bit pattern (subnormals, -0.0, the largest finite values)."""
    params = []
    for dtype, bits in ((torch.float16, torch.int16), (torch.bfloat16, torch.int16), (torch.float32, torch.int32)):
        every = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16) if bits == torch.int16 else \
            torch.randint(-2**31, 2**31 - 1, (1 << 16,), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
        values = every.view(dtype)
        finite = values[torch.isfinite(values)]
        finfo = torch.finfo(dtype)
        extremes = torch.tensor([0.0, -0.0, finfo.max, -finfo.max, finfo.tiny, finfo.smallest_normal / 4], dtype=dtype)
        grad = torch.cat([finite, extremes])
        p = nn.Parameter(torch.zeros_like(grad))
        p.grad = grad
        params.append(p)
    before = [(p.grad.data_ptr(), p.grad.clone()) for p in params]
    assert grads_finite(params, method="fused")
    for p, (ptr, saved) in zip(params, before):
        assert p.grad.data_ptr() == ptr and tr.bitwise_equal({"g": p.grad}, {"g": saved}), p.grad.dtype


def test_fused_check_falls_back_where_the_fused_op_is_missing(monkeypatch):
    params = _mixed_grads()
    overlapping = nn.Parameter(torch.zeros(4))
    overlapping.grad = torch.ones(1).expand(4)  # the in-place op refuses elements sharing memory
    assert grads_finite([*params, overlapping], method="fused")
    overlapping.grad = torch.tensor([math.nan]).expand(4)
    assert not grads_finite([*params, overlapping], method="fused")

    def missing(*args):
        raise NotImplementedError("no kernel for this backend")

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", missing)
    assert grads_finite(params, method="fused")
    params[1].grad[0] = -math.inf
    seen = _count_host_reads(monkeypatch)
    assert check(torch.tensor(1.0), params, method="fused") == (True, False) and seen == ["tolist"]


def test_a_kernel_that_clears_the_flag_cannot_erase_an_earlier_groups_nan(monkeypatch):
    """Review finding: an early MPS kernel set found_inf to 0 on each call; with one shared flag, a NaN in the
    first (device, dtype) group was erased by the second call. Every group now has its own flag."""
    real = torch._amp_foreach_non_finite_check_and_unscale_

    def clearing(grads, found_inf, inv_scale):
        found_inf.zero_()  # what that kernel did first
        real(grads, found_inf, inv_scale)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", clearing)
    params = _mixed_grads()  # several dtypes: several groups on one device
    params[0].grad[0] = math.nan  # in the first group
    assert not grads_finite(params, method="fused")


def test_the_fused_op_missing_from_torch_falls_back(monkeypatch):
    monkeypatch.delattr(torch, "_amp_foreach_non_finite_check_and_unscale_")
    params = _mixed_grads()
    assert grads_finite(params, method="fused")
    params[-1].grad[0] = math.inf
    assert not grads_finite(params, method="fused")


def test_one_gradient_off_the_cpu_chooses_the_fused_method(monkeypatch):
    """The method is chosen from every gradient, not the first: one accelerator gradient among CPU ones must
    not make the per-tensor path read each accelerator tensor to the host."""
    from robustdist.health import grad_check as _grad_check

    params = _mixed_grads()
    seen = []
    monkeypatch.setattr(_grad_check, "_fused_flag", lambda grads: seen.append(len(grads)) or torch.zeros(1))
    _grad_check.check(torch.tensor(1.0), params)
    assert seen == []  # all on the CPU: per tensor
    meta = nn.Parameter(torch.zeros(2, device="meta"))
    meta.grad = torch.zeros(2, device="meta")  # stands in for an accelerator's tensor (no GPU here)
    _grad_check.check(torch.tensor(1.0), [*params, meta])
    assert seen == [len(params) + 1]


@pytest.mark.parametrize("method", ["per_tensor", "fused"])
def test_sparse_and_complex_gradients_are_checked_through_every_value(method):
    sparse = nn.Parameter(torch.zeros(4, 3))
    sparse.grad = torch.sparse_coo_tensor([[0, 2], [1, 1]], [1.0, 2.0], (4, 3), check_invariants=True)
    cplx = nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    cplx.grad = torch.ones(3, dtype=torch.complex64)
    assert grads_finite([sparse, cplx], method=method)
    cplx.grad[1] = complex(1.0, math.nan)  # only the imaginary part: a sum cast to real would lose it
    assert not grads_finite([sparse, cplx], method=method)
    cplx.grad[1] = 1
    sparse.grad = torch.sparse_coo_tensor([[0, 2], [1, 1]], [1.0, math.inf], (4, 3), check_invariants=True)
    assert not grads_finite([sparse, cplx], method=method)


_DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])
_SPECIAL = st.sampled_from([math.nan, math.inf, -math.inf])
# values whose float32 sums cannot overflow, so the per-tensor sums and the fused check must agree exactly
_MODEST = st.lists(st.one_of(st.floats(-1e4, 1e4), _SPECIAL), min_size=1, max_size=80)
# any float32 value: huge finite ones too, where only the fused check is exact
_ANY = st.lists(st.floats(width=32), min_size=1, max_size=80)


def _as_params(tensors: list[tuple[torch.dtype, list[float]]]) -> list[nn.Parameter]:
    params = []
    for dtype, values in tensors:
        p = nn.Parameter(torch.zeros(len(values), dtype=dtype))
        p.grad = torch.tensor(values, dtype=torch.float32).to(dtype)
        params.append(p)
    return params


def _truth(params: list[nn.Parameter]) -> bool:
    return all(bool(torch.isfinite(p.grad).all()) for p in params)


@settings(max_examples=300)
@given(st.lists(st.tuples(_DTYPES, _MODEST), min_size=1, max_size=6))
def test_fused_and_per_tensor_checks_agree(tensors):
    params = _as_params(tensors)
    fused = grads_finite(params, method="fused")
    assert fused == grads_finite(params, method="per_tensor") == _truth(params)


@settings(max_examples=300)
@given(st.lists(st.tuples(_DTYPES, _ANY), min_size=1, max_size=6))
def test_fused_check_is_exact_on_any_values(tensors):
    params = _as_params(tensors)
    assert grads_finite(params, method="fused") == _truth(params)
    if not grads_finite(params, method="per_tensor"):  # a huge finite sum overflows: only ever a false alarm
        return
    assert _truth(params)
