"""Checksum-valid but forged optimizer, scheduler and grad-scaler state: load() used to accept it and the next
``opt.step()``/``sched.step()`` crashed (AttributeError, KeyError, RuntimeError, ZeroDivisionError). Each is
now a CheckpointCorruptError naming the entry and the key, checked before anything is restored, and load()
falls back to the older step; the objects then train. Legitimate states of torch's own classes still load."""

from __future__ import annotations

import io

import pytest
import torch
from torch.optim import lr_scheduler as L

from robustdist.checkpoint import AtomicCheckpointer
from robustdist.runtime.errors import CheckpointError, RobustDistWarning
from tests.security._forge import STEP2, forge

pytestmark = pytest.mark.timeout(120)


def _setup(momentum: float = 0.9):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    return model, opt, L.StepLR(opt, 3), torch.amp.GradScaler("cpu")


def _train(model, opt, sched) -> None:
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        sched.step()


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Steps 1 and 2 of a model, an SGD optimizer with momentum, a StepLR and a GradScaler; step 2's payload."""
    directory = tmp_path_factory.mktemp("live")
    model, opt, sched, scaler = _setup()
    _train(model, opt, sched)
    with AtomicCheckpointer(directory) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"model": model, "optimizer": opt, "sched": sched, "scaler": scaler})
    return directory, (directory / STEP2 / "replicated.pt").read_bytes()


def _group(p, **edit):
    return {**p["optimizer"]["param_groups"][0], **edit}


def _without(d, key):
    return {k: v for k, v in d.items() if k != key}


_OPT = [
    ("momentum_buffer is a str", lambda p: p["optimizer"]["state"][0].update(momentum_buffer="x"),
     "state of parameter 0 key 'momentum_buffer' is a text; expected a tensor or a number"),
    ("momentum_buffer of another shape", lambda p: p["optimizer"]["state"][0].update(momentum_buffer=torch.zeros(100)),
     "key 'momentum_buffer' has shape (100,); expected the parameter's shape (4, 4) or a scalar"),
    ("step param-shaped", lambda p: p["optimizer"]["state"][0].update(step=torch.zeros(4, 4)),
     "key 'step' has shape (4, 4); expected a scalar step count"),
    ("a group without lr", lambda p: p["optimizer"].update(param_groups=[_without(_group(p), "lr")]),
     "parameter group 0 lacks 'lr', which the live SGD's groups have"),
    ("lr a bool", lambda p: p["optimizer"].update(param_groups=[_group(p, lr=True)]),
     "parameter group 0 key 'lr' is a bool; the live value is a number"),
    ("lr None", lambda p: p["optimizer"].update(param_groups=[_group(p, lr=None)]),
     "parameter group 0 key 'lr' is None; the live value is a number"),
    ("momentum a str", lambda p: p["optimizer"].update(param_groups=[_group(p, momentum="0.9")]),
     "key 'momentum' is a text; the live value is a number"),
    ("nesterov a number", lambda p: p["optimizer"].update(param_groups=[_group(p, nesterov=1)]),
     "key 'nesterov' is a number; the live value is a bool"),
    ("a parameter's state is a list", lambda p: p["optimizer"]["state"].update({0: [torch.zeros(4, 4)]}),
     "the state of parameter 0 is not a dict of named values"),
    ("unhashable parameter ids", lambda p: p["optimizer"].update(param_groups=[_group(p, params=[[0], [1]])]),
     "lists parameter ids that are not ints or strings"),
]
_SCHED = [
    ("step_size 0", lambda p: p["sched"].update(step_size=0), "key 'step_size' is 0; the live value is a positive int"),
    ("step_size negative", lambda p: p["sched"].update(step_size=-3), "key 'step_size' is -3"),
    ("gamma a str", lambda p: p["sched"].update(gamma="0.1"), "key 'gamma' is a text; the live value is a number"),
    ("gamma NaN", lambda p: p["sched"].update(gamma=float("nan")), "key 'gamma' is nan; the live value is a finite"),
    ("base_lrs too short", lambda p: p["sched"].update(base_lrs=[]),
     "key 'base_lrs' has 0 items; the live value has 1"),
    ("base_lrs of str", lambda p: p["sched"].update(base_lrs=["0.1"]), "key 'base_lrs' item 0 is a text"),
    ("last_epoch None", lambda p: p["sched"].update(last_epoch=None), "key 'last_epoch' is None; the live value is"),
    ("_is_initial a number", lambda p: p["sched"].update(_is_initial=0), "key '_is_initial' is a number"),
    ("scaler growth_interval 0", lambda p: p["scaler"].update(growth_interval=0), "key 'growth_interval' is 0"),
    ("scaler scale a str", lambda p: p["scaler"].update(scale="big"), "key 'scale' is a text"),
]


@pytest.mark.parametrize(("edit", "reason"), [c[1:] for c in _OPT + _SCHED], ids=[c[0] for c in _OPT + _SCHED])
def test_forged_optimizer_and_scheduler_state_falls_back_and_training_continues(saved, tmp_path, edit, reason):
    import shutil

    source, pristine = saved
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    payload = torch.load(io.BytesIO(pristine), weights_only=True)
    edit(payload)
    forge(tmp_path / STEP2, "replicated.pt", _torch_bytes(payload))
    model, opt, sched, scaler = _setup()
    with pytest.warns(RobustDistWarning, match=r"checkpoint step 2 failed verification") as record:
        with AtomicCheckpointer(tmp_path) as ckpt:
            assert ckpt.load(state={"model": model, "optimizer": opt, "sched": sched, "scaler": scaler}).step == 1
    message = next(str(w.message) for w in record if w.category is RobustDistWarning)
    assert "replicated.pt entry '" in message and reason in message, message
    _train(model, opt, sched)  # the older step's state trains
    assert scaler.get_scale() > 0


