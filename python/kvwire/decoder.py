"""Incremental decoding of the stream form, sans-IO (in the manner of h11).

Bytes go in with ``feed`` as they arrive from any transport; ``next_event`` returns a
``HeaderEvent`` as soon as the header is complete, a ``ChunkEvent`` as soon as each
chunk's body is complete and verified, and an ``EndEvent`` after the end frame, so
layer 0 can be used while later layers are still in flight. ``close`` is called at end
of input: it rejects a stream cut short and checks a file-form tail (index + trailer)
if one follows the end frame. Every check of the whole-buffer ``Reader`` applies, in
the order the bytes arrive.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from . import registry as R
from .chunks import ChunkTable, check_record_fields
from .codecs import decode_body
from .container import (
    END_MARKER, FRAME_SIZE, MAGIC, PREAMBLE_SIZE, RECORD_DTYPE, TRAILER_MAGIC, TRAILER_SIZE, check_zero,
    next_frame_offset, parse_end_frame, parse_frame, parse_index, parse_preamble, parse_trailer, xxh3,
)
from .errors import ChecksumError, LayoutError, LimitError, TruncatedError
from .header import Header, parse_header
from .limits import DEFAULT_MAX_DECODED_BYTES, MAX_CHUNKS, MAX_INDEX_LENGTH
from .reader import _check_version
from .tensors import view


@dataclass(frozen=True)
class HeaderEvent:
    header: Header


@dataclass(frozen=True)
class ChunkEvent:
    layer: int
    component: str
    token_start: int
    data: object  # [heads, tokens, head_dim], owned by the event


@dataclass(frozen=True)
class EndEvent:
    chunk_count: int


class StreamDecoder:
    """Feed bytes, take events. One decoder per container."""

    def __init__(self, *, verify: bool = True, backend: str = "numpy",
                 max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES):
        self.verify, self.backend, self.max_decoded_bytes = verify, backend, max_decoded_bytes
        self.header: Header | None = None
        self._buf = bytearray()
        self._base = 0  # absolute offset of _buf[0]
        self._pos = 0  # absolute offset of the next structure to parse
        self._state = "preamble"
        self._hlen = self._hsum = 0
        self._table: ChunkTable | None = None
        self._filled: np.ndarray | None = None
        self._rec: np.ndarray | None = None
        self._records = bytearray()
        self._digest = xxhash.xxh3_64()
        self._decoded = 0
        self._end_at = 0

    # -- input -------------------------------------------------------------------------

    def feed(self, data) -> None:
        if self._state == "closed":
            raise RuntimeError("feed() after close()")
        self._buf += data
        if self._state == "tail" and len(self._buf) > MAX_INDEX_LENGTH + 8 + TRAILER_SIZE:
            raise LayoutError("TRAILING_BYTES", "more bytes after the end frame than an index and trailer",
                              rule="KVW-LAYOUT-4")

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

    def next_event(self):
        """The next complete event, or None until more bytes are fed."""
        step = getattr(self, "_step_" + self._state, None)
        while step is not None:
            result = step()
            if result is not False:
                return result  # an event, or None (need more bytes)
            step = getattr(self, "_step_" + self._state, None)
        return None

    def events(self):
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
        _, self._hlen, self._hsum = parse_preamble(self._bytes(0, PREAMBLE_SIZE))
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
        minor = struct.unpack_from("<H", self._bytes(10, 12))[0]
        self.header = parse_header(data)
        _check_version(self.header, minor)
        self._table = ChunkTable.of(self.header)
        if self._table.total > MAX_CHUNKS:
            raise LimitError("LIMIT_EXCEEDED", f"header implies {self._table.total} chunks", rule="KVW-LIM-1")
        self._filled = np.zeros(self._table.total, bool)
        self._consume(end)
        self._pos = end
        self._state = "frame"
        return HeaderEvent(self.header)

    def _step_frame(self):
        frame_at = next_frame_offset(self._pos, self.header.alignment)
        if not self._have(frame_at + FRAME_SIZE):
            return None
        check_zero(self._buf, self._pos - self._base, frame_at - self._base)
        marker, body = parse_frame(self._bytes(frame_at, frame_at + FRAME_SIZE), 0)
        if marker == END_MARKER:
            self._end(body)
            self._consume(frame_at + FRAME_SIZE)
            self._end_at = frame_at + FRAME_SIZE
            self._state = "tail"
            return EndEvent(len(self._records) // 56)
        rec = np.frombuffer(body, RECORD_DTYPE, 1)
        if len(self._records) // 56 >= MAX_CHUNKS:
            raise LimitError("LIMIT_EXCEEDED", f"more than {MAX_CHUNKS} chunk frames", rule="KVW-LIM-1")
        if int(rec["offset"][0]) != frame_at + FRAME_SIZE:
            raise LayoutError("BAD_OFFSET", f"frame at {frame_at} records body offset {int(rec['offset'][0])}, "
                              f"expected {frame_at + FRAME_SIZE}", rule="KVW-LAYOUT-1")
        slot = int(check_record_fields(self.header, self._table, rec)[0])
        if self._filled[slot]:
            raise LayoutError("CHUNK_DUPLICATE", "two records describe the same chunk", rule="KVW-CHUNK-8")
        self._filled[slot] = True
        self._decoded += int(rec["raw_length"][0])
        if self._decoded > self.max_decoded_bytes:
            raise LimitError("DECODED_SIZE_LIMIT", f"stream decodes to more than {self.max_decoded_bytes} bytes",
                             rule="KVW-LIM-5")
        self._records += body
        self._digest.update(body)
        self._rec = rec
        self._consume(frame_at + FRAME_SIZE)
        self._pos = frame_at + FRAME_SIZE
        self._state = "body"
        return False

    def _step_body(self):
        rec = self._rec
        off, length = int(rec["offset"][0]), int(rec["stored_length"][0])
        if not self._have(off + length):
            return None
        stored = self._buf[off - self._base : off + length - self._base]  # the one copy out of the stream buffer
        if self.verify and xxh3(stored) != int(rec["checksum"][0]):
            raise ChecksumError("BODY_CHECKSUM", f"chunk at {off} body checksum mismatch", rule="KVW-CSUM-1")
        layer, comp = int(rec["layer"][0]), R.COMPONENT_BY_CODE[int(rec["component"][0])]
        codec = R.CODEC_BY_CODE[int(rec["codec"][0])]
        raw = stored if codec == "raw" else bytearray(decode_body(codec, stored, int(rec["raw_length"][0])))
        shape = self.header.arch.layers[layer].shape(comp, int(rec["token_count"][0]))
        data = view(raw, 0, self.header.dtype, shape, self.backend)
        self._consume(off + length)
        self._pos = off + length
        self._state = "frame"
        return ChunkEvent(layer, comp, int(rec["token_start"][0]), data)

    def _end(self, body: bytes) -> None:
        count, digest = parse_end_frame(body)
        n = len(self._records) // 56
        if count != n or digest != self._digest.intdigest():
            raise LayoutError("INDEX_MISMATCH", "end frame count/digest disagree with the chunk frames",
                              rule="KVW-STREAM-1")
        if not self._filled.all():
            raise LayoutError("CHUNK_MISSING", f"{int((~self._filled).sum())} chunks never arrived",
                              rule="KVW-CHUNK-8")

    # -- end of input ------------------------------------------------------------------

    def close(self) -> str:
        """End of input: returns the form ("stream" or "file") or raises if incomplete."""
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
