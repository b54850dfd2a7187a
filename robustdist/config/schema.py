"""``HardenConfig``: one keyword-only, frozen, validated configuration for every robustdist part.

Sections (each a dataclass of its own): ``distributed``, ``data``, ``checkpoint``, ``health``, ``fsdp``,
``recovery``. Every field
carries a one-line doc in its metadata; :func:`config_reference` renders them as the table in docs/configuration.md.

Ways in, all validated up front; any bad input raises :class:`~robustdist.runtime.errors.ConfigError` naming the
field path, the bad value and what is accepted (never ``TypeError``/``KeyError``/``AttributeError``):

* ``HardenConfig(distributed=DistributedConfig(backend="gloo"))`` or with plain dicts per section;
* ``HardenConfig.from_dict({...})`` / ``HardenConfig.from_yaml(path)`` (needs ``robustdist[yaml]``);
* ``HardenConfig.from_env(base)``: overlays ``ROBUSTDIST_<SECTION>_<FIELD>`` variables;
* ``resolve_config(cfg)``: what every robustdist entry point calls on its ``cfg`` argument
  (a ``HardenConfig``, a dict, a YAML path, or ``None`` for defaults).

Durations (``timeout``, ``init_timeout``, ``barrier_timeout``, ``hang_timeout``) are stored as float seconds; a
``datetime.timedelta`` is accepted wherever a duration is. ``fingerprint()`` hashes the canonical JSON, so
it is the same across key order, int-vs-float spellings and processes: ranks compare it to catch config drift.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from robustdist.config import validate as v
from robustdist.runtime.errors import ConfigError

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "DistributedConfig",
    "FsdpConfig",
    "HardenConfig",
    "HealthConfig",
    "RecoveryConfig",
    "config_reference",
    "resolve_config",
    "section_of",
]


def _f(default: Any, doc: str, kind: v.Kind) -> Any:
    return field(default=default, metadata={"doc": doc, "kind": kind})


class _switch(v.boolean):
    """A boolean whose error also says what each value does (``fix``)."""

    def __init__(self, fix: str):
        self.fix = fix

    def check(self, path: str, value: Any) -> Any:
        if isinstance(value, bool):
            return value
        raise self.fail(path, value, f" Fix: {self.fix}.")


class _Section:
    """Shared behaviour of the section dataclasses: validation and normalisation on construction."""

    _name: ClassVar[str]

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = f.metadata["kind"].check(f"{self._name}.{f.name}", getattr(self, f.name))
            object.__setattr__(self, f.name, value)


@dataclass(frozen=True, kw_only=True)
class DistributedConfig(_Section):
    """Process group and model wrapping."""

    _name: ClassVar[str] = "distributed"
    backend: str = _f("auto", "Process-group backend: auto picks nccl when CUDA is available, else gloo.",
                      v.choice("auto", "nccl", "gloo"))
    timeout: float = _f(1800.0, "Collective timeout in seconds (or a timedelta) for the process group.",
                        v.seconds())
    init_timeout: float = _f(300.0, "Bound in seconds on the rendezvous at init (finding the store, connecting, every "
                             "rank arriving); a bad address or a rank that never started is named within it.",
                             v.seconds())
    init_method: str = _f("env://", "URL telling ranks how to find each other (env://, tcp://host:port, file://).",
                          v.url("env://", "tcp://", "file://"))
    find_unused_parameters: bool = _f(False, "Passed to DDP; True costs a graph traversal every step.", v.boolean())
    broadcast_buffers: bool = _f(True, "Passed to DDP: copy rank 0's buffers to all ranks at each forward.",
                                 v.boolean())
    sync_batchnorm: bool | str = _f("auto", "Convert BatchNorm to SyncBatchNorm: auto means when world_size > 1.",
                                    v.auto_or_bool())
    smoke_test: bool = _f(True, "After init, all_reduce the ranks' ids and check the sum.", v.boolean())
    barrier_timeout: float = _f(300.0, "Bound in seconds on the named barrier after init; names missing ranks.",
                                v.seconds())
    strategy: str = _f("ddp", "How harden() wraps the model: ddp or fsdp (FSDP2).", v.choice("ddp", "fsdp"))


@dataclass(frozen=True, kw_only=True)
class DataConfig(_Section):
    """Dataloader guards."""

    _name: ClassVar[str] = "data"
    auto_sampler: bool = _f(True, "Insert a DistributedSampler when distributed and none is set.", v.boolean())
    seed: int = _f(0, "Base seed for the sampler shuffle and the per-rank, per-worker seeds.",
                   v.integer(minimum=0, maximum=2**63 - 1))
    pin_memory: bool | str = _f("auto", "Pin host memory: auto means exactly when CUDA is available.",
                                v.auto_or_bool())
    check_shm: bool = _f(True, "Check that batches in flight fit in /dev/shm before iterating.", v.boolean())
    strict: bool = _f(False, "Raise ConfigError instead of fixing a dataloader misconfiguration.", v.boolean())


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig(_Section):
    """Atomic checkpoints."""

    _name: ClassVar[str] = "checkpoint"
    dir: str | None = _f(None, "Checkpoint directory; None disables checkpointing.", v.optional(v.path()))
    keep_last: int = _f(3, "How many committed checkpoints to keep; older ones are rotated after a commit.",
                        v.integer(minimum=1))
    async_save: bool = _f(False, "Write checkpoints on a background thread after a CPU snapshot.", v.boolean())
    every_n_steps: int | None = _f(None, "Save every N steps from harden().save(); None saves only when forced.",
                                   v.optional(v.integer(minimum=1)))
    arrival_timeout: float = _f(60.0, "Seconds every rank has to reach save()/resume() once another rank has; a "
                                "rank that does not is named (save/resume are collective).", v.seconds())
    local_every_n_steps: int | None = _f(None, "Take an in-memory checkpoint (node-local, replicated to a peer node) "
                                         "every N steps from harden().save(); None turns the tier off.",
                                         v.optional(v.integer(minimum=1)))
    local_dir: str | None = _f(None, "Where the in-memory tier lives on each node (the same path on every node; it "
                               "writes only in <local_dir>/robustdist-<uid>-<id>); None: /dev/shm.",
                               v.optional(v.path()))
    local_keep_last: int = _f(1, "Complete in-memory steps kept on each node (1 or 2).",
                              v.integer(minimum=1, maximum=2))
    replicas: int = _f(1, "In-memory copies of each rank's state kept on another node (1 or 0).",
                       v.integer(minimum=0, maximum=1))
    run_name: str | None = _f(None, "This run's name: a checkpoint directory recorded as another run's is refused. "
                              "Inside Ray Train it defaults to RunConfig.name, and checkpoints go to "
                              "<dir>/<run_name> (each Tune trial's run gets its own).",
                              v.optional(v.run_name()))


@dataclass(frozen=True, kw_only=True)
class HealthConfig(_Section):
    """Runtime health guards."""

    _name: ClassVar[str] = "health"
    interval_steps: int = _f(300, "Run the cross-rank divergence check every N steps.", v.integer(minimum=1))
    hang_timeout: float | None = _f(600.0, "Seconds without a step before the watchdog dumps stacks; None disables.",
                                    v.optional(v.seconds()))
    nan_policy: str = _f("raise", "What a non-finite loss does on every rank: raise, skip, rollback or warn.",
                         v.choice("raise", "skip", "rollback", "warn"))
    check_divergence: bool = _f(True, "Compare parameters across ranks every interval_steps.", v.boolean())
    hang_action: str = _f("dump", "After a hang is reported: dump (keep waiting) or abort (exit with code 86 "
                          "so torchrun/Ray restart the worker).", v.choice("dump", "abort"))
    max_rollbacks: int = _f(3, "nan_policy=rollback gives up with an error after this many consecutive "
                            "rollbacks of the same step.", v.integer(minimum=1))
    dump_dir: str | None = _f(None, "Where the watchdog writes stack dumps (also always to stderr).",
                              v.optional(v.path()))
    max_restarts_without_progress: int = _f(3, "resume() raises RestartLoopError when this many consecutive restart "
                                            "attempts resumed from the same step without committing a newer one.",
                                            v.integer(minimum=1))
    check_gradients: bool = _f(True, "The step guard under DDP reads the all-reduced gradients (no collective; also "
                               "catches an overflow whose loss is finite). false: it checks only the losses, with one "
                               "all-reduce of a flag per rank per step, and such an overflow reaches optimizer.step(). "
                               "FSDP and one process check only the loss either way.",
                               _switch("give a boolean, not a string or a number: true (the default: read DDP's "
                                       "gradients) or false (check only the losses, one all-reduce per step)"))
    scaler_overflow_warn_after: int = _f(10, "With a GradScaler given to harden or step_guard: this many optimizer "
                                         "steps in a row skipped for overflowing gradients log a warning (each "
                                         "one is logged at INFO).", v.integer(minimum=1))


@dataclass(frozen=True, kw_only=True)
class FsdpConfig(_Section):
    """FSDP2 sharding, used when ``distributed.strategy`` is fsdp."""

    _name: ClassVar[str] = "fsdp"
    shard_modules: tuple[str, ...] | str = _f("auto", "Which submodules get their own fully_shard before the root: a list "
                                        "of module class names, or auto (every module held in an nn.ModuleList, "
                                        "e.g. transformer blocks).", v.names("auto"))
    sharding: str = _f("auto", "auto (FULL_SHARD on one node, HYBRID_SHARD across nodes), FULL_SHARD, "
                       "HYBRID_SHARD or NO_SHARD.", v.choice("auto", "FULL_SHARD", "HYBRID_SHARD", "NO_SHARD"))
    mixed_precision: str | None = _f(None, "Parameter dtype in forward/backward: None (as stored), bf16 or fp16; "
                                     "gradients are reduced in fp32.", v.optional(v.choice("bf16", "fp16")))
    cpu_offload: bool = _f(False, "Keep sharded parameters, gradients and optimizer state in CPU memory "
                           "(CPUOffloadPolicy).", v.boolean())
    reshard_after_forward: bool = _f(True, "Free the gathered parameters after forward (less memory, one more "
                                     "all-gather in backward).", v.boolean())


@dataclass(frozen=True, kw_only=True)
class RecoveryConfig(_Section):
    """How a fault is recovered from."""

    _name: ClassVar[str] = "recovery"
    in_process: bool = _f(False, "Experimental. h.run(train_fn): a fault on any rank (an exception escaping the step) "
                          "is recovered in the same processes, from the last checkpoint, with no restart; gloo and "
                          "DDP only, else a fault ends the process as before (docs/recovery.md).",
                          _switch("give a boolean: true (recover in process under h.run) or false (the default: "
                                  "a fault ends the process and the launcher restarts it)"))


_SECTIONS: dict[str, type[_Section]] = {
    "distributed": DistributedConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "health": HealthConfig,
    "fsdp": FsdpConfig,
    "recovery": RecoveryConfig,
}

S = TypeVar("S", bound=_Section)


def _section_from_mapping(cls: type[S], name: str, data: Any) -> S:
    if isinstance(data, cls):
        return data
    if data is None:
        return cls()
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"config section `{name}` is {v.show(data)}; expected a mapping of its fields "
            f"({', '.join(_field_names(cls))}). Fix: write `{name}:` followed by indented `field: value` lines."
        )
    names = _field_names(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str) or key not in names:
            raise ConfigError(_unknown_key_message(f"{name}.", key, names, section=name))
        kwargs[key] = value
    return cls(**kwargs)


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _unknown_key_message(prefix: str, key: Any, valid: list[str], *, section: str | None) -> str:
    msg = f"unknown config key `{prefix}{v.cut(key)}`" if isinstance(key, str) else f"config key {v.show(key)} under `{prefix.rstrip('.') or 'the top level'}` is not a string"
    hint = v.suggest(key, valid) if isinstance(key, str) else None
    if hint:
        msg += f"; did you mean `{prefix}{hint}`?"
    elif isinstance(key, str) and section is not None:
        owners = [s for s, c in _SECTIONS.items() if s != section and key in _field_names(c)]
        if owners:
            msg += f"; `{key}` belongs to section `{owners[0]}`: move it under `{owners[0]}:`"
    return msg + f". Valid keys: {', '.join(valid)}."


@dataclass(frozen=True, kw_only=True)
class HardenConfig:
    """The whole robustdist configuration. Sections may be given as their dataclass or as a dict."""

    distributed: DistributedConfig = field(default_factory=DistributedConfig,
                                           metadata={"doc": "Process group and model wrapping."})
    data: DataConfig = field(default_factory=DataConfig, metadata={"doc": "Dataloader guards."})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata={"doc": "Atomic checkpoints."})
    health: HealthConfig = field(default_factory=HealthConfig, metadata={"doc": "Runtime health guards."})
    fsdp: FsdpConfig = field(default_factory=FsdpConfig, metadata={"doc": "FSDP2 sharding."})
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig,
                                     metadata={"doc": "Recovery from a fault (experimental)."})

    def __post_init__(self) -> None:
        for name, cls in _SECTIONS.items():
            object.__setattr__(self, name, _section_from_mapping(cls, name, getattr(self, name)))
        if self.health.nan_policy == "rollback" and self.checkpoint.dir is None:
            raise ConfigError(
                "health.nan_policy='rollback' needs a checkpoint to roll back to, but checkpoint.dir is None. "
                "Fix: set checkpoint.dir (and checkpoint.every_n_steps), or choose nan_policy 'raise', 'skip' or 'warn'."
            )
        if self.checkpoint.local_every_n_steps is not None and self.checkpoint.dir is None:
            raise ConfigError(
                "checkpoint.local_every_n_steps is set but checkpoint.dir is None; expected a durable checkpoint "
                "directory beside the in-memory tier (it is the fallback when a job or every copy is lost, and it holds "
                "the tier's lineage). Fix: set checkpoint.dir too."
            )
        if self.recovery.in_process and self.checkpoint.dir is None:
            raise ConfigError(
                "recovery.in_process is true but checkpoint.dir is None; expected a checkpoint directory: an "
                "in-process recovery resumes from the last checkpoint (best an in-memory one: "
                "checkpoint.local_every_n_steps); without one every fault would start the run over. Fix: set "
                "checkpoint.dir (and "
                "checkpoint.local_every_n_steps), or recovery.in_process: false."
            )

    # ----------------------------------------------------------------- constructors
    @classmethod
    def from_dict(cls, data: Any) -> HardenConfig:
        """Build from a nested mapping ``{"distributed": {...}, "data": {...}, ...}``; missing keys keep defaults."""
        if isinstance(data, HardenConfig):
            return data
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"a config must be a mapping of sections ({', '.join(_SECTIONS)}), got {v.show(data)}. "
                "Fix: pass a dict such as {'distributed': {'backend': 'gloo'}}, a YAML path, or a HardenConfig."
            )
        sections: dict[str, Any] = {}
        for key, value in data.items():
            if not isinstance(key, str) or key not in _SECTIONS:
                raise ConfigError(_top_level_key_message(key))
            sections[key] = _section_from_mapping(_SECTIONS[key], key, value)
        return cls(**sections)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> HardenConfig:
        """Load a YAML file (``yaml.safe_load``) and validate it like :meth:`from_dict`."""
        from robustdist.config.io import load_yaml

        return cls.from_dict(load_yaml(path))

    @classmethod
    def from_env(cls, base: Any = None, *, environ: Mapping[str, str] | None = None) -> HardenConfig:
        """Overlay ``ROBUSTDIST_<SECTION>_<FIELD>`` variables (e.g. ``ROBUSTDIST_DISTRIBUTED_TIMEOUT=600``)
        on ``base`` (anything :func:`resolve_config` takes). Unknown fields in a known section raise."""
        from robustdist.config.io import env_overrides

        merged = resolve_config(base).to_dict()
        for section, values in env_overrides(os.environ if environ is None else environ, _SECTIONS).items():
            merged[section].update(values)
        return cls.from_dict(merged)

    # ----------------------------------------------------------------- views
    def to_dict(self) -> dict[str, dict[str, Any]]:
        """A plain nested dict of JSON types; ``HardenConfig.from_dict(cfg.to_dict()) == cfg``."""
        return {name: dataclasses.asdict(getattr(self, name)) for name in _SECTIONS}

    def fingerprint(self) -> str:
        """SHA-256 hex digest of the canonical JSON (sorted keys, no whitespace) of :meth:`to_dict`."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False)
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    def replace(self, **sections: Any) -> HardenConfig:
        """A copy with some sections replaced: each given as its dataclass or as a dict of field overrides."""
        merged: dict[str, Any] = dict(self.to_dict())
        for name, value in sections.items():
            if name not in _SECTIONS:
                raise ConfigError(_top_level_key_message(name))
            merged[name] = {**merged[name], **value} if isinstance(value, Mapping) else value
        return HardenConfig.from_dict(merged)


