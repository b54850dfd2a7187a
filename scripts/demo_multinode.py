"""``make demo-multinode``: the resilient-training demo across 2 nodes of the lab, with a kill.

Builds two simulated nodes (``robustdist.testing.nodelab``: network namespaces joined by veth links, each with its
own address, hostname and torchrun agent; the checkpoint directory is shared, as it must be), runs
``examples/resilient_training.py`` with one rank per node, lets rank 1 (on node 1) SIGKILL itself at step 37,
and lets torchrun restart the group on both nodes. Prints each rank's attempt beside its node's
``TORCHELASTIC_RESTART_COUNT`` and the demo's summary. Exits 0 only if both agents succeed (the demo itself
exits non-zero unless the result is bitwise equal to the straight-through reference). Needs Linux, root and
iproute2; says so and exits 2 elsewhere. Everything the lab made is torn down on exit.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import time
from pathlib import Path

from robustdist.testing import nodelab

DEMO = Path(__file__).resolve().parents[1] / "examples" / "resilient_training.py"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default=".demo-multinode", help="checkpoints and the lab's logs (emptied first)")
    p.add_argument("--timeout", type=float, default=600, help="seconds before the agents are killed")
    args = p.parse_args()
    reason = nodelab.unavailable()
    if reason is not None:
        print(f"demo-multinode cannot run here: {reason}", file=sys.stderr)
        return 2
    work = Path(args.workdir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.time()
    with nodelab.NodeLab(2, log_dir=work / "lab-logs") as lab:
        print(f"2 lab nodes: node 0 at {lab.nodes[0].address}, node 1 at {lab.nodes[1].address}; "
              f"logs in {lab.log_dir}", flush=True)
        agents = [lab.torchrun(i, str(DEMO), ["--workdir", str(work / "run")], max_restarts=1) for i in range(2)]
        deadline = time.monotonic() + args.timeout
        codes = []
        for agent in agents:
            try:
                codes.append(agent.wait(timeout=max(1.0, deadline - time.monotonic())))
            except Exception:
                codes.append(None)
        logs = {i: lab.log(f"agent-n{i}") for i in range(2)}
    for i in range(2):
        for line in re.findall(r"^\[rank \d+\] attempt .*$", logs[i], re.M):
            print(f"node {i}: {line}")
    summary = logs[0][logs[0].find("== robustdist resilient-training demo =="):]
    print(summary.strip() if "==" in summary else "(no summary from node 0: see the logs)")
    print(f"agents exited {codes}; {time.time() - started:.0f} s in all")
    return 0 if codes == [0, 0] else 1


if __name__ == "__main__":
    raise SystemExit(main())
