"""A bounds-checked FlatBuffers reader: the verifier the Python runtime lacks.

The official Python runtime trusts its input: reads past the end raise ``struct.error``,
negative offsets raise ``TypeError``, long strings are silently truncated. kvwire never
hands untrusted bytes to it. Instead every table, vtable, vector and string is reached
through :class:`Table`, which checks bounds, alignment and size before reading, and
raises :class:`~kvwire.format.errors.HeaderError` with a stable code (spec KVW-HDR-2..8).
The schema-specific decoding (``header``, ``architecture`` and the other header parts) is written on top of this.

:class:`Buffer` also keeps the parse budget of KVW-LIM-7: every table visit and every
vector or string body decoded is charged before anything is materialised from it, against
a budget proportional to the FlatBuffer's length, so a header whose objects are shared
(a DAG: many references to one object) cannot make decoding cost more than a constant
times its size. ``memo`` lets a decoder reuse an object already decoded at a position
where the spec exempts the revisit (RopeParams tables, which writers share).
"""

from __future__ import annotations

import struct
from typing import Any, Literal, overload

from .errors import HeaderError, LimitError
from .limits import MAX_FB_TABLES, PARSE_BUDGET_BASE, PARSE_BUDGET_PER_BYTE, PARSE_TABLE_COST

_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_U16 = struct.Struct("<H")
_VT = struct.Struct("<HH")
MAX_FIELD_ID = 31  # no table of schemas/*.fbs has more fields; higher ids are never read


class Buffer:
    """One FlatBuffer (header or index) being verified; counts tables visited (KVW-HDR-8)
    and charges the parse budget (KVW-LIM-7)."""

    __slots__ = ("data", "n", "tables_left", "budget", "budget_left", "memo")

    def __init__(self, data: bytes, identifier: bytes, rule: str):
        self.data = data
        self.n = len(data)
        self.tables_left = MAX_FB_TABLES
        self.budget = self.budget_left = PARSE_BUDGET_PER_BYTE * self.n + PARSE_BUDGET_BASE
        self.memo: dict[Any, Any] = {}  # (kind, position) -> decoded object, for revisits KVW-LIM-7 exempts
        if self.n < 8:
            raise HeaderError("FB_BOUNDS", "FlatBuffer shorter than its root offset and identifier", rule=rule)
        if data[4:8] != identifier:
            raise HeaderError(
                "FB_IDENTIFIER", f"file_identifier {bytes(data[4:8])!r}, expected {identifier!r}", rule=rule
            )

    def check(self, pos: int, size: int, align: int, what: str) -> None:
        if pos < 0 or size < 0 or pos + size > self.n:
            raise HeaderError("FB_BOUNDS", f"{what} at {pos}+{size} outside buffer of {self.n} bytes", rule="KVW-HDR-3")
        if align > 1 and pos % align:
            raise HeaderError("FB_ALIGNMENT", f"{what} at {pos} not aligned to {align}", rule="KVW-HDR-4")

    def charge(self, units: int, what: str) -> None:
        """Charge ``units`` of decoding work; FB_TOO_COMPLEX once the budget is spent (KVW-LIM-7)."""
        self.budget_left -= units
        if self.budget_left < 0:
            raise LimitError("FB_TOO_COMPLEX", f"{what}: decoding this FlatBuffer of {self.n} bytes costs more "
                             f"than its parse budget of {self.budget} units", rule="KVW-LIM-7")

    @property
    def spent(self) -> int:
        """Units of the parse budget charged so far."""
        return self.budget - self.budget_left

    def u32(self, pos: int, what: str) -> int:
        self.check(pos, 4, 4, what)
        v: int = _U32.unpack_from(self.data, pos)[0]
        return v

    def root(self) -> Table:
        return Table(self, self.u32(0, "root offset"))


