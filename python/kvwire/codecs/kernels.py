"""Element kernels of the lossy codecs (spec/codecs.md), written as few whole-array numpy
passes: the spec's arithmetic (fp32, one round-to-nearest-even) is unchanged, only its cost.

Why not lookup tables: numpy's gather (``np.take``, fancy indexing) costs 1.5-2 ns an
element on this class of machine, several times a vectorized arithmetic pass (0.1-0.15 ns
for a one-byte-in, four-bytes-out pass). So fp8 codes become fp32 by bit placement and one
exact power-of-two multiply, packed codes become fp32 by shift-and-mask passes writing
straight into fp32. fp32 -> bf16 stays ml_dtypes' cast, written straight into the caller's
buffer: rounding by integer arithmetic on the uint32 view needs 5 passes and measured
slower (230 us against 120-190 us for 256 Ki elements).

Temporaries come from ``scratch``: per-thread buffers reused from chunk to chunk. A fresh
1 MiB numpy array costs its page faults on first touch (measured: the same pass 5-20x slower
on fresh memory than on reused memory), more than the arithmetic itself.

Every function here works on whole arrays of one chunk; ``quant`` decides the layout.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Any

import numpy as np

F32 = np.dtype("<f4")
U32 = np.dtype("<u4")
U16 = np.dtype("<u2")

# fp8 format -> (mantissa bits, exponent bias): code ``c`` with magnitude bits ``c & 0x7F``
# placed at fp32 bit ``23 - mantissa`` is the fp32 value times 2^(127 - bias) (subnormal
# codes too: they land on fp32 subnormals), so one power-of-two multiply, exact, restores it.
FP8_BITS = {"f8_e4m3fn": (3, 7), "f8_e5m2": (2, 15), "f8_e4m3fnuz": (3, 8)}
_LOCAL = threading.local()
POOL_LIMIT = 64 << 20  # bytes: larger temporaries are allocated per call


def scratch(slot: int, shape: Any, dtype: Any) -> np.ndarray:
    """A reusable uninitialized array for this thread: valid until the next call with the same
    ``slot``, so it must never leave the codec (results the caller keeps are fresh arrays)."""
    try:
        pool = _LOCAL.pool
    except AttributeError:
        pool = _LOCAL.pool = {}
    if type(shape) is int:
        shape = (shape,)
    dtype = np.dtype(dtype)
    n = math.prod(shape) * dtype.itemsize
    if n > POOL_LIMIT:  # not kept: a huge chunk would pin its temporaries for the thread's life
        return np.empty(shape, dtype)
    buf = pool.get(slot)
    if buf is None or len(buf) < n:
        buf = pool[slot] = np.empty(max(n, 64), np.uint8)
    view: np.ndarray = buf[:n].view(dtype).reshape(shape)
    return view


def f16_to_f32(raw: np.ndarray) -> np.ndarray:
    """fp32 values of f16 bit patterns (uint16) by one lookup in numpy's own conversion of all
    65536 of them: numpy's f16 cast costs ~4 ns an element on this machine (no F16C loop)."""
    return np.take(f16_table(), raw)


@functools.lru_cache(maxsize=1)
def f16_table() -> np.ndarray:
    """fp32 value of every f16 bit pattern, built on first use (256 KiB)."""
    return np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(F32)


