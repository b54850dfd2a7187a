"""A pass over a pickle's opcodes, before anything unpickles it, that bounds what unpickling can cost.

``torch.load(weights_only=True)`` and robustdist's DCP metadata unpickler refuse code, but not cost: a pickle
can reference one object many times, so a few hundred bytes can describe a tree of 2**40 nodes. Unpickling
it is cheap, but *hashing* it is not (a tuple built as ``t = (t, t)`` forty deep, used as a dict key or a set
member, hashes for hours inside the unpickler), nor is walking it (``Optimizer.load_state_dict``). Ints that
collide in a hash table (``i * (2**61 - 1)``) make building a dict quadratic.

:func:`scan` runs a stack machine over the opcodes (``pickletools.genops``) that tracks, for every value, the
size of the tree it stands for, sharing sizes through the memo exactly as the unpickler shares objects, and
refuses:

* any value whose tree size exceeds the bound;
* a dict key that stands for more than 64 values, or holds a float or an int of magnitude 2**61 - 1 or more
  (python hashes such ints modulo 2**61 - 1, so they can be made to collide; robustdist's keys are names,
  parameter indices and DCP's small ``MetadataIndex`` records), so hashing a key is cheap and no dict
  degrades into a list;
* sets (``EMPTY_SET``, ``ADDITEMS``, ``FROZENSET``), which robustdist never writes, and opcodes that
  ``torch.save`` and DCP never emit;
* a pickle whose unpickling would cost more memory than its budget: every opcode is charged what the unpickler
  allocates for it (a stack or memo slot, a mark, an empty dict or list, a string), and the total may not
  exceed ``max(MIN_BUDGET, BUDGET_PER_BYTE * size)`` where ``size`` is the size of the file the pickle came
  from. One-byte opcodes are the cheap way to make an unpickler allocate (7.6 MiB of ``EMPTY_DICT`` or
  ``MEMOIZE`` cost 550-650 MB before this bound); the scan's own state is kept below the same bound (scalars
  share one node, the memo is a list).

Each refusal is a :class:`~robustdist.runtime.errors.CheckpointCorruptError` naming the file.
"""

from __future__ import annotations

import pickletools
from typing import Any

from robustdist.runtime.errors import CheckpointCorruptError

MAX_KEY_INT = 2**61 - 1
MAX_KEY_SIZE = 64
BUDGET_PER_BYTE = 10
"""Memory the unpickler (and this scan) may be charged per byte of the file the pickle came from."""
MIN_BUDGET = 32 << 20
"""...and at least this much (a small file of plain data still loads)."""
_MARK = object()
_SLOT = 8  # a stack or memo slot, a mark: one pointer
# What the unpickler allocates for an object beyond its slot (CPython 3.10-3.13, 64-bit, rounded up): an empty
# dict or list, a tuple of n (+8 per item), an int or float, a str or bytes (+ its length), an object built by
# REDUCE/NEWOBJ/BINPERSID (torch's tensors, DCP's records: their own dicts and fields included), a dict item.
_COST = {"EMPTY_DICT": 64, "EMPTY_LIST": 56, "EMPTY_TUPLE": 0, "TUPLE": 40, "INT": 32, "FLOAT": 24, "TEXT": 56,
         "OBJECT": 160, "ITEM": 40}
_SCALARS = frozenset({"NONE", "NEWTRUE", "NEWFALSE", "BINFLOAT", "FLOAT", "STRING", "BINSTRING", "SHORT_BINSTRING",
                      "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES",
                      "BINBYTES8", "BYTEARRAY8"})
_INTS = frozenset({"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4"})
_IGNORED = frozenset({"PROTO", "FRAME", "STOP"})


class _Node:
    """A value on the machine's stack: the size of the tree it stands for, and whether it holds a number that
    must not be hashed (a float, or an int whose hash can be made to collide). ``shared``: one of the scalar
    nodes every scalar uses (never grown: items cannot be added to a scalar)."""

    __slots__ = ("big", "shared", "size")

    def __init__(self, size: int, big: bool = False, shared: bool = False):
        self.size, self.big, self.shared = size, big, shared

    @property
    def key_ok(self) -> bool:
        return self.size <= MAX_KEY_SIZE and not self.big


