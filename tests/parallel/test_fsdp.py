"""fsdp_calibrate on real gloo ranks with FSDP2 (fully_shard runs on CPU): meshes, strategies, and checks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from robustdist.parallel.fsdp import fsdp_calibrate
from robustdist.runtime.errors import TopologyError
from robustdist.testing.ranks import run_ranks

TOTAL = 8  # samples per step in the reference; split evenly across ranks


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(TOTAL, 6, generator=g), torch.randn(TOTAL, 3, generator=g)


def _reference():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.item(), {k: v.detach().clone() for k, v in model.state_dict().items()}


def _calibrate_and_train(rank, nodes):
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    host = f"node{rank // (world // nodes)}"
    cal = fsdp_calibrate(hostname=host)
    model = _model()
    fully_shard(model, **cal.fully_shard_kwargs())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    per = TOTAL // world
    loss = nn.functional.mse_loss(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
    loss.backward()
    opt.step()
    losses = [None] * world
    dist.all_gather_object(losses, loss.item())
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in model.state_dict().items()}
    fsdp1 = cal.fsdp1_kwargs()  # built here; running FSDP1 itself needs an accelerator
    fsdp1_summary = (fsdp1["sharding_strategy"].name, str(fsdp1["device_id"]), isinstance(fsdp1.get("process_group"), tuple))
    return (cal.sharding_strategy, cal.mesh_shape, cal.mesh_dim_names, cal.num_nodes, cal.local_world_size,
            sum(losses) / world, full, fsdp1_summary)


def _node_env(world, nodes):
    per = world // nodes
    return [{"LOCAL_RANK": str(r % per), "LOCAL_WORLD_SIZE": str(per), "GROUP_RANK": str(r // per)}
            for r in range(world)]


@pytest.mark.processes
@pytest.mark.parametrize(("world", "nodes", "strategy", "shape", "names"), [
    (2, 1, "FULL_SHARD", (2,), ("shard",)),
    (4, 1, "FULL_SHARD", (4,), ("shard",)),
    (4, 2, "HYBRID_SHARD", (2, 2), ("replicate", "shard")),
])
def test_strategy_mesh_and_a_training_step_match_the_reference(fsdp_cpu, world, nodes, strategy, shape, names):
    ref_loss, ref_params = _reference()
    out = run_ranks(_calibrate_and_train, world, args=(nodes,), env=_node_env(world, nodes), timeout=120)
    for got_strategy, got_shape, got_names, num_nodes, local_world, loss, params, fsdp1 in out:
        assert (got_strategy, got_shape, got_names) == (strategy, shape, names)
        assert fsdp1 == (strategy, "cpu", strategy == "HYBRID_SHARD")
        assert (num_nodes, local_world) == (nodes, world // nodes)
        assert abs(loss - ref_loss) < 1e-5
        assert all(torch.allclose(params[k], ref_params[k], atol=1e-6) for k in ref_params)


def _hybrid_on_one_node(rank):
    cal = fsdp_calibrate(strategy="HYBRID_SHARD")
    return cal.sharding_strategy, cal.warnings


@pytest.mark.processes
def test_hybrid_on_one_node_degrades_with_a_warning():
    for strategy, warnings in run_ranks(_hybrid_on_one_node, 2, timeout=60):
        assert strategy == "FULL_SHARD" and "HYBRID_SHARD was requested on a single node" in warnings[0]


def _mismatch(rank, case):
    try:
        if case == "env":
            os.environ["WORLD_SIZE"] = "4"
            fsdp_calibrate()
        elif case == "uneven":
            fsdp_calibrate(hostname="node0" if rank < 3 else "node1")
        elif case == "gpus":
            fsdp_calibrate(visible_devices=[0, 1, 2, 3] if rank == 0 else [4, 5, 6, 7])
    except TopologyError as e:
        return str(e)
    return None


@pytest.mark.processes
def test_env_world_size_differs_from_the_group():
    for rank, message in enumerate(run_ranks(_mismatch, 2, args=("env",), timeout=60)):
        assert message == (f"[rank {rank}] WORLD_SIZE=4 in the environment but the process group has 2 ranks; "
                           "expected them to agree, or FSDP shards for one world while the launcher counts another. "
                           "Fix: do not override WORLD_SIZE after the launcher sets it, and create the group with the "
                           "launcher's ranks.")


@pytest.mark.processes
def test_uneven_nodes():
    for message in run_ranks(_mismatch, 4, args=("uneven",), env=_node_env(4, 2), timeout=60):
        assert "nodes run different numbers of ranks (node0: 3, node1: 1); expected the same on every node" in message
        assert "Fix: launch the same --nproc_per_node on every node" in message


@pytest.mark.processes
def test_a_process_seeing_four_gpus():
    # the seed's trap: 2 Ray workers granted 4 GPUs each, one process per worker
    for message in run_ranks(_mismatch, 2, args=("gpus",), timeout=60):
        assert "each process sees 4 GPUs" in message and "its node runs 2 process(es)" in message
        assert "6 of the job's 8 GPUs would sit idle while world_size counts 2 ranks" in message
        assert "Fix: in Ray Train use ScalingConfig(num_workers=8, resources_per_worker={'GPU': 1})" in message


def test_single_process_is_no_shard(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cal = fsdp_calibrate()
    assert (cal.sharding_strategy, cal.world_size, cal.mesh_shape) == ("NO_SHARD", 1, (1,))


# ---------------------------------------------------------------------------------------------- wrap_fsdp
D, V = 8, 16


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.o = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        return self.o(torch.tanh(self.q(x)))

    def reset_parameters(self):
        self.q.reset_parameters()
        self.o.reset_parameters()


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.attn, self.mlp = nn.LayerNorm(D), Attn(), Mlp()

    def forward(self, x):
        h = x + self.attn(self.norm(x))
        return h + self.mlp(h)

    def reset_parameters(self):
        self.norm.reset_parameters()
        self.attn.reset_parameters()
        self.mlp.up.reset_parameters()
        self.mlp.down.reset_parameters()


class Tiny(nn.Module):
    """Embedding, a ModuleList of blocks, a head, and a RoPE-like buffer that reset_parameters re-creates."""

    def __init__(self, full_reset=True):
        super().__init__()
        self.full_reset = full_reset
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, V)
        self.register_buffer("freqs", self._freqs(), persistent=False)

    @staticmethod
    def _freqs():
        return 1.0 / (100.0 ** (torch.arange(D, dtype=torch.float32) / D))

    def forward(self, tokens):
        h = self.emb(tokens) * self.freqs
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def reset_parameters(self):  # full_reset=False: like the upstream example, blocks are left out
        self.emb.reset_parameters()
        self.head.reset_parameters()
        if self.full_reset:
            for block in self.blocks:
                block.reset_parameters()
        self.freqs = self._freqs()


class NoInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.scale = nn.Parameter(torch.ones(D))

    def forward(self, x):
        return self.lin(x) * self.scale


def _meta(cls=Tiny, **kwargs):
    torch.manual_seed(0)
    with torch.device("meta"):
        return cls(**kwargs)


def _sharded(model):
    from torch.distributed.fsdp import FSDPModule

    return [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def _full_state(model):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def _tokens(n=4, seed=3):
    return torch.randint(0, V, (n, 5), generator=torch.Generator().manual_seed(seed))


def _policies_and_init(rank):
    import warnings

    from torch.distributed.fsdp import fully_shard

    from robustdist.config.schema import FsdpConfig
    from robustdist.parallel.fsdp import wrap_fsdp
    from robustdist.runtime.errors import ConfigError

    out = {}
    out["names"] = _sharded(wrap_fsdp(_meta(), FsdpConfig(shard_modules=("Block",))))
    out["callable"] = _sharded(wrap_fsdp(_meta(), shard_policy=lambda m: isinstance(m, Attn)))
    out["classes"] = _sharded(wrap_fsdp(_meta(), shard_policy=[Mlp, "Attn"]))
    auto = wrap_fsdp(_meta())
    out["auto"] = _sharded(auto)
    state = _full_state(auto)
    out["init_finite"] = all(bool(torch.isfinite(t).all()) for t in state.values())
    out["freqs"] = torch.equal(auto.freqs, Tiny._freqs())
    out["dtensors"] = all(type(p).__name__ == "DTensor" for p in auto.parameters())

    def halves(model):
        for p in model.parameters():
            p.fill_(0.5)
        model.freqs = torch.ones(D)

    custom = wrap_fsdp(_meta(), init_weights=halves)
    out["init_weights"] = all(bool((t == 0.5).all()) for k, t in _full_state(custom).items()) and \
        torch.equal(custom.freqs, torch.ones(D))
    try:
        wrap_fsdp(_meta(NoInit))
        out["no_init"] = None
    except ConfigError as e:
        out["no_init"] = str(e)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gaps = wrap_fsdp(_meta(full_reset=False))
    out["gaps_warning"] = [str(w.message) for w in caught if "reset_parameters() left" in str(w.message)]
    out["gaps_finite"] = all(bool(torch.isfinite(t).all()) for t in _full_state(gaps).values())
    # the user already sharded everything: left alone; only the blocks: only the root is added, on their mesh
    torch.manual_seed(0)
    mine = Tiny()
    for block in mine.blocks:
        fully_shard(block)
    fully_shard(mine)
    before = [id(p) for p in mine.parameters()]
    out["adopted"] = (wrap_fsdp(mine) is mine, _sharded(mine), before == [id(p) for p in mine.parameters()])
    partly = _meta()
    for block in partly.blocks:
        fully_shard(block)
    wrapped = wrap_fsdp(partly)
    out["root_only"] = (wrapped is partly, _sharded(partly),
                        partly.head.weight.device_mesh is partly.blocks[0].attn.q.weight.device_mesh)
    out["root_only_finite"] = all(bool(torch.isfinite(t).all()) for t in _full_state(partly).values())
    return out


@pytest.fixture(scope="module")
def policies_and_init(_gloo_averages):
    if not _gloo_averages:  # the module scope runs before the tests' own fsdp_cpu
        pytest.skip("this torch's gloo reduce-scatter sums for ReduceOp.AVG (pytorch#162338): FSDP2 cannot train "
                    "on the CPU here, and wrap_fsdp refuses it")
    return run_ranks(_policies_and_init, 2, timeout=150)


@pytest.mark.processes
@pytest.mark.xdist_group("fsdp_policies_and_init")  # one worker makes the run they read
def test_per_layer_policies_by_names_callable_classes_and_auto(fsdp_cpu, policies_and_init):
    for out in policies_and_init:
        assert out["names"] == ["", "blocks.0", "blocks.1"]
        assert out["callable"] == ["", "blocks.0.attn", "blocks.1.attn"]
        assert out["classes"] == ["", "blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp"]
        assert out["auto"] == ["", "blocks.0", "blocks.1"]


@pytest.mark.processes
@pytest.mark.xdist_group("fsdp_policies_and_init")  # one worker makes the run they read
def test_meta_model_is_sharded_then_initialised(fsdp_cpu, policies_and_init):
    for out in policies_and_init:
        assert out["init_finite"] and out["freqs"] and out["dtensors"]
        assert out["init_weights"]


@pytest.mark.processes
@pytest.mark.xdist_group("fsdp_policies_and_init")  # one worker makes the run they read
def test_meta_model_without_an_init_path_is_refused_on_every_rank(fsdp_cpu, policies_and_init):
    for rank, out in enumerate(policies_and_init):
        assert out["no_init"] == (
            f"[rank {rank}] NoInit was built on the meta device; after to_empty() and its submodules' "
            "reset_parameters() (NoInit has none itself), 1 tensor(s) are still uninitialised: scale; expected "
            "every parameter and buffer to be initialised (or re-created, for buffers). Fix: pass init_weights=fn "
            "(harden(..., init_weights=fn) or wrap_fsdp(..., init_weights=fn)), where fn(model) initialises them in "
            "place, or give their modules a reset_parameters().")


@pytest.mark.processes
@pytest.mark.xdist_group("fsdp_policies_and_init")  # one worker makes the run they read
def test_a_root_reset_that_misses_the_blocks_is_completed_with_a_warning(fsdp_cpu, policies_and_init):
    for out in policies_and_init:
        assert out["gaps_finite"]
        assert len(out["gaps_warning"]) == 1
        assert "Tiny.reset_parameters() left blocks.0.norm.weight" in out["gaps_warning"][0]
        assert "robustdist called reset_parameters() of blocks.0, blocks.1 for them" in out["gaps_warning"][0]


@pytest.mark.processes
@pytest.mark.xdist_group("fsdp_policies_and_init")  # one worker makes the run they read
def test_already_sharded_is_left_alone_and_sharded_blocks_get_only_the_root(fsdp_cpu, policies_and_init):
    for out in policies_and_init:
        assert out["adopted"] == (True, ["", "blocks.0", "blocks.1"], True)
        assert out["root_only"] == (True, ["", "blocks.0", "blocks.1"], True)
        assert out["root_only_finite"]


def _precision_offload_and_reference(rank):
    import torch.distributed.fsdp as fsdp_api

    from robustdist.config.schema import FsdpConfig
    from robustdist.parallel.fsdp import wrap_fsdp

    out = {}
    real, calls = fsdp_api.fully_shard, []

    def recording(module, **kwargs):
        calls.append(kwargs)
        return real(module, **kwargs)

    fsdp_api.fully_shard = recording
    try:
        model = wrap_fsdp(_meta(), FsdpConfig(mixed_precision="bf16", cpu_offload=True, reshard_after_forward=False))
    finally:
        fsdp_api.fully_shard = real
    out["calls"] = [(type(k["mp_policy"]).__name__, k["mp_policy"].param_dtype, k["mp_policy"].reduce_dtype,
                     type(k["offload_policy"]).__name__, k["reshard_after_forward"]) for k in calls]
    seen = []
    model.blocks[0].attn.q.register_forward_hook(lambda m, i, o: seen.append(m.weight.dtype))
    model(_tokens()).float().mean().backward()
    out["forward_dtype"], out["grad_dtype"] = seen, model.head.weight.grad.dtype
    # NO_SHARD: replicated (a (world, 1) mesh), every rank holds the whole parameter
    ns = wrap_fsdp(_meta(), FsdpConfig(sharding="NO_SHARD"))
    out["no_shard"] = (tuple(ns.head.weight.to_local().shape), tuple(ns.head.weight.device_mesh.shape))
    # per-layer sharding trains exactly like one process on the whole batch
    torch.manual_seed(0)
    model = wrap_fsdp(Tiny())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens, targets = _tokens(), _tokens(seed=4)
    half = slice(rank * 2, rank * 2 + 2)
    nn.functional.cross_entropy(model(tokens[half]).flatten(0, 1), targets[half].flatten()).backward()
    opt.step()
    out["trained"] = _full_state(model)
    return out


def _reference_step():
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    nn.functional.cross_entropy(model(_tokens()).flatten(0, 1), _tokens(seed=4).flatten()).backward()
    opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.processes
def test_mixed_precision_offload_no_shard_and_a_step_that_matches_one_process(fsdp_cpu):
    reference = _reference_step()
    for out in run_ranks(_precision_offload_and_reference, 2, timeout=150):
        assert out["calls"] == [("MixedPrecisionPolicy", torch.bfloat16, torch.float32, "CPUOffloadPolicy", False)] * 3
        assert out["forward_dtype"] == [torch.bfloat16] and out["grad_dtype"] == torch.float32
        assert out["no_shard"] == ((V, D), (2, 1))
        assert all(torch.allclose(out["trained"][k], reference[k], atol=1e-6) for k in reference)


# ---------------------------------------------------------------------------------------------- one process
@pytest.fixture
def no_launcher(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_PROCID",
                "SLURM_NTASKS", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


def test_one_process_materialises_a_meta_model_unsharded(no_launcher):
    from robustdist.parallel.fsdp import wrap_fsdp

    model = _meta()
    assert wrap_fsdp(model) is model and _sharded(model) == []
    assert all(t.device.type == "cpu" and bool(torch.isfinite(t).all()) for t in model.state_dict().values())
    torch.manual_seed(0)
    assert torch.equal(model.freqs, Tiny._freqs()) and model(_tokens()).shape == (4, 5, V)


@pytest.mark.processes
def test_fully_shard_gets_the_policies_bottom_up(fsdp_cpu, no_launcher, monkeypatch):
    # patch-and-assert: what reaches fully_shard, in which order, without processes
    import torch.distributed.fsdp as fsdp_api

    from robustdist.config.schema import FsdpConfig
    from robustdist.parallel.fsdp import Calibration, wrap_fsdp
    from robustdist.parallel.syncbn import SyncBatchNorm
    from robustdist.runtime import dist as _dist

    calls = []
    monkeypatch.setattr(fsdp_api, "fully_shard", lambda module, **kw: calls.append((module, kw)))
    monkeypatch.setattr(_dist, "is_multi", lambda group=None: True)
    monkeypatch.setattr(_dist, "world_size", lambda group=None: 2)
    mesh = type("FakeMesh", (), {"shape": (2,), "size": lambda self: 2})()
    monkeypatch.setattr(Calibration, "device_mesh", lambda self: mesh)
    cal = Calibration(2, 0, 2, 1, 0, torch.device("cpu"), 0, (2,), ("shard",), "FULL_SHARD")
    model = Tiny()
    wrap_fsdp(model, FsdpConfig(mixed_precision="fp16", cpu_offload=True), calibration=cal)
    assert [m for m, _ in calls] == [model.blocks[1], model.blocks[0], model]
    for _, kw in calls:
        assert kw["mesh"] is mesh and kw["reshard_after_forward"] is True
        assert (kw["mp_policy"].param_dtype, kw["mp_policy"].reduce_dtype) == (torch.float16, torch.float32)
        assert type(kw["offload_policy"]).__name__ == "CPUOffloadPolicy"
        assert kw["offload_policy"].pin_memory == torch.cuda.is_available()
    calls.clear()
    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    wrap_fsdp(bn, calibration=cal)
    assert isinstance(bn[1], SyncBatchNorm) and [m for m, _ in calls] == [bn] and "mp_policy" not in calls[0][1]
    wrap_fsdp(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), calibration=cal, sync_batchnorm=False)
    assert type(calls[-1][0][1]) is nn.BatchNorm1d


def test_a_class_name_that_matches_nothing(no_launcher):
    from robustdist.config.schema import FsdpConfig
    from robustdist.parallel.fsdp import wrap_fsdp
    from robustdist.runtime.errors import ConfigError

    with pytest.raises(ConfigError) as exc:
        wrap_fsdp(_meta(), FsdpConfig(shard_modules=("Blok", "Mlp")))
    assert str(exc.value) == (
        "fsdp.shard_modules names 'Blok', but no module of Tiny is of that class (did you mean 'Block' for 'Blok'?); "
        "expected class names of its modules: Attn, Block, Embedding, LayerNorm, Linear, Mlp, ModuleList, Tiny. "
        "Fix: correct fsdp.shard_modules, or use 'auto'.")
    with pytest.raises(ConfigError, match=r"^shard_policy names 'NoInit', but no module of Tiny is of that class; "
                                          r"expected class names of its modules: Attn, .*Fix: pass classes"):
        wrap_fsdp(_meta(), shard_policy={NoInit})
    with pytest.raises(ConfigError, match=r"^shard_policy=3; expected module classes, class names, or a callable"):
        wrap_fsdp(_meta(), shard_policy=3)


def test_meta_errors_in_one_process(no_launcher):
    from robustdist.parallel.fsdp import wrap_fsdp
    from robustdist.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^NoInit was built on the meta device; .* 1 tensor\(s\) are still "
                                          r"uninitialised: scale; .*Fix: pass init_weights=fn"):
        wrap_fsdp(_meta(NoInit))
    half = _meta()
    half.head = nn.Linear(D, V)
    with pytest.raises(ConfigError, match=r"^Tiny has 22 tensor\(s\) on the meta device \(emb.weight, .*\) and 2 "
                                          r"elsewhere \(head.weight, head.bias\); expected all of them on meta"):
        wrap_fsdp(half)


def test_calibrating_before_the_group_exists_is_refused(no_launcher, monkeypatch):
    from robustdist.parallel.fsdp import wrap_fsdp

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(TopologyError) as exc:
        fsdp_calibrate()
    assert str(exc.value) == (
        "[rank 1] fsdp_calibrate() found no process group, but WORLD_SIZE=2 in the environment says the world has 2 "
        "ranks; expected the group of 2 ranks to exist first, or FSDP is calibrated for a 1-rank world and fails "
        "later (an IndexError in device_mesh). Fix: call robustdist.safe_init_process_group() (or harden(), which "
        "creates it) before fsdp_calibrate() and wrap_fsdp().")
    with pytest.raises(TopologyError, match="found no process group, but WORLD_SIZE=2"):
        wrap_fsdp(_meta())


def test_auto_picks_the_outermost_module_lists_only():
    from robustdist.parallel.fsdp_wrap import resolve_policy, select_modules

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
            self.acts = nn.ModuleList([nn.ReLU()])

    model = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([Experts(), Experts(), nn.ReLU()]))
    for policy in (None, "auto"):
        predicate, _ = resolve_policy(policy, "auto", model)
        assert [name for name, _ in select_modules(model, predicate)] == ["1.1", "1.0"]  # children first
    predicate, _ = resolve_policy(None, "auto", nn.Sequential(nn.Linear(2, 2)))
    assert select_modules(nn.Sequential(nn.Linear(2, 2)), predicate) == []  # no list: the root only


@pytest.mark.processes
def test_fsdp_on_a_torch_that_cannot_run_it_on_cpu_is_refused_with_the_version(monkeypatch):
    """torch 2.6's ``torch.cpu.Stream`` has no ``record_event``, which FSDP2's all-gather calls on the CPU: the
    capability is what is checked (the attribute is removed here to stand for that torch; the lanes run the
    real FSDP tests on every supported torch)."""
    from robustdist.parallel import fsdp

    assert fsdp.fsdp2_missing("cpu") is None  # every supported torch runs FSDP2 on the CPU
    monkeypatch.delattr(torch.cpu.Stream, "record_event")
    assert "record_event" in fsdp.fsdp2_missing("cpu")

    messages = run_ranks(_wrap_without_record_event, world_size=2, timeout=120)
    for rank, message in enumerate(messages):
        assert message is not None, f"rank {rank} sharded on a torch without record_event"
        assert f"[rank {rank}]" in message and "torch >= 2.7" in message and "Fix:" in message


def _wrap_without_record_event(rank):
    from robustdist.parallel import fsdp
    from robustdist.runtime.errors import UnsupportedVersionError

    del torch.cpu.Stream.record_event  # this process only: stands for torch 2.6
    try:
        fsdp.wrap_fsdp(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), device="cpu")
    except UnsupportedVersionError as e:
        return str(e)
    return None


def _wrap_on_this_torch(rank):
    from robustdist.parallel import fsdp
    from robustdist.runtime.errors import UnsupportedVersionError

    try:
        fsdp.wrap_fsdp(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), device="cpu")
    except UnsupportedVersionError as e:
        return fsdp.gloo_averages(), str(e)
    return fsdp.gloo_averages(), None


@pytest.mark.processes
def test_fsdp_is_refused_on_cpu_where_gloo_sums_instead_of_averaging():
    """torch 2.8's gloo reduce-scatter sums for ReduceOp.AVG (pytorch#162338): FSDP2 on the CPU would train with
    world-size times the gradient. The probe is real in every lane: refused there, wrapped where gloo averages."""
    for averages, message in run_ranks(_wrap_on_this_torch, world_size=2, timeout=120):
        if averages:
            assert message is None
        else:
            assert message is not None and "ReduceOp.AVG" in message and "pytorch/pytorch#162338" in message
            assert "torch >= 2.13" in message and "Fix:" in message
