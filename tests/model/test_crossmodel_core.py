"""Cross-model core: state layers (KVW-STATE-*), the layer map (KVW-MAP-4..7), the
compatibility check (KVW-XM-*) and the architecture families of spec/crossmodel.md section 2."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import forge
import kvwire
from kvwire import LayerMapEntry as E
from kvwire import LayerSpec, LocalModel, StateTensor
from kvwire.format import registry as R
from kvwire.format.chunks import ChunkTable, check_record_fields
from kvwire.format.errors import LayoutError, SchemaError
from kvwire.format.header import build_header, parse_header
from kvwire.model.identity import make_identity

STATE_BIT = R.REQUIRED_FEATURES["state_layers"]
FULL = LayerSpec("full_attention", 2, 8, 8)
SSM = LayerSpec("state", state_tensors=(StateTensor("conv", (1, 4, 3)), StateTensor("ssm", (1, 2, 5, 3), "bf16")))


def state_cache(tokens: int = 10, *, seed: int = 0, chunk_tokens: int = 4, layers=(FULL, SSM, FULL)) -> kvwire.KVCache:
    rng = np.random.default_rng(seed)
    h = kvwire.Header(kvwire.Architecture(tuple(layers)), token_count=tokens, dtype="f16", chunk_tokens=chunk_tokens,
                      required_features=STATE_BIT)
    out = []
    for s in layers:
        if s.kind == "state":
            out.append({"state": {t.name: forge.random_tensor(rng, t.shape, t.dtype) for t in s.state_tensors}
                        if tokens else {}})
        else:
            out.append({c: forge.random_tensor(rng, s.shape(c, tokens), "f16") for c in s.components})
    return kvwire.KVCache(h, out)


# ---------------------------------------------------------------------------------------
# State layers
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("form", ["file", "stream"])
@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_state7_state_layers_round_trip(form, codec):
    """KVW-STATE-7: one chunk per state tensor, in its own dtype, through random access and the stream decoder."""
    c = state_cache()
    data = kvwire.encode(c, form=form, codec=codec)
    assert forge.read_all(data).equal(c)
    with kvwire.open(data) as r:
        assert r.num_chunks(1, "state") == 2
        rec = r.record(1, "state", 1)
        assert (int(rec["token_start"]), int(rec["token_count"]), int(rec["head_start"]), int(rec["head_count"]),
                int(rec["raw_length"])) == (0, 10, 1, 1, 2 * 5 * 3 * 2)
        ssm = r.chunk(1, "state", 1)
        assert ssm.dtype == ml_dtypes.bfloat16 and ssm.shape == (1, 2, 5, 3)
        assert ssm.tobytes() == c.state(1)["ssm"].tobytes()
        assert r.layer(1)["state"]["conv"].tobytes() == c.state(1)["conv"].tobytes()
        # layer() and load() own their memory, state tensors included: none is a view of the container
        whole = np.frombuffer(r._buf, np.uint8)
        assert not any(np.shares_memory(x, whole) for x in r.layer(1)["state"].values())
        assert not any(np.shares_memory(x, whole) for x in r.load().state(1).values())
    dec = kvwire.StreamDecoder()
    dec.feed(data)
    events = [e for e in dec.events() if isinstance(e, kvwire.ChunkEvent) and e.component == "state"]
    assert [(e.layer, e.data.shape, str(e.data.dtype)) for e in events] == [
        (1, (1, 4, 3), "float32"), (1, (1, 2, 5, 3), "bfloat16")]


@pytest.mark.parametrize("codec", ["raw", "byteplane"])
def test_state1_writer_sets_the_state_layers_bit(codec):
    """KVW-STATE-1: the encoder derives required bit state_layers from the architecture, next to the
    bits other features set (codec_specs); a header without it is still refused (KVW-EVOL-9)."""
    c = state_cache()
    bare = kvwire.KVCache(c.header.replace(required_features=0), c.layers)
    enc = kvwire.cache.encoder.Encoder(bare.header, codec=codec)
    assert enc.header.required_features & STATE_BIT
    data = kvwire.encode(bare, codec=codec)
    with kvwire.open(data) as r:
        assert r.header.required_features & STATE_BIT
        assert r.layer(1)["state"]["ssm"].tobytes() == c.state(1)["ssm"].tobytes()
    plain = kvwire.Header(kvwire.Architecture((FULL,)), token_count=2, dtype="f16")
    assert kvwire.cache.encoder.Encoder(plain).header.required_features == 0  # only when a layer is a state layer
    with pytest.raises(SchemaError) as e:
        build_header(bare.header)
    assert e.value.code == "ENUM_OUT_OF_RANGE"


def test_state7_cache_of_zero_tokens_has_no_state_chunks():
    c = state_cache(0)
    data = kvwire.encode(c)
    with kvwire.open(data) as r:
        assert r.chunk_count == 0 and r.load().equal(c) and r.layer(1) == {"state": {}}


@settings(max_examples=25, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=3), min_size=1, max_size=3),
       dtypes=st.lists(st.sampled_from(sorted(R.DTYPES)), min_size=3, max_size=3), tokens=st.integers(1, 9),
       c=st.integers(1, 5), codec=st.sampled_from(["raw", "zstd"]))
def test_state_round_trip_property(shapes, dtypes, tokens, c, codec):
    """KVW-STATE-7: any state tensor shapes and dtypes next to attention layers round-trip bit for bit."""
    tensors = tuple(StateTensor(f"t{i}", tuple(s), dtypes[i]) for i, s in enumerate(shapes))
    spec = LayerSpec("state", state_tensors=tensors)
    cache = state_cache(tokens, chunk_tokens=c, layers=(spec, FULL, spec))
    assert forge.read_all(kvwire.encode(cache, codec=codec)).equal(cache)


def state_header(**spec_changes) -> kvwire.Header:
    return state_cache(0).header.replace(arch=kvwire.Architecture((FULL, dataclasses.replace(SSM, **spec_changes))))


@pytest.mark.parametrize("changes", [
    dict(num_kv_heads=1), dict(head_dim_k=4), dict(window=3), dict(kv_lora_rank=2), dict(source_layer=0),
    dict(state_tensors=()), dict(state_tensors=(StateTensor("a", (1,)), StateTensor("a", (2,)))),
    dict(state_tensors=(StateTensor("bad name", (1,)),)), dict(state_tensors=(StateTensor("", (1,)),)),
    dict(state_tensors=(StateTensor("a", ()),)), dict(state_tensors=(StateTensor("a", (2, 0)),)),
    dict(state_tensors=(StateTensor("a", (1,) * 9),)),
    dict(state_tensors=tuple(StateTensor(f"t{i}", (1,)) for i in range(65))),
], ids=["heads", "head-dim", "window", "mla", "source", "no-tensors", "duplicate-name", "name-space", "name-empty",
        "no-dims", "zero-dim", "nine-dims", "65-tensors"])
def test_state2_state_layer_spec(changes):
    """KVW-STATE-2: no attention fields on a state layer; 1-64 named tensors of 1-8 dimensions >= 1."""
    data = forge.wrap_header(forge.header_of(state_header(**changes)))
    forge.expect(data, SchemaError, "STATE_INVALID", "KVW-STATE-2")


def test_state2_state_tensor_limits_and_dtype():
    """KVW-STATE-2: a tensor over 2^32 bytes is LIMIT_EXCEEDED; an unknown dtype code ENUM_OUT_OF_RANGE."""
    big = state_header(state_tensors=(StateTensor("a", (1 << 16, 1 << 15)),))  # 2^31 f32 elements
    forge.expect(forge.wrap_header(forge.header_of(big)), kvwire.LimitError, "LIMIT_EXCEEDED", "KVW-LIM-4")
    hb = forge.header_of(state_header(state_tensors=(StateTensor("a", (1,), "u8"),)))
    code = R.DTYPES["u8"][0]
    st_tbl = forge.root_table(hb).table(6).tables(2, 8)[1].tables(10, 8)[0]
    hb = forge.patch(hb, forge.field_pos(st_tbl, 2, 1), "B", 200)
    assert code != 200
    forge.expect(forge.wrap_header(hb), SchemaError, "ENUM_OUT_OF_RANGE", "KVW-HDR-10")


def test_state3_state_tensors_only_on_state_layers():
    """KVW-STATE-3: another kind with state tensors is STATE_INVALID."""
    h = state_cache(0).header
    bad = h.replace(arch=kvwire.Architecture((dataclasses.replace(FULL, state_tensors=SSM.state_tensors), SSM)))
    forge.expect(forge.wrap_header(forge.header_of(bad)), SchemaError, "STATE_INVALID", "KVW-STATE-3")


def test_state4_state_layer_covers_every_token():
    """KVW-STATE-4: a state layer's range is [0, token_count)."""
    h = state_cache(8).header
    bad = h.replace(layer_tokens=(kvwire.TokenRange(0, 8), kvwire.TokenRange(2, 6), kvwire.TokenRange(0, 8)))
    forge.expect(forge.wrap_header(forge.header_of(bad)), SchemaError, "TOKEN_RANGE_INVALID", "KVW-STATE-4")


