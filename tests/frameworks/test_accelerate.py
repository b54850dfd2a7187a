"""robustdist inside Accelerate: harden composes with what ``accelerator.prepare`` returned (its DDP and
its sampler kept, the watchdog and step guard added), refuses the two double-wrap orders with a named error, and
``robustdist.frameworks.accelerate.save_state``/``load_state`` make Accelerate's checkpoints atomic and verified.

Every Accelerator lives in a process of its own (``run_ranks``): Accelerate keeps process-global state, which
would leak into the other tests of a pytest worker.
"""

from __future__ import annotations

import gc
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from robustdist.testing.ranks import run_ranks
from tests import _training as tr

pytest.importorskip("accelerate")

OFF = {"health": {"hang_timeout": None}}
TIMEOUT = 150


def _accelerator(**kwargs):
    from accelerate import Accelerator

    return Accelerator(cpu=True, **kwargs)


def _loader(n: int = 32) -> DataLoader:
    g = torch.Generator().manual_seed(3)
    return DataLoader(TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)),
                      batch_size=4, shuffle=False)


# ---------------------------------------------------------------------------------------------------- composition
def _compose(rank):
    import robustdist
    from robustdist import harden
    from robustdist.runtime.errors import ConfigError

    robustdist.safe_init_process_group()
    accelerator = _accelerator()
    model, optimizer = tr.make_model(), None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, _loader())
    try:
        harden(model, loader, {**OFF, "distributed": {"strategy": "fsdp"}}, optimizer=optimizer)
        fsdp_refusal = None
    except ConfigError as e:
        fsdp_refusal = str(e)
    h = harden(model, loader, {"health": {"hang_timeout": 60.0, "nan_policy": "skip"}}, optimizer=optimizer)
    seen, actions = [], []
    for step, (x, y) in enumerate(h.loader):
        seen.extend(y.tolist())
        loss = nn.functional.cross_entropy(h.model(x), y)
        if step == 2:
            loss = loss * float("nan")
        accelerator.backward(loss)
        decision = h.step_guard(loss, step)
        actions.append(decision.action)
        if decision:
            optimizer.step()
        optimizer.zero_grad()
    out = {"same_model": h.model is model, "same_loader": h.loader is loader, "batches": len(actions),
           "labels": seen, "actions": actions, "watchdog": h.watchdog is not None, "fsdp": fsdp_refusal,
           "ddp_type": type(h.model).__module__ + "." + type(h.model).__name__}
    h.close()
    return out


@pytest.mark.processes
def test_harden_after_prepare_keeps_accelerates_ddp_and_sampler_and_adds_the_guards():
    outs = run_ranks(_compose, 2, init=False, timeout=TIMEOUT)
    labels = _loader().dataset.tensors[1].tolist()
    for rank, out in enumerate(outs):
        assert out["same_model"] and out["same_loader"]  # nothing wrapped twice
        assert out["ddp_type"] == "torch.nn.parallel.distributed.DistributedDataParallel"  # Accelerate's own
        assert out["batches"] == 4  # 32 samples, batch 4, 2 ranks: each rank sees its half once, not a quarter
        assert out["watchdog"]
        assert out["actions"][2] == "skip" and out["actions"].count("skip") == 1  # the step guard, with nan_policy
        assert out["fsdp"].startswith(f"[rank {rank}] distributed.strategy is 'fsdp' while an Accelerator is in "
                                      "charge of this process")
    assert sorted(outs[0]["labels"] + outs[1]["labels"]) == sorted(labels)  # the two halves make the whole


