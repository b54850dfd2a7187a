"""The one reader of JSON values read back from a job's store or the environment: bounded before parsing, and
every way a value can fail to be JSON is one named error."""

from __future__ import annotations

import pytest

from robustdist.runtime.stored import Unreadable, json_value


def test_a_value_within_its_bound_is_parsed():
    assert json_value(b'{"a": [1, 2]}', 64) == {"a": [1, 2]}
    assert json_value('"text"', 6) == "text"


@pytest.mark.parametrize("raw, bound, said", [
    (b"[1]" * 100, 64, "300 bytes, more than the 64 it can be"),
    (b"[" * 100_000, 1 << 20, "not JSON (RecursionError: maximum recursion depth exceeded"),
    (b"\"\x80abc\"", 64, "not JSON (UnicodeDecodeError: 'utf-8' codec can't decode byte 0x80"),
    (b'{"a": 1,}', 64, "not JSON (JSONDecodeError: Expecting property name enclosed in double quotes: line 1 "
                       "column 9"),
    (b"", 64, "not JSON (JSONDecodeError: Expecting value"),
    # what json.loads alone would accept from bytes: a byte-order mark, UTF-16, a lone surrogate
    (b'\xef\xbb\xbf{"a": 1}', 64, "not JSON (JSONDecodeError: Unexpected UTF-8 BOM"),
    ('{"a": 1}'.encode("utf-16"), 64, "not JSON (UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff"),
    (b'"\xed\xa0\x80"', 64, "not JSON (UnicodeDecodeError: 'utf-8' codec can't decode byte 0xed"),
])
def test_anything_else_is_unreadable_saying_what_it_is(raw, bound, said):
    with pytest.raises(Unreadable) as caught:
        json_value(raw, bound)
    assert str(caught.value).startswith(said), str(caught.value)


def test_the_bound_is_checked_before_parsing():
    """A value over its bound is refused by its length: nothing of it is parsed (a deep nest would raise
    RecursionError, not the length)."""
    with pytest.raises(Unreadable, match="bytes, more than"):
        json_value(b"[" * 100_000, 1000)
