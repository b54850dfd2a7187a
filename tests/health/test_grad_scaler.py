"""The step guard beside an fp16 ``torch.amp.GradScaler`` loop (nanoGPT's path on GPUs without bf16), run on the
CPU with fp16 autocast: an overflow is the scaler's business, a non-finite loss still follows ``nan_policy``, and
skip/rollback leave ``scaler.update()`` working."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from robustdist import harden
from robustdist.health.step_guard import StepGuard
from robustdist.runtime.errors import ConfigError, NonFiniteLossError
from robustdist.testing.ranks import run_ranks
from tests import _training as tr

STEPS = 12
HUGE = 2.0 ** 40  # fp16's largest finite value is 65504: the first backward passes overflow at this scale


@pytest.fixture
def single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_PROCID",
                "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(7)
    return DataLoader(TensorDataset(torch.randn(96, 8, generator=g), torch.randint(0, 4, (96,), generator=g)),
                      batch_size=4, shuffle=False)


def _scaler(init_scale: float = HUGE, enabled: bool = True) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=init_scale, enabled=enabled)


def _fp16_loop(model, loader, opt, scaler, guard=None, *, steps=STEPS, poison=None, clip=False, pass_scaler=True):
    """nanoGPT's inner loop in fp16: autocast forward, scaled backward, (unscale_ and clip), guard, scaler.step
    when the decision says so, scaler.update every step. Returns (step, action, scale after update) per step."""
    out = []
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        if poison is not None:
            x = poison(step, x)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        decision = True if guard is None else guard(loss, step, scaler=scaler) if pass_scaler else guard(loss, step)
        if decision:
            scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        out.append((step, getattr(decision, "action", "ok"), scaler.get_scale()))
    return out


def _plain_run(steps=STEPS):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    trace = _fp16_loop(model, _loader(), opt, _scaler(), steps=steps)
    return trace, tr.state_of(model)


def test_an_overflow_is_left_to_the_scaler_and_the_run_equals_the_plain_loop_bitwise(single_process, caplog):
    caplog.set_level(logging.INFO, logger="robustdist")
    plain_trace, plain_state = _plain_run()
    backoffs = sum(1 for (_, _, before), (_, _, after) in zip([(0, "", HUGE)] + plain_trace, plain_trace)
                   if after < before)
    assert backoffs >= 3  # the premise: the scaler itself skipped several steps

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = _scaler()
    h = harden(model, _loader(), {"health": {"hang_timeout": None}}, optimizer=opt, scaler=scaler)  # "raise"
    trace = _fp16_loop(h.model, _loader(), opt, scaler, h.step_guard, pass_scaler=False)  # harden's scaler
    h.close()
    assert [s for _, _, s in trace] == [s for _, _, s in plain_trace]
    assert tr.bitwise_equal(tr.state_of(h.model), plain_state)
    overflowed = [step for step, action, _ in trace if action == "overflow"]
    assert len(overflowed) == backoffs == h.guard.overflows
    assert all(a in ("ok", "overflow") for _, a, _ in trace)
    logged = [_text(r) for r in caplog.records if "in a row" in r.getMessage()]
    assert len(logged) == backoffs  # one line per overflow: INFO, or the WARNING of a long streak
    assert logged[0].startswith(f"step 0: gradients overflowed at GradScaler scale {HUGE:g} while every loss was "
                                "finite: the scaler skips this optimizer step and lowers the scale (1 in a row)")


def _text(record: logging.LogRecord) -> str:
    """The message without the ``[rank r/w] `` prefix robustdist's logger adds."""
    return record.getMessage().split("] ", 1)[1]


def _poison_at(bad_step):
    def poison(step, x):
        if step == bad_step:
            x = x.clone()
            x[0, 0] = math.nan
        return x
    return poison


