"""Revision 1.1: per-layer scales of fp8 KV caches (spec/kvwire-v1.md section 5.10, required
feature bit 3 ``kv_scales``, ``Header`` field 20).

Round trips (a hypothesis property over dtypes, layer kinds, scales, forms and codecs), every
KVW-SCALE rule rejected with its code, the view of a 1.0 reader (bit 3 unknown:
UNSUPPORTED_FEATURE; field 20 without the bit: the same container for both), the values of
KVW-SCALE-6 against ml_dtypes and torch, and vLLM's fp8 paged buffers with their scales
through a container and back, bit for bit.
"""

from __future__ import annotations

import io
import json
import math
import struct

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import forge
import kvwire
from kvwire import stream
from kvwire.conformance import compare as C
from kvwire.conformance import neutral as N
from kvwire.format import registry as R
from kvwire.format.errors import FeatureError, HeaderError, LayoutError, SchemaError
from kvwire.format.fbs import Header as fbHeader
from kvwire.format.header import Architecture, Header, LayerSpec, ModelIdentity, TokenRange, build_header, parse_header
from kvwire.format.kv_scales import KV_SCALES_BIT, KVScale, dequantize_array
from kvwire.tools.cli import main as cli

FP8 = ("f8_e4m3fn", "f8_e5m2", "f8_e4m3fnuz")
F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).smallest_subnormal)
STATE_BIT = R.REQUIRED_FEATURES["state_layers"]
FULL = LayerSpec("full_attention", 2, 8, 8)
MLA = LayerSpec("mla_latent", 1, 12, 0, kv_lora_rank=8, qk_rope_head_dim=4)
SHARED0 = LayerSpec("shared", source_layer=0)
JAMBA = LayerSpec("state", state_tensors=(kvwire.StateTensor("conv", (1, 4, 3)),))
SCALES = ((0.0234375, 0.01171875), (0.10000000149011612, 0.5), (3.5, 0.0078125))


def scaled(layers=(FULL, FULL, FULL), scales=SCALES, *, dtype="f8_e4m3fn", tokens=0, chunk_tokens=8, **kw) -> Header:
    """A header as the writer writes it: bit 3 and format 1.1 (KVW-SCALE-1, KVW-EVOL-12)."""
    rf = kw.pop("required_features", 0) | KV_SCALES_BIT
    return Header(Architecture(tuple(layers)), token_count=tokens, dtype=dtype, chunk_tokens=chunk_tokens,
                  kv_scales=scales, required_features=rf, format_minor=1, **kw)


def container(h: Header) -> bytes:
    """A zero-chunk container around ``h`` (every writer check bypassed), preamble minor = h's."""
    return forge.wrap_header(forge.header_of(h), minor=h.format_minor)


random_cache = forge.random_cache


def preamble_minor(data: bytes) -> int:
    return struct.unpack_from("<H", data, 10)[0]


# ---------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------