def test_state5_no_shared_layer_over_a_state_layer():
    h = state_cache(0).header
    bad = h.replace(arch=kvwire.Architecture((SSM, LayerSpec("shared", source_layer=0))),
                    layer_tokens=(kvwire.TokenRange(0, 0), kvwire.TokenRange(0, 0)))
    forge.expect(forge.wrap_header(forge.header_of(bad)), SchemaError, "STATE_INVALID", "KVW-STATE-5")


def test_state1_state_kind_needs_its_feature_bit():
    """KVW-STATE-1 (KVW-EVOL-9): without required bit 2 the kind is out of range."""
    bad = state_cache(0).header.replace(required_features=0)
    forge.expect(forge.wrap_header(forge.header_of(bad)), SchemaError, "ENUM_OUT_OF_RANGE", "KVW-HDR-10")


@pytest.mark.parametrize("field, value, exc, code, rule", [
    ("token_start", 1, LayoutError, "CHUNK_BOUNDARY", "KVW-CHUNK-2"),
    ("token_count", 4, LayoutError, "CHUNK_BOUNDARY", "KVW-CHUNK-2"),
    ("head_start", 2, LayoutError, "HEAD_RANGE", "KVW-CHUNK-3"),
    ("head_count", 2, LayoutError, "HEAD_RANGE", "KVW-CHUNK-3"),
    ("raw_length", 32, LayoutError, "LENGTH_MISMATCH", "KVW-CHUNK-4"),
])
def test_state7_state_records(field, value, exc, code, rule):
    """KVW-STATE-7: a state record spans [0, T), names a tensor with head_start, and has the tensor's length."""
    data = kvwire.encode(state_cache())
    i = next(i for i, r in enumerate(forge.split(data).records) if r["component"] == R.COMPONENTS["state"])
    forge.expect(forge.rebuild(data, edit=forge.set_records(**{field: (i, value)})), exc, code, rule)


