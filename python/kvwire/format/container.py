"""Byte layout of a container around the header: preamble, frames, end frame, trailer.

Pure functions over buffers (no I/O). Positions are fully determined by the header
length, the alignment and the stored body lengths (``next_frame_offset``), so "no holes,
no overlaps, aligned bodies" is a single equality per chunk rather than a set of
interval checks (spec KVW-LAYOUT-1).

::

    preamble (32) | header (N) | pad | frame (64) | body | pad | frame | body | ...
                  | pad | end frame (64) [ | index | pad | trailer (32) ]   <- file form
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np
import xxhash

from . import limits as L
from .errors import ChecksumError, LayoutError, LimitError, MagicError, TruncatedError, VersionError
from .header import Header, parse_header
from .registry import FORMAT_MAJOR, FORMAT_MINOR

# bytes, bytearray, memoryview, mmap or a uint8 array: whatever has the buffer protocol (typing.Buffer is 3.12+)
BytesLike = Any

MAGIC = b"\x89KVW\r\n\x1a\n"
PREAMBLE_SIZE = 32
FRAME_SIZE = 64
RECORD_SIZE = 56
TRAILER_SIZE = 32
CHUNK_MARKER = b"KWCH"
END_MARKER = b"KWEN"
TRAILER_MAGIC = b"KVWINDEX"
INDEX_IDENTIFIER = b"KVWI"

_PREAMBLE = struct.Struct("<8sHHIQII")  # magic, major, minor, header_length, header_checksum, reserved, check
_FRAME_HEAD = struct.Struct("<4sI")  # marker, frame_check
_END = struct.Struct("<QQ40x")  # chunk_count, records_digest, reserved
_TRAILER = struct.Struct("<QIIQ8s")  # index_offset, index_length, reserved, index_checksum, magic

# ChunkRecord (FlatBuffers struct, 56 bytes) as a numpy structured dtype: the index and
# every frame are read through this view, never field by field.
RECORD_DTYPE = np.dtype([
    ("offset", "<u8"), ("stored_length", "<u8"), ("raw_length", "<u8"), ("checksum", "<u8"),
    ("token_start", "<u4"), ("token_count", "<u4"), ("layer", "<u2"), ("component", "u1"),
    ("codec", "u1"), ("flags", "<u2"), ("head_start", "<u2"), ("head_count", "<u2"),
    ("reserved0", "<u2"), ("reserved1", "<u4"),
])
assert RECORD_DTYPE.itemsize == RECORD_SIZE
# The same fields as a struct, for one record at a time (a frame being built or parsed).
RECORD_STRUCT = struct.Struct("<QQQQIIHBBHHHHI")
assert RECORD_STRUCT.size == RECORD_SIZE


def xxh3(data: BytesLike) -> int:
    digest: int = xxhash.xxh3_64_intdigest(data)
    return digest


def check32(data: BytesLike) -> int:
    """Low 32 bits of XXH3-64: the self-check of the preamble and of every frame."""
    low: int = xxhash.xxh3_64_intdigest(data) & 0xFFFFFFFF
    return low


def align_up(n: int, a: int) -> int:
    return (n + a - 1) & ~(a - 1)


def next_frame_offset(prev_end: int, alignment: int) -> int:
    """Where the next frame starts: the latest point that still leaves its body aligned."""
    return align_up(prev_end + FRAME_SIZE, alignment) - FRAME_SIZE


# ---------------------------------------------------------------------------------------
# Preamble
# ---------------------------------------------------------------------------------------

def build_preamble(header: bytes, minor: int = FORMAT_MINOR) -> bytes:
    """The preamble of ``header``; ``minor`` is the header's ``format_minor`` (KVW-HDR-9, KVW-EVOL-12)."""
    head = _PREAMBLE.pack(MAGIC, FORMAT_MAJOR, minor, len(header), xxh3(header), 0, 0)
    return head[:28] + struct.pack("<I", check32(head[:28]))