positive_f32 = st.floats(min_value=F32_TINY, max_value=F32_MAX, width=32, allow_subnormal=True)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_scale2_scale6_round_trip_property_both_forms(data):
    """KVW-SCALE-2, -3, -6: any fp8 dtype, layer kinds, binary32 scales (subnormal to largest),
    form and codec: the scales come back exactly, the stored elements bit for bit, in the
    random-access and the sequential reader; the writer sets bit 3 and format 1.1."""
    dtype = data.draw(st.sampled_from(FP8), "dtype")
    kinds = ["full_attention"] + data.draw(st.lists(st.sampled_from(
        ["full_attention", "sliding_attention", "mla_latent", "shared"]), max_size=3), "kinds")
    specs, scales = [], []
    for kind in kinds:
        spec = {"full_attention": FULL, "sliding_attention": LayerSpec("sliding_attention", 1, 4, 6, window=3),
                "mla_latent": MLA, "shared": SHARED0}[kind]
        specs.append(spec)
        k = 1.0 if kind == "shared" else data.draw(positive_f32, "k_scale")
        v = 1.0 if kind in ("shared", "mla_latent") else data.draw(positive_f32, "v_scale")
        scales.append((k, v))
    tokens = data.draw(st.integers(0, 20), "tokens")
    h = Header(Architecture(tuple(specs)), token_count=tokens, dtype=dtype,
               chunk_tokens=data.draw(st.integers(1, 8), "chunk_tokens"), kv_scales=scales)
    assert (h.required_features, h.format_minor) == (0, 0)  # as a caller builds it: the writer derives both
    cache = random_cache(h, data.draw(st.integers(0, 2**32 - 1), "seed"))
    form = data.draw(st.sampled_from(["file", "stream"]), "form")
    blob = kvwire.encode(cache, form=form, codec=data.draw(st.sampled_from(["raw", "zstd"]), "codec"))
    want = h.replace(required_features=KV_SCALES_BIT, format_minor=1)
    assert preamble_minor(blob) == 1
    got = forge.read_all(blob)
    assert got.kv_scales == tuple(KVScale(k, v) for k, v in scales)
    assert [(e.k_scale, e.v_scale) for e in got.kv_scales] == [(float(k), float(v)) for k, v in scales]
    assert forge.cache_bytes_equal(got, kvwire.KVCache(want, cache.layers))
    dec = kvwire.StreamDecoder()
    dec.feed(blob)
    events = list(dec.events())
    dec.close()
    assert events[0].header == want
    assert parse_header(build_header(want)) == want


def test_scale1_evol12_the_writer_derives_bit_and_minor():
    """KVW-SCALE-1, KVW-EVOL-12: the Encoder sets bit 3 and minor 1 with kv_scales and clears
    both without; a container without scales is a 1.0 container (no field 20, minor 0)."""
    cache = random_cache(Header(Architecture((FULL, FULL)), token_count=9, dtype="f8_e4m3fn", chunk_tokens=4,
                                kv_scales=SCALES[:2]), 1)
    data = kvwire.encode(cache)
    h = kvwire.probe(data)
    assert (h.required_features, h.format_minor, preamble_minor(data)) == (KV_SCALES_BIT, 1, 1)
    plain = kvwire.encode(kvwire.load(data).with_header(kv_scales=None))
    hp = kvwire.probe(plain)
    assert (hp.required_features, hp.format_minor, preamble_minor(plain), hp.kv_scales) == (0, 0, 0, None)
    hb = plain[32:32 + struct.unpack_from("<I", plain, 12)[0]]
    assert fbHeader.Header.GetRootAs(hb, 0).KvScalesIsNone()
    assert forge.root_table(hb).nfields <= 20  # the vtable of a 1.0 header: no slot for field 20
    for wrong in (dict(format_minor=0), dict(required_features=0)):  # a header-level writer checks, never guesses
        with pytest.raises(ValueError, match="EVOL-12|SCALE-1"):
            build_header(h.replace(**wrong))
    with pytest.raises(ValueError, match="EVOL-12"):
        build_header(hp.replace(format_minor=1))  # minor 1 without a 1.1 feature


# ---------------------------------------------------------------------------------------
# Every rule rejected with its code
# ---------------------------------------------------------------------------------------