def test_state7_two_records_for_one_state_tensor():
    twin = LayerSpec("state", state_tensors=(StateTensor("a", (3,)), StateTensor("b", (3,))))
    data = kvwire.encode(state_cache(layers=(twin,)))
    forge.expect(forge.rebuild(data, edit=forge.set_records(head_start=(1, 0))), LayoutError, "CHUNK_DUPLICATE",
                 "KVW-CHUNK-8")


def test_state8_state_chunks_are_raw_or_zstd_without_a_codec_spec():
    """KVW-STATE-8: a state chunk through a (lossless, otherwise valid) byte-plane codec spec is STATE_INVALID."""
    from kvwire.format.codec_specs import CodecSpec

    c = state_cache()
    h = c.header.replace(required_features=STATE_BIT | R.REQUIRED_FEATURES["codec_specs"],
                         codec_specs=(CodecSpec("byteplane_zstd"),))
    with kvwire.open(kvwire.encode(c)) as r:
        recs = np.array(r.records).copy()
    i = int(np.flatnonzero(recs["component"] == R.COMPONENTS["state"])[0])
    check_record_fields(h, ChunkTable.of(h), recs)  # valid as written
    recs[i]["codec"], recs[i]["reserved0"] = R.CODECS["byteplane_zstd"], 1
    with forge.raises_code(LayoutError, "STATE_INVALID", "KVW-STATE-8"):
        check_record_fields(h, ChunkTable.of(h), recs)


def test_state_cache_and_encoder_misuse():
    c = state_cache()
    with pytest.raises(ValueError):  # missing tensor
        kvwire.KVCache(c.header, [c.layers[0], {"state": {"conv": c.state(1)["conv"]}}, c.layers[2]])
    with pytest.raises(ValueError):  # wrong dtype
        kvwire.KVCache(c.header, [c.layers[0], {"state": {**c.state(1), "conv": np.zeros((1, 4, 3), np.float16)}},
                                  c.layers[2]])
    enc = kvwire.Encoder(c.header)
    enc.begin()
    for args in ((0, 0, c.state(1)["conv"]), (1, 2, c.state(1)["conv"]), (1, 1, c.state(1)["conv"])):
        with pytest.raises(ValueError):
            enc.state_chunk(*args)
    enc.state_chunk(1, 0, c.state(1)["conv"])
    with pytest.raises(ValueError):
        enc.state_chunk(1, 0, c.state(1)["conv"])


# ---------------------------------------------------------------------------------------
# Layer map (KVW-MAP-4..6)
# ---------------------------------------------------------------------------------------

def map_header(layer_map, layers=(FULL, FULL)) -> kvwire.Header:
    return kvwire.Header(kvwire.Architecture(tuple(layers)), token_count=4, dtype="f16", chunk_tokens=4,
                         layer_map=tuple(layer_map))


@pytest.mark.parametrize("layer_map", [
    [E(0, 0, "alias"), E(1, 0, "copy")],
    [E(5, 1, "copy"), E(2, 1, "alias"), E(9, 1, "alias")],
    [E(3, 0, "copy"), E(1, 0, "copy"), E(0, 0, "alias")],
], ids=["alias-before-copy", "alias-between", "owner-is-lowest-copy"])
def test_map4_alias_before_its_owner(layer_map):
    """KVW-MAP-4: every alias comes after the lowest receiver layer that copies the same transmitted layer."""
    forge.expect(forge.wrap_header(forge.header_of(map_header(layer_map))), SchemaError, "LAYER_MAP_INVALID",
                 "KVW-MAP-4")
    with pytest.raises(SchemaError):
        build_header(map_header(layer_map))


