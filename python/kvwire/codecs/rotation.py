"""Revision 1.2's rotation stage and Gaussian codebook (spec/codecs.md section 8, KVW-ROT-*).

Outlier channels (the keys of Llama-class models) wreck 2-4 bit groups: one large channel
sets the scale of its whole group. A randomized Hadamard transform of each token's ``D``
channels spreads every channel over all of them, so the rotated values are close to
Gaussian and quantize well; the Lloyd-Max levels of ``N(0, 1)`` then place the codes where
those values are dense. Decoding must give every reader the same bytes, so the transform is
fp32 arithmetic in a fixed order (butterfly stages h = 1, 2, .., B/2, then one multiply by
``c_B`` and the exact sign flip) and the levels are a table, not a computation.

Both functions work in place on fp32 rows (``[..., D]``, C-contiguous); the forward one is
the writer's, the inverse one every reader's (KVW-ROT-6).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

import numpy as np

from ..format import registry as RG
from ..format.codec_specs import CodecSpec
from . import kernels as K
from . import scales as SC

F32 = np.dtype("<f4")
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64 (KVW-ROT-5)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_RSQRT2 = np.uint32(0x3F3504F3).view(np.float32)  # fp32(1 / sqrt(2))

# Lloyd-Max levels of N(0, 1), upper half, as fp32 bit patterns (KVW-ROT-4's table)
_LEVEL_BITS = {
    2: (0x3EE7D2C9, 0x3FC1555D),
    3: (0x3E7AF9F8, 0x3F418990, 0x3FAC0538, 0x4009B97A),
    4: (0x3E0379FD, 0x3EC6AE44, 0x3F28215E, 0x3F713D39, 0x3FA0CC2F, 0x3FCF1C25, 0x40046AC7, 0x402EE2BF),
}


def _levels(bits: int) -> np.ndarray:
    upper = np.array(_LEVEL_BITS[bits], np.uint32).view(F32)
    return np.concatenate([-upper[::-1], upper])


GAUSSIAN_LEVELS = {b: _levels(b) for b in _LEVEL_BITS}  # C_b[u], u = 0 .. 2^b - 1, ascending
# Midpoints between neighbouring levels, in fp32 (the writer's decision boundaries)
GAUSSIAN_MIDPOINTS = {b: ((c[:-1] + c[1:]) / np.float32(2)).astype(F32) for b, c in GAUSSIAN_LEVELS.items()}


def block_size(dim: int) -> int:
    """B: the largest power of two that divides ``dim`` (section 8.4)."""
    return dim & -dim


def c_b(block: int) -> np.float32:
    """fp32(1 / sqrt(B)) rounded to nearest: a power of two, times fp32(1 / sqrt(2)) for odd log2(B)."""
    k = block.bit_length() - 1
    if k % 2 == 0:
        even: np.float32 = np.float32(2.0 ** (-k // 2))
        return even
    odd: np.float32 = np.float32(np.ldexp(_RSQRT2, -((k - 1) // 2)))
    return odd


@lru_cache(maxsize=64)
def signs(seed: int, dim: int) -> np.ndarray:
    """sigma: ``dim`` entries +-1 (fp32) from SplitMix64 of ``seed`` (KVW-ROT-5); read-only."""
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + np.arange(1, dim + 1, dtype=np.uint64) * _GOLDEN  # wraps modulo 2^64
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        z = z ^ (z >> np.uint64(31))
    out: np.ndarray = np.where((z >> np.uint64(63)) == 1, np.float32(-1), np.float32(1)).astype(F32)
    out.flags.writeable = False
    return out


def _butterflies(y: np.ndarray, block: int) -> np.ndarray:
    """H_B applied to every block of ``block`` consecutive channels of the rows ``y`` [..., D],
    stage by stage (the pairs of a stage are disjoint; the stages keep their order). Works
    channel-major, so that every operation runs over long contiguous runs (a stage's pairs
    are then whole rows of the transposed array): returns the transformed rows as [D, N]."""
    if not y.flags.c_contiguous:
        raise ValueError("rotation rows must be C-contiguous: they are transformed in place")
    d = y.shape[-1]
    yt = np.ascontiguousarray(y.reshape(-1, d).T)  # [D, N]
    n = yt.shape[1]
    t = np.empty(d // 2 * n, F32)  # one stage's sums: every stage has D / 2 pairs of rows
    h = 1
    while h < block:
        v = yt.reshape(-1, 2, h * n)  # channels (i, i + h) of each 2h-aligned run: a run never crosses a block
        a, b = v[:, 0], v[:, 1]
        tt = t.reshape(a.shape)
        np.add(a, b, out=tt)
        np.subtract(a, b, out=b)
        a[...] = tt
        h *= 2
    return yt


def forward(y: np.ndarray, seed: int, signed: bool = True) -> np.ndarray:
    """The writer's rotation of fp32 rows ``y`` [..., D], in place: ``r = x * sigma``, the
    butterflies, then ``r * c_B`` (section 8.4, informative). ``signed=False``: every sign
    +1 (``rotation = sylvester``, KVW-TQ-3)."""
    d = y.shape[-1]
    blk = block_size(d)
    if signed:
        np.multiply(y, signs(seed, d), out=y)
    yt = _butterflies(y, blk)
    np.multiply(yt, c_b(blk), out=yt)
    y.reshape(-1, d)[...] = yt.T
    return y


def inverse(y: np.ndarray, seed: int, signed: bool = True) -> np.ndarray:
    """Every reader's inverse rotation of dequantized fp32 rows ``y`` [..., D], in place:
    the butterflies, then ``(y * c_B) * sigma`` (KVW-ROT-6; ``sigma = +1`` unless ``signed``,
    KVW-TQ-3)."""
    d = y.shape[-1]
    blk = block_size(d)
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf is NaN, as specified
        yt = _butterflies(y, blk)
        np.multiply(yt, c_b(blk), out=yt)
    if signed:
        np.multiply(yt, signs(seed, d)[:, None], out=yt)
    y.reshape(-1, d)[...] = yt.T
    return y


def gaussian_codes(r: np.ndarray, s: np.ndarray, bits: int, out: np.ndarray) -> np.ndarray:
    """The writer's codes for rotated values ``r`` with group scales ``s`` broadcast to
    ``r``'s shape: the nearest level of ``r / s``, a value on a midpoint taking the level of
    larger magnitude (the middle midpoint, 0, the positive level); codes ``2^(b-1)`` where
    the scale is 0. Written into ``out`` (fp32, integer-valued)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.divide(r, s, out=out)
    mids = GAUSSIAN_MIDPOINTS[bits]
    half = len(mids) // 2  # mids[half] is 0
    u = np.zeros(r.shape, np.uint8)
    for k, m in enumerate(mids):
        u += (t >= m) if k >= half else (t > m)
    u[np.broadcast_to(s == 0, r.shape)] = 1 << (bits - 1)
    np.copyto(out, u, casting="unsafe")
    return out


