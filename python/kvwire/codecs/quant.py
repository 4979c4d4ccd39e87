"""Lossy codecs ``fp8`` and ``int_affine`` (spec/codecs.md, KVW-LOSSY-*, KVW-FP8-*, KVW-INT-*).

A lossy body of a chunk ``[H, T, D]`` (tokens ``[t0, t1)`` of a layer holding ``[lo, hi)``)::

    sink part [H, P, D] | residual part [H, Q, D] | scales | zeros | codes

The first ``P`` and last ``Q`` tokens of the chunk that fall in the layer's first
``sink_tokens`` / last ``residual_tokens`` tokens stay in the header dtype; the ``M``
tokens between them are quantized. Decoding is exact arithmetic in fp32 followed by one
round-to-nearest-even to the header dtype, so every implementation produces the same
bytes; how a writer picks scales is its own business (amax / fmax, min-max).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..format import registry as R
from ..format.codec_specs import CodecSpec
from ..format.errors import CodecError
from . import kernels as K
from . import rotation as RT
from . import scales as SC
from . import turboquant as TQ
from .scales import NotFaithful as NotFaithful  # re-exported: the writer's refusal

F32 = np.dtype("<f4")
FP8_MAX = {"f8_e4m3fn": 448.0, "f8_e5m2": 57344.0, "f8_e4m3fnuz": 240.0}  # format -> largest finite value


class FP8Formats(Mapping[str, tuple[np.dtype[Any], float]]):
    """``FP8[format] -> (numpy dtype, largest finite value)``; the dtypes come from ml_dtypes, imported on
    first use (R.DTYPES)."""

    def __getitem__(self, fmt: str) -> tuple[np.dtype[Any], float]:
        return R.DTYPES[fmt].numpy, FP8_MAX[fmt]

    def __iter__(self) -> Iterator[str]:
        return iter(FP8_MAX)

    def __len__(self) -> int:
        return len(FP8_MAX)


FP8 = FP8Formats()

CANONICAL_NAN = {"bf16": 0x7FC0, "f16": 0x7E00, "f32": 0x7FC00000}  # KVW-LOSSY-4


def fp8_table(fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """(fp32 value of each of the 256 codes, which codes are NaN), by the decoding kernel."""
    codes = np.arange(256, dtype=np.uint8)
    nan, inf = K.fp8_specials(codes, fmt)
    nan = np.zeros(256, bool) if nan is None else nan.copy()
    v = K.fp8_times(codes, fmt, np.float32(1), nan, inf).copy()
    v[nan] = np.nan
    return v, nan


def token_split(spec: CodecSpec, t0: int, t1: int, lo: int, hi: int) -> tuple[int, int]:
    """(P, Q): full-precision tokens at the start and end of chunk [t0, t1) (KVW-LOSSY-1)."""
    sink_end = min(hi, lo + spec.sink_tokens)
    resid_start = max(lo, hi - spec.residual_tokens)
    qa = min(t1, max(t0, sink_end))  # first quantized token
    qb = max(qa, min(t1, max(t0, resid_start)))  # end of the quantized tokens
    return qa - t0, t1 - qb


@dataclass(frozen=True)
class Layout:
    """Byte layout of one lossy body (KVW-LOSSY-2)."""

    heads: int
    tokens: int
    dim: int
    itemsize: int
    P: int
    Q: int
    groups: tuple[int, ...]  # shape of the scales (and zeros) array
    param_size: int  # bytes per scale / zero
    zeros: bool
    bits: int

    @property
    def M(self) -> int:
        return self.tokens - self.P - self.Q

    @property
    def fp_bytes(self) -> int:
        return self.heads * (self.P + self.Q) * self.dim * self.itemsize

    @property
    def param_count(self) -> int:
        return int(np.prod(self.groups)) if self.M else 0

    @property
    def code_bytes(self) -> int:
        return -(-self.heads * self.M * self.dim * self.bits // 8)

    @property
    def length(self) -> int:
        return self.fp_bytes + self.param_count * self.param_size * (2 if self.zeros else 1) + self.code_bytes


def layout(spec: CodecSpec, dtype: str, heads: int, dim: int, t0: int, t1: int, lo: int, hi: int) -> Layout:
    P, Q = token_split(spec, t0, t1, lo, hi)
    M = t1 - t0 - P - Q
    itemsize = R.DTYPES[dtype][1]
    groups: tuple[int, ...]
    if spec.codec == "fp8":
        groups = {"tensor": (1,), "head": (heads,), "token": (heads, M)}[spec.scale_granularity]
        return Layout(heads, t1 - t0, dim, itemsize, P, Q, groups, 4, False, 8)
    G = spec.group_size
    if spec.group_axis == "tokens":
        groups = (heads, -(-M // G), dim)
    else:
        groups = (heads, M, -(-dim // G))
    return Layout(heads, t1 - t0, dim, itemsize, P, Q, groups, R.DTYPES[spec.scale_dtype][1], not spec.symmetric,
                  spec.bits)


# ---------------------------------------------------------------------------------------
# Groups: a reduction and a broadcast over (full groups, partial tail group)
# ---------------------------------------------------------------------------------------

def _parts(n: int, G: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(start, stop, first group, group count, group size) of the full groups and the tail."""
    full = n // G
    if full:
        yield 0, full * G, 0, full, G
    if n % G:
        yield full * G, n, full, 1, n % G


