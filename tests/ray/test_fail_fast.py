"""A configuration error in a Ray Train worker is not retried with ``robustdist.ray.fail_fast()``: a
script that kept Ray's ``prepare_model`` before ``harden`` fails at the first attempt, naming the rank, the
wrapper and the fix, instead of ``FailureConfig.max_failures`` attempts later. Real Ray Train V2 runs on the
session's local cluster; without the callback the same run is retried (the premise)."""

from __future__ import annotations

import os
from typing import Any

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(400, method="thread")]


def train_fn(config: dict[str, Any]) -> None:
    import ray.train.torch
    from torch import nn

    from robustdist import harden

    with open(os.path.join(config["out"], f"attempts-{ray.train.get_context().get_world_rank()}"), "a") as fh:
        fh.write("attempt\n")
    model = ray.train.torch.prepare_model(nn.Linear(4, 2))  # the original script's line, kept by mistake
    harden(model, None, {"health": {"hang_timeout": None}})


def _fit(tmp_path, name: str, callbacks: list, max_failures: int) -> tuple[Any, int]:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = tmp_path / name
    out.mkdir()
    trainer = TorchTrainer(
        train_fn, train_loop_config={"out": str(out)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(storage_path=str(tmp_path / "ray"), name=name, callbacks=callbacks,
                             failure_config=FailureConfig(max_failures=max_failures)))
    error = None
    try:
        trainer.fit()
    except Exception as e:  # Ray raises the run's failure from fit()
        error = e
    attempts = [len((out / f"attempts-{r}").read_text().splitlines()) for r in range(2)]
    assert attempts[0] == attempts[1]
    return error, attempts[0]


@pytest.mark.processes
def test_a_config_error_fails_the_run_at_once_with_fail_fast_and_is_retried_without(ray_by_value, tmp_path):
    import robustdist.ray

    error, attempts = _fit(tmp_path, "fast", [robustdist.ray.fail_fast()], max_failures=3)
    assert attempts == 1
    text = str(error)
    assert "failed with ConfigError: [rank " in text
    assert "harden() was given a model already wrapped by DistributedDataParallel (ray.train.torch.prepare_model" \
        in text
    assert "robustdist.ray.fail_fast() ends the run instead of retrying it" in text

    error, attempts = _fit(tmp_path, "retried", [], max_failures=1)
    assert error is not None and attempts == 2  # without the callback Ray retries the same mistake


def test_fail_fast_leaves_other_failures_to_ray_and_reads_ray_s_wrapper():
    pytest.importorskip("ray")
    from ray.train.v2._internal.util import construct_user_exception_with_traceback

    import robustdist.ray
    from robustdist.ray.callbacks import non_retryable
    from robustdist.runtime.errors import CheckpointError, ConfigError, RestartLoopError

    def wrapped(error: BaseException) -> BaseException:
        try:
            raise error
        except BaseException as e:
            return construct_user_exception_with_traceback(e)

    assert non_retryable(wrapped(ConfigError("bad value", rank=1))) == "ConfigError: [rank 1] bad value"
    assert non_retryable(wrapped(RestartLoopError("looping"))) == "RestartLoopError: looping"
    assert non_retryable(wrapped(CheckpointError("disk"))) is None  # may pass on a retry: Ray's business
    assert non_retryable(wrapped(RuntimeError("peer died"))) is None
    # where Ray's wrapper holds no exception of ours, its traceback text still names robustdist's
    assert non_retryable(RuntimeError(str(wrapped(ConfigError("bad value"))))) == "ConfigError: bad value"
    callback = robustdist.ray.fail_fast()
    callback.after_exception(None, {0: wrapped(RuntimeError("peer died"))})  # not ours: nothing raised
    with pytest.raises(ConfigError, match=r"^Ray Train worker rank 1 \(and ranks 2\) failed with ConfigError"):
        callback.after_exception(None, {0: RuntimeError("collateral"), 1: wrapped(ConfigError("x")),
                                        2: wrapped(ConfigError("x"))})
