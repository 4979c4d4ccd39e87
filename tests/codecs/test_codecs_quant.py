"""Codec math of spec/codecs.md: byte planes, fp8 and int_affine bodies.

Round trips are property tests; decoded bytes are compared with ``codec_reference``, a
literal element-by-element decoder written from the spec text.
"""

from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import codec_reference as ref
from kvwire import CodecSpec
from kvwire.codecs import byteplane, quant
from kvwire.codecs.pipeline import _lossless_stage
from kvwire.format import registry as R
from kvwire.format.errors import CodecError

CCTX = zstandard.ZstdCompressor(level=3, write_content_size=True, write_checksum=False)
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _join(pieces) -> bytes:
    return b"".join(bytes(memoryview(p).cast("B")) for p in pieces)


# ---------------------------------------------------------------------------------------
# byteplane_zstd
# ---------------------------------------------------------------------------------------

@FAST
@given(data=st.binary(min_size=0, max_size=300), width=st.sampled_from([1, 2, 4]), repeat=st.integers(1, 40))
def test_bpz1_round_trip_is_exact(data, width, repeat):
    """KVW-BPZ-1/2: any bytes (with a tail when L mod w != 0) come back bit for bit."""
    raw = data * repeat
    body = _join(byteplane.encode(raw, width, CCTX))
    assert bytes(byteplane.decode(body, len(raw), width)) == raw
    assert ref.byteplane_decode(body, len(raw), width) == raw


def test_bpz1_body_layout_example():
    """KVW-BPZ-1: the worked example of spec/codecs.md section 2."""
    raw = np.array([0x3F80, 0xBF80, 0x4000], "<u2").tobytes()
    body = _join(byteplane.encode(raw, 2, CCTX))
    assert body == bytes.fromhex("03000000 03000000 3FBF40 808000".replace(" ", ""))


