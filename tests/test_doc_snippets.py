"""The Python snippets of README.md and docs/porting.md, run as a user who copies them whole would run them.

Each snippet is read from the Markdown at test time (so the docs and the tests cannot drift): a fresh interpreter
runs, in a directory of its own, a prelude that defines what the snippet leaves to the user's script (a small
model, a dataset, the loss), the snippet's text unchanged, and a few lines that print what it did; the test checks
that. ``.cuda()`` is made a no-op where a snippet calls it (this machine has no GPU: the one thing mocked).
Every Python block of both files must be listed in :data:`SNIPPETS`, either run or with the reason it is a
fragment (and the test that runs the whole port it comes from): a new snippet fails here until it is run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 240


@dataclass(frozen=True)
class Run:
    """Run the snippet between ``prelude`` and ``after``; ``after`` prints ``RESULT <json>``."""

    prelude: str
    after: str


@dataclass(frozen=True)
class Fragment:
    """A piece of a larger script, not copied whole: ``why``, and the test that runs the whole port."""

    why: str


TOY = """
import json
import os
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
x = torch.randn(64, 4)
dataset = TensorDataset(x, x.sum(1, keepdim=True))
loss_fn = nn.MSELoss()
"""

LOOP = TOY + """
from robustdist import harden

loader = DataLoader(dataset, batch_size=8, shuffle=True)
model = nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
"""

LIGHTNING_MODULE = """
import lightning as L


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
"""

SNIPPETS: dict[tuple[str, int], Run | Fragment] = {
    ("README.md", 0): Fragment("the plain DDP script before the change (NCCL and CUDA), not robustdist's"),
    ("README.md", 1): Run(
        TOY + """
torch.nn.Module.cuda = lambda self, *a, **k: self  # no GPU here
torch.Tensor.cuda = lambda self, *a, **k: self
model = nn.Linear(4, 1)
epochs = 2
open("train.yaml", "w").write("checkpoint:\\n  dir: ckpt\\n")
""", """
print("RESULT", json.dumps({"batches": len(loader), "loss": float(loss)}))
"""),
    ("README.md", 2): Run(
        LOOP + """
total_steps = 1000  # the snippet's cfg saves every 500
""", """
from robustdist.checkpoint._layout import committed_steps
print("RESULT", json.dumps({"step": step, "committed": committed_steps("ckpt"), "closed": h.closed}))
"""),
    ("docs/porting.md", 0): Run(
        TOY + """
from robustdist import harden


def load_train_objs():
    inputs, labels = torch.randn(32, 6), torch.randint(0, 3, (32,))
    model = nn.Linear(6, 3)
    return TensorDataset(inputs, labels), model, torch.optim.SGD(model.parameters(), lr=0.1)
""", """
main(save_every=1, total_epochs=2, batch_size=8)
main(save_every=1, total_epochs=3, batch_size=8)  # resumed at epoch 2, one epoch more
from robustdist.checkpoint._layout import committed_steps
print("RESULT", json.dumps({"committed": committed_steps("snapshots")}))
"""),
    ("docs/porting.md", 1): Run(
        LOOP + """
total_steps = 6
""", """
from robustdist.checkpoint._layout import committed_steps
print("RESULT", json.dumps({"closed": h.closed, "committed": committed_steps("ckpt")}))
"""),
    ("docs/porting.md", 2): Run(
        TOY + """
import argparse

from robustdist import harden

vocab_size, batch_size, seq_len = 16, 2, 8
args = argparse.Namespace(mixed_precision=False)
model_args = None


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, h):
        return torch.relu(self.linear(h))

    def reset_parameters(self):
        self.linear.reset_parameters()


class Transformer(nn.Module):
    def __init__(self, model_args):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 8)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(8, vocab_size)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)

    def reset_parameters(self):
        self.embed.reset_parameters()
        self.out.reset_parameters()
