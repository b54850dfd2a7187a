"""robustdist inside Lightning Fabric: harden composes with the model ``fabric.setup`` returned (Fabric's
DDP kept; harden shards the plain loader, adds the watchdog, the step guard and checkpoints, and resumes bitwise),
and refuses what would shard twice or double-wrap, with a named error.

Every Fabric lives in a process of its own (``run_ranks``), as a launched script's would.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from robustdist.testing.ranks import run_ranks
from tests import _training as tr

pytestmark = pytest.mark.processes

pytest.importorskip("lightning")

OFF = {"health": {"hang_timeout": None}}
TIMEOUT = 150


def _fabric(devices: int = 2):
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto")
    fabric.launch()
    return fabric


def _setup(fabric, seed: int = 0):
    model = tr.make_model(seed)
    return fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


# ---------------------------------------------------------------------------------------------------- composition
def _train(rank, ckpt, total, stop_at):
    """Fabric's loop, hardened: ``stop_at`` ends the process there (a crash after that step's checkpoint)."""
    import robustdist

    robustdist.safe_init_process_group()
    fabric = _fabric()
    model, optimizer = _setup(fabric)
    h = robustdist.harden(model, tr.make_loader(), {"health": {"hang_timeout": 60.0, "nan_policy": "skip"},
                                                    "checkpoint": {"dir": ckpt, "every_n_steps": 2}},
                          optimizer=optimizer)
    composed = {"same_model": h.model is model, "inner": type(model._forward_module).__name__,
                "loader": type(h.loader).__name__, "batches_per_epoch": len(h.loader),
                "watchdog": h.watchdog is not None, "agreement": h.guard.agreement}
    step = h.resume() or 0
    resumed_from, actions = step, []
    while step < stop_at:
        for x, y in h.loader:
            loss = nn.functional.cross_entropy(h.model(x), y)
            if step == 3:
                loss = loss * float("nan")  # a bad step, skipped on every rank
            fabric.backward(loss)
            decision = h.step_guard(loss, step)
            actions.append(decision.action)
            if decision:
                optimizer.step()
            optimizer.zero_grad()
            step += 1
            h.save(step)
            if step == stop_at:
                break
    state = tr.state_of(model)
    h.close()
    return composed, resumed_from, actions, state


def test_harden_after_setup_keeps_fabrics_ddp_shards_the_plain_loader_and_resumes_bitwise(tmp_path):
    total = 16  # more than one epoch: 12 batches per rank per epoch
    straight = run_ranks(_train, 2, args=(str(tmp_path / "s"), total, total), init=False, timeout=TIMEOUT)
    first = run_ranks(_train, 2, args=(str(tmp_path / "r"), total, 9), init=False, timeout=TIMEOUT)
    second = run_ranks(_train, 2, args=(str(tmp_path / "r"), total, total), init=False, timeout=TIMEOUT)
    for rank in range(2):
        composed, resumed_from, actions, state = straight[rank]
        assert composed == {"same_model": True, "inner": "DistributedDataParallel", "loader": "SafeDataLoader",
                            "batches_per_epoch": 6, "watchdog": True, "agreement": "gradients"}
        assert resumed_from == 0 and actions[3] == "skip" and actions.count("skip") == 1
        assert first[rank][1] == 0 and second[rank][1] == 8  # the newest checkpoint before the stop at 9
        assert second[rank][2] == actions[8:]
        assert tr.bitwise_equal(second[rank][3], state)
    weights = [{k: v for k, v in out[3].items() if "running_" not in k and "num_batches" not in k} for out in straight]
    assert tr.bitwise_equal(*weights)  # DDP kept the ranks' parameters in step (BatchNorm statistics are per rank)


# ---------------------------------------------------------------------------------------------------- refusals
def _refusals(rank, ckpt):
    import robustdist
    from robustdist.runtime.errors import ConfigError

    robustdist.safe_init_process_group()
    fabric = _fabric()
    found = {}

    def attempt(name, fn):
        try:
            fn()
            found[name] = None
        except ConfigError as e:
            found[name] = str(e)

    model, optimizer = _setup(fabric)
    attempt("fsdp", lambda: robustdist.harden(model, None, {**OFF, "distributed": {"strategy": "fsdp"}}))
    h = robustdist.harden(model, None, OFF, optimizer=optimizer)
    attempt("twice", lambda: robustdist.harden(model, None, OFF))
    h.close()
    again = robustdist.harden(model, None, OFF, optimizer=optimizer)  # closed: the same Fabric model again
    found["again"] = again.model is model
    again.close()

    h = robustdist.harden(tr.make_model(1), tr.make_loader(), OFF)  # harden first, then Fabric over it
    fabric_loader = fabric.setup_dataloaders(h.loader)  # Fabric keeps a DistributedSampler: no reshard here
    attempt("setup_dataloaders", lambda: next(iter(fabric_loader)))
    wrapped, _ = fabric.setup(h.model, torch.optim.SGD(h.model.parameters(), lr=0.1))
    x, y = next(iter(h.loader))
    attempt("setup_after_harden", lambda: wrapped(x))
    h.close()

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("robustdist").addHandler(handler)
    model, optimizer = _setup(fabric, seed=2)
    prepared = fabric.setup_dataloaders(tr.make_loader())
    h = robustdist.harden(model, prepared, {**OFF, "checkpoint": {"dir": ckpt}}, optimizer=optimizer)
    found["prepared_loader_kept"] = h.loader is prepared
    found["warned"] = [r.getMessage() for r in records if "fabric.setup_dataloaders returned" in r.getMessage()]
    h.close()
    return found


def test_double_wraps_and_a_reset_epoch_are_refused_naming_fabric(tmp_path):
    for found in run_ranks(_refusals, 2, args=(str(tmp_path / "ckpt"),), init=False, timeout=TIMEOUT):
        assert "distributed.strategy is 'fsdp' but the model is one fabric.setup returned" in found["fsdp"]
        assert "an earlier harden() call hardened" in found["twice"]
        assert "was given to fabric.setup_dataloaders" in found["setup_dataloaders"]
        assert "fabric.to_device(batch)" in found["setup_dataloaders"]
        assert "called through Lightning Fabric (fabric.setup)" in found["setup_after_harden"]
        assert "fabric.setup(model, optimizer)" in found["setup_after_harden"]
        assert found["prepared_loader_kept"] is True and found["again"] is True
        assert len(found["warned"]) == 1 and "Give harden the plain DataLoader" in found["warned"][0]


def _inner_not_ddp(rank):
    """A Fabric module whose forward module is neither Fabric's DDP nor the bare model (here DataParallel)."""
    import robustdist
    from lightning.fabric.strategies import SingleDeviceStrategy
    from lightning.fabric.wrappers import _FabricModule

    from robustdist.runtime.errors import ConfigError

    bare = tr.make_model()
    module = _FabricModule(nn.DataParallel(bare), SingleDeviceStrategy(torch.device("cpu")), original_module=bare)
    try:
        robustdist.harden(module, None, OFF)
    except ConfigError as e:
        return str(e)
    return None


