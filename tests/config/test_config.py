"""HardenConfig: construction, validation messages, YAML/env/dict inputs, fingerprint, fuzzed bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from robustdist.config.schema import (
    CheckpointConfig,
    DataConfig,
    DistributedConfig,
    HardenConfig,
    config_reference,
    resolve_config,
)
from robustdist.runtime.errors import ConfigError, MissingDependencyError

LITERATURE_YAML = """\
distributed:
  backend: nccl
  timeout: 1800
  init_method: env://
  find_unused_parameters: false
"""


def test_defaults_match_the_documented_values():
    cfg = HardenConfig()
    assert cfg.to_dict() == {
        "distributed": {"backend": "auto", "timeout": 1800.0, "init_timeout": 300.0, "init_method": "env://",
                        "find_unused_parameters": False, "broadcast_buffers": True, "sync_batchnorm": "auto",
                        "smoke_test": True, "barrier_timeout": 300.0, "strategy": "ddp"},
        "data": {"auto_sampler": True, "seed": 0, "pin_memory": "auto", "check_shm": True, "strict": False},
        "checkpoint": {"dir": None, "keep_last": 3, "async_save": False, "every_n_steps": None,
                       "arrival_timeout": 60.0, "local_every_n_steps": None, "local_dir": None,
                       "local_keep_last": 1, "replicas": 1, "run_name": None},
        "health": {"interval_steps": 300, "hang_timeout": 600.0, "nan_policy": "raise", "check_divergence": True,
                   "hang_action": "dump", "max_rollbacks": 3, "dump_dir": None,
                   "max_restarts_without_progress": 3, "check_gradients": True, "scaler_overflow_warn_after": 10},
        "fsdp": {"shard_modules": "auto", "sharding": "auto", "mixed_precision": None, "cpu_offload": False,
                 "reshard_after_forward": True},
        "recovery": {"in_process": False},
    }


def test_fsdp_section_accepts_class_names_and_refuses_the_rest():
    cfg = HardenConfig(fsdp={"shard_modules": ["Block", "Embedding"], "mixed_precision": "bf16"})
    assert cfg.fsdp.shard_modules == ("Block", "Embedding")
    assert HardenConfig.from_dict(cfg.to_dict()) == cfg
    env = HardenConfig.from_env(environ={"ROBUSTDIST_FSDP_SHARD_MODULES": "Block, Mlp"})
    assert env.fsdp.shard_modules == ("Block", "Mlp")
    for bad in (["not a name"], "all", [1], ["x"] * 65):
        with pytest.raises(ConfigError, match="fsdp.shard_modules"):
            HardenConfig(fsdp={"shard_modules": bad})
    with pytest.raises(ConfigError, match="fsdp.mixed_precision"):
        HardenConfig(fsdp={"mixed_precision": "fp8"})


def test_section_of_takes_a_section_or_a_harden_config_and_warns_on_a_dict():
    from robustdist.config.schema import FsdpConfig, section_of

    cfg = HardenConfig(data={"seed": 7})
    assert section_of(cfg, DataConfig, "f") is cfg.data
    assert section_of(cfg.data, DataConfig, "f") is cfg.data
    assert section_of(None, DataConfig, "f") == DataConfig()
    with pytest.warns(DeprecationWarning, match="resolve_config"):
        assert section_of({"data": {"seed": 3}}, DataConfig, "f").seed == 3
    assert section_of(None, FsdpConfig, "f").sharding == "auto"


def test_literature_yaml_loads_verbatim(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(LITERATURE_YAML)
    cfg = HardenConfig.from_yaml(path)
    assert cfg.distributed.backend == "nccl"
    assert cfg.distributed.timeout == 1800.0
    assert cfg.distributed.init_method == "env://"
    assert cfg.distributed.find_unused_parameters is False
    assert cfg.data == DataConfig()  # everything else keeps its default
    assert resolve_config(str(path)) == cfg


def test_sections_accept_dicts_and_timedelta():
    cfg = HardenConfig(distributed={"backend": "gloo", "timeout": timedelta(minutes=5)}, data=DataConfig(seed=7))
    assert cfg.distributed == DistributedConfig(backend="gloo", timeout=300)
    assert cfg.data.seed == 7


def test_config_is_frozen_and_replace_revalidates():
    cfg = HardenConfig()
    with pytest.raises(AttributeError):
        cfg.data = DataConfig()  # type: ignore[misc]
    changed = cfg.replace(data={"seed": 3}, checkpoint=CheckpointConfig(dir="/tmp/x"))
    assert changed.data.seed == 3 and changed.checkpoint.dir == "/tmp/x" and cfg.data.seed == 0
    with pytest.raises(ConfigError, match=r"`data.seed` is -1 \(int\); expected an integer >= 0"):
        cfg.replace(data={"seed": -1})


# ----------------------------------------------------------------------------- pinned messages
def test_unknown_key_suggests_the_closest_field():
    with pytest.raises(ConfigError) as exc:
        HardenConfig.from_dict({"distributed": {"timout": 10}})
    assert "unknown config key `distributed.timout`; did you mean `distributed.timeout`?" in str(exc.value)


def test_key_in_the_wrong_section_names_its_section():
    with pytest.raises(ConfigError, match="`seed` belongs to section `data`: move it under `data:`"):
        HardenConfig.from_dict({"distributed": {"seed": 1}})
    with pytest.raises(ConfigError, match=r"`backend` is a field of section `distributed`\. Fix: nest it"):
        HardenConfig.from_dict({"backend": "gloo"})


def test_unknown_section_suggests_the_closest_section():
    with pytest.raises(ConfigError, match="unknown config section `distributd`; did you mean `distributed`"):
        HardenConfig.from_dict({"distributd": {}})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"distributed": {"backend": "ncll"}},
         "`distributed.backend` is 'ncll' (str); expected one of 'auto', 'nccl', 'gloo'. Did you mean 'nccl'?"),
        ({"distributed": {"timeout": 0}},
         "`distributed.timeout` is 0 (int); expected a positive number of seconds"),
        ({"distributed": {"timeout": "1800"}},
         "`distributed.timeout` is '1800' (str); expected a positive number of seconds"),
        ({"distributed": {"find_unused_parameters": "no"}},
         "`distributed.find_unused_parameters` is 'no' (str); expected true or false."),
        ({"distributed": {"init_method": "http://x"}},
         "`distributed.init_method` is 'http://x' (str); expected a URL starting with 'env://', 'tcp://', 'file://'."),
        ({"data": {"pin_memory": "yes"}}, "`data.pin_memory` is 'yes' (str); expected 'auto', true or false."),
        ({"checkpoint": {"keep_last": 0}}, "`checkpoint.keep_last` is 0 (int); expected an integer >= 1."),
        ({"checkpoint": {"dir": ""}}, "`checkpoint.dir` is '' (str); expected None or a non-empty filesystem path"),
        ({"health": {"nan_policy": "ignore"}},
         "`health.nan_policy` is 'ignore' (str); expected one of 'raise', 'skip', 'rollback', 'warn'."),
        ({"health": {"interval_steps": True}}, "`health.interval_steps` is True (bool); expected an integer >= 1."),
        ({"health": {"check_gradients": "no"}},
         "`health.check_gradients` is 'no' (str); expected true or false. Fix: give a boolean, not a string or a "
         "number: true (the default: read DDP's gradients) or false (check only the losses, one all-reduce per "
         "step)."),
        ({"health": {"check_gradients": 0}}, "`health.check_gradients` is 0 (int); expected true or false. Fix: "),
        ({"data": 5}, "config section `data` is 5 (int); expected a mapping of its fields"),
        ([1, 2], "a config must be a mapping of sections (distributed, data, checkpoint, health, fsdp, recovery), got [1, 2] (list)"),
    ],
)
def test_invalid_values_name_field_value_and_accepted(data, message):
    with pytest.raises(ConfigError) as exc:
        HardenConfig.from_dict(data)
    assert message in str(exc.value)


def test_rollback_needs_a_checkpoint_dir():
    with pytest.raises(ConfigError, match=r"health.nan_policy='rollback' needs a checkpoint .* Fix: set checkpoint.dir"):
        HardenConfig.from_dict({"health": {"nan_policy": "rollback"}})
    ok = HardenConfig.from_dict({"health": {"nan_policy": "rollback"}, "checkpoint": {"dir": "ckpt"}})
    assert ok.health.nan_policy == "rollback"


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        HardenConfig.from_dict({"data": {"seed": "x"}})


# ----------------------------------------------------------------------------- YAML, env, resolve
def test_yaml_errors_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the YAML config"):
        HardenConfig.from_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("distributed: [unclosed\n")
    with pytest.raises(ConfigError, match="does not parse"):
        HardenConfig.from_yaml(bad)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert HardenConfig.from_yaml(empty) == HardenConfig()


def test_yaml_without_pyyaml_names_the_extra(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text(LITERATURE_YAML)
    monkeypatch.setitem(sys.modules, "yaml", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'robustdist\[yaml\]'"):
        HardenConfig.from_yaml(path)


def test_env_overlay():
    env = {
        "ROBUSTDIST_DISTRIBUTED_TIMEOUT": "600",
        "ROBUSTDIST_DISTRIBUTED_FIND_UNUSED_PARAMETERS": "yes",
        "ROBUSTDIST_DATA_PIN_MEMORY": "auto",
        "ROBUSTDIST_CHECKPOINT_DIR": "/ckpt",
        "ROBUSTDIST_CHECKPOINT_EVERY_N_STEPS": "none",
        "ROBUSTDIST_HEALTH_HANG_TIMEOUT": "90.5",
        "ROBUSTDIST_HEALTH_CHECK_GRADIENTS": "off",
        "ROBUSTDIST_LOG_LEVEL": "debug",  # not a config section: ignored
        "UNRELATED": "1",
    }
    cfg = HardenConfig.from_env({"data": {"seed": 4}, "checkpoint": {"every_n_steps": 10}}, environ=env)
    assert cfg.distributed.timeout == 600.0
    assert cfg.distributed.find_unused_parameters is True
    assert cfg.data.seed == 4 and cfg.data.pin_memory == "auto"
    assert cfg.checkpoint.dir == "/ckpt" and cfg.checkpoint.every_n_steps is None
    assert cfg.health.hang_timeout == 90.5 and cfg.health.check_gradients is False


def test_env_overlay_reads_os_environ(monkeypatch):
    monkeypatch.setenv("ROBUSTDIST_DATA_SEED", "11")
    assert HardenConfig.from_env().data.seed == 11


@pytest.mark.parametrize(
    ("var", "value", "message"),
    [
        ("ROBUSTDIST_DISTRIBUTED_TIMOUT", "5",
         "ROBUSTDIST_DISTRIBUTED_TIMOUT names no field of config section `distributed`; "
         "did you mean ROBUSTDIST_DISTRIBUTED_TIMEOUT?"),
        ("ROBUSTDIST_DATA_STRICT", "maybe",
         "`data.strict (from $ROBUSTDIST_DATA_STRICT)` is 'maybe' (str); expected true or false. "
         "In the environment write 1/0"),
        ("ROBUSTDIST_DATA_SEED", "1.5", "`data.seed (from $ROBUSTDIST_DATA_SEED)` is '1.5' (str); expected an integer"),
    ],
)
def test_env_errors(var, value, message):
    with pytest.raises(ConfigError) as exc:
        HardenConfig.from_env(environ={var: value})
    assert message in str(exc.value)


def test_resolve_config_accepts_each_form(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  seed: 9\n")
    cfg = HardenConfig(data={"seed": 9})
    assert resolve_config(None) == HardenConfig()
    assert resolve_config(cfg) is cfg
    assert resolve_config({"data": {"seed": 9}}) == cfg
    assert resolve_config(path) == cfg and resolve_config(str(path)) == cfg
    with pytest.raises(ConfigError, match=r"cfg is 3 \(int\); expected a HardenConfig, a dict, a YAML path or None"):
        resolve_config(3)


# ----------------------------------------------------------------------------- fingerprint
def test_fingerprint_is_stable_across_key_order_and_spellings():
    a = HardenConfig.from_dict({"distributed": {"timeout": 600, "backend": "gloo"}, "data": {"seed": 1}})
    b = HardenConfig.from_dict({"data": {"seed": 1}, "distributed": {"backend": "gloo", "timeout": 600.0}})
    c = HardenConfig(distributed={"backend": "gloo", "timeout": timedelta(seconds=600)}, data={"seed": 1})
    assert a.fingerprint() == b.fingerprint() == c.fingerprint()
    assert len(a.fingerprint()) == 64
    assert a.fingerprint() != a.replace(data={"seed": 2}).fingerprint()


@pytest.mark.processes
def test_fingerprint_is_stable_across_processes():
    data = {"distributed": {"backend": "gloo", "timeout": 60}, "checkpoint": {"dir": "/x", "keep_last": 2}}
    code = (
        "import json, sys; from robustdist.config import HardenConfig; "
        "print(HardenConfig.from_dict(json.loads(sys.argv[1])).fingerprint())"
    )
    out = subprocess.run([sys.executable, "-c", code, json.dumps(data)], capture_output=True, text=True,
                         check=True, timeout=60, env={**os.environ, "PYTHONHASHSEED": "123"})
    assert out.stdout.strip() == HardenConfig.from_dict(data).fingerprint()


# ----------------------------------------------------------------------------- properties
seconds_st = st.one_of(st.integers(1, 10**6), st.floats(0.001, 1e6, allow_nan=False))
valid_configs = st.fixed_dictionaries(
    {},
    optional={
        "distributed": st.fixed_dictionaries({}, optional={
            "backend": st.sampled_from(["auto", "nccl", "gloo"]), "timeout": seconds_st,
            "init_method": st.sampled_from(["env://", "tcp://10.0.0.1:23456", "file:///tmp/rdv"]),
            "find_unused_parameters": st.booleans(), "broadcast_buffers": st.booleans(),
            "sync_batchnorm": st.sampled_from(["auto", True, False]), "smoke_test": st.booleans(),
            "barrier_timeout": seconds_st, "strategy": st.sampled_from(["ddp", "fsdp"])}),
        "data": st.fixed_dictionaries({}, optional={
            "auto_sampler": st.booleans(), "seed": st.integers(0, 2**63 - 1),
            "pin_memory": st.sampled_from(["auto", True, False]), "check_shm": st.booleans(),
            "strict": st.booleans()}),
        "checkpoint": st.fixed_dictionaries({}, optional={
            "dir": st.sampled_from(["ckpt", "/tmp/a b", "s3-mount/run1"]), "keep_last": st.integers(1, 100),
            "async_save": st.booleans(), "every_n_steps": st.one_of(st.none(), st.integers(1, 10**6))}),
        "health": st.fixed_dictionaries({}, optional={
            "interval_steps": st.integers(1, 10**6), "hang_timeout": st.one_of(st.none(), seconds_st),
            "nan_policy": st.sampled_from(["raise", "skip", "warn"]), "check_divergence": st.booleans(),
            "hang_action": st.sampled_from(["dump", "abort"]), "max_rollbacks": st.integers(1, 100),
            "check_gradients": st.booleans(),
            "dump_dir": st.one_of(st.none(), st.just("/tmp/dumps"))}),
    },
)


@given(valid_configs)
def test_round_trip_through_dict_and_json(data):
    cfg = HardenConfig.from_dict(data)
    assert HardenConfig.from_dict(cfg.to_dict()) == cfg
    assert HardenConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert HardenConfig.from_dict(cfg.to_dict()).fingerprint() == cfg.fingerprint()


junk = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8), st.binary(max_size=4),
              st.timedeltas()),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(st.one_of(st.text(max_size=12), st.integers(), st.none()), children, max_size=4),
    ),
    max_leaves=12,
)
field_names = st.sampled_from(
    ["backend", "timeout", "init_timeout", "init_method", "find_unused_parameters", "sync_batchnorm",
     "barrier_timeout", "seed",
     "pin_memory", "dir", "keep_last", "every_n_steps", "hang_timeout", "nan_policy", "dump_dir", "interval_steps",
     "hang_action", "max_rollbacks"]
)
section_names = st.sampled_from(["distributed", "data", "checkpoint", "health"])


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(junk)
def test_any_junk_gives_config_error_or_a_valid_config(data):
    try:
        cfg = HardenConfig.from_dict(data)
    except ConfigError:
        return
    assert isinstance(cfg, HardenConfig)


@given(section_names, field_names, junk)
def test_junk_in_any_field_gives_config_error(section, name, value):
    try:
        cfg = HardenConfig.from_dict({section: {name: value}})
    except ConfigError as e:
        assert f"{section}." in str(e)  # the message names the field path
        return
    assert isinstance(cfg, HardenConfig)


@given(st.dictionaries(
    st.builds(lambda s, f: f"ROBUSTDIST_{s.upper()}_{f.upper()}", section_names, field_names),
    st.text(max_size=10).filter(lambda s: "\x00" not in s), max_size=4))
def test_any_env_gives_config_error_or_a_valid_config(environ):
    try:
        cfg = HardenConfig.from_env(environ=environ)
    except ConfigError as e:
        assert "ROBUSTDIST_" in str(e)  # the message names the variable
        return
    assert isinstance(cfg, HardenConfig)


@settings(max_examples=60)
@given(st.text(max_size=60))
def test_any_yaml_text_gives_config_error_or_a_valid_config(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("y") / "c.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        cfg = HardenConfig.from_yaml(path)
    except ConfigError:
        return
    assert isinstance(cfg, HardenConfig)


def test_config_reference_lists_every_field_with_its_doc():
    table = config_reference()
    assert "| `distributed.timeout` | `1800.0` | `ROBUSTDIST_DISTRIBUTED_TIMEOUT` | Collective timeout in seconds" in table
    assert "| `checkpoint.dir` | `null` | `ROBUSTDIST_CHECKPOINT_DIR` |" in table
    assert table.count("\n") + 1 == 2 + 10 + 5 + 10 + 10 + 5 + 1
