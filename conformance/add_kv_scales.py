"""Conformance vectors of revision 1.1's per-layer fp8 scales (spec/kvwire-v1.md section 5.10,
feature bit 3 ``kv_scales``, ``Header`` field 20), appended to the major-1 folder.

``gen_kv_scales(g)`` is registered in ``generate.py``'s ``ADDITIONS`` as ``kv_scales``;
``generate.py --add kv_scales`` appends these vectors. Valid vectors: fp8 caches of every
fp8 dtype with their scales (format 1.1 containers, ``format_minor`` 1), raw, zstd and
byteplane bodies, MLA, shared, sliding, state and sparse layers, scales at the binary32
limits, segments; and containers a 1.0 reader reads the same way: field 20 without bit 3
(neither read nor verified, KVW-SCALE-1) and bit 3 with ``format_minor`` 0 (KVW-EVOL-12).
Invalid vectors: one per rule and case, each breaking one rule with its code; the canonical
tensors of a valid vector are the stored fp8 elements (KVW-SCALE-6).
"""

from __future__ import annotations

import math
import struct

import numpy as np

import forge
import kvwire
from kvwire import StateTensor
from kvwire.cache.sparse import SparseKVCache
from kvwire.format import registry as R
from kvwire.format.header import Architecture, Header, LayerSpec, Producer, TokenRange
from kvwire.format.kv_scales import KV_SCALES_BIT

PRODUCER = Producer("kvwire-conformance-generator", "1.0")
STATE_BIT = R.REQUIRED_FEATURES["state_layers"]
F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).smallest_subnormal)  # 2^-149
FULL = LayerSpec("full_attention", 2, 8, 8)
SCALES = ((0.0234375, 0.01171875), (0.10000000149011612, 0.5), (3.5, 0.0078125))  # binary32 values, one per layer


def _cache(h: Header, seed: int, *, compressible: bool = False) -> kvwire.KVCache:
    """Arbitrary fp8 bit patterns (NaN, infinities of e5m2, -0, subnormals) for every stored tensor."""
    return forge.random_cache(h, seed, compressible=compressible)


def _scaled(arch, scales, *, dtype="f8_e4m3fn", tokens=20, chunk_tokens=8, **kw) -> Header:
    """A 1.1 header as the writer makes it: bit 3 and format_minor 1 (KVW-SCALE-1, KVW-EVOL-12)."""
    rf = kw.pop("required_features", 0) | KV_SCALES_BIT
    return Header(Architecture(tuple(arch)), token_count=tokens, dtype=dtype, chunk_tokens=chunk_tokens,
                  producer=PRODUCER, kv_scales=scales, required_features=rf, format_minor=1, **kw)


def _with_header(data: bytes, h: Header, *, minor: int | None = None, hb: bytes | None = None) -> bytes:
    """``data`` with its header replaced by ``h`` (the writer's checks bypassed), preamble minor = h's."""
    p = forge.split(data)
    p.header = forge.header_of(h) if hb is None else hb
    return forge.patch_preamble(forge.assemble(p), minor=h.format_minor if minor is None else minor)


def _field20(hb: bytes) -> int:
    """Position of the uoffset of Header field 20 in header bytes ``hb``."""
    return forge.field_pos(forge.root_table(hb), 20, 4)


def _stream(*parts) -> bytes:
    return b"".join(kvwire.encode(p, form="stream") for p in parts)


