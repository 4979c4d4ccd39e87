"""Revision 1.2: the rotation stage, the Gaussian codebook and 3-bit codes (spec/codecs.md
section 8, KVW-ROT-1..7), bit-exact against the literal decoder of tests/codec_reference.py."""

from __future__ import annotations

import struct
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import codec_reference as ref
import forge
import kvwire
from kvwire import CodecSpec
from kvwire.codecs import PRESETS, kernels, quant, rotation
from kvwire.format import registry as R
from kvwire.format.codec_specs import ROTATION_BIT, spec_from_json, spec_to_json
from kvwire.format.header import Architecture, Header, LayerSpec

SPECS_BIT = R.REQUIRED_FEATURES["codec_specs"]
SEED = 0x4B565752


def rotated(bits=4, **kw) -> CodecSpec:
    kw.setdefault("rotation", "hadamard")
    kw.setdefault("rotation_seed", SEED)
    return CodecSpec("int_affine", bits=bits, **kw)


# ---------------------------------------------------------------------------------------
# The spec's numbers (KVW-ROT-3..6)
# ---------------------------------------------------------------------------------------

def test_signs_match_the_spec_examples():
    """KVW-ROT-5: the sign strings the spec prints for seeds 0 and 1, and the literal reference."""
    text = lambda v: "".join("-" if s < 0 else "+" for s in v)
    assert text(rotation.signs(0, 32)) == "-++-+++-+-+-----+-+----+--++---+"
    assert text(rotation.signs(1, 32)) == "---++---+-+-+-++----++++++--+---"
    for seed in (0, 1, SEED, 2 ** 64 - 1):
        assert rotation.signs(seed, 300).tolist() == ref.splitmix_signs(seed, 300)


def test_block_size_and_c_b():
    """Section 8.4: B the largest power of two dividing D; c_B = fp32(1/sqrt(B)), c_128 = 0x3DB504F3."""
    assert [rotation.block_size(d) for d in (1, 2, 6, 80, 96, 128, 192, 576)] == [1, 2, 2, 16, 32, 128, 64, 64]
    assert np.float32(rotation.c_b(128)).view(np.uint32) == 0x3DB504F3
    for k in range(17):
        assert rotation.c_b(2 ** k) == np.float32(1 / np.sqrt(np.float64(2 ** k)))


def test_gaussian_levels_are_the_spec_table():
    """KVW-ROT-4: levels symmetric, ascending, equal to the table the spec prints (and the
    literal reference reads from it); they are the Lloyd-Max levels of N(0, 1) (the
    centroid condition holds to 1e-6)."""
    from math import erf, exp, inf, pi, sqrt

    pdf = lambda x: 0.0 if x in (inf, -inf) else exp(-x * x / 2) / sqrt(2 * pi)
    cdf = lambda x: 0.5 * (1 + erf(x / sqrt(2)))
    for b, c in rotation.GAUSSIAN_LEVELS.items():
        assert len(c) == 2 ** b and (np.diff(c) > 0).all() and (c == -c[::-1]).all()
        assert [float(x) for x in c] == [ref.gaussian_level(b, u) for u in range(2 ** b)]
        edges = [-inf] + [(float(c[i]) + float(c[i + 1])) / 2 for i in range(len(c) - 1)] + [inf]
        for i, level in enumerate(c):
            lo, hi = edges[i], edges[i + 1]
            centroid = (pdf(lo) - pdf(hi)) / (cdf(hi) - cdf(lo))
            assert abs(centroid - float(level)) < 1e-6, (b, i)


