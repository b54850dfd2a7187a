"""No code runs from a checkpoint, by any route: the plain payloads, DCP's ``.metadata`` (including dotted
names that reach attributes of allowed classes) and DCP's pickled bytes items. Each case re-checksums the
manifest as an attacker who can write the directory would, asserts that the marker file the payload would
create is absent, and that ``load()`` fell back to the valid older step."""

from __future__ import annotations

import contextlib
import io
import pickle
import shutil

import pytest
import torch

from robustdist.checkpoint import AtomicCheckpointer
from robustdist.checkpoint._sharded import check_metadata
from robustdist.runtime.errors import CheckpointCorruptError, RobustDistWarning
from tests.security._forge import (
    STEP1,
    dotted_name_pickle,
    evil_pickle,
    evil_torch_file,
    forge,
    full_params,
    one_rank_group,
    opened_paths,
    outside,
    sharded_pair,
    sharded_two_steps,
    state_for,
    two_steps,
)


def _load_falls_back_to_step_1(directory):
    with pytest.warns(RobustDistWarning, match=r"checkpoint step 2 failed verification") as record:
        with AtomicCheckpointer(directory) as ckpt:
            loaded = ckpt.load(state={"weights": torch.zeros(16)})
    assert loaded.step == 1 and torch.equal(loaded.state["weights"], state_for(1)["weights"])
    return str(record[0].message)


@pytest.mark.parametrize("target", ["replicated.pt", "rank_00000.pt"])
def test_a_payload_that_would_run_code_is_refused_and_the_older_step_loads(tmp_path, target):
    step2, marker = two_steps(tmp_path / "ckpt"), tmp_path / "marker"
    forge(step2, target, evil_torch_file(marker))
    with opened_paths() as opened:
        message = _load_falls_back_to_step_1(tmp_path / "ckpt")
    assert not marker.exists()
    assert f"{target}: refused to load: WeightsUnpickler error: Unsupported global" in message
    assert "nothing was executed" in message and outside(opened, tmp_path / "ckpt") == []


def test_the_payload_is_a_real_exploit_for_an_unsafe_load(tmp_path):
    marker = tmp_path / "marker"
    torch.load(io.BytesIO(evil_torch_file(marker)), weights_only=False)  # the control: this route runs it
    assert marker.exists()


def test_dotted_names_in_dcp_metadata_never_reach_attributes(tmp_path):
    marker, meta = tmp_path / "marker", tmp_path / ".metadata"
    payload = dotted_name_pickle(marker)

    class OldAllowList(pickle.Unpickler):  # robustdist <= 0.2: "any class of DCP's metadata module"
        def find_class(self, module, name):
            obj = super().find_class(module, name)
            if module == "torch.distributed.checkpoint.metadata" and isinstance(obj, type):
                return obj
            raise pickle.UnpicklingError(f"{module}.{name}")

    OldAllowList(io.BytesIO(payload)).load()
    assert marker.exists()  # the route is real: the old allow-list ran the attacker's function
    marker.unlink()
    meta.write_bytes(payload)
    with pytest.raises(CheckpointCorruptError, match=r"Metadata\.__init__\.__class__ is not allowed in DCP metadata"):
        check_metadata(str(meta))
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["dotted", "global"])
def test_crafted_dcp_metadata_in_a_sharded_checkpoint_falls_back(tmp_path, kind):
    marker = tmp_path / "marker"
    with one_rank_group():
        step2 = sharded_two_steps(tmp_path / "ckpt")
        forge(step2, "sharded/.metadata", dotted_name_pickle(marker) if kind == "dotted" else evil_pickle(marker))
        model, opt = sharded_pair(7)
        with pytest.warns(RobustDistWarning, match=r"sharded/\.metadata: refused to load"):
            with AtomicCheckpointer(tmp_path / "ckpt") as ckpt:
                assert ckpt.load(state={"model": model, "optimizer": opt}).step == 1
        expected, _ = sharded_pair(1)
        assert all(torch.equal(a, b) for a, b in zip(full_params(model).values(), full_params(expected).values()))
    assert not marker.exists()


def _poison_a_bytes_item(step2, marker):
    """Point one of DCP's pickled items (the optimizer's lr) at a torch.save'd object that runs code."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = FileSystemReader(str(step2 / "sharded")).read_metadata()  # our own valid file: trusted here
    name = next(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    index = next(i for i in metadata.storage_data if i.fqn == name)
    data = (step2 / "sharded" / "__0_0.distcp").read_bytes()
    evil = evil_torch_file(marker, wrap=lambda x: x)
    metadata.storage_data[index] = _StorageInfo("__0_0.distcp", len(data), len(evil))
    forge(step2, "sharded/__0_0.distcp", data + evil)
    forge(step2, "sharded/.metadata", pickle.dumps(metadata))


def test_a_pickled_dcp_bytes_item_never_runs(tmp_path):
    marker = tmp_path / "marker"
    with one_rank_group():
        step2 = sharded_two_steps(tmp_path / "ckpt")
        _poison_a_bytes_item(step2, marker)
        control = tmp_path / "control"
        shutil.copytree(step2 / "sharded", control)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        model, opt = sharded_pair(7)
        with contextlib.suppress(Exception):  # DCP's own reader runs the payload
            dcp.load({"optimizer": get_optimizer_state_dict(model, opt)}, storage_reader=dcp.FileSystemReader(control))
        assert marker.exists()  # the route is real
        marker.unlink()
        with pytest.warns(RobustDistWarning, match=r"holds objects robustdist never writes") as record:
            with AtomicCheckpointer(tmp_path / "ckpt") as ckpt:
                assert ckpt.load(state={"model": model, "optimizer": opt}).step == 1
        assert "checkpoint step 2 failed verification" in str(record[0].message)
        assert opt.param_groups[0]["lr"] == pytest.approx(0.02)  # step 1's optimizer
    assert not marker.exists()
    assert (tmp_path / "ckpt" / STEP1).is_dir()
