"""The record every private torch or Ray access carries, and its canary.

The private names robustdist uses live in fenced modules, one per area, ``robustdist/runtime/_<area>_compat.py``
(:mod:`robustdist.runtime._torch_compat` for process groups, modules and tensors; ``_serialization_compat``,
``_amp_compat``, ``_data_compat``, ``_elastic_compat``; Ray's ``_ray_compat``, ``_ray_train_compat`` and
``_tune_compat``); nothing else in the package touches one (``tests/test_private_api.py`` enforces it). Each fenced
access is listed there as a :class:`PrivateAPI`: the dotted name, the versions it was verified on (the version matrix,
``docs/status.md``), the public replacement where one exists, and a ``probe`` that resolves it on the installed version.
:func:`canary` runs the probe and says, naming the API and the installed version, when the next release has moved it.
``tests/runtime/test_private_api_canaries.py`` runs every canary in every matrix lane.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata

__all__ = ["PrivateAPI", "canary", "installed"]


@dataclass(frozen=True)
class PrivateAPI:
    """One private name of a dependency: ``name`` (dotted, as robustdist reaches it), ``dependency``
    (``"torch"`` or ``"ray"``), ``used_for`` (what robustdist needs it for, and what happens without it),
    ``verified`` (the versions the matrix ran it on), ``public`` (the public replacement, "" when the supported
    range has none), ``probe`` (resolves the name on the installed version; raises when it moved) and ``since``
    (the first version that has it, where older supported versions lack it and robustdist degrades there by
    design: "" when every supported version has it)."""

    name: str
    dependency: str
    used_for: str
    verified: str
    probe: Callable[[], object]
    public: str = ""
    since: str = ""


def installed(dependency: str) -> str:
    try:
        return metadata.version(dependency)
    except metadata.PackageNotFoundError:
        return "not installed"


def _older(found: str, since: str) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(Version(found).base_version) < Version(since)
    except InvalidVersion:
        return False


def canary(api: PrivateAPI) -> str | None:
    """None when ``api`` still resolves on the installed version (or is absent there by design: older than its
    ``since``); otherwise what moved, on which version."""
    if api.since and _older(installed(api.dependency), api.since):
        return None
    try:
        found = api.probe()
    except Exception as e:  # any failure to resolve is the canary's finding
        return (f"private API {api.name} moved in {api.dependency} {installed(api.dependency)} "
                f"(verified on {api.verified}): {type(e).__name__}: {e}. robustdist uses it for: {api.used_for}")
    if found is None:
        return (f"private API {api.name} is missing in {api.dependency} {installed(api.dependency)} "
                f"(verified on {api.verified}). robustdist uses it for: {api.used_for}")
    return None
