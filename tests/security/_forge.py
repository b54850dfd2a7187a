"""What an attacker who can write a checkpoint directory does, as helpers: forge a file and recompute the
manifest's checksum for it (the CRC is no defence against a writer), craft pickles that would run code, and
watch what the process opens.

Every crafted payload, when the unsafe route it targets is taken, creates a *marker* file; the tests assert
the marker is absent after robustdist handled the payload, and, where it is cheap, that the same payload
does create the marker through the unsafe route (so the test could fail).
"""

from __future__ import annotations

import builtins
import io
import json
import os
import pickle
import pickletools
import struct
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from robustdist.checkpoint import AtomicCheckpointer

STEP1, STEP2 = "step_0000000001", "step_0000000002"


def state_for(step: int) -> dict[str, Any]:
    return {"weights": torch.full((16,), float(step)), "meta": {"step": step}}


def two_steps(directory: Path) -> Path:
    """A checkpoint directory with valid steps 1 and 2; returns step 2's directory (the one to attack)."""
    with AtomicCheckpointer(directory) as ckpt:
        ckpt.save(1, state_for(1))
        ckpt.save(2, state_for(2))
    return directory / STEP2


def adam_two_steps(directory: Path) -> Path:
    """Steps 1 and 2 holding a Linear model and its Adam optimizer after one step; returns step 2's directory."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    with AtomicCheckpointer(directory) as ckpt:
        ckpt.save(1, {"model": model, "optimizer": opt})
        ckpt.save(2, {"model": model, "optimizer": opt})
    return directory / STEP2


def manifest_of(step_dir: Path) -> dict[str, Any]:
    return json.loads((step_dir / "manifest.json").read_text())


def write_manifest(step_dir: Path, manifest: Any) -> None:
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def crc_entry(data: bytes) -> dict[str, Any]:
    return {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}


def forge(step_dir: Path, name: str, data: bytes) -> None:
    """Replace ``name`` with ``data`` and recompute its manifest entry, as an attacker would."""
    (step_dir / name).write_bytes(data)
    manifest = manifest_of(step_dir)
    manifest["files"][name] = crc_entry(data)
    write_manifest(step_dir, manifest)


class _Touch:
    """Unpickling this opens ``path`` for writing: a stand-in for any code an attacker runs."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self) -> Any:
        return (builtins.open, (self.path, "w"))


def evil_torch_file(marker: Path, wrap: Callable[[Any], Any] = lambda x: {"weights": x}) -> bytes:
    buf = io.BytesIO()
    torch.save(wrap(_Touch(marker)), buf)
    return buf.getvalue()


def evil_pickle(marker: Path) -> bytes:
    return pickle.dumps(_Touch(marker), protocol=4)


def dotted_name_pickle(marker: Path) -> bytes:
    """A protocol-4 pickle that builds and calls a function using only names *inside* DCP's metadata module:
    ``Metadata.__init__.__code__.__class__`` (CodeType) and ``Metadata.__init__.__class__`` (FunctionType).
    An allow-list that accepts any dotted name whose result is a type runs it. (CPython 3.10 to 3.13.)"""
    def payload() -> None:
        open(MARKER, "w").close()  # noqa: F821 - MARKER comes from the globals the pickle builds

    c = payload.__code__
    if sys.version_info >= (3, 11):  # CodeType's positional signature
        args = (c.co_argcount, c.co_posonlyargcount, c.co_kwonlyargcount, c.co_nlocals, c.co_stacksize, c.co_flags,
                c.co_code, c.co_consts, c.co_names, c.co_varnames, c.co_filename, c.co_name, c.co_qualname,
                c.co_firstlineno, c.co_linetable, c.co_exceptiontable, c.co_freevars, c.co_cellvars)
    else:
        args = (c.co_argcount, c.co_posonlyargcount, c.co_kwonlyargcount, c.co_nlocals, c.co_stacksize, c.co_flags,
                c.co_code, c.co_consts, c.co_names, c.co_varnames, c.co_filename, c.co_name, c.co_firstlineno,
                c.co_linetable, c.co_freevars, c.co_cellvars)
    module = "torch.distributed.checkpoint.metadata"

    def body(obj: Any) -> bytes:  # an object's opcodes without PROTO and STOP (protocol 3: no frames), and
        # only the memo entries it reads (numbered from 0: only the first body may keep any, as pickle writes each
        # index once)
        return pickletools.optimize(pickle.dumps(obj, protocol=3))[2:-1]

    def glob(name: str) -> bytes:
        return b"".join(b"\x8c" + struct.pack("<B", len(s)) + s for s in (module.encode(), name.encode())) + b"\x93"

    return (b"\x80\x04" + glob("Metadata.__init__.__class__") + glob("Metadata.__init__.__code__.__class__")
            + body(args) + b"R" + body({"MARKER": str(marker)}) + b"\x86" + b"R" + b")" + b"R" + b".")


# ------------------------------------------------------------------ watching
_watching: list[list[str]] = []
_hook_installed = False


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _watching and args and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0])
        for opened in _watching:
            opened.append(path)


@contextmanager
def opened_paths() -> Iterator[list[str]]:
    """Every path this process opens inside the block (``open``/``os.open`` audit events)."""
    global _hook_installed
    if not _hook_installed:
        sys.addaudithook(_audit)  # audit hooks cannot be removed: this one does nothing outside the block
        _hook_installed = True
    opened: list[str] = []
    _watching.append(opened)
    try:
        yield opened
    finally:
        _watching.remove(opened)


def outside(paths: list[str], root: Path) -> list[str]:
    """Absolute paths not lexically inside ``root``, or ``root`` itself (relative ones are dir_fd opens inside a
    confined walk).
    Interpreter files (imports) are ignored."""
    root_s = os.path.abspath(root) + os.sep
    prefixes = tuple(os.path.abspath(p) + os.sep for p in {sys.prefix, sys.base_prefix, sys.exec_prefix})
    return [p for p in paths if os.path.isabs(p) and not (os.path.abspath(p) + os.sep).startswith(root_s)
            and not p.startswith(prefixes) and not p.endswith((".py", ".pyc", ".so"))]


def bounded(fn: Callable[[], Any], seconds: float, unblock: list[Path] = ()) -> tuple[Any, BaseException | None, float]:
    """Run ``fn`` in a thread for at most ``seconds``: ``(result, exception, elapsed)``. If it is still running,
    open each FIFO in ``unblock`` for writing (so a blocked reader returns) and fail."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    start = time.monotonic()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    elapsed = time.monotonic() - start
    if thread.is_alive():
        for fifo in unblock:
            with open(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK), "wb"):
                pass
        thread.join(5)
        raise AssertionError(f"the call did not return within {seconds} s (it hung)")
    return box.get("result"), box.get("error"), elapsed


# ------------------------------------------------------------------ sharded (FSDP2 / DCP) checkpoints
def small_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


@contextmanager
def one_rank_group() -> Iterator[None]:
    """A real 1-rank gloo group in this process (FSDP2 and DCP need one)."""
    import torch.distributed as dist

    from robustdist.testing.ranks import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded_pair(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = small_model(seed)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (seed + 1))
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def sharded_two_steps(directory: Path) -> Path:
    """Steps 1 and 2 holding a sharded model and optimizer (inside :func:`one_rank_group`); returns step 2."""
    with AtomicCheckpointer(directory) as ckpt:
        for step in (1, 2):
            model, opt = sharded_pair(step)
            ckpt.save(step, {"model": model, "optimizer": opt})
    return directory / STEP2


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in model.state_dict().items()}
