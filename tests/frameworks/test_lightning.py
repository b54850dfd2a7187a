"""robustdist inside a Lightning ``Trainer``: the ``CheckpointIO`` plugin writes ``.ckpt`` files
atomically with a size/CRC-32 record and, on load, refuses a damaged one and falls back to the newest intact
checkpoint beside it; the ``Callback`` raises or skips on non-finite gradients and runs the watchdog.

Every Trainer runs in a process of its own (``run_ranks``): Lightning keeps process-global state."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from robustdist.testing.ranks import run_ranks

pytest.importorskip("lightning")

TIMEOUT = 180
ALONE = {"RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None, "LOCAL_WORLD_SIZE": None, "MASTER_ADDR": None,
         "MASTER_PORT": None}


def _module(poison_at: int | None = None):
    import lightning as L

    class Regressor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            if poison_at is not None and self.global_step == poison_at:
                loss = loss * float("nan")
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return Regressor()


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def _trainer(directory: str, steps: int, **callback_kwargs):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from robustdist.frameworks import lightning as rdl

    saver = ModelCheckpoint(dirpath=directory, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    guard = rdl.callback(hang_timeout=60.0, **callback_kwargs)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, plugins=[rdl.checkpoint_io()], callbacks=[saver, guard])
    return trainer, guard


def _fit(rank, directory, steps, resume):
    from lightning.pytorch.callbacks import Callback

    started = []

    class Start(Callback):
        def on_train_start(self, trainer, pl_module):
            started.append((trainer.global_step, guard.watchdog is not None))

    trainer, guard = _trainer(directory, steps)
    trainer.callbacks.append(Start())
    module = _module()
    trainer.fit(module, _data(), ckpt_path=resume)
    closed = guard.watchdog is None  # closed at fit end
    return trainer.global_step, started[0], closed


@pytest.mark.processes
def test_checkpoints_are_atomic_recorded_and_a_damaged_one_falls_back(tmp_path):
    directory = str(tmp_path / "ckpt")
    ((step, (start, watching), closed),) = run_ranks(_fit, 1, init=False, timeout=TIMEOUT, args=(directory, 6, None),
                                                     env=ALONE)
    assert step == 6 and start == 0 and watching and closed
    names = sorted(p.name for p in Path(directory).iterdir())
    assert names == ["step=2.ckpt", "step=2.ckpt.robustdist.json", "step=4.ckpt", "step=4.ckpt.robustdist.json",
                     "step=6.ckpt", "step=6.ckpt.robustdist.json"]  # no temporary file left
    record = json.loads((Path(directory) / "step=6.ckpt.robustdist.json").read_text())
    assert record["size"] == (Path(directory) / "step=6.ckpt").stat().st_size
    newest = Path(directory) / "step=6.ckpt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    ((step, (start, _), _),) = run_ranks(_fit, 1, init=False, timeout=TIMEOUT, args=(directory, 8, str(newest)),
                                         env=ALONE)
    assert start == 4 and step == 8  # resumed from step 4 (the fallback), not the damaged 6, and trained to 8


def _load_only(rank, path):
    from robustdist.frameworks import lightning as rdl
    from robustdist.runtime.errors import CheckpointCorruptError

    try:
        rdl.checkpoint_io().load_checkpoint(path)
    except CheckpointCorruptError as e:
        return str(e)
    return None


class _Runs:
    def __reduce__(self):
        import os

        return (os.system, ("touch /tmp/robustdist-lightning-pwned",))


@pytest.mark.processes
def test_a_checkpoint_that_would_run_code_is_refused_and_nothing_else_is_there(tmp_path):
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": _Runs()}, path)
    marker = Path("/tmp/robustdist-lightning-pwned")
    marker.unlink(missing_ok=True)
    (message,) = run_ranks(_load_only, 1, init=False, timeout=TIMEOUT, args=(str(path),), env=ALONE)
    assert message is not None and "torch.load(weights_only=True) failed" in message
    assert "No other intact .ckpt" in message
    assert not marker.exists()


def _poisoned(rank, directory, policy):
    from robustdist.runtime.errors import NonFiniteLossError

    trainer, guard = _trainer(directory, 5, nan_policy=policy)
    module = _module(poison_at=2)
    try:
        trainer.fit(module, _data())
    except NonFiniteLossError as e:
        return "raised", str(e)
    finite = all(torch.isfinite(p).all() for p in module.parameters())
    return "finished", (trainer.global_step, guard.skipped, bool(finite))


@pytest.mark.processes
@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_non_finite_gradients_follow_the_policy(tmp_path, policy):
    ((what, detail),) = run_ranks(_poisoned, 1, init=False, timeout=TIMEOUT, args=(str(tmp_path), policy), env=ALONE)
    if policy == "raise":
        assert what == "raised" and detail.startswith("step 2: non-finite gradients before the optimizer step")
    else:
        assert what == "finished" and detail == (5, 1, True)  # one step skipped, the weights stayed finite


def test_a_bad_policy_is_a_config_error():
    from robustdist.frameworks import lightning as rdl
    from robustdist.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match=r"nan_policy='rollback'\); expected one of raise, skip"):
        rdl.callback(nan_policy="rollback")
    with pytest.raises(ConfigError, match=r"hang_timeout=0\); expected seconds > 0"):
        rdl.callback(hang_timeout=0)


def _save_and_remove(rank, directory):
    from robustdist.frameworks import lightning as rdl

    io = rdl.checkpoint_io()
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, f"{directory}/step=2.ckpt")
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, f"{directory}/step=4.ckpt")
    saved = sorted(p.name for p in Path(directory).iterdir() if not p.is_symlink())
    links = sorted(p.name for p in Path(directory).iterdir() if p.is_symlink())
    io.remove_checkpoint(f"{directory}/step=6.ckpt")  # a link planted at a name Lightning rotates out
    return saved, links, torch.equal(io.load_checkpoint(f"{directory}/step=4.ckpt")["state_dict"]["w"], torch.ones(3))


@pytest.mark.processes
def test_names_planted_as_links_are_replaced_and_removed_never_written_through(tmp_path):
    """A hard link and a symbolic link to files elsewhere planted at the names the plugin writes, and a link at a
    name it removes: each name is replaced or removed as a name; the files elsewhere keep their bytes."""
    directory, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    directory.mkdir()
    elsewhere.mkdir()
    for name in ("hard", "soft", "removed"):
        (elsewhere / name).write_bytes(b"precious")
    (directory / "step=2.ckpt").hardlink_to(elsewhere / "hard")
    (directory / "step=4.ckpt.robustdist.json").symlink_to(elsewhere / "soft")
    (directory / "step=6.ckpt").symlink_to(elsewhere / "removed")
    ((saved, links, loaded),) = run_ranks(_save_and_remove, 1, init=False, timeout=TIMEOUT, args=(str(directory),),
                                          env=ALONE)
    assert saved == ["step=2.ckpt", "step=2.ckpt.robustdist.json", "step=4.ckpt", "step=4.ckpt.robustdist.json"]
    assert links == ["step=6.ckpt"] and loaded
    assert not os.path.lexists(directory / "step=6.ckpt")
    assert {p.name: p.read_bytes() for p in elsewhere.iterdir()} == {n: b"precious" for n in ("hard", "soft", "removed")}


class Hyper:
    """A user's hyperparameter type (module-level, so pickled by reference)."""

    def __init__(self, width: int) -> None:
        self.width = width