def test_three_bit_codes_spec_example_and_padding():
    """KVW-ROT-3: codes 5, 3, 7 are bytes 0xDD 0x01; unused high bits must be 0."""
    assert kernels.pack_codes(np.array([5, 3, 7], np.float32), 3).tobytes() == b"\xdd\x01"
    rng = np.random.default_rng(3)
    for n in range(1, 50):
        q = rng.integers(0, 8, n).astype(np.float32)
        packed = kernels.pack_codes(q, 3)
        assert len(packed) == -(-3 * n // 8)
        assert (kernels.unpack_f32(packed, 3, n) == q).all()
        if (3 * n) % 8:
            bad = packed.copy()
            bad[-1] |= 0x80
            assert kernels.unpack_f32(bad, 3, n) is None


def test_forward_and_inverse_are_the_hadamard_matrix():
    """forward = diag(sigma) H_B / sqrt(B) per block (to fp32 rounding); inverse undoes it."""
    rng = np.random.default_rng(4)
    for d in (1, 2, 6, 64, 80, 96, 128):
        x = rng.standard_normal((7, d)).astype(np.float32)
        b = rotation.block_size(d)
        hm = np.array([[1.0]])
        while len(hm) < b:
            hm = np.block([[hm, hm], [hm, -hm]])
        want = ((x * rotation.signs(SEED, d)).reshape(7, d // b, b) @ hm.T).reshape(7, d) / np.sqrt(b)
        y = rotation.forward(x.copy(), SEED)
        assert np.abs(y - want).max() < 1e-5 * max(1.0, np.abs(want).max())
        back = rotation.inverse(y.copy(), SEED)
        assert np.abs(back - x).max() < 1e-5 * max(1.0, np.abs(x).max())
        row = [float(v) for v in y[0]]
        assert rotation.inverse(y[:1].copy(), SEED)[0].tolist() == ref.hadamard_inverse(row, SEED)


# ---------------------------------------------------------------------------------------
# Bodies: bit-exact against the literal decoder, and close to the input
# ---------------------------------------------------------------------------------------

@st.composite
def rotated_chunks(draw):
    bits = draw(st.sampled_from((2, 3, 4, 8)))
    gaussian = bits != 8 and draw(st.booleans())
    rot = draw(st.sampled_from(("hadamard", "hadamard", "none"))) if gaussian or bits == 3 else "hadamard"
    spec = CodecSpec("int_affine", bits=bits, group_size=draw(st.sampled_from((1, 3, 8, 32, 128))),
                     group_axis=draw(st.sampled_from(("tokens", "channels"))),
                     symmetric=gaussian or draw(st.booleans()),
                     scale_dtype=draw(st.sampled_from(("f16", "bf16", "f32"))),
                     sink_tokens=draw(st.sampled_from((0, 0, 2))), residual_tokens=draw(st.sampled_from((0, 0, 3))),
                     rotation=rot, rotation_seed=draw(st.integers(0, 2 ** 64 - 1)) if rot == "hadamard" else 0,
                     codebook="gaussian" if gaussian else "uniform")
    dtype = draw(st.sampled_from(("bf16", "f16", "f32")))
    H, T, D = draw(st.integers(1, 3)), draw(st.integers(1, 12)), draw(st.sampled_from((1, 2, 6, 16, 80, 96)))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    scale = draw(st.sampled_from((1.0, 1e-3, 300.0)))
    return spec, dtype, (H, T, D), seed, scale


@settings(max_examples=60, deadline=None)
@given(rotated_chunks())
def test_rotated_bodies_decode_bit_exactly(case):
    """Property: the reference writer's body decodes (quant.decode) to exactly the bytes of the
    literal decoder of the spec text, and back to values near the input."""
    spec, dtype, (H, T, D), seed, scale = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((H, T, D)) * scale
    if D > 4:
        x[..., 1] *= 30  # an outlier channel
    x = x.astype(R.DTYPES[dtype][2])
    lay = quant.layout(spec, dtype, H, D, 0, T, 0, T)
    try:
        body = b"".join(p.tobytes() for p in quant.encode(spec, x, lay, dtype))
    except quant.NotFaithful:
        return  # the writer refused (KVW-ROT-7): stored losslessly by the encoder
    assert len(body) == lay.length
    got = quant.decode(spec, body, lay, dtype)
    assert got.tobytes() == ref.decode(spec, dtype, body, H, T, D, 0, 0, T)
    err = np.abs(got.astype(np.float64) - x.astype(np.float64))
    assert np.isfinite(err).all()
    bound = {2: 2.5, 3: 1.2, 4: 0.6, 8: 0.05}[spec.bits] * np.abs(x.astype(np.float64)).max() * np.sqrt(D)
    assert err.max() <= bound + 1e-30


@pytest.mark.parametrize("name", ["hadamard-int4-g32", "hadamard-lloyd4", "hadamard-lloyd3", "hadamard-lloyd2",
                                  "hadamard-lloyd-k3v2", "kchan4-vlloyd4", "kchan3-vlloyd2"])
def test_presets_round_trip_through_containers(name):
    """Every rotated preset: a 1.2 container (bits 0 and 4, format_minor 2) that both readers
    decode to the literal decoder's bytes (kchan*: unrotated per-channel keys, rotated values)."""
    c = forge.small_cache(layers=2, heads=2, head_dim=32, tokens=70, dtype="bf16")
    data = kvwire.encode(c, codec=name)
    h = kvwire.probe(data)
    assert h.required_features == SPECS_BIT | ROTATION_BIT and h.format_minor == 2
    rotated = [s.rotation == "hadamard" for s in h.codec_specs]
    assert all(rotated) if name.startswith("hadamard") else sorted(rotated) == [False, True]
    got = kvwire.load(data)
    parts = ref.decode_container(data)
    for i, layer in enumerate(got.layers):
        for comp, arr in layer.items():
            assert np.asarray(arr).tobytes() == parts[i, comp].tobytes()
    dec = kvwire.StreamDecoder()  # the sequential reader decodes the same bytes
    dec.feed(data)
    seen = 0
    for ev in dec.events():
        if isinstance(ev, kvwire.ChunkEvent):
            want = parts[ev.layer, ev.component][:, ev.token_start : ev.token_start + ev.data.shape[1]]
            assert np.asarray(ev.data).tobytes() == want.tobytes()
            seen += 1
    dec.close()
    assert seen == len(kvwire.open(data).records)


def test_rotation_spreads_an_outlier_channel():
    """Why the stage exists: with one key channel 40x the others, rotated int4-g32 loses far
    less than int4-g32 at the same size."""
    rng = np.random.default_rng(5)
    k = rng.standard_normal((4, 256, 128))
    k[..., 7] *= 40
    k = k.astype(R.DTYPES["bf16"][2])

    def rel(name):
        spec = PRESETS[name]
        lay = quant.layout(spec, "bf16", 4, 128, 0, 256, 0, 256)
        body = b"".join(p.tobytes() for p in quant.encode(spec, k, lay, "bf16"))
        y = quant.decode(spec, body, lay, "bf16").astype(np.float64)
        ref_ = np.delete(k.astype(np.float64), 7, axis=2)
        return np.linalg.norm(np.delete(y, 7, axis=2) - ref_) / np.linalg.norm(ref_), len(body)

    plain, n1 = rel("int4-g32")
    rot, n2 = rel("hadamard-int4-g32")
    assert n1 == n2 and rot < plain / 2, (plain, rot)


# ---------------------------------------------------------------------------------------
# Writers: KVW-ROT-7, the feature bit and the fields
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,values", [("f16", 6e4), ("f16", 2.0 ** -20), ("bf16", 1e-38), ("f32", 1e30)])
def test_writer_keeps_rotated_chunks_faithful(dtype, values):
    """KVW-ROT-7: near the header dtype's extremes every finite element decodes finite and
    every nonzero row to a nonzero row, or the chunk is stored losslessly (codec_spec 0)."""
    rng = np.random.default_rng(6)
    h = Header(Architecture((LayerSpec("full_attention", 1, 16, 16),)), token_count=32, dtype=dtype,
               chunk_tokens=16)
    k = (np.sign(rng.standard_normal((1, 32, 16))) * values).astype(R.DTYPES[dtype][2])
    k[0, :3] = 0
    v = k.copy()
    c = kvwire.KVCache(h, [{"k": k, "v": v}])
    for name in ("hadamard-lloyd2", "hadamard-int4-g32"):
        data = kvwire.encode(c, codec=name)
        got = kvwire.load(data)
        for comp in ("k", "v"):
            y = np.asarray(got.layers[0][comp]).astype(np.float32)
            assert np.isfinite(y).all()
            assert ((y != 0).any(axis=-1) | ~(k.astype(np.float32) != 0).any(axis=-1)).all()


def test_json_lists_revision_1_2_fields_only_when_used():
    plain = CodecSpec("int_affine", bits=4)
    assert "rotation" not in spec_to_json(plain) and spec_from_json(spec_to_json(plain)) == plain
    s = PRESETS["hadamard-lloyd3"]
    j = spec_to_json(s)
    assert j["rotation"] == "hadamard" and j["codebook"] == "gaussian" and j["rotation_seed"] == SEED
    assert spec_from_json(j) == s


def _spec_header(spec: CodecSpec, rf: int) -> bytes:
    h = Header(Architecture((LayerSpec("full_attention", 1, 8, 8),)), token_count=0, dtype="bf16",
               codec_specs=(spec,), required_features=rf, format_minor=2)
    return forge.wrap_header(forge.header_of(h))


@pytest.mark.parametrize("spec,rf,code,rule", [
    (CodecSpec("int_affine", bits=4), SPECS_BIT | ROTATION_BIT, "CODEC_SPEC_INVALID", "KVW-ROT-1"),
    (rotated(rotation="none"), SPECS_BIT | ROTATION_BIT, "CODEC_SPEC_INVALID", "KVW-ROT-2"),
    (rotated(codebook="gaussian"), SPECS_BIT | ROTATION_BIT, "CODEC_SPEC_INVALID", "KVW-ROT-2"),  # asymmetric
    (rotated(8, codebook="gaussian", symmetric=True), SPECS_BIT | ROTATION_BIT, "CODEC_SPEC_INVALID", "KVW-ROT-2"),
    (CodecSpec("fp8", rotation="hadamard"), SPECS_BIT | ROTATION_BIT, "CODEC_SPEC_INVALID", "KVW-CSPEC-5"),
    (CodecSpec("int_affine", bits=3), SPECS_BIT, "CODEC_SPEC_INVALID", "KVW-INT-1"),
    (CodecSpec("int_affine", bits=5), SPECS_BIT | ROTATION_BIT, "CODEC_SPEC_INVALID", "KVW-INT-1"),
])
def test_reader_rules(spec, rf, code, rule):
    forge.expect(_spec_header(spec, rf), kvwire.FormatError, code, rule)


def test_bit_without_specs_and_enum_codes(monkeypatch):
    """KVW-ROT-1 (bit 4 alone) and KVW-ROT-2's registries (codes outside: ENUM_OUT_OF_RANGE)."""
    arch = Architecture((LayerSpec("full_attention", 1, 8, 8),))
    h = Header(arch, token_count=0, dtype="bf16", required_features=ROTATION_BIT, format_minor=2)
    forge.expect(forge.wrap_header(forge.header_of(h)), kvwire.FormatError, "CODEC_SPEC_INVALID", "KVW-ROT-1")
    monkeypatch.setitem(R.ROTATIONS, "bogus", 3)
    monkeypatch.setitem(R.CODEBOOKS, "bogus", 3)
    for bad in (rotated(rotation="bogus"), rotated(codebook="bogus", symmetric=True)):
        hb = forge.header_of(Header(arch, token_count=0, dtype="bf16", codec_specs=(bad,),
                                    required_features=SPECS_BIT | ROTATION_BIT, format_minor=2))
        monkeypatch.delitem(R.ROTATIONS, "bogus", raising=False)
        monkeypatch.delitem(R.CODEBOOKS, "bogus", raising=False)
        forge.expect(forge.wrap_header(hb), kvwire.FormatError, "ENUM_OUT_OF_RANGE", "KVW-HDR-10")
        monkeypatch.setitem(R.ROTATIONS, "bogus", 3)
        monkeypatch.setitem(R.CODEBOOKS, "bogus", 3)


def test_fields_without_the_bit_are_not_read():
    """KVW-ROT-1: a writer may not write fields 11-13 without bit 4; a reader that meets them
    decodes the spec as plain int_affine, as a 1.0 reader does."""
    from kvwire.format.header import build_header

    arch = Architecture((LayerSpec("full_attention", 1, 8, 8),))
    with pytest.raises(kvwire.SchemaError) as e:
        build_header(Header(arch, token_count=0, dtype="bf16", codec_specs=(rotated(),), required_features=SPECS_BIT))
    assert e.value.rule == "KVW-ROT-1"
    h = kvwire.Encoder(Header(arch, token_count=0, dtype="bf16"), codec=rotated(rotation_seed=3)).header
    assert h.required_features == SPECS_BIT | ROTATION_BIT and h.format_minor == 2  # the encoder sets them
    c = forge.small_cache(layers=1, heads=1, head_dim=8, tokens=16, dtype="bf16")
    plain = CodecSpec("int_affine", bits=4, group_size=8, group_axis="channels", symmetric=True, scale_dtype="f16")
    data = kvwire.encode(c, codec=plain)
    h = kvwire.probe(data)
    forged = replace(h, codec_specs=(replace(plain, rotation="hadamard", rotation_seed=9, codebook="gaussian"),))
    p = forge.split(data)
    p.header = forge.header_of(forged)
    other = forge.assemble(p)
    assert len(p.header) > len(forge.header_of(h))  # the fields are there
    assert kvwire.probe(other).codec_specs == (plain,)
    a, b = kvwire.load(data), kvwire.load(other)
    assert all(np.asarray(a.layers[0][x]).tobytes() == np.asarray(b.layers[0][x]).tobytes() for x in ("k", "v"))


def test_body_rules():
    """KVW-ROT-3 padding bits and KVW-INT-3 scales in rotated bodies."""
    spec = rotated(3, group_size=8, group_axis="channels", symmetric=True, codebook="gaussian", scale_dtype="f32")
    x = np.random.default_rng(7).standard_normal((1, 3, 8)).astype(np.float32)
    lay = quant.layout(spec, "f32", 1, 8, 0, 3, 0, 3)
    body = bytearray(b"".join(p.tobytes() for p in quant.encode(spec, x, lay, "f32")))
    bad = bytearray(body)
    bad[0:4] = struct.pack("<f", -1.0)
    with pytest.raises(kvwire.CodecError) as e:
        quant.decode(spec, bytes(bad), lay, "f32")
    assert (e.value.code, e.value.rule) == ("DECODE_FAILED", "KVW-INT-3")
    spec5 = replace(spec, group_size=5)
    x5 = x[:, :1, :5].copy()
    lay5 = quant.layout(spec5, "f32", 1, 5, 0, 1, 0, 1)
    body5 = bytearray(b"".join(p.tobytes() for p in quant.encode(spec5, x5, lay5, "f32")))
    body5[-1] |= 0x80  # 15 bits of codes in 2 bytes: bit 15 is padding
    with pytest.raises(kvwire.CodecError) as e:
        quant.decode(spec5, bytes(body5), lay5, "f32")
    assert (e.value.code, e.value.rule) == ("DECODE_FAILED", "KVW-ROT-3")
