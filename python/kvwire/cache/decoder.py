"""Incremental decoding of the stream form, sans-IO (in the manner of h11).

Bytes go in with ``feed`` as they arrive from any transport; ``next_event`` returns a
``HeaderEvent`` as soon as the header is complete, a ``ChunkEvent`` as soon as each
chunk's body is complete and verified, and an ``EndEvent`` after the end frame, so
layer 0 can be used while later layers are still in flight. ``close`` is called at end
of input: it rejects a stream cut short and checks a file-form tail (index + trailer)
if one follows the end frame. Every check of the whole-buffer ``Reader`` applies, in
the order the bytes arrive.

Two input styles, one per decoder:

* ``feed(data)``: the transport reads into its own buffer and hands the bytes over; the
  decoder copies them into an internal bytearray; a raw body is copied out of it once, a
  zstd body is decompressed from it straight into the event's buffer or the placement.
* ``read_targets()`` / ``filled(n)``: the decoder names the writable buffers the next
  bytes must go to, exactly as many bytes as it needs next and never more, and the
  transport fills them with ``recv_into``, ``recvmsg_into`` or ``os.readv``. Bodies land
  in place: with ``placement``, a raw body goes straight into the caller's
  preallocated tensor (one kernel copy, no user-space copy); without it, into a buffer
  that the event owns. A compressed body is received into a buffer that grows as its
  bytes arrive (its declared length sizes nothing, KVW-LIM-8). Because the decoder never asks for bytes past the end frame, a
  transport can read back-to-back containers (KVW-STREAM-3) without over-reading.

``stop_at_end=True`` makes the end frame final: nothing after it is parsed as a
file-form tail, and bytes fed after it are kept in ``unused_data`` (the start of the
next container).

The event types are in ``cache.events``; placements and the read-into style (what
``read_targets`` / ``filled`` do) in ``cache.placement``, a mixin of ``StreamDecoder``.
Both are imported here (``IOV_MAX`` too), so this module stays the one to import them from.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import xxhash

from ..codecs import decode_chunk
from ..format import registry as R
from ..format.chunks import ChunkTable, check_record_fields, on_grid
from ..format.container import (
    END_MARKER,
    FRAME_SIZE,
    MAGIC,
    PREAMBLE_SIZE,
    RECORD_DTYPE,
    RECORD_STRUCT,
    TRAILER_MAGIC,
    TRAILER_SIZE,
    check_version,
    check_zero,
    next_frame_offset,
    parse_end_frame,
    parse_frame,
    parse_index,
    parse_preamble,
    parse_trailer,
    xxh3,
)
from ..format.errors import ChecksumError, LayoutError, LimitError, TruncatedError
from ..format.header import Header, parse_header
from ..format.limits import DEFAULT_MAX_DECODED_BYTES, MAX_CHUNKS, MAX_INDEX_LENGTH
from ..format.sparse import PositionOrder, decode_positions
from ..format.state import state_tensor_of
from .events import ChunkEvent, EndEvent, HeaderEvent, Placed
from .placement import (
    IOV_MAX,
    REC_CHECKSUM,
    REC_CODEC,
    REC_COMP,
    REC_COUNT,
    REC_HEAD0,
    REC_HEADS,
    REC_LAYER,
    REC_OFFSET,
    REC_RAW,
    REC_SPEC,
    REC_STORED,
    REC_T0,
    PlacementMixin,
    head_pieces,
)
from .tensors import view, writable

# The fast path takes only v1.0's plain codes; anything else goes to check_record_fields.
_PLAIN_COMPONENT = R.COMPONENTS["latent"]
_PLAIN_CODEC = R.CODECS["zstd"]


class StreamDecoder(PlacementMixin):
    """Feed bytes (or fill its read targets), take events. One decoder per container.

    ``placement(layer, component, token_start, token_count)`` may return the array or
    CPU tensor ``[heads, token_count, dim]`` (each head's rows contiguous, as in a token
    slice of a ``[heads, T, dim]`` layer tensor) that the chunk's raw bytes are written
    to; its ``ChunkEvent.data`` is then that object. It may instead return
    ``Placed(data, pieces)`` with the byte buffers precomputed (checked only for their
    total length). Returning None leaves the chunk to the decoder. A placed raw body is
    verified where it landed, before its event (KVW-STREAM-2).
    """

    def __init__(self, *, verify: bool = True, backend: str = "numpy",
                 max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES,
                 placement: Callable[[int, str, int, int], Any] | None = None, stop_at_end: bool = False):
        self.verify, self.backend, self.max_decoded_bytes = verify, backend, max_decoded_bytes
        self.placement, self.stop_at_end = placement, stop_at_end
        self._mode = None  # "feed" or "into", fixed by the first input call
        self._pending: deque = deque()  # events completed by read_targets(), not yet taken
        self._scratch = bytearray()  # structural bytes (preamble, header, frames) in "into" mode
        self._dst = None  # placement target of the current body
        self._dst_pieces: list | None = None  # its byte buffers
        self._pieces: list | None = None  # where the current body is received ("into" mode)
        self._got = 0  # body bytes received into _pieces
        self._cap = 0  # bytes _pieces hold now (a compressed body's buffer grows to stored_length, KVW-LIM-8)
        self.header: Header | None = None
        self._buf = bytearray()
        self._base = 0  # absolute offset of _buf[0]
        self._pos = 0  # absolute offset of the next structure to parse
        self._state = "preamble"
        self._hlen = self._hsum = self._minor = 0
        self._table: ChunkTable | None = None
        self._filled: bytearray | None = None  # one byte per slot: chunk seen
        self._rec: tuple | None = None  # fields of the current record (RECORD_STRUCT order)
        self._geom: tuple | None = None  # ChunkTable columns as lists, for _fast_slot
        self._records = bytearray()
        self._digest = xxhash.xxh3_64()
        self._decoded = 0
        self._end_at = 0

    # -- input -------------------------------------------------------------------------

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        self._set_mode("feed")
        self._append(data)

    def _append(self, data) -> None:
        if self._state == "closed":
            raise RuntimeError("input after close()")
        self._buf += data
        if self._state == "tail" and len(self._buf) > MAX_INDEX_LENGTH + 8 + TRAILER_SIZE:
            raise LayoutError("TRAILING_BYTES", "more bytes after the end frame than an index and trailer",
                              rule="KVW-LAYOUT-4")

    def _set_mode(self, mode: str) -> None:
        if self._mode != mode:
            if self._mode is not None:
                raise RuntimeError(f"this decoder takes input by {self._mode}; do not mix input styles")
            self._mode = mode

    @property
    def done(self) -> bool:
        """The end frame has been verified."""
        return self._state in ("tail", "done") or (self._state == "closed" and self._end_at > 0)

    @property
    def unused_data(self) -> bytes:
        """With ``stop_at_end``: bytes fed after the end frame (the next container's start)."""
        return bytes(self._buf) if self._state == "done" else b""

    @property
    def received(self) -> int:
        """Absolute number of bytes fed so far."""
        return self._base + len(self._buf)

    def _have(self, stop: int) -> bool:
        return self.received >= stop

    def _bytes(self, start: int, stop: int) -> bytes:
        return bytes(self._buf[start - self._base : stop - self._base])

    def _consume(self, upto: int) -> None:
        del self._buf[: upto - self._base]
        self._base = upto

    # -- events ------------------------------------------------------------------------

    def next_event(self) -> HeaderEvent | ChunkEvent | EndEvent | None:
        """The next complete event, or None until more bytes are fed."""
        if self._pending:
            return self._pending.popleft()
        return self._advance()

    def _advance(self):
        step = getattr(self, "_step_" + self._state, None)
        while step is not None:
            result = step()
            if result is not False:
                return result  # an event, or None (need more bytes)
            step = getattr(self, "_step_" + self._state, None)
        return None

    def events(self) -> Iterator[HeaderEvent | ChunkEvent | EndEvent]:
        """Every event that the bytes fed so far complete."""
        while (ev := self.next_event()) is not None:
            yield ev

    def _step_preamble(self):
        if not self._have(PREAMBLE_SIZE):
            head = bytes(self._buf[:4])
            if self.received >= 8 or not (MAGIC.startswith(head) or b"\x09KVW".startswith(head)):
                # judge the magic as soon as it cannot be the start of a (possibly mangled) magic
                try:
                    parse_preamble(self._bytes(0, self.received))  # rejects a bad magic early
                except TruncatedError:
                    pass
            return None
        self._minor, self._hlen, self._hsum = parse_preamble(self._bytes(0, PREAMBLE_SIZE))
        self._state = "header"
        return False

    def _step_header(self):
        end = PREAMBLE_SIZE + self._hlen
        if not self._have(end):
            return None
        data = self._bytes(PREAMBLE_SIZE, end)
        if xxh3(data) != self._hsum:
            raise ChecksumError("HEADER_CHECKSUM", "header bytes do not match the preamble's checksum",
                                rule="KVW-PRE-6")
        self.header = parse_header(data)
        check_version(self.header, self._minor)
        self._table = ChunkTable.of(self.header)
        if self._table.total > MAX_CHUNKS:
            raise LimitError("LIMIT_EXCEEDED", f"header implies {self._table.total} chunks", rule="KVW-LIM-1")
        self._filled = bytearray(self._table.total)
        t = self._table
        self._geom = (t.heads.tolist(), t.dims.tolist(), t.start.tolist(), t.stop.tolist(), t.base.tolist())
        if self.header.sparse is not None:  # per-head grids: every record takes the full check
            self._geom, self._order = None, PositionOrder(self.header.chunk_tokens)
        self._consume(end)
        self._pos = end
        self._state = "frame"
        return HeaderEvent(self.header)

    def _step_frame(self):
        frame_at = next_frame_offset(self._pos, self.header.alignment)
        if not self._have(frame_at + FRAME_SIZE):
            return None
        if frame_at > self._pos:
            check_zero(self._buf, self._pos - self._base, frame_at - self._base)
        marker, body = parse_frame(self._bytes(frame_at, frame_at + FRAME_SIZE), 0)
        if marker == END_MARKER:
            self._end(body)
            self._consume(frame_at + FRAME_SIZE)
            self._end_at = frame_at + FRAME_SIZE
            self._state = "done" if self.stop_at_end else "tail"
            return EndEvent(len(self._records) // 56)
        rec = RECORD_STRUCT.unpack(body)
        if len(self._records) // 56 >= MAX_CHUNKS:
            raise LimitError("LIMIT_EXCEEDED", f"more than {MAX_CHUNKS} chunk frames", rule="KVW-LIM-1")
        if rec[REC_OFFSET] != frame_at + FRAME_SIZE:
            raise LayoutError("BAD_OFFSET", f"frame at {frame_at} records body offset {rec[REC_OFFSET]}, "
                              f"expected {frame_at + FRAME_SIZE}", rule="KVW-LAYOUT-1")
        slot = self._fast_slot(rec)
        if slot is None:  # the authoritative check names the rule (or accepts an unusual valid record)
            slot = int(check_record_fields(self.header, self._table, np.frombuffer(body, RECORD_DTYPE, 1))[0])
        if self._filled[slot]:
            raise LayoutError("CHUNK_DUPLICATE", "two records describe the same chunk", rule="KVW-CHUNK-8")
        self._filled[slot] = 1
        self._decoded += rec[REC_RAW]
        if self._decoded > self.max_decoded_bytes:
            raise LimitError("DECODED_SIZE_LIMIT", f"stream decodes to more than {self.max_decoded_bytes} bytes",
                             rule="KVW-LIM-5")
        self._records += body
        self._digest.update(body)
        self._rec = rec
        self._consume(frame_at + FRAME_SIZE)
        self._pos = frame_at + FRAME_SIZE
        self._state = "body"
        self._dst, self._dst_pieces = self._place(rec)
        if self._mode == "into":
            self._receive_body(rec)
        return False

    def _fast_slot(self, rec: tuple) -> int | None:
        """The slot of a record that plainly meets KVW-CHUNK-1..7 (flags 0, all heads,
        canonical lengths), without numpy; None for anything else, which then goes to
        ``check_record_fields``. Accepts only what that check accepts (tested)."""
        (_, stored, raw, _, t0, n, layer, comp, codec, flags, head_start, head_count, r0, r1) = rec
        hdr = self.header
        if self._geom is None or hdr is None or layer >= hdr.num_layers or comp > _PLAIN_COMPONENT or flags or r0 \
                or r1 or head_start or codec > _PLAIN_CODEC or stored == 0:
            return None
        heads, dims, start, stop, base = self._geom
        h = heads[layer][comp]
        if h == 0 or head_count != h:
            return None
        C, lo = hdr.chunk_tokens, start[layer]
        if not on_grid(t0, n, C, lo, stop[layer]) or raw != h * n * dims[layer][comp] * hdr.itemsize:
            return None
        if codec == R.CODECS["raw"] and stored != raw:
            return None
        return base[layer][comp] + t0 // C - lo // C

    def _step_body(self):
        rec = self._rec
        off, length = rec[REC_OFFSET], rec[REC_STORED]
        if not self._have(off + length):
            return None
        layer, comp = rec[REC_LAYER], R.COMPONENT_BY_CODE[rec[REC_COMP]]
        codec = R.CODEC_BY_CODE[rec[REC_CODEC]]
        shape = self.header.arch.layers[layer].shape(comp, rec[REC_COUNT])
        shape = (rec[REC_HEADS], *shape[1:])  # all heads, or the one head of a sparse chunk
        dtype = self.header.dtype
        if comp == "state":  # one named state tensor in its own shape and dtype (spec/crossmodel.md)
            dtype, shape = state_tensor_of(self.header, layer, rec[REC_HEAD0])
        dst, pieces = self._dst, self._pieces
        in_buf = pieces is None and (dst is not None or codec != "raw")  # feed mode, read where it lies
        if pieces is not None:  # received in place ("into" mode)
            stored = pieces[0] if len(pieces) == 1 else None
        elif in_buf:  # verified and decoded in the stream buffer (a placement's raw body: copied once)
            stored = memoryview(self._buf)[off - self._base : off + length - self._base]
        else:
            stored = self._buf[off - self._base : off + length - self._base]  # the one copy out of the stream buffer
        try:
            if self.verify:
                hasher = xxhash.xxh3_64()
                for p in pieces if stored is None else (stored,):
                    hasher.update(p)
                if hasher.intdigest() != rec[REC_CHECKSUM]:
                    raise ChecksumError("BODY_CHECKSUM", f"chunk at {off} body checksum mismatch", rule="KVW-CSUM-1")
            placed = codec == "raw" and pieces is not None  # a raw body received straight into its placement
            if codec != "raw":
                out = None
                if not rec[REC_SPEC]:  # plain zstd decodes straight into its final buffer: no second copy
                    out = np.empty(rec[REC_RAW], np.uint8) if dst is None else self._dst_pieces or head_pieces(dst)
                    placed = dst is not None
                raw = decode_chunk(self.header, codec, rec[REC_SPEC], stored, rec[REC_RAW], shape, layer, rec[REC_T0],
                                   out, head=rec[REC_HEAD0] if self.header.sparse is not None else 0)
            else:
                raw = stored
            if comp == "positions":  # sparse: int64 positions, checked against the previous and next cells
                data = decode_positions(raw, rec[REC_COUNT], self.header.first_position,
                                        self.header.sparse.next_position)
                self._order.add(layer, rec[REC_HEAD0], rec[REC_T0], data)
            elif dst is not None:
                if not placed:  # decoded or received aside: one copy into the placement
                    src, at = memoryview(raw).cast("B"), 0
                    for p in self._dst_pieces or head_pieces(dst):
                        p[:] = src[at : at + p.nbytes]
                        at += p.nbytes
                    src.release()
                data = dst
            else:
                data = view(raw if codec == "raw" else writable(raw), 0, dtype, shape, self.backend)
        except BaseException:
            if in_buf:
                try:
                    stored.release()
                except BufferError:  # a frame of the propagating traceback still holds a view of it
                    pass
            raise
        if in_buf:
            stored.release()  # the stream buffer must be resizable again
        self._dst = self._pieces = self._dst_pieces = None
        self._consume(off + length)
        self._pos = off + length
        self._state = "frame"
        return ChunkEvent(layer, comp, rec[REC_T0], data, rec[REC_HEAD0])

    def _end(self, body: bytes) -> None:
        count, digest = parse_end_frame(body)
        n = len(self._records) // 56
        assert self._filled is not None  # set with the header
        if count != n or digest != self._digest.intdigest():
            raise LayoutError("INDEX_MISMATCH", "end frame count/digest disagree with the chunk frames",
                              rule="KVW-STREAM-1")
        if self._filled.count(0):
            raise LayoutError("CHUNK_MISSING", f"{self._filled.count(0)} chunks never arrived",
                              rule="KVW-CHUNK-8")

    # -- end of input ------------------------------------------------------------------

    def close(self) -> str:
        """End of input: returns the form ("stream" or "file") or raises if incomplete."""
        if self._state == "done":
            self._state = "closed"
            return "stream"
        if self._state != "tail":
            if self._state == "closed":
                raise RuntimeError("close() called twice")
            raise TruncatedError(f"input ended in state {self._state!r} after {self.received} bytes",
                                 rule="KVW-LAYOUT-3")
        self._state = "closed"
        tail = bytes(self._buf)
        if not tail:
            return "stream"
        if len(tail) < TRAILER_SIZE or tail[-8:] != TRAILER_MAGIC:
            raise LayoutError("TRAILING_BYTES", f"{len(tail)} bytes after the end frame", rule="KVW-LAYOUT-4")
        index_offset, index = parse_trailer(tail, self._end_at)
        if index_offset != self._end_at:
            raise LayoutError("INDEX_POSITION", "index does not start where the end frame ends", rule="KVW-FILE-2")
        if parse_index(index).tobytes() != bytes(self._records):
            raise LayoutError("INDEX_MISMATCH", "index records differ from the chunk frames", rule="KVW-FILE-4")
        return "file"


__all__ = ["ChunkEvent", "EndEvent", "HeaderEvent", "IOV_MAX", "Placed", "StreamDecoder"]
