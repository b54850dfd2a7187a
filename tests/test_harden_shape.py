"""harden composes: adopt_group for a group that exists (and the loud restart-safety warning for the script's
own), Watchdog.attach, the TrainState it checkpoints, honest logs for the drop-in form and for resume, and
warnings that point at the user's line."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.distributed as dist

from robustdist import harden
from robustdist.checkpoint import AtomicCheckpointer
from robustdist.checkpoint.train_state import TrainState
from robustdist.config.schema import HardenConfig
from robustdist.data.dataloader import safe_dataloader
from robustdist.health.step_guard import Watchdog
from robustdist.init.process_group import adopt_group, safe_init_process_group
from robustdist.runtime.errors import InitError, RobustDistWarning
from robustdist.runtime.log import logging_configured
from robustdist.testing.ranks import run_ranks
from tests import _training as tr

pytestmark = pytest.mark.timeout(120)
RESTARTS = {"TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"}
QUIET = {"health": {"hang_timeout": None}}


@pytest.fixture
def single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_PROCID",
                "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


# ------------------------------------------------------------------------------------------------ adopt_group
def _harden_a_plain_group(rank: int) -> dict:
    """The FSDP2-example shape: the script made the group with plain init_process_group (run_ranks did), under
    torchrun with restarts (its variables are set after init: outside torchrun there is no agent store)."""
    os.environ.update(RESTARTS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h = harden(tr.make_model(), None, QUIET)  # this line is what the warning must point at
    try:
        ours = [w for w in caught if issubclass(w.category, RobustDistWarning)]
        return {"created": h.init_report.created, "barrier": "barrier" in h.init_report.timings,
                "fingerprints": len(h.init_report.fingerprints), "report": h.init_report.warnings,
                "files": [os.path.basename(w.filename) for w in ours], "messages": [str(w.message) for w in ours]}
    finally:
        h.close()
        assert dist.is_initialized()  # not harden's group: left to its creator


@pytest.mark.processes
def test_harden_validates_a_group_the_script_made_and_warns_loudly_about_restarts():
    for rank, got in enumerate(run_ranks(_harden_a_plain_group, 2, timeout=90)):
        assert got["created"] is False and got["barrier"] and got["fingerprints"] == 2  # validated like our own
        assert len(got["messages"]) == 1, got["messages"]
        message = got["messages"][0]
        assert f"[rank {rank}/2]" in message and "created outside robustdist" in message
        assert "TORCHELASTIC_MAX_RESTARTS=2" in message and "safe_init_process_group()" in message
        assert got["files"] == ["test_harden_shape.py"]  # the user's line, not robustdist's
        assert got["report"] == [message.split("] ", 1)[1]]


def _adopt_without_restarts(rank: int) -> tuple[bool, list[str]]:
    report = adopt_group(HardenConfig())
    return report.created, report.warnings


@pytest.mark.processes
def test_adopt_group_is_quiet_where_nothing_is_lost():
    assert run_ranks(_adopt_without_restarts, 2, timeout=60) == [(False, []), (False, [])]


def _own_group_then_harden(rank: int) -> list[str]:
    report = safe_init_process_group(HardenConfig())
    os.environ.update(RESTARTS)
    try:
        h = harden(tr.make_model(), None, QUIET)
        h.close()
        return h.init_report.warnings
    finally:
        dist.destroy_process_group()
        assert report.created


@pytest.mark.processes
def test_a_group_robustdist_created_is_not_warned_about():
    assert run_ranks(_own_group_then_harden, 2, init=False, timeout=60) == [[], []]


def test_adopt_group_without_a_group_names_the_fix(single_process):
    with pytest.raises(InitError, match=r"found no process group.*Fix: call safe_init_process_group\(\)"):
        adopt_group()


# ------------------------------------------------------------------------------------------ Watchdog.attach
def test_watchdog_attach_beats_at_forward_and_backward_and_close_removes_the_hooks():
    model = tr.make_model()
    dog = Watchdog(60).attach(model)
    try:
        dog.beat(7)
        before = dog._seq
        loss = model(torch.randn(4, 8)).sum()
        after_forward = dog._seq
        loss.backward()
        assert after_forward == before + 1 and dog._seq == before + 2 and dog._step == 7
    finally:
        dog.close()
    assert not model._forward_pre_hooks and not model._forward_hooks
    dog.close()  # idempotent


# --------------------------------------------------------------------------------------------------- TrainState
def test_train_state_alone_saves_and_restores_model_optimizer_extras_and_loader(single_process, tmp_path):
    torch.manual_seed(0)
    model = tr.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    loader = safe_dataloader(tr.make_loader())
    state = TrainState(model, optimizer=opt, loader=loader, extras={"sched": scaler})
    it = iter(loader)
    for _ in range(3):
        x, y = next(it)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        scaler.step()
    with AtomicCheckpointer(tmp_path) as ckpt:
        state.save(ckpt, 3)
        expected_next = next(it)[1].tolist()
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        scaler.step()
        loaded = state.load(ckpt)
    assert loaded is not None and loaded.step == 3
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    assert scaler.last_epoch == 3 and opt.state_dict()["state"]
    assert next(iter(loader))[1].tolist() == expected_next  # the loader resumes where the save left it


def test_train_state_remember_keeps_only_restorable_extras():
    state = TrainState(tr.make_model())
    opt = torch.optim.SGD(state.model.parameters(), lr=0.1)
    state.remember(optimizer=opt, extra={"note": "plain data", "sched": torch.optim.lr_scheduler.StepLR(opt, 1)})
    assert state.optimizer is opt and list(state.extras) == ["sched"]
    assert list(state.entries()) == ["model", "optimizer", "sched"]


# ------------------------------------------------------------------------------------------------ honest logs
def test_the_drop_in_form_says_that_it_does_not_guard_nans(single_process, caplog):
    caplog.set_level(logging.INFO, logger="robustdist")
    h = harden(tr.make_model(), tr.make_loader(), QUIET)
    try:
        described = [r.getMessage() for r in caplog.records if "hardened:" in r.getMessage()]
        assert described and "nan_policy raise through h.step_guard" in described[0]
        caplog.clear()
        model, loader = h
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "non-finite losses are not checked in this form" in said and "h.step_guard" in said
    finally:
        h.close()


def test_logging_configured_sees_handlers_up_the_tree(monkeypatch):
    root, ours = logging.getLogger(), logging.getLogger("robustdist")
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(ours, "handlers", [logging.NullHandler()])
    assert not logging_configured()
    monkeypatch.setattr(root, "handlers", [logging.StreamHandler()])
    assert logging_configured()
    monkeypatch.setattr(ours, "propagate", False)
    assert not logging_configured()


RESUME_SCRIPT = textwrap.dedent("""
    import sys, torch
    from robustdist import harden
    sys.path.insert(0, {root!r})
    from tests import _training as tr
    cfg = {{"checkpoint": {{"dir": {ckpt!r}, "every_n_steps": 1}}, "health": {{"hang_timeout": None}}}}
    h = harden(tr.make_model(), tr.make_loader(), cfg)
    h.optimizer = torch.optim.SGD(h.model.parameters(), lr=0.1)
    step = h.resume()
    h.save((step or 0) + 1)
    h.close()