def test_map6_layer_for():
    """KVW-MAP-5, KVW-MAP-6: copy, alias (owner or shared buffer), recompute, drop, unlisted layers."""
    from kvwire.format.layermap import LayerSource as S

    shared = (FULL, FULL, LayerSpec("shared", source_layer=1))
    h = map_header([E(0, 0, "copy"), E(2, 0, "alias"), E(3, 1, "alias"), E(4, -1, "drop"), E(5, 2, "copy"),
                    E(6, 2, "alias"), E(7, -1, "recompute")], shared)
    h = parse_header(build_header(h))
    got = [kvwire.open(kvwire.encode(kvwire.KVCache(h, forge_layers(h)))).layer_for(r) for r in range(9)]
    assert got == [S(0, "copy", 0, 0), S(1, "recompute"), S(2, "alias", 0, 0), S(3, "alias", 1, -1),
                   S(4, "drop"), S(5, "copy", 1, 5), S(6, "alias", 1, 5), S(7, "recompute"), S(8, "recompute")]
    # Reader.load_mapped applies the plan: copies own their tensors, aliases share them, and
    # recompute/drop/unlisted layers get nothing
    cache = kvwire.KVCache(h, forge_layers(h))
    with kvwire.open(kvwire.encode(cache)) as r:
        layers = r.load_mapped(9)
    assert [x is None for x in layers] == [False, True, False, False, True, False, False, True, True]
    assert layers[2] is layers[0] and layers[6] is layers[5] and layers[3] is not layers[5]
    for recv, t in ((0, 0), (3, 1), (5, 1)):
        for comp, x in layers[recv].items():
            assert np.array_equal(np.asarray(x).view(np.uint8), np.asarray(cache.layers[t][comp]).view(np.uint8))
    assert not np.shares_memory(np.asarray(layers[3]["k"]), np.asarray(layers[5]["k"]))
    plain = map_header([], shared)
    from kvwire.format.layermap import layer_for

    assert [layer_for(plain, r) for r in range(3)] == [S(0, "copy", 0, 0), S(1, "copy", 1, 1), S(2, "alias", 1, 1)]
    for bad in (-1, 3):
        with pytest.raises(ValueError):
            layer_for(plain, bad)


def forge_layers(h):
    rng = np.random.default_rng(1)
    return [{c: forge.random_tensor(rng, s.shape(c, r.count), h.dtype) for c in s.components}
            for s, r in zip(h.arch.layers, h.layer_tokens)]


# ---------------------------------------------------------------------------------------
# Compatibility check (KVW-XM-*)
# ---------------------------------------------------------------------------------------

TOK, W = b"t" * 32, b"w" * 32


def ident(arch, dtype="bf16", *, tok=TOK, weights=W, layer_weights=b"", config=b""):
    return make_identity(arch, dtype, tokenizer=tok, weights=weights, config=config, layer_weights=layer_weights)


def sent(arch=None, dtype="bf16", **kw) -> kvwire.Header:
    arch = arch or kvwire.Architecture.uniform(4, 4, 8, rope=kvwire.RopeParams())
    model = kw.pop("model", None) or ident(arch)
    return kvwire.Header(arch, token_count=10, dtype=dtype, chunk_tokens=4, model=model, **kw)


def local(h: kvwire.Header, **kw) -> LocalModel:
    return LocalModel(**{"arch": h.arch, "dtype": "bf16", "identity": ident(h.arch), **kw})


def test_xm_exact_and_verdict_truth():
    """KVW-XM-2: no reason and no conversion is exact; a Verdict is false only when incompatible."""
    h = sent()
    v = kvwire.check_compatible(h, local(h))
    assert v == kvwire.Verdict("exact") and v
    assert not kvwire.Verdict("incompatible", reasons=("x",))


def test_xm1_decided_from_the_header_bytes_alone():
    """KVW-XM-1: the verdict needs only the preamble and header: every body byte may be missing."""
    h = sent()
    rng = np.random.default_rng(0)
    layers = [{c: rng.standard_normal(s.shape(c, r.count)).astype(kvwire.format.registry.DTYPES["bf16"][2])
               for c in s.components} for s, r in zip(h.arch.layers, h.layer_tokens)]
    data = kvwire.encode(kvwire.KVCache(h, layers))
    with pytest.raises(kvwire.TruncatedError) as cut:
        kvwire.probe(data[:40])
    head = data[: cut.value.needed]
    assert len(head) < len(data) // 2
    assert kvwire.check_compatible(kvwire.probe(head), local(h)) == kvwire.Verdict("exact")
    other = kvwire.check_compatible(kvwire.probe(head), local(h, identity=ident(h.arch, weights=b"o" * 32)))
    assert other.status == "incompatible" and other.reasons == ("weights: fingerprints differ",)