def _trusting_loads(rank, directory):
    """Lightning's weights_only=False: code refused, Namespace loaded, a user type only once allowed."""
    import argparse

    from robustdist.frameworks import lightning as rdl
    from robustdist.runtime.errors import CheckpointCorruptError

    def outcome(io, name):
        try:
            return io.load_checkpoint(f"{directory}/{name}", weights_only=False)
        except CheckpointCorruptError as e:
            return str(e)

    io = rdl.checkpoint_io()
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "hyper_parameters": _Runs()}, f"{directory}/evil.ckpt")
    evil = outcome(io, "evil.ckpt")
    os.rename(f"{directory}/evil.ckpt", f"{directory}/evil.keep")  # the next loads have no fallback to it
    os.rename(f"{directory}/evil.ckpt{rdl.RECORD_SUFFIX}", f"{directory}/evil.keep{rdl.RECORD_SUFFIX}")
    io.save_checkpoint({"hyper_parameters": {"ns": argparse.Namespace(a=1)}}, f"{directory}/ns.ckpt")
    namespace = outcome(io, "ns.ckpt")["hyper_parameters"]["ns"].a
    os.makedirs(f"{directory}/own")
    io.save_checkpoint({"hyper_parameters": {"h": Hyper(8)}}, f"{directory}/own/h.ckpt")
    refused = outcome(io, "own/h.ckpt")
    torch.serialization.add_safe_globals([argparse.Namespace])  # the script's own: stays allowed after the loads
    allowed = outcome(rdl.checkpoint_io(allowed_globals=[f"{__name__}.Hyper"]), "own/h.ckpt")
    by_default = rdl.checkpoint_io(allowed_globals=Hyper).load_checkpoint(f"{directory}/own/h.ckpt")  # named: enough
    kept = argparse.Namespace in torch.serialization.get_safe_globals()
    added = Hyper in torch.serialization.get_safe_globals()
    return evil, namespace, refused, (allowed["hyper_parameters"]["h"].width, by_default["hyper_parameters"]["h"].width,
                                      kept, added)


