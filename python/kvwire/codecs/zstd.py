"""The ``raw`` and ``zstd`` body codecs (spec section 13, KVW-CODEC-*).

A codec maps the canonical raw bytes of one chunk to its stored bytes and back. Decoding
never produces more than the record's ``raw_length`` bytes and fails with a
``CodecError`` on anything else, so a decompression bomb costs at most the size the
header already declared (and the reader checked against its limit). The zstd frame
checks here are shared by every stage that stores zstd frames (byteplane planes,
chained lossless stages).
"""

from __future__ import annotations

import threading

import zstandard

from ..format.errors import CodecError

DEFAULT_ZSTD_LEVEL = 3


class BodyEncoder:
    """Encodes bodies with one codec, reusing its compression context across chunks."""

    def __init__(self, codec: str, level: int = DEFAULT_ZSTD_LEVEL):
        if codec not in ("raw", "zstd"):
            raise ValueError(f"unknown codec {codec!r}")
        self.codec = codec
        self._cctx = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False) \
            if codec == "zstd" else None

    def encode(self, pieces: list) -> list:
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


def decode_body(codec: str, stored, raw_length: int, out=None):
    """Raw bytes of a body. ``raw`` returns ``stored`` itself (a view); ``zstd`` decodes,
    into ``out`` when given (a writable buffer of raw_length bytes)."""
    if codec == "raw":
        if out is not None:
            memoryview(out).cast("B")[:] = memoryview(stored).cast("B")
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
        dict_id = zstandard.get_frame_parameters(stored).dict_id
    except zstandard.ZstdError as exc:
        raise CodecError("DECODE_FAILED", f"zstd frame header invalid: {exc}", rule="KVW-CODEC-2") from None
    if dict_id:
        raise CodecError("DECODE_FAILED", f"zstd frame needs dictionary {dict_id}", rule="KVW-CODEC-3")
    try:
        data = _decompressor().decompress(stored, max_output_size=raw_length, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CodecError("DECODE_FAILED", f"zstd: {exc}", rule="KVW-CODEC-2") from None
    if len(data) != raw_length:
        raise CodecError("DECODED_SIZE_MISMATCH", f"zstd produced {len(data)} bytes, record says {raw_length}",
                         rule="KVW-CODEC-2")
    if out is not None:
        memoryview(out).cast("B")[:] = data
        return out
    return data
