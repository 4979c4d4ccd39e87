"""Codec specs on the wire (spec/codecs.md): header field, record rules, encoder API,
every reader path (Reader.chunk/layer/load, StreamDecoder feed and read_targets)."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import codec_reference as ref
import forge
import kvwire
from kvwire import CodecSpec, codecs
from kvwire.conformance import neutral as N
from kvwire.format import registry as R
from kvwire.format.codec_specs import check_spec_refs, spec_from_json, spec_to_json
from kvwire.format.header import Architecture, Header, LayerSpec, parse_header

BIT = R.REQUIRED_FEATURES["codec_specs"]


def kv_cache(layers=3, heads=2, tokens=70, dim=16, dtype="bf16", seed=0, chunk_tokens=32, **kw) -> kvwire.KVCache:
    rng = np.random.default_rng(seed)
    dt = R.DTYPES[dtype][2]
    ks = [(rng.standard_normal((heads, tokens, dim)) * (1 + 10 * (np.arange(dim) % 7 == 0))).astype(dt)
          for _ in range(layers)]
    vs = [rng.standard_normal((heads, tokens, dim)).astype(dt) for _ in range(layers)]
    c = kvwire.KVCache.from_tensors(ks, vs)
    return c.with_header(chunk_tokens=chunk_tokens, **kw)


reference_decode = ref.decode_container


def _same(a, b) -> bool:
    return np.asarray(a).tobytes() == np.asarray(b).tobytes()


# ---------------------------------------------------------------------------------------
# Round trips through every reader path
# ---------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(codecs.PRESETS))
def test_presets_decode_identically_on_every_path(preset):
    """KVW-CSPEC-9/10, KVW-LOSSY-4: Reader.load, Reader.chunk, StreamDecoder (feed and
    read_targets) and the literal reference decoder agree byte for byte; lossless is exact."""
    cache = kv_cache(tokens=160, chunk_tokens=64)  # kivi keeps the last 128 tokens: 32 are quantized
    for form in ("file", "stream"):
        data = kvwire.encode(cache, codec=preset, form=form)
        loaded = forge.read_all(data)
        assert loaded.header.required_features & BIT and loaded.header.codec_specs
        want = reference_decode(data)
        for i, layer in enumerate(loaded.layers):
            for comp in ("k", "v"):
                assert _same(layer[comp], want[i, comp]), (preset, i, comp)
                if preset == "byteplane":
                    assert _same(layer[comp], cache.layers[i][comp])
        dec = kvwire.StreamDecoder()
        for j in range(0, len(data), 997):
            dec.feed(data[j : j + 997])
        got = {}
        for ev in dec.events():
            if isinstance(ev, kvwire.ChunkEvent):
                got.setdefault((ev.layer, ev.component), {})[ev.token_start] = ev.data
        dec.close()
        for key, parts in got.items():
            assert _same(np.concatenate([parts[t] for t in sorted(parts)], axis=1), want[key])
    # read_targets / filled: bodies land in decoder-owned buffers, then decode
    dec = kvwire.StreamDecoder(stop_at_end=True)
    data = kvwire.encode(cache, codec=preset, form="stream")
    pos, events = 0, []
    while not dec.done:
        for t in dec.read_targets():
            n = len(t)
            t[:] = data[pos : pos + n]
            pos += n
            dec.filled(n)
        events += list(dec.events())
    chunks = [e for e in events if isinstance(e, kvwire.ChunkEvent)]
    assert len(chunks) == 3 * 2 * 3
    for e in chunks:
        t = e.token_start
        assert _same(e.data, want[e.layer, e.component][:, t : t + e.data.shape[1]])


def test_layer_out_fills_caller_buffers_and_chunk_views():
    """Reader.layer(out=) decodes lossy chunks into the caller's tensors."""
    cache = kv_cache()
    data = kvwire.encode(cache, codec="kivi4")
    want = reference_decode(data)
    with kvwire.open(data) as r:
        out = {c: np.zeros((2, 70, 16), ml_dtypes.bfloat16) for c in ("k", "v")}
        got = r.layer(1, out=out)
        assert got is out and _same(out["k"], want[1, "k"]) and _same(out["v"], want[1, "v"])
        assert _same(r.chunk(2, "v", 1), want[2, "v"][:, 32:64])


