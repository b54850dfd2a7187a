"""wrap_ddp on real gloo ranks and as a single process."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from robustdist.parallel.ddp import reducer_parameter_names, wrap_ddp
from robustdist.parallel.syncbn import SyncBatchNorm
from robustdist.runtime.errors import ConfigError, RobustDistError, RobustDistWarning
from robustdist.testing.ranks import run_ranks


def _convnet():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 2))


def test_single_process_returns_the_bare_module_which_trains(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    model = _convnet()
    wrapped = wrap_ddp(model)
    assert wrapped is model and isinstance(model[1], nn.BatchNorm2d)  # no wrapper, no SyncBN
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 1, 6, 6), torch.randint(0, 2, (8,))
    losses = []
    for _ in range(5):
        loss = nn.functional.cross_entropy(wrapped(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def _wrap_and_train(rank):
    model = wrap_ddp(_convnet(), {"distributed": {"broadcast_buffers": False}}, bucket_cap_mb=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(rank)  # different data per rank
    x, y = torch.randn(8, 1, 6, 6), torch.randint(0, 2, (8,))
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    weights = [p.detach().clone() for p in model.module.parameters()]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, weights)
    same = all(torch.equal(a, b) for a, b in zip(gathered[0], gathered[1]))
    return (type(model).__mro__[1] is nn.parallel.DistributedDataParallel, isinstance(model.module[1], SyncBatchNorm),
            model.broadcast_buffers, model.find_unused_parameters, model.device_ids, same,
            sorted(model.state_dict())[0])


@pytest.mark.processes
def test_wraps_a_real_ddp_with_syncbn_and_config():
    for out in run_ranks(_wrap_and_train, 2, timeout=60):
        assert out == (True, True, False, False, None, True, "module.0.bias")


def _no_syncbn(rank):
    model = wrap_ddp(_convnet(), sync_batchnorm=False)
    return type(model.module[1]).__name__


@pytest.mark.processes
def test_sync_batchnorm_can_be_turned_off():
    assert run_ranks(_no_syncbn, 2, timeout=60) == ["BatchNorm2d"] * 2


def _double_wrap(rank):
    model = wrap_ddp(nn.Linear(2, 2))
    messages = []
    for candidate in (model, nn.Sequential(model), torch.compile(model)):
        try:
            wrap_ddp(candidate)
        except ConfigError as e:
            messages.append(str(e))
    return messages


@pytest.mark.processes
def test_refuses_to_wrap_twice():
    for rank, messages in enumerate(run_ranks(_double_wrap, 2, timeout=60)):
        assert len(messages) == 3
        assert messages[0] == (f"[rank {rank}] DistributedDataParallel is already wrapped in DistributedDataParallel "
                               "(by an earlier wrap_ddp, ray.train.torch.prepare_model, accelerator.prepare or the "
                               "script's own DDP(...)); expected a bare module. Fix: wrap it once: remove the other "
                               "wrapping call, or pass the unwrapped model (robustdist.unwrap_model(model) gives it "
                               "back).")


def _sharded_then_ddp(rank):
    """Models FSDP2 sharded (the root; a submodule; reshard_after_forward=False after a forward, whose parameters
    are plain tensors again) and one tensor parallelism split, given to wrap_ddp, to harden's default strategy,
    and (tensor parallel) to its fsdp strategy."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from robustdist import harden

    def net():
        return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))

    def root():
        m = net()
        fully_shard(m)
        return m

    def submodule():
        m = net()
        fully_shard(m[2])
        return m

    def unsharded_after_forward():
        m = net()
        fully_shard(m, reshard_after_forward=False)
        m(torch.randn(2, 4))
        return m

    def tensor_parallel():
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        return parallelize_module(net(), init_device_mesh("cpu", (2,)), plan)

    off = {"health": {"hang_timeout": None}}
    calls = {"wrap_ddp": wrap_ddp, "harden": lambda m: harden(m, None, off),
             "harden_fsdp": lambda m: harden(m, None, {**off, "distributed": {"strategy": "fsdp"}})}
    found = {}
    cases = (("root", root, ("wrap_ddp", "harden")), ("submodule", submodule, ("wrap_ddp",)),
             ("after_forward", unsharded_after_forward, ("wrap_ddp",)),
             ("tp", tensor_parallel, ("wrap_ddp", "harden_fsdp")))
    for model_name, make, call_names in cases:
        for call_name in call_names:
            try:
                calls[call_name](make())
                found[f"{model_name} {call_name}"] = None
            except ConfigError as e:
                found[f"{model_name} {call_name}"] = str(e)
    return found


