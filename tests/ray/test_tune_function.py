"""harden() inside a plain Ray Tune function trainable (no TorchTrainer), two trials sharing one checkpoint.dir:
each trial gets its own namespace from its trial identity and resumes only its own checkpoints
after Tune restarts it; with one checkpoint.run_name for every trial, the second trial is refused, never
resumed from the first's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]

TOTAL, CRASH_AT = 6, 4


def _train_steps(model: nn.Module, opt: torch.optim.Optimizer, start: int, stop: int) -> None:
    for step in range(start, stop):
        x = torch.linspace(-1, 1, 32).reshape(8, 4) * (step + 1)
        loss = ((model(x) - 1.0) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def trial_fn(config: dict) -> None:
    import ray.tune

    from robustdist import harden

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    ckpt = {"dir": config["dir"], "every_n_steps": 1}
    if config.get("run_name"):
        ckpt["run_name"] = config["run_name"]
    import logging

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    keep = Keep(logging.WARNING)
    logging.getLogger("robustdist").addHandler(keep)
    try:
        h = harden(model, None, {"checkpoint": ckpt, "health": {"hang_timeout": None}}, optimizer=opt)
    finally:
        logging.getLogger("robustdist").removeHandler(keep)
    start = h.resume() or 0
    out = Path(config["out"])
    trial = ray.tune.get_context().get_trial_id()
    with open(out / f"{trial}.jsonl", "a") as fh:
        fh.write(json.dumps({"start": start, "dir": h.checkpointer.directory, "lr": config["lr"],
                             "warned": [m for m in seen if "holds checkpoints of its own" in m]}) + "\n")
    for step in range(start, TOTAL):
        _train_steps(model, opt, step, step + 1)
        h.save(step + 1)
        marker = out / f"{trial}.crashed"
        if step + 1 == CRASH_AT and config.get("crash", True) and not marker.exists():  # the first attempt dies here; Tune restarts the trial
            marker.touch()
            raise RuntimeError("injected failure after step 4")
        ray.tune.report({"step": step + 1})
    torch.save(model.state_dict(), out / f"{trial}.pt")
    h.close()


def _straight(lr: float) -> dict:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    _train_steps(model, opt, 0, TOTAL)
    return model.state_dict()


def _tuner(tmp_path: Path, name: str, space: dict, max_failures: int):
    from ray import tune

    return tune.Tuner(tune.with_resources(trial_fn, {"cpu": 0.1}), param_space=space,
                      run_config=tune.RunConfig(storage_path=str(tmp_path / "tune"), name=name,
                                                failure_config=tune.FailureConfig(max_failures=max_failures)))


def test_each_trial_has_its_own_namespace_and_resumes_only_its_own_checkpoints(ray_by_value, tmp_path):
    from ray import tune

    out = tmp_path / "out"
    out.mkdir()
    base = tmp_path / "ckpt"
    from robustdist.checkpoint import AtomicCheckpointer

    old = AtomicCheckpointer(base)  # as an older robustdist left it: every trial's checkpoints in the base
    old.save(5, {"model": nn.Linear(4, 1)})
    old.close()
    space = {"lr": tune.grid_search([0.01, 0.05]), "dir": str(base), "out": str(out)}
    results = _tuner(tmp_path, "exp", space, max_failures=1).fit()
    assert results.num_errors == 0, [str(e)[:2000] for e in results.errors]
    trials = sorted(p.stem for p in out.glob("*.jsonl"))
    assert len(trials) == 2
    assert sorted(p.name for p in (base / "exp").iterdir()) == trials  # <dir>/<experiment>/<trial id>
    for trial in trials:
        attempts = [json.loads(line) for line in (out / f"{trial}.jsonl").read_text().splitlines()]
        assert [a["start"] for a in attempts] == [0, CRASH_AT]  # fresh, then its own step 4 after Tune's restart
        assert all(len(a["warned"]) == 1 and str(base) in a["warned"][0] for a in attempts)  # the base's step 5
        assert {a["dir"] for a in attempts} == {os.path.realpath(base / "exp" / trial)}
        record = json.loads((base / "exp" / trial / ".robustdist-run.json").read_text())
        assert record["run"] == f"exp/{trial}"
        final = torch.load(out / f"{trial}.pt", weights_only=True)
        reference = _straight(attempts[0]["lr"])
        assert all(torch.equal(final[k], reference[k]) for k in reference)  # bitwise, as if never interrupted


def test_one_run_name_for_every_trial_is_refused_for_the_second(ray_by_value, tmp_path):
    from ray import tune

    out = tmp_path / "out"
    out.mkdir()
    space = {"lr": tune.grid_search([0.01, 0.05]), "dir": str(tmp_path / "ckpt"), "out": str(out),
             "run_name": "shared", "crash": False}
    results = _tuner(tmp_path, "named", space, max_failures=0).fit()
    assert results.num_errors == 1
    message = str(results.errors[0])
    assert "checkpoint directory" in message and "belongs to run 'shared' with training config trial " in message
    assert "Ray Tune trial" in message and "Fix: drop checkpoint.run_name: each Ray Tune trial then gets" in message
    owners = [p for p in out.glob("*.jsonl")]
    assert len(owners) == 1  # the refused trial never got to resume or train