@given(tokens=st.integers(1, 80), chunk=st.sampled_from([7, 32, 64]), resid=st.integers(0, 90),
       sink=st.integers(0, 10), bits=st.sampled_from([2, 4, 8]), seed=st.integers(0, 1000))
def test_lossy1_sink_and_residual_tokens_are_exact_across_chunks(tokens, chunk, resid, sink, bits, seed):
    """KVW-LOSSY-1: the layer's first S and last R tokens decode bit for bit, whatever the
    chunk grid; the rest is quantized."""
    spec = CodecSpec("int_affine", bits=bits, group_size=8, sink_tokens=sink, residual_tokens=resid)
    cache = kv_cache(layers=1, tokens=tokens, chunk_tokens=chunk, seed=seed)
    loaded = kvwire.load(kvwire.encode(cache, codec=spec))
    for comp in ("k", "v"):
        src, got = cache.layers[0][comp], loaded.layers[0][comp]
        kept = [t for t in range(tokens) if t < sink or t >= tokens - resid]
        assert _same(got[:, kept], src[:, kept])


def test_lossy1_tokens_are_counted_in_the_layers_token_range():
    """KVW-LOSSY-1: windows count from the layer's range [lo, hi), not from token 0."""
    arch = Architecture((LayerSpec("full_attention", 1, 8, 8), LayerSpec("sliding_attention", 1, 8, 8, window=16)))
    h = Header(arch, token_count=40, dtype="f32", chunk_tokens=16,
               layer_tokens=(kvwire.TokenRange(0, 40), kvwire.TokenRange(20, 20)))
    rng = np.random.default_rng(3)
    layers = [{c: rng.standard_normal((1, r.count, 8)).astype(np.float32) for c in "kv"} for r in h.layer_tokens]
    cache = kvwire.KVCache(h, layers)
    spec = CodecSpec("int_affine", bits=2, group_size=4, sink_tokens=3, residual_tokens=5)
    data = kvwire.encode(cache, codec=spec)
    loaded = forge.read_all(data)
    want = reference_decode(data)
    for i in range(2):
        n = h.layer_tokens[i].count
        got, src = loaded.layers[i]["k"], layers[i]["k"]
        assert _same(got, want[i, "k"])
        assert _same(got[:, :3], src[:, :3]) and _same(got[:, n - 5 :], src[:, n - 5 :])
        assert not _same(got[:, 3 : n - 5], src[:, 3 : n - 5])


# ---------------------------------------------------------------------------------------
# Encoder API: per (layer, component) and per chunk
# ---------------------------------------------------------------------------------------

def test_mapping_and_callable_choose_per_layer_component_and_chunk():
    """Per (layer, component) and per chunk choices; distinct specs listed once."""
    cache = kv_cache()
    fp8 = codecs.PRESETS["fp8-e4m3"]
    choice = {(0, "k"): "byteplane", (0, "v"): "zstd", "k": "int4-g32", None: fp8}
    data = kvwire.encode(cache, codec=choice)
    with kvwire.open(data) as r:
        h = r.header
        assert h.codec_specs == (codecs.PRESETS["byteplane"], codecs.PRESETS["int4-g32"], fp8)  # first use order
        by = {(int(x["layer"]), R.COMPONENT_BY_CODE[int(x["component"])]): R.CODEC_BY_CODE[int(x["codec"])]
              for x in r.records}
    assert by[0, "k"] == "byteplane_zstd" and by[0, "v"] in ("zstd", "raw")
    assert by[1, "k"] == by[2, "k"] == "int_affine" and by[1, "v"] == by[2, "v"] == "fp8"
    assert _same(kvwire.load(data).layers[0]["k"], cache.layers[0]["k"])

    def per_chunk(layer, comp, t0):
        return "raw" if t0 == 0 else ("kivi2" if layer % 2 else codecs.PRESETS["int8"])

    data = kvwire.encode(cache, codec=per_chunk)
    with kvwire.open(data) as r:
        assert len(r.header.codec_specs) == 3  # kivi2 k, kivi2 v, int8
        for x in r.records:
            assert (int(x["token_start"]) == 0) == (int(x["reserved0"]) == 0)
    loaded = kvwire.load(data)
    assert _same(loaded.layers[1]["k"][:, :32], cache.layers[1]["k"][:, :32])


