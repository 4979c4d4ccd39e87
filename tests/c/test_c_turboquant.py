"""libkvwire's revision 1.3 (spec/codecs.md section 9: the TurboQuant codebook and the
unsigned rotation) against the numpy reference (kvwire.codecs.quant, kvwire.codecs.turboquant):
the same decoded bytes and the same rejections on random codes and norms of every rotation,
bit width, scale dtype and head dim (every power of two to 256, and the geometries KVW-TQ-2
rejects); the native encoder (native.encode_lossy over kvw_lossy_encode_wire) writing the
reference writer's bodies and refusals byte for byte for the three vllm-turboquant presets
and for the unsigned rotation under the 1.2 codebooks; whole containers of the presets equal
with and without libkvwire's encoder; and KVW-TQ-1/2's header rules with the reader's codes
and rules. Why: decoding is fp32 arithmetic in a fixed order (the squares added in order, a
square root, a division), so any other order or an FMA shows as bytes.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_c_rotation import check_header_cases
from test_native_codecs import LIB, both, values

import kvwire
from kvwire import CodecSpec
from kvwire.codecs import PRESETS, native, quant
from kvwire.codecs.pipeline import decode_chunk, lossy_range
from kvwire.codecs.presets import resolve
from kvwire.format import codec_specs as CS
from kvwire.format import registry as R
from kvwire.format.architecture import Architecture, LayerSpec
from kvwire.format.header import Header

FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.function_scoped_fixture])
TQ_PRESETS = ("vllm-turboquant-4bit-nc", "vllm-turboquant-k3v4-nc", "vllm-turboquant-3bit-nc")
ROT_BIT, TQ_BIT = R.REQUIRED_FEATURES["rotation"], R.REQUIRED_FEATURES["turboquant"]


def header(dtype, heads, dim, tokens, specs):
    arch = Architecture((LayerSpec("full_attention", heads, dim, dim),))
    bits = CS.features_of(specs)
    return Header(arch, token_count=tokens, dtype=dtype, chunk_tokens=256, codec_specs=tuple(specs),
                  required_features=bits, format_minor=3 if bits & TQ_BIT else 2 if bits & ROT_BIT else 0)


def _tq(bits, G, sd, rotation, seed):
    return CodecSpec("int_affine", bits=bits, group_size=G, group_axis="channels", symmetric=True, scale_dtype=sd,
                     rotation=rotation, rotation_seed=seed if rotation == "hadamard" else 0, codebook="turboquant")


TQ_SPECS = st.builds(_tq, st.sampled_from([3, 4]), st.sampled_from([256, 1 << 16]),
                     st.sampled_from(["f16", "bf16", "f32"]), st.sampled_from(["sylvester", "hadamard", "none"]),
                     st.sampled_from([0, 7, 2**64 - 1]))
# The unsigned rotation under section 8's codebooks (KVW-TQ-3 composes with both)
SYL_SPECS = st.builds(lambda b, G, axis, sym, sd, gauss: CodecSpec(
    "int_affine", bits=min(b, 4) if gauss else b, group_size=G, group_axis=axis, symmetric=sym or gauss,
    scale_dtype=sd, rotation="sylvester", codebook="gaussian" if gauss else "uniform"),
    st.sampled_from([2, 3, 4, 8]), st.sampled_from([1, 3, 16, 32, 128]), st.sampled_from(["tokens", "channels"]),
    st.booleans(), st.sampled_from(["f16", "bf16", "f32"]), st.booleans())


def _chunk(rng, spec, dtype, heads, dim, tokens, t0, special):
    h = header(dtype, heads, dim, t0 + tokens, [spec])
    lay = quant.layout(spec, dtype, heads, dim, t0, t0 + tokens, *lossy_range(h, 0))
    return h, lay, values(rng, (heads, tokens, dim), dtype, special)


def _body(spec, x, lay, dtype):
    return b"".join(bytes(memoryview(p).cast("B")) for p in quant.encode(spec, x, lay, dtype))


def _encode_both(h, spec, x, lay, dtype, t0=0):
    """(reference, libkvwire): ("ok", body) or ("refused",) or ("misuse",) (ValueError)."""
    def run(fn):
        try:
            return ("ok", fn())
        except quant.NotFaithful:
            return ("refused",)
        except ValueError:
            return ("misuse",)
    native.disable()
    ref = run(lambda: _body(spec, x, lay, dtype))
    native.enable(LIB)
    try:
        rec = native.record(h, "int_affine", 1, 0, x.nbytes, x.shape, 0, t0)
        got = run(lambda: bytes(native.encode_lossy(h, rec, np.ascontiguousarray(x).view(np.uint8))))
    finally:
        native.disable()
    return ref, got


@FAST
@given(spec=TQ_SPECS, dtype=st.sampled_from(["bf16", "f16", "f32"]), heads=st.integers(1, 3),
       dim=st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128, 256, 48, 96]), tokens=st.integers(1, 40),
       sink=st.integers(0, 4), resid=st.integers(0, 4), t0=st.sampled_from([0, 256]), small_groups=st.booleans(),
       random_body=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_decode_identical(lib, spec, dtype, heads, dim, tokens, sink, resid, t0, small_groups, random_body, seed):
    """KVW-TQ-2..4: any codes and norms decode to the reference's bytes, or both readers reject
    the body with the same code and rule (head_dim 48 / 96, groups shorter than a row,
    negative or non-finite norms, padding bits)."""
    rng = np.random.default_rng(seed)
    spec = replace(spec, sink_tokens=sink, residual_tokens=resid, group_size=dim // 2 if small_groups and dim > 1
                   else spec.group_size)
    h, lay, x = _chunk(rng, spec, dtype, heads, dim, tokens, t0, False)
    body = None
    if not random_body:
        ref, _ = _encode_both(h, spec, x, lay, dtype, t0)
        body = ref[1] if ref[0] == "ok" else None
    if body is None:
        body = bytearray(rng.integers(0, 256, lay.length, dtype=np.uint8).tobytes())
        sd = R.DTYPES[spec.scale_dtype]
        n = lay.M * heads
        at = lay.fp_bytes
        if rng.random() < 0.8 and n:  # mostly valid norms, so that the values are compared
            norms = np.abs(rng.standard_normal(n) * 3).astype(sd[2]).astype(sd[2].newbyteorder("<"))
            body[at : at + n * sd[1]] = norms.view(np.uint8).tobytes()
        body = bytes(body)
    raw = heads * tokens * dim * R.DTYPES[dtype][1]
    a, b = both(lambda: decode_chunk(h, "int_affine", 1, body, raw, (heads, tokens, dim), 0, t0))
    assert a == b


@FAST
@given(spec=st.one_of(TQ_SPECS, SYL_SPECS), dtype=st.sampled_from(["bf16", "f16", "f32"]), heads=st.integers(1, 3),
       dim=st.sampled_from([1, 4, 8, 16, 64, 128, 96]), tokens=st.integers(1, 40), sink=st.integers(0, 4),
       resid=st.integers(0, 4), special=st.booleans(),
       scale=st.sampled_from([1.0, 1.0, 1e-30, 1e-6, 1e4, 1e30]), seed=st.integers(0, 2**32 - 1))
def test_encode_identical(lib, spec, dtype, heads, dim, tokens, sink, resid, special, scale, seed):
    """The reference writer's bodies, refusals (KVW-TQ-5, KVW-ROT-7, KVW-LOSSY-6) and
    misuse (head_dim 96, not a power of two: ValueError) byte for byte."""
    rng = np.random.default_rng(seed)
    spec = replace(spec, sink_tokens=sink, residual_tokens=resid)
    h, lay, x = _chunk(rng, spec, dtype, heads, dim, tokens, 0, special)
    if scale != 1.0:
        with np.errstate(over="ignore"):
            x = (x.astype(np.float32) * np.float32(scale)).astype(x.dtype)
    ref, got = _encode_both(h, spec, x, lay, dtype)
    if ref[0] == "ok" and got == ("refused",) and spec.codebook == "gaussian":
        return  # the reference's band misses underflowing squares (tests/c/test_c_rotation.py)
    assert got == ref


@pytest.mark.parametrize("name", TQ_PRESETS)
@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("dim", [64, 128, 256, 32])
def test_presets_full_chunks(lib, name, dtype, dim):
    """The presets' K and V specs on full chunks (Llama-like outlier channels): libkvwire
    writes the reference's bodies, and both readers decode them to the same bytes."""
    for comp in ("k", "v"):
        spec = resolve(PRESETS[name], comp)
        rng = np.random.default_rng(dim)
        h, lay, x = _chunk(rng, spec, dtype, 4, dim, 256, 0, False)
        xf = rng.standard_normal(x.shape).astype(np.float32)
        xf[..., 3] *= 30
        x = xf.astype(x.dtype)
        ref, got = _encode_both(h, spec, x, lay, dtype)
        assert ref[0] == "ok" and got == ref, (comp, ref[0], got[0])
        a, b = both(lambda: decode_chunk(h, "int_affine", 1, ref[1], x.nbytes, x.shape, 0, 0))
        assert a == b and a[0] == "ok"