def _axis(spec: CodecSpec) -> int:
    return 1 if spec.group_axis == "tokens" else 2


def group_reduce(y: np.ndarray, spec: CodecSpec, fn: Callable[[np.ndarray, int], np.ndarray]) -> np.ndarray:
    """``fn(block, axis)`` over each group of ``y`` [H, M, D]; result shaped like the scales."""
    a, G = _axis(spec), spec.group_size
    out = []
    for s, e, _, ng, gs in _parts(y.shape[a], G):
        idx = (slice(None),) * a + (slice(s, e),)
        block = y[idx].reshape(y.shape[:a] + (ng, gs) + y.shape[a + 1:])
        out.append(fn(block, a + 1))
    reduced: np.ndarray = np.concatenate(out, axis=a) if len(out) > 1 else out[0]
    return reduced


def group_apply(y: np.ndarray, params: list[Any], spec: CodecSpec, fn: Callable[..., np.ndarray]) -> None:
    """In place: ``y_block = fn(y_block, *param_blocks)`` with each group's parameters broadcast."""
    a, G = _axis(spec), spec.group_size
    for s, e, g0, ng, gs in _parts(y.shape[a], G):
        idx = (slice(None),) * a + (slice(s, e),)
        shape = y.shape[:a] + (ng, gs) + y.shape[a + 1:]
        pshape = y.shape[:a] + (ng, 1) + y.shape[a + 1:]
        pidx = (slice(None),) * a + (slice(g0, g0 + ng),)
        block = y[idx].reshape(shape)
        r = fn(block, *(p[pidx].reshape(pshape) for p in params))
        if r is not block or not np.may_share_memory(block, y):  # fn returned a new array (or worked on a copy)
            y[idx] = r.reshape(y[idx].shape)


# ---------------------------------------------------------------------------------------
# Bit packing, least significant bits first (KVW-INT-4)
# ---------------------------------------------------------------------------------------

