"""Body codecs of format v1 core: ``raw`` and ``zstd`` (spec section "Codec registry").

A codec maps the canonical raw bytes of one chunk to its stored bytes and back. Decoding
never produces more than the record's ``raw_length`` bytes and fails with a
``CodecError`` on anything else, so a decompression bomb costs at most the size the
header already declared (and the reader checked against its limit).
"""

from __future__ import annotations

import zstandard

from .errors import CodecError

DEFAULT_ZSTD_LEVEL = 3


def encode_body(codec: str, pieces, level: int = DEFAULT_ZSTD_LEVEL) -> list:
    """Stored form of a body given as a list of buffers whose concatenation is the raw body."""
    if codec == "raw":
        return list(pieces)
    if codec == "zstd":
        cctx = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)
        if len(pieces) == 1:
            return [cctx.compress(pieces[0])]
        size = sum(memoryview(p).nbytes for p in pieces)
        chunker = cctx.chunker(size=size, chunk_size=1 << 20)
        out = []
        for p in pieces:
            out.extend(chunker.compress(p))
        out.extend(chunker.finish())
        return [b"".join(out)]
    raise ValueError(f"unknown codec {codec!r}")


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
        data = zstandard.ZstdDecompressor().decompress(stored, max_output_size=raw_length, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CodecError("DECODE_FAILED", f"zstd: {exc}", rule="KVW-CODEC-2") from None
    if len(data) != raw_length:
        raise CodecError("DECODED_SIZE_MISMATCH", f"zstd produced {len(data)} bytes, record says {raw_length}",
                         rule="KVW-CODEC-2")
    if out is not None:
        memoryview(out).cast("B")[:] = data
        return out
    return data