def test_bpz2_compressible_plane_is_a_zstd_frame_and_noise_is_stored():
    """KVW-BPZ-2: planes are compressed only when that makes them shorter."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal(4096).astype(ml_dtypes.bfloat16)
    body = _join(byteplane.encode(x.tobytes(), 2, CCTX))
    n0, n1 = struct.unpack_from("<2I", body)
    assert n0 < 4096 and body[8:12] == b"\x28\xb5\x2f\xfd"  # the exponent plane: a zstd frame
    assert n1 == 4096  # mantissa noise: as is
    assert bytes(byteplane.decode(body, 8192, 2)) == x.tobytes()


@pytest.mark.parametrize("cut", [
    lambda b: b[:5],  # shorter than the plane lengths
    lambda b: b[:-1],  # a truncated plane
    lambda b: b + b"\0",  # a byte too many
    lambda b: struct.pack("<2I", 4097, struct.unpack_from("<I", b, 4)[0] - 1) + b[8:],  # a plane longer than N
])
def test_bpz3_malformed_bodies_are_decode_failed(cut):
    """KVW-BPZ-3: DECODE_FAILED, never a crash or a short result."""
    x = np.random.default_rng(2).standard_normal(4096).astype(ml_dtypes.bfloat16)
    body = _join(byteplane.encode(x.tobytes(), 2, CCTX))
    with pytest.raises(CodecError) as e:
        byteplane.decode(cut(body), 8192, 2)
    assert e.value.code == "DECODE_FAILED"


def test_bpz2_plane_frame_follows_codec2():
    """KVW-BPZ-2: a plane frame declaring another content size is DECODED_SIZE_MISMATCH (KVW-CODEC-2)."""
    plane = b"\x3f" * 100
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(plane[:99])
    body = struct.pack("<I", len(frame)) + frame
    with pytest.raises(CodecError) as e:
        byteplane.decode(body, 100, 1)
    assert e.value.code == "DECODED_SIZE_MISMATCH"


# ---------------------------------------------------------------------------------------
# Lossy bodies
# ---------------------------------------------------------------------------------------

DTYPES = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32}
SPECS = [
    CodecSpec("fp8", fp8_format=f, scale_granularity=g)
    for f in ("f8_e4m3fn", "f8_e5m2", "f8_e4m3fnuz") for g in ("tensor", "head", "token")
] + [
    CodecSpec("int_affine", bits=b, group_size=G, group_axis=a, symmetric=s, scale_dtype=sd)
    for b in (2, 4, 8) for G, a in ((3, "tokens"), (5, "channels"), (64, "channels")) for s in (False, True)
    for sd in ("f16", "bf16", "f32") if (b + G) % 2 or sd == "f32"
]


def _encode_decode(spec, x, t0=0, lo=0, hi=None, **kw):
    H, T, D = x.shape
    hi = t0 + T if hi is None else hi
    lay = quant.layout(spec, _name(x.dtype), H, D, t0, t0 + T, lo, hi)
    body = _join(quant.encode(spec, x, lay, _name(x.dtype), **kw))
    assert len(body) == lay.length
    out = quant.decode(spec, body, lay, _name(x.dtype))
    assert out.tobytes() == ref.decode(spec, _name(x.dtype), body, H, T, D, t0, lo, hi)
    return out, body, lay


def _name(dt) -> str:
    return {np.dtype(v): k for k, v in DTYPES.items()}[np.dtype(dt)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=st.sampled_from(SPECS), dtype=st.sampled_from(sorted(DTYPES)), H=st.integers(1, 2),
       T=st.integers(1, 9), D=st.integers(1, 7), seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([1e-3, 1, 30]),
       sink=st.integers(0, 3), resid=st.integers(0, 4), t0=st.integers(0, 5))
def test_lossy3_decode_equals_the_literal_reference(spec, dtype, H, T, D, seed, scale, sink, resid, t0):
    """KVW-LOSSY-1..4, KVW-FP8-2/4, KVW-INT-2/4/5: numpy decode == element-by-element spec
    decode, for partial groups, kept sink/residual tokens and every granularity."""
    from dataclasses import replace

    spec = replace(spec, sink_tokens=sink, residual_tokens=resid)
    x = (np.random.default_rng(seed).standard_normal((H, T, D)) * scale).astype(DTYPES[dtype])
    lo, hi = max(0, t0 - 2), t0 + T + 3
    try:
        out, _, lay = _encode_decode(spec, x, t0, lo, hi)
    except quant.NotFaithful:  # a group too narrow for the scale dtype: the writer stores it losslessly
        return  # (KVW-LOSSY-5; test_lossy5_* covers the refusals)
    P, Q = lay.P, lay.Q
    assert (P, Q) == ref.token_split(spec, t0, t0 + T, lo, hi)
    kept = np.r_[0:P, T - Q:T]
    assert out[:, kept].tobytes() == x[:, kept].tobytes()  # full precision, bit for bit


@FAST
@given(bits=st.sampled_from([2, 4, 8]), G=st.integers(1, 40), axis=st.sampled_from(["tokens", "channels"]),
       seed=st.integers(0, 2**32 - 1))
def test_int5_error_is_within_half_a_step(bits, G, axis, seed):
    """KVW-INT-5/6: asymmetric min-max codes are within half a quantization step (plus the
    rounding of scale, zero and the output dtype)."""
    spec = CodecSpec("int_affine", bits=bits, group_size=G, group_axis=axis)
    x = np.random.default_rng(seed).standard_normal((2, 33, 20)).astype(np.float32)
    out, _, _ = _encode_decode(spec, x)
    y = x.reshape(2, 33, 20)
    step = quant.group_reduce(y, spec, lambda b, ax: b.max(axis=ax) - b.min(axis=ax)) / ((1 << bits) - 1)
    bound = np.empty_like(y)
    quant.group_apply(bound, [step], spec, lambda blk, s: np.broadcast_to(s, blk.shape))
    assert (np.abs(out - y) <= bound / 2 * (1 + 1e-5) + 1e-6).all()


def test_int6_constant_group_is_exact_with_zero_scale():
    """KVW-INT-3/6: a constant group has scale 0 and decodes exactly to its zero."""
    spec = CodecSpec("int_affine", bits=2, group_size=4, group_axis="channels", scale_dtype="f16")
    x = np.full((1, 3, 8), 1.5, ml_dtypes.bfloat16)
    out, body, lay = _encode_decode(spec, x)
    assert out.tobytes() == x.tobytes()
    scales = np.frombuffer(body[: lay.param_count * 2], "<f2")
    assert (scales == 0).all()


def test_fp8_5_nan_inf_and_saturation():
    """KVW-FP8-4/5: NaN decodes to the canonical NaN (KVW-LOSSY-4), infinities and values
    beyond the scale's range saturate to +-fmax * scale; the scale ignores them."""
    spec = CodecSpec("fp8", fp8_format="f8_e4m3fn", scale_granularity="tensor")
    x = np.array([[[np.nan, np.inf, -np.inf, 448.0, -1.0, 0.0]]], ml_dtypes.bfloat16)
    out, body, _ = _encode_decode(spec, x, keep_nonfinite=True)  # the reference writer stores it lossless
    assert struct.unpack_from("<f", body)[0] == 1.0  # amax 448 / fmax 448
    assert out.view("<u2")[0, 0, 0] == 0x7FC0
    assert out.astype(np.float32)[0, 0, 1:].tolist() == [448.0, -448.0, 448.0, -1.0, 0.0]