def _diagnose_magic(first: bytes) -> MagicError:
    if first[:4] == MAGIC[:4] and first[4:6] == b"\n\x1a":
        return MagicError("TEXT_MODE_MANGLED", "CRLF became LF: the file went through a text-mode transfer", rule="KVW-PRE-1")
    if first[1:4] == b"KVW" and first[0] == 0x09:
        return MagicError("TEXT_MODE_MANGLED", "high bit stripped: the file went through a 7-bit channel", rule="KVW-PRE-1")
    if first[1:4] == b"KVW" and first[4:6] == b"\r\r":
        return MagicError("TEXT_MODE_MANGLED", "LF became CRLF: the file went through a text-mode transfer", rule="KVW-PRE-1")
    return MagicError("BAD_MAGIC", f"not a kvwire container (starts with {bytes(first[:8])!r})", rule="KVW-PRE-1")


def parse_preamble(buf: BytesLike) -> tuple[int, int, int]:
    """(minor, header_length, header_checksum) after the preamble checks (KVW-PRE-1..5)."""
    n = len(buf)
    first = bytes(buf[: min(n, 8)])
    if first != MAGIC[: len(first)]:
        raise _diagnose_magic(first)
    if n < PREAMBLE_SIZE:
        raise TruncatedError(f"preamble needs {PREAMBLE_SIZE} bytes, have {n}", needed=PREAMBLE_SIZE, rule="KVW-PRE-1")
    raw = bytes(buf[:PREAMBLE_SIZE])
    _, major, minor, hlen, hsum, reserved, check = _PREAMBLE.unpack(raw)
    if check32(raw[:28]) != check:
        raise ChecksumError("PREAMBLE_CHECKSUM", "preamble self-check mismatch", rule="KVW-PRE-4")
    if major != FORMAT_MAJOR:
        raise VersionError("UNSUPPORTED_VERSION", f"format {major}.{minor}; this reader implements major {FORMAT_MAJOR}",
                           rule="KVW-PRE-2")
    if reserved:
        raise LayoutError("RESERVED_NONZERO", "preamble reserved field is not zero", rule="KVW-PRE-3")
    if hlen > L.MAX_HEADER_LENGTH:
        raise LimitError("HEADER_TOO_LARGE", f"header length {hlen} exceeds {L.MAX_HEADER_LENGTH}", rule="KVW-PRE-5")
    return minor, hlen, hsum


def header_bytes(buf: BytesLike, hlen: int, hsum: int) -> bytes:
    """The header's bytes, checksum verified (KVW-PRE-6)."""
    end = PREAMBLE_SIZE + hlen
    if len(buf) < end:
        raise TruncatedError(f"header needs {end} bytes, have {len(buf)}", needed=end, rule="KVW-PRE-5")
    data = bytes(buf[PREAMBLE_SIZE:end])
    if xxh3(data) != hsum:
        raise ChecksumError("HEADER_CHECKSUM", "header bytes do not match the preamble's checksum", rule="KVW-PRE-6")
    return data


def check_version(header: Header, minor: int) -> None:
    """The header's format version is the preamble's (KVW-HDR-9)."""
    if (header.format_major, header.format_minor) != (FORMAT_MAJOR, minor):
        raise VersionError("VERSION_MISMATCH", f"header says {header.format_major}.{header.format_minor}, "
                           f"preamble {FORMAT_MAJOR}.{minor}", rule="KVW-HDR-9")


def read_header(buf: BytesLike, known: tuple[Header, BytesLike] | None = None) -> tuple[Header, int]:
    """(Header, header length) from the first bytes of a container: preamble, header bytes
    and version checked; ``TruncatedError.needed`` says how many bytes are missing.

    ``known``: ``(header, first_bytes)``, a Header already parsed from another copy of the
    same object's first bytes (a store reader that checked the header before fetching the
    object): when this buffer's preamble and header bytes equal those of ``first_bytes``,
    ``header`` is used and not parsed again (a header is a function of its bytes)."""
    minor, hlen, hsum = parse_preamble(buf)
    end = PREAMBLE_SIZE + hlen
    if known is not None and len(known[1]) >= end and len(buf) >= end and \
            memoryview(buf)[:end] == memoryview(known[1])[:end]:
        check_version(known[0], minor)
        return known[0], hlen
    header = parse_header(header_bytes(buf, hlen, hsum))
    check_version(header, minor)
    return header, hlen