def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes (each < 2^bits) as bytes, least significant bits first (a fresh array)."""
    return K.pack_codes(codes, bits)


def unpack(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """The first ``n`` codes of ``packed`` (uint8); non-zero padding bits are refused."""
    v = K.unpack_f32(packed, bits, n)
    if v is None:
        raise CodecError("DECODE_FAILED", "padding bits after the last code are not zero", rule="KVW-INT-4")
    codes: np.ndarray = v.astype(np.uint8)
    return codes


# ---------------------------------------------------------------------------------------
# Decoding (normative arithmetic)
# ---------------------------------------------------------------------------------------

def _to_dtype(v: np.ndarray, dtype: str, nan_mask: np.ndarray | None = None) -> np.ndarray:
    """fp32 -> header dtype, round half to even; NaN results canonical (KVW-LOSSY-4)."""
    out = np.empty(v.shape, R.DTYPES[dtype][2])
    K.to_header(np.array(v, F32), dtype, out.dtype, out, nan_mask, CANONICAL_NAN[dtype])
    return out


_PARAM_RULES: dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]] = {  # which parameter values a reader accepts
    "positive": ("finite and > 0", lambda p: ~np.isfinite(p) | ~(p > 0)),
    "nonnegative": ("finite with the sign bit clear", lambda p: ~np.isfinite(p) | np.signbit(p)),
    "finite": ("finite", lambda p: ~np.isfinite(p)),
}


def _params(body: np.ndarray, at: int, lay: Layout, dtype: np.dtype[Any], rule: str, check: str) -> tuple[np.ndarray, int]:
    n = lay.param_count
    raw = body[at : at + n * lay.param_size]
    p = (K.f16_to_f32(raw.view("<u2")) if dtype == np.float16 else raw.view(dtype.newbyteorder("<")).astype(F32))
    p = p.reshape(lay.groups)
    what, test = _PARAM_RULES[check]
    bad = test(p)
    if bad.any():
        i = int(np.argmax(bad.reshape(-1)))
        raise CodecError("DECODE_FAILED", f"parameter {i} ({float(p.reshape(-1)[i])!r}) is not {what}", rule=rule)
    return p, at + n * lay.param_size


def decode(spec: CodecSpec, body: Any, lay: Layout, dtype: str, out: np.ndarray | Any = None) -> np.ndarray:
    """[H, T, D] in the header dtype from a lossy body of exactly ``lay.length`` bytes
    (written into the buffer ``out`` when given)."""
    b = np.frombuffer(body, np.uint8)
    if len(b) != lay.length:
        raise CodecError("DECODE_FAILED", f"{spec.codec} body of {len(b)} bytes, its geometry needs {lay.length}",
                         rule="KVW-LOSSY-2")
    H, T, D, P, Q, M = lay.heads, lay.tokens, lay.dim, lay.P, lay.Q, lay.M
    np_dtype = R.DTYPES[dtype][2]
    if out is None:
        out = np.empty((H, T, D), np_dtype)
    elif isinstance(out, np.ndarray) and out.ndim == 3:  # in place (e.g. a token slice of a layer)
        out = out.view(np_dtype)
    else:
        out = np.frombuffer(out, np_dtype, H * T * D).reshape(H, T, D)
    n_sink = H * P * D * lay.itemsize
    out[:, :P] = b[:n_sink].view(np_dtype).reshape(H, P, D)
    out[:, T - Q:] = b[n_sink : lay.fp_bytes].view(np_dtype).reshape(H, Q, D)
    if not M:
        return out
    at = lay.fp_bytes
    dst = out[:, P : P + M]
    if spec.codec == "fp8":
        scales, at = _params(b, at, lay, F32, "KVW-FP8-3", "positive")
        codes = b[at:].reshape(H, M, D)
        nan, inf = K.fp8_specials(codes, spec.fp8_format)
        s = scales.reshape({"tensor": (1, 1, 1), "head": (H, 1, 1), "token": (H, M, 1)}[spec.scale_granularity])
        v = K.fp8_times(codes, spec.fp8_format, s, nan, inf)
        K.to_header(v, dtype, np_dtype, dst, nan, CANONICAL_NAN[dtype])
        return out
    sd = R.DTYPES[spec.scale_dtype][2]
    scales, at = _params(b, at, lay, sd, "KVW-INT-3", "nonnegative")
    zeros = None
    if lay.zeros:
        zeros, at = _params(b, at, lay, sd, "KVW-INT-3", "finite")
    if spec.codebook == "turboquant":  # revision 1.3 (KVW-TQ-2)
        TQ.check_geometry(spec, D)
    q = K.unpack_f32(b[at:], spec.bits, H * M * D, (1 << (spec.bits - 1)) if spec.symmetric and spec.codebook ==
                     "uniform" else 0)
    if q is None:
        raise CodecError("DECODE_FAILED", "padding bits after the last code are not zero",
                         rule="KVW-ROT-3" if spec.bits == 3 else "KVW-INT-4")
    q = q.reshape(H, M, D)
    with np.errstate(over="ignore", invalid="ignore"):  # beyond the largest finite: infinity, as specified
        if spec.codebook == "turboquant":  # the normalised levels times each row's norm (KVW-TQ-4)
            q = TQ.values(q, scales.reshape(H, M, 1).astype(F32), spec.bits)
        elif spec.symmetric:  # revision 1.2: the gaussian levels C_b[u] times the scale (KVW-ROT-4)
            q = RT.gaussian_values(q, spec.bits) if spec.codebook == "gaussian" else q
            group_apply(q, [scales], spec, lambda blk, s: np.multiply(blk, s, out=blk))
        else:  # two fp32 roundings, no FMA (KVW-LOSSY-3), in place
            group_apply(q, [scales, zeros], spec, lambda blk, s, z: np.add(np.multiply(blk, s, out=blk), z, out=blk))
    if spec.rotation != "none":  # back from the rotated basis, row by row (KVW-ROT-6, KVW-TQ-3)
        RT.inverse(q, spec.rotation_seed, signed=spec.rotation == "hadamard")
    K.to_header(q, dtype, np_dtype, dst)
    return out


# ---------------------------------------------------------------------------------------
# Encoding (the reference writer's choices; readers need only ``decode``)
# ---------------------------------------------------------------------------------------

def _fp8_scales(amax: np.ndarray, fmax: float, dt: Any, dtype: str) -> np.ndarray:
    """fp32 scales ``amax / fmax`` (KVW-FP8-5); where a group is near the header's largest or
    smallest values, adjusted so that ``amax / scale <= fmax``, ``fmax * scale`` is finite in
    the header dtype and the largest element does not decode to 0 (KVW-LOSSY-5)."""
    f = np.float32(fmax)
    with np.errstate(all="ignore"):
        s: np.ndarray = (amax / f).astype(F32)
        if SC.safe(amax, max(2.0 ** -125 * fmax, 4 * SC.SMALLEST[dtype]), SC.LARGEST[dtype] / 4):
            return s  # every scale normal in fp32 and far from overflow: nothing to adjust
        live = amax > 0
        s[live & (s == 0)] = np.float32(SC.SMALLEST["f32"])  # underflow: the smallest scale
        up = live & (amax / s > f)  # rounded down: amax would saturate
        s[up] = np.nextafter(s[up], np.float32(np.inf))
        over = ~np.isfinite(SC.to_header(f * s, dtype))
        s[over] = np.nextafter(s[over], np.float32(0))
        s[~live | ~np.isfinite(s)] = 1.0  # all-zero groups: scale 1
        SC.check(np.isfinite(SC.to_header(f * s, dtype)), f"would decode {fmax} * scale to infinity")
        top = np.clip(amax / s, 0, f).astype(dt).astype(F32) * s
        SC.check(~live | (SC.to_header(top, dtype) != 0), "with nonzero input would decode to zero")
    return s


def _int_params(y: np.ndarray, spec: CodecSpec, dtype: str) -> tuple[np.ndarray, Any]:  # zeros: an array or None
    """(scales, zeros or None) in ``scale_dtype`` for [H, M, D] ``y`` (KVW-INT-6,
    KVW-LOSSY-5): min-max (amax) scales rounded up, so that every element fits the codes.
    Groups near the header's largest or smallest values are checked: the scale is one unit
    smaller where the top code would overflow the header dtype, and the chunk is refused
    (``NotFaithful``) where a group would still decode to infinity or to zero, or where its
    stored scale is coarser than ``scales.tolerance``."""
    b, sd = spec.bits, spec.scale_dtype
    with np.errstate(all="ignore"):
        if spec.symmetric:
            qmax = np.float32((1 << (b - 1)) - 1)
            a = np.abs(y, out=K.scratch(19, y.shape, F32))
            amax = group_reduce(a, spec, lambda blk, ax: K.group_extreme(blk, ax, np.maximum))
            need, z, zf, big = amax / qmax, None, np.float32(0), amax
        else:
            qmax = np.float32((1 << b) - 1)
            mn = group_reduce(y, spec, lambda blk, ax: K.group_extreme(blk, ax, np.minimum))
            mx = group_reduce(y, spec, lambda blk, ax: K.group_extreme(blk, ax, np.maximum))
            amax = np.maximum(-mn, mx)  # NaN propagates: non-finite input fails ``safe``
            z = mn.astype(R.DTYPES[sd][2])  # to nearest: off by at most 2^-p * amax far from the extremes
            zf = z.astype(F32)
            fit = (mx - zf) / qmax
            need = np.where(fit > 0, fit, 0)  # +0 (never -0: KVW-INT-3) where the zero rounded above max
        s = SC.round_up(need, sd)
        PREC = SC.PRECISION[sd]
        lo = 2.0 ** PREC * SC.SMALLEST[sd]  # amax from which a scale's rounding costs at most 2^-p * amax
        if SC.safe(amax, max(lo, 4 * SC.SMALLEST[dtype]), min(SC.LARGEST[dtype], SC.LARGEST[sd]) / 4):
            return s, z  # no group near an extreme: finite, not all-zero and within tolerance
        SC.check(np.isfinite(amax), "hold NaN or infinity (KVW-INT-6)")
        if not spec.symmetric:  # the zero rounded down, so that the codes absorb its rounding
            need = (mx - mn) / qmax  # the exact step, for the tolerance
            big = np.where(mx >= -mn, mx, mn)  # the element of largest magnitude
            z = SC.round_dir(mn, sd, up=False)
            low = ~np.isfinite(SC.to_header(z.astype(F32), dtype))  # past the header's range: round up
            z[low] = SC.round_dir(mn[low], sd, up=True)
            zf = z.astype(F32)
            SC.check(np.isfinite(zf) & np.isfinite(SC.to_header(zf, dtype)) & (zf - mn <= amax * np.float32(
                2.0 ** (1 - PREC))), f"have a minimum beyond {sd} or {dtype}")
        f64 = np.float64  # the quotient rounded up once, from its exact value (fp32 may underflow)
        s = SC.round_up((amax.astype(f64) if spec.symmetric else np.maximum(mx.astype(f64) - zf, 0)) / qmax, sd)
        top: Callable[[np.ndarray], np.ndarray] = lambda sc: SC.to_header(qmax * sc.astype(F32) + zf, dtype)
        over = ~np.isfinite(top(s)) & np.isfinite(s)
        if over.any():
            s = SC.step_down(s, over)
        sf = s.astype(F32)
        SC.check(np.isfinite(sf) & np.isfinite(top(s)), f"span more than {sd} scales or {dtype} can decode")
        SC.check(sf <= SC.tolerance(need, amax, sd, dtype), f"need a scale finer than {sd} holds (2^-{PREC})")
        code = np.clip(np.rint(np.divide(big - zf, sf, out=np.zeros_like(sf), where=sf > 0)),
                       -qmax if spec.symmetric else 0, qmax)
        SC.check((big == 0) | (SC.to_header(code * sf + zf, dtype) != 0), "with nonzero input would decode "
                 "to zero")
    return s, z


def encode(spec: CodecSpec, x: np.ndarray, lay: Layout, dtype: str | None = None, keep_nonfinite: bool = False) -> list[Any]:
    """Pieces of the lossy body of chunk ``x`` [H, T, D] (header dtype ``dtype``, by default
    the one of ``x``). Raises ``NotFaithful`` (a ``ValueError``) for a chunk that KVW-LOSSY-5
    forbids or, unless ``keep_nonfinite`` (fp8 only: KVW-FP8-5 saturation), whose quantized
    part holds NaN or infinity (KVW-LOSSY-6, KVW-INT-6)."""
    H, T, P, Q, M = lay.heads, lay.tokens, lay.P, lay.Q, lay.M
    dtype = dtype or {2: "bf16" if x.dtype == R.DTYPES["bf16"][2] else "f16", 4: "f32"}[x.dtype.itemsize]
    pieces = [np.ascontiguousarray(x[:, :P]).view(np.uint8).reshape(-1),
              np.ascontiguousarray(x[:, T - Q:]).view(np.uint8).reshape(-1)]
    if not M:
        return pieces
    y = K.scratch(10, (H, M, lay.dim), F32)  # reused from chunk to chunk: never returned
    with np.errstate(all="ignore"):
        np.copyto(y, x[:, P : P + M], casting="unsafe")
    if spec.codec == "fp8":
        dt, fmax = FP8[spec.fp8_format]
        axes = {"tensor": None, "head": (1, 2), "token": 2}[spec.scale_granularity]
        amax = np.asarray(K.amax_of(y.max(axis=axes), y.min(axis=axes)), F32).reshape(lay.groups)  # NaN, Inf propagate
        if not np.isfinite(amax).all():
            if not keep_nonfinite:
                raise NotFaithful("the chunk holds NaN or infinity (KVW-LOSSY-6): stored losslessly instead")
            a = np.abs(y)
            a[~np.isfinite(a)] = 0  # NaN and Inf do not set scales (KVW-FP8-5)
            amax = np.asarray(a.max(axis=axes), F32).reshape(lay.groups)
        scales = _fp8_scales(amax, fmax, dt, dtype)
        s = scales.reshape({"tensor": (1, 1, 1), "head": (H, 1, 1), "token": (H, M, 1)}[spec.scale_granularity])
        with np.errstate(all="ignore"):
            q = np.divide(y, s, out=y)
            np.clip(q, -fmax, fmax, out=q)  # saturate; NaN stays NaN
        codes = K.f32_to_fp8(q, spec.fp8_format, dt)  # round half to even
        return pieces + [scales.astype("<f4").view(np.uint8).reshape(-1), codes.reshape(-1)]
    rows: Any = None  # each row's largest magnitude, when a rotation needs it
    if spec.rotation != "none":  # the writer's rotation (section 8.4); KVW-ROT-7 checked below
        rows = K.amax_of(y.max(axis=2), y.min(axis=2))
    if spec.codebook == "turboquant":  # norms before the rotation, as vLLM (section 9)
        body = TQ.body(y, spec, pieces)
    elif spec.rotation != "none":
        RT.forward(y, spec.rotation_seed, signed=spec.rotation == "hadamard")
        if np.isfinite(rows).all() and not np.isfinite(y).all():
            raise NotFaithful("the rotation overflows fp32 (KVW-ROT-7): the chunk is stored losslessly instead")
    suspect = False
    if spec.codebook == "gaussian":
        body, suspect = RT.gaussian_body(y, spec, dtype, pieces, group_reduce, group_apply)
    elif spec.codebook == "uniform":
        body = _uniform(y, spec, dtype, pieces)
    if rows is not None or spec.codebook != "uniform":
        X = x[:, P : P + M]
        RT.check_encoded(X, rows, lay.dim, spec, dtype, lambda: decode(spec, b"".join(
            p.tobytes() for p in body), lay, dtype)[:, P : P + M], force=suspect)
    return body


def _uniform(y: np.ndarray, spec: CodecSpec, dtype: str, pieces: list[Any]) -> list[Any]:
    """Uniform int_affine body of ``y`` (KVW-INT-6), rotated or not."""
    b = spec.bits
    try:
        scale_s, zero_s = _int_params(y, spec, dtype)
    except NotFaithful as e:
        if "KVW-INT-6" in str(e):
            raise NotFaithful("int_affine cannot represent NaN or infinity (KVW-INT-6, KVW-LOSSY-6): use fp8 or "
                              "a lossless codec for this chunk") from None
        raise
    params = [scale_s] + ([zero_s] if zero_s is not None else [])
    sc = scale_s.astype(F32)
    q = y
    if spec.symmetric:
        qmax = (1 << (b - 1)) - 1
        group_apply(q, [sc], spec, lambda blk, s: K.quantize(blk, s, None, -qmax, qmax, 1 << (b - 1)))
    else:
        qmax, zs = (1 << b) - 1, zero_s.astype(F32)
        group_apply(q, [sc, zs], spec, lambda blk, s, z: K.quantize(blk, s, z, 0, qmax, 0))
    codes = K.pack_codes(q, b)
    return pieces + [p.astype(p.dtype.newbyteorder("<")).view(np.uint8).reshape(-1) for p in params] + [codes]