def test_xm3_xm4_every_identity_reason_is_reported():
    """KVW-XM-3, KVW-XM-4: tokenizer and config both reported; missing fingerprints are reasons unless waived."""
    h = sent(model=ident(kvwire.Architecture.uniform(4, 4, 8, rope=kvwire.RopeParams()), config=b"c" * 32))
    other = ident(h.arch, tok=b"u" * 32, config=b"d" * 32)
    v = kvwire.check_compatible(h, local(h, identity=other))
    assert v.status == "incompatible"
    assert sorted(r.split(":")[0] for r in v.reasons) == ["config", "tokenizer"]
    bare = h.replace(model=kvwire.ModelIdentity())
    v = kvwire.check_compatible(bare, local(h))
    assert [r.split(":")[0] for r in v.reasons] == ["tokenizer", "compat"]
    assert kvwire.check_compatible(bare, local(h, require_fingerprints=False)).status == "exact"
    unknown = dataclasses.replace(h.model, fingerprint_scheme=9)
    assert "scheme 9" in kvwire.check_compatible(h.replace(model=unknown), local(h)).reasons[0]


def test_xm4_compute_dtype_difference():
    """KVW-XM-4: when every part agrees but the compat fingerprints differ, the compute dtype does."""
    h = sent(model=ident(kvwire.Architecture.uniform(4, 4, 8, rope=kvwire.RopeParams()), "f16"))
    v = kvwire.check_compatible(h, local(h))
    assert v.status == "incompatible" and v.reasons[0].startswith("compat:") and "dtype" in v.reasons[0]


def test_xm5_partially_equal_weights():
    """KVW-XM-5: differing upper layers are recomputed; a difference from layer 0 is a reason."""
    h0 = sent()
    chain = lambda *same: b"".join((b"a" if s else b"b") * 32 for s in same)
    h = sent(model=ident(h0.arch, weights=b"x" * 32, layer_weights=chain(1, 1, 1, 1)))
    mine = lambda *same, **kw: local(h, identity=ident(h.arch, layer_weights=chain(*same)), **kw)
    assert kvwire.check_compatible(h, mine(1, 1, 0, 0)) == kvwire.Verdict("convertible", ("recompute layers 2..3",))
    assert kvwire.check_compatible(h, mine(1, 1, 1, 1)).conversions[0].startswith("reuse all layers")
    assert kvwire.check_compatible(h, mine(0, 1, 1, 1)).reasons == (
        "weights: differ from layer 0 on (layers 0..3 not reusable)",)
    assert kvwire.check_compatible(h, mine(1, 0, 0, 0, allow_recompute=False)).status == "incompatible"
    assert kvwire.check_compatible(h, local(h)).reasons == ("weights: fingerprints differ",)  # no per-layer list


def test_xm6_every_layer_difference_is_a_reason():
    """KVW-XM-6: layer count, keys_post_rope, each LayerSpec field and the RoPE in effect."""
    h = sent()
    mine = kvwire.Architecture((LayerSpec("full_attention", 2, 8, 8),
                                LayerSpec("sliding_attention", 4, 8, 8, window=8),
                                LayerSpec("full_attention", 4, 8, 8, rope=kvwire.RopeParams(theta=5e5)),
                                LayerSpec("full_attention", 4, 8, 8, uses_rope=False)),
                               rope=kvwire.RopeParams(), keys_post_rope=False)
    v = kvwire.check_compatible(h, local(h, arch=mine, identity=h.model))
    assert [r for r in v.reasons if r.startswith(("layer", "arch"))] == [
        "arch: keys_post_rope True != False", "layer 0: num_kv_heads 4 != 2",
        "layer 1: kind 'full_attention' != 'sliding_attention'", "layer 1: window 0 != 8",
        "layer 2: rope parameters differ", "layer 3: uses_rope True != False", "layer 3: rope parameters differ"]
    short = kvwire.check_compatible(h, local(h, arch=kvwire.Architecture.uniform(3, 4, 8), identity=h.model))
    assert "arch: 4 layers, receiver has 3" in short.reasons
    unknown = kvwire.check_compatible(h.replace(arch=kvwire.Architecture.uniform(4, 4, 8)), local(h, identity=h.model))
    assert "layer 0: rope parameters unknown on one side" in unknown.reasons