def test_encoder_keeps_header_specs_and_adds_new_ones():
    """Encoder(header with codec_specs): listed specs keep their indices."""
    cache = kv_cache(layers=1)
    extra = CodecSpec("fp8", fp8_format="f8_e5m2")
    h = cache.header.replace(codec_specs=(extra,), required_features=BIT)
    enc = kvwire.Encoder(h, codec="byteplane")
    assert enc.header.codec_specs == (extra, codecs.PRESETS["byteplane"])
    enc = kvwire.Encoder(h, codec=extra)
    assert enc.header.codec_specs == (extra,)


def test_plain_codecs_write_v10_containers():
    """KVW-CSPEC-1: raw/zstd alone set no feature bit and no codec_specs (a 1.0 reader reads them)."""
    data = kvwire.encode(kv_cache(layers=1), codec="zstd")
    h = kvwire.probe(data)
    assert h.required_features == 0 and h.codec_specs == ()


@pytest.mark.parametrize("bad", ["lz4", "fp9", 3, CodecSpec("raw")])
def test_unknown_codec_choices_are_refused(bad):
    with pytest.raises((ValueError, kvwire.SchemaError)):
        kvwire.encode(kv_cache(layers=1), codec=bad)


def test_writer_refuses_lossy_codecs_on_integer_dtypes():
    """KVW-CSPEC-6 on the writer side (KVW-WRITE-1)."""
    cache = kvwire.KVCache.from_tensors([np.zeros((1, 4, 8), np.int8)], [np.zeros((1, 4, 8), np.int8)])
    with forge.raises_code(kvwire.SchemaError, "CODEC_SPEC_INVALID", "KVW-CSPEC-6"):
        kvwire.encode(cache, codec="int8")
    assert _same(kvwire.load(kvwire.encode(cache, codec="byteplane")).layers[0]["k"], cache.layers[0]["k"])


def test_max_decoded_bytes_bounds_lossy_containers():
    """KVW-CSPEC-10: raw_length is the decoded size, so the limit applies before decoding."""
    data = kvwire.encode(kv_cache(), codec="kivi2")
    with forge.raises_code(kvwire.LimitError, "DECODED_SIZE_LIMIT"):
        kvwire.open(data, max_decoded_bytes=1000)


# ---------------------------------------------------------------------------------------
# Header field and its rules
# ---------------------------------------------------------------------------------------

def _header(*specs, dtype="bf16", bit=True):
    arch = Architecture.uniform(1, 1, 8)
    return Header(arch, token_count=4, dtype=dtype, codec_specs=tuple(specs), required_features=BIT if bit else 0)


def test_cspec_header_round_trip_and_json():
    """The table's every field survives build/parse and the neutral JSON model."""
    specs = (CodecSpec("byteplane_zstd"),
             CodecSpec("fp8", lossless="zstd", fp8_format="f8_e4m3fnuz", scale_granularity="token", sink_tokens=4),
             CodecSpec("int_affine", lossless="byteplane_zstd", bits=2, group_size=7, group_axis="channels",
                       symmetric=True, scale_dtype="bf16", residual_tokens=128))
    h = _header(*specs)
    assert parse_header(forge.header_of(h, check=True)) == h
    assert tuple(spec_from_json(spec_to_json(s)) for s in specs) == specs
    j = N.header_to_json(h)
    assert j["codec_specs"][2]["group_axis"] == "channels"
    assert N.header_from_json(j) == h