def _harden_first(rank):
    from robustdist import harden
    from robustdist.runtime.errors import ConfigError

    _accelerator()
    try:
        harden(tr.make_model(), _loader(), OFF)
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.processes
def test_harden_before_prepare_is_refused_when_the_accelerator_exists():
    for rank, message in enumerate(run_ranks(_harden_first, 2, init=False, timeout=TIMEOUT)):
        assert message is not None and message.startswith(
            f"[rank {rank}] harden() was given a bare Sequential while an Accelerator of 2 processes is in charge "
            "of this process: accelerator.prepare would then wrap harden's DDP in a second one")
        assert "model, optimizer, loader = accelerator.prepare(model, optimizer, loader) first" in message


def _prepare_after(rank):
    from robustdist import harden
    from robustdist.runtime.errors import ConfigError

    h = harden(tr.make_model(), _loader(), OFF)  # no Accelerator yet: harden wraps and shards
    accelerator = _accelerator()  # adopts harden's group
    model = accelerator.prepare(h.model)  # h.loader prepared too is refused at its first batch (below)
    x, y = next(iter(h.loader))
    try:
        model(x)
    except ConfigError as e:
        return str(e)
    finally:
        del model  # Accelerate's DDP goes while the group it uses exists (torch 2.8 could hang freeing it after)
        gc.collect()
        h.close()
    return None


@pytest.mark.processes
def test_prepare_of_a_hardened_model_is_refused_at_its_first_forward():
    for rank, message in enumerate(run_ranks(_prepare_after, 2, init=False, timeout=TIMEOUT)):
        assert message is not None and message.startswith(
            f"[rank {rank}] the model robustdist wrapped in DDP (harden or wrap_ddp) was called through a second "
            "DistributedDataParallel (accelerator.prepare, ray.train.torch.prepare_model or DDP(...) applied to the "
            "model robustdist returned)")


def _prepare_the_hardened_loader(rank):
    """harden first, then ``accelerator.prepare(h.loader)`` alone (the model left as harden wrapped it), with
    ``dispatch_batches`` too, a loader with a DistributedSampler of its own, and Accelerate's
    ``skip_first_batches(h.loader, 1)``: each reads harden's sharded sampler through a loader of Accelerate's own.
    Then the supported use: h.loader iterated directly, also from inside Accelerate's own helper
    (``find_executable_batch_size``, which calls the training function), every rank its own half."""
    from accelerate import skip_first_batches
    from accelerate.utils import DataLoaderConfiguration, find_executable_batch_size
    from torch.utils.data.distributed import DistributedSampler

    from robustdist import harden
    from robustdist.runtime.errors import ConfigError

    h = harden(tr.make_model(), _loader(), OFF)
    dataset = _loader().dataset
    own = harden(tr.make_model(), DataLoader(dataset, batch_size=4, sampler=DistributedSampler(
        dataset, num_replicas=2, rank=rank, shuffle=False)), OFF).loader
    accelerator = _accelerator()
    dispatching = _accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    found = {}
    for name, make in (("prepare", lambda: accelerator.prepare(h.loader)),
                       ("dispatch", lambda: dispatching.prepare(h.loader)),
                       ("own_sampler", lambda: accelerator.prepare(own)),
                       ("skip", lambda: skip_first_batches(h.loader, 1))):
        loader = make()
        try:
            found[name] = f"{len(list(loader))} batches"
        except ConfigError as e:
            found[name] = str(e)

    @find_executable_batch_size(starting_batch_size=4)
    def inside_accelerate(batch_size):
        return [int(i) for x, y in h.loader for i in y]

    found["direct"] = [int(i) for x, y in h.loader for i in y]
    found["inside_accelerate"] = inside_accelerate()
    h.close()
    return found