def gen_kv_scales(g) -> None:
    """Section 5.10: KVW-SCALE-1..8, KVW-EVOL-12, and the 1.0 reader's view (KVW-EVOL-2, -3, -11)."""
    W = lambda form="file", codec="raw": {"form": form, "codec": codec}
    I = g.invalid

    # --- valid -------------------------------------------------------------------------
    h1 = _scaled([FULL] * 3, SCALES)
    c1 = _cache(h1, 15001)
    base = kvwire.encode(c1)
    assert kvwire.probe(base) == h1
    g.valid("kv-scales-e4m3fn", base, c1, writer=W(),
            rules=["KVW-SCALE-1", "KVW-SCALE-2", "KVW-SCALE-3", "KVW-SCALE-4", "KVW-SCALE-6", "KVW-EVOL-12"],
            description="3 full-attention layers (2 kv heads, head_dim 8) of f8_e4m3fn elements as vLLM "
                        "kv_cache_dtype='fp8' caches them, 20 tokens in chunks of 8, and kv_scales (k_scale, "
                        f"v_scale) {list(SCALES)} (binary32: 0.10000000149011612 is f32(0.1)); required bit 3, "
                        "format 1.1; the canonical tensors are the stored fp8 elements")

    h2 = _scaled([FULL, FULL], ((0.25, 2.0), (1.0, 1.0)), dtype="f8_e5m2", tokens=13, chunk_tokens=4)
    c2 = _cache(h2, 15002, compressible=True)
    g.valid("kv-scales-e5m2-zstd-stream", kvwire.encode(c2, form="stream", codec="zstd"), c2,
            writer=W("stream", "zstd"), rules=["KVW-SCALE-6", "KVW-SCALE-1"],
            description="f8_e5m2 elements (patterns that include infinities and NaNs) with kv_scales "
                        "((0.25, 2.0), (1.0, 1.0)), zstd bodies, stream form: the codec acts on the stored "
                        "elements, the scales apply after decoding")

    mla = LayerSpec("mla_latent", 1, 12, 0, kv_lora_rank=8, qk_rope_head_dim=4)
    arch3 = [mla, LayerSpec("shared", source_layer=0), LayerSpec("sliding_attention", 2, 4, 4, window=4)]
    h3 = _scaled(arch3, ((0.03125, 1.0), (1.0, 1.0), (1.5, 0.75)), dtype="f8_e4m3fnuz", tokens=11, chunk_tokens=4,
                 layer_tokens=(TokenRange(0, 11), TokenRange(0, 0), TokenRange(8, 3)))
    c3 = _cache(h3, 15003, compressible=True)
    d3 = kvwire.encode(c3, codec="byteplane")
    g.valid("kv-scales-e4m3fnuz-mla-shared-byteplane", d3, c3.with_header(**_spec_fields(d3)),
            rules=["KVW-SCALE-5", "KVW-SCALE-6", "KVW-SCALE-4", "KVW-CSPEC-10"],
            description="f8_e4m3fnuz: an mla_latent layer (LATENT scaled by k_scale 0.03125, v_scale 1.0), a "
                        "shared layer (entry 1.0, 1.0: its values are layer 0's) and a sliding layer holding 3 "
                        "tokens; byteplane_zstd bodies (required bits 0 and 3)")

    JAMBA = LayerSpec("state", state_tensors=(StateTensor("conv", (1, 4, 3)), StateTensor("ssm", (1, 2, 4, 3))))
    h4 = _scaled([FULL, JAMBA], ((0.5, 0.25), (1.0, 1.0)), tokens=6, chunk_tokens=4, required_features=STATE_BIT)
    c4 = _cache(h4, 15004)
    g.valid("kv-scales-state-layer", kvwire.encode(c4), c4, writer=W(), rules=["KVW-SCALE-5", "KVW-SCALE-2"],
            description="an fp8 attention layer and a state layer (f32 state tensors, never scaled: entry 1.0, "
                        "1.0); required bits 2 and 3")

    h5 = _scaled([FULL] * 3, ((F32_TINY, F32_MAX), (2.0 ** -126, 1.0), (F32_MAX, F32_TINY)), tokens=4,
                 chunk_tokens=4)
    c5 = _cache(h5, 15005)
    g.valid("kv-scales-binary32-limits", kvwire.encode(c5), c5, writer=W(), rules=["KVW-SCALE-3"],
            description="scales at the limits of 'finite and above 0': the smallest subnormal 2^-149, the smallest "
                        "normal 2^-126 and the largest finite binary32 (3.4028234663852886e38)")

    dense = _cache(_scaled([FULL, FULL], SCALES[:2], tokens=20, chunk_tokens=4), 15006)
    sp = SparseKVCache.streaming(dense, 2, 5)
    g.valid("kv-scales-sparse", kvwire.encode(sp), sp, writer=W(), rules=["KVW-SCALE-6"],
            description="a sparse (StreamingLLM) f8_e4m3fn cache with kv_scales: every retained row is scaled by "
                        "its layer's entry; required bits 1 and 3")

    hs = _scaled([FULL], ((0.125, 0.0625),), tokens=0, chunk_tokens=4)
    seq = _cache(hs.replace(token_count=10), 15007)

    def seg(s: int, e: int, scales=None) -> kvwire.KVCache:
        h = hs.replace(first_position=s, token_count=e - s, kv_scales=scales or hs.kv_scales)
        return kvwire.KVCache(h, [{c: x[:, s:e, :] for c, x in seq.layers[0].items()}])

    g.valid("kv-scales-segments", _stream(seg(0, 4), seg(4, 10)), seq, segments=2,
            rules=["KVW-STREAM-7", "KVW-SCALE-6"],
            description="two segments [0, 4) and [4, 10) of an fp8 cache with equal kv_scales: the scales are a "
                        "header value the segments share")

    # 1.0 reader's view: field 20 without bit 3 is not read (KVW-SCALE-1, KVW-EVOL-2, KVW-EVOL-11)
    plain = h1.replace(kv_scales=None, required_features=0, format_minor=0)
    c6 = kvwire.KVCache(plain, c1.layers)
    data6 = kvwire.encode(c6)
    hb = forge.header_of(plain.replace(kv_scales=SCALES))  # field 20 written, bit 3 clear
    g.valid("kv-scales-field-without-bit-not-read", _with_header(data6, plain, hb=hb), c6,
            rules=["KVW-SCALE-1", "KVW-EVOL-2", "KVW-EVOL-11"],
            description="the cache of kv-scales-e4m3fn with Header field 20 holding its scales but required bit 3 "
                        "clear, format 1.0: the field is unknown to 1.0 and is not read, the container is an "
                        "unscaled f8_e4m3fn cache (no kv_scales in the header); no writer may emit it")
    hb_bad = forge.patch(hb, _field20(hb), "I", 0x7FFFFFF0)
    g.valid("kv-scales-field-without-bit-not-verified", _with_header(data6, plain, hb=hb_bad), c6,
            rules=["KVW-SCALE-1", "KVW-EVOL-2", "KVW-HDR-2"],
            description="as kv-scales-field-without-bit-not-read, with field 20's offset pointing 2 GiB past the "
                        "header: without bit 3 the field is neither followed nor verified")
    h7 = h1.replace(format_minor=0)
    g.valid("kv-scales-format-minor-0", _with_header(base, h7), kvwire.KVCache(h7, c1.layers),
            rules=["KVW-EVOL-12", "KVW-EVOL-2", "KVW-PRE-2"],
            description="kv-scales-e4m3fn with format_minor 0 in preamble and header (a writer writes 1): readers "
                        "decide nothing from the minor version, bit 3 announces the feature")

    # --- invalid: one rule each -----------------------------------------------------------
    def bad(name, h, rule, what, code="KV_SCALES_INVALID", **kw):
        I(name, _with_header(base, h), rule=rule, code=code, description=what, **kw)

    bad("kv-scales1-bit-without-field", h1.replace(kv_scales=None), "KVW-SCALE-1",
        "required bit 3 (kv_scales) set, Header field 20 absent")
    bad("kv-scales2-fewer-entries", h1.replace(kv_scales=SCALES[:2]), "KVW-SCALE-2", "2 entries for 3 layers")
    bad("kv-scales2-more-entries", h1.replace(kv_scales=SCALES + ((1.0, 1.0),)), "KVW-SCALE-2",
        "4 entries for 3 layers")
    bad("kv-scales2-empty", h1.replace(kv_scales=()), "KVW-SCALE-2",
        "field 20 present as an empty vector (0 entries for 3 layers)")
    bad("kv-scales2-over-4096-entries", h1.replace(kv_scales=((1.0, 1.0),) * 4097), "KVW-LIM-1",
        "4097 entries: over the vector limit of 4096 (MAX_LAYERS), found when the header is decoded",
        code="LIMIT_EXCEEDED", rules=["KVW-SCALE-2"])
    for name, layer, which, value, what in [
        ("kv-scales3-nan", 1, 0, math.nan, "k_scale of layer 1 is NaN"),
        ("kv-scales3-infinity", 2, 1, math.inf, "v_scale of layer 2 is +infinity"),
        ("kv-scales3-zero", 0, 0, 0.0, "k_scale of layer 0 is +0"),
        ("kv-scales3-negative-zero", 0, 1, -0.0, "v_scale of layer 0 is -0"),
        ("kv-scales3-negative", 1, 0, -0.5, "k_scale of layer 1 is -0.5"),
    ]:
        entries = [list(e) for e in SCALES]
        entries[layer][which] = value
        bad(name, h1.replace(kv_scales=[tuple(e) for e in entries]), "KVW-SCALE-3", what)
    for dtype in ("bf16", "i8"):
        h = _scaled([FULL] * 3, SCALES, dtype=dtype, tokens=0)
        I(f"kv-scales4-{dtype}-dtype", forge.wrap_header(forge.header_of(h), minor=1), rule="KVW-SCALE-4",
          code="KV_SCALES_INVALID", description=f"kv_scales on a {dtype} cache (0 tokens): scales describe fp8 "
                                               "dtypes only")
    h3_0 = h3.replace(token_count=0, layer_tokens=None)
    for name, scales, what in [
        ("kv-scales5-mla-v-scale", ((0.03125, 0.5), (1.0, 1.0), (1.5, 0.75)),
         "v_scale 0.5 on the mla_latent layer 0, which has no V"),
        ("kv-scales5-shared-layer", ((0.03125, 1.0), (0.03125, 1.0), (1.5, 0.75)),
         "the shared layer 1 repeats its source layer's scales instead of 1.0, 1.0"),
    ]:
        I(name, forge.wrap_header(forge.header_of(h3_0.replace(kv_scales=scales)), minor=1), rule="KVW-SCALE-5",
          code="KV_SCALES_INVALID", description=what + " (0 tokens)")
    bad_state = h4.replace(kv_scales=((0.5, 0.25), (2.0, 1.0)), token_count=0)
    I("kv-scales5-state-layer", forge.wrap_header(forge.header_of(bad_state), minor=1), rule="KVW-SCALE-5",
      code="KV_SCALES_INVALID", description="k_scale 2.0 on a state layer, whose tensors are never scaled (0 tokens)")

    hb1 = forge.header_of(h1)
    I("kv-scales-field-out-of-bounds", _with_header(base, h1, hb=forge.patch(hb1, _field20(hb1), "I", 0x7FFFFFF0)),
      rule="KVW-HDR-3", code="FB_BOUNDS", rules=["KVW-SCALE-1", "KVW-HDR-2"],
      description="bit 3 set and field 20's offset pointing 2 GiB past the header: with the bit the field is "
                  "followed and verified")
    pos = _field20(hb1)
    off = struct.unpack_from("<I", hb1, pos)[0]
    I("kv-scales-field-misaligned", _with_header(base, h1, hb=forge.patch(hb1, pos, "I", off + 2)),
      rule="KVW-HDR-4", code="FB_ALIGNMENT", rules=["KVW-SCALE-1"],
      description="bit 3 set and field 20 pointing 2 bytes into its vector: the count is not 4-aligned")
    I("kv-scales-segments-scales-differ", _stream(seg(0, 4), seg(4, 10, ((0.125, 0.125),))),
      rule="KVW-STREAM-5", code="SEGMENT_MISMATCH", segments=True, rules=["KVW-STREAM-7", "KVW-SCALE-6"],
      description="the second segment's v_scale (0.125) differs from the first's (0.0625): segments share "
                  "every resolved header value but positions and prefix")