# ---------------------------------------------------------------------------------------
# Frames
# ---------------------------------------------------------------------------------------

def build_frame(record: np.ndarray[Any, Any] | bytes | memoryview) -> bytes:
    """The 64-byte frame of a chunk: marker, check32 of the record, the 56-byte record."""
    body = record.tobytes() if not isinstance(record, bytes) else record
    return CHUNK_MARKER + struct.pack("<I", check32(body)) + body


def build_end_frame(chunk_count: int, records_digest: int) -> bytes:
    body = _END.pack(chunk_count, records_digest)
    return END_MARKER + struct.pack("<I", check32(body)) + body


def parse_frame(buf: BytesLike, pos: int) -> tuple[bytes, bytes]:
    """(marker, 56 frame bytes) of the frame at ``pos``, self-check verified (KVW-FRAME-1, -2)."""
    if pos + FRAME_SIZE > len(buf):
        raise TruncatedError(f"frame at {pos} runs past the end ({len(buf)} bytes)", needed=pos + FRAME_SIZE,
                             rule="KVW-LAYOUT-3")
    raw = bytes(buf[pos : pos + FRAME_SIZE])
    marker, check = _FRAME_HEAD.unpack_from(raw)
    if marker not in (CHUNK_MARKER, END_MARKER):
        raise LayoutError("BAD_FRAME_MARKER", f"no frame marker at {pos} (found {marker!r})", rule="KVW-FRAME-1")
    if check32(raw[8:]) != check:
        raise ChecksumError("FRAME_CHECKSUM", f"frame at {pos} fails its self-check", rule="KVW-FRAME-2")
    return marker, raw[8:]


def parse_end_frame(body: bytes) -> tuple[int, int]:
    count, digest = _END.unpack(body)
    if any(body[16:]):
        raise LayoutError("RESERVED_NONZERO", "end frame reserved bytes are not zero", rule="KVW-STREAM-1")
    return count, digest


def check_zero(buf: BytesLike, start: int, stop: int) -> None:
    """Padding is zero (KVW-LAYOUT-2): a container has exactly one byte representation."""
    if stop > start and np.frombuffer(buf, np.uint8, stop - start, start).any():
        raise LayoutError("NONZERO_PADDING", f"padding bytes [{start}, {stop}) are not zero", rule="KVW-LAYOUT-2")


# ---------------------------------------------------------------------------------------
# File-form index and trailer
# ---------------------------------------------------------------------------------------

def build_index(records: np.ndarray) -> bytes:
    """ChunkIndex FlatBuffer: root offset, identifier, then the table and its struct vector."""
    import flatbuffers

    from .fbs import ChunkIndex as fbIndex

    b = flatbuffers.Builder(64 + records.nbytes)
    b.StartVector(RECORD_SIZE, len(records), 8)
    b.head -= records.nbytes
    b.Bytes[b.head : b.head + records.nbytes] = records.tobytes()
    vec = b.EndVector()
    fbIndex.Start(b)
    fbIndex.AddRecords(b, vec)
    b.Finish(fbIndex.End(b), file_identifier=INDEX_IDENTIFIER)
    return bytes(b.Output())


def parse_index(data: bytes) -> np.ndarray:
    """The index's record vector as a structured numpy view (KVW-FILE-5)."""
    from .flatbuf import Buffer

    t = Buffer(data, INDEX_IDENTIFIER, "KVW-FILE-5").root()
    start, count = t.vector(0, RECORD_SIZE, 8, L.MAX_CHUNKS, required=True)
    return np.frombuffer(data, RECORD_DTYPE, count, start)


def build_trailer(index_offset: int, index: bytes) -> bytes:
    return _TRAILER.pack(index_offset, len(index), 0, xxh3(index), TRAILER_MAGIC)


def has_trailer(buf: BytesLike) -> bool:
    return len(buf) >= PREAMBLE_SIZE + TRAILER_SIZE and bytes(buf[-8:]) == TRAILER_MAGIC


