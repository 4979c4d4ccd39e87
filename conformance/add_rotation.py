"""Conformance vectors of revision 1.2's rotation stage, Gaussian codebook and 3-bit codes
(spec/codecs.md section 8, feature bit 4 ``rotation``, CodecSpec fields 11-13), appended to
the major-1 folder with ``generate.py --add rotation``.

Valid vectors: every rotated preset of the reference codec on a cache with outlier key
channels; head dims whose Hadamard blocks are 128, 32, 16, 2 and 1 channels; 3-bit uniform
codes on both group axes with sink and residual tokens; the codebook without a rotation;
f16 and f32 caches; lossless stages over rotated bodies; a sparse container; and the 1.0
view: fields 11-13 in a container without bit 4 are not read (the spec decodes as plain
int_affine). Expected values come from ``tests/codec_reference.py``, the literal decoder of
the spec text. Invalid vectors: one per rule and case, each with its code.
"""

from __future__ import annotations

import struct
from dataclasses import replace

import numpy as np

import codec_reference as ref
import forge
import kvwire
from add_codecs import PRODUCER, _cache, expected
from kvwire import CodecSpec
from kvwire.cache.sparse import SparseKVCache
from kvwire.codecs import PRESETS
from kvwire.format import registry as R
from kvwire.format.header import Architecture, Header, LayerSpec, TokenRange

SPECS_BIT = R.REQUIRED_FEATURES["codec_specs"]
ROT_BIT = R.REQUIRED_FEATURES["rotation"]
SEED = 0x4B565752
ROTATED = ("hadamard-int4-g32", "hadamard-lloyd4", "hadamard-lloyd3", "hadamard-lloyd2", "hadamard-lloyd-k3v2")
RULES = ["KVW-ROT-1", "KVW-ROT-6", "KVW-CSPEC-9", "KVW-CSPEC-10", "KVW-EVOL-12"]


def _full(heads: int, dim: int) -> LayerSpec:
    return LayerSpec("full_attention", heads, dim, dim)


def _outliers(layer) -> None:
    """Llama-like keys: two channels of every head 20-40x the others."""
    k = layer["k"]
    f = k.astype(np.float32)
    f[..., 1] *= 40
    f[..., -3] *= 20
    layer["k"] = f.astype(k.dtype)


def _rot(bits: int, **kw) -> CodecSpec:
    kw.setdefault("rotation", "hadamard")
    kw.setdefault("rotation_seed", SEED)
    return CodecSpec("int_affine", bits=bits, **kw)


def valid_maker(g, bit: int, minor: int, base_rules: list):
    """``valid(name, cache, codec, rules, description, form)``: a valid vector of ``cache``
    encoded with ``codec``, which must set ``bit`` and write ``minor``; expected values from
    the literal decoder."""
    def valid(name, cache, codec, rules, description, form="file"):
        data = kvwire.encode(cache, codec=codec, form=form)
        h = kvwire.probe(data)
        assert h.required_features & bit and h.format_minor == minor, name
        exp = expected(data)
        g.valid(name, data, exp, rules=[*base_rules, *rules], description=description, expect_header=exp.header)
        return data
    return valid


