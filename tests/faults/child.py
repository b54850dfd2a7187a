"""A child process for the fault-injection suite: saves checkpoints, then misbehaves at a chosen phase.

python -m tests.faults.child DIR LAST_STEP PHASE ACTION [FSIZE_LIMIT]
  saves steps 1..LAST_STEP-1 normally (keep_last=2), then step LAST_STEP with the fault:
  ACTION kill: SIGKILL this process when PHASE is reached; efbig: write under RLIMIT_FSIZE=FSIZE_LIMIT.
Prints one JSON line with what happened (for actions that return).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys

import torch

from robustdist.checkpoint import AtomicCheckpointer, _faults
from robustdist.runtime.errors import CheckpointError


def state_for(step: int, size: int = 64) -> dict:
    return {"weights": torch.full((size,), float(step)), "meta": {"step": step}}


def main() -> None:
    directory, last, phase, action = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    ckpt = AtomicCheckpointer(directory, keep_last=2)
    for step in range(1, last):
        ckpt.save(step, state_for(step))
    size = 64
    if action == "kill":
        def hook(name: str) -> None:
            if name == phase:
                os.kill(os.getpid(), signal.SIGKILL)
        _faults.HOOK = hook
    elif action == "efbig":
        limit = int(sys.argv[5])
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        size = limit  # float32 elements: 4x the limit in bytes
    try:
        ckpt.save(last, state_for(last, size))
        print(json.dumps({"outcome": "saved"}))
    except CheckpointError as e:
        print(json.dumps({"outcome": "error", "type": type(e).__name__, "message": str(e),
                          "cause": repr(e.__cause__)}))
    ckpt.close()


if __name__ == "__main__":
    main()