@pytest.mark.parametrize("clip", [False, True], ids=["no-clip", "unscale-and-clip"])
def test_a_nan_loss_under_skip_skips_the_step_and_scaler_update_still_works(single_process, clip):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = _scaler(init_scale=2.0 ** 8)  # no overflow: the NaN is the only bad step
    guard = StepGuard("skip", model=model, optimizer=opt, scaler=scaler)
    seen = {}

    def poison(step, x):
        if step == 5:
            seen["before"] = tr.state_of(model)
        if step == 6:
            seen["after"] = tr.state_of(model)
        return _poison_at(5)(step, x)

    trace = _fp16_loop(model, _loader(), opt, scaler, guard, poison=poison, clip=clip, pass_scaler=False)
    assert [(s, a) for s, a, _ in trace if a != "ok"] == [(5, "skip")]
    assert trace[5][2] == trace[4][2] * 0.5  # update() found the recorded check and backed off, as for an overflow
    assert tr.bitwise_equal(seen["before"], seen["after"])  # the NaN step changed no weight
    assert guard.overflows == 0


def test_a_nan_loss_with_a_scaler_still_raises_under_the_default_policy(single_process):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = StepGuard(model=model, optimizer=opt)
    with pytest.raises(NonFiniteLossError, match=r"^step 3: a non-finite loss \(nan\); expected finite values"):
        _fp16_loop(model, _loader(), opt, _scaler(init_scale=2.0 ** 8), guard, poison=_poison_at(3))


def test_overflows_in_a_row_warn_every_overflow_warn_after(single_process, caplog):
    caplog.set_level(logging.INFO, logger="robustdist")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = StepGuard(model=model, optimizer=opt, overflow_warn_after=3)
    scaler = _scaler(init_scale=2.0 ** 120)  # overflows long enough to warn twice
    trace = _fp16_loop(model, _loader(), opt, scaler, guard, steps=7)
    assert [a for _, a, _ in trace] == ["overflow"] * 7 and guard.overflows == 7
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "in a row skipped" in r.getMessage()]
    assert [_text(r).split(":")[0] for r in warned] == ["step 2", "step 5"]
    assert "3 optimizer steps in a row skipped by the GradScaler" in warned[0].getMessage()
    assert "6 optimizer steps in a row" in warned[1].getMessage()


def test_a_disabled_scaler_counts_as_none_and_a_wrong_object_is_refused(single_process):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = StepGuard(model=model, optimizer=opt)
    trace = _fp16_loop(model, _loader(), opt, _scaler(enabled=False), guard, steps=3)  # bf16-style: no scaling
    assert [a for _, a, _ in trace] == ["ok"] * 3
    with pytest.raises(ConfigError, match=r"scaler= is .*which has no is_enabled, unscale_, get_scale, step, update; "
                                          r"expected a torch.amp.GradScaler"):
        StepGuard(scaler=object())
    with pytest.raises(ConfigError, match=r"overflow_warn_after is 0 \(int\); expected an integer >= 1"):
        StepGuard(overflow_warn_after=0)
    with pytest.raises(ConfigError, match=r"health.scaler_overflow_warn_after"):
        harden(_model(), None, {"health": {"scaler_overflow_warn_after": 0, "hang_timeout": None}})


def test_skip_with_a_scaler_needs_the_optimizer(single_process):
    model = _model()
    guard = StepGuard("skip", model=model, scaler=_scaler(init_scale=2.0 ** 8))
    with pytest.raises(ConfigError, match=r"nan_policy='skip' with a GradScaler needs the optimizer"):
        _fp16_loop(model, _loader(), torch.optim.SGD(model.parameters(), lr=0.05), guard.scaler, guard,
                   poison=_poison_at(1))


def test_rollback_restores_the_scaler_with_the_checkpoint_and_resume_restores_it_too(single_process, tmp_path):
    cfg = {"health": {"hang_timeout": None, "nan_policy": "rollback"},
           "checkpoint": {"dir": str(tmp_path), "every_n_steps": 4}}
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = _scaler(init_scale=2.0 ** 16)
    h = harden(model, None, cfg, optimizer=opt, scaler=scaler)
    data = list(_loader())
    scales, actions, step, poisoned = {}, [], 0, False
    while step < 10:
        x, y = data[step]
        if step == 6 and not poisoned:
            poisoned = True
            x = _poison_at(6)(6, x)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(h.model(x), y)
        scaler.scale(loss).backward()
        decision = h.step_guard(loss, step)
        if decision:
            scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        actions.append((step, decision.action))
        if decision.rolled_back:
            step = decision.resume_step
            continue
        step += 1
        h.save(step)
        scales[step] = scaler.get_scale()
    h.close()
    assert (6, "rollback") in actions and [s for s, _ in actions][6:8] == [6, 4]
    saved_at_4 = scales[4]
    assert h.last_loaded.step == 4 and "grad_scaler" in h.last_loaded.manifest["entries"]
    # the rollback put back step 4's scale; the loop's update() then backed it off once (the recorded bad step)
    assert scales[5] == saved_at_4 * 0.5

    fresh_scaler, model2 = _scaler(init_scale=1.0), _model()
    h2 = harden(model2, None, cfg, optimizer=torch.optim.SGD(model2.parameters(), lr=0.05), scaler=fresh_scaler)
    assert h2.resume() == 8
    h2.close()
    assert fresh_scaler.get_scale() == scales[8]


