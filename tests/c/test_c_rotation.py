"""libkvwire's revision 1.2 int_affine (spec/codecs.md section 8: Hadamard rotation, the
Gaussian codebook, 3-bit codes) against the numpy reference (kvwire.codecs.quant and
kvwire.codecs.rotation): the same decoded bytes, through kvwire.codecs.native (the
kvw_decode_wire fast path), on random rotated / gaussian / 3-bit chunks of every header
dtype, head dims whose Hadamard block is the whole row (64, 128) or a part of it (96, 80),
partial groups and sink / residual windows; the same error codes on corrupted bodies; and
the native encoder (native.encode_lossy over kvw_lossy_encode_wire) writing the reference
writer's bodies and refusals byte for byte. Why: the rotation is fp32 arithmetic in a fixed
order, so any difference (an FMA, a reordered stage, another rounding) shows as bytes.
"""

from __future__ import annotations

import ctypes
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_native_codecs import LIB, both, values

from kvwire import CodecSpec
from kvwire.codecs import native, quant, rotation
from kvwire.codecs.pipeline import decode_chunk, lossy_range
from kvwire.format import codec_specs as CS
from kvwire.format import registry as R
from kvwire.format.architecture import Architecture, LayerSpec
from kvwire.format.errors import FormatError
from kvwire.format.header import Header

FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.function_scoped_fixture])
DIMS = [64, 96, 128, 80, 20]  # 20: B = 4 and D % 8 != 0, the portable row path


def header(dtype, heads, dim_k, dim_v, tokens, specs):
    arch = Architecture((LayerSpec("full_attention", heads, dim_k, dim_v),))
    bits = CS.features_of(specs)
    return Header(arch, token_count=tokens, dtype=dtype, chunk_tokens=256, codec_specs=tuple(specs),
                  required_features=bits, format_minor=2 if bits & R.REQUIRED_FEATURES["rotation"] else 0)


def _spec(bits, G, axis, sym, sd, rot, seed, gauss):
    if gauss:
        sym, bits = True, min(bits, 4)
    return CodecSpec("int_affine", bits=bits, group_size=G, group_axis=axis, symmetric=sym, scale_dtype=sd,
                     rotation="hadamard" if rot else "none", rotation_seed=seed if rot else 0,
                     codebook="gaussian" if gauss else "uniform")


ROT_SPECS = st.builds(_spec, st.sampled_from([2, 3, 4, 8]), st.sampled_from([1, 3, 16, 32, 128]),
                      st.sampled_from(["tokens", "channels"]), st.booleans(), st.sampled_from(["f16", "bf16", "f32"]),
                      st.booleans(), st.sampled_from([0, 1, 7, 2**64 - 1, 0x9E3779B97F4A7C15]), st.booleans())


def _chunk(rng, spec, dtype, heads, dim, tokens, t0, sink, resid, special, outlier):
    total = t0 + tokens
    h = header(dtype, heads, dim, dim, total, [spec])
    lay = quant.layout(spec, dtype, heads, dim, t0, t0 + tokens, *lossy_range(h, 0))
    x = values(rng, (heads, tokens, dim), dtype, special)
    if outlier:  # a Llama-like outlier channel: what the rotation is for
        x = x.astype(np.float32) if dtype != "bf16" else x
        x[..., rng.integers(0, dim)] *= 40
        x = x.astype(values(rng, (1, 1, 1), dtype, False).dtype)
    return h, lay, x


def _body(spec, x, lay, dtype):
    return b"".join(bytes(memoryview(p).cast("B")) for p in quant.encode(spec, x, lay, dtype))


