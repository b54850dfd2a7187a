"""Test your own distributed code on CPU with real ranks: robustdist.testing.run_ranks.

Run it: python examples/run_ranks_example.py   (or put the functions in a pytest file)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from robustdist.testing import run_ranks


def average_gradients(model: torch.nn.Module) -> None:
    """The code under test: average .grad across ranks, as hand-rolled data parallelism does."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def check_average_gradients(rank: int) -> list[float]:
    """Runs on every rank, inside a real gloo process group that run_ranks created."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1, bias=False)
    x = torch.full((1, 2), float(rank + 1))  # each rank sees different data
    model(x).sum().backward()
    average_gradients(model)
    return model.weight.grad.flatten().tolist()


def main() -> None:
    grads = run_ranks(check_average_gradients, world_size=3, timeout=60)
    # ranks saw x = 1, 2, 3, so the averaged gradient is 2 everywhere, and identical on every rank
    assert grads == [[2.0, 2.0]] * 3, grads
    print("every rank holds the averaged gradient:", grads[0])


if __name__ == "__main__":  # required: ranks are fresh interpreters that re-import this file
    main()
