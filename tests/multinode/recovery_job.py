"""A training script for the in-memory tier's end-to-end tests (``test_fast_recovery.py``), run under torchrun.

The usual shape (``harden``, ``resume``, a loop with ``save``) with the durable tier every ``--every`` steps and
the in-memory tier every ``--local-every`` steps in ``--local-dir`` (the same path on every rank; with
``--node-dirs`` each worker sees its node's own directory there, see :func:`private_node_dir`). The model has
dropout (the RNG matters) and SGD momentum (the optimizer state matters); the loader shuffles (its position
matters).

After the last step (``--steps``, or ``--stop-at``), every rank trains a straight-through reference in the same
process (same seeds, no checkpoints, no fault) and compares its model and optimizer state with it, bitwise.
``--stop-at S`` ends the run at step S after waiting for the in-memory step S to complete, and keeps the
in-memory copies (``h.close(keep_local=True)``) for the next launch; a run that reaches ``--steps`` closes
cleanly (the tier removes its directories).

Faults, on attempt 0 only:

* ``--pause-at P --pause-rank R``: rank R, once the in-memory step P is complete, records ``paused`` and sleeps
  (at most ``--pause-max`` s, then exits 5): the test kills its node there.
* ``--kill-local-save S --kill-rank R``: rank R SIGKILLs itself inside its in-memory save of step S (the fault
  hook's ``local_writing`` phase: the copy's files written, before its meta and rename), a second after
  reaching it.

Each rank appends JSON lines to ``--events/rank<r>-pid<pid>.jsonl``: ``start`` (attempt, GROUP_RANK, the step
resumed from, the source and its detail, the warnings ``resume`` issued, the durable steps before resuming,
the step directories this node's in-memory directory held at the start), ``paused``, ``killing``, ``error``
(then exit 3) and ``end`` (the step, stopped or done, whether the state is bitwise equal to the reference, the
mismatched keys, a checksum).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import threading
import time
import warnings

ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG: a worker never outlives its torchrun agent


def private_node_dir(base: str, local_dir: str) -> None:
    """``--node-dirs BASE``: this worker gets a mount namespace of its own in which ``BASE/node<GROUP_RANK>`` is
    bind-mounted at ``local_dir``: one path in the config on every rank (the ranks compare config fingerprints),
    a directory per node, as ``/dev/shm`` is on real nodes. Needs root; done before any thread exists (unshare
    of the mount namespace needs a single-threaded process); the mount goes with the process."""
    libc = ctypes.CDLL(None, use_errno=True)
    clone_newns, ms_bind, ms_rec, ms_private = 0x00020000, 0x1000, 0x4000, 0x40000
    source = os.path.join(base, f"node{os.environ['GROUP_RANK']}")
    os.makedirs(source, exist_ok=True)
    os.makedirs(local_dir, exist_ok=True)
    if libc.unshare(clone_newns) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    if libc.mount(b"none", b"/", None, ms_rec | ms_private, None) != 0:
        raise OSError(ctypes.get_errno(), "mount --make-rprivate /")
    if libc.mount(source.encode(), local_dir.encode(), None, ms_bind, None) != 0:
        raise OSError(ctypes.get_errno(), f"mount --bind {source} {local_dir}")


if "--node-dirs" in sys.argv:
    private_node_dir(sys.argv[sys.argv.index("--node-dirs") + 1], sys.argv[sys.argv.index("--local-dir") + 1])

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from robustdist import harden, unwrap_model  # noqa: E402
from robustdist.checkpoint import _faults  # noqa: E402

from _events import Events  # noqa: E402  (the script directory is on sys.path)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--events", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--local-dir", required=True)
    p.add_argument("--node-dirs", default=None)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--local-every", type=int, default=2)
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--pause-at", type=int, default=None)
    p.add_argument("--pause-rank", type=int, default=1)
    p.add_argument("--pause-max", type=float, default=60.0)
    p.add_argument("--kill-local-save", type=int, default=None)
    p.add_argument("--kill-rank", type=int, default=1)
    return p.parse_args()


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))


def make_loader() -> DataLoader:
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(256, 8, generator=g), torch.randn(256, 1, generator=g))
    return DataLoader(data, batch_size=8, shuffle=True)  # 16 batches per rank per epoch at world size 2


def base_cfg() -> dict:
    return {"distributed": {"timeout": 60, "init_timeout": 60, "barrier_timeout": 60},
            "health": {"hang_timeout": None}}


def build(cfg: dict):
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)  # the same initial weights on every rank, in the run and in the reference
    h = harden(make_model(), make_loader(), cfg)
    optimizer = torch.optim.SGD(h.model.parameters(), lr=0.05, momentum=0.9)
    torch.manual_seed(100 + rank)  # per-rank dropout stream
    return h, optimizer


def train_steps(h, optimizer, start: int, end: int, on_step=None) -> int:
    step = start
    while step < end:
        for x, y in h.loader:
            loss = nn.functional.mse_loss(h.model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if on_step is not None:
                on_step(step)
            if step == end:
                break
    return step


def state_of(h, optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in unwrap_model(h.model).state_dict().items()}
    for i, s in optimizer.state_dict()["state"].items():
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{i}.{k}"] = v.detach().clone()
    return out


def bitwise_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    bad = [k for k in a if k not in b or a[k].shape != b[k].shape or a[k].dtype != b[k].dtype
           or not torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))]
    return bad + [k for k in b if k not in a]


def listing(directory: str) -> list[str]:
    """The step directories (committed ``step_*`` and staging ``.tmp-step_*``) under the in-memory tier's dir."""
    found = []
    for root, dirs, _ in os.walk(directory):
        found += [os.path.relpath(os.path.join(root, d), directory) for d in dirs
                  if d.startswith(("step_", ".tmp-step_"))]
    # relative to the tier's own directory (<local_dir>/robustdist-<uid>-<id>)
    return sorted(f.split("/", 1)[1] if f.startswith("robustdist-") else f for f in found)


