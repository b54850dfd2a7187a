"""A Ray Train V2 client in the shape of Ray's own examples (``torch_regression_example.py``, and the Tune
variant): a small regression model, ``TorchTrainer``, ``FailureConfig``, and a Tune trial driver that runs one
``TorchTrainer`` per trial with ``TuneReportCallback``. Hardened per the README: ``harden`` in the training
function, ``h.resume()`` and ``h.save(step, metrics=...)``, nothing else.

Faults, each once (marked by a file in ``config["out"]``):

* ``config["faults"] = {"hang": s, "kill": t}``: rank 1 sleeps at step ``s`` (the watchdog, with
  ``hang_action="abort"``, ends it), and SIGKILLs itself at step ``t``; with ``wipe`` it first deletes
  robustdist's checkpoint directory, so the restart can only resume from what was reported to Ray;
* ``config["crash_at_end"]``: every rank raises after the last save (an interrupted trial that had finished).

With ``config["record_reports"]`` every report to Ray is also recorded (:func:`_record_reports`).

Each attempt appends ``{"rank", "resumed", "source", "ray_checkpoint", "host", ...}`` to ``out/resumes.jsonl``; rank 0 writes
the final parameters to ``out/final.pt``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def train_fn(config: dict[str, Any]) -> None:
    import ray.train

    from robustdist import harden

    out = config["out"]
    model, loader = _model_and_loader()
    cfg = {"data": {"seed": 3},
           "checkpoint": {"dir": config["ckpt"], "every_n_steps": config.get("every", 3), "keep_last": 2},
           "health": {"hang_timeout": config.get("hang_timeout", 120), "hang_action": "abort"}}
    if config.get("record_reports"):
        _record_reports(out)
    h = harden(model, loader, cfg)
    with h:
        rank = h.topology.rank
        opt = torch.optim.SGD(h.model.parameters(), lr=config["lr"])
        ray_ckpt = ray.train.get_checkpoint()
        step = h.resume(optimizer=opt) or 0
        with open(os.path.join(out, "resumes.jsonl"), "a") as fh:
            topo = h.topology
            fh.write(json.dumps({"rank": rank, "resumed": step, "directory": h.checkpointer.directory,
                                 "host": socket.gethostname(),
                                 "topology": [topo.launcher, topo.rank, topo.world_size, topo.local_rank,
                                              topo.local_world_size, str(topo.device), h.init_report.created],
                                 "source": h.last_loaded.source if h.last_loaded else None,
                                 "ray_checkpoint": getattr(ray_ckpt, "path", None)}) + "\n")
        total = config["total"]
        while step < total:
            for xb, yb in h.loader:
                _fault(config, h, rank, step)
                loss = nn.functional.mse_loss(h.model(xb), yb)
                loss.backward()
                if h.step_guard(loss, step):
                    opt.step()
                opt.zero_grad()
                step += 1
                h.save(step, optimizer=opt, metrics={"loss": loss.item(), "lr": config["lr"]})
                if step == total:
                    break
        if config.get("crash_at_end") and _first_time(out, f"crash-{rank}"):
            raise RuntimeError("interrupted after the last checkpoint (simulated)")
        if rank == 0:
            torch.save({k: v.detach().clone() for k, v in h.model.module.state_dict().items()},
                       os.path.join(out, "final.pt"))


def train_fn_inprocess(config: dict[str, Any]) -> None:
    """The same job with ``recovery.in_process: true`` and ``h.run``: with ``config["raise_at"]`` rank 1 raises
    once, before the backward of that step (rank 0 is then in DDP's all-reduce); with ``config["fatal_at"]`` it
    raises ``MemoryError`` there once (never recovered in place: Ray's restart takes over). Each generation appends
    ``{"rank", "pid", "generation", "created", "port", "ray_port", "resumed", "source", "from_process"}`` to
    ``out/generations.jsonl``; rank 0 writes ``out/final.pt``; each rank writes its recoveries' count to
    ``out/recoveries-<rank>``."""
    from robustdist import harden
    from robustdist.recovery import generation, history

    out = config["out"]
    model, loader = _model_and_loader()
    cfg = {"data": {"seed": 3},
           "checkpoint": {"dir": config["ckpt"], "every_n_steps": config.get("every", 3), "keep_last": 2,
                          "local_every_n_steps": 1, "local_dir": config["local_dir"]},
           "recovery": {"in_process": True}}
    if config.get("stuck_at"):  # rank 0 finds rank 1's stopped heartbeats (its watchdog hands errors to Ray)
        cfg["health"] = {"hang_timeout": 3}
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    h = harden(model, loader, cfg, optimizer=optimizer)
    rank = h.topology.rank
    if config.get("report_raise_at") or config.get("stage_raise_at") or config.get("stuck_at"):
        _fail_report(out, rank, config.get("report_raise_at"), config.get("stage_raise_at"))
        handler = logging.FileHandler(os.path.join(out, f"log-{rank}-{os.getpid()}.txt"))
        handler.setLevel(logging.INFO)
        logging.getLogger("robustdist").addHandler(handler)  # what each rank said of the fault (the test reads it)

    def train(h: Any, step: int) -> int:
        loaded = h.last_loaded
        with open(os.path.join(out, "generations.jsonl"), "a") as fh:
            fh.write(json.dumps({"rank": rank, "pid": os.getpid(), "generation": generation(),
                                 "created": h.init_report.created, "port": h.topology.master_port,
                                 "ray_port": os.environ.get("MASTER_PORT"), "resumed": step,
                                 "source": loaded.source if loaded else None,
                                 "from_process": loaded.from_process if loaded else None}) + "\n")
        while step < config["total"]:
            for xb, yb in h.loader:
                loss = nn.functional.mse_loss(h.model(xb), yb)
                if rank == 1 and step + 1 == config.get("raise_at") and _first_time(out, "raise"):
                    raise RuntimeError(f"boom before the backward of step {step + 1} (simulated)")
                if rank == 1 and step + 1 == config.get("fatal_at") and _first_time(out, "fatal"):
                    raise MemoryError(f"out of memory before the backward of step {step + 1} (simulated)")
                if step + 1 == config.get("stuck_at") and generation() == 0 and _first_time(out, f"stuck-{rank}"):
                    send_to_a_stopping_peer(rank)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                step += 1
                h.save(step, optimizer=optimizer, metrics={"loss": loss.item()})
                if step == config["total"]:
                    break
        return step

    h.run(train, optimizer=optimizer)
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(out, "final.pt"))
    with open(os.path.join(out, f"recoveries-{rank}"), "w") as fh:
        fh.write(str(len(history())))


def send_to_a_stopping_peer(rank: int, stop_for: float = 8.0) -> None:
    """Pipeline-style activations, 200 MB, from rank 0 to rank 1, which posts its receive and stops (SIGSTOP;
    continued ``stop_for`` seconds later) while the data flows: when a fault then shuts the group's connections
    down, gloo ends neither wait (also used by tests/recovery/test_run.py)."""
    import torch.distributed as dist

    big = torch.ones(200 << 20, dtype=torch.uint8)
    if rank == 1:
        work = dist.irecv(torch.empty_like(big), 0)  # its "ready" is sent before this returns: the data flows
        subprocess.Popen(["sh", "-c", f"sleep {stop_for}; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
        work.wait()
    else:
        dist.isend(big, 1).wait()


def _fail_report(out: str, rank: int, report_at: int | None, stage_at: int | None) -> None:
    """Once, on rank 1: Ray's ``ray.train.report`` of step ``report_at``'s checkpoint raises once rank 0 is in its
    own ``ray.train.report`` of that step (rank 0 then waits in Ray's report barrier: a rank 0 slower to get there
    would see the fault first and join an in-process recovery instead), or the staging of step ``stage_at``'s
    files for Ray fails (before any rank enters Ray's barrier)."""
    import ray.train

    from robustdist.ray import train as ray_train

    original_report, original_stage = ray.train.report, ray_train._stage
    entered = os.path.join(out, f"report-{report_at}-entered-by-rank-0")

    def report(metrics: Any, *args: Any, **kwargs: Any) -> Any:
        if report_at is not None and metrics.get("step") == report_at:
            if rank == 0:
                open(entered, "a").close()  # robustdist has marked this rank as waiting in ray.train.report
            elif rank == 1 and _first_time(out, "report"):
                deadline = time.monotonic() + 60
                while not os.path.exists(entered) and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(0.5)  # rank 0 on into Ray's barrier
                raise OSError(f"Ray's report of step {report_at} failed (simulated)")
        return original_report(metrics, *args, **kwargs)

    def stage(step_dir: str, *args: Any, **kwargs: Any) -> Any:
        if rank == 1 and stage_at is not None and step_dir.endswith(f"{stage_at:010d}") and _first_time(out, "stage"):
            raise OSError(f"[Errno 28] No space left on device: staging step {stage_at} (simulated)")
        return original_stage(step_dir, *args, **kwargs)

    ray.train.report = report
    ray_train._stage = stage


def _model_and_loader() -> tuple[nn.Module, DataLoader[Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 4, generator=g)
    return model, DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8, shuffle=True,
                             drop_last=True)


def _record_reports(out: str) -> None:
    """Instrumentation for the 2-node test: every ``ray.train.report`` this worker makes (robustdist's, on each
    commit) also appends ``{"rank", "host", "name", "files"}`` to ``out/reports.jsonl``: which rank sent which
    files to Ray's storage, from which node."""
    import ray.train

    original = ray.train.report

    def report(metrics: Any, *args: Any, **kwargs: Any) -> Any:
        checkpoint = kwargs.get("checkpoint", args[0] if args else None)
        record = {"rank": ray.train.get_context().get_world_rank(), "host": socket.gethostname(),
                  "name": kwargs.get("checkpoint_dir_name"),
                  "files": sorted(os.listdir(checkpoint.path)) if checkpoint is not None else []}
        with open(os.path.join(out, "reports.jsonl"), "a") as fh:
            fh.write(json.dumps(record) + "\n")
        return original(metrics, *args, **kwargs)

    ray.train.report = report


def _first_time(out: str, name: str) -> bool:
    marker = os.path.join(out, f"fault-{name}")
    if os.path.exists(marker):
        return False
    open(marker, "w").close()
    return True


def _fault(config: dict[str, Any], h: Any, rank: int, step: int) -> None:
    faults = config.get("faults", {})
    fault = next((name for name, at in faults.items() if at == step), None)
    if rank != 1 or fault is None or not _first_time(config["out"], fault):
        return
    if fault == "kill":
        if config.get("wipe"):
            shutil.rmtree(h.checkpointer.directory)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(3600)  # "hang": only the watchdog ends this


def trainer(config: dict[str, Any], *, storage: str, name: str, max_failures: int = 1, callbacks: Any = None,
            cpus_per_worker: float = 1.0, placement_strategy: str = "PACK", train_fn: Any = train_fn) -> Any:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    return TorchTrainer(
        train_fn, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": cpus_per_worker},
                                     placement_strategy=placement_strategy),
        run_config=RunConfig(storage_path=storage, name=name, failure_config=FailureConfig(max_failures=max_failures),
                             callbacks=callbacks or []))


class ErrorLog:
    """A Train V2 ``UserCallback`` (it runs in the controller) that writes what the controller saw each worker
    raise to ``path`` (one JSON line per failure)."""

    def __new__(cls, path: str) -> Any:
        from ray.train.v2.api.callback import UserCallback

        class _ErrorLog(UserCallback):
            def __init__(self, path: str) -> None:
                self.path = path

            def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
                with open(self.path, "a") as fh:
                    fh.write(json.dumps({str(r): f"{type(e).__name__}: {e}" for r, e in worker_exceptions.items()})
                             + "\n")

        return _ErrorLog(path)


def trial_driver(config: dict[str, Any]) -> None:
    """A Tune trial: one TorchTrainer, its run named after the trial (as Ray's V2 Tune guide does), its reports
    passed on to Tune."""
    import ray.tune
    from ray.tune.integration.ray_train import TuneReportCallback

    trial = ray.tune.get_context().get_trial_id()
    train_config = {k: v for k, v in config.items() if k != "storage"}
    train_config["out"] = os.path.join(config["out"], f"trial-{trial}")
    os.makedirs(train_config["out"], exist_ok=True)
    trainer(train_config, storage=config["storage"], name=f"trial-{trial}", max_failures=0,
            callbacks=[TuneReportCallback()], cpus_per_worker=0.45).fit()