def test_cspec10_field_without_the_bit_is_refused_by_readers_and_writers():
    """KVW-CSPEC-10 / KVW-EVOL-10: codec_specs is part of the 1.0 schema, read whatever bits are set."""
    h = _header(CodecSpec("byteplane_zstd"), bit=False)
    with forge.raises_code(kvwire.SchemaError, "CODEC_SPEC_INVALID", "KVW-CSPEC-10"):
        parse_header(forge.header_of(h))
    with forge.raises_code(kvwire.SchemaError, "CODEC_SPEC_INVALID", "KVW-CSPEC-10"):
        forge.header_of(h, check=True)


def test_cspec1_bit_without_specs_is_unsupported_feature():
    """KVW-CSPEC-1: bit 0 alone (the 1.0 gold vector evol3-required-feature) stays UNSUPPORTED_FEATURE."""
    forge.expect(forge.wrap_header(forge.header_of(_header(bit=True))), kvwire.FeatureError, "UNSUPPORTED_FEATURE",
                 "KVW-EVOL-3")
    with forge.raises_code(kvwire.FeatureError, "UNSUPPORTED_FEATURE", "KVW-EVOL-3"):
        kvwire.Encoder(kv_cache(layers=1).header.replace(required_features=BIT))


@pytest.mark.parametrize("spec, dtype, rule", [
    (CodecSpec("raw"), "bf16", "KVW-CSPEC-3"),
    (CodecSpec("zstd"), "bf16", "KVW-CSPEC-3"),
    (CodecSpec("fp8", lossless="fp8"), "bf16", "KVW-CSPEC-4"),
    (CodecSpec("byteplane_zstd", lossless="zstd"), "bf16", "KVW-CSPEC-5"),
    (CodecSpec("byteplane_zstd", bits=4), "bf16", "KVW-CSPEC-5"),
    (CodecSpec("fp8", bits=4), "bf16", "KVW-CSPEC-5"),
    (CodecSpec("int_affine", scale_granularity="head"), "bf16", "KVW-CSPEC-5"),
    (CodecSpec("fp8"), "i8", "KVW-CSPEC-6"),
    (CodecSpec("int_affine"), "f8_e4m3fn", "KVW-CSPEC-6"),
    (CodecSpec("fp8", fp8_format="bf16"), "bf16", "KVW-FP8-1"),
    (CodecSpec("int_affine", bits=3), "bf16", "KVW-INT-1"),
    (CodecSpec("int_affine", scale_dtype="u8"), "bf16", "KVW-INT-1"),
    (CodecSpec("int_affine", group_size=0), "bf16", "KVW-INT-2"),
    (CodecSpec("int_affine", group_size=65537), "bf16", "KVW-INT-2"),
])
def test_cspec_invalid_specs_are_rejected_by_readers(spec, dtype, rule):
    """KVW-CSPEC-3..6, KVW-FP8-1, KVW-INT-1/2: CODEC_SPEC_INVALID from parse_header."""
    hb = forge.header_of(_header(CodecSpec("byteplane_zstd"), spec, dtype=dtype))
    with forge.raises_code(kvwire.SchemaError, "CODEC_SPEC_INVALID", rule):
        parse_header(hb)
    assert "codec_specs[1]" in str(pytest.raises(kvwire.SchemaError, parse_header, hb).value)


# KVW-CSPEC-8 (sink and residual tokens of sparse containers, counted per head) is covered in
# tests/model/test_sparse.py with the sparse codec round trips.


