"""Values robustdist reads back from a job's store or from the environment: input, which may be stale (an earlier
attempt's), garbled, or written by something else. Every such JSON value is read by :func:`json_value`, bounded
before it is parsed, so that each reader's own checks of its shape start from a value of bounded size.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["Unreadable", "json_value"]


class Unreadable(ValueError):
    """A value that is not JSON of the size robustdist writes; the message says what it is instead."""


def json_value(raw: bytes | str, max_bytes: int) -> Any:
    """The JSON value in ``raw``; :class:`Unreadable` when it is longer than ``max_bytes`` or is not JSON (bytes
    that are not UTF-8, a byte-order mark, or nesting too deep to parse, included)."""
    if len(raw) > max_bytes:
        raise Unreadable(f"{len(raw)} bytes, more than the {max_bytes} it can be")
    try:  # UTF-8 only, as robustdist writes it: json.loads would guess UTF-16/32 and pass a BOM or lone surrogates
        return json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
    except (ValueError, TypeError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise Unreadable(f"not JSON ({type(e).__name__}: {str(e)[:200]})") from None
