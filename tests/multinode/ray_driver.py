"""The driver for the 2-node Ray Train V2 lab test (``test_ray_cluster.py``): run inside lab node 0, it
connects to the lab's Ray cluster (head on node 0, a worker node on node 1) and runs the V2 client
(``tests/clients/ray_train_v2.py``) twice, one worker per node (``STRICT_SPREAD``): a run without faults (the
reference), then a run where rank 1 wipes robustdist's checkpoint directory and SIGKILLs itself. Each fit's
outcome goes to ``<out>/<name>.result.json``; the test reads the clients' own records for the rest.

    python -m tests.multinode.ray_driver --address 10.213.0.1:6379 --node-ip 10.213.0.1 --work <dir>
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--node-ip", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--total", type=int, default=9)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--kill", type=int, default=7)
    args = parser.parse_args()

    import ray
    from ray import cloudpickle

    from tests.clients import ray_train_v2 as client

    # log_to_driver: the workers' output (tracebacks, robustdist's warnings) lands in this driver's log, which
    # outlives the lab; Ray's own logs live in the nodes' private temp disks and go with them.
    ray.init(address=args.address, _node_ip_address=args.node_ip, log_to_driver=True, configure_logging=False)
    cloudpickle.register_pickle_by_value(client)  # the workers import the client by value, not from tests/
    try:
        for name, extra in (("reference", {}), ("faults", {"faults": {"kill": args.kill}, "wipe": True,
                                                            "record_reports": True})):
            out = os.path.join(args.work, name)
            os.makedirs(out)
            config: dict[str, Any] = {"out": out, "ckpt": os.path.join(args.work, "ckpt"), "lr": 0.05,
                                      "total": args.total, "every": args.every, **extra}
            trainer = client.trainer(config, storage=os.path.join(args.work, "ray"), name=name, max_failures=1,
                                     placement_strategy="STRICT_SPREAD")
            result = trainer.fit()  # raises when the run fails (Train V2)
            with open(os.path.join(args.work, f"{name}.result.json"), "w") as fh:
                json.dump({"metrics": result.metrics, "checkpoint": getattr(result.checkpoint, "path", None)}, fh)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