def test_xm6_layer_map_path():
    """KVW-XM-6: with a map the mapped layers' geometry is compared, and the weights still are:
    without per-layer chains whole models; other weights only with accept_foreign_weights."""
    sender = kvwire.Architecture((FULL, LayerSpec("sliding_attention", 2, 8, 8, window=4)))
    h = kvwire.Header(sender, token_count=4, dtype="bf16", chunk_tokens=4, model=ident(sender, weights=b"s" * 32),
                      layer_map=(E(0, 0, "copy"), E(1, 0, "alias"), E(2, -1, "recompute"), E(3, 1, "copy")))
    recv = kvwire.Architecture((FULL, FULL, FULL, LayerSpec("sliding_attention", 2, 8, 8, window=4)))
    me = LocalModel(recv, "bf16", ident(recv, weights=b"s" * 32))  # same weights, another layer structure
    assert kvwire.check_compatible(h, me) == kvwire.Verdict("convertible", ("layer map: alias 1, copy 2, recompute 1",))
    other = dataclasses.replace(me, identity=ident(recv, weights=b"r" * 32))
    assert kvwire.check_compatible(h, other) == kvwire.Verdict(
        "incompatible", ("layer map: alias 1, copy 2, recompute 1",), ("weights: fingerprints differ",))
    assert kvwire.check_compatible(h, dataclasses.replace(other, accept_foreign_weights=True)) == kvwire.Verdict(
        "convertible", ("foreign layers: weights: fingerprints differ", "layer map: alias 1, copy 2, recompute 1"))
    bad = LocalModel(kvwire.Architecture((FULL, FULL, FULL, FULL)), "bf16",
                     ident(recv, tok=b"x" * 32, weights=b"s" * 32),
                     accept_layer_map=True)
    v = kvwire.check_compatible(h, bad)
    assert v.reasons == ("tokenizer: fingerprints differ",
                         "layer 3: from transmitted layer 1: kind 'sliding_attention' != 'full_attention'",
                         "layer 3: from transmitted layer 1: window 4 != 0")
    # KVW-MAP-7: a receiver with fewer layers than an entry's receiver_layer refuses the map
    few = kvwire.check_compatible(h, LocalModel(kvwire.Architecture((FULL, FULL)), "bf16", me.identity))
    assert "layer map: entry for receiver layer 3, the receiver has 2 layers" in few.reasons
    assert kvwire.check_compatible(h, dataclasses.replace(me, accept_layer_map=False)).reasons == (
        "layer map: the receiver does not apply layer maps",)


def test_xm6_layer_map_compares_per_layer_chains():
    """KVW-XM-6: with a map and per-layer chains on both sides, each copy/alias entry compares the
    sender's chain entry of its transmitted layer with the receiver's of the layer it fills (both
    resolved through shared layers): a same-model cache with aliases or recomputed layers is
    accepted, one from other weights is not, unless the receiver accepts foreign weights."""
    chain = lambda *tags: b"".join(bytes([t]) * 32 for t in tags)
    shared = kvwire.Architecture((FULL, FULL, LayerSpec("shared", source_layer=1), FULL))
    h = kvwire.Header(shared, token_count=4, dtype="bf16", chunk_tokens=4,
                      model=ident(shared, layer_weights=chain(1, 2, 2, 3)),
                      layer_map=(E(0, 0, "copy"), E(1, 1, "copy"), E(2, 1, "alias"), E(3, -1, "recompute")))
    me = LocalModel(shared, "bf16", ident(shared, weights=b"v" * 32, layer_weights=chain(1, 2, 2, 9)))
    # the whole models differ (top layer 3) but every mapped layer's chain agrees; layer 3 is recomputed
    assert kvwire.check_compatible(h, me) == kvwire.Verdict("convertible", ("layer map: alias 1, copy 2, recompute 1",))
    seed = dataclasses.replace(me, identity=ident(shared, weights=b"v" * 32, layer_weights=chain(5, 6, 6, 7)))
    v = kvwire.check_compatible(h, seed)
    assert v.reasons == ("weights: mapped layers computed by other weights (receiver<-transmitted 0<-0, 1<-1, 2<-1)",)
    fine_tuned = dataclasses.replace(me, identity=ident(shared, weights=b"v" * 32, layer_weights=chain(1, 4, 4, 9)))
    assert kvwire.check_compatible(h, fine_tuned).reasons == (
        "weights: mapped layers computed by other weights (receiver<-transmitted 1<-1, 2<-1)",)
    assert kvwire.check_compatible(h, dataclasses.replace(seed, accept_foreign_weights=True)).conversions == (
        "foreign layers: weights: mapped layers computed by other weights (receiver<-transmitted 0<-0, 1<-1, 2<-1)",
        "layer map: alias 1, copy 2, recompute 1")
    # a differing config is a reason too; a tokenizer difference is never a conversion
    conf = dataclasses.replace(me, identity=ident(shared, weights=b"v" * 32, layer_weights=chain(1, 2, 2, 9),
                                                  config=b"c" * 32))
    h_conf = h.replace(model=ident(shared, layer_weights=chain(1, 2, 2, 3), config=b"d" * 32))
    assert kvwire.check_compatible(h_conf, conf).reasons == ("config: fingerprints differ",)
    tok = dataclasses.replace(me, identity=ident(shared, tok=b"x" * 32, layer_weights=chain(1, 2, 2, 3)),
                              accept_foreign_weights=True)
    assert kvwire.check_compatible(h, tok).reasons == ("tokenizer: fingerprints differ",)
    # chains of the wrong length on one side: the whole models are compared, as without a map
    short = dataclasses.replace(me, identity=ident(shared, weights=b"v" * 32, layer_weights=chain(1, 2)))
    assert kvwire.check_compatible(h, short).reasons == ("weights: fingerprints differ",)