def _with_state():
    model, opt, _, _ = _setup()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return opt


def test_forged_state_is_refused_against_the_live_optimizers_own_state(tmp_path):
    with AtomicCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, {"optimizer": _with_state()})
        ckpt.save(2, {"optimizer": _with_state()})
    for key, value, reason in (
            ("momentum_buffer", torch.zeros(()), "key 'momentum_buffer' has shape (); the live optimizer's has (4, 4)"),
            ("momentum_buffer", 0.5, "key 'momentum_buffer' is a number; the live optimizer keeps a tensor"),
            ("exp_avg", torch.zeros(4, 4), "has keys ['exp_avg', 'momentum_buffer']; the live SGD keeps "
                                           "['momentum_buffer']")):
        payload = torch.load(tmp_path / "step_0000000001" / "replicated.pt", weights_only=True)
        payload["optimizer"]["state"][0][key] = value
        forge(tmp_path / STEP2, "replicated.pt", _torch_bytes(payload))
        opt = _with_state()  # the live optimizer has state: the saved state must have its keys, kinds and shapes
        with pytest.warns(RobustDistWarning, match="failed verification") as record, \
                AtomicCheckpointer(tmp_path) as ckpt:
            assert ckpt.load(state={"optimizer": opt}).step == 1
        assert reason in str(record[0].message), str(record[0].message)
        opt.step()


def test_a_layout_mismatch_is_not_called_corruption(tmp_path):
    model, opt, _, _ = _setup()
    with AtomicCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, {"optimizer": opt})
        bigger = torch.optim.SGD([*model.parameters(), torch.nn.Parameter(torch.ones(2))], lr=0.1)
        expected = (r"checkpoint step 1 could not be restored into the live objects .*the saved optimizer has 1 "
                    r"parameter group\(s\) of \[2\] parameters; the live SGD has 1 parameter group\(s\) of \[3\] "
                    r"parameters\. The checkpoint is not corrupt")
        with pytest.raises(CheckpointError, match=expected) as exc:
            ckpt.load(1, state={"optimizer": bigger})
        assert type(exc.value) is CheckpointError and "Fix: build the same model and optimizer" in str(exc.value)


def _schedulers(opt):
    return {"step": L.StepLR(opt, 3), "cos": L.CosineAnnealingLR(opt, 10),
            "warm": L.CosineAnnealingWarmRestarts(opt, 5),
            "onecycle": L.OneCycleLR(opt, 1.0, total_steps=20, cycle_momentum=False),
            "plateau": L.ReduceLROnPlateau(opt), "cyclic": L.CyclicLR(opt, 0.01, 0.1, cycle_momentum=False),
            "linear": L.LinearLR(opt), "poly": L.PolynomialLR(opt),
            "seq": L.SequentialLR(opt, [L.ConstantLR(opt), L.ExponentialLR(opt, 0.9)], [2])}


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adam(ps, amsgrad=True), lambda ps: torch.optim.AdamW(ps),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True), lambda ps: torch.optim.RMSprop(ps),
    lambda ps: torch.optim.Adagrad(ps), lambda ps: torch.optim.Rprop(ps), lambda ps: torch.optim.Adafactor(ps),
    lambda ps: torch.optim.NAdam(ps), lambda ps: torch.optim.ASGD(ps),
], ids=["adam-amsgrad", "adamw", "sgd-nesterov", "rmsprop", "adagrad", "rprop", "adafactor", "nadam", "asgd"])
def test_legitimate_states_of_torch_classes_still_load(tmp_path, make):
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
        opt = make(model.parameters())
        return model, opt, _schedulers(opt)

    model, opt, scheds = build()
    for _ in range(3):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        for name, s in scheds.items():
            s.step(1.0) if name == "plateau" else s.step()
    with AtomicCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": model, "optimizer": opt, **scheds})
        saved = torch.load(tmp_path / "step_0000000001" / "replicated.pt", weights_only=True)
        for live_state in (False, True):  # into fresh objects, and into objects that already have state
            model2, opt2, scheds2 = build()
            if live_state:
                model2(torch.randn(3, 4)).sum().backward()
                opt2.step()
            assert ckpt.load(state={"model": model2, "optimizer": opt2, **scheds2}).step == 1
            assert {k: v.tolist() if torch.is_tensor(v) else v for k, v in opt2.state_dict()["state"][0].items()} \
                == {k: v.tolist() if torch.is_tensor(v) else v for k, v in saved["optimizer"]["state"][0].items()}
        older = {**saved, "optimizer": {**saved["optimizer"], "param_groups": [
            {k: v for k, v in g.items() if k not in ("differentiable", "foreach", "maximize")}
            for g in saved["optimizer"]["param_groups"]]}}  # flags a newer torch added: torch fills them in
        forge(tmp_path / "step_0000000001", "replicated.pt", _torch_bytes(older))
        assert ckpt.load(state={"model": model2, "optimizer": build()[1]}).step == 1