def fp8_specials(codes: np.ndarray, fmt: str) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(NaN mask or None, +-infinity mask or None) of fp8 ``codes`` (uint8); scratch arrays."""
    work = scratch(1, codes.shape, np.uint8)
    mask = scratch(2, codes.shape, np.bool_)
    if fmt == "f8_e4m3fn":
        np.bitwise_and(codes, np.uint8(0x7F), out=work)
        np.equal(work, np.uint8(0x7F), out=mask)
        return (mask if mask.any() else None), None
    if fmt == "f8_e4m3fnuz":
        np.equal(codes, np.uint8(0x80), out=mask)
        return (mask if mask.any() else None), None
    np.bitwise_and(codes, np.uint8(0x7C), out=work)  # e5m2: exponent all ones
    np.equal(work, np.uint8(0x7C), out=mask)
    if not mask.any():
        return None, None
    mant = (codes & np.uint8(3)) != 0  # rare: fresh arrays
    nan = mask & mant
    inf = mask & ~mant
    return (nan if nan.any() else None), (inf if inf.any() else None)


def fp8_times(codes: np.ndarray, fmt: str, scale: np.ndarray, nan_mask: np.ndarray | None = None,
              inf_mask: np.ndarray | None = None) -> np.ndarray:
    """fp32 ``fp8_value(code) * scale`` (one fp32 rounding) for uint8 ``codes``; ``scale`` a
    positive fp32 array broadcastable to ``codes``. NaN codes give unspecified values (the
    caller writes canonical NaNs over them, KVW-LOSSY-4); infinity codes give infinity."""
    mbits, bias = FP8_BITS[fmt]
    # int8 -> int32 sign-extends: (c - 256 s) << (23 - mbits) is the magnitude bits with the
    # sign smeared over the bits above them; the mask keeps bit 31 and the magnitude
    u = scratch(0, codes.shape, np.int32)
    np.copyto(u, codes.view(np.int8), casting="unsafe")
    u <<= np.int32(23 - mbits)
    u &= np.int32(-0x80000000 | (0x7F << (23 - mbits)))
    v = u.view(F32)
    pow2 = np.float32(2.0 ** (127 - bias))
    scale = np.asarray(scale, F32)
    with np.errstate(over="ignore", invalid="ignore"):
        k = scale * pow2  # exact wherever finite: then (bits * k) rounds the exact product once
        if np.isfinite(k).all():
            np.multiply(v, k, out=v)
        else:  # a scale beyond 2^(bias + 1): two multiplies, the first exact
            np.multiply(v, pow2, out=v)
            np.multiply(v, scale, out=v)
    if inf_mask is not None:
        v[inf_mask] = np.where(codes[inf_mask] & 0x80, -np.inf, np.inf).astype(F32)
    return v


def unpack_f32(packed: np.ndarray, bits: int, n: int, offset: int = 0) -> np.ndarray | None:
    """The first ``n`` codes (least significant bits first, KVW-INT-4) of ``packed`` as fp32,
    minus ``offset``; ``None`` when padding bits after the last code are set."""
    v = scratch(0, n, F32)
    if bits == 3:
        return _unpack3(packed, n, v, offset)
    if bits == 8:
        np.copyto(v, packed[:n], casting="unsafe")
    else:  # spread the codes of each byte over the bytes of a wider word, then one cast
        per = 8 // bits
        nb = len(packed)
        if n % per and int(packed[nb - 1]) >> (bits * (n % per)):
            return None
        word = U16 if bits == 4 else U32
        w = scratch(3, nb, word)
        t = scratch(4, nb, word)
        np.copyto(w, packed, casting="unsafe")
        if bits == 4:
            np.left_shift(w, np.uint16(4), out=t)
            w |= t
            w &= np.uint16(0x0F0F)
        else:
            for k in (6, 12, 18):  # code j of the byte (at bit 2j) to bit 8j
                np.left_shift(w, np.uint32(k), out=t)
                t &= np.uint32(0x3 << (k + k // 3))
                w |= t
            w &= np.uint32(0x03030303)
        np.copyto(v, w.view(np.uint8)[:n], casting="unsafe")
    if offset:
        v -= np.float32(offset)
    return v


def to_header(v: np.ndarray, dtype: str, np_dtype: np.dtype[Any], dst: np.ndarray, nan_mask: np.ndarray | None = None,
              nan_bits: int = 0) -> None:
    """fp32 ``v`` rounded to the header dtype into ``dst`` (KVW-LOSSY-4): nearest-even,
    overflow to infinity, canonical NaN (``nan_bits``) where ``nan_mask``. May overwrite ``v``."""
    if dtype == "f32":
        dst[...] = v
    else:  # ml_dtypes' bf16 cast (round to nearest even) measured faster than ``to_bf16``
        with np.errstate(over="ignore"):
            np.copyto(dst.view(np_dtype), v, casting="unsafe")
    if nan_mask is not None:
        words: dict[int, np.dtype[Any]] = {2: U16, 4: U32}
        dst.view(words[np_dtype.itemsize])[nan_mask] = nan_bits


# ---------------------------------------------------------------------------------------
# Encoding kernels (the reference writer; readers need only the decoding side)
# ---------------------------------------------------------------------------------------

def f32_to_fp8(q: np.ndarray, fmt: str, fp8_dtype: Any) -> np.ndarray:
    """uint8 fp8 codes (a fresh array) of fp32 ``q`` (C-contiguous, already within +-largest
    finite, NaN allowed), rounded to nearest even exactly like ml_dtypes' cast (``fp8_dtype``),
    whose per-element conversion costs ~25 ns an element: normal results round by integer
    arithmetic on the fp32 bits, subnormal ones by one exact power-of-two multiply and
    ``rint``; NaNs go through ml_dtypes itself (their payload picks the e5m2 code)."""
    mbits, bias = FP8_BITS[fmt]
    sh = np.uint32(23 - mbits)
    u = q.view(U32)
    a = scratch(11, q.shape, U32)
    t = scratch(12, q.shape, U32)
    mask = scratch(13, q.shape, np.bool_)
    np.bitwise_and(u, np.uint32(0x7FFFFFFF), out=a)
    np.right_shift(a, sh, out=t)
    t &= np.uint32(1)
    t += np.uint32((1 << (22 - mbits)) - 1)
    t += a  # round half to even at bit ``sh``: the carry may reach the exponent
    t >>= sh
    t -= np.uint32((127 - bias) << mbits)  # fp32 exponent bias -> fp8 bias (wraps below: replaced next)
    small = np.less(a, np.uint32((128 - bias) << 23), out=mask)  # below the smallest normal (not NaN)
    nsmall = np.count_nonzero(small)
    if nsmall:
        k = np.float32(2.0 ** (bias - 1 + mbits))  # |q| * k is exact: the subnormal code before rounding
        if nsmall * 8 < small.size:
            at = np.flatnonzero(small)
            t.reshape(-1)[at] = np.rint(np.abs(q.reshape(-1)[at]) * k).astype(U32)
        else:
            sub = scratch(14, q.shape, F32)
            with np.errstate(invalid="ignore", over="ignore"):
                np.abs(q, out=sub)
                sub *= k
                np.rint(sub, out=sub)
            np.copyto(t, sub, where=small, casting="unsafe")
    code = t.astype(np.uint8)
    sign = scratch(15, q.shape, np.uint8)
    np.signbit(q, out=mask)
    np.left_shift(mask.view(np.uint8), np.uint8(7), out=sign)
    if fmt == "f8_e4m3fnuz":  # no negative zero (0x80 is its NaN): zero codes stay unsigned
        sign[code == 0] = 0
    code |= sign
    nan = np.greater(a, np.uint32(0x7F800000), out=mask)
    if nan.any():
        with np.errstate(invalid="ignore"):
            code[nan] = q[nan].astype(fp8_dtype).view(np.uint8)
    return code


def pack_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """Integer-valued fp32 codes ``q`` (each in [0, 2^bits)) as bytes (a fresh array), packed
    least significant bits first (KVW-INT-4): the codes of one byte are combined through a
    wider word view of the byte codes instead of strided byte access."""
    n = q.size
    if bits == 3:
        return _pack3(q, n)
    if bits == 8:
        out = np.empty(n, np.uint8)
        np.copyto(out, q.reshape(-1), casting="unsafe")
        return out
    per = 8 // bits
    c = scratch(16, n + (-n % per), np.uint8)
    c[n:] = 0
    np.copyto(c[:n], q.reshape(-1), casting="unsafe")
    word = U16 if bits == 4 else U32
    w = c.view(word)
    x = scratch(17, len(w), word)
    np.right_shift(w, word.type(6 if bits == 2 else 4), out=x)
    if bits == 2:
        t = scratch(18, len(w), word)
        for k in (12, 18):
            np.right_shift(w, np.uint32(k), out=t)
            x |= t
    x |= w  # the low byte now holds every code of the word at its place
    out = np.empty(len(w), np.uint8)
    np.copyto(out, x, casting="unsafe")
    return out


def group_extreme(block: np.ndarray, axis: int, fn: np.ufunc) -> np.ndarray:
    """``fn.reduce(block, axis)`` for ``fn`` np.maximum or np.minimum. Over the last axis of a
    C-contiguous block, numpy reduces each short row separately (~1.8 ns an element for rows
    of 32, measured); ``reduceat`` over the flat array gives the same values in ~1.3 ns."""
    G = block.shape[axis]
    if axis != block.ndim - 1 or G < 2 or not block.flags.c_contiguous:
        whole: np.ndarray = fn.reduce(block, axis=axis)
        return whole
    starts = np.arange(0, block.size, G)
    rows: np.ndarray = fn.reduceat(block.reshape(-1), starts).reshape(block.shape[:-1])
    return rows


def amax_of(mx: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Largest magnitude from a group's max and min (NaN propagates; +0, never -0)."""
    with np.errstate(invalid="ignore"):
        amax: np.ndarray = np.maximum(mx, -mn) + np.float32(0)
        return amax