class Table:
    """A verified table: vtable bounds and inline size checked on construction."""

    __slots__ = ("buf", "pos", "vt", "nfields", "inline", "offsets")

    def __init__(self, buf: Buffer, pos: int):
        buf.tables_left -= 1
        if buf.tables_left < 0:
            raise LimitError("FB_TOO_COMPLEX", f"more than {MAX_FB_TABLES} tables", rule="KVW-HDR-8")
        buf.charge(PARSE_TABLE_COST, "table visit")
        data, n = buf.data, buf.n
        if pos < 0 or pos + 4 > n or pos % 4:
            buf.check(pos, 4, 4, "table")  # raises with the precise reason
        vt = pos - _I32.unpack_from(data, pos)[0]
        if vt < 0 or vt + 4 > n or vt % 2:
            buf.check(vt, 4, 2, "vtable")
        vtsize, inline = _VT.unpack_from(data, vt)
        if vtsize < 4 or vtsize % 2:
            raise HeaderError("FB_VTABLE", f"vtable size {vtsize} invalid", rule="KVW-HDR-5")
        if inline < 4:
            raise HeaderError("FB_VTABLE", f"table inline size {inline} below 4", rule="KVW-HDR-5")
        if vt + vtsize > n:
            buf.check(vt, vtsize, 2, "vtable")
        if pos + inline > n:
            buf.check(pos, inline, 4, "table")
        self.buf, self.pos, self.vt, self.nfields, self.inline = buf, pos, vt, (vtsize - 4) // 2, inline
        # Field offsets of the ids a kvwire schema can have: unpacked once, never the whole of a
        # hostile 32767-entry vtable (which may be shared by thousands of tables).
        known = min(self.nfields, MAX_FIELD_ID + 1)
        self.offsets = struct.unpack_from(f"<{known}H", buf.data, vt + 4)

    def _field(self, fid: int, size: int) -> int | None:
        offsets = self.offsets
        if fid >= len(offsets):
            return None
        off: int = offsets[fid]
        if off == 0:
            return None
        if off < 4 or off + size > self.inline:
            raise HeaderError("FB_VTABLE", f"field {fid} offset {off} outside table of {self.inline} bytes", rule="KVW-HDR-5")
        pos = self.pos + off
        if pos % min(size, 8):
            raise HeaderError("FB_ALIGNMENT", f"field {fid} at {pos} not aligned to {size}", rule="KVW-HDR-4")
        return pos

    def scalar(self, fid: int, fmt: struct.Struct, default: Any) -> Any:
        pos = self._field(fid, fmt.size)
        return default if pos is None else fmt.unpack_from(self.buf.data, pos)[0]

    def boolean(self, fid: int, default: bool) -> bool:
        """A bool field: one byte that MUST be 0 or 1, so each header has one encoding (KVW-HDR-10)."""
        pos = self._field(fid, 1)
        if pos is None:
            return default
        value = self.buf.data[pos]
        if value > 1:
            from .errors import SchemaError

            raise SchemaError("ENUM_OUT_OF_RANGE", f"bool field {fid} holds {value}, not 0 or 1", rule="KVW-HDR-10")
        return bool(value)

    def _ref(self, fid: int, required: bool, what: str) -> int | None:
        pos = self._field(fid, 4)
        if pos is None:
            if required:
                raise HeaderError("FB_REQUIRED", f"required {what} (field {fid}) missing", rule="KVW-HDR-6")
            return None
        target: int = pos + _U32.unpack_from(self.buf.data, pos)[0]
        return target

    @overload
    def table(self, fid: int, *, required: Literal[True]) -> Table: ...
    @overload
    def table(self, fid: int, *, required: bool = False) -> Table | None: ...

    def table(self, fid: int, *, required: bool = False) -> Table | None:
        target = self._ref(fid, required, "table")
        return None if target is None else Table(self.buf, target)

    @overload
    def vector(self, fid: int, elem_size: int, elem_align: int, max_count: int, *,
               required: Literal[True]) -> tuple[int, int]: ...
    @overload
    def vector(self, fid: int, elem_size: int, elem_align: int, max_count: int, *,
               required: bool = False) -> tuple[int, int] | None: ...

    def vector(self, fid: int, elem_size: int, elem_align: int, max_count: int, *,
               required: bool = False) -> tuple[int, int] | None:
        """(start, count) of a vector, its length checked against the bytes left and its
        body (``count x elem_size`` bytes) charged to the parse budget (KVW-LIM-7)."""
        target = self._ref(fid, required, "vector")
        if target is None:
            return None
        buf = self.buf
        if target < 0 or target + 4 > buf.n or target % 4:
            buf.check(target, 4, 4, "vector length")
        count: int = _U32.unpack_from(buf.data, target)[0]
        if count > max_count:
            raise LimitError("LIMIT_EXCEEDED", f"vector of {count} elements exceeds limit {max_count}", rule="KVW-LIM-1")
        start = target + 4
        if start + count * elem_size > buf.n or (elem_align > 1 and start % elem_align):
            buf.check(start, count * elem_size, elem_align, "vector body")
        buf.charge(count * elem_size, "vector body")
        return start, count

    def blob(self, fid: int, max_len: int) -> bytes | None:
        v = self.vector(fid, 1, 1, max_len)
        return None if v is None else bytes(self.buf.data[v[0] : v[0] + v[1]])

    @overload
    def string(self, fid: int, max_len: int, *, required: Literal[True]) -> str: ...
    @overload
    def string(self, fid: int, max_len: int, *, required: bool = False) -> str | None: ...

    def string(self, fid: int, max_len: int, *, required: bool = False) -> str | None:
        v = self.vector(fid, 1, 1, max_len, required=required)
        if v is None:
            return None
        start, count = v
        self.buf.check(start + count, 1, 1, "string terminator")
        if self.buf.data[start + count] != 0:
            raise HeaderError("FB_STRING", "string not NUL-terminated", rule="KVW-HDR-7")
        if 0 in self.buf.data[start : start + count]:  # a C reader using strlen would see another string
            raise HeaderError("FB_STRING", "string contains a NUL byte", rule="KVW-HDR-7")
        try:
            return bytes(self.buf.data[start : start + count]).decode("utf-8")
        except UnicodeDecodeError:
            raise HeaderError("FB_STRING", "string is not valid UTF-8", rule="KVW-HDR-7") from None

    def tables(self, fid: int, max_count: int) -> list[Table]:
        v = self.vector(fid, 4, 4, max_count)
        if v is None:
            return []
        start, count = v
        data = self.buf.data
        return [Table(self.buf, start + 4 * i + _U32.unpack_from(data, start + 4 * i)[0]) for i in range(count)]
