"""Malformed manifests and payloads are CheckpointCorruptErrors naming the file, and load() falls back to the
older step exactly as for a checksum failure: never a TypeError, KeyError or RecursionError from deep
inside. Hypothesis fuzzes both."""

from __future__ import annotations

import copy
import io
import json
import pickle
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from robustdist.checkpoint import AtomicCheckpointer
from robustdist.runtime.errors import CheckpointError, RobustDistWarning
from tests.security._forge import STEP1, STEP2, forge, manifest_of, state_for, two_steps, write_manifest


def _load(directory):
    """Load with a live tensor entry; returns (step, weights, warnings)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with AtomicCheckpointer(directory) as ckpt:
            loaded = ckpt.load(state={"weights": torch.zeros(16)})
    return loaded.step, loaded.state["weights"], [str(w.message) for w in caught if w.category is RobustDistWarning]


def _mutate(manifest, path, value):
    out = copy.deepcopy(manifest)
    node = out
    for key in path[:-1]:
        node = node[key]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


_DELETE = object()
MANIFEST_CASES = [
    (("files",), ["replicated.pt"], "files is list; expected an object"),
    (("files",), "replicated.pt", "files is str; expected an object"),
    (("files",), None, "files is NoneType; expected an object"),
    (("files", "replicated.pt", "size"), _DELETE, "expected {'size': int >= 0"),
    (("files", "replicated.pt", "size"), -1, "expected {'size': int >= 0"),
    (("files", "replicated.pt", "size"), 1.5, "expected {'size': int >= 0"),
    (("files", "replicated.pt", "size"), True, "expected {'size': int >= 0"),
    (("files", "replicated.pt", "crc32"), "zz", "the crc32 of 'replicated.pt' is 'zz'; expected lowercase hex"),
    (("files", "replicated.pt", "crc32"), _DELETE, "the manifest records no checksum for replicated.pt"),
    (("files", "replicated.pt"), [], "the entry for 'replicated.pt' is []"),
    (("entries",), [], "entries is list; expected an object of entry kinds"),
    (("entries", "weights"), "weird", "entry 'weights' has kind 'weird'; expected one of module, stateful, data"),
    (("entries", "weights"), None, "entry 'weights' has kind None"),
    (("format",), 2, "not a robustdist manifest of format 1"),
    (("format",), True, "not a robustdist manifest of format 1"),
    (("format",), _DELETE, "not a robustdist manifest of format 1"),
    (("step",), 1, "step is 1; expected 2"),
    (("step",), "2", "step is '2'; expected 2"),
    (("world_size",), 0, "world_size is 0; expected an int >= 1"),
    (("metadata",), [], "metadata is not an object"),
    (("config_fingerprint",), 7, "config_fingerprint is 7"),
]


@pytest.mark.parametrize(("path", "value", "reason"), MANIFEST_CASES)
def test_malformed_manifest_falls_back(tmp_path, path, value, reason):
    step2 = two_steps(tmp_path)
    write_manifest(step2, _mutate(manifest_of(step2), path, value))
    step, weights, warned = _load(tmp_path)
    assert step == 1 and torch.equal(weights, state_for(1)["weights"])
    assert len(warned) == 1 and "manifest.json: " in warned[0] and reason in warned[0], warned


@pytest.mark.parametrize(("text", "reason"), [
    (b"", "unreadable"), (b"[" * 100_000, "unreadable"), (b"\xff\xfe", "unreadable"), (b"[]", "is a JSON list"),
    (b'{"format": 1, "step": 2, "world_size": 1, "files": {"replicated.pt": {"size": 1' + b"0" * 5000 + b"}}}",
     "unreadable"),
    (b"null", "is a JSON NoneType"),
    # UTF-8 only, as robustdist writes it: a byte-order mark, UTF-16 or a lone surrogate is never decoded by guess
    (b'\xef\xbb\xbf{"format": 1}', "unreadable (not JSON (JSONDecodeError: Unexpected UTF-8 BOM"),
    ('{"format": 1}'.encode("utf-16"), "unreadable (not JSON (UnicodeDecodeError: 'utf-8' codec"),
    (b'{"format": 1, "files": {"\xed\xa0\x80": {}}}', "unreadable (not JSON (UnicodeDecodeError: 'utf-8' codec"),
])
def test_manifest_that_is_not_a_json_object_falls_back(tmp_path, text, reason):
    step2 = two_steps(tmp_path)
    (step2 / "manifest.json").write_bytes(text)
    step, _, warned = _load(tmp_path)
    assert step == 1 and reason in warned[0]


def _torch_bytes(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


PAYLOAD_CASES = [
    ("replicated.pt", b"", "not a torch zip file"),
    ("replicated.pt", b"garbage" * 10, "not a torch zip file"),
    ("replicated.pt", _torch_bytes([1, 2, 3]), "holds a list; expected a dict of entries"),
    ("replicated.pt", _torch_bytes({"meta": {"step": 2}}), "lacks the entry 'weights' its manifest lists"),
    ("rank_00000.pt", _torch_bytes({"rng": {}, "per_rank": {}}), "the saved RNG state is malformed (python:"),
    ("rank_00000.pt", _torch_bytes(torch.zeros(3)), "expected a dict with 'rng' and 'per_rank' entries"),
    ("rank_00000.pt", _torch_bytes({"per_rank": []}), "expected a dict with 'rng' and 'per_rank' entries"),
    # plain data goes to the user as loaded: a 2 KB file holding a (2**18, 2**18) view over one float is ~275 GB
    # at its first use
    ("replicated.pt", _torch_bytes({"weights": torch.zeros(1).expand(2**18, 2**18), "meta": {"step": 2}}),
     "entry 'weights' is an expanded tensor view (shape (262144, 262144), strides (0, 0)"),
    ("replicated.pt", _torch_bytes({"weights": torch.zeros(16), "meta": {"step": [torch.ones(2).expand(4, 2)]}}),
     "entry 'meta'['step'][0] is an expanded tensor view"),
    ("replicated.pt", _torch_bytes({"weights": torch.as_strided(torch.quantize_per_tensor(
        torch.zeros(1), 0.1, 0, torch.quint8), (1 << 28,), (0,)), "meta": {"step": 2}}),
     "entry 'weights' is an expanded tensor view (shape (268435456,)"),
    # a pickle before a valid zip: zipfile finds the zip at the end, torch.load would unpickle the prefix instead
    ("replicated.pt", pickle.dumps({"meta": {"step": 2}}, protocol=2) + _torch_bytes({"meta": {"step": 2}}),
     "it does not start with a zip header"),
]


@pytest.mark.parametrize(("target", "data", "reason"), PAYLOAD_CASES)
def test_malformed_payload_falls_back(tmp_path, target, data, reason):
    step2 = two_steps(tmp_path)
    forge(step2, target, data)
    step, weights, warned = _load(tmp_path)
    assert step == 1 and torch.equal(weights, state_for(1)["weights"])
    assert f"{target}: " in warned[0] and reason in warned[0], warned


def test_an_expanded_view_in_plain_data_is_refused_at_save_as_at_load(tmp_path):
    with AtomicCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, state_for(1))
        with pytest.raises(CheckpointError, match=r"state\['meta'\]\['cache'\] is an expanded tensor view .*"
                                                  r"Fix: save value\.clone\(\)"):
            ckpt.save(2, {"weights": torch.zeros(16), "meta": {"cache": torch.zeros(1).expand(64, 64)}})
        ckpt.save(3, {"weights": torch.zeros(16), "meta": {"cache": torch.zeros(1).expand(64, 64).clone()}})

        class Holder:  # an object's state goes to its own load_state_dict: load refuses views there too
            def state_dict(self):
                return {"buf": torch.zeros(1).expand(64)}

            def load_state_dict(self, state):
                pass

        with pytest.raises(CheckpointError, match=r"state\['holder'\]\['buf'\] is an expanded tensor view"):
            ckpt.save(4, {"weights": torch.zeros(16), "holder": Holder()})
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == [STEP1, "step_0000000003"]


def test_a_payload_that_is_a_directory_falls_back(tmp_path):
    step2 = two_steps(tmp_path)
    (step2 / "replicated.pt").unlink()
    (step2 / "replicated.pt").mkdir()
    step, _, warned = _load(tmp_path)
    assert step == 1 and "replicated.pt: is a directory; expected a regular file" in warned[0]


def test_a_module_entry_that_is_not_a_state_dict_falls_back_before_touching_the_model(tmp_path):
    model = torch.nn.Linear(2, 2)
    with AtomicCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": model})
        ckpt.save(2, {"model": model})
    forge(tmp_path / STEP2, "replicated.pt", _torch_bytes({"model": [1, 2]}))
    with pytest.warns(RobustDistWarning, match="entry 'model' should be a model state dict"):
        with AtomicCheckpointer(tmp_path) as ckpt:
            assert ckpt.load(state={"model": torch.nn.Linear(2, 2)}).step == 1


# ------------------------------------------------------------------ fuzzing
_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                     max_leaves=8)
_keys = st.sampled_from(["format", "step", "world_size", "files", "entries", "metadata", "config_fingerprint"])


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    directory = tmp_path_factory.mktemp("template")
    step2 = two_steps(directory)
    return directory, manifest_of(step2)


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(replacements=st.lists(st.tuples(_keys, _json), min_size=1, max_size=3),
       file_edits=st.dictionaries(st.sampled_from(["replicated.pt", "rank_00000.pt", "../x", "sharded/.metadata"]),
                                  _json, max_size=2))
def test_fuzzed_manifests_load_or_fall_back(template, tmp_path_factory, replacements, file_edits):
    import shutil

    source, manifest = template
    directory = tmp_path_factory.mktemp("fuzz")
    shutil.copytree(source, directory, dirs_exist_ok=True)
    forged = copy.deepcopy(manifest)
    for key, value in replacements:
        forged[key] = value
    if isinstance(forged.get("files"), dict):
        forged["files"].update(file_edits)
    (directory / STEP2 / "manifest.json").write_text(json.dumps(forged))
    start = time.monotonic()
    try:
        step, weights, warned = _load(directory)
    except CheckpointError as e:  # only when step 1 cannot load either: it always can here
        raise AssertionError(f"no fallback: {e}") from e
    assert time.monotonic() - start < 10
    assert torch.equal(weights, state_for(step)["weights"]) and step in (1, 2)
    assert step == 2 or "failed verification" in warned[0]


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(target=st.sampled_from(["replicated.pt", "rank_00000.pt"]),
       data=st.one_of(st.binary(max_size=300), _json.map(_torch_bytes),
                      st.builds(lambda cut: cut, st.integers(0, 2000))))
def test_fuzzed_payloads_load_or_fall_back(template, tmp_path_factory, target, data):
    import shutil

    source, _ = template
    directory = tmp_path_factory.mktemp("fuzzp")
    shutil.copytree(source, directory, dirs_exist_ok=True)
    original = (directory / STEP2 / target).read_bytes()
    if isinstance(data, int):  # a truncated (but re-checksummed) real payload
        data = original[: data % max(len(original), 1)]
    forge(directory / STEP2, target, data)
    step, weights, warned = _load(directory)
    assert step in (1, 2)
    if step == 1:
        assert torch.equal(weights, state_for(1)["weights"]) and "failed verification" in warned[0]


@pytest.mark.parametrize("bad", [{"batches": -1}, {"batches": 10**6}, {"iterations": "3"}, {"rng": {"torch": 1}}])
def test_harden_resume_falls_back_past_a_malformed_loader_position(tmp_path, monkeypatch, bad):
    """The way a user's script resumes: harden(), then resume(); the newest step's loader state is forged."""
    from robustdist import harden
    from tests import _training as tr

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    cfg = {"checkpoint": {"dir": str(tmp_path), "every_n_steps": 5}, "health": {"hang_timeout": None}}
    with harden(tr.make_model(), tr.make_loader(), cfg) as h:
        opt = torch.optim.SGD(h.model.parameters(), lr=0.1)
        tr.loop(h, opt, 13)
    step_dir = tmp_path / "step_0000000010"
    payload = torch.load(step_dir / "rank_00000.pt", weights_only=True)
    payload["per_rank"]["loader"].update(bad)
    forge(step_dir, "rank_00000.pt", _torch_bytes(payload))
    with harden(tr.make_model(), tr.make_loader(), cfg) as h:
        opt = torch.optim.SGD(h.model.parameters(), lr=0.1)
        with pytest.warns(RobustDistWarning, match=r"checkpoint step 10 failed verification \(rank 0: .*loader state"):
            assert h.resume(optimizer=opt) == 5


def _save_two_steps(rank, directory):
    with AtomicCheckpointer(directory) as ckpt:
        ckpt.save(1, state_for(1))
        ckpt.save(2, state_for(2))


def _load_on_every_rank(rank, directory):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with AtomicCheckpointer(directory) as ckpt:
            loaded = ckpt.load(state={"weights": torch.zeros(16)})
    return loaded.step, loaded.state["weights"].tolist(), [str(w.message) for w in caught
                                                           if w.category is RobustDistWarning]


@pytest.mark.processes
def test_a_problem_only_one_rank_sees_makes_every_rank_fall_back_together(tmp_path):
    from robustdist.testing.ranks import run_ranks

    run_ranks(_save_two_steps, 2, args=(str(tmp_path),), timeout=60)
    payload = torch.load(tmp_path / STEP2 / "rank_00001.pt", weights_only=True)  # only rank 1 reads this file
    payload["rng"]["python"][0] = 1
    forge(tmp_path / STEP2, "rank_00001.pt", _torch_bytes(payload))
    out = run_ranks(_load_on_every_rank, 2, args=(str(tmp_path),), timeout=60)
    assert [step for step, _, _ in out] == [1, 1] and out[0][1] == state_for(1)["weights"].tolist()
    assert "checkpoint step 2 failed verification (rank 1: " in out[0][2][0]
    assert "rank_00001.pt: the saved RNG state is malformed (python: the generator refused it" in out[0][2][0]
