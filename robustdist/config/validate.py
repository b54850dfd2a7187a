"""Field kinds for the config dataclasses: each checks a Python value and parses an env-var string.

A kind never lets a stdlib exception escape: whatever it is handed, it returns the normalised value or
raises :class:`~robustdist.runtime.errors.ConfigError` naming the field path, the bad value and what is accepted.
"""

from __future__ import annotations

import builtins
import difflib
import math
import numbers
import os
import re
import reprlib
from collections.abc import Iterable, Mapping
from datetime import timedelta
from itertools import islice
from typing import Any

from robustdist.runtime.errors import ConfigError

MAX_SECONDS = 1e9  # ~31 years: larger values overflow timedelta arithmetic in torch and threading
MAX_NUMBER_TEXT = 40  # characters of an env-var number: no field needs more, and int() of long strings is slow
MAX_PATH = 4096  # characters: Linux's PATH_MAX; a longer path fails at the first open anyway
MAX_SUGGEST = 64  # longer words get no "did you mean" hint (difflib is quadratic in the word length)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_NONE = {"", "none", "null"}


class _ShortRepr(reprlib.Repr):
    """``reprlib`` with small bounds that never builds the full repr of a user value.

    Containers are cut to a few items and levels *before* their items are formatted (aliased YAML lists can
    expand to billions of items), strings and bytes are sliced before ``repr``, big ints are described by
    size (formatting one is quadratic, and past 4300 digits raises ``ValueError``), and dict and set items
    keep their order instead of being sorted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxtuple = self.maxlist = self.maxset = self.maxfrozenset = self.maxdict = 4
        self.maxstring = 60
        self.maxother = 60
        self.fillvalue = "..."  # reprlib.Repr has it only from Python 3.11

    def repr1(self, x: Any, level: int) -> str:
        if x is None or isinstance(x, (bool, float, complex)):
            return builtins.repr(x)
        if isinstance(x, int):
            if x.bit_length() > 128:
                return f"<int of about {int(math.log10(abs(x))) + 1} digits>"
            return builtins.repr(x)
        if isinstance(x, str):
            return self.repr_str(x, level)
        if isinstance(x, (bytes, bytearray)):
            return builtins.repr(bytes(x[: self.maxstring])) + (self.fillvalue if len(x) > self.maxstring else "")
        if isinstance(x, Mapping):
            return self._items(x.items(), len(x), level, "{", "}", self.maxdict, pairs=True)
        if isinstance(x, (list, tuple, set, frozenset)):
            return self._sequence(x, level)
        if isinstance(x, os.PathLike):
            try:
                return f"{type(x).__name__[:40]}({self.repr_str(str(os.fspath(x)), level)})"
            except Exception:
                pass
        return self.repr_instance(x, level)  # trusted Python objects: repr, then cut to maxother

    def _sequence(self, x: Any, level: int) -> str:
        if isinstance(x, list):
            return self._items(x, len(x), level, "[", "]", self.maxlist)
        if isinstance(x, tuple):
            return self._items(x, len(x), level, "(", ",)" if len(x) == 1 else ")", self.maxtuple)
        name = "set" if isinstance(x, set) else "frozenset"
        if not x:
            return f"{name}()"
        left, right = ("{", "}") if name == "set" else ("frozenset({", "})")
        return self._items(x, len(x), level, left, right, self.maxset)

    def _items(self, items: Iterable[Any], n: int, level: int, left: str, right: str, most: int,
               *, pairs: bool = False) -> str:
        if n == 0:
            return left + right
        if level <= 0:
            return left + self.fillvalue + right
        if pairs:
            pieces = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}" for k, v in islice(items, most)]
        else:
            pieces = [self.repr1(e, level - 1) for e in islice(items, most)]
        if n > most:
            pieces.append(self.fillvalue)
        return left + ", ".join(pieces) + right


_SHORT = _ShortRepr()


def short(value: Any, limit: int = 80) -> str:
    """A bounded ``repr(value)``: cut before formatting, at most ``limit`` characters; never raises."""
    try:
        text = _SHORT.repr(value)
    except Exception:
        text = "<unrepresentable>"
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text


def cut(text: str, limit: int = 80) -> str:
    """``text`` itself when short, else its first ``limit - 3`` characters and "..." (for names in messages)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def show(value: Any, limit: int = 80) -> str:
    """``short(value)`` with its type, for "`field` is <value> (<type>)" messages; never raises."""
    return f"{short(value, limit)} ({type(value).__name__[:40]})"


def suggest(word: str, candidates: Iterable[str]) -> str | None:
    """The closest candidate to ``word``, for "did you mean" hints, or None (also for very long words)."""
    if len(word) > MAX_SUGGEST:
        return None
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
        stripped = text.strip()
        if len(stripped) > MAX_NUMBER_TEXT:  # refuse before int(): quadratic, and a ValueError past 4300 digits
            return _raise(self.fail(path, text))
        try:
            return self.check(path, int(stripped))
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
        stripped = text.strip()
        if len(stripped) > MAX_NUMBER_TEXT:
            return _raise(self.fail(path, text))
        try:
            return self.check(path, float(stripped))
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


class run_name(Kind):
    describe = "1 to 100 characters of letters, digits and ._=- (not '.' or '..'; it names a directory)"

    def check(self, path_: str, value: Any) -> Any:
        if isinstance(value, str) and _RUN_NAME.fullmatch(value) and value not in (".", ".."):
            return value
        return _raise(self.fail(path_, value))


_RUN_NAME = re.compile(r"[A-Za-z0-9._=-]{1,100}")


class path(Kind):
    describe = f"a non-empty filesystem path (str or os.PathLike) of at most {MAX_PATH} characters"

    def check(self, path_: str, value: Any) -> Any:
        if isinstance(value, os.PathLike):
            try:
                value = os.fspath(value)
            except Exception:
                return _raise(self.fail(path_, value))
        if isinstance(value, str) and value.strip() and len(value) <= MAX_PATH and "\x00" not in value:
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


class names(Kind):
    """A list of identifiers (e.g. module class names), or one of ``keywords``. In the environment: a
    comma-separated list."""

    def __init__(self, *keywords: str, max_items: int = 64):
        self.keywords, self.max_items = keywords, max_items
        alt = " or one of " + ", ".join(repr(k) for k in keywords) if keywords else ""
        self.describe = f"a list of at most {max_items} Python identifiers (class names){alt}"

    def check(self, path: str, value: Any) -> Any:
        if isinstance(value, str) and value in self.keywords:
            return value
        if isinstance(value, (list, tuple)) and len(value) <= self.max_items and all(
                isinstance(x, str) and x.isidentifier() and len(x) <= 200 for x in value):
            return tuple(value)
        return _raise(self.fail(path, value))

    def parse(self, path: str, text: str) -> Any:
        stripped = text.strip()
        if stripped in self.keywords:
            return stripped
        return self.check(path, [x.strip() for x in stripped.split(",") if x.strip()] if stripped else [])


def _raise(error: ConfigError) -> Any:
    raise error
