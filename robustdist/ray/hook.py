"""The Ray worker setup hook that installs robustdist's bf16 serializers without importing torch.

Use it as ``ray.init(runtime_env={"worker_process_setup_hook": "robustdist.ray.hook.worker_setup"})``.

Why not :func:`robustdist.bf16.ray_worker_setup`: Ray runs the setup hook while the worker process starts,
*before* it sets ``OMP_NUM_THREADS``. Ray sets that variable lazily, from the CPUs assigned to the task, when
the first task executes (Ray's private ``set_omp_num_threads_if_unset``, called from its raylet). A hook
that imports torch (``robustdist.bf16`` does) sizes torch's OpenMP pool to every core of the machine, so a
``num_cpus=1`` worker runs torch with all cores' threads: it oversubscribes the CPU and its results differ
in the last bit from the same job without the hook. A hardening library must change neither numerics nor
thread counts.

:func:`worker_setup` imports neither torch nor ray. If torch is already imported it installs the serializers
at once (:func:`robustdist.bf16.install_ray_serializers`); otherwise it arranges for them to be installed
right after the worker's own code first imports torch (which Ray does after setting ``OMP_NUM_THREADS``).
Deferring is correct: only the *sending* side needs the registration (the deserializer travels pickled by
reference), and a process can only send tensors once it has imported torch.

The deferral is a one-shot post-import hook (:func:`_after_import`): a ``sys.meta_path`` finder for one
module name that lets the other finders find the module, wraps that spec's ``exec_module`` so the callbacks
run once the module has executed, and removes itself. A callback that fails is logged; it never breaks the
user's import. Nothing happens at import of this module; :func:`cancel_worker_setup` removes a pending hook.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from robustdist.runtime.log import get_logger

__all__ = ["cancel_worker_setup", "worker_setup"]

_logger = get_logger(__name__)

_BF16 = "robustdist.bf16"
_lock = threading.RLock()
_pending: dict[str, _PostImportFinder] = {}  # module name -> its armed finder (in sys.meta_path)
_local = threading.local()  # .finding: the names this thread's finders are resolving right now


def _initializing(module: ModuleType) -> bool:
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _run_callbacks(name: str, module: ModuleType, callbacks: Sequence[Callable[[ModuleType], Any]]) -> None:
    # Nothing in this module logs before torch is imported: robustdist.runtime.log's rank prefix asks
    # robustdist.runtime.dist, which imports torch. Here the failure log may import it (for a name other than
    # torch), after the fact.
    for callback in callbacks:
        try:
            callback(module)
        except Exception:  # the user's `import` must succeed whatever a hook does
            _logger.exception(f"the post-import hook {callback!r} for {name!r} failed; {name} itself imported "
                              "fine. Fix the hook, or call it yourself after the import")


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: asks the other finders for ``name`` and hooks the loader of what they find."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.callbacks: list[Callable[[ModuleType], Any]] = []

    def __repr__(self) -> str:
        return f"<robustdist post-import hook for {self.name!r}>"

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        finding: set[str] = _local.__dict__.setdefault("finding", set())
        if fullname in finding:  # another finder's find_spec imported this very name: let the others answer
            return None
        finding.add(fullname)
        try:
            spec = self._find_with_others(fullname, path, target)
        finally:
            finding.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None  # not found (the import fails as it would anyway), a namespace package, or a legacy loader
        self._hook(spec)
        # The import system stops iterating sys.meta_path as soon as a finder returns a spec, so removing this
        # finder now cannot make it skip another finder.
        _disarm(self)
        return spec

    def _find_with_others(self, fullname: str, path: Sequence[str] | None,
                          target: ModuleType | None) -> importlib.machinery.ModuleSpec | None:
        for finder in list(sys.meta_path):  # a copy: a finder may edit sys.meta_path while we iterate
            if isinstance(finder, _PostImportFinder):
                continue
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None

    def _hook(self, spec: importlib.machinery.ModuleSpec) -> None:
        loader = spec.loader
        original = loader.exec_module  # bound; a loader may be shared by several modules (zipimporter)
        name, callbacks = self.name, list(self.callbacks)

        def exec_module(module: ModuleType) -> None:
            if module.__name__ != name:
                original(module)
                return
            if getattr(loader, "__dict__", {}).get("exec_module") is exec_module:
                del loader.exec_module  # one shot: the loader is itself again before anything else runs
            try:
                original(module)
            except BaseException:
                for callback in callbacks:  # the import failed: wait for the next attempt
                    _arm(name, callback)
                raise
            _run_callbacks(name, sys.modules.get(name, module), callbacks)

        try:
            loader.exec_module = exec_module  # on this instance only: its type and every other attribute unchanged
        except (AttributeError, TypeError):  # a loader without an instance __dict__ (slots): wrap it instead
            spec.loader = _Delegating(loader, exec_module)


class _Delegating:
    """A loader that is ``loader`` in everything but ``exec_module``."""

    def __init__(self, loader: Any, exec_module: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self.exec_module = exec_module

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._loader, attr)


def _disarm(finder: _PostImportFinder) -> None:
    with _lock:
        if _pending.get(finder.name) is finder:
            del _pending[finder.name]
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)


def _arm(name: str, callback: Callable[[ModuleType], Any]) -> None:
    with _lock:
        finder = _pending.get(name)
        if finder is None:
            finder = _pending[name] = _PostImportFinder(name)
            sys.meta_path.insert(0, finder)
        if callback not in finder.callbacks:
            finder.callbacks.append(callback)


def _after_import(name: str, callback: Callable[[ModuleType], Any]) -> None:
    """Call ``callback(module)`` once module ``name`` has been imported: now if it already is, else right after
    the first import of it has executed. Idempotent: the same callback for the same name is called once."""
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            _arm(name, callback)
            return
    _run_callbacks(name, module, [callback])


def _cancel(name: str) -> bool:
    """Remove the pending post-import hook for ``name``; returns whether one was pending."""
    with _lock:
        finder = _pending.get(name)
        if finder is None:
            return False
        _disarm(finder)
        return True


def _install_serializers(module: ModuleType) -> None:
    """Post-import callback for torch and for robustdist.bf16: install once both are complete."""
    if module.__name__ != _BF16:
        bf16 = sys.modules.get(_BF16)
        if bf16 is not None and _initializing(bf16):
            return  # robustdist.bf16 itself is importing torch: its own hook installs once it is complete
    cancel_worker_setup()
    if module.__name__ == _BF16:
        bf16 = module  # still marked initializing while its hook runs, but it has executed: complete
    else:
        import robustdist.bf16 as bf16
    bf16.install_ray_serializers()
    _logger.debug("installed robustdist's bf16 Ray serializers after torch was imported")


def worker_setup() -> None:
    """For ``ray.init(runtime_env={"worker_process_setup_hook": "robustdist.ray.hook.worker_setup"})``.

    Installs robustdist's bf16/float8 Ray serializers in this worker without importing torch: at once if
    torch is already imported, else right after the worker's code first imports it. Idempotent.
    """
    if "torch" in sys.modules:
        import robustdist.bf16 as bf16

        bf16.install_ray_serializers()
        return
    # Hook robustdist.bf16 too: when it is what imports torch (a worker unpickling a tensor), the serializers
    # can only be installed once it has executed completely, not in the middle of its `import torch`.
    _after_import(_BF16, _install_serializers)
    _after_import("torch", _install_serializers)


def cancel_worker_setup() -> bool:
    """Undo a pending :func:`worker_setup` (nothing installed yet); returns whether one was pending."""
    cancelled_torch = _cancel("torch")
    cancelled_bf16 = _cancel(_BF16)
    return cancelled_torch or cancelled_bf16
