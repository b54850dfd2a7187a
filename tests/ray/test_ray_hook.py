"""robustdist.ray.hook.worker_setup: bf16 serializers in every Ray worker, torch's thread count untouched.

The bug fixed: Ray runs ``worker_process_setup_hook`` before it sets ``OMP_NUM_THREADS`` from the task's CPUs,
so the former hook (``robustdist.bf16.ray_worker_setup``, which imports torch) fixed torch's thread pool at the
machine's core count in a 1-CPU worker. The new hook imports no torch and installs the serializers right after
the worker's own code imports it. Everything here runs for real: a fresh interpreter, the session's Ray cluster
(whose job-level hook is the new one) and a second driver process that joins that cluster without a hook, then
with the old one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.processes, pytest.mark.ray, pytest.mark.timeout(360, method="thread")]

ROOT = Path(__file__).resolve().parents[2]
# A runtime_env of its own gives the probe a fresh worker in every job: no earlier task in the session has
# imported torch in it under another OMP_NUM_THREADS. Task-level fields merge with the job's hook.
PROBE_ENV = {"env_vars": {"ROBUSTDIST_TEST_RAY_HOOK_PROBE": "1"}}


def _probe() -> dict[str, Any]:
    """Runs in a 1-CPU Ray worker: the thread count torch got, and bitwise fingerprints of computations whose
    last bits depend on it (SGD steps of a small MLP, a large reduction), all on fixed data."""
    import hashlib

    import torch

    g = torch.Generator().manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    x, y = torch.randn(512, 64, generator=g), torch.randn(512, 8, generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(5):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    params = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    big = torch.randn(4_000_000, generator=g).sum()
    return {
        "pid": os.getpid(),
        "threads": torch.get_num_threads(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "loss": loss.detach().numpy().tobytes().hex(),
        "params": params,
        "sum": big.numpy().tobytes().hex(),
        "serializers": _robustdist_serializer_installed(),
        # A strided bf16 view: robustdist's representation sends its 8 elements and it arrives contiguous;
        # torch's own reduction sends the whole 16-element storage and keeps the stride.
        "view": torch.arange(16, dtype=torch.bfloat16)[::2],
    }


def _robustdist_serializer_installed() -> bool:
    import torch
    from ray import cloudpickle

    from robustdist.bf16 import _ray_serialize

    reducer = cloudpickle.CloudPickler.dispatch.get(torch.Tensor)
    return reducer is not None and any(c.cell_contents is _ray_serialize for c in (reducer.__closure__ or ()))


def _received(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` as JSON, the bf16 view replaced by how it arrived in this (driver) process."""
    view = result.pop("view")
    result["view_arrived"] = {"stride": list(view.stride()), "storage_bytes": view.untyped_storage().nbytes(),
                              "values": view.float().tolist()}
    return result


ROBUSTDIST_VIEW = {"stride": [1], "storage_bytes": 16, "values": [float(v) for v in range(0, 16, 2)]}

DRIVER = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import ray
from tests.ray.test_ray_hook import PROBE_ENV, _probe, _received

probe = ray.remote(num_cpus=1)(_probe).options(runtime_env=PROBE_ENV)
jobs = {"no_hook": None, "old_hook": {"worker_process_setup_hook": "robustdist.bf16.ray_worker_setup"},
        "moved_hook": {"worker_process_setup_hook": "robustdist.ray_setup.worker_setup"}}
out = {}
for label, runtime_env in jobs.items():
    ray.init(address=sys.argv[2], runtime_env=runtime_env, log_to_driver=False, configure_logging=False)
    try:
        out[label] = _received(ray.get(probe.remote(), timeout=120))
    finally:
        ray.shutdown()
print(json.dumps(out))
"""


FRESH = r"""
import json, sys
from robustdist.ray import hook as ray_setup
seen = []
ray_setup._after_import("torch", lambda m: seen.append(hasattr(m, "get_num_threads")))
ray_setup.worker_setup()
ray_setup.worker_setup()  # idempotent
before = {"torch": "torch" in sys.modules, "bf16": "robustdist.bf16" in sys.modules,
          "hooks": sum("robustdist post-import hook" in repr(f) for f in sys.meta_path)}
exec(sys.argv[1])  # the first import of torch, however it comes
import torch
from ray import cloudpickle
from robustdist.bf16 import _ray_serialize
reducer = cloudpickle.CloudPickler.dispatch.get(torch.Tensor)
after = {"seen": seen, "hooks": sum("robustdist post-import hook" in repr(f) for f in sys.meta_path),
         "installed": reducer is not None and any(c.cell_contents is _ray_serialize for c in reducer.__closure__ or ())}
print(json.dumps([before, after]))
"""


@pytest.mark.parametrize("first_import", [
    "import torch",  # the worker's own code
    "from robustdist.bf16 import _ray_deserialize",  # a worker unpickling a tensor robustdist serialized:
])  # robustdist.bf16 imports torch, and is itself only half-imported when torch's import completes
def test_worker_setup_imports_no_torch_and_installs_after_torch_is_imported(first_import):
    """In a fresh interpreter: the hook leaves torch unimported; after the first import of torch the serializers
    are installed and every finder the hook added is gone. A test callback registered with the same mechanism
    shows it runs once torch has executed completely."""
    out = subprocess.run([sys.executable, "-c", FRESH, first_import], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    before, after = json.loads(out.stdout.strip().splitlines()[-1])
    assert before == {"torch": False, "bf16": False, "hooks": 2}, "worker_setup() must import neither torch nor " \
        f"robustdist.bf16 and arm one hook each for torch and robustdist.bf16; found {before}"
    assert after == {"seen": [True], "hooks": 0, "installed": True}, f"after {first_import!r}: {after}; " \
        f"stderr:\n{out.stderr[-2000:]}"


MOVED = r"""
import json, sys, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import robustdist.ray_setup as old
    old.worker_setup()
