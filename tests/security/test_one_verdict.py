"""One verdict: ``verify-checkpoint`` calls a step corrupt exactly where ``load()`` falls back past it.

Every hostile fixture below damages step 2 of a directory holding valid steps 1 and 2, as an attacker who can
write the directory would (re-checksumming the manifest). Each is fed to both ``load()`` and ``verify_all`` /
``robustdist verify-checkpoint``; they must agree, and the verifier must name the same file and problem.
An undamaged directory is the control: both keep step 2.

The command line runs as its own ``python -m robustdist`` process for the control and for a file that would run
code (``CLI_PROCESS_CASES``); for the other cases its ``main()`` runs in the test's process, where a traceback
would be an exception that fails the test, and its return value is the status ``python -m robustdist`` exits with.
"""

from __future__ import annotations

import io
import subprocess
import sys
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from robustdist.checkpoint import AtomicCheckpointer, verify_all
from robustdist.cli import main as cli_main
from tests.security._forge import (
    STEP2,
    adam_two_steps,
    evil_pickle,
    evil_torch_file,
    forge,
    one_rank_group,
    sharded_pair,
    sharded_two_steps,
    two_steps,
)
from tests.security.test_checkpoint_code import _poison_a_bytes_item
from tests.security.test_checkpoint_malformed import PAYLOAD_CASES

pytestmark = pytest.mark.timeout(300)


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _edit(target: str, change: Callable[[Any], Any]) -> Callable[[Path, Path], None]:
    def damage(step2: Path, _: Path) -> None:
        payload = torch.load(step2 / target, weights_only=True)
        change(payload)  # in place
        forge(step2, target, _torch_bytes(payload))
    return damage


def _compressed(step2: Path, _: Path) -> None:
    real = zipfile.ZipFile(io.BytesIO((step2 / "replicated.pt").read_bytes()))
    bomb = io.BytesIO()
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as out:
        for info in real.infolist():
            out.writestr(info.filename, real.read(info.filename))
    forge(step2, "replicated.pt", bomb.getvalue())


def _shared_tree(payload: Any) -> None:
    node: list = []
    for _ in range(40):
        node = [node, node]
    payload["meta"] = {"tree": node}


def _truncated(step2: Path, _: Path) -> None:
    data = (step2 / "replicated.pt").read_bytes()
    (step2 / "replicated.pt").write_bytes(data[:-7])


def _symlinked(step2: Path, tmp: Path) -> None:
    outside = tmp / "outside.pt"
    outside.write_bytes((step2 / "replicated.pt").read_bytes())
    (step2 / "replicated.pt").unlink()
    (step2 / "replicated.pt").symlink_to(outside)


PLAIN: dict[str, Callable[[Path, Path], None]] = {
    "undamaged": lambda step2, tmp: None,
    **{f"payload-{i}": (lambda t, d: lambda step2, tmp: forge(step2, t, d))(target, data)
       for i, (target, data, _) in enumerate(PAYLOAD_CASES)},
    "code-replicated": lambda step2, tmp: forge(step2, "replicated.pt", evil_torch_file(tmp / "marker")),
    "code-rank": lambda step2, tmp: forge(step2, "rank_00000.pt", evil_torch_file(tmp / "marker")),
    "compressed": _compressed,
    "rng-python": _edit("rank_00000.pt", lambda p: p["rng"]["python"].__setitem__(0, 1)),
    "rng-torch": _edit("rank_00000.pt", lambda p: p["rng"]["torch"].fill_(255)),
    "shared-tree": _edit("replicated.pt", _shared_tree),
    "truncated": _truncated,
    "symlink": _symlinked,
}


def _load_step(directory: Path, state: dict[str, Any]) -> int | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with AtomicCheckpointer(directory) as ckpt:
            loaded = ckpt.load(state=state)
    return None if loaded is None else loaded.step


def _verdicts(directory: Path, state: dict[str, Any]) -> tuple[bool, bool, str]:
    """(load fell back past step 2, verify called step 2 corrupt, verify's reason)."""
    rows = {r["step"]: r for r in verify_all(str(directory))}
    fell_back = _load_step(directory, state) != 2
    return fell_back, rows[2]["status"] == "corrupt", rows[2]["reason"]