@FAST
@given(spec=ROT_SPECS, dtype=st.sampled_from(["bf16", "f16", "f32"]), heads=st.integers(1, 3),
       dim=st.sampled_from(DIMS), tokens=st.integers(1, 70), sink=st.integers(0, 5), resid=st.integers(0, 5),
       t0=st.sampled_from([0, 256]), special=st.booleans(), outlier=st.booleans(), random_body=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_decode_identical(lib, spec, dtype, heads, dim, tokens, sink, resid, t0, special, outlier, random_body, seed):
    rng = np.random.default_rng(seed)
    spec = replace(spec, sink_tokens=sink, residual_tokens=resid)
    h, lay, x = _chunk(rng, spec, dtype, heads, dim, tokens, t0, sink, resid, special, outlier)
    body = None
    if not random_body:
        try:
            body = _body(spec, x, lay, dtype)
        except quant.NotFaithful:
            pass
    if body is None:  # any bytes: the decoders agree on values and on rejections
        body = rng.integers(0, 256, lay.length, dtype=np.uint8).tobytes()
    shape = (heads, tokens, dim)
    raw = heads * tokens * dim * R.DTYPES[dtype][1]
    a, b = both(lambda: decode_chunk(h, "int_affine", 1, body, raw, shape, 0, t0))
    assert a == b


@FAST
@given(spec=ROT_SPECS, dtype=st.sampled_from(["bf16", "f16", "f32"]), heads=st.integers(1, 3),
       dim=st.sampled_from(DIMS), tokens=st.integers(1, 70), sink=st.integers(0, 5), resid=st.integers(0, 5),
       t0=st.sampled_from([0, 256]), special=st.booleans(), outlier=st.booleans(),
       scale=st.sampled_from([1.0, 1.0, 1e-30, 1e-6, 1e4, 1e30]), seed=st.integers(0, 2**32 - 1))
def test_encode_identical(lib, spec, dtype, heads, dim, tokens, sink, resid, t0, special, outlier, scale, seed):
    rng = np.random.default_rng(seed)
    spec = replace(spec, sink_tokens=sink, residual_tokens=resid)
    h, lay, x = _chunk(rng, spec, dtype, heads, dim, tokens, t0, sink, resid, special, outlier)
    if scale != 1.0:  # near the extremes of the dtypes: the band checks and refusals
        with np.errstate(over="ignore"):
            x = (x.astype(np.float32) * np.float32(scale)).astype(x.dtype)
    native.disable()
    try:
        ref = ("ok", _body(spec, x, lay, dtype))
    except quant.NotFaithful:
        ref = ("refused",)
    native.enable(LIB)
    try:
        rec = native.record(h, "int_affine", 1, 0, x.nbytes, x.shape, 0, t0)
        try:
            got = ("ok", bytes(native.encode_lossy(h, rec, np.ascontiguousarray(x).view(np.uint8))))
        except quant.NotFaithful:
            got = ("refused",)
    finally:
        native.disable()
    if ref[0] == "ok" and got == ("refused",) and spec.codebook == "gaussian":
        # The reference's band (rotation.band) misses root mean squares whose squares
        # underflow fp32 (|x| below ~1e-19): it then writes bodies that KVW-ROT-7 (rotated:
        # rows) or KVW-LOSSY-5 (unrotated: groups) forbid, and libkvwire, which checks those
        # chunks on their decoded bytes, stores them losslessly. Only there may they differ.
        assert _unfaithful(spec, x, ref[1], lay, dtype)
        return
    assert got == ref


def _unfaithful(spec, x, body, lay, dtype) -> bool:
    """A body that breaks KVW-ROT-7 (a nonzero row decoding to zeros) or, unrotated, LOSSY-5
    (b) (a nonzero group decoding to zeros)."""
    P, M = lay.P, lay.M
    X = np.asarray(x, np.float32)[:, P:P + M]
    d = np.asarray(quant.decode(spec, body, lay, dtype)).astype(np.float32)[:, P:P + M]
    if not rotation.faithful(X, d):
        return True
    if spec.rotation != "none":
        return False
    G = spec.group_size
    ax = 2 if spec.group_axis == "channels" else 1
    for g0 in range(0, X.shape[ax], G):
        sl = [slice(None)] * 3
        sl[ax] = slice(g0, g0 + G)
        live = (X[tuple(sl)] != 0).any(axis=ax)
        if (live & ~(d[tuple(sl)] != 0).any(axis=ax)).any():
            return True
    return False


def test_known_values(lib):
    """The spec's examples: the sign vectors of seeds 0 and 1, c_128, and a 3-bit string."""
    s0 = "".join("-" if v < 0 else "+" for v in rotation.signs(0, 32))
    assert s0 == "-++-+++-+-+-----+-+----+--++---+"
    assert rotation.c_b(128).view(np.uint32) == 0x3DB504F3
    spec = CodecSpec("int_affine", bits=3, group_size=3, group_axis="channels", symmetric=True, scale_dtype="f32")
    h = header("f32", 1, 3, 3, 1, [spec])
    lay = quant.layout(spec, "f32", 1, 3, 0, 1, 0, 1)
    body = np.float32(1).tobytes() + bytes([0xDD, 0x01])  # codes 5, 3, 7: values 1, -1, 3
    assert lay.length == len(body)
    a, b = both(lambda: decode_chunk(h, "int_affine", 1, body, 12, (1, 1, 3), 0, 0))
    assert a == b == ("ok", np.array([1, -1, 3], "<f4").tobytes())
    a, b = both(lambda: decode_chunk(h, "int_affine", 1, body[:-1] + b"\x03", 12, (1, 1, 3), 0, 0))
    assert a == b and a[:2] == ("err", "DECODE_FAILED")


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("dim", DIMS[:4])
@pytest.mark.parametrize("kind", ["int4", "gauss3", "int2-tokens"])
def test_rotated_full_chunk(lib, dtype, dim, kind):
    """Full-size rotated chunks (the turboquant-like keys, an outlier channel) both ways:
    inside rotation.band libkvwire encodes through its fused path, outside (x 40) through the
    careful one with the decoded check; the same bodies as the reference either way."""
    spec = {"int4": CodecSpec("int_affine", bits=4, group_size=32, group_axis="channels", symmetric=True,
                              scale_dtype="f16", rotation="hadamard", rotation_seed=12345, residual_tokens=16),
            "gauss3": CodecSpec("int_affine", bits=3, group_size=32, group_axis="channels", symmetric=True,
                                scale_dtype="bf16", rotation="hadamard", rotation_seed=7, codebook="gaussian"),
            "int2-tokens": CodecSpec("int_affine", bits=2, group_size=32, group_axis="tokens", scale_dtype="f16",
                                     rotation="hadamard", rotation_seed=2**63, sink_tokens=4)}[kind]
    for outlier in (8, 40):
        rng = np.random.default_rng(dim + outlier)
        h, lay, x = _chunk(rng, spec, dtype, 4, dim, 256, 0, 0, 0, False, False)
        xf = rng.standard_normal(x.shape).astype(np.float32)
        xf[..., 3] *= outlier
        x = xf.astype(x.dtype)
        body = _body(spec, x, lay, dtype)
        native.enable(LIB)
        try:
            rec = native.record(h, "int_affine", 1, 0, x.nbytes, x.shape, 0, 0)
            assert bytes(native.encode_lossy(h, rec, np.ascontiguousarray(x).view(np.uint8))) == body
        finally:
            native.disable()
        a, b = both(lambda: decode_chunk(h, "int_affine", 1, body, x.nbytes, x.shape, 0, 0))
        assert a == b and a[0] == "ok"


class KvwError(ctypes.Structure):  # kvw_error (c/include/kvwire.h)
    _fields_ = [("code", ctypes.c_int), ("rule", ctypes.c_char_p), ("needed", ctypes.c_uint64),
                ("message", ctypes.c_char * 240)]


def check_header_cases(lib, arch, cases, minor) -> None:
    """Each case ``(specs, required bits, expected code)``: the numpy reader reports the expected
    code (None: accepted) and kvw_header_new the same code and rule; ``minor(bits)`` is the
    header's format_minor."""
    import forge
    from kvwire.format.header import parse_header

    c = ctypes.CDLL(str(lib))
    c.kvw_code_name.restype = ctypes.c_char_p
    for specs, bits, want in cases:
        fb = forge.header_of(Header(arch, token_count=4, codec_specs=specs, required_features=bits,
                                    format_minor=minor(bits)))
        try:
            parse_header(fb)
            ref = (None, None)
        except FormatError as e:
            ref = (e.code, e.rule)
        assert ref[0] == want, specs
        out, e = ctypes.c_void_p(), KvwError()
        code = c.kvw_header_new(fb, len(fb), ctypes.byref(out), ctypes.byref(e))
        if code == 0:
            c.kvw_header_delete(out)
        got = (None, None) if code == 0 else (c.kvw_code_name(code).decode(), e.rule.decode())
        assert got == ref, specs


def test_header_rules(lib):
    """KVW-ROT-1/2 through kvw_header_new: the code and rule the numpy reader gives, also for
    fields 11-13 in a container without bit 4 (not read: a 1.0 spec)."""
    arch = Architecture((LayerSpec("full_attention", 1, 64, 64),))
    bit0, bit4 = R.REQUIRED_FEATURES["codec_specs"], R.REQUIRED_FEATURES["rotation"]
    ia = lambda **k: CodecSpec("int_affine", **k)
    cases = [
        ((ia(bits=3),), bit0 | bit4, None),
        ((ia(bits=3),), bit0, "CODEC_SPEC_INVALID"),
        ((ia(bits=4),), bit0 | bit4, "CODEC_SPEC_INVALID"),
        ((ia(bits=4, rotation="hadamard"),), bit0, None),  # fields 11-13 not read without bit 4
        ((ia(bits=4, rotation_seed=5),), bit0, None),
        ((), bit4, "CODEC_SPEC_INVALID"),
        ((), bit0 | bit4, "UNSUPPORTED_FEATURE"),
        ((ia(bits=4, codebook="gaussian"),), bit0 | bit4, "CODEC_SPEC_INVALID"),
        ((ia(bits=8, symmetric=True, codebook="gaussian"),), bit0 | bit4, "CODEC_SPEC_INVALID"),
        ((ia(bits=4, symmetric=True, codebook="gaussian"),), bit0 | bit4, None),
        ((ia(bits=4, rotation_seed=9),), bit0 | bit4, "CODEC_SPEC_INVALID"),
        ((ia(bits=4, rotation="hadamard", rotation_seed=3),), bit0 | bit4, None),
        ((CodecSpec("fp8", rotation="hadamard"), ia(bits=3)), bit0 | bit4, "CODEC_SPEC_INVALID"),
        ((CodecSpec("byteplane_zstd", codebook="gaussian"), ia(bits=3)), bit0 | bit4, "CODEC_SPEC_INVALID"),
        ((ia(bits=3), ia(bits=5)), bit0 | bit4, "CODEC_SPEC_INVALID"),
    ]
    check_header_cases(lib, arch, cases, lambda bits: 2 if bits & bit4 else 0)