def test_cspec_unknown_enum_codes_are_enum_out_of_range():
    """KVW-HDR-10 for the table's enums."""
    h = _header(CodecSpec("fp8"))
    hb = bytearray(forge.header_of(h))
    t = forge.root_table(bytes(hb)).tables(18, 10)[0]
    hb[forge.field_pos(t, 0, 1)] = 9  # codec 9
    with forge.raises_code(kvwire.SchemaError, "ENUM_OUT_OF_RANGE", "KVW-HDR-10"):
        parse_header(bytes(hb))


def test_cspec2_vector_limit():
    """KVW-CSPEC-2: more than 4096 specs is LIMIT_EXCEEDED (refused before reading them)."""
    specs = tuple(CodecSpec("int_affine", group_size=g) for g in range(1, 4098))
    with forge.raises_code(kvwire.LimitError, "LIMIT_EXCEEDED"):
        parse_header(forge.header_of(_header(*specs)))


# ---------------------------------------------------------------------------------------
# Record rules
# ---------------------------------------------------------------------------------------

def _container():
    return kvwire.encode(kv_cache(layers=1, tokens=40), codec={"k": "fp8-e4m3", "v": "zstd"}, form="stream")


@pytest.mark.parametrize("edit, what", [
    (forge.set_records(reserved0=(0, 2)), "codec_spec beyond the specs"),
    (forge.set_records(reserved0=(0, 0)), "fp8 record with codec_spec 0"),
    (forge.set_records(codec=(0, R.CODECS["int_affine"])), "codec differs from its spec's"),
    (forge.set_records(reserved0=(2, 1)), "a zstd/raw record naming the fp8 spec"),
])
def test_cspec9_record_references(edit, what):
    """KVW-CSPEC-9: CODEC_SPEC_MISMATCH from the random-access and the sequential reader."""
    data = forge.rebuild(_container(), edit=edit)
    forge.expect(data, kvwire.CodecError, "CODEC_SPEC_MISMATCH", "KVW-CSPEC-9", stage="open")
    dec = kvwire.StreamDecoder()
    with forge.raises_code(kvwire.CodecError, "CODEC_SPEC_MISMATCH", "KVW-CSPEC-9"):
        dec.feed(data)
        list(dec.events())


def test_cspec9_lossy_spec_only_on_kv_components():
    """KVW-CSPEC-9: a lossy spec on a component other than k, v, latent."""
    rec = np.zeros(1, kvwire.format.container.RECORD_DTYPE)
    rec["codec"], rec["reserved0"], rec["component"] = R.CODECS["fp8"], 1, R.COMPONENTS["positions"]
    with forge.raises_code(kvwire.CodecError, "CODEC_SPEC_MISMATCH", "KVW-CSPEC-9"):
        check_spec_refs(_header(CodecSpec("fp8")), rec)


def test_chunk7_reserved0_without_the_bit_and_evol9_codecs_without_the_bit():
    """KVW-CHUNK-7 and KVW-EVOL-9 still hold in containers without the feature: reserved0 only
    gains its meaning under the codec_specs bit, which older readers reject (KVW-EVOL-8)."""
    data = kvwire.encode(kv_cache(layers=1, tokens=40), form="stream")
    forge.expect(forge.rebuild(data, edit=forge.set_records(reserved0=(0, 1))), kvwire.LayoutError,
                 "RESERVED_NONZERO", "KVW-CHUNK-7")
    forge.expect(forge.rebuild(data, edit=forge.set_records(codec=(0, R.CODECS["fp8"]))), kvwire.CodecError,
                 "UNKNOWN_CODEC", "KVW-CHUNK-5")


def test_bodies_are_checked_at_decode():
    """KVW-LOSSY-2 / KVW-BPZ-3 through the reader: a body cut by one byte (checksum fixed)."""
    data = kvwire.encode(kv_cache(layers=1, tokens=40), codec={"k": "fp8-e4m3", "v": "byteplane"},
                         form="stream")
    p = forge.split(data)
    p.bodies = [b[:-1] for b in p.bodies]
    bad = forge.assemble(p)
    err = forge.expect(bad, kvwire.CodecError, "DECODE_FAILED", stage="validate")
    assert err.rule in ("KVW-LOSSY-2", "KVW-CSPEC-7", "KVW-BPZ-3")


