"""Hostile and broken config files, ROBUSTDIST_* overrides and launcher variables: each route gives a clear
ConfigError / TopologyError quickly, never a hang, a blow-up or a raw stdlib exception."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from robustdist.config import validate as v
from robustdist.config.io import MAX_YAML_BYTES
from robustdist.config.schema import HardenConfig
from robustdist.runtime.errors import ConfigError, TopologyError
from robustdist.runtime.topology import Topology, detect_topology, parse_visible_devices
from tests._memory import peak_growth
from tests.runtime.test_topology import LAUNCHER_VARS, _set, clean_env  # noqa: F401 - clean_env is a fixture

pytest.importorskip("yaml")

HUGE = "9" * 5000


def _yaml(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _load_error(path) -> str:
    start = time.monotonic()
    with pytest.raises(ConfigError) as exc:
        HardenConfig.from_yaml(path)
    assert time.monotonic() - start < 5
    return str(exc.value)


# ----------------------------------------------------------------------------- YAML structure bounds
BOMB = "\n".join(
    [
        "a: &a [x,x,x,x,x,x,x,x,x]",
        *(f"{n}: &{n} [{','.join([f'*{p}'] * 9)}]" for p, n in zip("abcdefgh", "bcdefghi")),
        "distributed:",
        "  timeout: *i",
    ]
) + "\n"


def test_alias_bomb_is_refused_within_seconds_and_little_memory(tmp_path):
    assert len(BOMB) < 500  # 9**9 = 387 million values once expanded
    found = []
    grew = peak_growth(lambda: found.append(_load_error(_yaml(tmp_path, BOMB))))
    message = found[0]
    assert grew < 200 * 2**20, f"peak memory grew by {grew >> 20} MiB"
    assert message.startswith(f"the YAML config '{tmp_path / 'c.yaml'}' holds more than 10000 values")
    assert "counting each alias (*name) as a copy of its anchor; expected at most 10000. Fix: " in message
    assert "remove anchors and aliases (&name, *name)" in message


def test_alias_bomb_as_a_python_value_formats_in_bounded_time():
    # The same shape handed to from_dict: the error message must not repr 387 million items.
    bomb: object = ["x"] * 9
    for _ in range(8):
        bomb = [bomb] * 9
    start = time.monotonic()
    with pytest.raises(ConfigError) as exc:
        HardenConfig.from_dict({"distributed": {"timeout": bomb}})
    assert time.monotonic() - start < 5
    assert str(exc.value).startswith("`distributed.timeout` is [[[[...], [...], [...], [...], ...]")
    assert len(str(exc.value)) < 300


def test_too_many_aliases(tmp_path):
    message = _load_error(_yaml(tmp_path, "a: &a 1\nb: [" + ", ".join(["*a"] * 101) + "]\n"))
    assert "uses more than 100 aliases (*name); expected at most 100. Fix: write the values out" in message


@pytest.mark.parametrize("text", [
    "[" * 100_000 + "]" * 100_000,  # PyYAML alone raises RecursionError
    "".join(" " * i + "k:\n" for i in range(200)),
])
def test_deep_nesting_is_refused_before_recursion(tmp_path, text):
    message = _load_error(_yaml(tmp_path, text))
    assert "nests deeper than 64 levels; expected at most 64 (a config needs 2: section, then field). " \
           "Fix: flatten the file." in message


@pytest.mark.parametrize(("value", "digits"), [("9" * 5000, 5000), ("0x" + "f" * 5000, 5002), ("1_0" * 20, 40)])
def test_huge_integers_are_refused_before_conversion(tmp_path, value, digits):
    message = _load_error(_yaml(tmp_path, f"data:\n  seed: {value}\n"))
    assert (f"has a {digits}-digit integer at line 2; expected at most 30 digits (no config field needs more). "
            "Fix: correct that value.") in message


def test_thirty_digit_integer_still_reaches_field_validation(tmp_path):
    with pytest.raises(ConfigError, match=r"`data.seed` is 9{30} \(int\); expected an integer >= 0"):
        HardenConfig.from_yaml(_yaml(tmp_path, "data:\n  seed: " + "9" * 30 + "\n"))


def test_errors_inside_the_yaml_constructor_are_config_errors(tmp_path):
    message = _load_error(_yaml(tmp_path, "data:\n  seed: 2001-02-30\n"))  # datetime() raises ValueError
    assert "cannot be loaded: ValueError: day is out of range for month; expected a small YAML mapping" in message
    assert "Fix: correct the value the error names." in message


@pytest.mark.parametrize(("text", "key", "lines"), [
    ("distributed:\n  timeout: 600\n  timeout: 0.001\n", "timeout", (2, 3)),
    ("checkpoint:\n  dir: /a\n  keep_last: 3\nhealth: {}\ncheckpoint:\n  dir: /b\n", "checkpoint", (1, 5)),
    ("data: {seed: 1, seed: 2}\n", "seed", (1, 1)),
], ids=["field", "section", "flow"])
def test_a_key_given_twice_is_a_config_error_naming_both_lines(tmp_path, text, key, lines):
    message = _load_error(_yaml(tmp_path, text))
    assert f"has the key '{key}' twice in one mapping (lines {lines[0]} and {lines[1]})" in message
    assert "Fix: merge the two into one" in message


@pytest.mark.parametrize(("text", "expected"), [
    ("checkpoint:\n  <<: {keep_last: 3}\n  <<: {keep_last: 7}\n", "has the key '<<' twice in one mapping (lines 2 and 3)"),
    ("<<: {checkpoint: {dir: /a, keep_last: 5}}\ncheckpoint: {dir: /b}\n",
     "replaces the section 'checkpoint' merged in with << (line 1) by the one at line 2"),
], ids=["two-merges", "merged-section-replaced"])
def test_a_merge_that_would_drop_values_silently_is_a_config_error(tmp_path, text, expected):
    assert expected in _load_error(_yaml(tmp_path, text))


@pytest.mark.parametrize("text", ["checkpoint: {keep_last: !!bool maybe}\n", "checkpoint: {keep_last: !!int }\n",
                                  "checkpoint: {keep_last: !!int _}\n", "data: {seed: !!timestamp x}\n"],
                         ids=["bool", "int-empty", "int-underscore", "timestamp"])
def test_a_tag_whose_constructor_fails_is_a_config_error(tmp_path, text):
    assert "cannot be loaded:" in _load_error(_yaml(tmp_path, text))


def test_merge_keys_may_still_be_overridden(tmp_path):
    text = "base: &b {seed: 1, drop_last: false}\ndata:\n  <<: *b\n  seed: 2\n"
    from robustdist.config.io import load_yaml

    assert load_yaml(_yaml(tmp_path, text))["data"] == {"seed": 2, "drop_last": False}


def test_long_values_and_keys_are_cut_in_messages(tmp_path):
    for text in ("distributed:\n  backend: " + "k" * 500_000 + "\n", "data:\n  ? " + "k" * 500_000 + "\n  : 1\n"):
        message = _load_error(_yaml(tmp_path, text))
        assert len(message) < 400 and "..." in message
    with pytest.raises(ConfigError) as exc:
        HardenConfig.from_dict({"data": {"seed": 10**5000}})
    assert str(exc.value).startswith("`data.seed` is <int of about 5001 digits> (int); expected an integer")


# ----------------------------------------------------------------------------- what the path names
def test_fifo_config_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    outcome: list[BaseException | object] = []

    def load() -> None:
        try:
            outcome.append(HardenConfig.from_yaml(fifo))
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            outcome.append(e)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(timeout=10)
    if thread.is_alive():  # the regression: unblock the reader (a writer that closes gives it EOF), then fail
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        thread.join(timeout=10)
        pytest.fail("loading a FIFO config blocked")
    assert len(outcome) == 1 and isinstance(outcome[0], ConfigError), outcome
    assert str(outcome[0]) == (
        f"the YAML config '{fifo}' is a FIFO (named pipe), not a regular file; expected a regular YAML file "
        "(reading a pipe or device may block or never end). Fix: pass the path of a YAML file, or save the "
        "config to a file first."
    )


@pytest.mark.processes
def test_dev_zero_is_refused_without_reading(tmp_path):
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    # In a child with a memory cap and a timeout, so that a regression (reading forever) fails, not the machine.
    code = (
        "import resource; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
        "from robustdist.config import HardenConfig\nfrom robustdist.runtime.errors import ConfigError\n"
        "try:\n    HardenConfig.from_yaml('/dev/zero')\nexcept ConfigError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(
        "the YAML config '/dev/zero' is a character device, not a regular file; expected a regular YAML file")
    assert "Fix: pass the path of a YAML file" in out.stdout


def test_directory_and_socket_are_refused(tmp_path):
    assert "' is a directory, not a regular file; expected a regular YAML file" in _load_error(tmp_path)
    with tempfile.TemporaryDirectory(dir="/tmp") as short, socket.socket(socket.AF_UNIX) as sock:
        path = os.path.join(short, "s")  # AF_UNIX paths are short; tmp_path may be too long
        sock.bind(path)
        assert f"the YAML config '{path}' is a socket, not a regular file" in _load_error(path)


def test_file_over_the_size_bound_is_refused_before_reading(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_bytes(b"#" * (MAX_YAML_BYTES + 1))
    assert _load_error(path) == (
        f"the YAML config '{path}' is {MAX_YAML_BYTES + 1} bytes; expected at most {MAX_YAML_BYTES} bytes (1 MiB). "
        "Fix: pass the right file; a robustdist config holds only its four sections and is a few hundred bytes."
    )


def test_symlink_to_a_regular_file_is_fine(tmp_path):
    target = _yaml(tmp_path, "data:\n  seed: 3\n", name="real.yaml")
    link = tmp_path / "link.yaml"
    link.symlink_to(target)
    assert HardenConfig.from_yaml(link).data.seed == 3


def test_not_utf8_is_a_config_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"data:\n  seed: \xff\n")
    assert "cannot read the YAML config" in _load_error(path)
    assert "Fix: pass the path of a readable UTF-8 YAML file." in _load_error(path)


# ----------------------------------------------------------------------------- ROBUSTDIST_* overrides
@pytest.mark.parametrize(
    ("var", "value", "expected"),
    [
        ("ROBUSTDIST_DATA_SEED", HUGE, "expected an integer >= 0 and <= 9223372036854775807."),
        ("ROBUSTDIST_DATA_SEED", "-1", "expected an integer >= 0"),
        ("ROBUSTDIST_CHECKPOINT_EVERY_N_STEPS", HUGE, "expected None or an integer >= 1."),
        ("ROBUSTDIST_DISTRIBUTED_TIMEOUT", "1e999", "expected a positive number of seconds"),
        ("ROBUSTDIST_DISTRIBUTED_TIMEOUT", "nan", "expected a positive number of seconds"),
        ("ROBUSTDIST_DISTRIBUTED_TIMEOUT", "-inf", "expected a positive number of seconds"),
        ("ROBUSTDIST_DISTRIBUTED_TIMEOUT", "1" * 5000, "expected a positive number of seconds"),
        ("ROBUSTDIST_HEALTH_HANG_TIMEOUT", "1e999", "expected None or a positive number of seconds"),
        ("ROBUSTDIST_DISTRIBUTED_BACKEND", "n" * 100_000, "expected one of 'auto', 'nccl', 'gloo'."),
        ("ROBUSTDIST_CHECKPOINT_DIR", "d" * 100_000,
         "expected None or a non-empty filesystem path (str or os.PathLike) of at most 4096 characters."),
        ("ROBUSTDIST_DATA_" + "X" * 100_000, "1", "names no field of config section `data`. Valid fields:"),
    ],
)
def test_env_overrides_refuse_huge_and_non_finite_values_briefly(var, value, expected):
    start = time.monotonic()
    with pytest.raises(ConfigError) as exc:
        HardenConfig.from_env(environ={var: value})
    assert time.monotonic() - start < 5
    assert expected in str(exc.value) and len(str(exc.value)) < 500
    assert "ROBUSTDIST_" in str(exc.value)


numbers_text = st.one_of(
    st.integers(-(2**80), 2**80).map(str), st.just(HUGE), st.just("-" + HUGE), st.text(max_size=12),
    st.sampled_from(["1e999", "-1e999", "nan", "inf", "1_000", " 7 ", "0x10", "1.5", ""]),
)


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(["ROBUSTDIST_DATA_SEED", "ROBUSTDIST_DISTRIBUTED_TIMEOUT",
                                        "ROBUSTDIST_HEALTH_HANG_TIMEOUT", "ROBUSTDIST_CHECKPOINT_KEEP_LAST",
                                        "ROBUSTDIST_CHECKPOINT_EVERY_N_STEPS", "ROBUSTDIST_HEALTH_INTERVAL_STEPS"]),
                       numbers_text, max_size=3))
def test_any_numeric_env_gives_a_short_config_error_or_a_valid_config(environ):
    try:
        cfg = HardenConfig.from_env(environ=environ)
    except ConfigError as e:
        assert "ROBUSTDIST_" in str(e) and len(str(e)) < 500
        return
    assert isinstance(cfg, HardenConfig)


# ----------------------------------------------------------------------------- launcher variables
TORCH_BASE = {"RANK": 0, "WORLD_SIZE": 1}
SLURM_BASE = {"SLURM_PROCID": 0, "SLURM_NTASKS": 1}
RANK_VARS = [("RANK", TORCH_BASE), ("LOCAL_RANK", TORCH_BASE), ("GROUP_RANK", TORCH_BASE), ("NODE_RANK", TORCH_BASE),
             ("SLURM_PROCID", SLURM_BASE), ("SLURM_LOCALID", SLURM_BASE), ("SLURM_NODEID", SLURM_BASE)]
SIZE_VARS = [("WORLD_SIZE", TORCH_BASE), ("LOCAL_WORLD_SIZE", TORCH_BASE), ("GROUP_WORLD_SIZE", TORCH_BASE),
             ("SLURM_NTASKS", SLURM_BASE), ("SLURM_NNODES", SLURM_BASE), ("SLURM_NTASKS_PER_NODE", SLURM_BASE)]


def _topology_error(mp, **env) -> TopologyError:
    _set(mp, **env)
    start = time.monotonic()
    with pytest.raises(TopologyError) as exc:
        detect_topology()
    assert time.monotonic() - start < 5
    return exc.value


@pytest.mark.parametrize(("var", "base"), RANK_VARS)
@pytest.mark.parametrize("value", ["-1", str(2**24), HUGE])
def test_every_rank_variable_is_range_checked(clean_env, var, base, value):
    message = str(_topology_error(clean_env, **{**base, var: value}))
    assert f"{var}='{value[:40]}'" in message
    assert ("is out of range; expected an integer in 0..16777215 (a rank or id counts from 0). "
            f"Fix: unset {var}, or let the launcher set it") in message
    assert len(message) < 400


@pytest.mark.parametrize(("var", "base"), SIZE_VARS)
@pytest.mark.parametrize("value", ["0", "-3", str(2**24 + 1), HUGE])
def test_every_size_variable_is_range_checked(clean_env, var, base, value):
    message = str(_topology_error(clean_env, **{**base, var: value}))
    assert f"{var}='{value[:40]}'" in message
    assert ("is out of range; expected an integer in 1..16777216 (a size or count is at least 1). "
            f"Fix: unset {var}, or let the launcher set it") in message


def test_largest_accepted_values(clean_env, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _set(clean_env, RANK=2**24 - 1, WORLD_SIZE=2**24, LOCAL_WORLD_SIZE=8, TORCHELASTIC_RUN_ID="x")
    topo = detect_topology()
    assert (topo.rank, topo.world_size, topo.local_rank, topo.node_rank, topo.num_nodes) == (
        2**24 - 1, 2**24, 7, 2**21 - 1, 2**21)


def test_local_world_size_zero_is_not_a_zero_division(clean_env):
    error = _topology_error(clean_env, RANK=0, WORLD_SIZE=2, LOCAL_WORLD_SIZE=0)
    assert str(error).startswith("[rank 0] LOCAL_WORLD_SIZE='0' is out of range; expected an integer in 1..16777216")


@pytest.mark.parametrize(
    ("spec", "what"),
    [("0", "task count '0'"), ("2,0", "task count '0'"), ("1(x1000000000000)", "repeat (xN) '1000000000000'"),
     ("4(x0)", "repeat (xN) '0'"), ("1(x" + HUGE + ")", "repeat (xN) '" + "9" * 20 + "'..."),
     ("2(x16777217)", "repeat (xN) '16777217'")],
)
def test_slurm_tasks_per_node_counts_are_checked_not_expanded(clean_env, spec, what):
    error = _topology_error(clean_env, SLURM_PROCID=0, SLURM_NTASKS=2, SLURM_NODEID=0, SLURM_NNODES=2,
                            SLURM_TASKS_PER_NODE=spec)
    message = str(error)
    assert message.startswith("[rank 0] SLURM_TASKS_PER_NODE=")
    assert (f"has the {what}; expected every task count and (xN) repeat in 1..16777216. "
            "Fix: unset SLURM_TASKS_PER_NODE, or start the job with srun, which sets it") in message


def test_slurm_tasks_per_node_walks_groups_arithmetically(clean_env):
    _set(clean_env, SLURM_PROCID=8, SLURM_NTASKS=9, SLURM_LOCALID=0, SLURM_NNODES=4, SLURM_NODEID=3,
         SLURM_TASKS_PER_NODE="4,2(x2),1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert detect_topology().local_world_size == 1


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({**TORCH_BASE, "GROUP_RANK": 7, "GROUP_WORLD_SIZE": 2},
         "[rank 0] GROUP_RANK=7 but GROUP_WORLD_SIZE=2; expected GROUP_RANK < GROUP_WORLD_SIZE (node ranks count "
         "from 0). Fix: give each node a distinct rank below the node count (torchrun --node_rank < --nnodes)."),
        ({**TORCH_BASE, "NODE_RANK": 2, "GROUP_WORLD_SIZE": 2}, "[rank 0] NODE_RANK=2 but GROUP_WORLD_SIZE=2;"),
        ({**SLURM_BASE, "SLURM_NODEID": 3, "SLURM_NNODES": 2},
         "[rank 0] SLURM_NODEID=3 but SLURM_NNODES=2; expected SLURM_NODEID < SLURM_NNODES (node ranks count from "
         "0). Fix: unset the stale SLURM_* variables, or start the job with srun, which sets them."),
    ],
)
def test_node_rank_must_be_below_the_node_count(clean_env, env, message):
    assert message in str(_topology_error(clean_env, **env))


def test_slurm_nodeid_minus_one(clean_env):
    message = str(_topology_error(clean_env, **SLURM_BASE, SLURM_NODEID=-1))
    assert message.startswith("[rank 0] SLURM_NODEID='-1' is out of range; expected an integer in 0..16777215")


def test_huge_master_port_and_visible_devices(clean_env):
    message = str(_topology_error(clean_env, RANK=0, WORLD_SIZE=2, MASTER_PORT=HUGE))
    assert message.startswith(f"[rank 0] MASTER_PORT='{'9' * 40}'... is not a TCP port; expected an integer in "
                              "1..65535. Fix: set MASTER_PORT")
    assert parse_visible_devices(HUGE) == ()
    assert parse_visible_devices("0,1," + HUGE + ",2") == (0, 1)


def _slurm_spec():
    group = st.tuples(st.integers(-1, 2**25).map(str) | st.just(HUGE),
                      st.none() | st.integers(-1, 2**41).map(str) | st.just(HUGE))
    return st.lists(group, min_size=1, max_size=4).map(
        lambda groups: ",".join(c if r is None else f"{c}(x{r})" for c, r in groups))


env_values = st.one_of(
    st.integers(-3, 20).map(str), st.integers(-(2**70), 2**70).map(str), st.just(HUGE), st.just("-" + HUGE),
    st.sampled_from(["0", "-0", "+2", " 3 ", "", "1e3", "0x10", "٣"]), st.text(max_size=6),
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from([v for v in LAUNCHER_VARS if v != "SLURM_TASKS_PER_NODE"]), env_values),
       st.none() | _slurm_spec() | st.text(max_size=12))
def test_any_launcher_env_gives_a_topology_or_a_topology_error(environ, spec):
    if spec is not None:
        environ = {**environ, "SLURM_TASKS_PER_NODE": spec}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            topo = detect_topology(environ=environ)
    except TopologyError as e:
        assert "Fix:" in str(e) and len(str(e)) < 600
        return
    assert isinstance(topo, Topology)
    assert 0 <= topo.rank < topo.world_size <= 2**24
    assert 0 <= topo.local_rank < topo.local_world_size <= 2**24
    assert topo.node_rank >= 0 and topo.num_nodes >= 1


def test_show_is_bounded_for_any_shape():
    loop: list[object] = []
    loop.append(loop)
    assert v.show(loop) == "[[[[...]]]] (list)"
    assert v.show("x" * 10**6) == f"'{'x' * 27}...{'x' * 28}' (str)"
    assert v.show(b"\0" * 10**6).endswith("... (bytes)") and len(v.show(b"\0" * 10**6)) < 100
    assert v.show({i: i for i in range(10**5)}) == "{0: 0, 1: 1, 2: 2, 3: 3, ...} (dict)"
