"""The fast lossy kernels (kvwire.codecs.kernels, quant.decode/encode) against the literal
spec decoder (codec_reference) and against the implementation they replaced (quant.py and
scales.py of commit PREVIOUS, loaded from git when this is a checkout), byte for byte.

Bodies are built from random bytes with parameters drawn from awkward values (subnormal,
huge, negative zero, the extremes of the scale dtype), so every fp8 code (NaN, infinity,
subnormal) and every overflow to infinity in the header dtype is decoded.
"""

from __future__ import annotations

import math
import subprocess
import sys
import types
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import codec_reference as ref
from kvwire import CodecSpec
from kvwire.codecs import kernels, quant
from kvwire.format import registry as R
from kvwire.format.errors import CodecError

PREVIOUS = "34011f1cfc98b4f7540bcc7f3daa6b8dc2fb7952"  # the numpy codecs before the kernels
ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"bf16": R.DTYPES["bf16"][2], "f16": np.dtype("<f2"), "f32": np.dtype("<f4")}
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _previous():
    """The previous ``quant`` module (with its own ``scales``), or None outside a git checkout."""
    mods = {}
    for name in ("scales", "quant"):
        try:
            src = subprocess.run(["git", "-C", str(ROOT), "show", f"{PREVIOUS}:python/kvwire/codecs/{name}.py"],
                                 capture_output=True, check=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        mod = types.ModuleType(f"kvwire.codecs.previous_{name}")
        mod.__package__ = "kvwire.codecs"
        if name == "quant":  # its ``from . import scales`` must bind the previous scales
            src = src.replace(b"from . import scales as SC", b"SC = PREVIOUS_SCALES").replace(
                b"from .scales import NotFaithful", b"NotFaithful = PREVIOUS_SCALES.NotFaithful")
            mod.PREVIOUS_SCALES = mods["scales"]
        sys.modules[mod.__name__] = mod
        exec(compile(src, f"{PREVIOUS[:8]}:{name}.py", "exec"), mod.__dict__)
        mods[name] = mod
    return mods["quant"]


OLD = _previous()
needs_old = pytest.mark.skipif(OLD is None, reason="previous implementation not available (no git checkout)")

FP8_SPECS = [CodecSpec("fp8", fp8_format=f, scale_granularity=g)
             for f in ("f8_e4m3fn", "f8_e5m2", "f8_e4m3fnuz") for g in ("tensor", "head", "token")]
INT_SPECS = [CodecSpec("int_affine", bits=b, group_size=G, group_axis=a, symmetric=s, scale_dtype=sd)
             for b in (2, 4, 8) for G in (1, 3, 4, 32) for a in ("tokens", "channels") for s in (False, True)
             for sd in ("f16", "bf16", "f32")]
PARAM_VALUES = {  # awkward parameter values per scale dtype (all accepted as scales except the negatives)
    "f32": [1.0, 0.5, 3e-3, 1e-30, 1.4e-45, 3.4e38, 1e38, 7.0, 65504.0],
    "f16": [1.0, 0.5, 3e-3, 6e-8, 6.1e-5, 65504.0, 1000.0, 7.0],
    "bf16": [1.0, 0.5, 3e-3, 1e-38, 9.2e-41, 3.38e38, 1e30, 7.0],
}


def _param_bytes(rng, n, sd, allow_negative):
    vals = np.array(PARAM_VALUES[sd], np.float64)
    p = rng.choice(vals, n) * rng.choice([1.0, 1.0, 0.75, 0.9], n)
    if allow_negative:
        p *= rng.choice([-1.0, 1.0], n)
    a = p.astype(np.float32).astype(DTYPES[sd] if sd != "bf16" else np.float32)
    if sd == "bf16":  # the upper halves of fp32, as stored
        return (a.view("<u4") >> 16).astype("<u2").tobytes()
    return a.astype(a.dtype.newbyteorder("<")).tobytes()


def _body(rng, spec, lay):
    """A valid body: random sink/residual bytes and codes, awkward but accepted parameters."""
    fp = rng.integers(0, 256, lay.fp_bytes, dtype=np.uint8).tobytes()
    n = lay.param_count
    if spec.codec == "fp8":
        params = _param_bytes(rng, n, "f32", False)
    else:
        params = _param_bytes(rng, n, spec.scale_dtype, False)
        if lay.zeros:
            params += _param_bytes(rng, n, spec.scale_dtype, True)
    codes = rng.integers(0, 256, lay.code_bytes, dtype=np.uint8)
    tail = (lay.heads * lay.M * lay.dim * lay.bits) % 8
    if tail and len(codes):
        codes[-1] &= (1 << tail) - 1  # zero padding bits (KVW-INT-4)
    return fp + params + codes.tobytes()


def _geometry(data):
    H = data.draw(st.integers(1, 3))
    T = data.draw(st.integers(1, 12))
    D = data.draw(st.integers(1, 9))
    t0 = data.draw(st.integers(0, 6))
    lo = data.draw(st.integers(0, t0))
    hi = t0 + T + data.draw(st.integers(0, 5))
    return H, T, D, t0, lo, hi


@FAST
@given(data=st.data(), spec=st.sampled_from(FP8_SPECS + INT_SPECS), dtype=st.sampled_from(sorted(DTYPES)),
       sink=st.integers(0, 4), resid=st.integers(0, 5), seed=st.integers(0, 2**32 - 1))
def test_decode_of_random_bodies_equals_reference_and_previous(data, spec, dtype, sink, resid, seed):
    spec = replace(spec, sink_tokens=sink, residual_tokens=resid)
    H, T, D, t0, lo, hi = _geometry(data)
    lay = quant.layout(spec, dtype, H, D, t0, t0 + T, lo, hi)
    body = _body(np.random.default_rng(seed), spec, lay)
    got = quant.decode(spec, body, lay, dtype).tobytes()
    assert got == ref.decode(spec, dtype, body, H, T, D, t0, lo, hi)
    if OLD is not None:
        assert got == OLD.decode(spec, body, OLD.layout(spec, dtype, H, D, t0, t0 + T, lo, hi), dtype).tobytes()
    # into a strided destination (a token slice of a larger layer buffer)
    big = np.zeros((H, T + 3, D), DTYPES[dtype])
    quant.decode(spec, body, lay, dtype, out=big[:, 2 : 2 + T])
    assert big[:, 2 : 2 + T].tobytes() == got and not big[:, :2].any() and not big[:, 2 + T:].any()


@FAST
@given(data=st.data(), spec=st.sampled_from(INT_SPECS), dtype=st.sampled_from(sorted(DTYPES)),
       seed=st.integers(0, 2**32 - 1))
def test_bad_padding_and_parameters_are_refused_like_before(data, spec, dtype, seed):
    H, T, D, t0, lo, hi = _geometry(data)
    lay = quant.layout(spec, dtype, H, D, t0, t0 + T, lo, hi)
    rng = np.random.default_rng(seed)
    body = bytearray(_body(rng, spec, lay))
    if lay.M and data.draw(st.booleans()):
        body[lay.fp_bytes + data.draw(st.integers(0, lay.param_count - 1)) * lay.param_size
             + lay.param_size - 1] |= 0x80  # a negative scale
    elif lay.code_bytes and (lay.heads * lay.M * lay.dim * lay.bits) % 8:
        body[-1] |= 0x80  # a padding bit
    else:
        return
    with pytest.raises(CodecError) as new:
        quant.decode(spec, bytes(body), lay, dtype)
    if OLD is not None:
        with pytest.raises(CodecError) as old:
            OLD.decode(spec, bytes(body), OLD.layout(spec, dtype, H, D, t0, t0 + T, lo, hi), dtype)
        assert new.value.rule == old.value.rule


def _chunk(rng, dtype, shape, kind):
    x = rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 40.0])
    if kind == "outliers":
        x[..., rng.integers(0, shape[-1])] *= 64
    elif kind == "special":
        flat = x.reshape(-1)
        flat[rng.integers(0, flat.size, 3)] = rng.choice([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40], 3)
    elif kind == "subnormal":
        x *= {"f32": 1e-40, "bf16": 1e-40, "f16": 1e-6}[dtype]
    elif kind == "huge":
        x *= {"f32": 1e37, "bf16": 1e37, "f16": 6e3}[dtype]
    with np.errstate(over="ignore"):
        return x.astype(DTYPES[dtype])