def main() -> int:
    args = parse_args()
    events = Events(args.events)
    rank = int(os.environ.get("RANK", "0"))
    local_dir = args.local_dir
    cfg = base_cfg()
    cfg["checkpoint"] = {"dir": args.ckpt, "every_n_steps": args.every, "keep_last": 2,
                         "local_every_n_steps": args.local_every, "local_dir": local_dir, "local_keep_last": 1,
                         "replicas": 1}
    before = listing(local_dir)  # what this node holds when the run starts
    try:
        h, optimizer = build(cfg)
        durable_before = h.checkpointer.steps() if h.checkpointer is not None else []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resumed = h.resume(optimizer=optimizer)
        loaded = h.last_loaded
    except Exception as e:  # the tests read what each rank saw
        events("error", type=type(e).__name__, message=str(e))
        return 3
    attempt = h.attempt
    events("start", attempt=attempt, resumed=resumed, source=loaded.source if loaded else None,
           source_detail=loaded.source_detail if loaded else None, durable_before=durable_before,
           warnings=[str(w.message) for w in caught], local_dir=local_dir, listing=before,
           peers=list(h.local.peers) if h.local is not None else None,
           nodes=list(h.local.nodes) if h.local is not None else None)

    if attempt == 0 and args.kill_local_save is not None and rank == args.kill_rank:
        target = f"robustdist-local-ckpt-{args.kill_local_save}"

        def hook(phase: str) -> None:
            if phase == "local_writing" and threading.current_thread().name == target:
                events("killing", step=args.kill_local_save, phase=phase)
                # A moment first, so the other ranks' own copies of this step are surely committed: the restart
                # then finds a newer, incomplete step beside the previous complete one (never a race with it).
                time.sleep(1.0)
                os.kill(os.getpid(), signal.SIGKILL)

        _faults.HOOK = hook

    end = args.stop_at if args.stop_at is not None else args.steps

    def on_step(step: int) -> None:
        h.save(step, optimizer=optimizer)
        if attempt == 0 and args.pause_at == step and rank == args.pause_rank:
            h.local.wait()
            events("paused", step=step, local_complete=h.local.last_complete)
            time.sleep(args.pause_max)  # the test kills this node here
            events("error", type="Pause", message=f"not killed within {args.pause_max} s")
            sys.exit(5)

    step = train_steps(h, optimizer, resumed or 0, end, on_step)
    if h.local is not None:
        h.local.wait()
    local_complete = h.local.last_complete if h.local is not None else None
    final = state_of(h, optimizer)
    h_ref, opt_ref = build(base_cfg())  # adopts the group the first harden() created
    train_steps(h_ref, opt_ref, 0, end)
    reference = state_of(h_ref, opt_ref)
    bad = bitwise_diff(final, reference)
    h_ref.close()
    checksum = float(sum(v.double().sum() for k, v in final.items() if k.startswith("model.")))
    events("end", step=step, stopped=args.stop_at is not None, local_complete=local_complete,
           bitwise_equal=not bad, mismatched=bad, tensors=len(final), checksum=checksum)
    h.close(keep_local=args.stop_at is not None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