RULE_CASES = {
    "scale1-bit-without-field": (scaled(scales=None), "KVW-SCALE-1"),
    "scale2-fewer": (scaled(scales=SCALES[:2]), "KVW-SCALE-2"),
    "scale2-more": (scaled(scales=SCALES + ((1.0, 1.0),)), "KVW-SCALE-2"),
    "scale2-empty": (scaled(scales=()), "KVW-SCALE-2"),
    "scale3-nan": (scaled(scales=[SCALES[0], (math.nan, 0.5), SCALES[2]]), "KVW-SCALE-3"),
    "scale3-inf": (scaled(scales=[SCALES[0], SCALES[1], (3.5, math.inf)]), "KVW-SCALE-3"),
    "scale3-minus-inf": (scaled(scales=[(-math.inf, 1.0), SCALES[1], SCALES[2]]), "KVW-SCALE-3"),
    "scale3-zero": (scaled(scales=[(0.0, 1.0), SCALES[1], SCALES[2]]), "KVW-SCALE-3"),
    "scale3-negative-zero": (scaled(scales=[(1.0, -0.0), SCALES[1], SCALES[2]]), "KVW-SCALE-3"),
    "scale3-negative": (scaled(scales=[SCALES[0], (-0.5, 0.5), SCALES[2]]), "KVW-SCALE-3"),
    "scale3-underflows-to-zero": (scaled(scales=[(1e-50, 1.0), SCALES[1], SCALES[2]]), "KVW-SCALE-3"),
    "scale4-bf16": (scaled(dtype="bf16"), "KVW-SCALE-4"),
    "scale4-f32": (scaled(dtype="f32"), "KVW-SCALE-4"),
    "scale4-i8": (scaled(dtype="i8"), "KVW-SCALE-4"),
    "scale4-u8": (scaled(dtype="u8"), "KVW-SCALE-4"),
    "scale5-mla-v-scale": (scaled((MLA, FULL), ((0.5, 0.5), (1.0, 1.0))), "KVW-SCALE-5"),
    "scale5-shared": (scaled((FULL, SHARED0), ((0.5, 0.5), (0.5, 0.5))), "KVW-SCALE-5"),
    "scale5-shared-v-only": (scaled((FULL, SHARED0), ((0.5, 0.5), (1.0, 2.0))), "KVW-SCALE-5"),
    "scale5-state": (scaled((FULL, JAMBA), ((0.5, 0.5), (2.0, 1.0)), required_features=STATE_BIT), "KVW-SCALE-5"),
}


@pytest.mark.parametrize("name", sorted(RULE_CASES))
def test_scale1_to_scale5_each_rejected_with_kv_scales_invalid(name):
    """KVW-SCALE-1..5: KV_SCALES_INVALID (SchemaError) with the rule id, random-access and sequential readers."""
    h, rule = RULE_CASES[name]
    data = container(h)
    forge.expect(data, SchemaError, "KV_SCALES_INVALID", rule)
    dec = kvwire.StreamDecoder()
    with forge.raises_code(SchemaError, "KV_SCALES_INVALID", rule):
        dec.feed(data)
        list(dec.events())
    with forge.raises_code(SchemaError, "KV_SCALES_INVALID", rule):  # the writer refuses it too (KVW-WRITE-1)
        build_header(h)


def test_scale2_lim1_over_4096_entries_is_limit_exceeded():
    """KVW-SCALE-2 / KVW-LIM-1: the vector's count is checked against 4096 when decoded."""
    forge.expect(container(scaled(scales=((1.0, 1.0),) * 4097)), kvwire.LimitError, "LIMIT_EXCEEDED", "KVW-LIM-1")


def test_err4_order_of_the_scale_rules():
    """Section 14.1 step 3: SCALE-1, SCALE-4, SCALE-2, SCALE-3 (layer order, k before v), SCALE-5."""
    order = [
        (scaled(scales=None, dtype="bf16"), "KVW-SCALE-1"),
        (scaled(scales=SCALES[:1], dtype="bf16"), "KVW-SCALE-4"),
        (scaled(scales=((math.nan, 1.0),)), "KVW-SCALE-2"),
        (scaled((MLA, FULL), ((0.5, 2.0), (math.nan, 1.0))), "KVW-SCALE-3"),  # a SCALE-3 defect after a SCALE-5 one
    ]
    for h, rule in order:
        forge.expect(container(h), SchemaError, "KV_SCALES_INVALID", rule)
    with forge.raises_code(SchemaError, "KV_SCALES_INVALID", "KVW-SCALE-3") as e:
        parse_header(forge.header_of(scaled(scales=[(1.0, -1.0), (-2.0, 1.0), SCALES[2]])))
    assert "layer 0 v_scale" in str(e.value)
    # the header rules before it come first: an unknown bit (KVW-EVOL-3) before anything of kv_scales
    forge.expect(container(scaled(scales=None, required_features=1 << 40)), FeatureError, "UNSUPPORTED_FEATURE",
                 "KVW-EVOL-3")