def test_registry_knows_the_feature():
    assert R.KNOWN_REQUIRED_FEATURES & BIT
    assert dataclasses.is_dataclass(CodecSpec) and hash(CodecSpec("fp8")) == hash(CodecSpec("fp8"))


@given(dtype=st.sampled_from(sorted(R.DTYPES)), tokens=st.integers(1, 40), chunk=st.sampled_from([5, 16, 64]),
       seed=st.integers(0, 2**31), form=st.sampled_from(["file", "stream"]))
def test_bpz_containers_round_trip_every_dtype_bit_for_bit(dtype, tokens, chunk, seed, form):
    """KVW-BPZ-1/2, KVW-CHUNK-11: byteplane_zstd is lossless for every dtype and bit pattern
    (NaN payloads, -0, subnormals), low-entropy or not."""
    rng = np.random.default_rng(seed)
    h = Header(Architecture.uniform(2, 2, 8), token_count=tokens, dtype=dtype, chunk_tokens=chunk)
    layers = [{c: forge.random_tensor(rng, (2, tokens, 8), dtype, compressible=bool(i)) for c in "kv"}
              for i in range(2)]
    cache = kvwire.KVCache(h, layers)
    loaded = forge.read_all(kvwire.encode(cache, codec="byteplane", form=form))
    assert forge.cache_bytes_equal(loaded, kvwire.KVCache(loaded.header, layers))


def test_conformance_vectors_generate_and_check(tmp_path):
    """conformance/add_codecs.py: every vector is built and checked against the literal
    reference decoder (valid) or the expected code and rule (invalid)."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "conformance"))
    try:
        import add_codecs
        import generate
    finally:
        sys.path.remove(str(root / "conformance"))
    g = generate.Generator(tmp_path)
    add_codecs.gen_codecs(g)
    kinds = [e["kind"] for e in g.entries]
    assert kinds.count("valid") >= 12 and kinds.count("invalid") >= 20
    codes = {e["expected_code"] for e in g.entries if e["kind"] == "invalid"}
    assert {"CODEC_SPEC_INVALID", "CODEC_SPEC_MISMATCH", "DECODE_FAILED", "UNKNOWN_CODEC"} <= codes
    assert generate.ADDITIONS["codecs"] is add_codecs.ADDITION


CODEC_SPEC_V1_1 = [('codec', 'Codec', 0), ('lossless', 'Codec', 1), ('fp8_format', 'DType', 2),
                   ('scale_granularity', 'ScaleGranularity', 3), ('bits', 'ubyte', 4), ('group_size', 'uint', 5),
                   ('group_axis', 'GroupAxis', 6), ('symmetric', 'bool', 7), ('scale_dtype', 'DType', 8),
                   ('sink_tokens', 'uint', 9), ('residual_tokens', 'uint', 10)]
# revision 1.2 (spec/codecs.md section 8): appended with the next ids, never inserted
CODEC_SPEC_V1_2 = CODEC_SPEC_V1_1 + [('rotation', 'Rotation', 11), ('rotation_seed', 'ulong', 12),
                                     ('codebook', 'Codebook', 13)]


def test_evol7_codec_spec_table_is_pinned():
    """KVW-EVOL-7 for the table of spec/codecs.md: pinned here (never edit; add fields with new ids),
    and the reference codec's field list agrees with the schema."""
    from test_schema_evolution import current

    from kvwire.format.codec_specs import _FIELDS

    tables, _ = current()
    assert tables["CodecSpec"][: len(CODEC_SPEC_V1_2)] == CODEC_SPEC_V1_2
    assert ("codec_specs", "[CodecSpec]", 18) in tables["Header"]
    assert [(a, fid) for a, fid, _ in _FIELDS] == [(n, i) for n, _, i in CODEC_SPEC_V1_2]