def _top_level_key_message(key: Any) -> str:
    valid = list(_SECTIONS)
    if isinstance(key, str):
        owners = [s for s, c in _SECTIONS.items() if key in _field_names(c)]
        if owners:
            return (f"unknown config section `{key}`: `{key}` is a field of section `{owners[0]}`. "
                    f"Fix: nest it, e.g. {{'{owners[0]}': {{'{key}': ...}}}}. Valid sections: {', '.join(valid)}.")
    return _unknown_key_message("", key, valid, section=None).replace("config key", "config section", 1)


def resolve_config(cfg: Any = None) -> HardenConfig:
    """Turn what users pass as ``cfg`` into a validated :class:`HardenConfig`.

    Accepts a ``HardenConfig``, a mapping, a YAML path (``str`` or ``os.PathLike``), or ``None`` (defaults).
    """
    if cfg is None or isinstance(cfg, HardenConfig):
        return cfg if cfg is not None else HardenConfig()
    if isinstance(cfg, Mapping):
        return HardenConfig.from_dict(cfg)
    if isinstance(cfg, (str, os.PathLike)):
        return HardenConfig.from_yaml(cfg)
    raise ConfigError(
        f"cfg is {v.show(cfg)}; expected a HardenConfig, a dict, a YAML path or None. "
        "Fix: pass HardenConfig(...) or a dict such as {'distributed': {'backend': 'gloo'}}."
    )