def quantize(blk: np.ndarray, s: np.ndarray, z: np.ndarray | None, lo: int, hi: int, offset: int) -> np.ndarray:
    """In place: ``clip(rint((blk - z) / s), lo, hi) + offset``, code 0 (before the offset)
    where a group's scale is 0 (KVW-INT-6)."""
    if z is not None:
        np.subtract(blk, z, out=blk)
    pos = s > 0
    if pos.all():
        np.divide(blk, s, out=blk)
    else:
        np.divide(blk, s, out=blk, where=pos)
        np.copyto(blk, np.float32(0), where=~pos)
    np.rint(blk, out=blk)
    np.clip(blk, lo, hi, out=blk)
    if offset:
        blk += np.float32(offset)
    return blk


def _unpack3(packed: np.ndarray, n: int, v: np.ndarray, offset: int) -> np.ndarray | None:
    """3-bit codes (revision 1.2, KVW-ROT-3): 8 codes in each 3 bytes, a little-endian 24-bit
    word; ``None`` when a bit after the last code is set."""
    nb = len(packed)
    groups = -(-nb // 3)
    w: np.ndarray = np.zeros(groups * 3, np.uint32)
    w[:nb] = packed
    w = w.reshape(groups, 3)
    word = w[:, 0] | (w[:, 1] << np.uint32(8)) | (w[:, 2] << np.uint32(16))
    codes = np.empty((groups, 8), np.uint8)
    for j in range(8):
        np.copyto(codes[:, j], (word >> np.uint32(3 * j)) & np.uint32(7), casting="unsafe")
    flat = codes.reshape(-1)
    if flat[n:].any():  # the codes after the last one hold exactly the bits after it
        return None
    np.copyto(v, flat[:n], casting="unsafe")
    if offset:
        v -= np.float32(offset)
    return v


def _pack3(q: np.ndarray, n: int) -> np.ndarray:
    """Integer-valued fp32 codes (each < 8) as the 3-bit string of KVW-ROT-3 (a fresh array)."""
    groups = -(-n // 8)
    c: np.ndarray = np.zeros(groups * 8, np.uint32)
    np.copyto(c[:n], q.reshape(-1), casting="unsafe")
    c = c.reshape(groups, 8)
    word = np.zeros(groups, np.uint32)
    for j in range(8):
        word |= c[:, j] << np.uint32(3 * j)
    out = np.empty((groups, 3), np.uint8)
    for k in range(3):
        np.copyto(out[:, k], (word >> np.uint32(8 * k)) & np.uint32(0xFF), casting="unsafe")
    packed: np.ndarray = out.reshape(-1)[: -(-n * 3 // 8)].copy()
    return packed