@needs_old
@FAST
@given(data=st.data(), spec=st.sampled_from(FP8_SPECS + INT_SPECS), dtype=st.sampled_from(sorted(DTYPES)),
       kind=st.sampled_from(["plain", "outliers", "special", "subnormal", "huge"]), keep=st.booleans(),
       sink=st.integers(0, 3), resid=st.integers(0, 4), seed=st.integers(0, 2**32 - 1))
def test_encode_equals_previous(data, spec, dtype, kind, keep, sink, resid, seed):
    """Same pieces, or the same refusal, as the previous writer."""
    spec = replace(spec, sink_tokens=sink, residual_tokens=resid)
    H, T, D, t0, lo, hi = _geometry(data)
    x = _chunk(np.random.default_rng(seed), dtype, (H, T, D), kind)
    keep = keep and spec.codec == "fp8"
    args = (spec, dtype, H, D, t0, t0 + T, lo, hi)
    try:
        want = b"".join(bytes(memoryview(p).cast("B")) for p in OLD.encode(spec, x, OLD.layout(*args), dtype, keep))
    except ValueError as e:
        with pytest.raises(quant.NotFaithful) as new:
            quant.encode(spec, x, quant.layout(*args), dtype, keep)
        assert str(new.value) == str(e)
        return
    got = b"".join(bytes(memoryview(p).cast("B")) for p in quant.encode(spec, x, quant.layout(*args), dtype, keep))
    assert got == want