def test_xm7_soft_tier_conversions():
    """KVW-XM-7: cast, rechunk, head shard and layout are conversions when supported, reasons otherwise."""
    h = sent(dtype="f32", engine_layout=kvwire.EngineLayout("vllm.flash_nhd"))
    v = kvwire.check_compatible(h, local(h, accept_casts=frozenset({"f32"}), chunk_tokens=16, head_range=(2, 4),
                                         layout="sglang.mha"))
    assert v == kvwire.Verdict("convertible", ("cast f32->bf16", "rechunk 4->16", "select heads 2..3",
                                               "permute layout vllm.flash_nhd->sglang.mha"))
    v = kvwire.check_compatible(h, local(h, head_range=(2, 6)))
    assert v.status == "incompatible" and [r.split(":")[0] for r in v.reasons] == ["dtype", "heads"]
    assert kvwire.check_compatible(h.replace(dtype="bf16"), local(h, head_range=(0, 4))).status == "exact"


def test_xm8_retained_tokens():
    """KVW-XM-8: sliding layers need the last window-1 tokens, chunked layers their current chunk."""
    arch = kvwire.Architecture((LayerSpec("sliding_attention", 1, 4, 4, window=4),
                                LayerSpec("chunked_attention", 1, 4, 4, window=4), FULL), rope=kvwire.RopeParams())
    ranges = (kvwire.TokenRange(7, 3), kvwire.TokenRange(8, 2), kvwire.TokenRange(0, 10))
    h = sent(arch, layer_tokens=ranges, model=ident(arch))
    assert kvwire.check_compatible(h, local(h)).status == "exact"
    short = h.replace(layer_tokens=(kvwire.TokenRange(8, 2), kvwire.TokenRange(9, 1), kvwire.TokenRange(1, 9)))
    assert kvwire.check_compatible(short, local(h)).reasons == (
        "layer 0: holds tokens [8, 10), the receiver needs [7, 10)",
        "layer 1: holds tokens [9, 10), the receiver needs [8, 10)",
        "layer 2: holds tokens [1, 10), the receiver needs [0, 10)")
    # from position 1 the next token is position 11, whose attention chunk [8, 12) starts at cache token 7
    assert "layer 1: holds tokens [8, 10), the receiver needs [7, 10)" in \
        kvwire.check_compatible(h, local(h, first_position=1)).reasons


def test_xm9_shifting_positions():
    """KVW-XM-9: default/linear/llama3/yarn keys re-rotate (yarn needs its parameters in range,
    KVW-ROPE-3); dynamic, longrope, unknown and state layers do not."""
    h = sent()
    assert kvwire.check_compatible(h, local(h, first_position=5)).conversions == ("shift positions by +5",)
    for rope, ok in ((kvwire.RopeParams("dynamic"), False), (kvwire.RopeParams("yarn", factor=4.0), False),
                     (kvwire.RopeParams("yarn", factor=4.0, original_max_position_embeddings=64), True),
                     (None, False)):
        arch = kvwire.Architecture.uniform(2, 4, 8, rope=rope)
        g = sent(arch, model=ident(arch))
        assert bool(kvwire.check_compatible(g, local(g, first_position=3))) is ok, rope
    nope = kvwire.Architecture.uniform(2, 4, 8)  # rope unknown, but keys stored before rotation
    pre = dataclasses.replace(nope, keys_post_rope=False)
    g = sent(pre, model=ident(pre))
    assert kvwire.check_compatible(g, local(g, first_position=3)).conversions == ("shift positions by +3",)
    s = state_cache(10).header
    s = s.replace(model=ident(s.arch, "f16"))
    v = kvwire.check_compatible(s, LocalModel(s.arch, "f16", s.model, first_position=1, require_fingerprints=False))
    assert any(r.startswith("layer 1: a state layer") for r in v.reasons)


ROPES = {"default": kvwire.RopeParams(),
         "yarn": kvwire.RopeParams("yarn", factor=4.0, original_max_position_embeddings=64),
         "yarn-no-L": kvwire.RopeParams("yarn", factor=4.0), "dynamic": kvwire.RopeParams("dynamic", factor=2.0),
         "none": kvwire.RopeParams("none"), "odd-rotary": kvwire.RopeParams(rotary_dim=7), "unknown": None}


@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("uses_rope, post, target", [(True, True, 3), (False, True, 3), (True, False, 3),
                                                     (True, True, -1), (True, True, 0)])
