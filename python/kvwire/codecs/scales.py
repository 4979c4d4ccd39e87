"""Scale and zero choice of the lossy writers under KVW-LOSSY-5 (spec/codecs.md): directed
rounding to a scale dtype, the decoded value of one code exactly as a reader computes it,
and the per-group checks that a chunk decodes finite and not all-zero.

Everything here works on the (small) arrays of per-group parameters, never on the
elements of a chunk, so the checks cost a fraction of the quantization itself.
"""

from __future__ import annotations

import numpy as np

from ..format import registry as R
from ..format.errors import Error

F32 = np.dtype("<f4")
PRECISION = {"f16": 11, "bf16": 8, "f32": 24}  # significand bits
SMALLEST = {"f16": 2.0 ** -24, "bf16": 2.0 ** -133, "f32": 2.0 ** -149}  # smallest subnormal
LARGEST = {"f16": 65504.0, "bf16": float(np.float32(3.3895313892515355e38)), "f32": float(np.finfo(F32).max)}
_BITS = {2: np.uint16, 4: np.uint32}


class NotFaithful(Error, ValueError):
    """A chunk the lossy codec cannot encode faithfully (KVW-LOSSY-5/6); the writer stores
    it with a lossless pipeline instead."""

    code = "NOT_FAITHFUL"


def to_header(v: np.ndarray, dtype: str) -> np.ndarray:
    """fp32 -> header dtype as fp32 values (KVW-LOSSY-4 rounding; overflow -> inf)."""
    if dtype == "f32":
        return v
    with np.errstate(over="ignore"):
        return v.astype(R.DTYPES[dtype][2]).astype(F32)


def _step(r: np.ndarray, up: bool) -> np.ndarray:
    """One unit in the last place of ``r`` (a float array of its dtype) toward +inf / -inf."""
    u = r.view(_BITS[r.dtype.itemsize]).copy()
    sign = np.asarray(1 << (8 * r.dtype.itemsize - 1), u.dtype)
    neg = (u & sign) != 0
    mag = u & ~sign
    grow = ~neg if up else neg  # moving away from zero
    out = np.where(grow, u + 1, u - 1).astype(u.dtype)
    zero = mag == 0  # +-0 toward the other side: the smallest subnormal of that sign
    out[zero] = 1 if up else (sign | 1)
    nxt: np.ndarray = out.view(r.dtype)
    return nxt


def round_dir(v: np.ndarray, dtype: str, up: bool) -> np.ndarray:
    """fp32 ``v`` rounded to ``dtype`` toward +inf (``up``) or -inf, in that dtype."""
    with np.errstate(over="ignore", invalid="ignore"):
        r = v.astype(R.DTYPES[dtype][2])
        back = r.astype(F32)
    off = (back < v) if up else (back > v)
    if off.any():
        r = r.copy()
        r[off] = _step(r[off], up)
    return r


def round_up(v: np.ndarray, dtype: str) -> np.ndarray:
    """Non-negative ``v`` (fp32 or float64) rounded up to ``dtype`` (the fast form of
    ``round_dir``)."""
    with np.errstate(over="ignore", invalid="ignore"):
        r = np.asarray(v.astype(R.DTYPES[dtype][2]))
        if dtype != "f32" or v.dtype != F32:
            u = r.view(_BITS[r.dtype.itemsize])
            u += r.astype(v.dtype) < v
    return r


def safe(amax: np.ndarray, lo: float, hi: float) -> bool:
    """Every group's largest magnitude in ``[lo, hi]`` (NaN fails): no check is needed."""
    return bool(amax.size == 0 or (amax.min() >= lo and amax.max() <= hi))


def step_down(r: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``r`` (a non-negative scale array) one unit smaller where ``mask``."""
    r = r.copy()
    r[mask] = _step(r[mask], False)
    return r


def tolerance(need: np.ndarray, amax: np.ndarray, scale_dtype: str, dtype: str) -> np.ndarray:
    """Largest stored scale a group may use: twice the larger of the exact scale, the scale
    dtype's precision at the group's magnitude and the header dtype's smallest step."""
    floor: np.ndarray = 2 * np.maximum(np.maximum(need, amax * np.float32(2.0 ** -PRECISION[scale_dtype])),
                                       np.float32(SMALLEST[dtype]))
    return floor


def check(ok: np.ndarray, what: str) -> None:
    if not ok.all():
        n = int((~ok).sum())
        raise NotFaithful(f"{n} group(s) {what} (KVW-LOSSY-5): the chunk is stored losslessly instead")
