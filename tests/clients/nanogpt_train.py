"""A client in the shape of nanoGPT's ``train.py``, ported to ``harden()``. Our own code, not nanoGPT's.

What the upstream script does, and what the port changes (docs/porting.md, "nanoGPT's train.py"):

* ``ddp = int(os.environ.get('RANK', -1)) != -1``, ``init_process_group``, ``torch.cuda.set_device``: gone;
  ``robustdist.local_device()`` gives the device before ``harden`` (for ``model.to`` and the autocast type);
* ``gradient_accumulation_steps //= world_size`` and ``torch.manual_seed(1337 + seed_offset)``: kept;
* ``get_batch`` draws random offsets from the global torch RNG and *prefetches* the next batch inside the
  micro-step loop: kept. robustdist saves every rank's RNG, and the prefetched batch, which lives in a local
  across the save point, is given to ``h.save`` as a plain extra (each rank's own: it differs per rank);
* ``GradScaler(enabled=(dtype == 'float16'))``, ``scaler.scale(loss).backward()``, ``unscale_`` + clip,
  ``scaler.step``, ``scaler.update``: kept; the scaler is given to ``harden`` (its overflows are its own
  business, and its scale is checkpointed), and ``scaler.step`` runs ``if h.step_guard(...)``;
* ``model.require_backward_grad_sync = (micro_step == last)`` for accumulation: kept (robustdist's DDP is a DDP);
* ``estimate_loss`` and the checkpoint under ``if iter_num % eval_interval == 0 and master_process``: made
  collective. Every rank evaluates (its own batches; the losses are averaged across ranks, so the
  ``best_val_loss`` condition is the same on every rank) and every rank calls ``h.save``; the checkpoint is
  taken after the evaluation, so a resumed run does not evaluate its first iteration again;
* ``init_from = 'resume'`` and ``torch.load(ckpt.pt)``: ``h.resume()``.

Run under ``torchrun --standalone --nproc_per_node=2`` (CPU, gloo). ``--kill-at k``: on the first attempt, rank 1
SIGKILLs itself at iteration k (torchrun ``--max-restarts`` restarts the job, which resumes). At the end, every
rank writes ``final-<tag>-rank<r>.pt`` (its weights) and ``result-<tag>-rank<r>.json`` to ``--workdir``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import robustdist
from robustdist import harden

VOCAB, BLOCK, EMBD, HEADS, LAYERS = 64, 16, 32, 2, 2
ALWAYS_SAVE_CHECKPOINT = True  # nanoGPT's default: a checkpoint at every evaluation


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(EMBD), nn.LayerNorm(EMBD)
        self.qkv, self.proj = nn.Linear(EMBD, 3 * EMBD), nn.Linear(EMBD, EMBD)
        self.mlp = nn.Sequential(nn.Linear(EMBD, 4 * EMBD), nn.GELU(), nn.Linear(4 * EMBD, EMBD))
        self.drop = nn.Dropout(0.1)
        self.register_buffer("mask", torch.tril(torch.ones(BLOCK, BLOCK)).view(1, 1, BLOCK, BLOCK), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(EMBD, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # nanoGPT's manual (non-flash) path
        att = F.softmax(att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf")), dim=-1)
        y = (self.drop(att) @ v).transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, EMBD), nn.Embedding(BLOCK, EMBD)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(EMBD)
        self.lm_head = nn.Linear(EMBD, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, VOCAB).float(), targets.view(-1))

    def configure_optimizers(self, weight_decay: float, lr: float, device_type: str) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=device_type == "cuda")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--tag", default="run")
    ap.add_argument("--max-iters", type=int, default=12)
    ap.add_argument("--eval-interval", type=int, default=4)
    ap.add_argument("--eval-iters", type=int, default=2)
    ap.add_argument("--grad-accum", type=int, default=4)  # across the job, as nanoGPT's config
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--dtype", default="float16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--init-scale", type=float, default=2.0 ** 16)
    ap.add_argument("--kill-at", type=int, default=-1)
    args = ap.parse_args()
    work = Path(args.workdir)

    device = robustdist.local_device()  # was: f"cuda:{ddp_local_rank}" and torch.cuda.set_device(device)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    assert args.grad_accum % world == 0
    grad_accum = args.grad_accum // world
    torch.manual_seed(1337 + rank)  # nanoGPT's seed_offset; DDP's first broadcast makes the weights rank 0's
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    ctx = nullcontext() if args.dtype == "float32" else torch.autocast(device.type, dtype=ptdtype)

    tokens = np.random.default_rng(0).integers(0, VOCAB, size=20_000).astype(np.int64)  # train.bin / val.bin
    data = {"train": torch.from_numpy(tokens[:18_000]), "val": torch.from_numpy(tokens[18_000:])}

    def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
        d = data[split]
        ix = torch.randint(len(d) - BLOCK, (args.batch_size,))
        x = torch.stack([d[i:i + BLOCK] for i in ix])
        y = torch.stack([d[i + 1:i + 1 + BLOCK] for i in ix])
        return x.to(device), y.to(device)

    model = GPT().to(device)
    scaler = torch.amp.GradScaler(device.type, init_scale=args.init_scale, enabled=args.dtype == "float16")
    optimizer = model.configure_optimizers(0.1, 1e-3, device.type)
    cfg = {"checkpoint": {"dir": str(work / "out"), "keep_last": 2}, "health": {"hang_timeout": 120}}
    h = harden(model, None, cfg, optimizer=optimizer, scaler=scaler)
    model = h.model

    @torch.no_grad()
    def estimate_loss() -> dict[str, float]:
        out = {}
        model.eval()
        for split in ("train", "val"):
            losses = torch.zeros(args.eval_iters)
            for k in range(args.eval_iters):
                x, y = get_batch(split)
                with ctx:
                    losses[k] = model(x, y)[1].item()
            mean = losses.mean()
            if world > 1:  # every rank decides alike on the best-loss condition
                dist.all_reduce(mean)
                mean /= world
            out[split] = mean.item()
        model.train()
        return out

    def get_lr(it: int) -> float:
        warmup, decay, lr, min_lr = 2, args.max_iters, 1e-3, 1e-4
        if it < warmup:
            return lr * (it + 1) / (warmup + 1)
        ratio = min(1.0, (it - warmup) / max(1, decay - warmup))
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)

    iter_num = h.resume() or 0  # was: init_from = 'resume'
    resumed_from = iter_num if h.last_loaded is not None else None
    best_val_loss = 1e9
    if h.last_loaded is not None:
        best_val_loss = h.last_loaded.state["best_val_loss"]
        X, Y = h.last_loaded.state["X"], h.last_loaded.state["Y"]  # this rank's prefetched batch
    else:
        X, Y = get_batch("train")
    losses_seen, decisions = [], []
    while True:
        for group in optimizer.param_groups:
            group["lr"] = get_lr(iter_num)
        if iter_num % args.eval_interval == 0 and iter_num != resumed_from:  # was: ... and master_process
            losses = estimate_loss()
            if losses["val"] < best_val_loss or ALWAYS_SAVE_CHECKPOINT:
                best_val_loss = min(best_val_loss, losses["val"])
                if iter_num > 0:
                    h.save(iter_num, force=True, best_val_loss=best_val_loss, X=X, Y=Y)  # every rank
        if iter_num == args.kill_at and rank == 1 and h.attempt == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        total = torch.zeros(())  # every micro-step's loss, so that a NaN in any of them reaches the guard
        for micro_step in range(grad_accum):
            model.require_backward_grad_sync = micro_step == grad_accum - 1
            with ctx:
                _, loss = model(X, Y)
                loss = loss / grad_accum
            total += loss.detach().float()
            X, Y = get_batch("train")  # the prefetch
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        decision = h.step_guard(total, iter_num)
        if decision:
            scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses_seen.append(loss.item() * grad_accum)
        decisions.append(decision.action)
        iter_num += 1
        if iter_num >= args.max_iters:
            break
    state = {k: v.detach().cpu() for k, v in robustdist.unwrap_model(model).state_dict().items()}
    torch.save(state, work / f"final-{args.tag}-rank{rank}.pt")
    (work / f"result-{args.tag}-rank{rank}.json").write_text(json.dumps({
        "resumed_from": resumed_from, "attempt": h.attempt, "losses": losses_seen, "decisions": decisions,
        "overflows": h.guard.overflows, "scale": scaler.get_scale(), "world": world, "device": str(device)}))
    h.close()


if __name__ == "__main__":
    main()