def test_fp8_5_all_zero_group_scale_is_one():
    """KVW-FP8-5: amax 0 gives scale 1 (a reader rejects 0, KVW-FP8-3)."""
    spec = CodecSpec("fp8", scale_granularity="head")
    out, body, _ = _encode_decode(spec, np.zeros((2, 2, 4), np.float16))
    assert np.frombuffer(body[:8], "<f4").tolist() == [1.0, 1.0]
    assert not out.any()


def test_int4_packing_example_lsb_first():
    """KVW-INT-4: codes 1, 2, 3, 0, 1 at 2 bits are the bytes 0x39 0x01."""
    assert quant.pack(np.array([1, 2, 3, 0, 1], np.uint8), 2).tobytes() == b"\x39\x01"
    assert quant.pack(np.array([1, 15, 7], np.uint8), 4).tobytes() == b"\xf1\x07"
    assert quant.unpack(np.frombuffer(b"\x39\x01", np.uint8), 2, 5).tolist() == [1, 2, 3, 0, 1]


def test_int4_nonzero_padding_bits_are_rejected():
    """KVW-INT-4: unused high bits of the last code byte must be 0."""
    with pytest.raises(CodecError) as e:
        quant.unpack(np.frombuffer(b"\x39\x41", np.uint8), 2, 5)
    assert e.value.code == "DECODE_FAILED" and e.value.rule == "KVW-INT-4"


def _body(spec, x):
    H, T, D = x.shape
    lay = quant.layout(spec, _name(x.dtype), H, D, 0, T, 0, T)
    return bytearray(_join(quant.encode(spec, x, lay))), lay


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_fp8_3_bad_scales_are_rejected(value):
    """KVW-FP8-3: scales must be finite and > 0."""
    spec = CodecSpec("fp8")
    body, lay = _body(spec, np.ones((1, 2, 2), np.float16))
    struct.pack_into("<f", body, 0, value)
    with pytest.raises(CodecError) as e:
        quant.decode(spec, bytes(body), lay, "f16")
    assert (e.value.code, e.value.rule) == ("DECODE_FAILED", "KVW-FP8-3")


@pytest.mark.parametrize("where, value", [("scale", -1.0), ("scale", float("nan")), ("zero", float("inf"))])
def test_int3_bad_parameters_are_rejected(where, value):
    """KVW-INT-3: scales finite with the sign bit clear, zeros finite."""
    spec = CodecSpec("int_affine", bits=4, group_size=2)
    body, lay = _body(spec, np.arange(8, dtype=np.float32).reshape(1, 4, 2))
    at = 0 if where == "scale" else lay.param_count * 4
    struct.pack_into("<f", body, at, value)
    with pytest.raises(CodecError) as e:
        quant.decode(spec, bytes(body), lay, "f32")
    assert (e.value.code, e.value.rule) == ("DECODE_FAILED", "KVW-INT-3")


