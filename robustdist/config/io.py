"""Reading configs from YAML files and ``ROBUSTDIST_<SECTION>_<FIELD>`` environment variables.

A YAML config is untrusted input, so reading one is bounded at every step:

* the path must name a regular file (a symlink to one is fine): a FIFO, a device such as ``/dev/zero``, a
  socket or a directory is refused after a non-blocking open, before anything is read;
* at most :data:`MAX_YAML_BYTES` are read;
* the YAML is composed by a ``yaml.SafeLoader`` subclass that counts while it builds the node graph and stops
  at :data:`MAX_YAML_DEPTH` levels of nesting, :data:`MAX_YAML_ALIASES` alias uses (``*name``) and
  :data:`MAX_YAML_NODES` nodes with every alias expanded (a "billion laughs" file of a few hundred bytes
  expands to billions), and refuses integers longer than :data:`MAX_YAML_INT_DIGITS` digits and a key given
  twice in one mapping (YAML keeps the last silently: ``timeout: 600`` then ``timeout: 0.001`` loads 0.001, and a
  second ``checkpoint:`` section replaces the first).

Exceeding a bound, or any error inside PyYAML, is a :class:`~robustdist.runtime.errors.ConfigError` naming the file.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import stat
from collections.abc import Mapping
from typing import Any

from robustdist.config import validate as v
from robustdist.runtime.errors import ConfigError, MissingDependencyError

ENV_PREFIX = "ROBUSTDIST_"
MAX_YAML_BYTES = 1 << 20  # 1 MiB; a full robustdist config is well under 2 KiB
MAX_YAML_DEPTH = 64  # nesting levels; a config needs 2 (section, field)
MAX_YAML_ALIASES = 100  # alias uses (*name) in one file
MAX_YAML_NODES = 10_000  # values (nodes) with every alias expanded; a full config has ~40
MAX_YAML_INT_DIGITS = 30  # no field takes more (seeds are < 2**63, 19 digits)
_MAX_DETAIL = 300  # characters of a PyYAML / OS error quoted in a message

_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class _Limit(Exception):
    """A bound of the YAML loader was exceeded; ``str()`` is the middle of a ConfigError message."""


def _shown(path: Any) -> str:
    """The path for a message: its repr, cut to 200 characters before formatting."""
    try:
        text = os.fspath(path)
    except TypeError:
        return v.show(path)
    return repr(text) if len(text) <= 200 else repr(text[:200]) + "..."


def _detail(e: BaseException) -> str:
    try:
        text = str(e) or type(e).__name__
    except Exception:
        text = type(e).__name__
    return v.cut(text, _MAX_DETAIL)


def _unreadable(shown: str, e: BaseException) -> ConfigError:
    return ConfigError(
        f"cannot read the YAML config {shown}: {_detail(e)}. Fix: pass the path of a readable UTF-8 YAML file."
    )


def _file_kind(mode: int) -> str:
    return next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")


def _check_regular(st: os.stat_result, shown: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(
            f"the YAML config {shown} is {_file_kind(st.st_mode)}, not a regular file; expected a regular YAML "
            "file (reading a pipe or device may block or never end). Fix: pass the path of a YAML file, or save "
            "the config to a file first."
        )
    if st.st_size > MAX_YAML_BYTES:
        raise ConfigError(
            f"the YAML config {shown} is {st.st_size} bytes; expected at most {MAX_YAML_BYTES} bytes (1 MiB). "
            "Fix: pass the right file; a robustdist config holds only its four sections and is a few hundred bytes."
        )


def read_config_bytes(path: str | os.PathLike[str]) -> bytes:
    """The bytes of a config file: a regular file of at most :data:`MAX_YAML_BYTES`, never blocking."""
    shown = _shown(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        before = os.stat(path)
    except (OSError, TypeError, ValueError) as e:
        raise _unreadable(shown, e) from e
    _check_regular(before, shown)  # refuse devices and FIFOs before even opening them
    try:
        fd = os.open(path, flags)
    except (OSError, TypeError, ValueError) as e:
        raise _unreadable(shown, e) from e
    try:
        _check_regular(os.fstat(fd), shown)  # the file actually opened (the path may have been swapped)
        chunks, left = [], MAX_YAML_BYTES + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as e:
        raise _unreadable(shown, e) from e
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > MAX_YAML_BYTES:  # it grew after fstat
        raise ConfigError(
            f"the YAML config {shown} holds more than {MAX_YAML_BYTES} bytes (1 MiB); expected a small file. "
            "Fix: pass the right file; a robustdist config is a few hundred bytes."
        )
    return data


@functools.lru_cache(maxsize=1)
def _loader_class() -> type:
    """``yaml.SafeLoader`` with the bounds of the module docstring (built on first use: yaml is optional)."""
    import yaml

    class BoundedSafeLoader(yaml.SafeLoader):
        def __init__(self, stream: str) -> None:
            super().__init__(stream)
            self._depth = self._aliases = self._expanded = 0
            self._weights: dict[int, int] = {}  # id(anchored node) -> its node count with aliases expanded

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                self._aliases += 1
                if self._aliases > MAX_YAML_ALIASES:
                    raise _Limit(f"uses more than {MAX_YAML_ALIASES} aliases (*name); expected at most "
                                 f"{MAX_YAML_ALIASES}. Fix: write the values out instead of reusing anchors")
                node = super().compose_node(parent, index)
                self._count(self._weights.get(id(node), 1))
                return node
            anchored, start = self.peek_event().anchor is not None, self._expanded
            self._depth += 1
            if self._depth > MAX_YAML_DEPTH:
                raise _Limit(f"nests deeper than {MAX_YAML_DEPTH} levels; expected at most {MAX_YAML_DEPTH} "
                             "(a config needs 2: section, then field). Fix: flatten the file")
            try:
                self._count(1)
                node = super().compose_node(parent, index)
            finally:
                self._depth -= 1
            if anchored:
                self._weights[id(node)] = self._expanded - start
            return node

        def _count(self, n: int) -> None:
            self._expanded += n
            if self._expanded > MAX_YAML_NODES:
                raise _Limit(f"holds more than {MAX_YAML_NODES} values, counting each alias (*name) as a copy "
                             f"of its anchor; expected at most {MAX_YAML_NODES}. Fix: pass the right file, and "
                             "remove anchors and aliases (&name, *name) that multiply the content")

        def construct_bounded_int(self, node: Any) -> Any:
            text = self.construct_scalar(node)
            digits = len(text.replace("_", "").lstrip("+-"))
            if digits > MAX_YAML_INT_DIGITS:
                raise _Limit(f"has a {digits}-digit integer at line {node.start_mark.line + 1}; expected at most "
                             f"{MAX_YAML_INT_DIGITS} digits (no config field needs more). Fix: correct that value")
            return super().construct_yaml_int(node)

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: dict[Any, int] = {}
            merged = self._merged_sections(node)
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    key = "<<"  # a merge given twice: the second replaces the first silently too
                else:
                    key = self.construct_object(key_node, deep=False)
                    if isinstance(value_node, yaml.MappingNode) and merged.get(key) is not None:
                        raise _Limit(f"replaces the section {str(key)[:80]!r} merged in with << (line "
                                     f"{merged[key]}) by the one at line {key_node.start_mark.line + 1}; a merge is "
                                     "shallow, so the merged section's other fields would be dropped silently. "
                                     "Fix: write the section once")
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: SafeLoader refuses it itself
                    continue
                if first is None:
                    seen[key] = key_node.start_mark.line + 1
                else:
                    raise _Limit(f"has the key {str(key)[:80]!r} twice in one mapping (lines {first} and "
                                 f"{key_node.start_mark.line + 1}); expected each key once (YAML would keep the "
                                 "last one silently, a second section replacing the first whole). Fix: merge the "
                                 "two into one")
            return super().construct_mapping(node, deep=deep)

        def _merged_sections(self, node: Any) -> dict[Any, int]:
            """Keys whose value is a mapping, in what this mapping merges in with ``<<`` -> their line."""
            found: dict[Any, int] = {}
            for key_node, value_node in node.value:
                if key_node.tag != "tag:yaml.org,2002:merge":
                    continue
                sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
                for source in sources:
                    if not isinstance(source, yaml.MappingNode):
                        continue
                    for k, v in source.value:
                        if isinstance(v, yaml.MappingNode) and k.tag != "tag:yaml.org,2002:merge":
                            try:
                                found[self.construct_object(k, deep=False)] = k.start_mark.line + 1
                            except TypeError:
                                continue
            return found

    BoundedSafeLoader.add_constructor("tag:yaml.org,2002:int", BoundedSafeLoader.construct_bounded_int)
    return BoundedSafeLoader


def load_yaml(path: str | os.PathLike[str]) -> Any:
    """Parse a YAML config file within the bounds of the module docstring; an empty file means "all defaults"."""
    try:
        import yaml
    except ImportError as e:
        raise MissingDependencyError(
            f"reading the YAML config {_shown(path)} needs PyYAML, which is not installed. "
            "Fix: pip install 'robustdist[yaml]', or pass the config as a dict."
        ) from e
    shown = _shown(path)
    raw = read_config_bytes(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _unreadable(shown, e) from e
    loader = None
    try:
        loader = _loader_class()(text)  # its reader already checks the text
        data = loader.get_single_data()
    except _Limit as e:
        raise ConfigError(f"the YAML config {shown} {e}.") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"the YAML config {shown} does not parse: {_detail(e)}. Fix: correct the YAML syntax.") from e
    except Exception as e:  # RecursionError, ValueError, and what a crafted tag makes a constructor raise
        raise ConfigError(
            f"the YAML config {shown} cannot be loaded: {type(e).__name__}: {_detail(e)}; expected a small YAML "
            "mapping of config sections. Fix: correct the value the error names."
        ) from e
    finally:
        if loader is not None:
            loader.dispose()
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
                f"environment variable {v.cut(var, 100)} names no field of config section `{section}`{did_you_mean}. "
                f"Valid fields: {', '.join(fields)}."
            )
        out.setdefault(section, {})[key] = fields[key].metadata["kind"].parse(f"{section}.{key} (from ${var})", environ[var])
    return out