def test_scale1_with_bit_3_field_20_is_verified():
    """KVW-SCALE-1 / KVW-HDR-3, -4: with the bit, field 20 is followed and verified like any field."""
    h = scaled()
    hb = forge.header_of(h)
    pos = forge.field_pos(forge.root_table(hb), 20, 4)
    off = struct.unpack_from("<I", hb, pos)[0]
    forge.expect(forge.wrap_header(forge.patch(hb, pos, "I", 0x7FFFFFF0), minor=1), HeaderError, "FB_BOUNDS",
                 "KVW-HDR-3")
    forge.expect(forge.wrap_header(forge.patch(hb, pos, "I", off + 2), minor=1), HeaderError, "FB_ALIGNMENT",
                 "KVW-HDR-4")


# ---------------------------------------------------------------------------------------
# What a 1.0 reader sees (KVW-EVOL-2, -3, -11)
# ---------------------------------------------------------------------------------------

def test_scale1_field_20_without_bit_3_is_neither_read_nor_verified_nor_written():
    """KVW-SCALE-1 (and KVW-EVOL-11): without bit 3 field 20 is a field 1.0 does not know: the
    container reads as unscaled, even when the field points outside the header; no writer
    emits it."""
    h = scaled(tokens=0).replace(required_features=0, format_minor=0)
    hb = forge.header_of(h)
    assert fbHeader.Header.GetRootAs(hb, 0).KvScalesLength() == 3  # the field is in the bytes
    assert parse_header(hb) == h.replace(kv_scales=None)
    pos = forge.field_pos(forge.root_table(hb), 20, 4)
    assert parse_header(forge.patch(hb, pos, "I", 0x7FFFFFF0)) == h.replace(kv_scales=None)
    assert kvwire.probe(forge.wrap_header(forge.patch(hb, pos, "I", 0x7FFFFFF0))).kv_scales is None
    with pytest.raises(ValueError, match="SCALE-1"):
        build_header(h)


def test_evol3_a_1_0_reader_rejects_bit_3_and_reads_everything_else_the_same(monkeypatch):
    """KVW-EVOL-3 through the feature registry: a reader whose KNOWN_REQUIRED_FEATURES lacks bit
    3 (a 1.0 reader) rejects a scaled container with UNSUPPORTED_FEATURE, in both readers; a
    container with field 20 but no bit reads identically in both views."""
    scaled_c = random_cache(scaled(tokens=10, chunk_tokens=4), 3)
    data = kvwire.encode(scaled_c)
    plain_h = scaled_c.header.replace(kv_scales=None, required_features=0, format_minor=0)
    p = forge.split(kvwire.encode(kvwire.KVCache(plain_h, scaled_c.layers)))
    p.header = forge.header_of(plain_h.replace(kv_scales=SCALES))
    no_bit = forge.assemble(p)
    as_1_1 = forge.read_all(no_bit)
    monkeypatch.setattr(R, "KNOWN_REQUIRED_FEATURES", R.KNOWN_REQUIRED_FEATURES & ~KV_SCALES_BIT)
    forge.expect(data, FeatureError, "UNSUPPORTED_FEATURE", "KVW-EVOL-3", stage="open")
    dec = kvwire.StreamDecoder()
    with forge.raises_code(FeatureError, "UNSUPPORTED_FEATURE", "KVW-EVOL-3"):
        dec.feed(data)
        list(dec.events())
    assert forge.cache_bytes_equal(forge.read_all(no_bit), as_1_1)
    assert as_1_1.kv_scales is None


