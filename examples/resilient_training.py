"""Resilient training demo: a real crash, a recovery, a bit-identical result.

Run under ``torchrun --standalone --nproc_per_node=2 --max-restarts=1`` (on CPU):

1. Attempt 0 trains a small convnet with BatchNorm and dropout on synthetic data through ``harden()``,
   committing a checkpoint every ``--every`` steps. At step ``--kill-step``, rank 1 SIGKILLs itself.
2. torchrun sees the dead worker and restarts both ranks (attempt 1). ``resume()`` restores the model,
   optimizer, scheduler, every rank's RNG and the loader's position from the last committed checkpoint, and
   training continues to ``--steps``.
3. In the same processes, a reference run trains straight through (no checkpoints, no fault) from the same
   seeds. Every rank compares its final parameters and buffers with the reference **bitwise**.

Rank 0 prints a summary (steps, checkpoints committed, the fault, the resume step, the verdict, wall time)
and writes ``final.pt`` and ``reference.pt`` to ``--workdir``. The exit code is 0 only if every rank's
tensors are bitwise equal. ``--no-fault`` runs the same thing without the kill.

``make demo`` (``scripts/demo.py``) runs it with ``--in-process --no-reference`` instead: in-process recovery
(``recovery.in_process``, the loop under ``h.run``) from an in-memory checkpoint taken every step, every rank writing
``final-rank<r>.pt`` for the driver's own comparison with a straight run; under ``robustdist run`` only the killed rank
starts again. ``--kill-after FILE`` makes rank 1 wait at the kill step until FILE exists (the driver creates it once
the warm spare is ready). Every rank logs each step's time to ``steps-rank<r>.jsonl``, and ``fault.json`` records
the kill's time.

"Fresh run or restart?" is ``h.attempt``: the same on every rank, counted in torchrun's store. It is never
``TORCHELASTIC_RESTART_COUNT``, which torchrun counts per node: after a restart of a 2-node job it was 0 on one
node and 1 on the other (torch #108158), and an earlier version of this demo took that 0 for a fresh run and
deleted its checkpoints. The script never deletes anything: ``make demo`` empties ``--workdir`` before it
starts, and a run started on a workdir that holds checkpoints resumes from them.

The training loop is the one from robustdist's README: three lines of robustdist (``harden``, ``resume``,
``save``) plus ``step_guard``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from robustdist import CheckpointInfo, harden, unwrap_model


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default=".demo-run", help="checkpoints, stack dumps and results (default: .demo-run)")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps in total")
    p.add_argument("--every", type=int, default=10, help="commit a checkpoint every this many steps")
    p.add_argument("--kill-step", type=int, default=37, help="rank 1 SIGKILLs itself at this step on attempt 0")
    p.add_argument("--no-fault", action="store_true", help="do not inject the fault")
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds to pause after each step (time for an outside fault, e.g. killing a node)")
    p.add_argument("--in-process", action="store_true",
                   help="recover in the same processes (recovery.in_process, h.run) from an in-memory checkpoint "
                        "taken every step: under `robustdist run` only the killed rank starts again")
    p.add_argument("--kill-after", default=None, metavar="FILE",
                   help="the fault waits for FILE: at --kill-step rank 1 waits until FILE exists (at most 120 s), then "
                        "kills itself (make demo creates it once robustdist run's spare is warm)")
    p.add_argument("--no-reference", action="store_true",
                   help="no straight-through reference run in the same processes (make demo runs one of its own); "
                        "every rank writes final-rank<r>.pt")
    return p.parse_args()


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(16, 10),
    )


def make_loader() -> DataLoader:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(512, 3, 16, 16, generator=g)
    y = torch.randint(0, 10, (512,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)


def train(cfg: dict, steps: int, *, fault_step: int | None, work: Path | None, step_sleep: float = 0.0,
          kill_after: str | None = None) -> tuple[dict, int | None, object]:
    """The user's training loop, hardened. Returns (final state, the step last resumed from, the Hardened). With
    ``recovery.in_process`` it runs under ``h.run``, which recovers in the same processes and closes ``h`` at the end;
    otherwise ``h`` stays open (the caller closes it after its reference run)."""
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)  # same initial weights everywhere
    model = make_model()
    h = harden(model, make_loader(), cfg)  # <- robustdist line 1
    kill_at = fault_step if h.attempt == 0 else None  # the fault only on the first attempt, on every node alike
    if "ROBUSTDIST_REPLACES" in os.environ:  # a rank robustdist run started again alone: the fault is behind it
        kill_at = None
    if work is not None:  # what the launcher says beside it: per node, so it can disagree across nodes
        told = os.environ.get("TORCHELASTIC_RESTART_COUNT", "-1")
        print(f"[rank {rank}] attempt {h.attempt} (TORCHELASTIC_RESTART_COUNT on this node: {told})", flush=True)
    if work is not None and rank == 0 and h.attempt == 0 and "ROBUSTDIST_REPLACES" not in os.environ:
        if h.checkpointer is not None and h.checkpointer.steps():
            print(f"{work} holds checkpoints of an earlier run: resuming from them (make demo empties it first)",
                  flush=True)
        (work / "demo.json").write_text(json.dumps({"started": time.time()}))
    optimizer = torch.optim.SGD(h.model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
    torch.manual_seed(100 + rank)  # per-rank dropout stream
    resumed: list[int] = []

    def loop(h, step: int) -> int:  # h.run's function: from the step resumed to the end
        resumed.append(step)
        while step < steps:
            for x, y in h.loader:
                if kill_at is not None and step == kill_at and rank == 1 and work is not None:
                    waited = time.monotonic()
                    while kill_after is not None and not os.path.exists(kill_after):  # rank 0 waits in the step
                        if time.monotonic() - waited > 120:
                            raise SystemExit(f"--kill-after: {kill_after} did not appear within 120 s")
                        time.sleep(0.05)
                    (work / "fault.json").write_text(json.dumps({"rank": 1, "step": step, "signal": "SIGKILL",
                                                                 "time": time.time()}))
                    os.kill(os.getpid(), signal.SIGKILL)  # the fault: no cleanup, no flush, mid-epoch
                loss = nn.functional.cross_entropy(h.model(x), y)
                loss.backward()
                decision = h.step_guard(loss, step)
                if decision:
                    optimizer.step()
                    scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                if decision.rolled_back:
                    step = decision.resume_step
                    break
                step += 1
                info = h.save(step, optimizer=optimizer, scheduler=scheduler)  # <- robustdist line 3
                if work is not None:
                    with (work / f"steps-rank{rank}.jsonl").open("a") as f:
                        f.write(json.dumps({"step": step, "time": time.time(), "pid": os.getpid()}) + "\n")
                    if isinstance(info, CheckpointInfo) and rank == 0:
                        with (work / "saves.log").open("a") as f:
                            f.write(f"{step}\n")
                if step == steps:
                    break
                if step_sleep:
                    time.sleep(step_sleep)
        return step

    if cfg.get("recovery", {}).get("in_process"):
        h.run(loop, optimizer=optimizer, scheduler=scheduler)  # resume, train (recovering in process), close
    else:
        loop(h, h.resume(optimizer=optimizer, scheduler=scheduler) or 0)  # <- robustdist line 2
    final = {k: v.detach().clone() for k, v in unwrap_model(h.model).state_dict().items()}
    return final, resumed[-1] or None, h


def bitwise_equal(a: dict, b: dict) -> list[str]:
    bad = [k for k in a if k not in b or a[k].shape != b[k].shape or a[k].dtype != b[k].dtype
           or not torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))]
    return bad + [k for k in b if k not in a]


def main() -> int:
    args = parse_args()
    rank = int(os.environ.get("RANK", "0"))
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)  # never emptied here: a restart must find its checkpoints
    cfg: dict = {"checkpoint": {"dir": str(work / "ckpt"), "every_n_steps": args.every, "keep_last": 2},
                 "health": {"hang_timeout": 120, "dump_dir": str(work / "dumps")}}
    if args.in_process:
        if not args.no_reference:
            raise SystemExit("--in-process needs --no-reference: h.run closes the group the reference would use")
        cfg["checkpoint"]["local_every_n_steps"] = 1
        cfg["recovery"] = {"in_process": True}
    final, resumed, h = train(cfg, args.steps, fault_step=None if args.no_fault else args.kill_step, work=work,
                              step_sleep=args.step_sleep, kill_after=args.kill_after)
    attempt = h.attempt
    if args.no_reference:
        torch.save(final, work / f"final-rank{rank}.pt")
        if rank == 0:
            summary(work, args, attempt, resumed, None, len(final), h)
        h.close()
        return 0
    reference, _, h_ref = train({"health": {"hang_timeout": 120}}, args.steps, fault_step=None, work=None)
    h_ref.close()  # the group was created by the first harden(); only its close() destroys it
    bad = bitwise_equal(final, reference)
    mismatches = torch.tensor([float(len(bad))])
    if dist.is_initialized():
        dist.all_reduce(mismatches)
    if bad:
        print(f"[rank {rank}] differs from the reference: {', '.join(bad)}", flush=True)
    if rank == 0:
        torch.save(final, work / "final.pt")
        torch.save(reference, work / "reference.pt")
        summary(work, args, attempt, resumed, int(mismatches.item()), len(final), h)
    h.close()
    return 0 if mismatches.item() == 0 else 1


def summary(work: Path, args: argparse.Namespace, attempt: int, resumed: int | None, mismatches: int | None,
            tensors: int, h: object) -> None:
    started = json.loads((work / "demo.json").read_text())["started"]
    fault = json.loads((work / "fault.json").read_text()) if (work / "fault.json").exists() else None
    saves = (work / "saves.log").read_text().split() if (work / "saves.log").exists() else []
    on_disk = h.checkpointer.steps() if h.checkpointer is not None else []
    verdict = "not compared here (--no-reference: final-rank<r>.pt)" if mismatches is None else "BITWISE EQUAL" \
        if mismatches == 0 else f"DIFFERENT ({mismatches} tensor(s) across ranks)"
    lines = [
        "",
        "== robustdist resilient-training demo ==",
        f"steps trained            {args.steps} (2 ranks, gloo, DDP + SyncBatchNorm, dropout, SGD + StepLR)",
        f"checkpoints committed    {len(saves)} (at steps {', '.join(saves) or '-'}; on disk now: {on_disk})",
        "fault injected           " + (f"rank {fault['rank']} sent itself {fault['signal']} at step {fault['step']} "
                                       "on attempt 0" if fault else "none (--no-fault)"),
        f"torchrun attempts        {attempt + 1}",
        f"resumed from step        {resumed if resumed is not None else '- (no restart)'}",
        f"final vs straight-through reference: {verdict} ({tensors} parameters and buffers per rank)",
        f"wall time                {time.time() - started:.1f} s",
        "",
    ]
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