@pytest.mark.processes
def test_refuses_a_sharded_model_naming_what_sharded_it_and_the_fix():
    for rank, found in enumerate(run_ranks(_sharded_then_ddp, 2, timeout=90)):
        for key, where in (("root wrap_ddp", "the root"), ("root harden", "the root"), ("submodule wrap_ddp", "2"),
                           ("after_forward wrap_ddp", "the root")):
            message = found[key]
            kind = "FSDPSequential" if where == "the root" else "Sequential"
            assert message is not None and message.startswith(
                f"[rank {rank}] {kind} is sharded by FSDP2 (fully_shard on {where}); DDP needs whole parameters on "
                "every rank"), (key, message)
            assert "Fix: with harden(), set distributed.strategy: fsdp" in message, key
        tp = found["tp wrap_ddp"]
        assert tp is not None and tp.startswith(
            f"[rank {rank}] Sequential has parameters split across ranks (DTensor: 0.weight, 0.bias, 2.weight, ...: "
            "tensor parallelism, parallelize_module); DDP needs whole parameters on every rank"), tp
        tp_fsdp = found["tp harden_fsdp"]
        assert tp_fsdp is not None and tp_fsdp.startswith(
            f"[rank {rank}] Sequential has parameters split across ranks by tensor parallelism (DTensor, "
            "parallelize_module) and no FSDP2 module"), tp_fsdp


def _compiled(rank):
    model = torch.compile(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = wrap_ddp(model)
    inner = wrapped.module._orig_mod
    return (isinstance(inner[1], SyncBatchNorm), [str(w.message) for w in caught if w.category is RobustDistWarning],
            sorted(wrapped.state_dict())[0])


@pytest.mark.processes
def test_compiled_module_is_accepted_with_advice():
    for syncbn, warned, first_key in run_ranks(_compiled, 2, timeout=120):
        assert syncbn and first_key == "module._orig_mod.0.bias"
        assert len(warned) == 1 and "torch.compile(wrap_ddp(model))" in warned[0]


class _Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(2, 2)
        self.frozen = nn.Linear(2, 2).requires_grad_(False)
        self.skipped = nn.Sequential(nn.Linear(2, 2))
        self.head = nn.Linear(2, 1)

    def forward(self, x):
        return self.head(self.used(x))


def _unused_parameters(rank):
    model = wrap_ddp(_Unused())
    for _ in range(3):
        try:
            model(torch.ones(1, 2)).sum().backward()
        except RobustDistError as e:
            return str(e), e.rank, isinstance(e.__cause__, RuntimeError)
    return None


@pytest.mark.processes
def test_unused_parameters_are_named():
    for rank, (message, err_rank, chained) in enumerate(run_ranks(_unused_parameters, 2, timeout=60)):
        assert message == (
            f"[rank {rank}] DDP found parameters that received no gradient in the last backward: skipped.0.weight, "
            "skipped.0.bias; expected every parameter that requires grad to take part in the loss "
            "(find_unused_parameters=False). Fix: pass find_unused_parameters=True to wrap_ddp (costs a graph "
            "traversal every step), or make those parameters part of the loss (or set requires_grad=False on them)."
        )
        assert err_rank == rank and chained


def test_reducer_order_matches_ddp():
    shared = nn.Linear(2, 2)
    model = nn.Sequential(shared, nn.Sequential(shared, nn.Linear(2, 2)), nn.BatchNorm1d(2))
    assert reducer_parameter_names(model) == ["0.weight", "0.bias", "1.1.weight", "1.1.bias", "2.weight", "2.bias"]
    assert reducer_parameter_names(model, {"2.weight"}) == ["0.weight", "0.bias", "1.1.weight", "1.1.bias", "2.bias"]


def _bad_mode(rank):
    try:
        wrap_ddp(nn.Linear(1, 1), sync_batchnorm="yes")
    except RobustDistError as e:
        return str(e)


@pytest.mark.processes
def test_bad_sync_batchnorm_value():
    assert run_ranks(_bad_mode, 2, timeout=60)[0] == ("sync_batchnorm='yes'; expected 'auto', True or False. "
                                                      "Fix: pass one of those.")


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_explicit_device(device, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert next(wrap_ddp(nn.Linear(1, 1), device=device).parameters()).device.type == "cpu"
