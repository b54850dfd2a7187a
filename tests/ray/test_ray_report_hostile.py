"""``robustdist.ray.train.report`` hands Ray only the files robustdist committed: a committed file swapped for a
symbolic link or a hard link to a file outside the checkpoint (between the commit and the report) is refused
with a named error, and the outside file never reaches Ray's storage. One real Ray Train V2 run, one worker, tries
the three cases in turn (each its own checkpoint directory and outside file): the symbolic link, the hard link,
then the untouched control, whose report is the run's checkpoint; each test reads its case from that run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600, method="thread")]
SECRET = "the contents of a file outside the checkpoint"
CASES = ("symlink", "hardlink", "none")  # the control last: its report is the run's checkpoint


def _train(config):
    import ray.train
    import torch

    from robustdist.checkpoint import AtomicCheckpointer
    from robustdist.checkpoint._layout import read_manifest
    from robustdist.ray import train as rt

    ctx = ray.train.get_context()
    refused = {}
    for swap in CASES:
        with AtomicCheckpointer(os.path.join(config["ckpt"], swap)) as ckpt:
            info = ckpt.save(1, {"weights": torch.zeros(8)})
        step_dir = info.path
        target = os.path.join(step_dir, "replicated.pt")
        secret = Path(config["secret"][swap])
        if swap != "none":  # what someone who can write the directory does after the commit
            if swap == "hardlink":  # an outside file of the very size the manifest records
                secret.write_bytes(SECRET.encode().ljust(os.path.getsize(target), b"."))
            os.unlink(target)
            (os.symlink if swap == "symlink" else os.link)(secret, target)
        try:
            rt.report({"step": 1}, step_dir, read_manifest(step_dir, 1), rank=ctx.get_world_rank(),
                      world_size=ctx.get_world_size())
        except Exception as e:  # the refusal: recorded for the test, and the next case goes on
            refused[swap] = f"{type(e).__name__}: {e}"
        else:
            refused[swap] = None
    with open(config["refused"], "w") as fh:
        json.dump(refused, fh)


@pytest.fixture(scope="module")
def run(ray_by_value, tmp_path_factory):
    """The one fit: ``(result, error, {case: the report's error text or None}, files holding SECRET in Ray's
    storage)``."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    tmp_path = tmp_path_factory.mktemp("report")
    secrets = {swap: str(tmp_path / f"secret-{swap}.txt") for swap in CASES}
    for secret in secrets.values():
        Path(secret).write_text(SECRET)
    config = {"ckpt": str(tmp_path / "ckpt"), "secret": secrets, "refused": str(tmp_path / "refused.json")}
    storage = tmp_path / "ray"
    trainer = TorchTrainer(_train, train_loop_config=config,
                           scaling_config=ScalingConfig(num_workers=1, use_gpu=False),
                           run_config=RunConfig(storage_path=str(storage), name="report",
                                                failure_config=FailureConfig(max_failures=0)))
    try:
        result = trainer.fit()
        error = result.error
    except Exception as e:  # Train V2 raises the worker's error from fit()
        result, error = None, e
    refused = json.loads(Path(config["refused"]).read_text()) if error is None else {}
    uploaded = [p for p in storage.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    return result, error, refused, uploaded


@pytest.mark.processes
@pytest.mark.parametrize("swap", ["symlink", "hardlink"])
def test_a_committed_file_swapped_for_a_link_never_reaches_rays_storage(run, swap):
    _, error, refused, uploaded = run
    assert error is None, error
    assert uploaded == []
    text = refused[swap]
    assert text is not None
    assert "replicated.pt" in text
    assert ("is a symbolic link; refused" in text) if swap == "symlink" else ("has 2 names (a hard link" in text)


@pytest.mark.processes
def test_the_control_reports_the_checkpoint(run):
    result, error, refused, uploaded = run
    assert error is None and uploaded == []
    assert refused["none"] is None
    assert result.checkpoint is not None
    with result.checkpoint.as_directory() as d:
        assert sorted(os.listdir(d)) == ["manifest.json", "rank_00000.pt", "replicated.pt"]


@pytest.mark.parametrize("where", ["parent", "file"])
def test_every_failure_before_ray_s_barrier_is_told_to_the_agreement_first_and_nothing_reaches_ray(tmp_path,
                                                                                                    monkeypatch, where):
    """What fails before ``ray.train.report`` (the step directory's parent gone, a committed file gone) is handed
    to ``agree`` (robustdist's own collective, which every rank reaches), whose error is raised from it; Ray's
    barrier is never entered. No cluster needed: nothing reaches Ray."""
    import ray.train

    from robustdist.ray import train as rt

    monkeypatch.setattr(ray.train, "report", lambda *a, **k: pytest.fail("entered Ray's barrier"))
    step_dir = tmp_path / "ckpt" / "step_0000000006"
    manifest = {"files": {"rank_1.pt": {"size": 10}}}
    if where == "file":
        step_dir.mkdir(parents=True)
    told: list[str | None] = []

    class Named(Exception):
        pass

    def agree(problem: str | None) -> None:
        told.append(problem)
        raise Named("every rank raises this")

    with pytest.raises(Named) as caught:
        rt.report({"step": 6}, str(step_dir), manifest, rank=1, world_size=2, agree=agree)
    assert len(told) == 1 and told[0], told
    assert caught.value.__cause__ is not None and type(caught.value.__cause__).__name__ in told[0]
    left = sorted(p.name for p in (tmp_path / "ckpt").iterdir()) if where == "file" else []
    assert left == (["step_0000000006"] if where == "file" else []), left  # no scratch directory left behind