def test_a_model_fabric_wrapped_in_something_else_is_refused():
    message, = run_ranks(_inner_not_ddp, 1, init=False, timeout=TIMEOUT)
    assert "harden() was given a model Lightning Fabric wrapped in DataParallel" in message
    assert "Fabric(strategy='ddp')" in message


def _model_parallel(rank):
    """Fabric's ModelParallelStrategy sharding the model with FSDP2 (``fully_shard``) on 2 CPU ranks."""
    import robustdist
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from robustdist.runtime.errors import ConfigError

    def parallelize(model, mesh):
        return fully_shard(model, mesh=mesh["data_parallel"])

    fabric = Fabric(accelerator="cpu", devices=2,
                    strategy=ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1))
    fabric.launch()
    model = fabric.setup(tr.make_model())
    try:
        robustdist.harden(model, None, OFF)
    except ConfigError as e:
        return str(e)
    return None


def test_a_model_fabric_sharded_into_dtensors_is_refused_on_every_rank():
    for rank, message in enumerate(run_ranks(_model_parallel, 2, init=False, timeout=TIMEOUT)):
        assert message is not None and message.startswith(
            f"[rank {rank}] harden() was given a model Lightning Fabric wrapped in FSDPSequential with sharded "
            "(DTensor) parameters (its strategy ModelParallelStrategy); robustdist composes with Fabric's DDP and "
            "single-device strategies only"), message
        assert "Fix: Fabric(strategy='ddp'), or let harden shard the bare model" in message


def _single_device(rank):
    import robustdist
    from lightning.fabric import Fabric
    from lightning.fabric.plugins import MixedPrecision

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu")])  # fp16, a GradScaler
    model, optimizer = _setup(fabric)
    data = TensorDataset(torch.randn(8, 8), torch.randint(0, 4, (8,)))
    h = robustdist.harden(model, DataLoader(data, batch_size=4), OFF, optimizer=optimizer)
    scaler = fabric.strategy.precision.scaler
    out = (h.model is model, len(h.loader), type(model._forward_module).__name__,
           scaler is not None and h.guard.scaler is scaler)
    h.close()
    compiled, _ = fabric.setup(torch.compile(tr.make_model()), torch.optim.SGD(tr.make_model().parameters()))
    h = robustdist.harden(compiled, None, OFF)  # torch.compile before setup, as Lightning documents
    out = (*out, h.model is compiled)
    h.close()
    return out


def test_one_device_composes_keeping_the_bare_module_the_whole_loader_and_fabrics_scaler_compiled_too():
    assert run_ranks(_single_device, 1, init=False, timeout=TIMEOUT) == [(True, 2, "Sequential", True, True)]
