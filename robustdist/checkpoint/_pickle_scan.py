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
* a persistent id (``BINPERSID``) that is not a storage reference as torch.save writes it: the tuple
  ``('storage', type, key, location, size)`` whose key is a memoised string of decimal digits. torch finds a
  storage's record by name without regard to case (and only up to a NUL byte) but remembers what it loaded by the
  exact key, so keys spelled ``aaaa``, ``aaaA``, ... would read one record again for each spelling;
* a memo index that is not the next one (pickle writes each once, in order; the C unpickler sizes its memo table
  to twice the index, so a 9-byte pickle can cost gigabytes), and a stack of more than :data:`MAX_STACK` values;
* a pickle whose unpickling would cost more memory than its size warrants. One-byte opcodes make the unpickler
  allocate far more than a byte each: an empty dict (``EMPTY_DICT``, ~80 bytes), a memo slot, a mark (torch's
  weights-only unpickler makes a new list per ``MARK``, ~64 bytes). The machine adds up what each opcode makes
  the unpickler allocate (:data:`COSTS`, measured on CPython's and torch's unpicklers, rounded up), with the
  stack and the marks counted at their deepest, and refuses once the total passes :func:`budget`:
  :data:`COST_PER_BYTE` bytes per byte of the pickle plus :data:`COST_FLOOR`. Plain data costs 5-20 bytes per
  byte to unpickle (a list of ints ~10, of short strings ~10-20, of small dicts ~13; a torch state dict's pickle
  far less), so the budget refuses nothing robustdist would write, while the cheapest hostile opcodes (~80
  bytes per byte) are refused partway through.

The machine's own state is a few flat integer arrays (4 bytes per value, memo slot and stack entry; scalars
share one entry), so scanning a refused pickle costs a small multiple of its size, not the unpickler's.