def test_int3_negative_zero_is_allowed():
    """KVW-INT-3: a negative zero (min) is fine; only scales have the sign rule."""
    spec = CodecSpec("int_affine", bits=8, group_size=4)
    x = -np.arange(8, dtype=np.float32).reshape(1, 4, 2)
    out, _, _ = _encode_decode(spec, x)
    assert np.allclose(out, x, atol=0.02)


def test_lossy2_wrong_body_length_is_rejected():
    """KVW-LOSSY-2: a lossy body must be exactly its geometry's length."""
    spec = CodecSpec("fp8")
    body, lay = _body(spec, np.ones((1, 2, 2), np.float16))
    for bad in (bytes(body[:-1]), bytes(body) + b"\0"):
        with pytest.raises(CodecError) as e:
            quant.decode(spec, bad, lay, "f16")
        assert (e.value.code, e.value.rule) == ("DECODE_FAILED", "KVW-LOSSY-2")


def test_cspec7_lossless_stage_is_detected_by_length():
    """KVW-CSPEC-7: n == Lb is the lossy body; n < Lb the stage; n > Lb, or n != Lb without a stage, fail."""
    spec = CodecSpec("int_affine", bits=8, group_size=32, lossless="zstd")
    body = bytes(64)
    assert _lossless_stage(spec, body, 64, 2) is body
    assert bytes(_lossless_stage(spec, CCTX.compress(body), 64, 2)) == body
    for stored, sp, rule in ((body + b"\0", spec, "KVW-CSPEC-7"), (body[:-1], CodecSpec("int_affine"), "KVW-LOSSY-2")):
        with pytest.raises(CodecError) as e:
            _lossless_stage(sp, stored, 64, 2)
        assert (e.value.code, e.value.rule) == ("DECODE_FAILED", rule)
    bp = CodecSpec("fp8", lossless="byteplane_zstd")
    staged = _join(byteplane.encode(bytes(range(7)) * 20, 2, CCTX))
    assert bytes(_lossless_stage(bp, staged, 140, 2)) == bytes(range(7)) * 20


def test_int6_writer_refuses_non_finite_values():
    """KVW-INT-6: int_affine cannot represent NaN/Inf; the writer says so."""
    x = np.array([[[1.0, np.nan]]], np.float32)
    with pytest.raises(ValueError, match="KVW-INT-6"):
        _encode_decode(CodecSpec("int_affine"), x)


def test_lossy4_rounding_to_bf16_is_nearest_even_with_overflow_to_inf():
    """KVW-LOSSY-4: fp32 -> bf16 ties to even; beyond the largest finite -> inf."""
    v = np.array([1.00390625, 1.01171875, 3.4e38, -3.4e38], np.float32)  # ties: 1+2^-8, 1+3*2^-8
    got = quant._to_dtype(v, "bf16").view("<u2").tolist()
    assert got == [0x3F80, 0x3F82, 0x7F80, 0xFF80]
    assert [ref.to_dtype(float(x), "bf16") for x in v] == [struct.pack("<H", g) for g in got]
    sub = np.array([1.5e-39, -2.2e-40, 6e-8, 3e-5, 70000.0], np.float32)  # subnormal in bf16 / in f16, overflow
    for dtype in ("bf16", "f16"):
        assert quant._to_dtype(sub, dtype).tobytes() == b"".join(ref.to_dtype(float(x), dtype) for x in sub)


def test_fp8_tables_match_the_reference_formula():
    """KVW-FP8-1/4: every code's value in the three formats."""
    for fmt in quant.FP8:
        table, nan = quant.fp8_table(fmt)
        for code in range(256):
            want = ref.fp8_value(code, fmt)
            assert (np.isnan(table[code]) and want != want) or table[code] == want, (fmt, code)
        assert R.DTYPES[fmt][2] == quant.FP8[fmt][0]


# ---------------------------------------------------------------------------------------
# Faithful encoding at the extremes (KVW-LOSSY-5/6)
# ---------------------------------------------------------------------------------------