def gaussian_values(u: np.ndarray, bits: int) -> np.ndarray:
    """fp32 levels C_b[u] of integer codes ``u`` (KVW-ROT-4)."""
    return GAUSSIAN_LEVELS[bits][u.astype(np.intp)]


def gaussian_scales(y: np.ndarray, spec: CodecSpec, reduce: Callable[..., Any]) -> tuple[np.ndarray, np.ndarray, bool]:
    """The writer's Gaussian-codebook scales of rotated ``y`` [H, M, D] (section 8.4): each
    group's root mean square ``sqrt(q / n)`` in fp32, ``q`` the squares added one at a time
    in the group's order, rounded to ``scale_dtype`` to nearest. ``reduce`` is
    ``quant.group_reduce`` (groups shaped like the scales). Also returns which groups hold a
    nonzero element, and whether one of those has ``q`` below 2^-126: its squares lost
    precision or vanished (the scale may be 0), so the chunk must be checked on its decoded
    values (KVW-ROT-7)."""

    def stats(block: np.ndarray, axis: int) -> np.ndarray:  # (q, n, live) per group, in one pass
        acc = np.zeros(block.shape[:axis] + block.shape[axis + 1:], F32)
        with np.errstate(over="ignore", under="ignore"):
            for j in range(block.shape[axis]):  # one at a time: every writer gets the same sum
                e = np.take(block, j, axis=axis)
                acc += e * e
        live = (block != 0).any(axis=axis)
        return np.stack([acc, np.full_like(acc, block.shape[axis]), live.astype(F32)], axis=-1)

    r = reduce(y, spec, stats)
    q, n, live = r[..., 0], r[..., 1], r[..., 2] != 0
    suspect = bool((live & ~(q >= np.float32(2.0 ** -126))).any())
    return rms_to_dtype(np.sqrt(q / n), RG.DTYPES[spec.scale_dtype][2]), live, suspect


