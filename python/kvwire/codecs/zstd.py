"""The ``raw`` and ``zstd`` body codecs (spec section 13, KVW-CODEC-*).

A codec maps the canonical raw bytes of one chunk to its stored bytes and back. Decoding
never produces more than the record's ``raw_length`` bytes and fails with a
``CodecError`` on anything else, so a decompression bomb costs at most the size the
header already declared (and the reader checked against its limit). The zstd frame
checks here are shared by every stage that stores zstd frames (byteplane planes,
chained lossless stages).

Revision 1.4 (KVW-CODEC-4, KVW-CODEC-5): every frame written here carries zstd's content
checksum (XXH64 of the decoded bytes), which libzstd verifies while decoding. The record's
checksum covers the compressed bytes only, and two zstd decoders (libzstd 1.5.4 and 1.5.7)
decode some corrupt frames to different bytes without noticing; the content checksum is what
makes every reader reject such a frame instead of returning its own reading of it.
"""

from __future__ import annotations

import threading
from typing import Any

import zstandard

from ..format.errors import CodecError

DEFAULT_ZSTD_LEVEL = 3
CHECKSUM_MINOR = 4  # KVW-CODEC-5: from this format_minor on, every zstd frame must carry a content checksum


def checksum_required(header: Any) -> bool:
    """Whether ``header``'s container must checksum every zstd frame (KVW-CODEC-5)."""
    required: bool = header.format_minor >= CHECKSUM_MINOR
    return required


class BodyEncoder:
    """Encodes bodies with one codec, reusing its compression context across chunks."""

    def __init__(self, codec: str, level: int = DEFAULT_ZSTD_LEVEL) -> None:
        if codec not in ("raw", "zstd"):
            raise ValueError(f"unknown codec {codec!r}")
        self.codec = codec
        self._cctx = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=True) \
            if codec == "zstd" else None

    def encode(self, pieces: list[Any]) -> list[Any]:
        """Stored form of a body given as buffers whose concatenation is the raw body."""
        if self._cctx is None:
            return list(pieces)
        return [self._cctx.compress(pieces[0] if len(pieces) == 1 else b"".join(pieces))]


_LOCAL = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    """One decompression context per thread (contexts are not thread-safe; making one per
    body costs more than decoding a small plane)."""
    d = getattr(_LOCAL, "zstd", None)
    if d is None:
        d = _LOCAL.zstd = zstandard.ZstdDecompressor()
    return d


