"""torch_dequant (the device-side lossy decoder) is bit-exact with quant.decode on CPU
torch, and refuses the bodies numpy refuses with the same rule."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from kvwire.codecs import quant
from kvwire.codecs import torch_dequant as TD
from kvwire.format import registry as R
from kvwire.format.codec_specs import CodecSpec
from kvwire.format.errors import CodecError

TDT = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
IDT = {2: np.uint16, 4: np.uint32}


def _spec(draw):
    if draw(st.booleans()):
        return CodecSpec("fp8", fp8_format=draw(st.sampled_from(sorted(quant.FP8))),
                         scale_granularity=draw(st.sampled_from(["tensor", "head", "token"])),
                         sink_tokens=draw(st.integers(0, 3)), residual_tokens=draw(st.integers(0, 3)))
    return CodecSpec("int_affine", bits=draw(st.sampled_from([8, 4, 2])), group_size=draw(st.sampled_from([1, 3, 4, 32])),
                     group_axis=draw(st.sampled_from(["tokens", "channels"])), symmetric=draw(st.booleans()),
                     scale_dtype=draw(st.sampled_from(["f32", "f16", "bf16"])),
                     sink_tokens=draw(st.integers(0, 3)), residual_tokens=draw(st.integers(0, 3)))


@st.composite
def cases(draw):
    spec = _spec(draw)
    dtype = draw(st.sampled_from(["bf16", "f16", "f32"]))
    H, T, D = draw(st.integers(1, 3)), draw(st.integers(1, 9)), draw(st.integers(1, 9))
    scale = draw(st.sampled_from([1.0, 1e-6, 1e4, 6e4]))
    x = (np.random.default_rng(draw(st.integers(0, 2**31))).standard_normal((H, T, D)) * scale)
    x = x.astype(R.DTYPES[dtype][2] if dtype != "bf16" else np.float32)
    return spec, dtype, x


def _pair(spec, dtype, body, lay):
    ref = quant.decode(spec, body, lay, dtype)
    dst = torch.zeros((lay.heads, lay.tokens, lay.dim), dtype=TDT[dtype])
    TD.dequant(spec, torch.frombuffer(bytearray(body), dtype=torch.uint8), lay, dtype, dst)
    return np.asarray(ref).view(IDT[lay.itemsize]), dst.view({2: torch.int16, 4: torch.int32}[lay.itemsize]).numpy()


@settings(max_examples=150, deadline=None)
@given(cases())
def test_matches_numpy(case):
    spec, dtype, x = case
    H, T, D = x.shape
    lay = quant.layout(spec, dtype, H, D, 0, T, 0, T)
    np_dt = R.DTYPES[dtype][2]
    try:
        body = b"".join(bytes(memoryview(p)) for p in quant.encode(spec, x.astype(np_dt), lay, dtype))
    except quant.NotFaithful:
        return
    ref, got = _pair(spec, dtype, body, lay)
    assert (ref.view(np.uint8) == got.view(np.uint8)).all()


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(quant.FP8)), st.sampled_from(["bf16", "f16", "f32"]), st.integers(0, 2**31))
def test_fp8_every_code_nan_inf_subnormal(fmt, dtype, seed):
    """All 256 codes with a random (tiny / huge) scale: NaN codes, overflow to inf, subnormals."""
    spec = CodecSpec("fp8", fp8_format=fmt, scale_granularity="tensor")
    lay = quant.layout(spec, dtype, 1, 256, 0, 1, 0, 1)
    rng = np.random.default_rng(seed)
    s = np.float32(2.0 ** rng.integers(-140, 120)) * np.float32(rng.uniform(1, 2))
    body = s.tobytes() + np.arange(256, dtype=np.uint8).tobytes()
    ref, got = _pair(spec, dtype, body, lay)
    assert (ref == got.view(ref.dtype)).all()


@pytest.mark.parametrize("spec,params,rule", [
    (CodecSpec("fp8", scale_granularity="tensor"), np.float32(-1).tobytes(), "KVW-FP8-3"),
    (CodecSpec("fp8", scale_granularity="tensor"), np.float32(np.inf).tobytes(), "KVW-FP8-3"),
    (CodecSpec("int_affine", bits=8, group_size=4, group_axis="channels", symmetric=True, scale_dtype="f32"),
     np.float32(-0.0).tobytes(), "KVW-INT-3"),
])
def test_bad_params_same_rule(spec, params, rule):
    lay = quant.layout(spec, "f16", 1, 4, 0, 1, 0, 1)
    body = params + bytes(lay.length - len(params))
    with pytest.raises(CodecError) as a:
        quant.decode(spec, body, lay, "f16")
    with pytest.raises(CodecError) as b:
        TD.dequant(spec, torch.frombuffer(bytearray(body), dtype=torch.uint8), lay, "f16",
                   torch.zeros((1, 1, 4), dtype=torch.float16))
    assert a.value.rule == b.value.rule == rule


def test_padding_bits_refused():
    spec = CodecSpec("int_affine", bits=4, group_size=3, group_axis="channels", symmetric=True, scale_dtype="f32")
    lay = quant.layout(spec, "f16", 1, 3, 0, 1, 0, 1)
    body = np.float32(1).tobytes() + bytes([0x21, 0x13])  # the last byte's high nibble is padding
    dst = torch.zeros((1, 1, 3), dtype=torch.float16)
    with pytest.raises(CodecError) as a:
        quant.decode(spec, body, lay, "f16")
    with pytest.raises(CodecError) as b:
        TD.dequant(spec, torch.frombuffer(bytearray(body), dtype=torch.uint8), lay, "f16", dst)
    assert a.value.rule == b.value.rule == "KVW-INT-4"
    assert (dst.view(torch.int16) == 0).all()  # nothing written


@pytest.mark.parametrize("codec", ["fp8-e4m3", "fp8-e4m3-token", "int8", "int4-g32", "int4-g32-zstd", "kivi2"])
def test_load_to_device_lossy(codec):
    """load_to_device (SimulatedStream, CPU device) of a lossy container equals the host load
    bit for bit, and the ring staged each lossy chunk as its lossy body (not decoded bytes)."""
    import forge
    import kvwire
    from kvwire.cache.cuda import SimulatedStream, StagingRing
    from kvwire.cache.device_load import load_to_device
    from kvwire.codecs.pipeline import lossy_range
    from kvwire.tools.synth import synth_cache
    cache = synth_cache(2, 2, 64, 512, chunk_tokens=128, seed=3)  # Gaussian bf16: every chunk faithful
    data = kvwire.encode(cache, codec=codec)
    with SimulatedStream(delay=0.0) as s, kvwire.open(data) as r:
        ring = StagingRing(s, 1, 2)
        got = load_to_device(r, "cpu", ring=ring)
        h, want, lossy = r.header, 0, 0
        for j in range(r.chunk_count):
            c, k = r.info(j), int(r.records["reserved0"][j])
            spec = h.codec_specs[k - 1] if k else None
            if spec is not None and spec.codec in ("fp8", "int_affine"):
                lay = quant.layout(spec, h.dtype, c.shape[0], c.shape[2], c.token_start,
                                   c.token_start + c.token_count, *lossy_range(h, c.layer))
                want += lay.length
                lossy += lay.M > 0
            else:
                want += c.raw_length
        raw = int(r.records["raw_length"].sum())
    assert forge.cache_bytes_equal(got, kvwire.load(data))
    assert lossy > 0 and ring.staged == want < raw  # compressed bytes crossed the ring
    with SimulatedStream(delay=0.0) as s, kvwire.open(data) as r:
        ring = StagingRing(s, 1, 2)
        host = load_to_device(r, "cpu", ring=ring, device_dequant=False)  # decoded on the host
    assert forge.cache_bytes_equal(host, got) and ring.staged == raw


@pytest.mark.parametrize("codec", ["hadamard-int4-g32", "hadamard-lloyd3", "kchan3-vlloyd2", "vllm-turboquant-4bit-nc"])
def test_load_to_device_of_revision_1_2_and_1_3_specs_decodes_on_the_host(codec):
    """Rotated, codebook and 3-bit specs have no torch kernel: load_to_device decodes them on
    the host (the ring stages decoded bytes) and the result equals the host load bit for bit
    (the device kernel would misread them)."""
    import forge
    import kvwire
    from kvwire.cache.cuda import SimulatedStream, StagingRing
    from kvwire.cache.device_load import load_to_device
    from kvwire.tools.synth import synth_cache
    data = kvwire.encode(synth_cache(2, 2, 64, 300, chunk_tokens=128, seed=4), codec=codec)
    assert kvwire.probe(data).format_minor >= 2
    with SimulatedStream(delay=0.0) as s, kvwire.open(data) as r:
        ring = StagingRing(s, 1, 2)
        got = load_to_device(r, "cpu", ring=ring)
        raw = int(r.records["raw_length"].sum())
        all_new = all(sp.needs_rotation_bit for sp in r.header.codec_specs)
    assert forge.cache_bytes_equal(got, kvwire.load(data))
    assert ring.staged == raw if all_new else ring.staged < raw  # turboquant's plain V: dequantized on the device