@pytest.mark.parametrize("fmt", sorted(kernels.FP8_BITS))
def test_f32_to_fp8_is_the_ml_dtypes_cast(fmt):
    """Every fp32 upper half with low halves at and around the rounding ties, plus random
    patterns; NaN payloads and both zeros included."""
    dt, fmax = quant.FP8[fmt]
    hi = np.arange(0, 1 << 16, 3, dtype=np.uint32) << np.uint32(16)
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x4000, 0xC000, 0x80000, 0x7FFFF], np.uint32)
    u = np.concatenate([(hi[:, None] | lows[None, :]).reshape(-1),
                        np.random.default_rng(1).integers(0, 2**32, 200_000, dtype=np.uint32)])
    with np.errstate(all="ignore"):
        q = np.clip(u.view(np.float32), -fmax, fmax)
        want = q.astype(dt).view(np.uint8)
    assert np.array_equal(kernels.f32_to_fp8(q, fmt, dt), want)
    # mostly subnormal results: the whole-array branch
    tiny = (np.random.default_rng(2).standard_normal(4096) * 2.0 ** -9).astype(np.float32)
    assert np.array_equal(kernels.f32_to_fp8(tiny, fmt, dt), tiny.astype(dt).view(np.uint8))


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 33, 1000])
def test_pack_codes_and_unpack_are_the_lsb_first_layout(bits, n):
    codes = np.random.default_rng(n).integers(0, 1 << bits, n).astype(np.uint8)
    packed = kernels.pack_codes(codes.astype(np.float32), bits)
    want = bytearray(-(-n * bits // 8))
    for i, c in enumerate(codes.tolist()):
        want[i * bits // 8] |= c << (i * bits % 8)
    assert packed.tobytes() == bytes(want)
    assert kernels.unpack_f32(packed, bits, n, 3).tolist() == (codes.astype(np.float32) - 3).tolist()


@pytest.mark.parametrize("G", [1, 2, 3, 4, 5, 16, 31, 32, 33, 128])
def test_group_extreme_equals_the_numpy_reduction(G):
    x = np.random.default_rng(G).standard_normal((3, 5, G)).astype(np.float32)
    x[0, 0, G // 2] = np.nan
    for fn in (np.maximum, np.minimum):
        got, want = kernels.group_extreme(x, 2, fn), fn.reduce(x, axis=2)
        assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("fmt", sorted(kernels.FP8_BITS))
@pytest.mark.parametrize("scale", [1.0, 2.0 ** -140, 3.0e-5, 0.7, 2.0 ** 10, 3.0e38])
def test_fp8_times_every_code_and_extreme_scales(fmt, scale):
    codes = np.arange(256, dtype=np.uint8)
    nan, inf = kernels.fp8_specials(codes, fmt)
    with np.errstate(over="ignore"):
        v = kernels.fp8_times(codes, fmt, np.float32(scale), nan, inf)
    for c in range(256):
        want = ref.fp8_value(c, fmt)
        if math.isnan(want):
            assert nan is not None and nan[c]
            continue
        with np.errstate(over="ignore"):
            w = np.float32(np.float64(want) * np.float64(np.float32(scale)))
        assert v[c].tobytes() == w.tobytes(), (c, v[c], w)