from kvwire.codecs import PRESETS
from kvwire.codecs.presets import resolve
from kvwire.codecs.scales import LARGEST, PRECISION, SMALLEST

LOSSY_PRESETS = sorted(n for n in PRESETS if isinstance(resolve(PRESETS[n], "k"), CodecSpec)
                       and resolve(PRESETS[n], "k").lossy
                       and resolve(PRESETS[n], "k").rotation == "none")  # rotated: tests/codecs/test_rotation.py
PRESET_SPECS = [(n, c) for n in LOSSY_PRESETS for c in ("k", "v") if (c == "k" or isinstance(PRESETS[n], dict))
                and resolve(PRESETS[n], c).rotation == "none"]
EXTREME_SPECS = PRESET_SPECS + [
    (f"int{b}-{a}-{'sym' if s else 'asym'}-{sd}", CodecSpec("int_affine", bits=b, group_size=G, group_axis=a,
                                                            symmetric=s, scale_dtype=sd))
    for b, G, a in ((2, 4, "tokens"), (4, 8, "channels"), (8, 16, "tokens")) for s in (False, True)
    for sd in ("f16", "bf16", "f32")]


def _spec(entry):
    name, c = entry
    return resolve(PRESETS[name], c) if isinstance(c, str) else c


def _extreme(rng, dtype, shape, pattern, e):
    """An array of the header dtype at magnitude 2^e: random signs and mantissas, one pattern."""
    dt = DTYPES[dtype]
    top, sub = LARGEST[dtype], SMALLEST[dtype]
    g = rng.standard_normal(shape)
    if pattern == "max":  # +-largest finite (and its neighbours)
        x = np.sign(g) * top * (1 - rng.integers(0, 3, shape) * 2.0 ** -PRECISION[dtype])
    elif pattern == "mixed":  # each group mixes magnitudes 2^e and 2^(e - 30)
        x = g * 2.0 ** e * np.where(rng.random(shape) < 0.5, 1, 2.0 ** -30)
    elif pattern == "subnormal":  # small multiples of the smallest subnormal
        x = rng.integers(-4, 5, shape) * sub
    elif pattern == "zero-groups":
        x = g * 2.0 ** e
        x[:, ::2] = 0
        x[..., 1::3] = 0
    else:  # "gauss": one magnitude 2^e
        x = g * 2.0 ** e
    return np.clip(x, -top, top).astype(dt)


def _groups(spec, a):
    """Per group (the elements sharing one scale) the largest |a|, shaped like the scales."""
    a = np.abs(a.astype(np.float64))
    if spec.codec == "fp8":
        return a.max(axis={"tensor": None, "head": (1, 2), "token": 2}[spec.scale_granularity], keepdims=True)
    return quant.group_reduce(a, spec, lambda b, ax: b.max(axis=ax))


def _bound(spec, x, dtype):
    """Largest |decoded - input| the reference writer allows per element (KVW-LOSSY-5,
    spec/codecs.md section 3.1): one exact step plus the scale dtype's precision at the
    group's magnitude plus the header dtype's rounding (fp8: its significand); float64."""
    y = x.astype(np.float64)
    hdr = 2.0 ** (1 - PRECISION[dtype]) * np.abs(y) + SMALLEST[dtype] + 2.0 ** -20 * np.abs(y)
    if spec.codec == "fp8":
        amax = np.broadcast_to(_groups(spec, y), y.shape)
        m = {"f8_e4m3fn": 3, "f8_e4m3fnuz": 3, "f8_e5m2": 2}[spec.fp8_format]
        fmax = quant.FP8[spec.fp8_format][1]
        sub = {"f8_e4m3fn": 2.0 ** -9, "f8_e4m3fnuz": 2.0 ** -10, "f8_e5m2": 2.0 ** -16}[spec.fp8_format]
        return 2.0 ** -m * np.abs(y) + amax / fmax * sub + 2.0 ** -149 + hdr + 2.0 ** -20 * amax
    b, p = spec.bits, PRECISION[spec.scale_dtype]
    with np.errstate(over="ignore"):
        return _int_bound(spec, y, b, p) + hdr