Each refusal is a :class:`~robustdist.runtime.errors.CheckpointCorruptError` naming the file.
"""

from __future__ import annotations

import pickletools
from array import array
from typing import Any

from robustdist.checkpoint._pickle_tensors import EMPTY_OD, EXPANDED, FROZEN, TensorRules
from robustdist.runtime._serialization_compat import (COPYING_REBUILDS, STATEFUL_REBUILDS, canonical_global,
                                                     makes_tensor, tensor_classes)
from robustdist.runtime.errors import CheckpointCorruptError

MAX_KEY_INT = 2**61 - 1
MAX_KEY_SIZE = 64
COST_PER_BYTE = 32
"""Bytes of unpickler memory allowed per byte of pickle (see the module docstring)."""
COST_FLOOR = 32 << 20
"""Bytes of unpickler memory any pickle may cost, however small."""
_SCALARS = frozenset({"NONE", "NEWTRUE", "NEWFALSE", "BINFLOAT", "FLOAT", "STRING", "BINSTRING", "SHORT_BINSTRING",
                      "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES",
                      "BINBYTES8", "BYTEARRAY8"})
_INTS = frozenset({"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4"})
_IGNORED = frozenset({"PROTO", "FRAME", "STOP"})
COSTS = {
    # what the unpickler allocates for the object an opcode makes (CPython 3.10-3.13, 64-bit, rounded up);
    # strings and bytes add their length, and a list or tuple item or a dict pair adds ITEM or PAIR
    "EMPTY_DICT": 80, "DICT": 80, "EMPTY_LIST": 64, "LIST": 64, "EMPTY_TUPLE": 16, "TUPLE": 56,
    "TUPLE1": 56, "TUPLE2": 56, "TUPLE3": 56, "INT": 40, "FLOAT": 32, "STR": 72, "OBJECT": 160,
    "MEMO": 64, "STACK": 16, "MARK": 64, "ITEM": 8, "PAIR": 48,
    # measured on torch's weights-only unpickler (resident memory, 260,000-380,000 of each, rounded up): a tensor
    # made by a rebuild call (~570 bytes), a storage made from a record torch does not cache (~285)
    "TENSOR": 576, "STORAGE": 320,
}
MAX_STACK = 1 << 20
"""Values that may wait on the stack at once: pickle adds items a thousand at a time, so even a thousand levels of
nesting stay under it (and a payload's whole tree is bounded by its value count anyway)."""
PAYLOAD_REFUSED = frozenset({"builtins bytearray", "builtins set", "builtins complex", "collections Counter"})
"""Callables torch's weights-only unpickler allows that robustdist's payloads never call (their plain data has no
bytearray, set, complex or Counter): ``bytearray(2**31)`` is a 6-byte call for 2 GiB."""
_EMPTY_CALLS = frozenset({"collections OrderedDict"})  # torch.save calls it with no arguments, then adds the items
_ENCODE = "_codecs encode"  # how protocol 2 writes bytes: _codecs.encode(<a fresh str>, "latin1")
_READ = 1  # flags: the value was pushed again (a memo read or DUP)
_FIRST_READ = 2  # a tuple whose first item had been pushed again
_KEEPS_STACK = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE", "MARK", "PROTO", "FRAME", "STOP"})
_SMALL, _BIG = 0, 1  # the shared entries of every scalar: one that may be hashed as a key, and one that may not
_MARK = -1
_STORAGE = "storage"  # the first item of every persistent id torch.save writes
MAX_KEY_CHARS = 32


def budget(size: int) -> int:
    """Bytes of unpickler memory a pickle of ``size`` bytes may cost."""
    return COST_PER_BYTE * size + COST_FLOOR


def _scalar_cost(name: str, arg: Any) -> int:
    if name in _INTS:
        return 0 if isinstance(arg, int) and -5 <= arg <= 256 else COSTS["INT"]  # CPython shares small ints
    if name in ("NONE", "NEWTRUE", "NEWFALSE"):
        return 0
    if name in ("BINFLOAT", "FLOAT"):
        return COSTS["FLOAT"]
    if isinstance(arg, str):
        return COSTS["STR"] + len(arg) * (1 if arg.isascii() else 4)
    return COSTS["STR"] + len(arg) if isinstance(arg, (bytes, bytearray)) else COSTS["STR"]


class _Machine(TensorRules):
    """The stack machine. A value is an index into ``sizes`` (the size of the tree it stands for) and ``big``
    (whether it holds a number that must not be hashed: a float, or an int whose hash can be made to collide);
    every scalar is one of the two shared entries, only containers and objects get their own."""

    def __init__(self, where: str, limit: int, allowed: int, payload: bool = False):
        self.where, self.limit, self.allowed, self.payload = where, limit, allowed, payload
        self.flags = bytearray(b"\x00\x00")  # per value: _READ, _FIRST_READ
        self.callables: dict[int, str] = {}  # value -> the global it is, for the few whose calls are checked
        # 32-bit entries: a pickle has fewer values than bytes, and scan() refuses one of 2 GiB or more
        self.sizes = array("i", [1, 1])
        self.big = bytearray(b"\x00\x01")
        self.stack = array("i")
        self.marks = array("i")  # stack positions of the open marks
        self.memo = array("i")
        self.cost = 0  # what the unpickler has allocated so far, stack and marks aside
        self.max_stack = min(limit, MAX_STACK)
        self.deepest = 0  # the stack's and the marks' cost at their deepest
        self.pending: str | None = None  # the text of a short string the previous opcode pushed, if it may matter
        self.texts: dict[int, str] = {}  # value -> its text, for memoised strings that are "storage" or digits
        self.keys: dict[int, str] = {}  # value -> its storage key, for the persistent ids torch.save writes
        self.init_tensor_rules()
        self.loaded: set[str] = set()  # storage keys already made: torch caches them (unless their record is empty)
        self.empty_keys: frozenset[str] = frozenset()  # keys whose record is empty (see scan)

    def fail(self, problem: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{self.where}: refused before unpickling: {problem}")

    def charge(self, nbytes: int) -> None:
        self.cost += nbytes
        if len(self.stack) > self.max_stack:
            raise self.fail(f"more than {self.max_stack} values wait on its stack; pickle adds items to their "
                            "container a thousand at a time")
        depth = COSTS["STACK"] * len(self.stack) + COSTS["MARK"] * len(self.marks)
        if depth > self.deepest:
            self.deepest = depth
        if self.cost + self.deepest > self.allowed:
            raise self.fail(f"unpickling it would cost more than {self.allowed >> 20} MiB of memory (its objects, "
                            "memo slots, stack and marks), more than a pickle of its size can need "
                            f"({COST_PER_BYTE} bytes per byte plus {COST_FLOOR >> 20} MiB); expected plain "
                            "checkpoint data, not one-byte opcodes that each allocate an object")

    def new(self, items: Any, extra: int = 1) -> int:
        """A container or object standing for ``items`` (value indices) plus ``extra`` nodes of its own."""
        size = extra + sum(self.sizes[i] for i in items)
        if size > self.limit:
            raise self.fail(f"a value stands for a tree of more than {self.limit} values (one object referenced "
                            "many times); expected plain checkpoint data")
        self.sizes.append(size)
        self.big.append(1 if any(self.big[i] for i in items) else 0)
        self.flags.append(EXPANDED if any(self.flags[i] & EXPANDED for i in items) else 0)
        return len(self.sizes) - 1

    def made(self, args: Any, cost: int = COSTS["OBJECT"]) -> int:
        """The object a callable makes from ``args`` (REDUCE, NEWOBJ, BINPERSID): the arguments must stand for a
        bounded tree, and the object counts as one value (a tensor is one value, whatever its storage key). It may
        copy what its arguments stand for (``torch.Size(t)`` copies ``t``), so it costs as much; and made from
        more than a key's worth of values, it may not be hashed as a key (hashing it walks them)."""
        node = self.new(args)
        spans = self.sizes[node]
        self.sizes[node] = 1
        if spans > MAX_KEY_SIZE:
            self.big[node] = 1
        self.charge(cost + COSTS["ITEM"] * spans)
        return node

    def first_read(self, items: Any) -> None:
        """Mark the value just made when its first item had been pushed again (see :meth:`check_call`)."""
        if len(items) and self.flags[items[0]] & _READ:
            self.flags[len(self.sizes) - 1] |= _FIRST_READ

    def check_call(self, callable_: str | None, args: int) -> None:
        """Calls whose cost a pickle could multiply: ``OrderedDict(items)`` copies what it is given (torch.save
        calls it with nothing); ``_codecs.encode(s, ...)`` expands ``s`` up to tenfold, so each call must encode a
        string of its own, as pickle writes bytes, never one read again from the memo (6 bytes a call)."""
        if callable_ in _EMPTY_CALLS and self.sizes[args] > 1:
            raise self.fail(f"it calls {callable_.replace(' ', '.')} with arguments (a copy of what they stand "
                            "for); torch.save calls it with none and adds the items")
        if callable_ == _ENCODE and self.flags[args] & (_READ | _FIRST_READ):
            raise self.fail("it encodes a string (or an argument tuple) already used; pickle encodes each bytes "
                            "value from a string of its own")

    def pop_mark(self) -> array:
        if not self.marks:
            raise self.fail("a MARK is missing")
        at = self.marks.pop()
        items = self.stack[at:]
        del self.stack[at:]
        return items

    def pop(self, n: int = 1) -> array:
        floor = self.marks[-1] if self.marks else 0
        if len(self.stack) - floor < n:
            raise self.fail("the stack is too short")
        items = self.stack[len(self.stack) - n:]
        del self.stack[len(self.stack) - n:]
        return items

    def top(self) -> int:
        if len(self.stack) <= (self.marks[-1] if self.marks else 0):
            raise self.fail("the stack is empty where a value is expected")
        return self.stack[-1]

    def add_items(self, container: int, items: Any, *, pairs: bool) -> None:
        if container in (_SMALL, _BIG):
            raise self.fail("items are added to a value that is not a container")
        if container in items:
            raise self.fail("a container is added to itself (a cycle); robustdist writes trees")
        if self.flags[container] & FROZEN:
            raise self.fail("items are added to a tensor's backward hooks; torch.save writes them empty")
        if pairs:
            if len(items) % 2:
                raise self.fail("a dict update has an odd number of items")
            for key in items[0::2]:
                if self.sizes[key] > MAX_KEY_SIZE or self.big[key]:
                    raise self.fail(f"a dict key stands for {self.sizes[key]} values or holds a float, an int "
                                    f"of magnitude {MAX_KEY_INT} or more, or an object made from more than "
                                    f"{MAX_KEY_SIZE} values; expected a name, an index or a small record")
        # a dict counts its values, as a payload's tree count does (its keys are small: checked above)
        size = self.sizes[container] + sum(self.sizes[i] for i in (items[1::2] if pairs else items))
        if size > self.limit:
            raise self.fail(f"a value stands for a tree of more than {self.limit} values (one object referenced "
                            "many times); expected plain checkpoint data")
        self.sizes[container] = size
        if any(self.big[i] for i in items):
            self.big[container] = 1
        if any(self.flags[i] & EXPANDED for i in items):
            self.flags[container] |= EXPANDED
        self.charge(len(items) * (COSTS["PAIR"] // 2 if pairs else COSTS["ITEM"]))

    def step(self, name: str, arg: Any) -> None:
        self._step(name, arg)
        self.after_step(name, arg, name in _INTS, name in _KEEPS_STACK)

    def _step(self, name: str, arg: Any) -> None:  # noqa: C901 - one branch per opcode family, flat on purpose
        stack = self.stack
        pending = self.pending
        if name not in _IGNORED:
            self.pending = None
        if name in _INTS:
            stack.append(_SMALL if isinstance(arg, int) and abs(arg) < MAX_KEY_INT else _BIG)
            self.charge(_scalar_cost(name, arg))
        elif name in _SCALARS:
            stack.append(_BIG if name in ("BINFLOAT", "FLOAT") else _SMALL)
            self.charge(_scalar_cost(name, arg))
            if isinstance(arg, str) and len(arg) <= MAX_KEY_CHARS and (arg == _STORAGE or _is_key(arg)):
                self.pending = arg  # pickle memoises every string it writes: the next opcode is its PUT
        elif name in ("EMPTY_LIST", "EMPTY_DICT"):
            stack.append(self.new(()))
            self.charge(COSTS[name])
        elif name == "EMPTY_TUPLE":  # immutable and empty: one shared entry, as for a scalar
            stack.append(_SMALL)
            self.charge(COSTS[name])
        elif name in ("GLOBAL", "PERSID"):
            if name == "GLOBAL":  # as torch's weights-only unpickler reads it: __builtin__ is builtins
                arg = canonical_global(str(arg))
            if name == "GLOBAL" and self.payload and (arg in PAYLOAD_REFUSED or arg in COPYING_REBUILDS
                                                      or arg in STATEFUL_REBUILDS or arg in tensor_classes()):
                raise self.fail(f"it calls {str(arg).replace(' ', '.')}, which robustdist's payloads never hold "
                                "(bytearray, set, complex, Counter, a legacy tensor class, a device tensor's copy from "
                                "the CPU, a tensor with Python attributes: save() stores tensors detached); a few bytes "
                                "of such a call can allocate gigabytes or set what no check sees")
            stack.append(self.new(()))
            if name == "GLOBAL" and (arg in _EMPTY_CALLS or arg == _ENCODE or makes_tensor(arg)):
                self.callables[stack[-1]] = arg
            self.charge(COSTS["OBJECT"] if name == "PERSID" else 0)
        elif name == "MARK":
            self.marks.append(len(stack))
            self.charge(0)
        elif name in ("TUPLE", "LIST"):
            items = self.pop_mark()
            stack.append(self.new(items))
            self.first_read(items)
            self.charge(COSTS[name] + COSTS["ITEM"] * len(items))
            self.note_shape(items, len(stack) - 1)
            if name == "TUPLE" and len(items) == 5 and self.texts.get(items[0]) == _STORAGE:
                key = self.texts.get(items[2])
                if key is not None and key != _STORAGE:
                    self.keys[stack[-1]] = key
            self.note_args(items)
        elif name == "DICT":
            items = self.pop_mark()
            container = self.new(())
            stack.append(container)
            self.charge(COSTS[name])
            self.add_items(container, items, pairs=True)
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            items = self.pop(n)
            stack.append(self.new(items))
            self.first_read(items)
            self.charge(COSTS[name] + COSTS["ITEM"] * n)
            self.note_shape(items, len(stack) - 1)
            self.note_args(items)
        elif name == "APPEND":
            value = self.pop()
            self.add_items(self.top(), value, pairs=False)
        elif name in ("APPENDS", "SETITEMS"):
            items = self.pop_mark()
            self.add_items(self.top(), items, pairs=name == "SETITEMS")
        elif name == "SETITEM":
            items = self.pop(2)
            self.add_items(self.top(), items, pairs=True)
        elif name in ("REDUCE", "NEWOBJ"):
            call, args = self.pop(2)
            callable_ = self.callables.get(call)
            self.check_call(callable_, args)
            self.check_not_expanded(args)
            if callable_ is not None and makes_tensor(callable_):
                expanded = self.check_tensor(callable_, args)
                stack.append(self.made([args], COSTS["TENSOR"]))
                if expanded:
                    self.flags[stack[-1]] |= EXPANDED
            else:
                stack.append(self.made([args]))
                if callable_ in _EMPTY_CALLS:
                    self.flags[stack[-1]] |= EMPTY_OD
        elif name == "NEWOBJ_EX":
            args = self.pop(3)[1:]
            for a in args:
                self.check_not_expanded(a)
            stack.append(self.made(args))
        elif name == "STACK_GLOBAL":
            self.pop(2)
            stack.append(self.new(()))
            self.charge(0)
        elif name == "BINPERSID":
            pid = self.pop()
            if pid[0] not in self.keys:
                # torch looks a storage's record up by name without regard to case (and up to a NUL byte), and
                # remembers what it loaded by the exact key: keys spelled "aaaa", "aaaA", ... read one record again
                # and again (an 8 MiB record referenced 32 times cost 248 MB). torch.save's keys are decimal.
                raise self.fail("a persistent id is not a storage reference as torch.save writes it (a tuple "
                                "'storage', type, key, location, size, whose key is a memoised string of decimal "
                                f"digits, at most {MAX_KEY_CHARS}); torch reads records without regard to case, so "
                                "other keys could read one record many times")
            key = self.keys[pid[0]]
            fresh = key not in self.loaded or key in self.empty_keys  # torch caches a storage with data, by key
            self.loaded.add(key)
            stack.append(self.made(pid, COSTS["STORAGE"] if fresh else 0))
        elif name == "BUILD":
            state = self.pop()
            self.add_items(self.top(), state, pairs=False)
            if self.flags[state[0]] & _READ:  # the object's __dict__ copies a state read again from the memo
                self.charge(COSTS["PAIR"] * self.sizes[state[0]])
        elif name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
            value = self.top()
            if value in (_SMALL, _BIG):  # a memoised scalar gets its own entry, so a read of it again is seen
                value = self.new(())
                self.big[value] = self.big[stack[-1]]
                stack[-1] = value
            index = len(self.memo) if name == "MEMOIZE" else arg
            if not isinstance(index, int) or index != len(self.memo):
                # pickle writes each memo index once, in order. The C unpickler sizes its memo table to twice the
                # index, so a 9-byte pickle with LONG_BINPUT 2**24 costs hundreds of MB (2**31: tens of GB); and
                # an index written again lets every object claim one memo slot, hiding what the objects cost
                raise self.fail(f"memo index {index!r:.20} is not the next of the {len(self.memo)} entries written; "
                                "pickle writes each once, in order")
            if pending is not None:
                self.texts[value] = pending
            self.memo.append(value)
            self.charge(COSTS["MEMO"])
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            if not isinstance(arg, int) or not 0 <= arg < len(self.memo):
                raise self.fail(f"memo entry {arg!r:.20} is read before it is written")
            stack.append(self.memo[arg])
            self.flags[stack[-1]] |= _READ
            self.charge(0)
        elif name == "POP":
            if stack and self.marks and self.marks[-1] == len(stack):
                self.pop_mark()  # as the unpickler does: POP right after MARK drops the mark
            else:
                self.pop()
        elif name == "POP_MARK":
            self.pop_mark()
        elif name == "DUP":
            stack.append(self.top())
            self.flags[stack[-1]] |= _READ
            self.charge(0)
        elif name not in _IGNORED:
            raise self.fail(f"opcode {name}, which neither torch.save nor DCP writes (sets included)")


def _is_key(text: str) -> bool:
    return text.isascii() and text.isdigit()


def scan(data: bytes, where: str, limit: int, *, payload: bool = False,
         empty_keys: frozenset[str] = frozenset()) -> None:
    """Refuse a pickle that would be expensive to unpickle (see the module docstring). ``payload``: a robustdist
    payload file, which never calls :data:`PAYLOAD_REFUSED`. ``empty_keys``: the storage keys whose record in the
    archive is empty (torch does not cache the storage it makes from one, so each use costs a new one)."""
    if len(data) >= 1 << 31 or limit >= 1 << 31:
        raise CheckpointCorruptError(f"{where}: refused before unpickling: its pickle is {len(data)} bytes; "
                                     "expected less than 2 GiB (a checkpoint's tensors are stored beside it)")
    machine = _Machine(where, limit, budget(len(data)), payload)
    machine.empty_keys = empty_keys
    try:
        for opcode, arg, _ in pickletools.genops(data):
            machine.step(opcode.name, arg)
    except CheckpointCorruptError:
        raise
    except Exception as e:  # a truncated or garbled stream: pickletools raises ValueError and friends
        raise machine.fail(f"not a well-formed pickle ({type(e).__name__}: {str(e)[:120]})") from None
