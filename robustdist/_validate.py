"""Field kinds for the config dataclasses: each checks a Python value and parses an env-var string.

A kind never lets a stdlib exception escape: whatever it is handed, it returns the normalised value or
raises :class:`~robustdist.errors.ConfigError` naming the field path, the bad value and what is accepted.
"""

from __future__ import annotations

import difflib
import math
import numbers
import os
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from robustdist.errors import ConfigError

MAX_SECONDS = 1e9  # ~31 years: larger values overflow timedelta arithmetic in torch and threading

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_NONE = {"", "none", "null"}


def show(value: Any, limit: int = 80) -> str:
    """``repr(value)`` with its type, truncated; never raises."""
    try:
        text = repr(value)
    except Exception:
        text = "<unrepresentable>"
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{text} ({type(value).__name__})"


def suggest(word: str, candidates: Iterable[str]) -> str | None:
    """The closest candidate to ``word``, for "did you mean" hints, or None."""
    matches = difflib.get_close_matches(word.lower(), list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


class Kind:
    """What a field accepts. ``describe`` is the "expected ..." text of error messages."""

    describe = "a value"

    def check(self, path: str, value: Any) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError

    def parse(self, path: str, text: str) -> Any:
        """Turn an environment-variable string into a value, then check it."""
        return self.check(path, text)

    def fail(self, path: str, value: Any, extra: str = "") -> ConfigError:
        return ConfigError(f"`{path}` is {show(value)}; expected {self.describe}.{extra}")


class choice(Kind):
    def __init__(self, *values: str):
        self.values = values
        self.describe = "one of " + ", ".join(repr(x) for x in values)

    def check(self, path: str, value: Any) -> Any:
        if isinstance(value, str) and value in self.values:
            return value
        hint = suggest(value, self.values) if isinstance(value, str) else None
        return _raise(self.fail(path, value, f" Did you mean {hint!r}?" if hint else ""))


class boolean(Kind):
    describe = "true or false"

    def check(self, path: str, value: Any) -> Any:
        if isinstance(value, bool):
            return value
        return _raise(self.fail(path, value))

    def parse(self, path: str, text: str) -> Any:
        low = text.strip().lower()
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        return _raise(self.fail(path, text, " In the environment write 1/0, true/false, yes/no or on/off."))


class auto_or_bool(Kind):
    describe = "'auto', true or false"

    def check(self, path: str, value: Any) -> Any:
        if isinstance(value, bool) or (isinstance(value, str) and value == "auto"):
            return value
        return _raise(self.fail(path, value))

    def parse(self, path: str, text: str) -> Any:
        if text.strip().lower() == "auto":
            return "auto"
        return boolean().parse(path, text)


class integer(Kind):
    def __init__(self, *, minimum: int | None = None, maximum: int | None = None):
        self.minimum, self.maximum = minimum, maximum
        lo = "" if minimum is None else f" >= {minimum}"
        hi = "" if maximum is None else f" <= {maximum}"
        self.describe = "an integer" + lo + (" and" if lo and hi else "") + hi

    def check(self, path: str, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            return _raise(self.fail(path, value))
        value = int(value)
        if (self.minimum is not None and value < self.minimum) or (self.maximum is not None and value > self.maximum):
            return _raise(self.fail(path, value))
        return value

    def parse(self, path: str, text: str) -> Any:
        try:
            return self.check(path, int(text.strip()))
        except ValueError:
            return _raise(self.fail(path, text))


class seconds(Kind):
    describe = f"a positive number of seconds (at most {MAX_SECONDS:g}) or a datetime.timedelta"

    def check(self, path: str, value: Any) -> Any:
        if isinstance(value, timedelta):
            secs = value.total_seconds()
        elif isinstance(value, bool) or not isinstance(value, numbers.Real):
            return _raise(self.fail(path, value))
        else:
            try:
                secs = float(value)
            except (OverflowError, ValueError, TypeError):
                return _raise(self.fail(path, value))
        if not (math.isfinite(secs) and 0 < secs <= MAX_SECONDS):
            return _raise(self.fail(path, value))
        return secs

    def parse(self, path: str, text: str) -> Any:
        try:
            return self.check(path, float(text.strip()))
        except ValueError:
            return _raise(self.fail(path, text))


class url(Kind):
    def __init__(self, *schemes: str):
        self.schemes = schemes
        self.describe = "a URL starting with " + ", ".join(repr(s) for s in schemes)

    def check(self, path: str, value: Any) -> Any:
        if isinstance(value, str) and value.startswith(self.schemes) and value.strip() == value:
            return value
        return _raise(self.fail(path, value))


class path(Kind):
    describe = "a non-empty filesystem path (str or os.PathLike)"

    def check(self, path_: str, value: Any) -> Any:
        if isinstance(value, os.PathLike):
            try:
                value = os.fspath(value)
            except Exception:
                return _raise(self.fail(path_, value))
        if isinstance(value, str) and value.strip() and "\x00" not in value:
            return value
        return _raise(self.fail(path_, value))


class optional(Kind):
    def __init__(self, inner: Kind):
        self.inner = inner
        self.describe = f"None or {inner.describe}"

    def check(self, path: str, value: Any) -> Any:
        if value is None:
            return None
        try:
            return self.inner.check(path, value)
        except ConfigError:
            return _raise(self.fail(path, value))

    def parse(self, path: str, text: str) -> Any:
        if text.strip().lower() in _NONE:
            return None
        try:
            return self.inner.parse(path, text)
        except ConfigError:
            return _raise(self.fail(path, text))


def _raise(error: ConfigError) -> Any:
    raise error


def as_timedelta(value: float | timedelta) -> timedelta:
    """A timeout given as seconds or a timedelta, as a timedelta (what torch.distributed wants)."""
    return value if isinstance(value, timedelta) else timedelta(seconds=float(value))