""", """
from robustdist.checkpoint._layout import committed_steps
print("RESULT", json.dumps({"step": step, "committed": committed_steps("checkpoints")}))
"""),
    ("docs/porting.md", 3): Fragment("nanoGPT's training loop, inside the rest of its train.py; the whole port runs in "
                                     "tests/test_porting_nanogpt.py"),
    ("docs/porting.md", 4): Fragment("the changed lines of Accelerate's nlp_example.py (a '...' stands for the rest); "
                                     "the whole port runs in tests/test_porting_accelerate.py"),
    ("docs/porting.md", 5): Run(
        TOY + LIGHTNING_MODULE + """
from lightning.pytorch.callbacks import ModelCheckpoint

os.environ["PL_TRAINER_MAX_EPOCHS"] = "2"  # the script's own Trainer argument, given the way Lightning reads it
model = Regressor()
loader = DataLoader(dataset, batch_size=8)
ckpt_dir = "ckpt"
""", """
print("RESULT", json.dumps({"step": trainer.global_step, "files": sorted(os.listdir("ckpt"))}))
"""),
    ("docs/porting.md", 6): Run(
        TOY + """
import argparse

import robustdist
from lightning.fabric import Fabric
from torch.optim.lr_scheduler import StepLR

args = argparse.Namespace(accelerator="cpu", devices=1, seed=1, lr=1.0, gamma=0.7, epochs=2)
bs, seed = 8, 1
images = torch.randn(32, 1, 6, 6)
train_set = TensorDataset(images, torch.randint(0, 3, (32,)))
test_set = TensorDataset(images[:16], torch.randint(0, 3, (16,)))
cfg = {"checkpoint": {"dir": "ckpt", "every_n_steps": 1}}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(36, 3)

    def forward(self, x):
        return F.log_softmax(self.fc(x.flatten(1)), dim=1)
""", """
from robustdist.checkpoint._layout import committed_steps
h.close()
print("RESULT", json.dumps({"step": step, "committed": committed_steps("ckpt")}))
"""),
}


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def test_every_python_snippet_is_run_or_named_a_fragment():
    found = {(name, i) for name in ("README.md", "docs/porting.md") for i in range(len(_python_blocks(ROOT / name)))}
    assert found == set(SNIPPETS), f"snippets without a test: {sorted(found - set(SNIPPETS))}; " \
                                   f"listed but gone: {sorted(set(SNIPPETS) - found)}"


def _run(key: tuple[str, int], tmp_path: Path) -> dict:
    case = SNIPPETS[key]
    assert isinstance(case, Run)
    code = textwrap.dedent(case.prelude) + "\n" + _python_blocks(ROOT / key[0])[key[1]] + "\n" + case.after
    script = tmp_path / "snippet.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                            "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=TIMEOUT)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, f"{key} failed (exit {out.returncode}):\n{out.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


RUN = sorted(k for k, v in SNIPPETS.items() if isinstance(v, Run))


@pytest.mark.processes
@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize("key", RUN, ids=[f"{name}#{i}" for name, i in RUN])
def test_the_snippet_runs_as_written(key, tmp_path):
    result = _run(key, tmp_path)
    if key == ("README.md", 1):
        assert result["batches"] == 2 and result["loss"] == result["loss"]  # 64 samples in 32s, a finite loss
    elif key == ("README.md", 2):
        assert result == {"step": 1000, "committed": [500, 1000], "closed": True}
    elif key == ("docs/porting.md", 0):
        assert result["committed"] == [1, 2, 3]  # one save per epoch, and the second call resumed at epoch 2
    elif key == ("docs/porting.md", 1):
        assert result == {"closed": True, "committed": []}  # 6 steps, a durable save every 100: none
    elif key == ("docs/porting.md", 2):
        assert result == {"step": 10, "committed": [10]}
    elif key == ("docs/porting.md", 5):  # 2 epochs of 8 batches, a checkpoint at each epoch end, each recorded
        assert result["step"] == 16
        assert [name for name in result["files"] if name.endswith(".ckpt")] == \
            ["epoch=0-step=8.ckpt", "epoch=1-step=16.ckpt", "last.ckpt"]
        assert all(f"{name}.robustdist.json" in result["files"] for name in result["files"] if name.endswith(".ckpt"))
    elif key == ("docs/porting.md", 6):
        assert result == {"step": 8, "committed": [6, 7, 8]}  # 2 epochs of 4 batches, a save at each step
    else:
        raise AssertionError(f"no check for {key}")
