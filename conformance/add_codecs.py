"""Conformance vectors for spec/codecs.md (feature ``codec_specs``), appended to format 1.0
with ``generate.py --add codecs``.

Valid vectors: fixed inputs encoded by the reference writer; the expected decoded values
(the JSON twin's tensors) come from ``tests/codec_reference.py``, a literal decoder
written from the spec text, and the reference reader must reproduce them byte for byte.
Invalid vectors: one broken rule each (checksums recomputed by the forge).
"""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import zstandard

import codec_reference as ref
import forge
import kvwire
from kvwire import CodecSpec
from kvwire.codecs import PRESETS, quant
from kvwire.format import registry as R
from kvwire.format.header import Architecture, Header, LayerSpec, TokenRange

BIT = R.REQUIRED_FEATURES["codec_specs"]
PRODUCER = kvwire.Producer("kvwire-conformance-generator", "1.0")


def _kv(rng, shape, dtype, *, scale=1.0, outliers=True):
    """Gaussian K/V with a few large channels (the shape that makes key quantization hard)."""
    x = rng.standard_normal(shape) * scale
    if outliers:
        x[..., ::5] *= 8
    return x.astype(R.DTYPES[dtype][2])


def _cache(h: Header, seed: int, special=None) -> kvwire.KVCache:
    rng = np.random.default_rng(seed)
    layers = []
    for spec, r in zip(h.arch.layers, h.layer_tokens):
        layer = {c: _kv(rng, spec.shape(c, r.count), h.dtype) for c in spec.components}
        if special:
            special(layer)
        layers.append(layer)
    return kvwire.KVCache(h, layers)


def expected(data: bytes) -> kvwire.KVCache:
    """The decoded cache by the literal reference decoder (header from the container)."""
    parts = ref.decode_container(data)
    h = kvwire.probe(data)
    return kvwire.KVCache(h, [{comp: parts[i, comp] for comp in spec.components}
                              for i, spec in enumerate(h.arch.layers)])