armed = sum("robustdist post-import hook" in repr(f) for f in sys.meta_path)
from robustdist.ray import hook
print(json.dumps({"torch": "torch" in sys.modules, "ray": "ray" in sys.modules, "armed": armed,
                  "cancelled": hook.cancel_worker_setup(),
                  "warnings": [(w.category.__name__, str(w.message), w.filename) for w in caught]}))
"""


def test_the_old_hook_string_still_works_and_warns():
    """``robustdist.ray_setup.worker_setup`` (the string in users' runtime_env before the package layout) runs
    the same hook: no torch or ray imported, the post-import hooks armed; and warns, naming the new string."""
    out = subprocess.run([sys.executable, "-c", MOVED], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert (seen["torch"], seen["ray"], seen["armed"], seen["cancelled"]) == (False, False, 2, True), seen
    [(category, message, filename)] = seen["warnings"]
    assert category == "RobustDistDeprecationWarning" and filename == "<string>", seen["warnings"]
    assert "robustdist.ray.hook.worker_setup" in message and "robustdist.ray_setup.worker_setup moved" in message
    import robustdist

    assert issubclass(robustdist.RobustDistDeprecationWarning, (robustdist.RobustDistWarning, FutureWarning))


def test_the_old_hook_string_runs_the_hook_when_warnings_are_errors():
    """A worker that runs with ``-W error`` must not lose its hook over a deprecation: the hook runs first, and the
    warning is then logged instead of failing the worker's start."""
    code = ("import json, sys\nimport robustdist.ray_setup as old\nold.worker_setup()\n"
            "print(json.dumps(sum('robustdist post-import hook' in repr(f) for f in sys.meta_path)))")
    out = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == 2
    assert "robustdist.ray_setup.worker_setup moved to robustdist.ray.hook.worker_setup" in out.stderr


def test_hooked_worker_matches_a_worker_without_the_hook_bit_for_bit(ray_cluster):
    """The session cluster's job runs the new hook; a second driver runs the identical task without a hook, then
    with the old hook (the bug), then with the hook's pre-1.0 string (``robustdist.ray_setup.worker_setup``).
    New hook: the same thread count and the same bits as no hook, and the serializers are installed in the
    worker. Old hook: the serializers too (on Ray 2.60 torch also got a thread per core: the bug, not asserted)."""
    ray = ray_cluster
    gcs = ray.get_runtime_context().gcs_address
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(ROOT), gcs], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:  # the second driver starts while this job's probe runs: one CPU each
        hooked = _received(ray.get(ray.remote(num_cpus=1)(_probe).options(runtime_env=PROBE_ENV).remote(),
                                   timeout=120))
        stdout, stderr = driver.communicate(timeout=270)  # three jobs, each a ray.init and a probe
    except BaseException:
        driver.kill()
        driver.communicate()  # reaped: no child outlives the test
        raise
    assert driver.returncode == 0, f"the second driver failed (rc {driver.returncode}):\n{stderr[-4000:]}"
    others = json.loads(stdout.strip().splitlines()[-1])
    plain, old, moved = others["no_hook"], others["old_hook"], others["moved_hook"]
    assert hooked["serializers"] is True and hooked["view_arrived"] == ROBUSTDIST_VIEW, \
        f"the hooked worker must send bf16 through robustdist's serializers; it sent {hooked['view_arrived']}"
    assert plain["serializers"] is False and plain["view_arrived"] != ROBUSTDIST_VIEW, \
        f"without the hook the worker must use torch's own reduction; it sent {plain['view_arrived']}"
    # robustdist's promise is "the same as without the hook"; what Ray itself sets (OMP_NUM_THREADS from the
    # task's CPUs, and so torch's thread count) is Ray's business and differs between Ray versions.
    assert (hooked["threads"], hooked["omp"]) == (plain["threads"], plain["omp"]), \
        f"threads/OMP_NUM_THREADS: hooked {hooked['threads']}/{hooked['omp']}, " \
        f"no hook {plain['threads']}/{plain['omp']}"
    fingerprint = ("loss", "params", "sum")
    assert {k: hooked[k] for k in fingerprint} == {k: plain[k] for k in fingerprint}, \
        "the hook changed the bits of a computation"
    # The hook's string before the package layout (robustdist.ray_setup.worker_setup) still works, the same way.
    assert moved["serializers"] is True and moved["view_arrived"] == ROBUSTDIST_VIEW, \
        f"the old hook string must still install the serializers; the worker sent {moved['view_arrived']}"
    assert (moved["threads"], moved["omp"]) == (plain["threads"], plain["omp"]) and \
        {k: moved[k] for k in fingerprint} == {k: plain[k] for k in fingerprint}, \
        "the old hook string must run the new hook (threads and bits untouched)"

    # The bug the new hook fixes: the old hook imports torch before Ray sets OMP_NUM_THREADS, so on Ray 2.60 torch
    # sized its pool to every core although the task sees OMP_NUM_THREADS=1 (seen here, 2 cores: 2 threads, and
    # the 4M-element sum 1 ulp off the other two runs). Not asserted: when Ray sets the variable, and so whether
    # the old hook shows the bug, is Ray's incidental behaviour. The old hook still installs the serializers.
    assert old["serializers"] is True