@pytest.mark.processes
def test_weights_only_false_unpickles_only_what_robustdist_allows(tmp_path):
    marker = Path("/tmp/robustdist-lightning-pwned")
    marker.unlink(missing_ok=True)
    ((evil, namespace, refused, width),) = run_ranks(_trusting_loads, 1, init=False, timeout=TIMEOUT,
                                                        args=(str(tmp_path),), env=ALONE)
    assert "refused although Lightning asked for weights_only=False" in evil and "system" in evil
    assert "No other intact .ckpt" in evil and not marker.exists()  # nothing ran
    assert namespace == 1  # argparse.Namespace, as Lightning's save_hyperparameters writes it, loads
    assert "Hyper" in refused and "checkpoint_io(allowed_globals=['module.Name'])" in refused
    assert width == (8, 8, True, False)  # named by the user: loads (with or without Lightning's flag); the
    # script's own allowed global stays allowed, and the plugin's go when the load is done


def test_allowed_globals_are_classes_that_can_be_imported():
    from robustdist.frameworks import lightning as rdl
    from robustdist.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match=r"cannot import it .*expected 'module.Name' of an importable class"):
        rdl.checkpoint_io(allowed_globals=["no_such_module_here.Config"])
    with pytest.raises(ConfigError, match=r"expected classes \(or 'module.Name' strings naming classes\)"):
        rdl.checkpoint_io(allowed_globals=[3])
    with pytest.raises(ConfigError, match=r"'os.system'.*a function allowed would run with arguments the file"):
        rdl.checkpoint_io(allowed_globals=["os.system"])
    assert rdl._resolve(Hyper) == (Hyper,)  # one class, not in a list


def _nested_record(rank, directory):
    from robustdist.frameworks import lightning as rdl

    io = rdl.checkpoint_io()
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, f"{directory}/step=2.ckpt")
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, f"{directory}/step=4.ckpt")
    Path(f"{directory}/step=4.ckpt{rdl.RECORD_SUFFIX}").write_text("[" * 60_000 + "]" * 60_000)
    return tuple(io.load_checkpoint(f"{directory}/step=4.ckpt")["state_dict"]["w"].shape)


@pytest.mark.processes
def test_a_record_nested_beyond_parsing_falls_back_to_the_checkpoint_before(tmp_path):
    (shape,) = run_ranks(_nested_record, 1, init=False, timeout=TIMEOUT, args=(str(tmp_path),), env=ALONE)
    assert shape == (2,)  # step=2's, named fallback (not a RecursionError)


def _warned(rank, directory, every_n_epochs):
    import logging

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from robustdist.frameworks import lightning as rdl

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logging.getLogger("robustdist").addHandler(Keep(logging.WARNING))
    saver = (ModelCheckpoint(dirpath=directory, every_n_epochs=1, save_top_k=-1) if every_n_epochs else
             ModelCheckpoint(dirpath=directory, every_n_train_steps=2, save_top_k=-1))
    trainer = L.Trainer(max_steps=12, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, plugins=[rdl.checkpoint_io()],
                        callbacks=[saver, rdl.callback(hang_timeout=None)])
    trainer.fit(_module(), _data())
    return [m for m in seen if "mid-epoch" in m]


@pytest.mark.processes
@pytest.mark.parametrize("every_n_epochs", [False, True], ids=["every-2-steps", "every-epoch"])
def test_a_mid_epoch_checkpoint_is_warned_about_once_with_the_fix(tmp_path, every_n_epochs):
    (warnings,) = run_ranks(_warned, 1, init=False, timeout=TIMEOUT, args=(str(tmp_path), every_n_epochs),
                              env=ALONE)
    if every_n_epochs:
        assert warnings == []  # saves at 8 (an epoch end) and 12 (the run's last step: not warned)
    else:
        assert len(warnings) == 1 and "the checkpoint at step 2 is taken mid-epoch (after batch 2 of epoch 0)" in warnings[0]
        assert "Fix: checkpoint at epoch ends (ModelCheckpoint(every_n_epochs=1, save_last=True))" in warnings[0]
