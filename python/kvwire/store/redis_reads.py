"""How a batch of reads becomes Redis transactions and round trips (KVW-STORE-22, 23).

Why this shape: Redis 7 answers one large value several times slower than the same bytes
in replies of about 1 MiB (benchmarks/results/store_reads.md, loopback: 16 MiB values by
``MGET`` 0.71 GB/s, ``GETRANGE`` of 1 MiB 2.84 GB/s; the server allocates, faults in and
frees every large reply), and a round trip whose replies add up to much more than 16 MiB
slows the same way (1 MiB ranges: 16 MiB per trip 2.84 GB/s, 32 MiB 2.59, 64 MiB 1.11,
256 MiB 0.77). So a read is cut into ``GETRANGE``
slices of at most ``slice_bytes`` inside one ``MULTI``/``EXEC`` (one transaction: the
slices are of one object, never of two), and a batch goes in round trips of at most
``trip_bytes`` of known reply bytes. A read whose end is not known (a whole object, an
open range, a suffix) first learns the object's length with its first slice; only an
object longer than one slice takes a second trip, which reads the range again, sliced, in
a transaction that checks the length has not changed.

Pure functions over commands and replies (no I/O, as the h11 core): ``RedisStore`` sends
what ``first_read`` plans and feeds the replies to ``answer``.
"""

from __future__ import annotations

from typing import NamedTuple

from .base import ByteRange, resolve_range

SLICE_BYTES = 1 << 20  # the most bytes one GETRANGE reply carries
TRIP_BYTES = 16 << 20  # the most known reply bytes one round trip asks for


class Read(NamedTuple):
    """One request's next transaction: ``cmds`` to send (its answer is the last command's
    reply), ``expect`` the reply bytes it asks for when known (0 when not), and what
    ``answer`` needs to read the reply."""

    position: int  # the request's place in the batch
    key: str
    byte_range: ByteRange
    kind: str  # "exists", "range", "open", "rest" or "again"
    cmds: list
    expect: int
    span: tuple = ()  # "rest": (start, stop, object length seen by the first read)


def slices(key: str, start: int, stop: int, size: int) -> list:
    """``GETRANGE`` commands reading bytes [start, stop) in pieces of at most ``size``."""
    return [["GETRANGE", key, o, min(o + size, stop) - 1] for o in range(start, stop, size)]


def first_read(position: int, key: str, byte_range: ByteRange, slice_bytes: int = SLICE_BYTES) -> Read:
    """The first transaction of a read of ``byte_range`` (KVW-STORE-3; None: the whole
    object) of ``key``. ``EXISTS`` in the transaction tells a miss from an empty range."""
    resolve_range(byte_range, 0)  # validates the form
    off, length = byte_range if byte_range is not None else (0, None)
    if length == 0:
        return Read(position, key, byte_range, "exists", [["EXISTS", key]], 0)
    if length is not None:  # known length: sliced, in one transaction
        return Read(position, key, byte_range, "range",
                    [["MULTI"], ["EXISTS", key], *slices(key, off, off + length, slice_bytes), ["EXEC"]], length)
    # open end: the length with the first slice (a suffix longer than a slice: the length alone)
    if off >= 0:
        first = [["GETRANGE", key, off, off + slice_bytes - 1]]
    else:
        first = [["GETRANGE", key, off, -1]] if -off <= slice_bytes else []
    return Read(position, key, byte_range, "open", [["MULTI"], ["EXISTS", key], ["STRLEN", key], *first, ["EXEC"]], 0)


def unsliced(read: Read) -> Read:
    """The read as one ``GETRANGE`` of the whole range in one transaction: slower, but
    needs no length known beforehand (the last resort of an object that changed)."""
    off, length = read.byte_range if read.byte_range is not None else (0, None)
    stop = -1 if length is None else off + length - 1
    return read._replace(kind="again", cmds=[["MULTI"], ["EXISTS", read.key], ["GETRANGE", read.key, off, stop],
                                             ["EXEC"]], expect=0)


def joined(parts) -> bytes:
    return parts[0] if len(parts) == 1 else b"".join(parts)


def answer(read: Read, reply, slice_bytes: int = SLICE_BYTES):
    """The value of ``read`` from its transaction's reply (EXEC's list, or EXISTS's
    integer): bytes, None for a miss, or the ``Read`` still to send. Raises ``TypeError``
    when the reply is not what the commands answer."""
    if read.kind == "exists":
        if not isinstance(reply, int):
            raise TypeError("not the reply of EXISTS")
        return b"" if reply else None
    if not isinstance(reply, list) or not all(isinstance(x, (int, bytes)) for x in reply) or \
            len(reply) != len(read.cmds) - 2:
        raise TypeError("not the replies of the transaction's commands")
    if read.kind in ("range", "again"):
        if not isinstance(reply[0], int) or not all(isinstance(x, bytes) for x in reply[1:]):
            raise TypeError("not the replies of EXISTS and GETRANGE")
        return joined(reply[1:]) if reply[0] else None
    if read.kind == "open":
        if not isinstance(reply[0], int) or not isinstance(reply[1], int) or \
                not all(isinstance(x, bytes) for x in reply[2:]):
            raise TypeError("not the replies of EXISTS, STRLEN and GETRANGE")
        if not reply[0]:
            return None
        size = reply[1]
        start, stop = resolve_range(read.byte_range, size)
        if stop == start:
            return b""
        if len(reply) == 3 and len(reply[2]) == stop - start:
            return reply[2]
        return read._replace(kind="rest", cmds=[["MULTI"], ["STRLEN", read.key],
                                                *slices(read.key, start, stop, slice_bytes), ["EXEC"]],
                             expect=stop - start, span=(start, stop, size))
    # "rest": the range read again in slices; the same length, or the object was replaced
    if not isinstance(reply[0], int) or not all(isinstance(x, bytes) for x in reply[1:]):
        raise TypeError("not the replies of STRLEN and GETRANGE")
    start, stop, size = read.span
    if reply[0] == 0:
        return None  # deleted since the first read (it was longer than a slice: not empty)
    if reply[0] != size:
        return unsliced(read)  # replaced by another object meanwhile: read it whole, atomically
    return joined(reply[1:])


def trips(reads: list, trip_bytes: int = TRIP_BYTES) -> list:
    """``reads`` in consecutive groups, one round trip each: at most ``trip_bytes`` of
    known reply bytes per group, at least one read."""
    out: list = []
    size = 0
    for r in reads:
        if out and size + r.expect <= trip_bytes:
            out[-1].append(r)
            size += r.expect
        else:
            out.append([r])
            size = r.expect
    return out


__all__ = ["SLICE_BYTES", "TRIP_BYTES", "Read", "answer", "first_read", "slices", "trips", "unsliced"]
