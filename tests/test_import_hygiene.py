"""Importing robustdist (every module, every public name) changes no global state.

Checked in a fresh interpreter: torch and numpy are imported first (their own import effects are theirs),
a snapshot is taken, then all of robustdist is imported and the snapshot is compared.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.processes

SCRIPT = r"""
import atexit, copyreg, faulthandler, json, logging, multiprocessing, os, signal, sys, threading, warnings
import numpy, torch, torch.multiprocessing, torch.serialization

def snapshot():
    return {
        "environ": dict(os.environ),
        "copyreg": sorted(repr(k) for k in copyreg.dispatch_table),
        "copyreg_values": sorted(repr(v) for v in copyreg.dispatch_table.values()),
        "signals": {s.name: repr(signal.getsignal(s)) for s in signal.valid_signals()
                    if isinstance(s, signal.Signals) and s not in (signal.SIGKILL, signal.SIGSTOP)},
        "start_method": multiprocessing.get_start_method(allow_none=True),
        "sharing_strategy": torch.multiprocessing.get_sharing_strategy(),
        "excepthook": repr(sys.excepthook), "threading_excepthook": repr(threading.excepthook),
        "faulthandler": faulthandler.is_enabled(),
        "threads": threading.active_count(),
        "atexit": atexit._ncallbacks(),
        "root_handlers": repr(logging.getLogger().handlers),
        "robustdist_handlers": repr(logging.getLogger("robustdist").handlers),
        "warning_filters": len(warnings.filters),
        "default_dtype": str(torch.get_default_dtype()),
        "safe_globals": sorted(repr(g) for g in torch.serialization.get_safe_globals()),
        "meta_path": repr(sys.meta_path),
        "recursion": sys.getrecursionlimit(),
        "torch_threads": torch.get_num_threads(),
        "ray_imported": "ray" in sys.modules,
        "yaml_imported": "yaml" in sys.modules,
    }

before = snapshot()
import robustdist
light = {"torch_free": True}
import importlib, pkgutil
imported = 0
for mod in pkgutil.walk_packages(robustdist.__path__, "robustdist."):  # every module of every package
    if mod.name != "robustdist.__main__":
        package = importlib.import_module(mod.name)
        imported += 1
        for name in getattr(package, "__all__", ()) if mod.ispkg else ():
            getattr(package, name)  # a package's lazy exports
assert imported > 80, f"walked only {imported} modules"
for name in robustdist.__all__:
    getattr(robustdist, name)
after = snapshot()
print(json.dumps({k: [before[k], after[k]] for k in before if before[k] != after[k]}))
"""

LIGHT = "import sys, robustdist; print(json.dumps(sorted(m for m in ('torch', 'ray', 'numpy', 'yaml') if m in sys.modules)))"


def test_importing_everything_changes_no_global_state():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}


PACKAGES = ["runtime", "config", "init", "parallel", "data", "health", "ray", "frameworks", "testing"]


def test_importing_a_package_imports_none_of_its_modules():
    """Each package's ``__init__`` exports lazily: importing it (what importing any of its modules does first)
    imports neither torch nor ray nor the package's own modules; the checkpoint package is eager, as before."""
    code = ("import json, sys\n" + "".join(f"import robustdist.{p}\n" for p in PACKAGES) +
            "print(json.dumps(sorted(m for m in sys.modules if m in ('torch', 'ray', 'numpy') or "
            "(m.startswith('robustdist.') and m.count('.') > 1))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == ["robustdist.runtime.lazy"]


def test_import_robustdist_is_light():
    out = subprocess.run([sys.executable, "-c", "import json; " + LIGHT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []
