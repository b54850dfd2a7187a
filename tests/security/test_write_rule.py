"""One rule for every file robustdist writes or deletes in a directory it does not trust
(:mod:`robustdist.checkpoint._confined`), held by a ratchet: every call in the package that opens, creates,
links, renames or deletes a path is counted per module, and the counts must equal the table below.

* ``_confined`` is the helper itself; ``_safeio`` is its read half.
* LEGIT: paths that are not a checkpoint directory (a config file, ``/proc``, the test harness, a stack-dump
  file the user names, a Ray temp directory).

Every checkpoint-directory writer is on the helper: a new raw call anywhere
fails this test. DCP's own ``FileSystemWriter`` writes the sharded files by path, inside a directory
``checkpoint._sharded`` made confined; it is torch's code, not counted here.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "robustdist"
CALLS = {"open", "unlink", "remove", "rmtree", "replace", "rename", "renames", "link", "symlink", "copy", "copy2",
         "copyfile", "copytree", "move", "makedirs", "mkdir", "rmdir", "truncate", "mkdtemp", "mkstemp"}
MODULES = {"os", "shutil", "tempfile"}

HELPERS = {"checkpoint/_confined.py", "checkpoint/_safeio.py"}
LEGIT = {
    "config/io.py": 1,  # the config file (read: non-blocking, a regular file, bounded)
    "checkpoint/local/memory.py": 1,  # /proc/meminfo
    "ray/memory.py": 1,  # cgroup memory files (read)
    "init/reach.py": 1,  # /proc/sys/kernel/random/boot_id
    "runtime/exit_drain.py": 2,  # /proc/self/task/<tid>/comm and stat (read)
    "recovery/stuck.py": 2,  # /proc/self/task/<tid>/stat and wchan (read)
    "health/watchdog.py": 3,  # the stack-dump file in health.dump_dir, which the user names
    "ray/actor.py": 3,  # sysfs (NUMA node, CPU list), /proc/self/statm
    "launcher/launch.py": 2,  # robustdist run's own temporary log directory (made, and removed when left empty)
    "launcher/forked.py": 1,  # /proc/<pid>/stat (read: a forked worker's exit code while its parent has not reaped it)
    "launcher/idle.py": 2,  # /proc/self/autogroup (read, and written: the spare's own session, lowered and put back)
    "launcher/spare.py": 3,  # /dev/null, the worker's output file torchrun chose (appended), /proc/self/maps (read)
    "runtime/_elastic_compat.py": 2,  # a replaced worker's output files torchrun chose (appended)
    "runtime/group_sockets.py": 1,  # /dev/null, put in place of a DataLoader worker's inherited listeners
    "testing/nodelab.py": 8,  # the test harness
    "testing/ranks.py": 4,
    "testing/ports.py": 4,  # /proc/sys/net/ipv4/ip_local_port_range, the port registry (its directory, twice; its file)
}


def _is_path_call(node: ast.Call) -> bool:
    func = node.func
    if isinstance(func, ast.Name):
        return func.id == "open"
    if isinstance(func, ast.Attribute) and func.attr in CALLS:
        return isinstance(func.value, ast.Name) and func.value.id in MODULES
    return False


def _counts() -> Counter[str]:
    found: Counter[str] = Counter()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call) and _is_path_call(node):
                found[rel] += 1
    return found


def test_every_raw_file_call_is_in_the_table():
    found = {m: n for m, n in _counts().items() if m not in HELPERS}
    expected = dict(LEGIT)
    new = {m: n for m, n in found.items() if m not in expected}
    assert not new, (f"raw open/unlink/rename/... calls outside robustdist.checkpoint._confined: {new}. Expected "
                     "every file robustdist writes or deletes in a checkpoint directory to go through Confined. Fix: "
                     "use Confined (or, for a path that is not a checkpoint directory, add it to LEGIT with why).")
    changed = {m: (expected[m], found.get(m, 0)) for m in expected if found.get(m, 0) != expected[m]}
    assert not changed, (f"(table, now) counts changed: {changed}. Fix: a module that gained a raw call must use "
                         "Confined instead; one that lost its legitimate calls leaves LEGIT.")
