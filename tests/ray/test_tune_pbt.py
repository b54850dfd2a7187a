"""Ray Tune's PBT with harden() in a function trainable, in the shape of Ray's ``pbt_function.py``
(``tests/clients/tune_pbt.py``): 4 trials, the lower half exploiting the upper every 4 iterations, a checkpoint at
each, ``reuse_actors`` both ways, one trial's actor SIGKILLed mid-run. Every exploit restores the donor's checkpoint
through robustdist (the trial continues from the donor's saved parameters with its own new learning rate, and its
later manifests record the lineage), every other start (a pause, the restart after the kill) resumes the trial's
own saved state, no trial errors, and a reused actor keeps no thread of the trials before. A trial that does fail
reaches Tune's results with robustdist's message, and ``fail_fast="raise"`` raises it from ``fit()``."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from robustdist.checkpoint._layout import committed_steps, step_dirname
from tests.clients import tune_pbt as client

pytestmark = [pytest.mark.processes, pytest.mark.timeout(420)]

INTERVAL = 4
KILL_AT = 10  # between the saves at 8 and 12


@pytest.fixture(scope="module")
def client_by_value(ray_by_value):
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(client)
    try:
        yield ray_by_value
    finally:
        cloudpickle.unregister_pickle_by_value(client)


def _fit(tmp_path: Path, *, reuse: bool, iterations: int, **failure: object):
    from ray import tune
    from ray.tune.schedulers import PopulationBasedTraining

    (tmp_path / "out").mkdir()
    pbt = PopulationBasedTraining(time_attr="training_iteration", perturbation_interval=INTERVAL,
                                  quantile_fraction=0.5,  # the lower half exploits the upper: exploits every run
                                  hyperparam_mutations={"lr": tune.uniform(0.001, 0.05)})
    space = {"lr": tune.uniform(0.001, 0.05), "checkpoint_interval": INTERVAL, "dir": str(tmp_path / "ckpt"),
             "out": str(tmp_path / "out"), "kill_at": KILL_AT}
    return tune.Tuner(
        tune.with_resources(client.pbt_trainable, {"cpu": 0.5}), param_space=space,
        tune_config=tune.TuneConfig(scheduler=pbt, metric="mean_accuracy", mode="max", num_samples=4,
                                    reuse_actors=reuse),
        run_config=tune.RunConfig(name="pbt", storage_path=str(tmp_path / "tune"), verbose=0,
                                  stop={"training_iteration": iterations},
                                  failure_config=tune.FailureConfig(**failure))).fit()


def _donor(source: str | None) -> str | None:
    """The trial a start's state came from, when Tune handed it over: "run 'pbt/<trial>''s checkpoint, ..."."""
    found = re.match(r"run 'pbt/([^']+)''s checkpoint, handed over by Ray Tune", source or "")
    return found.group(1) if found else None


def _lines(out: Path) -> dict[str, list[dict]]:
    return {p.stem: [json.loads(line) for line in p.read_text().splitlines()] for p in sorted(out.glob("*.jsonl"))}


@pytest.mark.parametrize("reuse", [True, False], ids=["reused-actors", "fresh-actors"])
def test_pbt_exploits_restore_the_donor_through_robustdist(client_by_value, tmp_path, reuse):
    results = _fit(tmp_path, reuse=reuse, iterations=40 if reuse else 32, max_failures=1)
    assert results.num_errors == 0, [str(e)[:1500] for e in results.errors]
    trials = _lines(tmp_path / "out")
    assert len(trials) == 4
    saved = {(trial, line["step"], line["digest"]) for trial, lines in trials.items() for line in lines
             if line["kind"] == "save"}
    exploits = 0
    for trial, lines in trials.items():
        starts = [line for line in lines if line["kind"] == "start"]
        assert starts[0]["step"] == 0 and starts[0]["source"] is None
        for start in starts[1:]:
            donor = _donor(start["source"])
            if donor is not None:  # an exploit: the donor's saved state, this trial's own (perturbed) rate
                assert donor != trial
                assert (donor, start["step"], start["digest"]) in saved, start
                donors = [line for line in trials[donor] if line["step"] == start["step"] and line["kind"] == "save"]
                assert all(d["lr"] != start["lr"] for d in donors)
                exploits += 1
            else:  # a pause, or a restart in another actor: this trial's own newest state
                assert (trial, start["step"], start["digest"]) in saved, start
    assert exploits >= 1  # PBT did exploit, through robustdist's checkpoints
    killed = (tmp_path / "out" / "killed").read_text()
    after = [line["kind"] for line in trials[killed]]
    assert "kill" in after and after[after.index("kill") + 1] == "start"  # Tune restarted the killed trial, and
    restart = trials[killed][after.index("kill") + 1]  # it resumed a saved state (the checks above: whose)
    assert 0 < restart["step"] <= KILL_AT
    lineages = 0
    for trial, lines in trials.items():
        handed = [line for line in lines if line["kind"] == "start" and _donor(line["source"])]
        directory = tmp_path / "ckpt" / "pbt" / trial
        newest = max(committed_steps(str(directory)))
        if handed and newest > handed[-1]["step"]:  # a checkpoint after the last exploit records where it came from
            manifest = json.loads((directory / step_dirname(newest) / "manifest.json").read_text())
            adopted = manifest["metadata"].get("adopted")
            assert adopted is not None and adopted["run"] == f"pbt/{_donor(handed[-1]['source'])}", manifest
            assert adopted["step"] == handed[-1]["step"]
            lineages += 1
    assert lineages >= 1
    by_pid: dict[int, list[int]] = {}
    for lines in trials.values():
        for line in lines:
            if line["kind"] == "start":
                by_pid.setdefault(line["pid"], []).append(line["threads"])
    if reuse:
        assert any(len(counts) > 1 for counts in by_pid.values())  # an actor did run a second trial (or resume)
    for counts in by_pid.values():
        assert max(counts) <= min(counts) + 1, by_pid  # no thread left behind by the trials before


def test_a_failing_trial_reaches_tunes_results_and_fail_fast_raises_it(client_by_value, tmp_path):
    from ray import tune

    def failing(config: dict) -> None:
        from robustdist import harden

        harden(__import__("torch").nn.Linear(2, 1), None, {"checkpoint": {"dir": config["dir"], "keep_last": 0}})

    results = tune.Tuner(tune.with_resources(failing, {"cpu": 0.5}), param_space={"dir": str(tmp_path / "a")},
                         run_config=tune.RunConfig(name="fails", storage_path=str(tmp_path / "tune"), verbose=0)
                         ).fit()
    assert results.num_errors == 1 and "checkpoint.keep_last" in str(results.errors[0])
    with pytest.raises(Exception, match="checkpoint.keep_last"):
        tune.Tuner(tune.with_resources(failing, {"cpu": 0.5}), param_space={"dir": str(tmp_path / "b")},
                   run_config=tune.RunConfig(name="raises", storage_path=str(tmp_path / "tune"), verbose=0,
                                             failure_config=tune.FailureConfig(fail_fast="raise"))).fit()
    assert os.path.isdir(tmp_path / "tune" / "raises")