def decode_body(codec: str, stored: Any, raw_length: int, out: Any = None, *, checksum_required: bool = False) -> Any:
    """Raw bytes of a body. ``raw`` returns ``stored`` itself (a view); ``zstd`` decodes,
    into ``out`` when given: a writable buffer of raw_length bytes, or a list of writable
    byte buffers whose concatenation is (for example one run per head of a placement).
    With ``out`` a zstd frame is decompressed straight into it, with no intermediate copy.
    ``checksum_required``: the container's format_minor is 4 or more, so a frame without a
    content checksum is rejected (KVW-CODEC-5); a checksum present is always verified."""
    targets = None if out is None else [memoryview(t).cast("B") for t in (out if isinstance(out, list) else [out])]
    if targets is not None and sum(t.nbytes for t in targets) != raw_length:
        raise ValueError(f"out holds {sum(t.nbytes for t in targets)} bytes, the body decodes to {raw_length}")
    if codec == "raw":
        if targets is not None:
            src, at = memoryview(stored).cast("B"), 0
            for t in targets:
                t[:] = src[at : at + t.nbytes]
                at += t.nbytes
            return out
        return stored
    try:
        declared = zstandard.frame_content_size(stored)
    except zstandard.ZstdError as exc:
        raise CodecError("DECODE_FAILED", f"zstd frame header invalid: {exc}", rule="KVW-CODEC-2") from None
    if declared != raw_length:
        raise CodecError("DECODED_SIZE_MISMATCH", f"zstd frame declares {declared} bytes, record says {raw_length}",
                         rule="KVW-CODEC-2")
    try:
        params = zstandard.get_frame_parameters(stored)
    except zstandard.ZstdError as exc:
        raise CodecError("DECODE_FAILED", f"zstd frame header invalid: {exc}", rule="KVW-CODEC-2") from None
    if params.dict_id:
        raise CodecError("DECODE_FAILED", f"zstd frame needs dictionary {params.dict_id}", rule="KVW-CODEC-3")
    if checksum_required and not params.has_checksum:
        raise CodecError("ZSTD_CHECKSUM_MISSING", f"zstd frame without a content checksum in a container of format "
                         f"1.{CHECKSUM_MINOR} or later", rule="KVW-CODEC-5")
    if targets is not None and _frame_end(stored, raw_length, params.has_checksum) == memoryview(stored).nbytes:
        _decompress_into(stored, raw_length, targets)
        return out
    try:  # one-shot (or an unusual frame: left-over input and short frames are judged by libzstd here)
        data = _decompressor().decompress(stored, max_output_size=raw_length, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CodecError("DECODE_FAILED", f"zstd: {exc}", rule="KVW-CODEC-2") from None
    if len(data) != raw_length:  # found while decompressing (the header check above passed): KVW-CODEC-2
        raise CodecError("DECODE_FAILED", f"zstd produced {len(data)} bytes, record and frame header say "
                         f"{raw_length}", rule="KVW-CODEC-2")
    if targets is not None:  # a frame of many small blocks: decoded aside, then copied
        src, at = memoryview(data), 0
        for t in targets:
            t[:] = src[at : at + t.nbytes]
            at += t.nbytes
        return out
    return data


_BLOCK_WALK = 4096  # decoded bytes per block assumed by the walk's bound (libzstd's block splitter stays above)


def _frame_end(stored: Any, raw_length: int, checksum: bool) -> int | None:
    """Where the zstd frame at the start of ``stored`` ends, from its block headers (and the
    4-byte content checksum when the frame header, already parsed by the caller, says it has
    one); None when it is not found within ``raw_length / 4096 + 16`` blocks, more than an
    encoder writes (the walk stays bounded; such frames take the one-shot path)."""
    mv = memoryview(stored).cast("B")
    n = mv.nbytes
    try:
        at = zstandard.frame_header_size(stored)
    except zstandard.ZstdError:
        return None
    for _ in range(raw_length // _BLOCK_WALK + 16):
        if at + 3 > n:
            return None
        b = mv[at] | mv[at + 1] << 8 | mv[at + 2] << 16
        kind, at = (b >> 1) & 3, at + 3
        if kind == 3:  # reserved block type
            return None
        at += 1 if kind == 1 else b >> 3  # RLE blocks store one byte
        if b & 1:  # last block
            return at + 4 * checksum
    return None


def _decompress_into(stored: Any, raw_length: int, targets: list[memoryview]) -> None:
    """Decompress one whole zstd frame (``stored`` holds exactly it) into ``targets``."""
    try:
        with _decompressor().stream_reader(stored, read_across_frames=False) as reader:
            got = 0
            for t in targets:
                at = 0
                while at < t.nbytes:
                    n = reader.readinto(t[at:])
                    if n == 0:  # blocks produce fewer bytes than the declared size: found while decompressing
                        raise CodecError("DECODE_FAILED", f"zstd produced {got + at} bytes, record and frame "
                                         f"header say {raw_length}", rule="KVW-CODEC-2")
                    at += n
                got += at
            if reader.read(1):
                raise CodecError("DECODE_FAILED", f"zstd output beyond {raw_length} bytes", rule="KVW-CODEC-2")
    except zstandard.ZstdError as exc:
        raise CodecError("DECODE_FAILED", f"zstd: {exc}", rule="KVW-CODEC-2") from None