# ---------------------------------------------------------------------------------------------- two ranks
def _ranks_fp16(rank, policy, check_gradients, nan_step, give_scaler=True):
    cfg = {"health": {"nan_policy": policy, "hang_timeout": 60, "check_gradients": check_gradients},
           "distributed": {"sync_batchnorm": False}}
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = _scaler()
    h = harden(model, _loader(), cfg, optimizer=opt, scaler=scaler if give_scaler else None)

    def poison(step, x):
        return _poison_at(nan_step)(step, x) if rank == 1 else x

    try:
        trace = _fp16_loop(h.model, h.loader, opt, scaler, h.step_guard, poison=poison, pass_scaler=False)
    except NonFiniteLossError as e:
        return "raised", str(e), e.ranks
    finally:
        h.close()
    return "finished", h.guard.agreement, trace, tr.state_of(h.model), h.guard.overflows


def _ranks_plain(rank):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data.distributed import DistributedSampler

    model = DDP(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = _loader()
    sampler = DistributedSampler(loader.dataset, shuffle=False)
    trace = _fp16_loop(model, DataLoader(loader.dataset, batch_size=4, sampler=sampler), opt, _scaler())
    return trace, tr.state_of(model)


@pytest.fixture(scope="module")
def plain_ddp_run() -> list:
    """The plain DDP + GradScaler loop on two ranks (no robustdist): each rank's trace and final state, the
    reference both cases below compare with."""
    return run_ranks(_ranks_plain, 2, timeout=120)


@pytest.mark.processes
@pytest.mark.xdist_group("grad_scaler_plain_ddp")  # one worker makes the reference run both cases read
@pytest.mark.parametrize("check_gradients", [True, False], ids=["gradients", "allreduce"])
def test_two_ranks_leave_overflows_to_the_scaler_and_agree_on_a_nan_loss(check_gradients, plain_ddp_run):
    plain = plain_ddp_run
    assert plain[0][0] == plain[1][0]
    clean = run_ranks(_ranks_fp16, 2, args=("raise", check_gradients, -1), init=False, timeout=120)
    for rank, (kind, agreement, trace, state, overflows) in enumerate(clean):
        assert kind == "finished" and agreement == ("gradients" if check_gradients else "allreduce")
        assert [s for _, _, s in trace] == [s for _, _, s in plain[rank][0]]
        assert tr.bitwise_equal(state, plain[rank][1])
        if check_gradients:
            assert overflows == sum(a == "overflow" for _, a, _ in trace) >= 3
        else:  # the losses alone decide: no gradient is read, so the scaler skips its overflows uncounted
            assert overflows == 0 and {a for _, a, _ in trace} == {"ok"}
    raised = run_ranks(_ranks_fp16, 2, args=("raise", check_gradients, 7), init=False, timeout=120)
    for rank, (kind, message, ranks) in enumerate(raised):
        assert kind == "raised" and ranks == (1,)
        assert message.startswith(f"[rank {rank}] step 7: a non-finite loss on rank 1 (rank 1: nan)")
    skipped = run_ranks(_ranks_fp16, 2, args=("skip", check_gradients, 7), init=False, timeout=120)
    traces = [out[2] for out in skipped]
    assert traces[0] == traces[1] and [(s, a) for s, a, _ in traces[0] if a == "skip"] == [(7, "skip")]
    assert tr.bitwise_equal(skipped[0][3], skipped[1][3])
    assert all(torch.isfinite(t).all() for t in skipped[0][3].values())


@pytest.mark.processes
def test_without_the_scaler_a_ddp_overflow_is_a_bad_step_and_the_error_says_to_pass_it():
    out = run_ranks(_ranks_fp16, 2, args=("raise", True, -1, False), init=False, timeout=120)
    for rank, (kind, message, ranks) in enumerate(out):
        assert kind == "raised" and ranks == ()
        assert message.startswith(f"[rank {rank}] step 0: non-finite gradients while every rank's loss was finite")
        assert "pass it (h.step_guard(loss, step, scaler=scaler), or harden(..., scaler=scaler))" in message


def test_non_finite_gradients_past_the_scale_floor_are_a_bad_step_not_an_overflow(single_process):
    """A NaN in an earlier micro-step (the guard sees the last micro-step's finite loss) looks like an overflow;
    once the scale is below 1 no overflow explains it, and nan_policy applies."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = _scaler(init_scale=4.0)
    guard = StepGuard(model=model, optimizer=opt, scaler=scaler)
    data = list(_loader())
    actions = []
    with pytest.raises(NonFiniteLossError) as exc:
        for step in range(8):
            for micro, (x, y) in enumerate(data[2 * step:2 * step + 2]):
                if micro == 0:
                    x = _poison_at(0)(0, x)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.cross_entropy(model(x), y) / 2
                scaler.scale(loss).backward()
            decision = guard(loss, step)
            actions.append(decision.action)
            if decision:
                scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    assert actions == ["overflow"] * 3  # scales 4, 2, 1: the scaler's business; then 0.5 is below the floor
    assert str(exc.value).startswith("step 3: gradients still non-finite at GradScaler scale 0.5, below 1, after 3 "
                                     "overflows in a row, with every loss finite: not an fp16 overflow")


def test_a_scaler_that_never_scaled_is_a_config_error_under_skip(single_process):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = StepGuard("skip", model=model, optimizer=opt, scaler=_scaler())
    x, y = next(iter(_loader()))
    loss = nn.functional.cross_entropy(model(_poison_at(0)(0, x)), y)
    loss.backward()  # not scaler.scale(loss): the scaler never saw this step
    with pytest.raises(ConfigError, match=r"has not scaled a loss .*expected scaler.scale\(loss\).backward\(\)"):
        guard(loss, 0)


@pytest.mark.parametrize(("before", "after"), [(None, True), (False, True), (True, False)],
                         ids=["no-scaler-then-fp16", "bf16-then-fp16", "fp16-then-bf16"])
def test_a_checkpoint_without_a_usable_scaler_state_resumes_and_the_scaler_keeps_its_own(single_process, tmp_path,
                                                                                          before, after):
    cfg = {"health": {"hang_timeout": None}, "checkpoint": {"dir": str(tmp_path)}}
    model = _model()
    scaler = None if before is None else _scaler(init_scale=2.0 ** 5, enabled=before)
    h = harden(model, None, cfg, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), scaler=scaler)
    h.save(3, force=True)
    h.close()
    model2 = _model()
    scaler2 = _scaler(init_scale=2.0 ** 9, enabled=after)
    h2 = harden(model2, None, cfg, optimizer=torch.optim.SGD(model2.parameters(), lr=0.05), scaler=scaler2)
    assert h2.resume() == 3
    h2.close()
    if after:
        assert scaler2.get_scale() == 2.0 ** 9  # nothing usable was saved: the live scaler keeps its scale


def _mixed_scalers(rank):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model())
    guard = StepGuard(model=model, scaler=_scaler() if rank == 0 else None)
    x, y = next(iter(_loader()))
    nn.functional.cross_entropy(model(x), y).backward()
    try:
        guard(torch.tensor(1.0), 0)
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.processes
def test_a_scaler_on_some_ranks_only_is_refused_on_every_rank_at_the_first_step():
    for rank, message in enumerate(run_ranks(_mixed_scalers, 2, timeout=60)):
        assert message == (f"[rank {rank}] the step guard was given an enabled GradScaler on rank 0 but not on the "
                           "others; expected the same on every rank (each decides an overflow differently without "
                           "one). Fix: pass the same scaler= on every rank, enabled alike.")