def _int_bound(spec, y, b, p):
    if spec.symmetric:
        step = quant.group_reduce(np.abs(y), spec, lambda k, ax: k.max(axis=ax)) / ((1 << (b - 1)) - 1)
    else:
        step = quant.group_reduce(y, spec, lambda k, ax: k.max(axis=ax) - k.min(axis=ax)) / ((1 << b) - 1)
    per = step + 2.0 ** (3 - p) * _groups(spec, y)
    out = np.empty_like(y)
    quant.group_apply(out, [per], spec, lambda blk, s: np.broadcast_to(s, blk.shape))
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entry=st.sampled_from(EXTREME_SPECS), dtype=st.sampled_from(sorted(DTYPES)),
       pattern=st.sampled_from(["max", "mixed", "subnormal", "zero-groups", "gauss"]), e=st.floats(-160, 130),
       H=st.integers(1, 2), T=st.integers(1, 40), D=st.integers(1, 40), seed=st.integers(0, 2**32 - 1))
def test_lossy5_decoded_values_are_finite_not_all_zero_and_within_the_bound(entry, dtype, pattern, e, H, T, D, seed):
    """KVW-LOSSY-5, every lossy preset and int_affine variant, f16/bf16/f32 header dtypes,
    input anywhere in the dtype's finite range: either the writer refuses the chunk
    (``NotFaithful``: the container stores it losslessly) or (a) every element decodes
    finite, (b) every group with a nonzero element decodes to a nonzero value, and (c)
    |decoded - input| <= step + 2^(3-p) * amax + the header dtype's rounding, per element
    (``_bound``). Presets never refuse ordinary data (test below)."""
    spec = _spec(entry)
    x = _extreme(np.random.default_rng(seed), dtype, (H, T, D), pattern,
                 min(e, np.log2(LARGEST[dtype]) - 1))
    lay = quant.layout(spec, dtype, H, D, 0, T, 0, 10**6)
    try:
        body = _join(quant.encode(spec, x, lay, dtype))
    except quant.NotFaithful as err:
        assert "KVW-LOSSY-5" in str(err)
        return
    out = quant.decode(spec, body, lay, dtype).astype(np.float32)
    if T * D <= 200:
        assert out.astype(DTYPES[dtype]).tobytes() == ref.decode(spec, dtype, body, H, T, D, 0, 0, 10**6)
    assert np.isfinite(out).all()
    live = _groups(spec, x) > 0
    assert (_groups(spec, out)[live] > 0).all()
    err, bound = np.abs(out.astype(np.float64) - x.astype(np.float64)), _bound(spec, x, dtype)
    assert np.isfinite(bound).all()  # a group whose range overflows fp32 is refused
    assert (err <= bound).all(), float((err - bound).max())


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("entry", PRESET_SPECS, ids=lambda e: f"{e[0]}-{e[1]}")
def test_lossy5_presets_encode_ordinary_data_without_fallback(entry, dtype):
    """KVW-LOSSY-5: the checks refuse only extremes: Gaussian K/V from 1e-3 to 1e3 (and
    zero groups) encode with every preset in every header dtype."""
    spec = _spec(entry)
    rng = np.random.default_rng(1)
    for scale in (1e-3, 1.0, 1e3):
        x = (rng.standard_normal((2, 64, 128)) * scale).astype(DTYPES[dtype])
        x[:, :3] = 0
        lay = quant.layout(spec, dtype, 2, 128, 0, 64, 0, 10**6)
        quant.decode(spec, _join(quant.encode(spec, x, lay, dtype)), lay, dtype)


@pytest.mark.parametrize("dtype, preset, value", [
    ("f16", "int8", 65504.0), ("f16", "int4-g32", 65504.0), ("f16", "kivi2", -65504.0), ("f16", "kivi4", 65504.0),
    ("f32", "fp8-e4m3", 3.4028234663852886e38), ("bf16", "int8-asym", 3.3895313892515355e38)])