def test_xm9_shift_verdict_agrees_with_rope_shift(rope, uses_rope, post, target):
    """KVW-XM-9, KVW-ROPE-6: "shift positions" is promised exactly when kvwire.model.rope.shift moves the
    cache; every refusal of shift (no RoPE anywhere, as gpt2's absolute positions; unknown or
    length-dependent RoPE; parameters out of range; a negative position) is a reason."""
    from kvwire.model.rope import RepositionError, shift

    arch = kvwire.Architecture((LayerSpec("full_attention", 1, 8, 8, uses_rope=uses_rope),) * 2, rope=ROPES[rope],
                               keys_post_rope=post)
    h = kvwire.Header(arch, token_count=3, dtype="f32", chunk_tokens=4, model=ident(arch, "f32"))
    cache = kvwire.KVCache(h, [{"k": np.ones((1, 3, 8), np.float32), "v": np.ones((1, 3, 8), np.float32)}] * 2)
    v = kvwire.check_compatible(h, LocalModel(arch, "f32", h.model, first_position=target))
    try:
        moved = shift(cache, target)
    except RepositionError as exc:
        assert not v and v.reasons and all(r.startswith(("positions:", "layer ")) for r in v.reasons), (v, exc)
        return
    assert v.status == ("exact" if target == 0 else "convertible")
    assert v.conversions == (() if target == 0 else (f"shift positions by +{target}",))
    assert moved.header.first_position == target


# ---------------------------------------------------------------------------------------
# Architecture families (spec/crossmodel.md section 2)
# ---------------------------------------------------------------------------------------

FAMILIES = {
    "mha-gpt2": (LayerSpec("full_attention", 4, 16, 16, uses_rope=False),) * 2,
    "gqa-llama": (LayerSpec("full_attention", 2, 16, 16),) * 2,
    "mqa-falcon": (LayerSpec("full_attention", 1, 16, 16),) * 2,
    "mla-latent": (LayerSpec("mla_latent", 1, 24, 0, kv_lora_rank=16, qk_rope_head_dim=8),) * 2,
    "mla-expanded": (LayerSpec("full_attention", 4, 24, 16),) * 2,
    "sliding-gemma3": (LayerSpec("sliding_attention", 2, 16, 16, window=8),) * 5
    + (LayerSpec("full_attention", 2, 16, 16),),
    "chunked-nope-llama4": (LayerSpec("chunked_attention", 2, 16, 16, window=8),) * 3
    + (LayerSpec("full_attention", 2, 16, 16, uses_rope=False),),
    "shared-gemma3n": (LayerSpec("sliding_attention", 2, 16, 16, window=8), LayerSpec("full_attention", 2, 16, 16),
                       LayerSpec("shared", source_layer=0), LayerSpec("shared", source_layer=1)),
    "hybrid-jamba": (SSM, LayerSpec("full_attention", 2, 16, 16), SSM),
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_architecture_families_round_trip_and_match_themselves(name):
    """Each family of spec/crossmodel.md section 2: a valid header, a bit-exact round trip, exact for itself."""
    layers = FAMILIES[name]
    arch = kvwire.Architecture(layers, rope=kvwire.RopeParams(theta=1e6))
    tokens = 12
    ranges = tuple(kvwire.TokenRange(0, 0) if s.kind == "shared" else kvwire.TokenRange(5, 7)
                   if s.kind == "sliding_attention" else kvwire.TokenRange(8, 4) if s.kind == "chunked_attention"
                   else kvwire.TokenRange(0, tokens) for s in layers)
    bit = STATE_BIT if any(s.kind == "state" for s in layers) else 0
    h = kvwire.Header(arch, token_count=tokens, dtype="bf16", chunk_tokens=4, layer_tokens=ranges,
                      model=ident(arch), required_features=bit)
    rng = np.random.default_rng(2)
    tensors = [{"state": {t.name: forge.random_tensor(rng, t.shape, t.dtype) for t in s.state_tensors}}
               if s.kind == "state" else
               {c: forge.random_tensor(rng, s.shape(c, r.count), "bf16") for c in s.components}
               for s, r in zip(layers, ranges)]
    c = kvwire.KVCache(h, tensors)
    back = forge.read_all(kvwire.encode(c, codec="zstd"))
    assert back.equal(c)
    assert kvwire.check_compatible(back.header, LocalModel(arch, "bf16", ident(arch))).status == "exact"


@pytest.mark.slow
def test_writer_refuses_a_header_its_own_reader_rejects_for_complexity():
    """KVW-WRITE-1 with KVW-HDR-8/LIM-7: 4,096 distinct state layers of 16 state tensors each
    pass check_header but take over 65,536 table visits to read; the Encoder parses what it
    built and refuses it (FB_TOO_COMPLEX) instead of writing a container no reader accepts."""
    layers = tuple(LayerSpec("state", state_tensors=tuple(StateTensor(f"t{j}", (1, i + 1)) for j in range(16)))
                   for i in range(4096))
    h = kvwire.Header(arch=kvwire.Architecture(layers), token_count=1, dtype="f32")
    with pytest.raises(ValueError, match="readers would reject this header .*FB_TOO_COMPLEX"):
        kvwire.Encoder(h)
    small = kvwire.Header(arch=kvwire.Architecture(layers[:8]), token_count=1, dtype="f32")
    assert kvwire.Encoder(small).header.num_layers == 8
