"""Lazy package exports: a package names its public names here and imports them on first use.

A package ``__init__`` that imported its modules eagerly would import torch (and every dependency of every
module) whenever any one of its modules is imported, and the Ray worker hook must import neither torch nor
ray. So each package's ``__init__`` calls :func:`attach` with a table ``{name: module}``; ``from
robustdist.health import StepGuard`` then imports :mod:`robustdist.health.step_guard` at that moment, once.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["attach"]


def attach(package: str, table: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for ``package``, exporting each ``name`` of ``table`` from its module."""
    exports = dict(table)

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # later look-ups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__, sorted(exports)
