"""Deterministic training for the bit-identical resume test.

python -m tests.faults.train MODE DIR; MODE: straight (20 steps), crash (SIGKILL itself at step 13, after
the step-10 checkpoint), resume (load the newest checkpoint and finish). Prints JSON with the parameters'
SHA-256. Uses every RNG a training script does: torch (data, dropout), python random, numpy; each run seeds them
all. ``crash`` first trains the straight run (in ``DIR-straight``) in the same process and prints its line: the
reference, without a process of its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import sys

import numpy as np
import torch
from torch import nn

from robustdist.checkpoint import AtomicCheckpointer

STEPS, EVERY, CRASH_AT = 20, 5, 13


def train(mode: str, directory: str) -> dict:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    torch.use_deterministic_algorithms(True)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
    ckpt = AtomicCheckpointer(directory, keep_last=2)
    start, resumed = 0, None
    if mode == "resume":
        resumed = ckpt.load(state={"model": model, "optimizer": opt, "scheduler": sched}).step
        start = resumed
    for step in range(start, STEPS):
        x = torch.randn(16, 8) * (1 + random.random())
        y = torch.from_numpy(np.random.randn(16, 1).astype(np.float32))
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        done = step + 1
        if done % EVERY == 0:
            ckpt.save(done, {"model": model, "optimizer": opt, "scheduler": sched})
        if mode == "crash" and done == CRASH_AT:
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    return {"params_sha256": digest, "resumed_from": resumed}


def main() -> None:
    mode, directory = sys.argv[1], sys.argv[2]
    if mode == "crash":
        print(json.dumps(train("straight", f"{directory}-straight")), flush=True)
    print(json.dumps(train(mode, directory)))


if __name__ == "__main__":
    main()