def rms_to_dtype(r: np.ndarray, dt: np.dtype) -> np.ndarray:
    """fp32 values rounded to nearest in the scale dtype (f16, bf16 or f32)."""
    with np.errstate(over="ignore"):
        return r.astype(dt)


def band(dim: int, scale_dtype: str, dtype: str) -> tuple[float, float]:
    """``[lo, hi]``: row magnitudes for which a rotated spec meets KVW-ROT-7 by construction
    (section 8.4): away from the scale dtype's and the header dtype's subnormals by 2^10
    sqrt(D), and below their largest values by 4 D (the inverse transform can gather a row's
    norm, at most sqrt(D) times its largest rotated value, into one channel)."""
    lo = 2.0 ** 10 * np.sqrt(dim) * max(SC.SMALLEST[scale_dtype], SC.SMALLEST[dtype], 2.0 ** -126)
    hi = min(SC.LARGEST[scale_dtype], SC.LARGEST[dtype], SC.LARGEST["f32"] ** 0.5) / (4 * dim)
    return lo, hi


def faithful(x: np.ndarray, decoded: np.ndarray) -> bool:
    """KVW-ROT-7 on a decoded chunk: every finite input element decodes to a finite value and
    every row [h, m, :] holding a nonzero element decodes to a row with a nonzero value."""
    xf = np.asarray(x, F32)
    d = np.asarray(decoded, F32)
    if not np.isfinite(d[np.isfinite(xf)]).all():
        return False
    live = (xf != 0).any(axis=-1)
    return bool(((d != 0).any(axis=-1) | ~live).all())


def gaussian_body(y: np.ndarray, spec: CodecSpec, dtype: str, pieces: list[Any], reduce: Callable[..., Any],
                  apply: Callable[..., Any]) -> tuple[list[Any], bool]:
    """Gaussian-codebook body of rotated (or plain) ``y`` (section 8.4): RMS scales, nearest
    levels; ``reduce`` and ``apply`` are ``quant.group_reduce`` and ``quant.group_apply``.
    Returns the pieces and whether the chunk must be checked on its decoded values
    (``gaussian_scales``). Without a rotation KVW-LOSSY-5 (b) holds per group: a group with
    a nonzero element whose largest level decodes to 0 refuses the chunk."""
    s, live, suspect = gaussian_scales(y, spec, reduce)
    sf = s.astype(F32)
    SC.check(np.isfinite(sf), f"have a root mean square beyond {spec.scale_dtype}")
    apply(y, [sf], spec, lambda blk, sc: gaussian_codes(blk, sc, spec.bits, blk))
    if spec.rotation == "none":
        top = reduce(np.abs(gaussian_values(y, spec.bits)), spec, lambda blk, ax: blk.max(axis=ax))
        with np.errstate(over="ignore", under="ignore"):
            SC.check(~live | (SC.to_header((top * sf).astype(F32), dtype) != 0), "with nonzero input would decode "
                     "to zero")
    body = pieces + [s.astype(s.dtype.newbyteorder("<")).view(np.uint8).reshape(-1), K.pack_codes(y, spec.bits)]
    return body, suspect


def check_encoded(X: np.ndarray, rows: np.ndarray | None, dim: int, spec: CodecSpec, dtype: str,
                  decoded: Callable[[], np.ndarray], force: bool = False) -> None:
    """KVW-ROT-7 for a chunk's quantized part ``X``: by construction when every nonzero row's
    largest magnitude (``rows``, computed here when None) is inside ``band``, else on
    ``decoded()``, the chunk's decoded quantized part. Raises ``NotFaithful``."""
    lo, hi = band(dim, spec.scale_dtype, dtype)
    if rows is None:
        rows = np.abs(np.asarray(X, F32)).max(axis=2)
    if not force and SC.safe(rows[rows != 0], lo, hi):
        return
    if not faithful(X, decoded()):
        raise SC.NotFaithful("the rotated chunk would decode a finite element to infinity or a nonzero row to "
                             "zeros (KVW-ROT-7, KVW-LOSSY-5): stored losslessly instead")
