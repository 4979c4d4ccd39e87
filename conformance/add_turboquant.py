"""Conformance vectors of revision 1.3: vLLM's TurboQuant key codebook and the unsigned
rotation (spec/codecs.md section 9, feature bit 5 ``turboquant``, Rotation and Codebook code
2), appended to the major-1 folder with ``generate.py --add turboquant``.

Valid vectors: the three turboquant presets on head_dim 128 (odd log2: the D = 128 table)
and 64 (even: the D = 64 table), the codebook after the signed rotation and without one,
f32 and bf16 norms, the unsigned rotation with uniform codes on a head_dim of 96 (blocks of
32), all-zero rows, a zstd stage and the stream form. Expected values come from
``tests/codec_reference.py``, the literal decoder of the spec text. Invalid vectors: one per
rule and case, each with its code.
"""

from __future__ import annotations

import struct
from dataclasses import replace

import forge
import kvwire
from add_codecs import PRODUCER, _cache
from add_rotation import valid_maker
from kvwire import CodecSpec
from kvwire.codecs import PRESETS
from kvwire.format import registry as R
from kvwire.format.header import Architecture, Header, LayerSpec

SPECS_BIT, ROT_BIT, TQ_BIT = (R.REQUIRED_FEATURES[n] for n in ("codec_specs", "rotation", "turboquant"))
ALL = SPECS_BIT | ROT_BIT | TQ_BIT
PRESET_NAMES = ("vllm-turboquant-4bit-nc", "vllm-turboquant-k3v4-nc", "vllm-turboquant-3bit-nc")
RULES = ["KVW-TQ-1", "KVW-TQ-3", "KVW-TQ-4", "KVW-EVOL-12"]


def _full(heads: int, dim: int) -> LayerSpec:
    return LayerSpec("full_attention", heads, dim, dim)


def _tq(bits: int, **kw) -> CodecSpec:
    kw = {"rotation": "sylvester", "group_size": 1 << 16, "scale_dtype": "f16", **kw}
    return CodecSpec("int_affine", bits=bits, group_axis="channels", symmetric=True, codebook="turboquant", **kw)