def test_evol12_readers_decide_nothing_from_the_minor():
    """KVW-EVOL-12: bit 3 with minor 0 reads like minor 1; minor 1 without 1.1 features like 1.0."""
    h = scaled(tokens=0)
    assert kvwire.probe(container(h.replace(format_minor=0))).kv_scales == h.kv_scales
    plain = Header(Architecture((FULL,)), token_count=0, dtype="f8_e4m3fn", format_minor=1)
    assert kvwire.probe(container(plain)).kv_scales is None


# ---------------------------------------------------------------------------------------
# Values (KVW-SCALE-6)
# ---------------------------------------------------------------------------------------

ALL_SCALES = (F32_TINY, 2.0 ** -126, 0.10000000149011612, 1.0 / 448, 1.0, 3.0, 448.0, 2.0 ** 100, F32_MAX)


@pytest.mark.parametrize("dtype", FP8)
def test_scale6_dequantize_matches_ml_dtypes_for_every_element(dtype):
    """KVW-SCALE-6: every one of the 256 elements times binary32 scales from the smallest
    subnormal to the largest finite value equals the exact product (ml_dtypes' value of the
    element times the scale in binary64, where the product of two binary32 values is exact)
    rounded once to binary32: NaN stays NaN, infinities and signed zeros stay, overflow is an
    infinity, subnormal results are kept. Casting the values to bf16/f16 rounds them once more."""
    x = np.arange(256, dtype=np.uint8).view(R.DTYPES[dtype][2])
    exact = np.array([float(v) for v in x.astype(np.float64)])
    for s in ALL_SCALES:
        s = float(np.float32(s))  # a scale is binary32 (1/448 is not)
        with np.errstate(over="ignore", invalid="ignore"):
            want = (exact * s).astype(np.float32)
        got = dequantize_array(x, s)
        assert got.dtype == np.float32
        assert np.array_equal(np.isnan(got), np.isnan(want))
        ok = ~np.isnan(want)
        assert np.array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32)), (dtype, s)
        for cast in ("bf16", "f16"):
            with np.errstate(over="ignore", invalid="ignore"):
                ref = want.astype(R.DTYPES[cast][2])
            out = dequantize_array(x, s, cast)
            assert np.array_equal(out[ok].view(np.uint16), ref[ok].view(np.uint16)), (dtype, s, cast)
    assert np.isposinf(dequantize_array(x, F32_MAX)).any()  # overflow: +-infinity, not NaN or a clamp
    assert (dequantize_array(x, F32_TINY)[ok].view(np.uint32) & 0x7F800000 == 0).any()  # subnormals kept


def test_scale6_kvcache_dequantize_scales_each_component_by_its_scale():
    """KVW-SCALE-6 / -5: K and LATENT by k_scale, V by v_scale, shared layers none, state tensors
    unscaled; ``dequantize`` gives an unscaled cache (no field, bit, minor 0) a writer encodes."""
    h = scaled((FULL, MLA, LayerSpec("shared", source_layer=1), JAMBA),
               ((0.5, 0.25), (0.125, 1.0), (1.0, 1.0), (1.0, 1.0)), tokens=7, chunk_tokens=4,
               required_features=STATE_BIT)
    cache = random_cache(h, 5)
    for i, layer in enumerate(cache.layers):
        s = cache.layer_scales(i)
        got = cache.dequantize_layer(i)
        for comp, x in layer.items():
            if comp == "state":
                assert {n: t.tobytes() for n, t in got["state"].items()} == {n: t.tobytes() for n, t in x.items()}
                continue
            want = x.astype(np.float32) * np.float32(s.v_scale if comp == "v" else s.k_scale)
            assert got[comp].tobytes() == want.tobytes(), (i, comp)
    f = cache.dequantize("bf16")
    assert (f.header.dtype, f.kv_scales, f.header.required_features, f.header.format_minor) == \
           ("bf16", None, STATE_BIT, 0)
    assert f.layers[0]["v"].tobytes() == (cache.layers[0]["v"].astype(np.float32) * np.float32(0.25)).astype(
        ml_dtypes.bfloat16).tobytes()
    assert forge.cache_bytes_equal(forge.read_all(kvwire.encode(f, codec="zstd")), f)
    assert cache.dequantize().header.dtype == "f32"
    plain = random_cache(Header(Architecture((FULL,)), token_count=3, dtype="f8_e5m2"), 6)
    assert plain.layer_scales(0) == KVScale(1.0, 1.0) and plain.kv_scales is None
    assert plain.dequantize().layers[0]["k"].tobytes() == plain.layers[0]["k"].astype(np.float32).tobytes()