CLI_PROCESS_CASES = ("undamaged", "code-replicated", "code-rank")


@pytest.mark.processes
@pytest.mark.parametrize("case", list(PLAIN))
def test_plain_checkpoints_get_one_verdict(tmp_path, case, capsys):
    directory = tmp_path / "ckpt"
    PLAIN[case](two_steps(directory), tmp_path)
    fell_back, corrupt, reason = _verdicts(directory, {"weights": torch.zeros(16)})
    assert fell_back == corrupt == (case != "undamaged"), reason
    assert not (tmp_path / "marker").exists()
    if case.startswith("payload-"):
        target, _, expected = PAYLOAD_CASES[int(case.split("-")[1])]
        assert f"{target}: " in reason and expected in reason
    if case in CLI_PROCESS_CASES:
        cli = subprocess.run([sys.executable, "-m", "robustdist", "verify-checkpoint", str(directory)],
                             capture_output=True, text=True, timeout=120)
        code, stdout, stderr = cli.returncode, cli.stdout, cli.stderr
    else:
        capsys.readouterr()
        code = cli_main(["verify-checkpoint", str(directory)])
        stdout, stderr = capsys.readouterr()
    assert code == (1 if corrupt else 0), stdout + stderr
    assert "Traceback" not in stderr
    assert not (tmp_path / "marker").exists()


def test_an_expanded_optimizer_state_gets_one_verdict(tmp_path):
    adam_two_steps(tmp_path)
    _edit("replicated.pt", lambda p: p["optimizer"]["state"][0].__setitem__(
        "exp_avg", torch.zeros(1, dtype=torch.float64).expand(2**29)))(tmp_path / STEP2, tmp_path)
    fresh = torch.nn.Linear(4, 2)
    fell_back, corrupt, reason = _verdicts(tmp_path, {"model": fresh, "optimizer": torch.optim.Adam(fresh.parameters())})
    assert fell_back and corrupt and "expanded tensor view" in reason


@pytest.mark.parametrize("case", ["undamaged", "metadata-code", "bytes-item-code"])
def test_sharded_checkpoints_get_one_verdict(tmp_path, case):
    marker = tmp_path / "marker"
    with one_rank_group():
        step2 = sharded_two_steps(tmp_path / "ckpt")
        if case == "metadata-code":
            forge(step2, "sharded/.metadata", evil_pickle(marker))
        elif case == "bytes-item-code":
            _poison_a_bytes_item(step2, marker)
        model, opt = sharded_pair(7)
        fell_back, corrupt, reason = _verdicts(tmp_path / "ckpt", {"model": model, "optimizer": opt})
    assert fell_back == corrupt == (case != "undamaged"), reason
    assert not marker.exists()
    if case == "bytes-item-code":
        assert "holds objects robustdist never writes" in reason


class _Holder:
    """A user's object with a state dict, restored through its own load_state_dict (nothing else checks it)."""

    def __init__(self) -> None:
        self.buf = torch.zeros(8)

    def state_dict(self) -> dict:
        return {"buf": self.buf}

    def load_state_dict(self, state: dict) -> None:
        self.buf = state["buf"]


@pytest.mark.parametrize("case", ["module-meta", "module-sparse", "object-expanded"])
def test_object_and_module_state_get_one_verdict(tmp_path, case):
    model, holder = torch.nn.Linear(4, 2), _Holder()
    with AtomicCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": model, "holder": holder})
        ckpt.save(2, {"model": model, "holder": holder})

    def damage(p: Any) -> None:
        if case == "module-meta":
            p["model"]["weight"] = torch.empty(2, 4, device="meta")
        elif case == "module-sparse":
            p["model"]["weight"] = torch.zeros(2, 4).to_sparse()
        else:
            p["holder"]["buf"] = torch.zeros(1).expand(1 << 30)
    _edit("replicated.pt", damage)(tmp_path / STEP2, tmp_path)
    live = _Holder()
    fell_back, corrupt, reason = _verdicts(tmp_path, {"model": torch.nn.Linear(4, 2), "holder": live})
    assert fell_back and corrupt, reason
    assert live.buf.numel() == 8  # the step-1 state, never the 2**30-element view