def section_of(cfg: Any, cls: type[S], caller: str) -> S:
    """The ``cls`` section a mechanism reads, from its typed section, a :class:`HardenConfig`, or None.

    Each mechanism (``wrap_ddp``, ``safe_dataloader``, ...) takes its own section. A dict or YAML path is
    still accepted for compatibility and resolved here once, with a ``DeprecationWarning``: resolve it once
    with :func:`resolve_config` (``harden`` and the CLI do) and pass the result.
    """
    if isinstance(cfg, cls):
        return cfg
    if cfg is None:
        return cls()
    if isinstance(cfg, HardenConfig):
        return getattr(cfg, cls._name)  # type: ignore[no-any-return]
    import warnings

    warnings.warn(f"{caller}(cfg=<{type(cfg).__name__}>): pass a {cls.__name__} or a HardenConfig; a dict or YAML "
                  "path is resolved on every call. Resolve it once with robustdist.resolve_config(cfg).",
                  DeprecationWarning, stacklevel=3)
    return getattr(resolve_config(cfg), cls._name)  # type: ignore[no-any-return]


def config_reference() -> str:
    """The Markdown table of every field (path, default, env var, doc) that docs/configuration.md shows."""
    rows = ["| field | default | environment variable | meaning |", "|---|---|---|---|"]
    for name, cls in _SECTIONS.items():
        for f in dataclasses.fields(cls):
            default = json.dumps(f.default)
            env = f"ROBUSTDIST_{name.upper()}_{f.name.upper()}"
            rows.append(f"| `{name}.{f.name}` | `{default}` | `{env}` | {f.metadata['doc']} |")
    return "\n".join(rows)