def test_lossy5_largest_finite_values_never_decode_to_infinity(dtype, preset, value):
    """KVW-LOSSY-5 (a): +-max finite (the issue's f16 +-65504 under int8 / int4-g32: the f16
    scale rounded up and 127 * scale overflowed) decodes finite, or the chunk is refused."""
    spec = _spec((preset, "k"))
    x = np.full((1, 4, 32), value, np.float32)
    x[0, ::2, 1::2] *= -1
    x = x.astype(DTYPES[dtype])
    lay = quant.layout(spec, dtype, 1, 32, 0, 4, 0, 10**6)
    try:
        out = quant.decode(spec, _join(quant.encode(spec, x, lay, dtype)), lay, dtype).astype(np.float32)
    except quant.NotFaithful:
        assert (dtype, preset) == ("bf16", "int8-asym")  # max - min = 2 * max overflows fp32
        return
    assert np.isfinite(out).all()
    assert (np.abs(out - x.astype(np.float32)) <= abs(value) * 2 ** -6).all()


@pytest.mark.parametrize("dtype, preset", [("f16", "int8"), ("f16", "int4-g32"), ("f16", "kivi4"),
                                           ("f32", "int8-asym"), ("f32", "fp8-e4m3")])
def test_lossy5_tiny_values_never_decode_to_all_zero(dtype, preset):
    """KVW-LOSSY-5 (b): values near 1e-7 in f16 (the issue: the int8 scale underflowed f16
    and everything decoded to 0) and near the f32 smallest subnormal keep their values."""
    spec = _spec((preset, "k"))
    unit = SMALLEST[dtype]
    x = (np.arange(-16, 16, dtype=np.float64).reshape(1, 1, 32).repeat(4, axis=1) * unit).astype(DTYPES[dtype])
    lay = quant.layout(spec, dtype, 1, 32, 0, 4, 0, 10**6)
    out = quant.decode(spec, _join(quant.encode(spec, x, lay, dtype)), lay, dtype)
    bits = 8 if preset.startswith(("int8", "fp8")) else 4
    if bits == 8:
        assert out.tobytes() == x.tobytes()  # small multiples of the smallest subnormal: exact
    assert (out != 0).sum() >= (x != 0).sum() // 2 and np.isfinite(out.astype(np.float32)).all()


@pytest.mark.parametrize("dtype, preset, scale", [("bf16", "int8", 1e-7), ("f32", "int4-g32", 1e-30),
                                                  ("bf16", "kivi2", 1e30), ("f32", "int8", 1e8)])
def test_lossy5_scales_the_scale_dtype_cannot_hold_are_refused(dtype, preset, scale):
    """KVW-LOSSY-5: f16 scales for values the f16 range cannot scale (bf16 1e-7 under int8,
    f32 1e30 under kivi2) are refused rather than decoded to 0 or infinity (KVW-INT-6 once
    raised for overflow only, and encoded underflow silently)."""
    spec = _spec((preset, "k"))
    x = (np.random.default_rng(0).standard_normal((1, 40, 32)) * scale).astype(DTYPES[dtype])
    lay = quant.layout(spec, dtype, 1, 32, 0, 40, 0, 10**6)
    with pytest.raises(quant.NotFaithful, match="KVW-LOSSY-5"):
        quant.encode(spec, x, lay, dtype)


@pytest.mark.parametrize("spec", [CodecSpec("fp8"), CodecSpec("int_affine", bits=4, group_size=4)])
def test_lossy6_non_finite_input_is_refused_by_the_codec(spec):
    """KVW-LOSSY-6: NaN or an infinity in the quantized part: the writer stores the chunk
    losslessly (``NotFaithful``); fp8 encodes them only when asked (KVW-FP8-5)."""
    for bad in (np.nan, np.inf, -np.inf):
        x = np.ones((1, 2, 4), np.float16)
        x[0, 1, 2] = bad
        lay = quant.layout(spec, "f16", 1, 4, 0, 2, 0, 2)
        with pytest.raises(quant.NotFaithful, match="KVW-LOSSY-6"):
            quant.encode(spec, x, lay, "f16")