def parse_trailer(buf: BytesLike, base: int = 0) -> tuple[int, bytes]:
    """(index_offset, index bytes) of a file-form container (KVW-FILE-1..3).

    ``buf`` ends with the trailer and holds the container from offset ``base`` on: the
    whole container for a random-access reader, only what follows the end frame for a
    sequential one.
    """
    n = len(buf)
    index_offset, index_length, reserved, index_sum, _ = _TRAILER.unpack(bytes(buf[n - TRAILER_SIZE :]))
    if reserved:
        raise LayoutError("RESERVED_NONZERO", "trailer reserved field is not zero", rule="KVW-FILE-1")
    if index_length > L.MAX_INDEX_LENGTH:
        raise LimitError("INDEX_TOO_LARGE", f"index length {index_length} exceeds {L.MAX_INDEX_LENGTH}", rule="KVW-FILE-2")
    start = index_offset - base
    if align_up(index_offset + index_length, 8) + TRAILER_SIZE != base + n or start < 0 \
            or index_offset < PREAMBLE_SIZE + FRAME_SIZE:
        raise LayoutError("INDEX_POSITION", f"index at {index_offset}+{index_length} does not end at the trailer",
                          rule="KVW-FILE-2")
    index = bytes(buf[start : start + index_length])
    if xxh3(index) != index_sum:
        raise ChecksumError("INDEX_CHECKSUM", "index bytes do not match the trailer's checksum", rule="KVW-FILE-3")
    check_zero(buf, start + index_length, n - TRAILER_SIZE)
    return index_offset, index


def trailer_fields(buf: bytes | memoryview | np.ndarray) -> tuple[int, int]:
    """(index_offset, index_length) that the trailer ending ``buf`` states, not yet checked
    (``parse_trailer`` checks them against the index): where a reader that holds only the
    end of a file-form container finds the index (KVW-FILE-1)."""
    if len(buf) < TRAILER_SIZE:
        raise TruncatedError(f"trailer needs {TRAILER_SIZE} bytes, have {len(buf)}", needed=TRAILER_SIZE,
                             rule="KVW-FILE-1")
    index_offset, index_length, _, _, _ = _TRAILER.unpack(bytes(buf[len(buf) - TRAILER_SIZE :]))
    return index_offset, index_length


def file_size(index_offset: int, index_length: int) -> int:
    """The size of a file-form container whose index is at ``index_offset``: the index ends
    it, padded to 8 bytes, then the trailer (KVW-FILE-2)."""
    return align_up(index_offset + index_length, 8) + TRAILER_SIZE


# ---------------------------------------------------------------------------------------
# Size bounds for a reader that fetches a container in ranges (a store's layer-wise loader)
# ---------------------------------------------------------------------------------------

def max_records(header: Header) -> int:
    """An upper bound on the records of a container of ``header`` whose token range starts
    anywhere: every component of every layer in at most ceil(tokens / chunk_tokens) + 1
    grid chunks (one more than a range that starts on a chunk boundary needs)."""
    return int(sum(len(s.components) for s in header.arch.layers) * (-(-header.token_count // header.chunk_tokens) + 1))


def tail_bound(header: Header) -> int:
    """Bytes from the end frame to the end of a file-form container of ``header``, at most:
    the end frame, an index of ``max_records`` records (56 bytes each, and its FlatBuffer
    table, under 256 bytes), its padding and the trailer. One suffix read of this many bytes
    gets a reader the whole index."""
    return FRAME_SIZE + RECORD_SIZE * max_records(header) + 256 + TRAILER_SIZE


def tensor_bytes_per_token(header: Header) -> int:
    """Tensor bytes of one token over every layer and component of ``header``."""
    return int(header.itemsize) * sum(math.prod(s.shape(c, 1)) for s in header.arch.layers for c in s.components)


def size_bound(header: Header, first_bytes: int) -> int:
    """The largest file-form container of ``header`` whose preamble, header and padding take
    ``first_bytes``: every tensor byte with 1% of codec overhead, then for each of at most
    ``max_records`` records a chunk frame, its index record, its alignment padding and an end
    frame's worth of slack, and 64 KiB for the index table and trailer. A trailer stating a
    bigger size is refused before anything of that size is allocated."""
    return int(first_bytes + tensor_bytes_per_token(header) * header.token_count * 101 // 100
               + max_records(header) * (2 * FRAME_SIZE + RECORD_SIZE + header.alignment) + (64 << 10))