def test_stream_decoder_placement_receives_decoded_lossy_chunks():
    """StreamDecoder(placement=...) writes each decoded chunk into the caller's tensor."""
    cache = kv_cache(layers=2, tokens=70)
    data = kvwire.encode(cache, codec="int4-g32", form="stream")
    want = reference_decode(data)
    dst = {(i, c): np.zeros((2, 70, 16), ml_dtypes.bfloat16) for i in range(2) for c in "kv"}
    dec = kvwire.StreamDecoder(placement=lambda layer, comp, t0, n: dst[layer, comp][:, t0 : t0 + n])
    dec.feed(data)
    n = sum(isinstance(e, kvwire.ChunkEvent) for e in dec.events())
    dec.close()
    assert n == 2 * 2 * 3 and all(_same(dst[k], want[k]) for k in dst)


_FUZZ_BASE = {}


@given(preset=st.sampled_from(["byteplane", "fp8-e4m3-token", "int4-g32-zstd", "kivi2",
                               CodecSpec("fp8", lossless="byteplane_zstd")]),
       chunk=st.integers(0, 7), pos=st.integers(0, 10**6), value=st.integers(0, 255), cut=st.integers(-3, 3))
def test_corrupt_bodies_with_valid_checksums_fail_cleanly(preset, chunk, pos, value, cut):
    """Bad input never crashes: any byte change or length change of a stored body (checksum
    recomputed, so the codec sees it) is decoded or rejected with a FormatError."""
    key = str(preset)
    if key not in _FUZZ_BASE:
        _FUZZ_BASE[key] = forge.split(kvwire.encode(kv_cache(layers=1, tokens=200, chunk_tokens=64), codec=preset))
    p = _FUZZ_BASE[key].copy()
    i = chunk % len(p.bodies)
    body = bytearray(p.bodies[i])
    body[pos % len(body)] = value
    body = body[: len(body) + cut] if cut < 0 else body + bytes(cut)
    p.bodies[i] = bytes(body)
    try:
        forge.read_all(forge.assemble(p))
    except kvwire.FormatError:
        pass


def test_bpz4_incompressible_chunks_fall_back_to_raw():
    """KVW-BPZ-4: a chunk whose byteplane body would not be shorter is stored raw, codec_spec 0."""
    rng = np.random.default_rng(11)
    noise = rng.integers(0, 256, (2, 40, 16, 2), dtype=np.uint8).view(ml_dtypes.bfloat16)[..., 0]
    noise = np.where(np.isfinite(noise.astype(np.float32)), noise, 0).astype(ml_dtypes.bfloat16)
    c = kvwire.KVCache.from_tensors([noise], [noise]).with_header(chunk_tokens=16)
    with kvwire.open(kvwire.encode(c, codec="byteplane")) as r:
        assert set(r.records["codec"].tolist()) == {R.CODECS["raw"]}
        assert not r.records["reserved0"].any()
        assert forge.cache_bytes_equal(r.load(), c.with_header(**{
            "codec_specs": r.header.codec_specs, "required_features": r.header.required_features}))


# ---------------------------------------------------------------------------------------
# Faithful encoding: chunks a lossy spec cannot carry are stored losslessly (KVW-LOSSY-5/6)
# ---------------------------------------------------------------------------------------

def _records(data):
    with kvwire.open(data) as r:
        return [(r.info(i).layer, r.info(i).component, r.info(i).token_start, r.info(i).codec,
                 int(rec["reserved0"])) for i, rec in enumerate(r.records)]


