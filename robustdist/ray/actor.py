"""``RobustGPUActor``: a Ray actor base class that lands on the GPU Ray gave it, not on GPU 0.

Ray narrows ``CUDA_VISIBLE_DEVICES`` per actor, so the GPU id Ray assigned is not an ordinal for torch: it
must be mapped to its *position* in this process's ``CUDA_VISIBLE_DEVICES`` (Ray #40803 and SkyRL #1577 are
"every worker on GPU 0" bugs). In ``__init__`` the actor:

1. resolves its device(s): Ray's assigned GPU ids -> positions in ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs,
   narrowed or shared) -> ``torch.cuda.set_device``, then checks ``torch.cuda.current_device()`` agrees
   (:class:`~robustdist.runtime.errors.TopologyError` otherwise). ``self.device`` is the first, ``self.devices`` all;
   on a CPU-only cluster (``num_gpus=0``) ``self.device`` is ``cpu``;
2. optionally pins its CPUs to the GPU's NUMA node (``pin_numa=True``: sysfs ``numa_node`` and
   ``local_cpulist``, intersected with the CPUs allowed now; a logged no-op without a GPU or NUMA info);
3. installs robustdist's bf16 Ray serializers in its own process.

It never calls ``torch.set_default_device``: that setting is process-global, so in an actor that runs many
tasks it leaks from one task into the next. Use ``self.device`` and :meth:`to_device`.

An actor that asks for a GPU on a cluster without one stays pending forever (Ray waits for a GPU node).
:func:`gpu_actor_options` checks the cluster first: ``Worker.options(**gpu_actor_options(1,
fallback_to_cpu=True)).remote(...)`` runs on the CPU there (with a warning), and without ``fallback_to_cpu``
it raises :class:`~robustdist.runtime.errors.TopologyError` instead of hanging.

``release(*names)`` drops the named attributes (a later access raises an ``AttributeError`` saying so);
``release()`` drops nothing, it only collects garbage and empties the CUDA cache. On a graceful exit
(``__ray_shutdown__``) every tensor and module attribute is dropped.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import platform
import socket
from importlib import metadata
from typing import Any

import torch

from robustdist._version import __version__
from robustdist.runtime.errors import ConfigError, TopologyError
from robustdist.runtime.log import get_logger
from robustdist.runtime.topology import parse_visible_devices

__all__ = ["RobustGPUActor", "gpu_actor_options", "gpu_positions", "parse_cpulist", "pin_to_numa"]

log = get_logger(__name__)


def gpu_positions(assigned: list[str], cuda_visible_devices: str | None) -> list[int]:
    """Map Ray's assigned GPU ids to their positions in ``CUDA_VISIBLE_DEVICES`` (torch's ordinals).

    ``("3",)`` with ``"2,3"`` -> ``[1]``; with it unset, the ids are the ordinals. UUIDs match UUIDs.
    """
    visible = parse_visible_devices(cuda_visible_devices)
    if visible is None:
        try:
            return [int(a) for a in assigned]
        except ValueError:
            raise TopologyError(f"Ray assigned GPU ids {assigned} but CUDA_VISIBLE_DEVICES is unset, so they cannot be "
                                "mapped to ordinals; expected integer ids or a CUDA_VISIBLE_DEVICES listing them. Fix: "
                                "let Ray set CUDA_VISIBLE_DEVICES (do not override it in the actor).") from None
    names = [str(v) for v in visible]
    positions = []
    for gpu in assigned:
        if str(gpu) not in names:
            raise TopologyError(
                f"Ray assigned GPU {gpu!r} but it is not in this process's CUDA_VISIBLE_DEVICES="
                f"{cuda_visible_devices!r}; expected every assigned id to be visible. Fix: do not set "
                "CUDA_VISIBLE_DEVICES yourself inside Ray actors (Ray narrows it per actor).")
        positions.append(names.index(str(gpu)))
    return positions


def parse_cpulist(text: str) -> set[int]:
    """Parse a sysfs CPU list such as ``"0-3,8,10-11"``."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def pin_to_numa(pci_bus_id: str, sysfs_root: str = "/sys") -> tuple[int | None, set[int] | None]:
    """Pin this process to the CPUs near a PCI device. Returns ``(numa node, CPUs pinned)``; ``None`` where
    sysfs has no answer or no allowed CPU is near the device (then nothing changes)."""
    dev = os.path.join(sysfs_root, "bus/pci/devices", pci_bus_id.lower())
    try:
        with open(os.path.join(dev, "numa_node")) as fh:
            node = int(fh.read().strip())
        with open(os.path.join(dev, "local_cpulist")) as fh:
            near = parse_cpulist(fh.read())
    except (OSError, ValueError):
        log.info("no NUMA information for %s under %s: CPU affinity left as is", pci_bus_id, sysfs_root)
        return None, None
    cpus = near & os.sched_getaffinity(0)
    if not cpus:
        log.info("none of the CPUs near %s (%s) are allowed here: CPU affinity left as is", pci_bus_id, sorted(near))
        return (node if node >= 0 else None), None
    os.sched_setaffinity(0, cpus)
    log.info("pinned to NUMA node %s CPUs %s (near %s)", node, sorted(cpus), pci_bus_id)
    return (node if node >= 0 else None), cpus


