"""Reading configs from YAML files and ``ROBUSTDIST_<SECTION>_<FIELD>`` environment variables."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from robustdist import _validate as v
from robustdist.errors import ConfigError, MissingDependencyError

ENV_PREFIX = "ROBUSTDIST_"


def load_yaml(path: str | os.PathLike[str]) -> Any:
    """Parse a YAML file with ``yaml.safe_load``; an empty file means "all defaults"."""
    try:
        import yaml
    except ImportError as e:
        raise MissingDependencyError(
            f"reading the YAML config {os.fspath(path)!r} needs PyYAML, which is not installed. "
            "Fix: pip install 'robustdist[yaml]', or pass the config as a dict."
        ) from e
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError, TypeError, ValueError) as e:
        raise ConfigError(
            f"cannot read the YAML config {v.show(path)}: {e}. Fix: pass the path of a readable UTF-8 YAML file."
        ) from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"the YAML config {os.fspath(path)!r} does not parse: {e}. Fix: correct the YAML syntax.") from e
    return {} if data is None else data


def env_overrides(environ: Mapping[str, str], sections: Mapping[str, type]) -> dict[str, dict[str, Any]]:
    """Parse every ``ROBUSTDIST_<SECTION>_<FIELD>`` variable whose section exists into typed values.

    Variables with the prefix but another second word (e.g. ``ROBUSTDIST_LOG_LEVEL``) are not config and are
    left alone; an unknown field inside a known section is an error, with a "did you mean" hint.
    """
    out: dict[str, dict[str, Any]] = {}
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX):
            continue
        section, _, name = var[len(ENV_PREFIX):].partition("_")
        section = section.lower()
        if section not in sections:
            continue
        fields = {f.name: f for f in dataclasses.fields(sections[section])}
        key = name.lower()
        if key not in fields:
            hint = v.suggest(key, fields)
            did_you_mean = f"; did you mean {ENV_PREFIX}{section.upper()}_{hint.upper()}?" if hint else ""
            raise ConfigError(
                f"environment variable {var} names no field of config section `{section}`{did_you_mean}. "
                f"Valid fields: {', '.join(fields)}."
            )
        out.setdefault(section, {})[key] = fields[key].metadata["kind"].parse(f"{section}.{key} (from ${var})", environ[var])
    return out