def gen_rotation(g) -> None:
    """spec/codecs.md section 8: KVW-ROT-1..7."""
    I = g.invalid
    valid = valid_maker(g, ROT_BIT, 2, RULES)

    # --- every rotated preset, one per layer, K with outlier channels
    h = Header(Architecture((_full(2, 64),) * len(ROTATED)), token_count=40, dtype="bf16", chunk_tokens=32,
               producer=PRODUCER)
    c = _cache(h, 7001, _outliers)
    choice = {(i, comp): p for i, p in enumerate(ROTATED) for comp in ("k", "v")}
    valid("rotation-presets-bf16", c, choice, ["KVW-ROT-4", "KVW-ROT-5", "KVW-LOSSY-3", "KVW-LOSSY-4"],
          f"bf16 cache, one rotated preset per layer ({', '.join(ROTATED)}; seed {SEED:#x}), 2 heads of dim 64 "
          "(one Hadamard block of 64), 40 tokens in chunks of 32; K has two outlier channels (x40, x20)")

    # --- block sizes: D = 128, 96 (B 32), 80 (B 16), 6 (B 2), 1 (B 1); 3-bit uniform codes, both axes
    dims = (128, 96, 80, 6, 1)
    h = Header(Architecture(tuple(_full(1, d) for d in dims)), token_count=21, dtype="f16", chunk_tokens=16,
               producer=PRODUCER)
    c = _cache(h, 7002)
    choice = {}
    for i, _d in enumerate(dims):
        choice[i, "k"] = _rot(3, group_size=5, group_axis="tokens", scale_dtype="f16", rotation_seed=i)
        choice[i, "v"] = _rot(3, group_size=7, group_axis="channels", symmetric=True, scale_dtype="bf16",
                              rotation_seed=2 ** 64 - 1 - i)
    valid("rotation-blocks-int3-f16", c, choice, ["KVW-ROT-3", "KVW-ROT-5", "KVW-INT-2", "KVW-INT-5"],
          "f16 cache of 5 layers with head dims 128, 96, 80, 6 and 1 (Hadamard blocks of 128, 32, 16, 2 and 1 "
          "channels), 21 tokens in chunks of 16: K rotated 3-bit asymmetric groups of 5 tokens (f16 scales, "
          "seeds 0..4), V rotated 3-bit symmetric groups of 7 channels (bf16 scales, seeds 2^64-1..2^64-5); "
          "codes straddle bytes and groups are partial")

    # --- 3 bits and the codebook without a rotation; sink and residual tokens; f32
    arch = Architecture((_full(2, 16), LayerSpec("sliding_attention", 2, 16, 16, window=24)))
    h = Header(arch, token_count=44, dtype="f32", chunk_tokens=16, producer=PRODUCER,
               layer_tokens=(TokenRange(0, 44), TokenRange(20, 24)))
    c = _cache(h, 7003)
    choice = {(0, "k"): CodecSpec("int_affine", bits=3, group_size=4, sink_tokens=3, residual_tokens=18),
              (0, "v"): CodecSpec("int_affine", bits=4, group_size=16, group_axis="channels", symmetric=True,
                                  codebook="gaussian", scale_dtype="f32"),
              (1, "k"): _rot(2, group_size=8, group_axis="channels", symmetric=True, codebook="gaussian",
                             scale_dtype="f16", residual_tokens=5),
              (1, "v"): _rot(3, group_size=16, group_axis="channels", symmetric=True, codebook="gaussian",
                             scale_dtype="bf16", sink_tokens=2)}
    valid("rotation-unrotated-int3-codebook-f32", c, choice,
          ["KVW-ROT-2", "KVW-ROT-3", "KVW-ROT-4", "KVW-LOSSY-1", "KVW-LOSSY-2"],
          "f32 cache: layer 0 K plain 3-bit asymmetric (no rotation, sink 3 and residual 18 tokens), layer 0 V "
          "the Gaussian codebook at 4 bits without a rotation; layer 1 (sliding, tokens [20, 44)) rotated "
          "codebooks at 2 bits (residual 5) and 3 bits (sink 2): kept tokens are not rotated")

    # --- lossless stages over rotated bodies; stream form
    h = Header(Architecture((_full(2, 32),) * 2), token_count=40, dtype="bf16", chunk_tokens=32, producer=PRODUCER)
    c = _cache(h, 7004)
    lumpy = kvwire.KVCache(h, [{k: (np.zeros_like(v) if i == 0 and k == "v" else v) for k, v in layer.items()}
                               for i, layer in enumerate(c.layers)])
    valid("rotation-lossless-stages-stream", lumpy,
          {"k": replace(PRESETS["hadamard-lloyd3"], lossless="zstd"),
           "v": replace(PRESETS["hadamard-int4-g32"], lossless="byteplane_zstd")},
          ["KVW-CSPEC-7"], "rotated 3-bit codebook K with a zstd stage and rotated int4-g32 V with a "
          "byteplane_zstd stage (layer 0's V is all zeros: its bodies shrink under the stage; scale 0 gives "
          "codes 2^(b-1), decoding to 0), stream form", form="stream")

    # --- sparse container
    dense = _cache(Header(Architecture((_full(2, 16),) * 2), token_count=40, dtype="bf16", chunk_tokens=16,
                          producer=PRODUCER), 7005)
    sp = SparseKVCache.streaming(dense, 2, 9)
    data = kvwire.encode(sp, codec="hadamard-lloyd4")
    assert kvwire.probe(data).required_features & ROT_BIT
    want = ref.decode_sparse_container(data)
    assert kvwire.load(data).equal(want)
    g.valid("rotation-sparse", data, want, rules=["KVW-ROT-6", "KVW-CSPEC-8"],
            description="a sparse (StreamingLLM: 2 sink + 9 recent tokens) cache under hadamard-lloyd4: every "
                        "chunk holds one head; rows are rotated as in dense containers; expected values from "
                        "the literal decoder")

    # --- the 1.0 view: fields 11-13 without bit 4 are not read
    h = Header(Architecture((_full(1, 8),)), token_count=16, dtype="bf16", chunk_tokens=8, producer=PRODUCER)
    c = _cache(h, 7006)
    plain = CodecSpec("int_affine", bits=4, group_size=8, group_axis="channels", symmetric=True, scale_dtype="f16")
    data = kvwire.encode(c, codec=plain)
    hp = kvwire.probe(data)
    p = forge.split(data)
    p.header = forge.header_of(replace(hp, codec_specs=(replace(plain, rotation="hadamard", rotation_seed=9,
                                                                codebook="gaussian"),)))
    forged = forge.patch_preamble(forge.assemble(p), minor=0)
    assert kvwire.probe(forged) == hp
    exp = expected(data)
    g.valid("rotation-fields-without-bit", forged, exp, expect_header=exp.header,
            rules=["KVW-ROT-1", "KVW-EVOL-2", "KVW-EVOL-11"],
            description="a 1.0 container (bit 0 only, format 1.0) whose int_affine spec also carries fields 11-13 "
                        "(rotation hadamard, seed 9, codebook gaussian): without bit 4 they are not read, and the "
                        "spec decodes as plain symmetric int4 exactly as a 1.0 reader decodes it")

    # ===================================================================================
    # Invalid
    # ===================================================================================
    arch1 = Architecture((_full(1, 8),))

    def spec_header(spec, rf=SPECS_BIT | ROT_BIT, dtype="bf16") -> bytes:
        hh = Header(arch1, token_count=0, dtype=dtype, producer=PRODUCER, codec_specs=(CodecSpec("byteplane_zstd"),
                    spec), required_features=rf, format_minor=2)
        return forge.wrap_header(forge.header_of(hh), minor=2)

    inv = "CODEC_SPEC_INVALID"
    for name, spec, rule, what in (
        ("rotation-bit-without-rotated-spec", CodecSpec("int_affine", bits=4), "KVW-ROT-1",
         "bit 4 set, but no spec uses a rotation, the gaussian codebook or 3 bits"),
        ("rotation-seed-without-rotation", _rot(3, rotation="none", rotation_seed=5), "KVW-ROT-2",
         "rotation none with rotation_seed 5"),
        ("rotation-codebook-asymmetric", _rot(4, codebook="gaussian"), "KVW-ROT-2",
         "the gaussian codebook with symmetric false"),
        ("rotation-codebook-8-bits", _rot(8, codebook="gaussian", symmetric=True), "KVW-ROT-2",
         "the gaussian codebook at 8 bits (tables exist for 2, 3 and 4)"),
        ("rotation-on-fp8", CodecSpec("fp8", rotation="hadamard", rotation_seed=1), "KVW-CSPEC-5",
         "an fp8 spec with a rotation (fields 11-13 are int_affine's)"),
        ("rotation-bits-5", _rot(5), "KVW-INT-1", "int_affine with bits 5 (3 is allowed with bit 4, 5 never)"),
    ):
        I(name, spec_header(spec), rule=rule, code=inv, description=what)
    I("rotation-bit-without-specs", forge.wrap_header(forge.header_of(Header(
        arch1, token_count=0, dtype="bf16", producer=PRODUCER, required_features=ROT_BIT, format_minor=2)), minor=2),
      rule="KVW-ROT-1", code=inv, description="bit 4 set without bit 0 and without codec specs")
    for attr in ("rotation", "codebook"):
        table = R.ROTATIONS if attr == "rotation" else R.CODEBOOKS
        table["unassigned-2"] = 2
        try:
            hb = spec_header(replace(_rot(4, symmetric=True), **{attr: "unassigned-2"}))
        finally:
            del table["unassigned-2"]
        I(f"rotation-{attr}-code-2", hb, rule="KVW-HDR-10", code="ENUM_OUT_OF_RANGE", rules=["KVW-ROT-2"],
          description=f"{attr} code 2 (unassigned) in a container with bit 4")

    # bodies
    h = Header(arch1, token_count=5, dtype="f32", chunk_tokens=8, producer=PRODUCER)
    c = _cache(h, 7010)
    spec = _rot(3, group_size=8, group_axis="channels", symmetric=True, codebook="gaussian", scale_dtype="f32")
    data = kvwire.encode(c, codec=spec, form="stream")

    def body_edit(fn):
        p = forge.split(data)
        p.bodies[0] = fn(bytes(p.bodies[0]))
        return forge.patch_preamble(forge.assemble(p), minor=2)  # the preamble keeps the header's minor

    n = len(forge.split(data).bodies[0])
    assert n == 5 * 4 + -(-5 * 8 * 3 // 8)  # 5 f32 scales, 15 code bytes (no padding: 120 bits)
    I("rotation-negative-scale", body_edit(lambda b: struct.pack("<f", -1.0) + b[4:]), rule="KVW-INT-3",
      code="DECODE_FAILED", rules=["KVW-ROT-4"], description="a gaussian-codebook body whose first scale is -1.0")
    I("rotation-body-short", body_edit(lambda b: b[:-1]), rule="KVW-LOSSY-2", code="DECODE_FAILED",
      description="a rotated 3-bit body one byte short of its geometry's length")
    h = Header(Architecture((_full(1, 5),)), token_count=1, dtype="f32", chunk_tokens=8, producer=PRODUCER)
    c = _cache(h, 7011)
    data = kvwire.encode(c, codec=replace(spec, group_size=5), form="stream")
    I("rotation-int3-padding-bits", body_edit(lambda b: b[:-1] + bytes([b[-1] | 0x80])), rule="KVW-ROT-3",
      code="DECODE_FAILED", description="5 codes of 3 bits fill 15 bits of 2 bytes: bit 15 (the padding) set")


KCHAN = ("kchan4-vlloyd4", "kchan3-vlloyd2")


def gen_rotation_kchan(g) -> None:
    """The mixed presets: unrotated per-channel keys, rotated Gaussian-codebook values."""
    for name, dtype, form, seed, dim in (("rotation-kchan-presets-bf16", "bf16", "file", 7101, 64),
                                         ("rotation-kchan-presets-f16-stream", "f16", "stream", 7102, 128)):
        h = Header(Architecture((_full(2, dim),) * len(KCHAN)), token_count=100, dtype=dtype, chunk_tokens=64,
                   producer=PRODUCER)
        c = _cache(h, seed, _outliers)
        choice = {(i, comp): p for i, p in enumerate(KCHAN) for comp in ("k", "v")}
        data = kvwire.encode(c, codec=choice, form=form)
        hd = kvwire.probe(data)
        assert hd.required_features & ROT_BIT and hd.format_minor == 2, name
        exp = expected(data)
        g.valid(name, data, exp, rules=[*RULES, "KVW-ROT-4", "KVW-INT-2", "KVW-LOSSY-3"],
                description=f"{dtype} cache ({form} form), one preset per layer ({', '.join(KCHAN)}): K per channel "
                            f"over 64 tokens (unrotated, with two outlier channels x40, x20), V rotated onto the "
                            f"Gaussian codebook; 2 heads of dim {dim}, 100 tokens in chunks of 64 (a partial "
                            "token group in the second chunk)", expect_header=exp.header)


ADDITION_KCHAN = {
    "make": gen_rotation_kchan,
    "spec": "spec/codecs.md revision 1.2: section 8 and section 6 (presets kchan4-vlloyd4, kchan3-vlloyd2)",
    "rules_without_vector": {},
}

ADDITION = {
    "make": gen_rotation,
    "spec": "spec/codecs.md revision 1.2: section 8, feature bit 4 rotation, CodecSpec fields 11-13 "
            "(KVW-ROT-1..7)",
    "rules_without_vector": {
        "KVW-ROT-7": "Writer-only: which chunks a writer stores losslessly is its choice within the rule; "
                     "tests/codecs/test_rotation.py checks the reference writer near the extremes.",
        "KVW-ROT-1 (writers)": "A writer never writes fields 11-13 without bit 4: writer-only; the reference "
                               "refuses it (tests/codecs/test_rotation.py).",
        "KVW-EVOL-3 (1.0 and 1.1 readers)": "A reader without bit 4 rejects every vector of this set that sets it "
                                            "with UNSUPPORTED_FEATURE; the vectors state what a 1.2 reader reports.",
    },
}