@pytest.mark.parametrize("name", TQ_PRESETS)
def test_preset_containers_identical(lib, name):
    """kvwire.encode of a preset writes the same container whether libkvwire or numpy encodes
    its chunks (bits 0, 4, 5, format_minor 3), and both readers load the same bytes."""
    rng = np.random.default_rng(1)
    ks = [rng.standard_normal((2, 70, 128)).astype(np.float16) for _ in range(2)]
    vs = [rng.standard_normal((2, 70, 128)).astype(np.float16) for _ in range(2)]
    cache = kvwire.KVCache.from_tensors(ks, vs, chunk_tokens=32)
    native.disable()
    ref = kvwire.encode(cache, codec=name)
    native.enable(LIB)
    try:
        got = kvwire.encode(cache, codec=name)
        loaded = kvwire.load(got)
    finally:
        native.disable()
    assert got == ref
    h = kvwire.probe(ref)
    assert h.required_features & (TQ_BIT | ROT_BIT) == TQ_BIT | ROT_BIT and h.format_minor == 3
    want = kvwire.load(ref)
    for i, layer in enumerate(want.layers):
        for comp, arr in layer.items():
            assert np.asarray(loaded.layers[i][comp]).tobytes() == np.asarray(arr).tobytes()


def test_header_rules(lib):
    """KVW-TQ-1/2 through kvw_header_new: the code and rule the numpy reader gives."""
    arch = Architecture((LayerSpec("full_attention", 1, 64, 64),))
    bit0 = R.REQUIRED_FEATURES["codec_specs"]
    all3 = bit0 | ROT_BIT | TQ_BIT
    k4 = resolve(PRESETS["vllm-turboquant-4bit-nc"], "k")
    cases = [
        ((k4,), all3, None),
        ((k4,), bit0 | TQ_BIT, "CODEC_SPEC_INVALID"),  # fields 11-13 unread without bit 4
        ((k4,), bit0 | ROT_BIT, "ENUM_OUT_OF_RANGE"),
        ((replace(k4, codebook="uniform"),), bit0 | ROT_BIT, "ENUM_OUT_OF_RANGE"),
        ((replace(k4, rotation="none"),), bit0 | ROT_BIT, "ENUM_OUT_OF_RANGE"),
        ((replace(k4, rotation="hadamard", rotation_seed=3),), all3, None),
        ((replace(k4, codebook="gaussian"),), all3, None),
        ((PRESETS["hadamard-lloyd4"],), all3, "CODEC_SPEC_INVALID"),
        ((), bit0 | ROT_BIT | TQ_BIT, "UNSUPPORTED_FEATURE"),
        ((), TQ_BIT, "CODEC_SPEC_INVALID"),
        ((), ROT_BIT | TQ_BIT, "CODEC_SPEC_INVALID"),
        ((replace(k4, rotation_seed=1),), all3, "CODEC_SPEC_INVALID"),
        ((replace(k4, symmetric=False),), all3, "CODEC_SPEC_INVALID"),
        ((replace(k4, group_axis="tokens"),), all3, "CODEC_SPEC_INVALID"),
        ((replace(k4, bits=2),), all3, "CODEC_SPEC_INVALID"),
        ((replace(k4, bits=8),), all3, "CODEC_SPEC_INVALID"),
        ((CodecSpec("fp8", rotation="sylvester"), k4), all3, "CODEC_SPEC_INVALID"),
        ((CodecSpec("int_affine", bits=3), k4), bit0 | ROT_BIT, "ENUM_OUT_OF_RANGE"),
    ]
    check_header_cases(lib, arch, cases, lambda bits: 3)
