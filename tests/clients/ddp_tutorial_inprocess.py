"""A torchrun client in the shape of the pytorch/examples DDP tutorial (``multigpu_torchrun.py``), ported as
docs/porting.md (a) says and run under ``h.run`` with ``recovery.in_process: true``.

The tutorial's parts are kept: ``load_train_objs`` (a dataset, a linear model, SGD), ``prepare_dataloader``
(``pin_memory=True``, a ``DistributedSampler`` built with explicit ranks before any group exists), a ``Trainer``
with ``_run_batch`` and ``_run_epoch`` (the batch-size peek, ``set_epoch``), saving every epoch. Written for the
tests (nothing pasted): the loop body is ``Trainer.train(h, step)``, the function ``h.run`` re-runs; it saves to the
in-memory tier every step.

``--epochs`` (3), ``--step-sleep`` (seconds per step), ``--hang-timeout`` (the watchdog's) and ``--log-steps`` (an
event per step) and ``--local-every`` (the in-memory tier's interval, 1) shape a run for tests that act on it mid-run. ``--fault RANK:STEP`` raises ``ValueError`` on that rank after the optimizer step of global step STEP (its peer then
waits in the save's arrival check), in generation 0 of attempt 0 only, or with ``--always`` in every generation of
every attempt (a deterministic fault). ``--kill RANK:STEP`` SIGKILLs that rank (-1: every rank) there instead, in its
first process only (not in a replacement ``robustdist run`` started), or with ``--always`` in every process; ``--kill-in-save`` right after that step's ``save()``
returns (its background part under way). ``--hold FILE:STEP``: every rank waits after step STEP's save while FILE
exists (a test acts meanwhile; the results are those of a run without it). Each rank writes ``events-<tag>-rank<r>.jsonl`` (every start of the
training function and the restart-loop guard's stop), and at the end ``result-<tag>-rank<r>.json`` and
``final-<tag>-rank<r>.pt`` (the parameters) as ``tests/_torchrun.py`` reads them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from robustdist import harden
from robustdist.recovery import generation
from robustdist.runtime.errors import RestartLoopError

BATCH = 4


class MyTrainDataset(Dataset):
    def __init__(self, size: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        return self.data[i]


def load_train_objs():
    train_set = MyTrainDataset(64)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    return train_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int) -> DataLoader:
    sampler = DistributedSampler(dataset, num_replicas=int(os.environ["WORLD_SIZE"]), rank=int(os.environ["RANK"]))
    return DataLoader(dataset, batch_size=batch_size, pin_memory=True, shuffle=False, sampler=sampler)


class Trainer:
    def __init__(self, optimizer, fault: tuple[int, int] | None, always: bool, note, *, epochs: int,
                 step_sleep: float, log_steps: bool) -> None:
        self.rank = int(os.environ["RANK"])
        self.optimizer, self.fault, self.always, self.note = optimizer, fault, always, note
        self.epochs, self.step_sleep, self.log_steps = epochs, step_sleep, log_steps
        self.kill: tuple[int, int] | None = None
        self.kill_in_save = False
        self.hold: tuple[str, int] | None = None

    def _run_batch(self, h, source, targets, step: int) -> None:
        self.optimizer.zero_grad()
        loss = F.mse_loss(h.model(source), targets)
        time.sleep(self.step_sleep)  # accelerator time, for tests that act mid-run (a fault lands here, before the
        loss.backward()              # gradient all-reduce)
        if h.step_guard(loss, step):
            self.optimizer.step()

    def _run_epoch(self, h, epoch: int, step: int) -> int:
        b_sz = len(next(iter(h.loader))[0])  # the tutorial's batch-size peek
        assert b_sz == BATCH
        h.loader.sampler.set_epoch(epoch)
        for source, targets in h.loader:
            self._run_batch(h, source, targets, step)
            step += 1
            if self.log_steps:
                self.note(event="step", step=step)
            first = generation() == 0 and h.attempt == 0
            if self.fault == (self.rank, step) and (self.always or first):
                raise ValueError(f"boom at step {step} (attempt {h.attempt}, generation {generation()})")
            replaced = "ROBUSTDIST_REPLACES" in os.environ
            doomed = (self.kill is not None and self.kill[1] == step and self.kill[0] in (-1, self.rank)
                      and (self.always or (first and not replaced)))
            if doomed and not self.kill_in_save:
                self.note(event="kill", step=step)
                os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer's way: no exception, no exit code
            h.save(step)  # the in-memory tier every --local-every steps (1), the durable one every 4
            if self.hold is not None and step == self.hold[1]:
                while os.path.exists(self.hold[0]):  # a pause, the same on every rank: the results are unchanged
                    time.sleep(0.05)
            if doomed:  # --kill-in-save: while the save's background part (commit, replication) runs
                self.note(event="kill", step=step)
                os.kill(os.getpid(), signal.SIGKILL)
        return step

    def train(self, h, step: int) -> int:
        """The part h.run re-runs: from the step it resumed (0 on a fresh start) to the end."""
        self.note(event="start", step=step)
        per_epoch = len(h.loader)
        while step < self.epochs * per_epoch:
            step = self._run_epoch(h, step // per_epoch, step)
        return step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workdir", required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--fault", default=None, help="RANK:STEP")
    p.add_argument("--always", action="store_true")
    p.add_argument("--kill", default=None, help="RANK:STEP: SIGKILL that rank there (first process only)")
    p.add_argument("--kill-in-save", action="store_true", help="--kill right after that step's save() returns")
    p.add_argument("--max-no-progress", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--hang-timeout", type=float, default=None)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--log-steps", action="store_true")
    p.add_argument("--local-every", type=int, default=1)
    p.add_argument("--local-dir", default=None, help="the in-memory tier's (default: <workdir>/shm-<tag>)")
    p.add_argument("--hold", default=None, help="FILE:STEP: after step STEP's save, wait while FILE exists")
    a = p.parse_args()
    work, rank = Path(a.workdir), int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def note(**kw) -> None:
        with open(work / f"events-{a.tag}-rank{rank}.jsonl", "a") as f:
            f.write(json.dumps({"attempt": attempt, "generation": generation(), "pid": os.getpid(),
                                "time": time.time(), **kw}) + "\n")

    torch.manual_seed(0)
    dataset, model, optimizer = load_train_objs()
    loader = prepare_dataloader(dataset, BATCH)
    cfg = {"checkpoint": {"dir": str(work / "ckpt"), "every_n_steps": 4, "local_every_n_steps": a.local_every,
                          "local_dir": a.local_dir or str(work / f"shm-{a.tag}")},
           "health": {"hang_timeout": a.hang_timeout, "max_restarts_without_progress": a.max_no_progress},
           "distributed": {"timeout": 60, "init_timeout": 60, "barrier_timeout": 60},
           "recovery": {"in_process": True}}
    fault = tuple(int(v) for v in a.fault.split(":")) if a.fault else None
    h = harden(model, loader, cfg, optimizer=optimizer)
    trainer = Trainer(optimizer, fault, a.always, note, epochs=a.epochs,  # type: ignore[arg-type]
                      step_sleep=a.step_sleep, log_steps=a.log_steps)
    trainer.kill = tuple(int(v) for v in a.kill.split(":")) if a.kill else None  # type: ignore[assignment]
    trainer.kill_in_save = a.kill_in_save
    if a.hold:
        path, _, at = a.hold.rpartition(":")
        trainer.hold = (path, int(at))
    try:
        end = h.run(trainer.train, optimizer=optimizer)
    except RestartLoopError as e:
        note(event="guard", message=str(e))
        raise
    note(event="done", step=end)
    (work / f"result-{a.tag}-rank{rank}.json").write_text(json.dumps({"end": end, "attempt": attempt,
                                                                       "pid": os.getpid()}))
    torch.save({n: t.detach().clone() for n, t in model.state_dict().items()}, work / f"final-{a.tag}-rank{rank}.pt")


if __name__ == "__main__":
    main()
