"""What the lab's job scripts record: one JSON line per event, per rank and process (no torch import here: the
recovery job makes its mount namespace before torch starts threads)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


class Events:
    """Appends ``{"event", "time", "rank", "group_rank", "pid", ...}`` lines to ``<directory>/rank<r>-pid<p>.jsonl``
    (flushed and fsynced: a rank may be SIGKILLed right after)."""

    def __init__(self, directory: str):
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / f"rank{os.environ.get('RANK', '0')}-pid{os.getpid()}.jsonl"

    def __call__(self, event: str, **fields: object) -> None:
        record = {"event": event, "time": time.time(), "rank": int(os.environ.get("RANK", "0")),
                  "group_rank": os.environ.get("GROUP_RANK"), "pid": os.getpid(), **fields}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