@pytest.mark.processes
def test_preparing_the_hardened_loader_is_refused_on_every_rank_before_its_first_batch():
    out = run_ranks(_prepare_the_hardened_loader, 2, init=False, timeout=TIMEOUT)
    for rank, found in enumerate(out):
        for name in ("prepare", "dispatch", "own_sampler", "skip"):
            assert found[name].startswith(
                f"[rank {rank}] Accelerate is reading the sampler of a loader robustdist sharded over 2 ranks "
                "(h.loader, or safe_dataloader) through a loader of its own: accelerator.prepare(h.loader) would "
                "shard its batches a second time"), (name, found[name])
            assert "Fix: leave h.loader out of accelerator.prepare and iterate it" in found[name]
    _, labels = _loader().dataset.tensors
    assert len(out[0]["direct"]) == len(out[1]["direct"]) == 16  # each rank half of the 32 samples, not a quarter
    assert sorted(out[0]["direct"] + out[1]["direct"]) == sorted(labels.tolist())
    assert [found["inside_accelerate"] for found in out] == [found["direct"] for found in out]


def _fsdp2_sharded_under_accelerate(rank):
    """What Accelerate's FSDP2 plugin hands back (a model fully_shard sharded) given to harden while the
    Accelerator is in charge. On the CPU Accelerate runs DDP whatever the plugin says, so the sharding is done by
    fully_shard directly, on the same gloo group."""
    import robustdist
    from torch.distributed.fsdp import fully_shard

    from robustdist.runtime.errors import ConfigError

    robustdist.safe_init_process_group()
    _accelerator()
    model = tr.make_model()
    fully_shard(model)
    try:
        robustdist.harden(model, None, OFF)
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.processes
def test_a_model_fsdp2_sharded_under_an_accelerator_is_refused_on_every_rank():
    for rank, message in enumerate(run_ranks(_fsdp2_sharded_under_accelerate, 2, init=False, timeout=TIMEOUT)):
        assert message is not None and message.startswith(
            f"[rank {rank}] harden() was given a Sequential sharded by FSDP2 (fully_shard: Accelerate's FSDP plugin, "
            "or the script's own) or split by tensor parallelism (DTensor parameters) while an Accelerator is in "
            "charge of this process"), message
        assert "Fix: drop the FSDP plugin (Accelerate then uses DDP)" in message


def _one_process_mixed_precision(rank):
    from robustdist import harden

    accelerator = _accelerator(mixed_precision="bf16")
    model = accelerator.prepare(nn.Linear(2, 2))  # one process: no DDP, Accelerate's autocast forward
    with harden(model, None, OFF) as h:
        return h.model is model


@pytest.mark.processes
def test_one_process_prepared_model_composes_too():
    assert run_ranks(_one_process_mixed_precision, 1, init=False, timeout=TIMEOUT,
                     env={"RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None, "LOCAL_WORLD_SIZE": None,
                          "MASTER_ADDR": None, "MASTER_PORT": None}) == [True]