_SCALAR, _BIG_SCALAR = _Node(1, shared=True), _Node(1, True, shared=True)


class _Machine:
    def __init__(self, where: str, limit: int, budget: int):
        self.where, self.limit, self.budget = where, limit, budget
        self.stack: list[Any] = []
        self.memo: list[_Node | None] = []  # BINPUT/LONG_BINPUT/MEMOIZE write it in order in practice
        self.sparse: dict[Any, _Node] = {}  # an index written out of order
        self.cost = 0

    def fail(self, problem: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{self.where}: refused before unpickling: {problem}")

    def charge(self, n: int) -> None:
        self.cost += n
        if self.cost > self.budget:
            raise self.fail(f"unpickling it would allocate more than {self.budget >> 20} MiB (memo slots, stack "
                            f"entries, marks and empty containers are charged as they appear; the budget is "
                            f"{BUDGET_PER_BYTE} bytes per byte of the file, at least {MIN_BUDGET >> 20} MiB); "
                            "expected plain checkpoint data")

    def node(self, items: list[_Node], extra: int = 1, cost: int = _COST["TUPLE"]) -> _Node:
        size = extra + sum(i.size for i in items)
        if size > self.limit:
            raise self.fail(f"a value stands for a tree of more than {self.limit} values (one object referenced "
                            "many times); expected plain checkpoint data")
        self.charge(_SLOT + cost + _SLOT * len(items))
        return _Node(size, any(i.big for i in items))

    def memoise(self, index: Any, value: _Node) -> None:
        self.charge(2 * _SLOT)  # the unpickler's memo table grows by doubling
        if index == len(self.memo):
            self.memo.append(value)
        elif isinstance(index, int) and 0 <= index < len(self.memo):
            self.memo[index] = value
        else:
            self.sparse[index] = value
            self.charge(96)  # a dict entry here

    def recall(self, index: Any) -> _Node:
        found = self.memo[index] if isinstance(index, int) and 0 <= index < len(self.memo) else self.sparse.get(index)
        if found is None:
            raise self.fail(f"memo entry {index!r:.20} is read before it is written")
        return found

    def pop_mark(self) -> list[_Node]:
        items: list[_Node] = []
        while self.stack:
            item = self.stack.pop()
            if item is _MARK:
                return items[::-1]
            items.append(item)
        raise self.fail("a MARK is missing")

    def pop(self, n: int = 1) -> list[_Node]:
        if len(self.stack) < n or any(x is _MARK for x in self.stack[-n:]):
            raise self.fail("the stack is too short")
        items = self.stack[-n:]
        del self.stack[-n:]
        return items

    def add_items(self, container: _Node, items: list[_Node], *, pairs: bool) -> None:
        if container.shared:
            raise self.fail("items are added to a scalar")
        self.charge((_COST["ITEM"] // 2 if pairs else _SLOT) * len(items))
        if pairs:
            if len(items) % 2:
                raise self.fail("a dict update has an odd number of items")
            for key in items[0::2]:
                if not key.key_ok:
                    raise self.fail(f"a dict key stands for {key.size} values or holds a float or an int of "
                                    f"magnitude {MAX_KEY_INT} or more; expected a name, an index or a small record")
        size = container.size + sum(i.size for i in items)
        if size > self.limit:
            raise self.fail(f"a value stands for a tree of more than {self.limit} values (one object referenced "
                            "many times); expected plain checkpoint data")
        container.size, container.big = size, container.big or any(i.big for i in items)

    def step(self, name: str, arg: Any) -> None:  # noqa: C901 - one branch per opcode family, flat on purpose
        stack = self.stack
        if name in _INTS:
            big = not (isinstance(arg, int) and abs(arg) < MAX_KEY_INT)
            self.charge(_SLOT + _COST["INT"] + (abs(arg).bit_length() // 8 if isinstance(arg, int) else 0))
            stack.append(_BIG_SCALAR if big else _SCALAR)
        elif name in _SCALARS:
            floating = name == "BINFLOAT" or name == "FLOAT"
            self.charge(_SLOT + (_COST["FLOAT"] if floating else _COST["TEXT"] + len(arg)
                                 if isinstance(arg, (str, bytes, bytearray)) else 0))
            stack.append(_BIG_SCALAR if floating else _SCALAR)
        elif name in ("EMPTY_LIST", "EMPTY_DICT", "EMPTY_TUPLE"):
            self.charge(_SLOT + _COST[name])
            stack.append(_Node(1))
        elif name in ("GLOBAL", "PERSID"):
            self.charge(_SLOT + _COST["OBJECT"])
            stack.append(_Node(1))
        elif name == "MARK":
            self.charge(_SLOT)
            stack.append(_MARK)
        elif name in ("TUPLE", "LIST"):
            stack.append(self.node(self.pop_mark(), cost=_COST["TUPLE" if name == "TUPLE" else "EMPTY_LIST"]))
        elif name == "DICT":
            items = self.pop_mark()
            container = self.node([], cost=_COST["EMPTY_DICT"])
            self.add_items(container, items, pairs=True)
            stack.append(container)
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            stack.append(self.node(self.pop(int(name[-1]))))
        elif name == "APPEND":
            value, = self.pop()
            self._into_top([value], pairs=False)
        elif name in ("APPENDS", "SETITEMS"):
            self._into_top(self.pop_mark(), pairs=name == "SETITEMS")
        elif name == "SETITEM":
            self._into_top(self.pop(2), pairs=True)
        elif name in ("REDUCE", "NEWOBJ"):
            stack.append(self.node(self.pop(2)[1:], cost=_COST["OBJECT"]))
        elif name == "NEWOBJ_EX":
            stack.append(self.node(self.pop(3)[1:], cost=_COST["OBJECT"]))
        elif name == "STACK_GLOBAL":
            self.pop(2)
            self.charge(_SLOT + _COST["OBJECT"])
            stack.append(_Node(1))
        elif name == "BINPERSID":
            stack.append(self.node(self.pop(), cost=_COST["OBJECT"]))
        elif name == "BUILD":
            state, = self.pop()
            self._into_top([state], pairs=False)
        elif name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
            if not stack or stack[-1] is _MARK:
                raise self.fail("nothing to memoise")
            self.memoise(len(self.memo) + len(self.sparse) if name == "MEMOIZE" else arg, stack[-1])
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            self.charge(_SLOT)
            stack.append(self.recall(arg))
        elif name == "POP":
            self.pop()
        elif name == "POP_MARK":
            self.pop_mark()
        elif name == "DUP":
            self.charge(_SLOT)
            stack.append(self.pop()[0])
            stack.append(stack[-1])
        elif name not in _IGNORED:
            raise self.fail(f"opcode {name}, which neither torch.save nor DCP writes (sets included)")

    def _into_top(self, items: list[_Node], *, pairs: bool) -> None:
        if not self.stack or self.stack[-1] is _MARK:
            raise self.fail("no container to add to")
        self.add_items(self.stack[-1], items, pairs=pairs)


def budget_for(size: int) -> int:
    """The memory a pickle from a file of ``size`` bytes may cost to unpickle (see the module docstring)."""
    return max(MIN_BUDGET, BUDGET_PER_BYTE * size)


def scan(data: bytes, where: str, limit: int, *, file_size: int | None = None) -> None:
    """Refuse a pickle that would be expensive to unpickle (see the module docstring). ``file_size``: the size of
    the file the pickle is part of (a torch zip's tensors count); the pickle's own length by default."""
    machine = _Machine(where, limit, budget_for(len(data) if file_size is None else file_size))
    try:
        for opcode, arg, _ in pickletools.genops(data):
            machine.step(opcode.name, arg)
    except CheckpointCorruptError:
        raise
    except Exception as e:  # a truncated or garbled stream: pickletools raises ValueError and friends
        raise machine.fail(f"not a well-formed pickle ({type(e).__name__}: {str(e)[:120]})") from None