# ---------------------------------------------------------------------------------------
# vLLM's fp8 paged buffers (KVW-SCALE-7)
# ---------------------------------------------------------------------------------------

def test_scale7_vllm_fp8_paged_buffers_and_scales_round_trip_bit_exactly():
    """vLLM kv_cache_dtype="fp8": per attention layer a uint8 tensor [num_blocks, num_kv_heads,
    block_size, 2 * head_dim] (K in the first head_dim channels, V in the last, as the
    FlashAttention/Triton backends split it) viewed as float8_e4m3fn, and the layer's scales as
    Python floats (``_k_scale_float``, ``_v_scale_float``: binary32 values). A request's blocks
    go into a container with their scales and come back into fresh buffers bit for bit, the
    scales as the same floats; the values equal torch's fp32 dequantization."""
    num_blocks, heads, block_size, head_dim, L = 12, 2, 16, 8, 3
    gen = torch.Generator().manual_seed(15)
    buffers = [torch.randint(0, 256, (num_blocks, heads, block_size, 2 * head_dim), dtype=torch.uint8,
                             generator=gen) for _ in range(L)]
    fp8 = [b.view(torch.float8_e4m3fn) for b in buffers]
    scales = [(torch.tensor(k, dtype=torch.float32).item(), torch.tensor(v, dtype=torch.float32).item())
              for k, v in ((0.0172, 0.0098), (0.5, 0.03), (0.1, 1.0))]  # calibrated-looking, not dyadic
    block_table, T = [7, 2, 9, 4], 50  # the last block holds 2 tokens
    t = torch.arange(T)
    blocks, offs = torch.tensor(block_table)[t // block_size], t % block_size

    def gather(x):  # [tokens, heads, 2 * head_dim] -> K, V [heads, tokens, head_dim]
        y = x[blocks, :, offs]
        return y[..., :head_dim].permute(1, 0, 2).contiguous(), y[..., head_dim:].permute(1, 0, 2).contiguous()

    kv = [gather(x) for x in fp8]
    cache = kvwire.KVCache.from_tensors([k for k, _ in kv], [v for _, v in kv], kv_scales=scales, chunk_tokens=16)
    for form, codec in (("file", "raw"), ("stream", "zstd"), ("file", "byteplane")):
        data = kvwire.encode(cache, form=form, codec=codec)
        back = kvwire.load(data, backend="torch")
        assert back.header.dtype == "f8_e4m3fn"
        out = [torch.zeros_like(b) for b in buffers]
        for i in range(L):
            s = back.layer_scales(i)
            assert (s.k_scale, s.v_scale) == scales[i] and type(s.k_scale) is float  # the same Python floats
            view = out[i].view(torch.float8_e4m3fn)
            view[blocks, :, offs] = torch.cat([back.keys(i), back.values(i)], dim=2).permute(1, 0, 2)
            assert torch.equal(out[i][blocks, :, offs], buffers[i][blocks, :, offs])  # the request's slots
            untouched = torch.ones(num_blocks, dtype=torch.bool)
            untouched[block_table] = False
            assert not out[i][untouched].any()
            vals = back.dequantize_layer(i)
            for comp, x, sc in (("k", kv[i][0], scales[i][0]), ("v", kv[i][1], scales[i][1])):
                ref = (x.to(torch.float32) * sc).numpy()  # what an fp8 attention kernel computes
                assert np.array_equal(np.isnan(vals[comp]), np.isnan(ref))
                ok = ~np.isnan(ref)
                assert np.array_equal(vals[comp][ok].view(np.uint32), ref[ok].view(np.uint32))


def test_scale7_the_reference_hands_scales_over_with_the_elements():
    """KVW-SCALE-7: every way the reference gives out stored elements carries the scales:
    probe, open, load, the sequential decoder's header event, segments."""
    cache = random_cache(scaled(tokens=10, chunk_tokens=4), 7)
    data = kvwire.encode(cache, form="stream")
    assert kvwire.probe(data).kv_scales == cache.kv_scales
    with kvwire.open(data) as r:
        assert r.header.kv_scales == cache.kv_scales
        assert r.load().kv_scales == cache.kv_scales
    dec = kvwire.StreamDecoder()
    dec.feed(data)
    assert next(iter(dec.events())).header.kv_scales == cache.kv_scales
    segs = [kvwire.KVCache(cache.header.replace(first_position=s, token_count=e - s),
                           [{c: x[:, s:e] for c, x in layer.items()} for layer in cache.layers])
            for s, e in ((0, 4), (4, 10))]
    ra = stream.Reassembler()
    for seg in stream.read_segments(io.BytesIO(b"".join(kvwire.encode(s, form="stream") for s in segs))):
        ra.add(seg)
    assert forge.cache_bytes_equal(ra.cache(), kvwire.KVCache(cache.header, cache.layers))
    other = segs[1].with_header(kv_scales=SCALES[:2] + ((3.5, 0.5),))
    ra = stream.Reassembler()
    ra.add(segs[0])
    with forge.raises_code(LayoutError, "SEGMENT_MISMATCH", "KVW-STREAM-5"):  # KVW-STREAM-7: a shared value
        ra.add(other)


# ---------------------------------------------------------------------------------------
# Layer ranges (KVW-SCALE-8), API, JSON, inspect
# ---------------------------------------------------------------------------------------

def test_scale8_layer_slice_cuts_every_per_layer_value():
    """KVW-SCALE-8: Header.layer_slice(start, stop) keeps the scales of the layers it holds,
    with their specs, token ranges and per-layer fingerprints; shared sources are renumbered."""
    specs = (FULL, MLA, FULL, LayerSpec("shared", source_layer=2))
    sc = ((0.5, 0.25), (0.125, 1.0), (2.0, 4.0), (1.0, 1.0))
    fps = bytes(range(128))
    h = scaled(specs, sc, tokens=6, chunk_tokens=4, model=ModelIdentity(layer_weights_fingerprints=fps),
               layer_tokens=(TokenRange(0, 6), TokenRange(0, 6), TokenRange(2, 4), TokenRange(0, 0)))
    sub = h.layer_slice(2, 4)
    assert sub.kv_scales == (KVScale(2.0, 4.0), KVScale(1.0, 1.0))
    assert sub.arch.layers == (FULL, LayerSpec("shared", source_layer=0))
    assert sub.layer_tokens == (TokenRange(2, 4), TokenRange(0, 0)) and sub.layer_map == ()
    assert sub.model.layer_weights_fingerprints == fps[64:128]
    cache = random_cache(h, 8)
    part = kvwire.KVCache(sub, cache.layers[2:4])
    got = forge.read_all(kvwire.encode(part))
    assert got.kv_scales == sub.kv_scales and got.layers[0]["k"].tobytes() == cache.layers[2]["k"].tobytes()
    assert h.layer_slice(0, 4) == h.replace(layer_map=())
    for bad in ((3, 4), (0, 0), (2, 1), (0, 5), (-1, 2), (0.0, 1)):  # a source outside, empty, reversed, beyond
        with pytest.raises(ValueError):
            h.layer_slice(*bad)
    sparse = kvwire.SparseKVCache.streaming(random_cache(scaled((FULL,), SCALES[:1], tokens=8, chunk_tokens=4), 9),
                                            1, 2)
    with pytest.raises(ValueError, match="sparse"):
        sparse.header.layer_slice(0, 1)


def test_api_misuse_is_named():
    """Clear TypeErrors and ValueErrors naming the valid forms and choices."""
    arch = Architecture((FULL,))
    for bad in ("0.5", 0.5, {0: (1.0, 1.0)}, [(1.0,)], [("a", 1.0)], [(True, 1.0)], [object()]):
        with pytest.raises(TypeError, match="kv_scales|scale"):
            Header(arch, kv_scales=bad)
    assert Header(arch, kv_scales=[KVScale(0.5, 2)]).kv_scales == (KVScale(0.5, 2.0),)
    assert Header(arch, kv_scales=np.array([[0.5, 2.0]], np.float32)).kv_scales == (KVScale(0.5, 2.0),)
    assert KVScale(0.1).k_scale == float(np.float32(0.1)) and KVScale(0.1).v_scale == 1.0  # binary32, v defaults 1
    cache = random_cache(scaled(tokens=2), 10)
    with pytest.raises(ValueError, match="f32, bf16, f16"):
        cache.dequantize("i8")
    with pytest.raises(ValueError, match="f32, bf16, f16"):
        cache.dequantize_layer(0, dtype="f8_e4m3fn")


def test_neutral_json_twin_carries_the_scales_and_the_runner_requires_them():
    """PROTOCOL.md 2.2: ``kv_scales`` is reported as [{k_scale, v_scale}] per layer, read back
    exactly, and a decoder that leaves it out (or gets one wrong) fails the comparison."""
    h = scaled(tokens=4, chunk_tokens=4)
    d = N.header_to_json(h)
    assert d["kv_scales"][1] == {"k_scale": 0.10000000149011612, "v_scale": 0.5}
    assert N.header_from_json(json.loads(json.dumps(d))) == h
    assert "kv_scales" not in N.header_to_json(h.replace(kv_scales=None))
    missing = {k: v for k, v in d.items() if k != "kv_scales"}
    assert "kv_scales: not reported" in C.compare_header(d, missing)[0]
    wrong = json.loads(json.dumps(d))
    wrong["kv_scales"][2]["v_scale"] = 0.0078125 * 2
    assert any(e.startswith("kv_scales: expected") for e in C.compare_header(d, wrong)[0])
    assert C.compare_header(d, json.loads(json.dumps(d))) == ([], [])


def test_inspect_shows_the_scales(tmp_path, capsys):
    path = tmp_path / "fp8.kvw"
    path.write_bytes(kvwire.encode(random_cache(scaled(tokens=4, chunk_tokens=4), 11)))
    assert cli(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "kvwire 1.1" in out and "x per-layer scales (kv_scales)" in out
    assert "k_scale=0.100000001 v_scale=0.5" in out and "k_scale=0.0234375 v_scale=0.01171875" in out
    assert cli(["inspect", str(path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["kv_scales"][2] == {"k_scale": 3.5, "v_scale": 0.0078125} and d["required_features"] == KV_SCALES_BIT


def test_lim7_a_4096_layer_scaled_header_is_small_and_cheap():
    """The field costs 8 bytes per layer and no table visit (section 5.10 rationale): a 4096-layer
    header grows by 32 KiB and 44 bytes (count, vtable slots, the now non-default bit and minor),
    and the vector costs its 32 KiB of the parse budget (KVW-LIM-7), nothing more."""
    from kvwire.format.flatbuf import Buffer

    arch = Architecture((FULL,) * 4096)
    plain = build_header(Header(arch, token_count=0, dtype="f8_e4m3fn"))
    hb = build_header(Header(arch, token_count=0, dtype="f8_e4m3fn", kv_scales=[(0.5, 0.25)] * 4096,
                             required_features=KV_SCALES_BIT, format_minor=1))
    assert 8 * 4096 < len(hb) - len(plain) <= 8 * 4096 + 64
    assert parse_header(hb).kv_scales == (KVScale(0.5, 0.25),) * 4096
    buf = Buffer(hb, b"KVWH", "KVW-HDR-1")
    t = buf.root()
    t.vector(20, 8, 4, 4096)
    assert buf.spent <= 8 * 4096 + 64