# ------------------------------------------------------------------------------------------- save_state/load_state
class _Counter:
    """An object registered for checkpointing (Accelerate's custom_checkpoint_<i>.pkl)."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def _prepared(seed: int = 0):
    accelerator = _accelerator()
    model = tr.make_model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    counter = _Counter()
    accelerator.register_for_checkpointing(counter)
    return accelerator, model, optimizer, counter


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _save_three(rank, directory):
    from robustdist.frameworks import accelerate as rda

    accelerator, model, optimizer, counter = _prepared()
    kept = {}
    for step in (1, 2, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(step)
        counter.value = step
        rda.save_state(accelerator, directory, step, keep_last=2)
        kept[step] = _weights(model)
    return kept, rda.committed_states(directory)


def _load(rank, directory):
    from robustdist.frameworks import accelerate as rda

    accelerator, model, optimizer, counter = _prepared(seed=5)
    try:
        step = rda.load_state(accelerator, directory)
    except Exception as e:
        return type(e).__name__, str(e)
    return step, _weights(model), counter.value


@pytest.fixture(scope="module")
def _three_saved(tmp_path_factory):
    """Steps 1, 2 and 3 saved by 2 ranks with ``keep_last=2``, once per module: the tests damage copies of it."""
    directory = str(tmp_path_factory.mktemp("three") / "ckpt")
    outs = run_ranks(_save_three, 2, init=True, timeout=TIMEOUT, args=(directory,))
    kept, committed = outs[0]
    assert committed == [2, 3] and outs[1][1] == [2, 3]  # keep_last=2
    return Path(directory), kept


@pytest.fixture
def three(_three_saved, tmp_path):
    """A test's own copy of the module's saved checkpoints (a deterministic save: a copy is what a save of its
    own would leave), and the weights each step saved."""
    saved, kept = _three_saved
    directory = tmp_path / "ckpt"
    shutil.copytree(saved, directory, symlinks=True)
    return directory, kept


def _load_all(directory: Path):
    return run_ranks(_load, 2, init=True, timeout=TIMEOUT, args=(str(directory),))


@pytest.mark.processes
@pytest.mark.xdist_group("accelerate_three_saved")  # one worker saves the three steps they copy
def test_the_newest_checkpoint_loads_bitwise_with_its_registered_objects(three):
    directory, kept = three
    names = sorted(p.name for p in (directory / "checkpoint_3").iterdir())
    assert "robustdist-manifest.json" in names and "random_states_1.pkl" in names and "model.safetensors" in names
    assert not [p for p in directory.iterdir() if p.name.startswith(".")]  # no staging or trash left behind
    for step, weights, value in _load_all(directory):
        assert step == 3 and value == 3
        assert tr.bitwise_equal({k.removeprefix("module."): v for k, v in weights.items()},
                                {k.removeprefix("module."): v for k, v in kept[3].items()})


@pytest.mark.processes
def test_an_empty_directory_is_a_fresh_start(tmp_path):
    assert [out[0] for out in _load_all(tmp_path / "none")] == [None, None]


def _damage_truncate(folder: Path) -> None:
    target = folder / "model.safetensors"
    target.write_bytes(target.read_bytes()[:-10])


def _damage_flip(folder: Path) -> None:
    target = folder / "optimizer.bin"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))


def _damage_unlisted(folder: Path) -> None:
    (folder / "custom_checkpoint_1.pkl").write_bytes((folder / "custom_checkpoint_0.pkl").read_bytes())


def _damage_link(folder: Path) -> None:
    (folder / "optimizer.bin").unlink()
    (folder / "optimizer.bin").symlink_to("/etc/hostname")


def _damage_manifest(folder: Path) -> None:
    (folder / "robustdist-manifest.json").write_text("{not json")


def _damage_missing(folder: Path) -> None:
    (folder / "random_states_1.pkl").unlink()


class _Runs:
    def __reduce__(self):
        return (os.system, ("touch /tmp/robustdist-accelerate-pwned",))


def _damage_code(folder: Path) -> None:
    """A custom checkpoint that runs code when unpickled with weights_only=False, its manifest entry updated."""
    import json
    import zlib

    target = folder / "custom_checkpoint_0.pkl"
    torch.save({"value": _Runs()}, target)
    manifest = json.loads((folder / "robustdist-manifest.json").read_text())
    data = target.read_bytes()
    manifest["files"]["custom_checkpoint_0.pkl"] = {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    (folder / "robustdist-manifest.json").write_text(json.dumps(manifest))


def _damage_zipbomb(folder: Path) -> None:
    import json
    import zlib

    target = folder / "scheduler_like.bin"
    with zipfile.ZipFile(target, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", pickle.dumps({}) + b"\0" * (1 << 20))
    manifest = json.loads((folder / "robustdist-manifest.json").read_text())
    data = target.read_bytes()
    manifest["files"]["scheduler_like.bin"] = {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    (folder / "robustdist-manifest.json").write_text(json.dumps(manifest))


@pytest.mark.processes
@pytest.mark.parametrize(("damage", "why"), [
    (_damage_truncate, r"model\.safetensors: \d+ bytes, expected \d+ \(truncated or extended\)"),
    (_damage_flip, r"optimizer\.bin: its CRC-32 differs from the manifest's"),
    (_damage_unlisted, r"holds 'custom_checkpoint_1\.pkl', which its manifest does not list"),
    (_damage_link, r"optimizer\.bin: .*(link|regular file)"),
    (_damage_manifest, r"robustdist-manifest\.json: not JSON"),
    (_damage_missing, r"random_states_1\.pkl"),
    (_damage_code, r"custom_checkpoint_0\.pkl: does not load with weights_only=True"),
    (_damage_zipbomb, r"holds compressed members"),
], ids=["truncated", "bit-flip", "unlisted-file", "symlink", "manifest", "missing-file", "code", "zip-bomb"])
@pytest.mark.xdist_group("accelerate_three_saved")  # one worker saves the three steps they copy
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(three, damage, why, caplog):
    directory, kept = three
    damage(directory / "checkpoint_3")
    marker = Path("/tmp/robustdist-accelerate-pwned")
    marker.unlink(missing_ok=True)
    for step, weights, value in _load_all(directory):
        assert step == 2 and value == 2  # the older one, whole
        assert tr.bitwise_equal({k.removeprefix("module."): v for k, v in weights.items()},
                                {k.removeprefix("module."): v for k, v in kept[2].items()})
    assert not marker.exists()
    # the refusal names the file: check it from the library directly, in this process
    from robustdist.frameworks.accelerate import _verify
    from robustdist.runtime.errors import CheckpointCorruptError

    with pytest.raises(CheckpointCorruptError, match=why):
        for rank in range(2):  # each rank checks its share of the files; together they check all
            _verify(str(directory / "checkpoint_3"), 3, rank, 2)


@pytest.mark.processes
@pytest.mark.xdist_group("accelerate_three_saved")  # one worker saves the three steps they copy
def test_when_no_checkpoint_verifies_the_error_names_each(three):
    directory, _ = three
    _damage_flip(directory / "checkpoint_3")
    _damage_manifest(directory / "checkpoint_2")
    for name, message in _load_all(directory):
        assert name == "CheckpointCorruptError"
        assert "none of its 2 committed checkpoint(s) verifies: checkpoint_3 refused" in message
        assert "checkpoint_2 refused" in message and "Fix: restore the folder from a copy" in message


@pytest.mark.processes
@pytest.mark.xdist_group("accelerate_three_saved")  # one worker saves the three steps they copy
def test_staging_links_and_foreign_names_are_never_checkpoints(three, tmp_path):
    directory, _ = three
    (directory / ".tmp-checkpoint_9-abc").mkdir()  # a save killed before its commit
    (directory / ".tmp-checkpoint_9-abc" / "model.safetensors").write_bytes(b"half")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (directory / "checkpoint_8").symlink_to(elsewhere)
    (directory / "checkpoint_x").mkdir()
    from robustdist.frameworks.accelerate import committed_states

    assert committed_states(directory) == [2, 3]
    assert [out[0] for out in _load_all(directory)] == [3, 3]


def _auto_naming(rank, directory):
    from accelerate.utils import ProjectConfiguration

    from robustdist.frameworks import accelerate as rda
    from robustdist.runtime.errors import ConfigError

    accelerator = _accelerator(project_config=ProjectConfiguration(project_dir=directory,
                                                                   automatic_checkpoint_naming=True))
    out = []
    for call in (lambda: rda.save_state(accelerator, directory, 1), lambda: rda.load_state(accelerator, directory),
                 lambda: rda.save_state(object(), directory, 1), lambda: rda.save_state(_accelerator(), directory, -1)):
        try:
            call()
            out.append(None)
        except ConfigError as e:
            out.append(str(e))
    return out


@pytest.mark.processes
def test_misuse_is_a_named_config_error(tmp_path):
    (out,) = run_ranks(_auto_naming, 1, init=False, timeout=TIMEOUT, args=(str(tmp_path),),
                       env={"RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None, "LOCAL_WORLD_SIZE": None,
                            "MASTER_ADDR": None, "MASTER_PORT": None})
    assert out[0].startswith("robustdist.frameworks.accelerate.save_state: the Accelerator has ProjectConfiguration("
                             "automatic_checkpoint_naming=True)")
    assert out[1].startswith("robustdist.frameworks.accelerate.load_state: the Accelerator has ProjectConfiguration(")
    assert out[2].startswith("robustdist.frameworks.accelerate.save_state was given object; expected an "
                             "accelerate.Accelerator")
    assert out[3].startswith("save_state(step=-1); expected an int in [0, 10**18)")
    assert not list(tmp_path.iterdir())  # nothing written


# ------------------------------------------------------------------------------------- a reviewer's second round
def _damage_polyglot(folder: Path) -> None:
    """A pickle before a valid zip: zipfile finds the zip at the end, torch.load reads the leading pickle."""
    import json
    import zlib

    target = folder / "optimizer.bin"
    data = pickle.dumps({"state": {}, "param_groups": []}, protocol=2) + target.read_bytes()
    target.write_bytes(data)
    manifest = json.loads((folder / "robustdist-manifest.json").read_text())
    manifest["files"]["optimizer.bin"] = {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    (folder / "robustdist-manifest.json").write_text(json.dumps(manifest))


def _damage_deep_manifest(folder: Path) -> None:
    (folder / "robustdist-manifest.json").write_text("[" * 200_000 + "]" * 200_000)


@pytest.mark.processes
@pytest.mark.parametrize(("damage", "why"), [
    (_damage_polyglot, r"optimizer\.bin: not a torch zip file \(it does not start with a zip header"),
    (_damage_deep_manifest, r"robustdist-manifest\.json: (not JSON|unreadable)"),
], ids=["pickle-before-zip", "deep-manifest"])
@pytest.mark.xdist_group("accelerate_three_saved")  # one worker saves the three steps they copy
def test_hostile_files_that_pass_a_lax_check_are_refused(three, damage, why):
    directory, kept = three
    damage(directory / "checkpoint_3")
    assert [out[0] for out in _load_all(directory)] == [2, 2]
    from robustdist.frameworks.accelerate import _verify
    from robustdist.runtime.errors import CheckpointCorruptError

    with pytest.raises((CheckpointCorruptError, RecursionError), match=why):
        for rank in range(2):
            try:
                _verify(str(directory / "checkpoint_3"), 3, rank, 2)
            except RecursionError as e:  # load_state names it (checked above by the fallback); _verify alone is raw
                raise CheckpointCorruptError(f"robustdist-manifest.json: unreadable ({e})") from None


def _save_after_fallback(rank, directory):
    from robustdist.frameworks import accelerate as rda

    accelerator, model, optimizer, counter = _prepared()
    loaded = rda.load_state(accelerator, directory)
    counter.value = 99
    rda.save_state(accelerator, directory, 110, keep_last=2)
    return loaded, rda.committed_states(directory), rda.load_state(accelerator, directory)


@pytest.mark.processes
@pytest.mark.xdist_group("accelerate_three_saved")  # one worker saves the three steps they copy
def test_a_save_after_a_fallback_is_the_newest_and_the_abandoned_ones_are_kept_aside(three):
    directory, _ = three  # steps 2 and 3 kept
    (directory / "checkpoint_3" / "robustdist-manifest.json").write_text("{")  # 3 refused: resume from 2
    for loaded, committed, again in run_ranks(_save_after_fallback, 2, init=True, timeout=TIMEOUT,
                                              args=(str(directory),)):
        assert loaded == 2 and committed == [2, 110] and again == 110
    assert [p.name.split("-")[1] for p in directory.iterdir() if p.name.startswith(".rejected-")] == ["checkpoint_3"]


@pytest.mark.processes
@pytest.mark.xdist_group("accelerate_three_saved")  # one worker saves the three steps they copy
def test_a_resave_killed_between_its_renames_keeps_its_committed_copy(three):
    directory, kept = three
    (directory / "checkpoint_3").rename(directory / ".old-checkpoint_3-0123abcd")  # the instant between renames
    from robustdist.frameworks.accelerate import committed_states

    assert committed_states(directory) == [2, 3]
    for step, weights, value in _load_all(directory):
        assert step == 3 and value == 3


@pytest.mark.processes
@pytest.mark.xdist_group("accelerate_three_saved")  # one worker saves the three steps they copy
def test_leading_zero_twins_and_accelerates_own_folders_are_not_checkpoints_and_never_deleted(three, caplog):
    directory, _ = three
    shutil.copytree(directory / "checkpoint_2", directory / "checkpoint_0002")
    shutil.copytree(directory / "checkpoint_3", directory / "checkpoint_4")
    (directory / "checkpoint_4" / "robustdist-manifest.json").unlink()  # as accelerator.save_state leaves it
    (directory / "checkpoint_4" / "notes.txt").write_text("mine")
    from robustdist.frameworks.accelerate import committed_states

    assert committed_states(directory) == [2, 3]
    assert [out[0] for out in _load_all(directory)] == [3, 3]
    outs = run_ranks(_save_step, 2, init=True, timeout=TIMEOUT, args=(str(directory), 4))
    assert all(o.startswith("CheckpointError") and "robustdist did not commit it" in o for o in outs), outs
    assert (directory / "checkpoint_4" / "notes.txt").read_text() == "mine"


def _save_step(rank, directory, step):
    from robustdist.frameworks import accelerate as rda

    accelerator, *_ = _prepared()
    try:
        rda.save_state(accelerator, directory, step)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


def _rank0_only(rank, directory):
    import time

    from robustdist.frameworks import accelerate as rda

    accelerator, *_ = _prepared()
    if rank == 1:
        time.sleep(8)  # busy elsewhere, never in save_state
        return "elsewhere"
    try:
        rda.save_state(accelerator, directory, 1, arrival_timeout=3.0)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


@pytest.mark.processes
def test_a_save_called_on_one_rank_only_is_a_named_error_not_a_hang(tmp_path):
    outs = run_ranks(_rank0_only, 2, init=True, timeout=TIMEOUT, args=(str(tmp_path),))
    assert outs[1] == "elsewhere"
    assert outs[0].startswith("CheckpointError: [rank 0] save_state() is collective: call it on every rank. "
                              "Rank 1 did not reach save_state() within 3 s")


def test_fsdp_deepspeed_and_megatron_accelerators_are_refused(tmp_path):
    from types import SimpleNamespace

    from robustdist.frameworks import accelerate as rda
    from robustdist.runtime.errors import ConfigError

    for kind in ("FSDP", "DEEPSPEED", "MEGATRON_LM"):
        fake = SimpleNamespace(project_configuration=SimpleNamespace(automatic_checkpoint_naming=False),
                               save_state=None, distributed_type=SimpleNamespace(name=kind))
        for call in (rda.save_state, rda.load_state):
            args = (fake, tmp_path, 1) if call is rda.save_state else (fake, tmp_path)
            with pytest.raises(ConfigError, match=f"the Accelerator runs {kind}, whose checkpoints are not plain"):
                call(*args)


def _prepare_after_a_no_grad_forward(rank):
    from robustdist import harden
    from robustdist.runtime.errors import ConfigError

    h = harden(tr.make_model(), _loader(), OFF)
    with torch.no_grad():
        h.model.eval()(torch.zeros(2, 8))  # an evaluation before training: not the check's last chance
    h.model.train()
    model = _accelerator().prepare(h.model)
    x, y = next(iter(h.loader))
    try:
        model(x)
    except ConfigError as e:
        return str(e)
    finally:
        del model  # Accelerate's DDP goes while the group it uses exists (torch 2.8 could hang freeing it after)
        gc.collect()
        h.close()
    return None


@pytest.mark.processes
def test_a_forward_before_prepare_does_not_let_a_second_wrapper_through():
    for rank, message in enumerate(run_ranks(_prepare_after_a_no_grad_forward, 2, init=False, timeout=TIMEOUT)):
        assert message is not None and "was called through a second DistributedDataParallel" in message


def _swap_mid_commit(rank, directory, outside, moved):
    """save_state, with the staging directory moved away and replaced by a link to ``outside`` between the
    checksum pass and the manifest (as a writer of the checkpoint directory could)."""
    from robustdist.frameworks import accelerate as rda
    from robustdist.runtime.errors import CheckpointError

    accelerator, model, optimizer, counter = _prepared()
    real = rda.checksum_entry

    def swap_then_checksum(path):
        for staging in Path(directory).glob(".tmp-checkpoint_*"):
            if not staging.is_symlink():
                staging.rename(moved)
                staging.symlink_to(outside, target_is_directory=True)
        return real(path)

    rda.checksum_entry = swap_then_checksum
    try:
        rda.save_state(accelerator, directory, 1)
    except CheckpointError as e:
        return type(e).__name__, str(e), rda.committed_states(directory)
    return None, None, rda.committed_states(directory)


@pytest.mark.processes
def test_a_staging_directory_swapped_for_a_link_mid_commit_is_never_written_through_or_committed(tmp_path):
    directory, outside, moved = tmp_path / "ckpt", tmp_path / "outside", tmp_path / "moved"
    outside.mkdir()
    (kind, message, committed), = run_ranks(
        _swap_mid_commit, 1, init=False, timeout=TIMEOUT, args=(str(directory), str(outside), str(moved)),
        env={"RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None, "LOCAL_WORLD_SIZE": None, "MASTER_ADDR": None,
             "MASTER_PORT": None})
    assert kind == "CheckpointError" and "is a symbolic link" in message and "nothing was committed" in message, \
        (kind, message)
    assert committed == [] and not os.path.lexists(directory / "checkpoint_1")
    assert list(outside.iterdir()) == []  # no manifest written through the link


def _swap_before_rename(rank, directory, moved):
    """save_state, with the staging directory (its manifest written) moved away and another real directory put
    at its name just before the commit's rename."""
    from robustdist.checkpoint._confined import Confined
    from robustdist.frameworks import accelerate as rda
    from robustdist.runtime.errors import CheckpointError

    accelerator, model, optimizer, counter = _prepared()
    real = Confined.rename

    def swap_then_rename(self, old, new):
        if old.startswith(".tmp-checkpoint_") and new.startswith("checkpoint_"):
            os.rename(os.path.join(directory, old), moved)
            os.mkdir(os.path.join(directory, old))
        return real(self, old, new)

    Confined.rename = swap_then_rename
    try:
        rda.save_state(accelerator, directory, 1)
    except CheckpointError as e:
        return str(e), rda.committed_states(directory), sorted(os.listdir(directory))
    return None, rda.committed_states(directory), sorted(os.listdir(directory))


@pytest.mark.processes
def test_a_staging_directory_replaced_by_another_before_the_rename_is_not_committed(tmp_path):
    directory, moved = tmp_path / "ckpt", tmp_path / "moved"
    (message, committed, names), = run_ranks(
        _swap_before_rename, 1, init=False, timeout=TIMEOUT, args=(str(directory), str(moved)),
        env={"RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None, "LOCAL_WORLD_SIZE": None, "MASTER_ADDR": None,
             "MASTER_PORT": None})
    assert message is not None and "was replaced by a link or another directory while the checkpoint was " \
        "committed; expected the staging directory robustdist wrote" in message and "Fix: make sure nothing else" \
        in message, message
    assert committed == [] and "checkpoint_1" not in names, names