def _spec_fields(data: bytes) -> dict:
    """The header fields the writer added for a codec-spec encoding (spec/codecs.md)."""
    h = kvwire.probe(data)
    return {"codec_specs": h.codec_specs, "required_features": h.required_features}


ADDITION = {
    "make": gen_kv_scales,
    "spec": "spec/kvwire-v1.md revision 1.1: section 5.10, feature bit 3 kv_scales, Header field 20 [KVScale] "
            "(KVW-SCALE-1..8, KVW-EVOL-12); error code KV_SCALES_INVALID",
    "rules_without_vector": {
        "KVW-SCALE-7": "Binds readers and engines that hand over or load stored elements (scales handed over, "
                       "other scales converted or refused): behaviour of a connector, not of a container "
                       "(tests/format/test_kv_scales.py covers the reference's hand-over).",
        "KVW-SCALE-8": "Binds writers of layer ranges and receivers of layer maps; a container of a layer range is "
                       "an ordinary container (tests/format/test_kv_scales.py covers Header.layer_slice).",
        "KVW-SCALE-1 (writers)": "A writer never writes field 20 without bit 3: writer-only; the reference refuses it "
                                 "(tests/format/test_kv_scales.py).",
        "KVW-SCALE-6 (values)": "The canonical tensors are the stored elements, so no twin holds values; "
                                "tests/format/test_kv_scales.py checks KVCache.dequantize against ml_dtypes.",
        "KVW-EVOL-3 (1.0 readers)": "A 1.0 reader rejects every vector of this set that sets bit 3 with "
                                    "UNSUPPORTED_FEATURE; the vectors state what a 1.1 reader reports "
                                    "(tests/format/test_kv_scales.py shows the 1.0 view).",
    },
}
