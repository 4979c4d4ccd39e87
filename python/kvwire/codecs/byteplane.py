"""Byte planes (spec/codecs.md, KVW-BPZ-*): lossless, for float data whose high bytes repeat.

The high byte of a bf16 element is its sign and 7 exponent bits, which take few values
in a KV cache; the low byte is mostly mantissa noise. Split apart, the high plane
compresses well with zstd and the low plane is stored as is (zstd would not shrink it and
would cost decode time). Body of width ``w`` over ``L`` input bytes, ``N = L // w``::

    u32 len[0] .. u32 len[w-1] | plane 0 | ... | plane w-1 | tail (L mod w bytes, as is)

Plane ``j`` holds byte ``w-1-j`` (little-endian byte index) of every element, so plane 0
is the most significant byte. ``len[j] == N``: the plane is stored as is; otherwise it is
one zstd frame (KVW-CODEC-2 rules; with a content checksum from revision 1.4, KVW-CODEC-4)
of content size ``N`` that is shorter than ``N``.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import zstandard

from ..format.errors import CodecError
from .kernels import scratch
from .zstd import decode_body

_WORD: dict[int, np.dtype[Any]] = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4")}


def split(raw: Any, width: int) -> tuple[list[np.ndarray], bytes]:
    """(planes, tail) of ``raw``: plane 0 the most significant byte of each element."""
    a = np.frombuffer(raw, np.uint8)
    n = len(a) // width
    tail = a[n * width:].tobytes()
    if width == 1:
        return [a[:n]], tail
    if width == 2:
        u = a[: 2 * n].view("<u2")
        return [(u >> 8).astype(np.uint8), u.astype(np.uint8)], tail
    m = a[: n * width].reshape(n, width)
    return [np.ascontiguousarray(m[:, width - 1 - j]) for j in range(width)], tail


# Plane compression: exponent planes are low-entropy but have few long repeats; zstd's fast
# strategy with 7-byte minimum matches codes them mostly as Huffman literals, which is both
# denser and several times faster to decode than the default short-match parsing.
PLANE_PARAMS = dict(strategy=zstandard.STRATEGY_FAST, min_match=7, search_log=1, hash_log=6, target_length=0)
SAMPLE = 16 << 10  # bytes of a plane tried first: a plane whose sample does not shrink is stored as is


def plane_compressor(level: int = 1) -> zstandard.ZstdCompressor:
    params = zstandard.ZstdCompressionParameters.from_level(level, write_content_size=1, write_checksum=1,
                                                            **PLANE_PARAMS)
    return zstandard.ZstdCompressor(compression_params=params)


def encode(raw: Any, width: int, cctx: zstandard.ZstdCompressor) -> list[Any]:
    """Stored pieces of ``raw`` (a bytes-like object) as a byteplane body."""
    planes, tail = split(raw, width)
    stored: list[Any] = []
    p: Any  # a plane: zstandard's stubs ask for bytes, any buffer is compressed
    for p in planes:
        frame = b""
        if len(p) and (len(p) <= SAMPLE or len(cctx.compress(p[:SAMPLE])) < SAMPLE * 0.97):
            frame = cctx.compress(p)
        stored.append(frame if 0 < len(frame) < len(p) else p)  # KVW-BPZ-2: zstd only when it is shorter
    lengths = struct.pack(f"<{width}I", *(len(memoryview(s).cast("B")) for s in stored))
    return [lengths, *stored, tail]


def decode(stored: Any, length: int, width: int, *, rule: str = "KVW-BPZ-3", out: Any = None,
           checksum_required: bool = False) -> np.ndarray:
    """The ``length`` bytes a byteplane body of element width ``width`` encodes (uint8 array),
    written into ``out`` (a writable buffer of ``length`` bytes) when given.
    ``checksum_required``: each zstd plane must carry a content checksum (KVW-CODEC-5)."""
    mv = memoryview(stored).cast("B")
    n, rest = divmod(length, width)
    head = 4 * width
    if len(mv) < head:
        raise CodecError("DECODE_FAILED", f"byteplane body of {len(mv)} bytes, shorter than its {width} plane "
                         "lengths", rule=rule)
    lens = struct.unpack_from(f"<{width}I", mv, 0)
    if head + sum(lens) + rest != len(mv):
        raise CodecError("DECODE_FAILED", f"byteplane body of {len(mv)} bytes; plane lengths {list(lens)} and a "
                         f"{rest}-byte tail need {head + sum(lens) + rest}", rule=rule)
    srcs, at = [], head
    for j, ln in enumerate(lens):
        piece = mv[at : at + ln]
        at += ln
        if ln > n:
            raise CodecError("DECODE_FAILED", f"plane {j}: {ln} stored bytes for {n} elements", rule=rule)
        if ln != n:  # a zstd frame of content size n (KVW-BPZ-2), into a reused buffer (no fresh pages)
            piece = decode_body("zstd", piece, n, out=scratch(30 + j, n, np.uint8), checksum_required=checksum_required)
        srcs.append(np.frombuffer(piece, np.uint8))
    if isinstance(out, np.ndarray) and out.ndim > 1:  # words in place (e.g. a token slice of a layer)
        assert width in _WORD and out.dtype.itemsize == width and out.size == n and not rest
        _combine(srcs, out.view(_WORD[width]), width)
        return out
    out = np.empty(length, np.uint8) if out is None else np.frombuffer(out, np.uint8, length)
    if width in _WORD:
        _combine(srcs, out[: n * width].view(_WORD[width]), width)
    else:
        planes = out[: n * width].reshape(n, width)
        for j, src in enumerate(srcs):
            planes[:, width - 1 - j] = src
    out[n * width:] = np.frombuffer(mv[at:], np.uint8)
    result: np.ndarray = out
    return result


def _combine(srcs: list[np.ndarray], words: np.ndarray, width: int) -> None:
    """Shift the planes into ``words`` (any shape and strides): plane 0 is the most significant byte."""
    shape = words.shape
    np.left_shift(srcs[0].reshape(shape), 8 * (width - 1), out=words, dtype=words.dtype)
    for j in range(1, width):
        shift = 8 * (width - 1 - j)
        src = srcs[j].reshape(shape)
        words |= np.left_shift(src, shift, dtype=words.dtype) if shift else src
