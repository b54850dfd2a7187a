"""One canary per private torch or Ray API robustdist uses: each resolves on the installed version,
or fails with a message naming the API, the installed version and what robustdist needs it for. The version
matrix (``make test-matrix``) runs these in every lane."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest

from robustdist.runtime.private_api import PrivateAPI, canary


RUNTIME = Path(__file__).resolve().parents[2] / "robustdist" / "runtime"
FENCES = sorted(p.stem for p in RUNTIME.glob("_*_compat.py"))  # one per area; Ray's are named _ray..., _tune...


def _registry(module: str) -> tuple[PrivateAPI, ...]:
    return importlib.import_module(f"robustdist.runtime.{module}").PRIVATE_APIS


TORCH = sum((_registry(f) for f in FENCES if not f.startswith(("_ray", "_tune"))), ())
RAY = sum((_registry(f) for f in FENCES if f.startswith(("_ray", "_tune"))), ()) \
    if importlib.util.find_spec("ray") else ()


def test_every_area_has_its_fence():
    assert {"_torch_compat", "_serialization_compat", "_amp_compat", "_data_compat", "_elastic_compat",
            "_ray_compat"} <= set(FENCES), FENCES


@pytest.mark.parametrize("api", TORCH + RAY, ids=lambda api: api.name[:70])
def test_private_api_still_resolves(api):
    problem = canary(api)
    assert problem is None, problem


def test_every_entry_says_what_it_is_for_and_where_it_was_verified():
    for api in TORCH + RAY:
        assert api.dependency in ("torch", "ray") and api.used_for and api.verified.startswith(("torch", "Ray")), api


def test_a_moved_api_is_named_with_the_installed_version():
    from importlib import metadata

    gone = PrivateAPI("torch._robustdist_canary_never_exists", "torch", "nothing (a canary's own check)",
                      "torch 2.13.0", lambda: getattr(__import__("torch"), "_robustdist_canary_never_exists"))
    message = canary(gone)
    assert message is not None and "torch._robustdist_canary_never_exists" in message
    assert metadata.version("torch") in message and "verified on torch 2.13.0" in message
    assert canary(PrivateAPI("x", "torch", "y", "torch 2.13.0", lambda: None)).startswith("private API x is missing")


def test_an_api_newer_than_the_installed_version_is_absent_by_design():
    from importlib import metadata

    future = PrivateAPI("torch.not_yet", "torch", "a feature newer releases have", "torch 99.0", lambda: None,
                        since="99.0")
    assert canary(future) is None
    past = PrivateAPI("torch.gone", "torch", "a feature", "torch 1.0", lambda: None, since="1.0")
    assert f"missing in torch {metadata.version('torch')}" in canary(past)


def test_a_dcp_reader_without_slice_file_is_refused_not_loaded_unchecked():
    """If a torch drops ``FileSystemReader._slice_file`` (where robustdist checks each slice before DCP unpickles
    it), the sharded loader must refuse rather than read the slices unchecked."""
    from robustdist.runtime import _serialization_compat
    from robustdist.runtime.errors import CheckpointError

    class ReaderWithoutSliceFile:
        pass

    with pytest.raises(CheckpointError, match="no FileSystemReader._slice_file.*refused rather than loading"):
        _serialization_compat.reader_checking_slices(ReaderWithoutSliceFile, lambda *a: None)

    seen = []

    class Reader:
        def _slice_file(self, file, sinfo):
            return (file, sinfo)

    checking = _serialization_compat.reader_checking_slices(Reader, lambda reader, file, sinfo: seen.append((file, sinfo)))
    assert checking()._slice_file("f", "s") == ("f", "s") and seen == [("f", "s")]
