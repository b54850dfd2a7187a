"""robustdist beside transformers' ``Trainer``: harden does not compose with it (Trainer runs its own
loop, wraps the model it holds in a DDP of its own and shards its own loader), so both orders are refused on every
rank with a ``ConfigError`` that names the Trainer and says what to do instead, before any gradient is applied.

Two real gloo ranks (``run_ranks``), each with its own Accelerate state; a model in the shape the Trainer expects
(keyword inputs, a ``loss`` in the output).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from robustdist.testing.ranks import run_ranks

pytestmark = pytest.mark.processes

pytest.importorskip("transformers")

OFF = {"checkpoint": {"dir": None}, "health": {"hang_timeout": None}}
TIMEOUT = 180


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = self.linear(x).squeeze(-1)
        return {"loss": ((out - labels) ** 2).mean(), "logits": out}


class Rows(Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(8, generator=g), "labels": torch.tensor(float(i % 3))}


def _trainer(model: nn.Module, out: str):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=2, report_to=[], use_cpu=True,
                             ddp_backend="gloo", save_strategy="no", remove_unused_columns=False, disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=Rows())


def _harden_first(rank: int, out: str) -> dict[str, str | None]:
    from robustdist import harden
    from robustdist.runtime.errors import ConfigError

    found: dict[str, str | None] = {}
    h = harden(Regressor(), None, OFF)  # harden first (it creates the group), then Trainer(model=h.model)
    before = [p.detach().clone() for p in h.model.parameters()]
    try:
        _trainer(h.model, out).train()
        found["harden_first"] = None
    except ConfigError as e:
        found["harden_first"] = str(e)
    found["unchanged"] = str(all(torch.equal(a, b) for a, b in zip(before, h.model.parameters())))
    h.close()
    return found


def _trainer_first(rank: int, out: str) -> str | None:
    """The Trainer built first (its TrainingArguments make the group and the Accelerator), then harden(model)."""
    from robustdist import harden
    from robustdist.runtime.errors import ConfigError

    model = Regressor()
    _trainer(model, out)
    try:
        harden(model, None, OFF)
    except ConfigError as e:
        return str(e)
    return None


def test_harden_and_the_hf_trainer_are_refused_in_both_orders_on_every_rank(tmp_path):
    # each order in processes of its own: the Accelerate state a Trainer leaves behind is process-global
    then_all = run_ranks(_trainer_first, 2, args=(str(tmp_path),), init=False, timeout=TIMEOUT)
    for rank, found in enumerate(run_ranks(_harden_first, 2, args=(str(tmp_path),), init=False, timeout=TIMEOUT)):
        found["trainer_first"] = then_all[rank]
        first = found["harden_first"]
        assert first is not None and first.startswith(
            f"[rank {rank}] the model robustdist wrapped in DDP (harden or wrap_ddp) was called through transformers' "
            "Trainer (Trainer(model=h.model): its Accelerator wraps the model in a second DDP)"), first
        assert found["unchanged"] == "True"  # refused at the first forward: no step was taken
        then = found["trainer_first"]
        assert then is not None and then.startswith(
            f"[rank {rank}] harden() was given a bare Regressor while an Accelerator of 2 processes is in charge of "
            "this process and transformers' Trainer is loaded"), then
        for message in (first, then):
            assert "Fix: harden() does not compose with transformers' Trainer, which runs its own loop, DDP, " \
                   "sampler and checkpoints" in message
            assert "give Trainer the bare model and drop harden(), or write the loop with Accelerate" in message


def _after_a_step(rank: int, out: str) -> str | None:
    """A direct training step on h.model first (a warm-up), then Trainer(model=h.model): robustdist's DDP has
    passed its first training forward, so only the frames that call it can show the Trainer's DDP."""
    from robustdist import harden
    from robustdist.runtime.errors import ConfigError

    h = harden(Regressor(), None, OFF)
    rows = Rows()
    batch = {k: torch.stack([rows[i][k] for i in range(4)]) for k in ("x", "labels")}
    h.model(**batch)["loss"].backward()
    try:
        _trainer(h.model, out).train()
    except ConfigError as e:
        return str(e)
    finally:
        h.close()
    return None


def test_the_trainer_is_refused_after_a_direct_training_step_too(tmp_path):
    for rank, message in enumerate(run_ranks(_after_a_step, 2, args=(str(tmp_path),), init=False, timeout=TIMEOUT)):
        assert message is not None and message.startswith(
            f"[rank {rank}] the model robustdist wrapped in DDP (harden or wrap_ddp) was called through transformers' "
            "Trainer (Trainer(model=h.model): its Accelerator wraps the model in a second DDP)"), message