def gen_codecs(g) -> None:
    """spec/codecs.md: codec specs (KVW-CSPEC), byte planes (KVW-BPZ), lossy bodies
    (KVW-LOSSY), fp8 (KVW-FP8) and int_affine (KVW-INT)."""
    full = lambda h, d, **kw: LayerSpec("full_attention", h, d, d, **kw)

    def valid(name, cache, codec, rules, description, form="file"):
        data = kvwire.encode(cache, codec=codec, form=form)
        exp = expected(data)
        g.valid(name, data, exp, rules=["KVW-CSPEC-9", "KVW-CSPEC-10", *rules], description=description,
                expect_header=exp.header)
        return data

    # --- byteplane_zstd: lossless, bf16 (2 planes) and f32 (4 planes), stream and file form
    h = Header(Architecture((full(2, 16),) * 2), token_count=50, dtype="bf16", chunk_tokens=32, producer=PRODUCER)
    c = _cache(h, 5001)
    data = valid("codecs-byteplane-bf16", c, "byteplane", ["KVW-BPZ-1", "KVW-BPZ-2"],
                 "byteplane_zstd on bf16 K/V (2 layers, 2 heads, dim 16, 50 tokens in chunks of 32): the exponent "
                 "plane is a zstd frame, the mantissa plane stored as is; decodes bit for bit")
    assert forge.cache_bytes_equal(kvwire.load(data), kvwire.KVCache(kvwire.probe(data), c.layers))
    h = Header(Architecture((full(1, 8),)), token_count=20, dtype="f32", chunk_tokens=8, producer=PRODUCER)
    c = _cache(h, 5002)
    valid("codecs-byteplane-f32-stream", c, "byteplane", ["KVW-BPZ-1", "KVW-BPZ-2"],
          "byteplane_zstd on f32 (4 planes), stream form", form="stream")

    # --- fp8: every format and granularity; NaN, infinities, saturation, all-zero groups
    def specials(layer):
        k = layer["k"]
        flat = k.reshape(-1)
        flat[:6] = np.array([np.nan, np.inf, -np.inf, 1e4, -1e4, 0], np.float32).astype(k.dtype)
        layer["v"][:, :3] = 0  # all-zero tokens: scale 1 (KVW-FP8-5)

    h = Header(Architecture((full(2, 8),)), token_count=12, dtype="f16", chunk_tokens=8, producer=PRODUCER)
    for fmt, gran, dtype in (("f8_e4m3fn", "head", "f16"), ("f8_e5m2", "token", "bf16"),
                             ("f8_e4m3fnuz", "tensor", "f32")):
        hh = dataclasses.replace(h, dtype=dtype)
        c = _cache(hh, 5003, specials)
        valid(f"codecs-fp8-{fmt.replace('_', '-')}-{gran}", c, CodecSpec("fp8", fp8_format=fmt, scale_granularity=gran),
              ["KVW-FP8-2", "KVW-FP8-4", "KVW-FP8-5", "KVW-LOSSY-3", "KVW-LOSSY-4"],
              f"fp8 {fmt}, one scale per {gran}, {dtype} cache of 12 tokens in chunks of 8; K holds NaN "
              "(decodes to the canonical NaN), +-inf and +-1e4 (saturate to +-fmax * scale) and 0; V has "
              "all-zero tokens")

    # --- int_affine: partial groups on both axes, constant groups, symmetric, bf16/f16/f32 scales
    def constant(layer):
        layer["k"][:, :, 3] = 1.25  # a constant channel: scale 0 over tokens (KVW-INT-6)
        layer["v"][:, 4] = -0.5  # a constant token: scale 0 over channels

    h = Header(Architecture((full(2, 12),)), token_count=23, dtype="bf16", chunk_tokens=16, producer=PRODUCER)
    c = _cache(h, 5004, constant)
    for bits, axis, sym, sd in ((2, "tokens", False, "f16"), (4, "channels", True, "bf16"), (8, "tokens", False, "f32")):
        name = f"codecs-int{bits}-{axis}-{'sym' if sym else 'asym'}-{sd}"
        valid(name, c, CodecSpec("int_affine", bits=bits, group_size=5, group_axis=axis, symmetric=sym, scale_dtype=sd),
              ["KVW-INT-2", "KVW-INT-4", "KVW-INT-5", "KVW-LOSSY-3", "KVW-LOSSY-4"],
              f"int_affine {bits} bits, groups of 5 along {axis} ({'symmetric' if sym else 'asymmetric'}, {sd} "
              "scales): 23 tokens in chunks of 16 and 12 channels leave partial groups; K has a constant channel "
              "and V a constant token (scale 0)")

    # --- sink and residual tokens, counted in the layer's token range (a sliding layer starting at 20)
    arch = Architecture((full(1, 8), LayerSpec("sliding_attention", 1, 8, 8, window=24)))
    h = Header(arch, token_count=44, dtype="f16", chunk_tokens=16, producer=PRODUCER,
               layer_tokens=(TokenRange(0, 44), TokenRange(20, 24)))
    c = _cache(h, 5005)
    valid("codecs-int4-sink-residual", c, CodecSpec("int_affine", bits=4, group_size=4, sink_tokens=3,
                                                    residual_tokens=18),
          ["KVW-LOSSY-1", "KVW-LOSSY-2"],
          "int_affine 4 bits with sink_tokens 3 and residual_tokens 18: layer 0 holds [0, 44), layer 1 (sliding) "
          "[20, 44); kept tokens are bit-exact and split chunks into sink part, quantized part and residual part")

    # --- chained lossless stages
    h = Header(Architecture((full(2, 16),) * 2), token_count=40, dtype="bf16", chunk_tokens=32, producer=PRODUCER)
    c = _cache(h, 5006)
    lumpy = kvwire.KVCache(h, [{k: (np.round(v.astype(np.float32)) if i == 0 else v.astype(np.float32)).astype(v.dtype)
                                for k, v in layer.items()} for i, layer in enumerate(c.layers)])
    data = valid("codecs-int4-zstd-stage", lumpy, PRESETS["int4-g32-zstd"], ["KVW-CSPEC-7"],
                 "int_affine 4 bits (groups of 32 channels, f16 scales) followed by a zstd stage, applied per chunk "
                 "only where it is shorter: layer 0 holds integer values (its codes compress), layer 1 Gaussian "
                 "values (stored without the stage)")
    with kvwire.open(data) as r:
        lengths = r.records["stored_length"].tolist()
    assert len(set(lengths)) > 2, lengths  # some chunks staged, some not
    valid("codecs-fp8-byteplane-stage", c, CodecSpec("fp8", scale_granularity="token", lossless="byteplane_zstd"),
          ["KVW-CSPEC-7", "KVW-BPZ-1"], "fp8 e4m3fn per token, then a byteplane_zstd stage over the lossy body "
          "(element width 2, the bf16 header dtype)", form="stream")

    # --- a different codec per (layer, component) and per chunk; KIVI on 200 tokens
    h = Header(Architecture((full(2, 16),) * 3), token_count=200, dtype="bf16", chunk_tokens=64, producer=PRODUCER)
    c = _cache(h, 5007)
    choice = {(0, "k"): "kivi2", (0, "v"): "kivi2", (1, "k"): "byteplane", (1, "v"): "fp8-e4m3", (2, "k"): "zstd",
              (2, "v"): "raw"}
    valid("codecs-per-layer", c, choice, ["KVW-CSPEC-9"],
          "a different pipeline per (layer, component): KIVI-2 (K per channel over 32 tokens, V per token, last "
          "128 tokens full precision), byteplane_zstd, fp8, and plain zstd/raw records (codec_spec 0)")

    # ===================================================================================
    # Invalid
    # ===================================================================================
    I = g.invalid

    def spec_header(spec, dtype="bf16") -> bytes:
        hh = Header(Architecture((full(1, 8),)), token_count=0, dtype=dtype, producer=PRODUCER,
                    codec_specs=(CodecSpec("byteplane_zstd"), spec), required_features=BIT)
        return forge.wrap_header(forge.header_of(hh))

    for name, spec, dtype, rule, what in (
        ("codecs-spec-codec-raw", CodecSpec("raw"), "bf16", "KVW-CSPEC-3", "codec_specs[1] names codec raw"),
        ("codecs-spec-lossless-fp8", CodecSpec("int_affine", lossless="fp8"), "bf16", "KVW-CSPEC-4",
         "a lossless stage of codec fp8"),
        ("codecs-spec-unused-field", CodecSpec("byteplane_zstd", group_size=64), "bf16", "KVW-CSPEC-5",
         "byteplane_zstd with group_size 64 (unused fields keep their defaults)"),
        ("codecs-spec-lossy-on-i8", CodecSpec("int_affine"), "i8", "KVW-CSPEC-6", "int_affine in an i8 container"),
        ("codecs-spec-fp8-format-bf16", CodecSpec("fp8", fp8_format="bf16"), "f16", "KVW-FP8-1",
         "fp8_format bf16"),
        ("codecs-spec-bits-3", CodecSpec("int_affine", bits=3), "bf16", "KVW-INT-1", "int_affine with bits 3"),
        ("codecs-spec-group-size-0", CodecSpec("int_affine", group_size=0), "bf16", "KVW-INT-2",
         "int_affine with group_size 0"),
    ):
        I(name, spec_header(spec, dtype), rule=rule, code="CODEC_SPEC_INVALID", description=what)

    # records: a plain container with a fp8 K spec and zstd V chunks
    h = Header(Architecture((full(1, 8),)), token_count=20, dtype="bf16", chunk_tokens=8, producer=PRODUCER)
    c = _cache(h, 5010)
    data = kvwire.encode(c, codec={"k": CodecSpec("fp8"), "v": "zstd"}, form="stream")
    with kvwire.open(data) as r:
        recs = r.records.copy()
    kv = [int(x) for x in recs["component"]]
    k0, v0 = kv.index(R.COMPONENTS["k"]), kv.index(R.COMPONENTS["v"])
    for name, edit, what in (
        ("codecs-record-spec-out-of-range", forge.set_records(reserved0=(k0, 2)), "codec_spec 2 with one spec"),
        ("codecs-record-codec-mismatch", forge.set_records(codec=(k0, R.CODECS["int_affine"])),
         "an int_affine record naming the fp8 spec"),
        ("codecs-record-lossy-without-spec", forge.set_records(reserved0=(k0, 0)), "an fp8 record with codec_spec 0"),
        ("codecs-record-plain-with-spec", forge.set_records(reserved0=(v0, 1)), "a zstd (or raw) record naming the "
         "fp8 spec"),
    ):
        I(name, forge.rebuild(data, edit=edit), rule="KVW-CSPEC-9", code="CODEC_SPEC_MISMATCH", description=what)
    plain = kvwire.encode(c, form="stream")
    I("codecs-codec2-without-feature", forge.rebuild(plain, edit=forge.set_records(codec=(0, 2))),
      rule="KVW-CHUNK-5", code="UNKNOWN_CODEC", rules=["KVW-EVOL-9"],
      description="codec 2 (byteplane_zstd) in a container without the codec_specs bit")
    I("codecs-reserved0-without-feature", forge.rebuild(plain, edit=forge.set_records(reserved0=(0, 1))),
      rule="KVW-CHUNK-7", code="RESERVED_NONZERO", rules=["KVW-CSPEC-9"],
      description="reserved0 = 1 in a container without the codec_specs bit")

    # bodies (checksums recomputed)
    def body_edit(data, i, fn):
        p = forge.split(data)
        p.bodies[i] = fn(bytes(p.bodies[i]))
        return forge.assemble(p)

    def first(data, codec):
        with kvwire.open(data) as r:
            return [R.CODEC_BY_CODE[int(x)] for x in r.records["codec"]].index(codec)

    h = Header(Architecture((full(2, 16),)), token_count=64, dtype="bf16", chunk_tokens=64, producer=PRODUCER)
    c = _cache(h, 5011)
    bp = kvwire.encode(c, codec="byteplane", form="stream")
    i = first(bp, "byteplane_zstd")
    I("codecs-byteplane-truncated-plane", body_edit(bp, i, lambda b: b[:-1]), rule="KVW-BPZ-3", code="DECODE_FAILED",
      description="a byteplane body one byte short (its last plane truncated)")
    n = 2 * 64 * 16
    I("codecs-byteplane-plane-too-long", body_edit(bp, i, lambda b: struct.pack("<I", n + 1) + b[4:] + b"\0"),
      rule="KVW-BPZ-3", code="DECODE_FAILED", description="plane 0 claims N + 1 stored bytes (body length "
      "consistent)")
    fp8 = kvwire.encode(c, codec=CodecSpec("fp8"), form="stream")
    I("codecs-fp8-zero-scale", body_edit(fp8, 0, lambda b: b"\0\0\0\0" + b[4:]), rule="KVW-FP8-3",
      code="DECODE_FAILED", description="an fp8 chunk whose (tensor) scale is 0.0")
    I("codecs-fp8-body-short", body_edit(fp8, 0, lambda b: b[:-1]), rule="KVW-LOSSY-2", code="DECODE_FAILED",
      description="an fp8 body one byte shorter than its geometry (no lossless stage)")
    i4 = kvwire.encode(c, codec=CodecSpec("int_affine", bits=4, group_size=16), form="stream")
    I("codecs-int-negative-scale", body_edit(i4, 0, lambda b: struct.pack("<f", -1.0) + b[4:]), rule="KVW-INT-3",
      code="DECODE_FAILED", description="an int_affine scale of -1.0")
    h3 = Header(Architecture((full(1, 3),)), token_count=3, dtype="f32", chunk_tokens=8, producer=PRODUCER)
    i2 = kvwire.encode(_cache(h3, 5012), codec=CodecSpec("int_affine", bits=2, group_size=4), form="stream")
    I("codecs-int-padding-bits", body_edit(i2, 0, lambda b: b[:-1] + bytes([b[-1] | 0x40])), rule="KVW-INT-4",
      code="DECODE_FAILED", description="9 two-bit codes: a non-zero bit in the unused top of the last byte")
    zspec = PRESETS["int4-g32-zstd"]
    z = kvwire.encode(c, codec=zspec, form="stream")
    lb = quant.layout(zspec, "bf16", 2, 16, 0, 64, 0, 64).length
    I("codecs-stage-longer-than-body", body_edit(z, 0, lambda b: bytes(lb + 10)), rule="KVW-CSPEC-7",
      code="DECODE_FAILED", description=f"a chunk with a zstd stage stored in {lb + 10} bytes, more than its "
      f"{lb}-byte lossy body")
    I("codecs-stage-content-size", body_edit(z, 0, lambda b: zstandard.ZstdCompressor(
        write_content_size=True).compress(bytes(lb + 1))), rule="KVW-CODEC-2", code="DECODED_SIZE_MISMATCH",
      rules=["KVW-CSPEC-7"], description="the zstd stage's frame declares one byte more than the lossy body")


ADDITION = {
    "make": gen_codecs,
    "spec": "spec/codecs.md (feature codec_specs, header field 18, table CodecSpec, codecs 2-4)",
    "rules_without_vector": {
        "KVW-CSPEC-1": "The bit without codec specs is invalid/evol3-required-feature of the frozen 1.0 set; a "
                       "field without the bit is invisible to readers (KVW-EVOL-2), so no vector can show it.",
        "KVW-CSPEC-2": "4097 codec specs: a header of about 100 KiB for one LIMIT_EXCEEDED the 1.0 set already "
                       "covers for vectors (KVW-LIM-1); tests/codecs/test_codecs_container.py covers it.",
        "KVW-CSPEC-8": "Needs the sparse feature (spec/sparse.md); tests/codecs/test_codecs_container.py covers it.",
        "KVW-BPZ-4": "Writer SHOULD (raw when not smaller); valid vectors show only that raw records coexist.",
        "KVW-INT-6": "Writer-side (non-finite input refused): no container can carry it.",
    },
}
