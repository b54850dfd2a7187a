"""A client in the shape of Accelerate's ``examples/nlp_example.py`` (and its ``complete_nlp_example.py``
checkpointing), ported to robustdist. Our own code: a small classifier on synthetic token data
stands in for BERT on GLUE MRPC.

The upstream shape, kept: ``Accelerator(cpu=..., mixed_precision=...)``, ``set_seed``, train and eval
loaders, AdamW with a linear warm-up schedule, ``accelerator.prepare(model, optimizer, train, eval, scheduler)``,
``accelerator.backward(loss / accumulation)``, a step every ``accumulation`` batches, evaluation through
``accelerator.gather_for_metrics`` each epoch, and resuming with ``load_state`` + ``skip_first_batches``.

What the port changes (docs/porting.md, "Accelerate"):

* each DataLoader gets its own ``generator=``: a DataLoader draws a seed from the global RNG whenever an epoch
  starts, so a run resumed mid-epoch would otherwise draw different dropout masks than the straight run;
* ``robustdist.safe_init_process_group()`` before ``Accelerator()``, which uses that group: Accelerate's own
  ``init_process_group`` cannot rendezvous again after torchrun restarts the job (``Gloo connectFullMesh failed``);
* after ``prepare``: ``h = robustdist.harden(model, train_loader, cfg, optimizer=optimizer)``. An Accelerator is in
  charge, so harden keeps its DDP and its sampler (no second wrap, no second shard) and adds the watchdog and
  the step guard; ``optimizer.step()`` runs ``if h.step_guard(loss, step)``;
* ``accelerator.save_state(dir)`` / ``load_state(dir)`` -> ``robustdist.frameworks.accelerate.save_state`` /
  ``load_state``: a checkpoint is committed whole or not at all, and a damaged newest one falls back to the one
  before.

Run under ``torchrun --standalone --nproc_per_node=2`` (CPU, gloo). ``--kill-at k``: on the first attempt, rank 1
SIGKILLs itself at optimizer step k. ``--kill-in-save k``: on the first attempt, rank 0 SIGKILLs itself inside
the save of step k, after Accelerate wrote the model but before the rest. ``--order harden-first``: the
mistake (harden before prepare). At the end every rank writes ``final-<tag>-rank<r>.pt`` and
``result-<tag>-rank<r>.json`` to ``--workdir``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, Dataset

import robustdist
from robustdist.frameworks import accelerate as rd_accelerate

VOCAB, LENGTH, CLASSES = 50, 12, 2


class PairsDataset(Dataset):
    """Synthetic 'sentence pairs': token ids, and a label that depends on them (so the model can learn)."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
        self.labels = (self.ids[:, : LENGTH // 2].sum(1) > self.ids[:, LENGTH // 2:].sum(1)).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.body = nn.Sequential(nn.Linear(32 * LENGTH, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, CLASSES))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.body(self.embed(input_ids).flatten(1))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


def training_function(config: dict, args: argparse.Namespace) -> None:
    robustdist.safe_init_process_group()  # before Accelerator(), which adopts it: a restarted attempt can rendezvous
    accelerator = Accelerator(cpu=True, mixed_precision=args.mixed_precision,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    lr, num_epochs, seed, batch_size = config["lr"], config["num_epochs"], config["seed"], config["batch_size"]
    accumulation = config["gradient_accumulation_steps"]
    set_seed(seed)
    # Each loader has its own generator: a DataLoader draws a seed from the global RNG whenever an epoch starts,
    # so without one a run resumed mid-epoch (a new iterator, the RNG restored) draws its dropout differently.
    train_dataloader = DataLoader(PairsDataset(96, 1), shuffle=True, batch_size=batch_size,
                                  generator=torch.Generator().manual_seed(seed))
    eval_dataloader = DataLoader(PairsDataset(32, 2), shuffle=False, batch_size=batch_size,
                                 generator=torch.Generator().manual_seed(seed))
    model = Classifier().to(accelerator.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    updates_per_epoch = len(train_dataloader) // accumulation // accelerator.num_processes
    total = updates_per_epoch * num_epochs
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 3) * max(0.0, 1 - s / (total + 1)))
    cfg = {"health": {"hang_timeout": 120.0, "nan_policy": "skip"}}
    if args.order == "harden-first":  # the mistake: harden before prepare
        h = robustdist.harden(model, train_dataloader, cfg, optimizer=optimizer)
        model, optimizer, train_dataloader = accelerator.prepare(h.model, optimizer, h.loader)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    h = robustdist.harden(model, train_dataloader, cfg, optimizer=optimizer)
    assert h.model is model and h.loader is train_dataloader, "harden re-wrapped what Accelerate prepared"
    workdir = Path(args.workdir)
    ckpt_dir = workdir / "ckpt"
    rank = accelerator.process_index
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if args.kill_in_save is not None and attempt == 0 and rank == 0:
        # A kill inside the save: the model half written, nothing else (Accelerate's public pre-save hook).
        def dying(models, weights, output_dir):
            if os.path.basename(output_dir).startswith(f".tmp-checkpoint_{args.kill_in_save}-"):
                (Path(output_dir) / "model.safetensors").write_bytes(b"\0" * 100)
                os.kill(os.getpid(), signal.SIGKILL)

        accelerator.register_save_state_pre_hook(dying)
    step = rd_accelerate.load_state(accelerator, ckpt_dir) or 0
    resumed_from = step if step else None
    losses: list[float] = []
    decisions: list[str] = []
    accuracies: list[float] = []
    batches_per_epoch = updates_per_epoch * accumulation
    for epoch in range(step // updates_per_epoch, num_epochs):
        model.train()
        train_dataloader.set_epoch(epoch)
        skip = (step - epoch * updates_per_epoch) * accumulation
        active = accelerator.skip_first_batches(train_dataloader, skip) if skip else train_dataloader
        for batch_index, batch in enumerate(active, start=skip):
            if batch_index >= batches_per_epoch:
                break
            outputs = model(**batch)
            loss = outputs["loss"] / accumulation
            accelerator.backward(loss)
            if (batch_index + 1) % accumulation:
                continue
            if args.kill_at is not None and attempt == 0 and rank == 1 and step == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            decision = h.step_guard(loss, step)
            decisions.append(str(decision.action))
            if decision:
                optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            step += 1
            if step % args.checkpointing_steps == 0:
                rd_accelerate.save_state(accelerator, ckpt_dir, step, keep_last=2)
        model.eval()
        correct = total_seen = 0
        for batch in eval_dataloader:
            with torch.no_grad():
                logits = model(input_ids=batch["input_ids"])["logits"]
            predictions, references = accelerator.gather_for_metrics((logits.argmax(-1), batch["labels"]))
            correct += int((predictions == references).sum())
            total_seen += len(references)
        accuracies.append(correct / total_seen)
        accelerator.print(f"epoch {epoch}: accuracy {correct / total_seen:.3f}")
    torch.save({k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
               workdir / f"final-{args.tag}-rank{rank}.pt")
    (workdir / f"result-{args.tag}-rank{rank}.json").write_text(json.dumps({
        "world": accelerator.num_processes, "attempt": attempt, "resumed_from": resumed_from, "losses": losses,
        "decisions": decisions, "accuracies": accuracies, "steps": step, "wrapper": type(model).__name__,
        "committed": rd_accelerate.committed_states(ckpt_dir)}))
    h.close()
    accelerator.end_training()


def main() -> None:
    parser = argparse.ArgumentParser(description="Accelerate nlp_example-shaped client, hardened.")
    parser.add_argument("--mixed_precision", default="no", choices=["no", "bf16"])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--tag", default="run")
    parser.add_argument("--checkpointing_steps", type=int, default=4)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--kill-in-save", type=int, default=None)
    parser.add_argument("--order", default="prepare-first", choices=["prepare-first", "harden-first"])
    args = parser.parse_args()
    config = {"lr": 2e-3, "num_epochs": 3, "seed": 42, "batch_size": 8, "gradient_accumulation_steps": 2}
    training_function(config, args)


if __name__ == "__main__":
    main()