@pytest.mark.parametrize("preset", ["int8", "int4-g32", "kivi2", "kivi4", "int8-asym", "fp8-e4m3"])
def test_lossy5_f16_largest_finite_values_decode_finite(preset):
    """KVW-LOSSY-5 (a), the issue's case: an f16 cache holding +-65504 decoded to +-inf
    under int8 (the f16 scale 516 = 65504/127 rounded up, 127 * 516 > 65504) and int4-g32;
    now every element decodes finite and close, and the chunks stay lossy."""
    cache = kv_cache(layers=1, tokens=192, dim=32, dtype="f16", chunk_tokens=64)
    for a in cache.layers[0].values():
        a[:, :64] = np.where(a[:, :64] >= 0, 65504, -65504)
    data = kvwire.encode(cache, codec=preset)
    got = forge.read_all(data)
    want = reference_decode(data)
    for comp in ("k", "v"):
        y = got.layers[0][comp].astype(np.float32)
        assert _same(got.layers[0][comp], want[0, comp])
        assert np.isfinite(y).all(), preset
        assert np.abs(y[:, :64] - cache.layers[0][comp][:, :64].astype(np.float32)).max() <= 65504 * 2 ** -5
    assert all(spec for *_, spec in _records(data))  # no fallback needed


@pytest.mark.parametrize("dtype, preset, scale", [("bf16", "int8", 1e-7), ("bf16", "kivi2", 1e30),
                                                  ("f32", "int4-g32", 1e-9), ("f32", "int8-asym", 3e38)])
def test_lossy5_chunks_the_spec_cannot_carry_are_stored_losslessly(dtype, preset, scale):
    """KVW-LOSSY-5: values an f16 scale cannot scale (bf16 1e-7 under int8 decoded to all
    zeros; 1e30 under kivi2 raised) or whose range overflows fp32: that chunk is stored raw
    or zstd (codec_spec 0), bit for bit; the other chunks keep the lossy spec."""
    cache = kv_cache(layers=1, tokens=192, dim=32, dtype=dtype, chunk_tokens=32)
    dt = R.DTYPES[dtype][2]
    for a in cache.layers[0].values():
        a[:, 32:64] = (a[:, 32:64].astype(np.float64) * scale).clip(-3.38e38, 3.38e38).astype(dt)
    data = kvwire.encode(cache, codec=preset)
    recs = _records(data)
    got = forge.read_all(data)
    for comp in ("k", "v"):
        assert got.layers[0][comp][:, 32:64].tobytes() == cache.layers[0][comp][:, 32:64].tobytes()
        assert np.isfinite(got.layers[0][comp].astype(np.float32)).all()
    for _layer, comp, t0, codec, spec in recs:
        if t0 == 32:
            assert codec in ("raw", "zstd") and spec == 0, (comp, codec)
        elif t0 < 64:  # kivi keeps the last 128 tokens: quantized chunks are t0 < 64
            assert spec != 0, (comp, t0, codec)
    ref_ = reference_decode(data)
    assert _same(got.layers[0]["k"], ref_[0, "k"])


@pytest.mark.parametrize("preset", ["int8", "kivi2", "fp8-e4m3", "fp8-e5m2"])
def test_lossy6_nan_and_infinity_chunks_are_stored_bit_for_bit(preset):
    """KVW-LOSSY-6: a chunk holding NaN (with a payload) or +-inf is stored losslessly:
    int8 used to raise ValueError for the whole cache, fp8 saturated infinities."""
    cache = kv_cache(layers=1, tokens=192, dim=16, dtype="bf16", chunk_tokens=32)
    k = cache.layers[0]["k"]
    k.view(np.uint16)[0, 5, :3] = [0x7FA1, 0x7F80, 0xFF80]  # a NaN payload, +inf, -inf
    data = kvwire.encode(cache, codec=preset)
    got = forge.read_all(data)
    assert got.layers[0]["k"][:, :32].tobytes() == k[:, :32].tobytes()
    assert [c for _, comp, t0, c, _ in _records(data) if comp == "k" and t0 == 0] in (["raw"], ["zstd"])