""")


@pytest.mark.processes
def test_resume_is_not_silent_when_the_script_configured_no_logging(single_process, tmp_path):
    script = tmp_path / "train.py"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script.write_text(RESUME_SCRIPT.format(root=root, ckpt=str(tmp_path / "ckpt")))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    runs = [subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90, env=env)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
    assert "nothing to resume in" in runs[0].stderr
    assert "resumed from checkpoint step 1" in runs[1].stderr
    assert "hardened:" not in runs[1].stderr  # only what the user must see is raised to WARNING
    assert "written by torch" not in runs[1].stderr  # this torch wrote it
    manifest = tmp_path / "ckpt" / "step_0000000002" / "manifest.json"  # as another torch would have written it
    manifest.write_text(manifest.read_text().replace(f'"torch": "{torch.__version__}"', '"torch": "2.99.0"'))
    third = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90, env=env)
    assert third.returncode == 0, third.stderr[-2000:]
    assert (f"resumed from checkpoint step 2 (durable) in {tmp_path / 'ckpt'}; written by torch 2.99.0, resumed under "
            f"torch {torch.__version__}") in third.stderr, third.stderr[-2000:]


def _warning_through_the_context_manager(rank: int) -> list[str]:
    from robustdist.init.process_group import distributed

    os.environ.update(RESTARTS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with distributed(HardenConfig()):  # the group exists (run_ranks made it): adopted, and warned about
            pass
    return [os.path.basename(w.filename) for w in caught if issubclass(w.category, RobustDistWarning)]


@pytest.mark.processes
def test_a_warning_raised_through_the_context_manager_points_at_the_with_line():
    assert run_ranks(_warning_through_the_context_manager, 2, timeout=60) == [["test_harden_shape.py"] * 2] * 2


def _adopt_and_close_repeatedly(rank: int) -> int:
    from torch.distributed import distributed_c10d as c10d

    from robustdist.init.process_group import destroy_process_group_if_owned

    before = len(c10d._world.pg_map)
    for _ in range(3):
        report = adopt_group(HardenConfig())
        report.side_group = dist.new_group(backend="gloo")  # what a non-gloo backend's validation makes
        dist.barrier()  # both ranks finished connecting it: destroying it at once must not close a half-made pair
        destroy_process_group_if_owned(report)
    return len(c10d._world.pg_map) - before


@pytest.mark.processes
def test_adopting_leaks_no_side_group():
    assert run_ranks(_adopt_and_close_repeatedly, 2, timeout=60) == [0, 0]


def test_the_watchdog_allows_a_bounded_operation_its_own_bound():
    dog = Watchdog(0.3)
    try:
        with dog.allow(5.0, "a slow save"):
            import time

            time.sleep(0.8)  # longer than hang_timeout, within the allowance
        assert dog.reports == []
        time.sleep(0.8)  # outside the block the ordinary bound applies again
        assert len(dog.reports) == 1
    finally:
        dog.close()


def test_fsdp_only_arguments_with_ddp_are_refused_with_the_fix(single_process):
    from robustdist.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match=r"apply to FSDP, but distributed.strategy is 'ddp'.*Fix: set "
                                          r"distributed.strategy: fsdp, or drop those arguments"):
        harden(tr.make_model(), None, QUIET, shard_policy=lambda m: False)


def test_an_optimizer_over_a_meta_model_is_refused_before_fsdp_materialises_it(single_process):
    from robustdist.runtime.errors import ConfigError

    with torch.device("meta"):
        model = tr.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"distributed": {"strategy": "fsdp"}, **QUIET}
    with pytest.raises(ConfigError, match=r"fully_shard replaces the model's parameters.*Fix: h = harden"):
        harden(model, None, cfg, optimizer=opt)


def _dict_config_warns(rank: int) -> list[tuple[str, str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        safe_init_process_group({"distributed": {"timeout": 60}})  # the group exists: adopted
    return [(os.path.basename(w.filename), str(w.message)) for w in caught if w.category is DeprecationWarning]


@pytest.mark.processes
def test_a_dict_passed_to_safe_init_process_group_warns_at_the_callers_line():
    for got in run_ranks(_dict_config_warns, 2, timeout=60):
        assert len(got) == 1 and got[0][0] == "test_harden_shape.py"
        assert "pass a HardenConfig or a DistributedConfig" in got[0][1]
        assert "Resolve it once with robustdist.resolve_config(cfg)" in got[0][1]
