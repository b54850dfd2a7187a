"""A small deterministic model, data and training loop shared by the harden and health tests.

Module level, so ``run_ranks`` can pickle these by reference into its ranks.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from robustdist.parallel.state_dict import unwrap_model


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 4))


def make_loader(n: int = 48, batch_size: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 8, generator=g)
    y = torch.randint(0, 4, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True)


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def loop(h: Any, optimizer: Any, total: int, *, start: int = 0,
         poison: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
         before_backward: Callable[[int], None] | None = None, after_step: Callable[[int], None] | None = None,
         guard: bool = True) -> list[tuple[int, str]]:
    """The README's loop. Returns ``(step, action)`` for every guarded step."""
    actions: list[tuple[int, str]] = []
    step = start
    while step < total:
        for x, y in h.loader:
            if poison is not None:
                x = poison(step, x)
            loss = nn.functional.cross_entropy(h.model(x), y)
            if before_backward is not None:
                before_backward(step)
            loss.backward()
            decision = h.step_guard(loss, step) if guard else True
            actions.append((step, getattr(decision, "action", "ok")))
            if decision:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if getattr(decision, "rolled_back", False):
                step = decision.resume_step
                break
            step += 1
            if after_step is not None:
                after_step(step)
            h.save(step, optimizer=optimizer)
            if step == total:
                break
    return actions


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in unwrap_model(model).state_dict().items()}


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)


class Plain:
    """The shape of ``Hardened`` a hand-composed loop needs (no guard, no checkpoints)."""

    def __init__(self, model: nn.Module, loader: Any):
        self.model, self.loader = model, loader

    def save(self, step: int, **kwargs: Any) -> None:
        return None


def gloo_averages(rank: int) -> bool:
    """In a rank: whether this torch's gloo reduce-scatter averages for ReduceOp.AVG, as FSDP2 on the CPU needs
    (torch 2.8's sums: pytorch#162338)."""
    from robustdist.parallel.fsdp import gloo_averages as probe

    return probe()