def gen_turboquant(g) -> None:
    """spec/codecs.md section 9: KVW-TQ-1..5."""
    I = g.invalid
    valid = valid_maker(g, TQ_BIT, 3, RULES)

    # --- the presets, one per layer: D = 128 (odd log2) and D = 64 (even)
    for dim, dtype, form, seed in ((128, "bf16", "file", 7201), (64, "f16", "stream", 7202)):
        h = Header(Architecture((_full(2, dim),) * len(PRESET_NAMES)), token_count=70, dtype=dtype, chunk_tokens=32,
                   producer=PRODUCER)
        c = _cache(h, seed)
        choice = {(i, comp): p for i, p in enumerate(PRESET_NAMES) for comp in ("k", "v")}
        valid(f"turboquant-presets-d{dim}-{dtype}", c, choice, ["KVW-TQ-2", "KVW-INT-5", "KVW-ROT-3"],
              f"{dtype} cache ({form} form), one vLLM turboquant preset per layer ({', '.join(PRESET_NAMES)}): K the "
              f"turboquant codebook after the unsigned rotation with an f16 norm per row, V min-max per row; 2 heads "
              f"of dim {dim} (the {'odd' if dim == 128 else 'even'} log2(D) table), 70 tokens in chunks of 32",
              form=form)

    # --- the codebook with the signed rotation, without a rotation; f32 / bf16 norms; zero rows; zstd
    h = Header(Architecture((_full(2, 32), _full(1, 16), _full(1, 256))), token_count=20, dtype="f32",
               chunk_tokens=16, producer=PRODUCER)
    c = _cache(h, 7203)
    c.layers[2]["k"][:, 3:5] = 0  # zero rows: norm 0 decodes to 0
    choice = {(0, "k"): _tq(4, rotation="hadamard", rotation_seed=0x4B565752, scale_dtype="f32"),
              (0, "v"): _tq(3, rotation="none", scale_dtype="bf16"),
              (1, "k"): _tq(3, scale_dtype="bf16", lossless="zstd"),
              (1, "v"): CodecSpec("int_affine", bits=4, group_size=16, group_axis="channels", scale_dtype="f16"),
              (2, "k"): _tq(4), (2, "v"): _tq(3, group_size=256)}
    valid("turboquant-rotations-f32", c, choice, ["KVW-TQ-2", "KVW-ROT-5", "KVW-ROT-6", "KVW-CSPEC-7"],
          "f32 cache: layer 0 (D 32) K the codebook after the signed rotation (seed 0x4B565752) with f32 norms, V "
          "the codebook without a rotation (bf16 norms); layer 1 (D 16) K with a zstd stage; layer 2 (D 256) K "
          "with rows 3-4 all zero (norm 0), V with group_size exactly D")

    # --- the unsigned rotation with uniform codes; block form on D = 96 (B = 32)
    h = Header(Architecture((_full(2, 96),)), token_count=24, dtype="bf16", chunk_tokens=16, producer=PRODUCER)
    c = _cache(h, 7204)
    choice = {"k": CodecSpec("int_affine", bits=4, group_size=32, group_axis="channels", scale_dtype="f16",
                             rotation="sylvester"),
              "v": CodecSpec("int_affine", bits=3, group_size=8, scale_dtype="f16", rotation="sylvester")}
    valid("turboquant-sylvester-uniform-d96", c, choice, ["KVW-INT-5", "KVW-ROT-6"],
          "bf16 cache, D 96 (three Hadamard blocks of 32): K 4-bit per-token groups of 32 and V 3-bit per-channel "
          "groups of 8 tokens, both after the unsigned rotation (every sign +1)")

    # ===================================================================================
    # Invalid
    # ===================================================================================
    arch1 = Architecture((_full(1, 64),))

    def spec_header(spec, rf=ALL) -> bytes:
        hh = Header(arch1, token_count=0, dtype="bf16", producer=PRODUCER, codec_specs=(CodecSpec("byteplane_zstd"),
                    spec), required_features=rf, format_minor=3)
        return forge.wrap_header(forge.header_of(hh), minor=3)

    inv = "CODEC_SPEC_INVALID"
    for name, spec, rf, rule, code, what in (
        ("turboquant-bit-without-rotation-bit", _tq(4), SPECS_BIT | TQ_BIT, "KVW-TQ-1", inv,
         "bit 5 set without bit 4 (fields 11-13 are not read, so no spec can use the feature)"),
        ("turboquant-bit-without-spec", PRESETS["hadamard-lloyd4"], ALL, "KVW-TQ-1", inv,
         "bits 0, 4 and 5 set, but no spec uses the sylvester rotation or the turboquant codebook"),
        ("turboquant-codebook-without-bit", _tq(4, rotation="hadamard", rotation_seed=1), SPECS_BIT | ROT_BIT,
         "KVW-HDR-10", "ENUM_OUT_OF_RANGE", "codebook code 2 (turboquant) in a container without bit 5 "
         "(KVW-EVOL-9: a code a feature registers is out of range without its bit)"),
        ("turboquant-sylvester-without-bit", CodecSpec("int_affine", bits=4, rotation="sylvester"),
         SPECS_BIT | ROT_BIT, "KVW-HDR-10", "ENUM_OUT_OF_RANGE", "rotation code 2 (sylvester) without bit 5"),
        ("turboquant-sylvester-seed", _tq(4, rotation_seed=3), ALL, "KVW-TQ-2", inv,
         "the sylvester rotation with rotation_seed 3"),
        ("turboquant-asymmetric", replace(_tq(4), symmetric=False), ALL, "KVW-TQ-2", inv,
         "the turboquant codebook with symmetric false"),
        ("turboquant-token-groups", replace(_tq(4), group_axis="tokens"), ALL, "KVW-TQ-2", inv,
         "the turboquant codebook with group_axis tokens"),
        ("turboquant-2-bits", _tq(2), ALL, "KVW-TQ-2", inv, "the turboquant codebook at 2 bits (tables: 3 and 4)"),
    ):
        I(name, spec_header(spec, rf), rule=rule, code=code, rules=["KVW-TQ-2"] if rule != "KVW-TQ-2" else [],
          description=what)

    # chunk geometry: a body laid out as the spec says, on a layer the codebook cannot decode
    def forged(dim: int, group: int, seed: int) -> bytes:
        hh = Header(Architecture((_full(1, dim),)), token_count=4, dtype="bf16", chunk_tokens=4, producer=PRODUCER)
        plain = CodecSpec("int_affine", bits=4, group_size=group, group_axis="channels", symmetric=True,
                          scale_dtype="f16")
        data = kvwire.encode(_cache(hh, seed), codec=plain, form="stream")
        p = forge.split(data)
        hp = kvwire.probe(data)
        p.header = forge.header_of(replace(hp, codec_specs=(replace(plain, codebook="turboquant",
                                                                    rotation="sylvester"),),
                                           required_features=ALL, format_minor=3))
        return forge.patch_preamble(forge.assemble(p), minor=3)

    I("turboquant-head-dim-48", forged(48, 1 << 16, 7210), rule="KVW-TQ-2", code="DECODE_FAILED",
      description="a turboquant K chunk of a layer with head_dim 48 (not a power of two)")
    I("turboquant-groups-shorter-than-rows", forged(64, 32, 7211), rule="KVW-TQ-2", code="DECODE_FAILED",
      description="a turboquant chunk with group_size 32 on head_dim 64 (two groups per row)")

    # bodies
    h = Header(Architecture((_full(1, 64),)), token_count=3, dtype="bf16", chunk_tokens=4, producer=PRODUCER)
    data = kvwire.encode(_cache(h, 7212), codec={"k": _tq(3), "v": "raw"}, form="stream")

    def body_edit(fn):
        p = forge.split(data)
        p.bodies[0] = fn(bytes(p.bodies[0]))
        return forge.patch_preamble(forge.assemble(p), minor=3)

    assert len(forge.split(data).bodies[0]) == 3 * 2 + 3 * 64 * 3 // 8
    I("turboquant-negative-norm", body_edit(lambda b: struct.pack("<e", -1.0) + b[2:]), rule="KVW-INT-3",
      code="DECODE_FAILED", rules=["KVW-TQ-4"], description="a turboquant body whose first norm is -1.0 (f16)")
    I("turboquant-body-short", body_edit(lambda b: b[:-1]), rule="KVW-LOSSY-2", code="DECODE_FAILED",
      description="a turboquant 3-bit body one byte short of its geometry's length")


ADDITION = {
    "make": gen_turboquant,
    "spec": "spec/codecs.md revision 1.3: section 9, feature bit 5 turboquant, Rotation and Codebook code 2 "
            "(KVW-TQ-1..5)",
    "rules_without_vector": {
        "KVW-TQ-5": "Writer-only: which chunks a writer stores losslessly; tests/codecs/test_turboquant.py checks the "
                    "reference writer.",
        "KVW-EVOL-3 (1.2 readers)": "A 1.2 reader rejects every vector of this set (ENUM_OUT_OF_RANGE for the codes "
                                    "outside its registries, or UNSUPPORTED_FEATURE for bit 5); the vectors state "
                                    "what a 1.3 reader reports.",
    },
}
