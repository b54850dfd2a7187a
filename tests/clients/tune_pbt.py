"""A Ray Tune PBT job in the shape of Ray's ``tune/examples/pbt_function.py``, ported to robustdist as docs/ray.md
says: a function trainable that hardens a small model, resumes, sets its hyperparameter from the trial's config,
and calls ``h.save(step, metrics=...)`` once per iteration (the checkpoint every ``checkpoint_interval`` steps,
where the example reports ``Checkpoint.from_directory``). No ``with`` and no ``close()``: the example's function
never returns either (Tune stops it).

``kill_at``: the first trial to reach that step SIGKILLs its own actor (once per run; ``<out>/killed`` names it),
and Tune restarts it from its checkpoint. Every start, every save and the kill append a line to ``<out>/<trial>.jsonl``: the step, the learning rate used, a digest
of the parameters, the number of threads in the process and the actor's pid, so a test can follow each exploit
(a start whose parameters are another trial's saved ones) and see what a reused actor kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading

import torch
from torch import nn


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(value.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 4, generator=g)
    return x, x.sum(dim=1, keepdim=True) * 0.5


def _first_kill(out: str, trial: str) -> bool:
    """True once per run (the first trial to get here): the marker names it."""
    try:
        fd = os.open(os.path.join(out, "killed"), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        return False
    os.write(fd, trial.encode())
    os.close(fd)
    return True


def pbt_trainable(config: dict) -> None:
    from ray import tune

    from robustdist import harden

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    cfg = {"checkpoint": {"dir": config["dir"], "every_n_steps": config["checkpoint_interval"]},
           "health": {"hang_timeout": 60}}
    h = harden(model, None, cfg, optimizer=opt)
    step = h.resume() or 0
    for group in opt.param_groups:  # the trial's own hyperparameter, also after a resume from another trial
        group["lr"] = config["lr"]
    trial = tune.get_context().get_trial_id()
    log = os.path.join(config["out"], f"{trial}.jsonl")

    def note(kind: str, **fields: object) -> None:
        with open(log, "a") as fh:
            fh.write(json.dumps({"kind": kind, "step": step, "lr": config["lr"], "digest": digest(model),
                                 "threads": threading.active_count(), "pid": os.getpid(), **fields}) + "\n")

    note("start", source=h.last_loaded.source_detail if h.last_loaded is not None else None)
    while True:
        x, y = batch(step)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step == config.get("kill_at") and _first_kill(config["out"], trial):
            note("kill")
            os.kill(os.getpid(), signal.SIGKILL)  # the trial's actor dies; Tune restarts the trial (max_failures)
        if step % config["checkpoint_interval"] == 0:
            note("save")  # before: Tune may end this thread inside the report that carries the checkpoint
        h.save(step, metrics={"mean_accuracy": -loss.item(), "lr": config["lr"]})
