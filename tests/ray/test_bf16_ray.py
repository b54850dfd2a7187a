"""bf16/float8 tensors through a real local Ray cluster, whose workers run the setup hook."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from robustdist.bf16 import RAW_DTYPES, install_ray_serializers
from tests.test_bf16 import ALL_BF16, FLOAT8, same, views

pytestmark = [pytest.mark.processes, pytest.mark.ray, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def remote(ray_cluster):
    ray = ray_cluster
    install_ray_serializers()  # the driver's side; workers got it from the setup hook

    @ray.remote
    def echo(t):
        return t

    @ray.remote
    def describe(t):
        return str(t.dtype), tuple(t.shape), t.contiguous().view(RAW_DTYPES[t.dtype]).numpy().tobytes()

    @ray.remote
    class Holder:
        def roundtrip(self, t):
            return t.clone()

    return ray, echo, describe, Holder.remote()


def test_every_pattern_through_put_get_tasks_and_actors(remote):
    ray, echo, describe, holder = remote
    assert same(ray.get(ray.put(ALL_BF16)), ALL_BF16)
    assert same(ray.get(echo.remote(ALL_BF16)), ALL_BF16)
    assert same(ray.get(holder.roundtrip.remote(ALL_BF16)), ALL_BF16)
    dtype, shape, raw = ray.get(describe.remote(ALL_BF16))  # the worker sees the exact bits too
    assert (dtype, shape) == ("torch.bfloat16", (65536,)) and raw == ALL_BF16.view(torch.uint16).numpy().tobytes()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(t=views())
def test_views_through_ray(remote, t):
    ray, echo, _, holder = remote
    assert same(ray.get(ray.put(t)), t)
    assert same(ray.get(echo.remote(t)), t)
    assert same(ray.get(holder.roundtrip.remote(t)), t)


@pytest.mark.parametrize("dtype", FLOAT8, ids=str)
def test_float8_through_ray(remote, dtype):
    ray, echo, _, holder = remote
    t = torch.from_numpy(np.arange(256, dtype=np.uint8)).view(dtype)
    assert same(ray.get(echo.remote(t)), t) and same(ray.get(holder.roundtrip.remote(t)), t)


def test_parameters_and_other_dtypes_through_ray(remote):
    ray, echo, _, _ = remote
    p = torch.nn.Parameter(torch.randn(3, dtype=torch.bfloat16))
    back = ray.get(echo.remote(p))
    assert type(back) is torch.nn.Parameter and back.requires_grad and same(back, p)
    x = torch.randn(4, 5)
    assert torch.equal(ray.get(echo.remote(x)), x)  # torch's own reduction for every other dtype


def _robustdist_serializer_installed():
    from ray import cloudpickle

    from robustdist.bf16 import _ray_serialize

    reducer = cloudpickle.CloudPickler.dispatch.get(torch.Tensor)
    return reducer is not None and any(c.cell_contents is _ray_serialize for c in (reducer.__closure__ or ()))


def test_workers_ran_the_setup_hook(remote):
    ray = remote[0]
    probe = ray.remote(_robustdist_serializer_installed)
    assert ray.get(probe.remote()) is True  # a fresh worker process: the hook, not the driver, installed it
    assert _robustdist_serializer_installed()  # and the driver, by install_ray_serializers()