def _bus_id(index: int) -> str | None:
    props = torch.cuda.get_device_properties(index)
    if all(hasattr(props, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    return None


def _assigned_gpu_ids() -> list[str]:
    import ray

    try:
        return [str(x) for x in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]
    except Exception:  # older Ray
        return [str(x) for x in ray.get_gpu_ids()]


def _gpus(n: float) -> str:
    return f"{n:g} GPU" if n == 1 else f"{n:g} GPUs"


def gpu_actor_options(num_gpus: float = 1, *, fallback_to_cpu: bool = False) -> dict[str, float]:
    """Actor options asking for ``num_gpus``, checked against the connected cluster first.

    Use as ``Worker.options(**gpu_actor_options(1, fallback_to_cpu=True)).remote(...)``. When a node of the
    cluster has ``num_gpus`` GPUs (``ray.nodes()``; the total is ``ray.cluster_resources()["GPU"]``) it returns
    ``{"num_gpus": num_gpus}``. Otherwise Ray would keep the actor pending forever, so: with
    ``fallback_to_cpu`` it logs a warning and returns ``{"num_gpus": 0}`` (the actor's ``device`` is ``cpu``);
    without, it raises :class:`~robustdist.runtime.errors.TopologyError`. It sees the cluster as it is now: on an
    autoscaling cluster whose GPU nodes start on demand, pass ``num_gpus`` to ``.options`` directly.
    """
    import ray

    if (isinstance(num_gpus, bool) or not isinstance(num_gpus, (int, float)) or not math.isfinite(num_gpus)
            or num_gpus <= 0):
        raise ConfigError(f"num_gpus={num_gpus!r}; expected a number > 0 (a fraction such as 0.5 shares a GPU). "
                          "Fix: pass the GPUs one actor needs, or create the actor without GPUs (num_gpus=0) "
                          "without this helper.")
    if not ray.is_initialized():
        raise TopologyError("gpu_actor_options found no Ray cluster to check (ray.is_initialized() is False); "
                            "expected a connected cluster. Fix: call ray.init(...) first.")
    total = float(ray.cluster_resources().get("GPU", 0))
    largest = max((float(n.get("Resources", {}).get("GPU", 0)) for n in ray.nodes() if n.get("Alive")), default=0.0)
    if largest >= num_gpus:
        return {"num_gpus": num_gpus}
    found = (f"the Ray cluster has {_gpus(total)}" + (f" (at most {largest:g} on one node)" if total else "")
             + f" and the actor asks for num_gpus={num_gpus:g}")
    if fallback_to_cpu:
        log.warning("%s: the actor will run on the CPU (num_gpus=0, self.device is cpu) instead of staying pending. "
                    "Add GPU nodes to run it on a GPU.", found)
        return {"num_gpus": 0}
    raise TopologyError(f"{found}, so Ray would keep the actor pending forever; expected a node with at least "
                        f"{_gpus(num_gpus)}. Fix: add GPU nodes (or start Ray with --num-gpus), ask for fewer GPUs, or "
                        "pass fallback_to_cpu=True to run the actor on the CPU.")


class RobustGPUActor:
    """Base class for Ray actors: the right device, optional NUMA pinning, bf16 serializers, health probes.

    Subclasses call ``super().__init__()`` first. ``pin_numa`` may be passed or set as a class attribute.
    """

    pin_numa: bool = False
    sysfs_root: str = "/sys"

    def __init__(self, *, pin_numa: bool | None = None, sysfs_root: str | None = None) -> None:
        from robustdist.bf16 import install_ray_serializers

        if pin_numa is not None:
            self.pin_numa = pin_numa
        if sysfs_root is not None:
            self.sysfs_root = sysfs_root
        self.assigned_gpu_ids = _assigned_gpu_ids()
        self.devices = self._resolve_devices()
        self.device: torch.device = self.devices[0]
        self.numa_node: int | None = None
        if self.pin_numa:
            self._pin()
        install_ray_serializers()

    def _resolve_devices(self) -> list[torch.device]:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if not self.assigned_gpu_ids:
            return [torch.device("cpu")]
        if not torch.cuda.is_available():
            raise TopologyError(f"Ray assigned GPU ids {self.assigned_gpu_ids} but torch.cuda.is_available() is False "
                                f"(CUDA_VISIBLE_DEVICES={visible!r}); expected a CUDA build of torch and a driver. Fix: "
                                "install a CUDA torch in the worker image, or request num_gpus=0.")
        positions = gpu_positions(self.assigned_gpu_ids, visible)
        torch.cuda.set_device(positions[0])
        current = torch.cuda.current_device()
        if current != positions[0]:
            raise TopologyError(f"device mismatch: Ray assigned GPU ids {self.assigned_gpu_ids}, CUDA_VISIBLE_DEVICES="
                                f"{visible!r} puts them at cuda:{positions[0]}, but torch uses cuda:{current}; expected "
                                "them to agree. Fix: do not call torch.cuda.set_device or change CUDA_VISIBLE_DEVICES "
                                "before RobustGPUActor.__init__.")
        return [torch.device("cuda", p) for p in positions]

    def _pin(self) -> None:
        if self.device.type != "cuda":
            log.info("pin_numa: no GPU assigned, CPU affinity left as is")
            return
        bus = _bus_id(self.device.index)
        if bus is None:
            log.info("pin_numa: torch does not expose the GPU's PCI bus id here; CPU affinity left as is")
            return
        self.numa_node, _ = pin_to_numa(bus, self.sysfs_root)

    def to_device(self, obj: Any) -> Any:
        """Move tensors inside nested dicts, lists, tuples, namedtuples and dataclasses to ``self.device``
        (``non_blocking`` when the source is pinned). Other objects are returned as they are."""
        if isinstance(obj, torch.Tensor):
            return obj.to(self.device, non_blocking=obj.is_pinned())
        if isinstance(obj, dict):
            return type(obj)((k, self.to_device(v)) for k, v in obj.items())
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return type(obj)(*(self.to_device(v) for v in obj))
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.to_device(v) for v in obj)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            changes = {f.name: self.to_device(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
            return dataclasses.replace(obj, **changes)
        return obj

    def health(self) -> dict[str, Any]:
        """A cheap liveness probe with where this actor runs and what it holds."""
        import ray

        info: dict[str, Any] = {
            "pid": os.getpid(), "hostname": socket.gethostname(), "node_id": ray.get_runtime_context().get_node_id(),
            "device": str(self.device), "devices": [str(d) for d in self.devices],
            "assigned_gpu_ids": list(self.assigned_gpu_ids),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "numa_node": self.numa_node,
            "cpu_affinity": sorted(os.sched_getaffinity(0)),
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "ray": metadata.version("ray"), "robustdist": __version__},
        }
        if self.device.type == "cuda":
            info["cuda_memory_allocated"] = torch.cuda.memory_allocated(self.device)
            info["cuda_memory_reserved"] = torch.cuda.memory_reserved(self.device)
        else:
            with open("/proc/self/statm") as fh:
                info["rss_bytes"] = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return info

    def release(self, *names: str) -> list[str]:
        """Drop the named attributes, collect garbage and empty the CUDA cache. Returns the names dropped.

        ``release()`` with no names drops nothing (it only collects garbage and empties the cache). A later
        access to a dropped attribute raises an ``AttributeError`` saying it was released: re-create it first.
        """
        if not names:
            self._collect()
            log.info("release(): no attribute names given, so nothing was dropped (garbage collected, CUDA cache "
                     "emptied); pass names, e.g. release('model'), to drop attributes")
            return []
        present = vars(self)
        dropped = [n for n in names if n in present]
        self._drop(dropped)
        missing = [n for n in names if n not in dropped]
        log.info("release(): dropped %s%s; garbage collected, CUDA cache emptied", dropped or "nothing",
                 f" ({missing} not set on the actor)" if missing else "")
        return dropped

    def _drop(self, names: list[str]) -> None:
        released = self.__dict__.setdefault("_released", set())
        for name in names:
            delattr(self, name)
            released.add(name)
        self._collect()

    def _drop_all(self) -> list[str]:
        """Drop every tensor and module attribute (but ``device``/``devices``): for the end of the process."""
        dropped = [n for n, v in vars(self).items()
                   if n not in ("device", "devices") and isinstance(v, (torch.Tensor, torch.nn.Module))]
        self._drop(dropped)
        return dropped

    @staticmethod
    def _collect() -> None:
        gc.collect()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def __getattr__(self, name: str) -> Any:
        # Only consulted when normal lookup fails: explain attributes release() dropped, plain otherwise.
        if not name.startswith("__"):
            released = object.__getattribute__(self, "__dict__").get("_released", ())
            if name in released:
                cls = type(self).__name__
                raise AttributeError(
                    f"{cls}.{name} was released by release({name!r}) (deleted to free its memory), so it is gone; "
                    f"expected it to be re-created before use. Fix: re-create it (self.{name} = ...) before "
                    f"calling methods that use it, or release it only once it is no longer needed.")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __ray_shutdown__(self) -> None:  # called by Ray Core on a graceful actor exit (Ray >= 2.x)
        self._drop_all()  # the process is ending: nothing can use them any more
