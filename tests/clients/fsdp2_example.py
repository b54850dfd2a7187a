"""A client in the shape of pytorch/examples ``distributed/FSDP2/example.py``, ported to ``harden()``.

What the upstream script does by hand, and where it went:

* the model is built on the meta device, with ``reset_parameters()`` (here the root's covers everything,
  and re-creates the RoPE-like ``freqs`` buffer, which ``to_empty()`` leaves as garbage);
* ``fully_shard(layer)`` per transformer block, then ``fully_shard(model)``: ``fsdp.shard_modules: auto``;
* ``--mixed-precision`` -> ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``:
  ``fsdp.mixed_precision: bf16``;
* ``to_empty(device=...)`` + ``reset_parameters()`` and the DCP checkpoints: done by ``harden``
  (``h.resume``/``h.save``). The optimizer is created after ``harden`` (sharding replaces parameters).

Run under ``torchrun --standalone --nproc_per_node=2`` (CPU, gloo). ``--stop-at k`` ends the run after step k
(a checkpoint is forced there), so a second invocation resumes. At the end, every rank takes part in
gathering the full model state, and rank 0 writes ``result-<tag>.json`` to ``--workdir``: the SHA-256 of the
full state (before and after training), the losses, which modules are FSDPModules, and the parameter dtype
seen inside a block's forward.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from robustdist import harden


@dataclass
class Args:
    n_layers: int = 2
    vocab_size: int = 32
    max_seq_len: int = 8
    dim: int = 16
    n_heads: int = 2
    dropout_p: float = 0.1


def rope_freqs(dim: int, seq_len: int) -> torch.Tensor:
    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)  # (seq_len, dim)


def rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    cos, sin = freqs[: x.shape[-2], :half].to(x.dtype), freqs[: x.shape[-2], half:].to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class SelfAttention(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.heads, self.p = a.n_heads, a.dropout_p
        self.qkv = nn.Linear(a.dim, 3 * a.dim, bias=False)
        self.proj = nn.Linear(a.dim, a.dim, bias=False)
        self.drop = nn.Dropout(a.dropout_p)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        q, k = rotate(q, freqs), rotate(k, freqs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0)
        return self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))

    def reset_parameters(self) -> None:
        self.qkv.reset_parameters()
        self.proj.reset_parameters()


class MLP(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.fc, self.out = nn.Linear(a.dim, 4 * a.dim), nn.Linear(4 * a.dim, a.dim)
        self.drop = nn.Dropout(a.dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.out(F.gelu(self.fc(x))))

    def reset_parameters(self) -> None:
        self.fc.reset_parameters()
        self.out.reset_parameters()


class Block(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(a.dim), SelfAttention(a)
        self.norm2, self.mlp = nn.LayerNorm(a.dim), MLP(a)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), freqs)
        return x + self.mlp(self.norm2(x))

    def reset_parameters(self) -> None:
        for m in (self.norm1, self.attn, self.norm2, self.mlp):
            m.reset_parameters()


class Transformer(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.args = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.norm = nn.LayerNorm(a.dim)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)
        self.register_buffer("freqs", rope_freqs(a.dim // a.n_heads, a.max_seq_len), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.freqs)
        return self.output(self.norm(h)).float()

    def reset_parameters(self) -> None:
        self.tok_embeddings.reset_parameters()
        for layer in self.layers:
            layer.reset_parameters()
        self.norm.reset_parameters()
        self.output.reset_parameters()
        self.freqs = rope_freqs(self.args.dim // self.args.n_heads, self.args.max_seq_len)  # re-created


class Tokens(Dataset):
    """Synthetic next-token data, the same on every rank (the sampler splits it)."""

    def __init__(self, n: int, a: Args):
        g = torch.Generator().manual_seed(1234)
        self.data = torch.randint(0, a.vocab_size, (n, a.max_seq_len + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def full_state_digest(model: nn.Module) -> str:
    """SHA-256 of the full (unsharded) state, gathered with DCP's state-dict API (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description="FSDP2 example, hardened")
    p.add_argument("--workdir", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--stop-at", type=int, default=None, help="end after this step (a checkpoint is forced)")
    p.add_argument("--every", type=int, default=3, help="checkpoint every this many steps")
    p.add_argument("--mixed-precision", action="store_true")
    p.add_argument("--tag", default="run")
    args = p.parse_args()

    from torch.distributed.fsdp import FSDPModule

    seed_everything(0)
    margs = Args()
    with torch.device("meta"):
        model = Transformer(margs)
    loader = DataLoader(Tokens(64, margs), batch_size=4, shuffle=True, drop_last=True)
    cfg = {"distributed": {"strategy": "fsdp", "backend": "gloo", "timeout": 120},
           "fsdp": {"mixed_precision": "bf16" if args.mixed_precision else None},
           "checkpoint": {"dir": os.path.join(args.workdir, "ckpt"), "every_n_steps": args.every},
           "data": {"seed": 7}, "health": {"hang_timeout": 120}}
    h = harden(model, loader, cfg)
    h.optimizer = torch.optim.AdamW(h.model.parameters(), lr=1e-2)
    rank = h.init_report.rank
    start = h.resume() or 0
    initial = full_state_digest(h.model) if start == 0 else None
    seen: list[str] = []
    hook = h.model.layers[0].attn.qkv.register_forward_hook(lambda m, i, o: seen.append(str(m.weight.dtype)))
    end = min(args.steps, args.stop_at or args.steps)
    losses, step = [], start
    while step < end:
        for x, y in h.loader:
            loss = F.cross_entropy(h.model(x).flatten(0, 1), y.flatten())
            loss.backward()
            decision = h.step_guard(loss, step)
            if decision:
                torch.nn.utils.clip_grad_norm_(h.model.parameters(), max_norm=1.0)
                h.optimizer.step()
            h.optimizer.zero_grad()
            step += 1
            losses.append(loss.item())
            h.save(step, force=step == args.stop_at)
            if step == end:
                break
    hook.remove()
    result = {
        "start": start, "end": step, "losses": losses, "initial": initial, "final": full_state_digest(h.model),
        "fsdp_modules": [n or "<root>" for n, m in h.model.named_modules() if isinstance(m, FSDPModule)],
        "forward_dtype": sorted(set(seen)), "world": h.init_report.world_size,
        "param_dtype": str(next(h.model.parameters()).dtype), "finite": all(math.isfinite(v) for v in losses),
    }
    h.close()
    if rank == 0:
        Path(args.workdir, f"result-{args.tag}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
