"""Sparse (evicted) caches: spec/sparse.md. Every test names the rule it covers."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import codec_reference as ref
import forge
import kvwire
from kvwire import CodecSpec, codecs
from kvwire.cache.sparse import SparseKVCache, decode_positions, encode_positions
from kvwire.cache.tensors import as_numpy, as_uint
from kvwire.format import chunks
from kvwire.format import registry as R
from kvwire.format.errors import CodecError, FeatureError, LayoutError, SchemaError
from kvwire.format.header import Architecture, Header, LayerSpec, TokenRange
from kvwire.format.sparse import (
    SPARSE_BIT,
    SparseInfo,
    SparseTable,
    check_sparse,
    check_sparse_records,
    planned_sparse_chunks,
)

# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------


def sparse_cache(layers=2, heads=3, tokens=40, *, density=0.3, seed=0, chunk_tokens=4, dtype="f16"):
    dense = forge.small_cache(layers=layers, heads=heads, tokens=tokens, seed=seed, dtype=dtype,
                              chunk_tokens=chunk_tokens)
    rng = np.random.default_rng(seed)
    mask = [rng.random((heads, tokens)) < density for _ in range(layers)]
    return SparseKVCache.from_mask(dense, mask)


def stream_events(data):
    dec = kvwire.StreamDecoder()
    dec.feed(bytes(data))
    events = list(dec.events())
    dec.close()
    return events


def from_events(header, events) -> SparseKVCache:
    """Reassemble a sparse cache from StreamDecoder events (any chunk order)."""
    layers = []
    for _spec, heads in zip(header.arch.layers, _empty_like(header)):
        layers.append(heads)
    for ev in events:
        if isinstance(ev, kvwire.ChunkEvent):
            dst = layers[ev.layer][ev.head_start][ev.component]
            n = len(ev.data) if ev.component == "positions" else ev.data.shape[1]
            dst[ev.token_start : ev.token_start + n] = ev.data if ev.component == "positions" else ev.data[0]
    return SparseKVCache(header, layers)


_empty_like = ref._zeros_like_sparse


def stream_expect(data, cls, code, rule=None):
    with forge.raises_code(cls, code, rule):
        stream_events(data)


def positions_record(parts, layer=0, head=0, cell=0, C=4):
    recs = parts.records
    hit = np.flatnonzero((recs["component"] == R.COMPONENTS["positions"]) & (recs["layer"] == layer)
                         & (recs["head_start"] == head) & (recs["token_start"] == cell * C))
    return int(hit[0])


def with_positions_body(data, body: bytes, *, layer=0, head=0, cell=0, C=4, raw_length=None):
    """The container with one raw POSITIONS body replaced (every checksum fixed)."""
    p = forge.split(data)
    i = positions_record(p, layer, head, cell, C)
    assert p.records[i]["codec"] == R.CODECS["raw"]
    p.bodies[i] = body
    p.records[i]["raw_length"] = len(body) if raw_length is None else raw_length
    return forge.assemble(p)


def header_container(h: Header) -> bytes:
    """A zero-chunk container around ``h`` as written without the writer's checks."""
    return forge.wrap_header(forge.header_of(h))


# ---------------------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=st.integers(1, 3), heads=st.integers(1, 3), tokens=st.integers(1, 30), density=st.floats(0, 1),
       chunk_tokens=st.integers(1, 9), codec=st.sampled_from(["raw", "zstd"]), form=st.sampled_from(["file", "stream"]),
       first_position=st.integers(0, 1 << 40), extra=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_sparse_round_trip_is_exact(layers, heads, tokens, density, chunk_tokens, codec, form, first_position, extra,
                                    seed):
    """KVW-SPARSE-7/8/10/11: any per-(layer, head) subsets round-trip bit for bit through the
    random-access reader and the sequential StreamDecoder, in both forms and both codecs."""
    dense = forge.small_cache(layers=layers, heads=heads, tokens=tokens, seed=seed, chunk_tokens=chunk_tokens,
                              first_position=first_position)
    rng = np.random.default_rng(seed)
    mask = [rng.random((heads, tokens)) < density for _ in range(layers)]
    s = SparseKVCache.from_mask(dense, mask, next_position=first_position + tokens + extra)
    data = kvwire.encode(s, codec=codec, form=form)
    with kvwire.open(data) as r:
        r.validate()
        back = r.load()
    assert back.equal(s)
    assert from_events(s.header, stream_events(data)).equal(s)
    for i, m in enumerate(mask):
        for h in range(heads):
            assert list(s.positions(i, h)) == list(np.flatnonzero(m[h]) + first_position)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, (1 << 63) - 2), min_size=1, max_size=60, unique=True), st.integers(0, 1 << 20))
def test_positions_varints_round_trip(values, first):
    """KVW-SPARSE-10/11: delta + LEB128 encoding decodes to the same positions; every varint
    is minimal (at most 9 bytes, no zero final group)."""
    kept = [v + first for v in sorted(values) if v + first < (1 << 63) - 1]
    if not kept:
        return
    p = np.array(kept, np.int64)
    body = encode_positions(p, first)
    assert len(p) <= len(body) <= 9 * len(p)
    assert list(decode_positions(body, len(p), first, int(p[-1]) + 1)) == list(p)


def test_positions_spec_examples():
    """KVW-SPARSE-10: the byte examples of spec/sparse.md section 4.1."""
    assert encode_positions([0, 1, 2, 3, 1000, 1001], 0) == bytes.fromhex("00000000e40700")
    assert encode_positions([4096, 4100], 4096) == bytes.fromhex("0003")
    assert encode_positions([70000], 0) == bytes.fromhex("f0a204")
    assert list(decode_positions(bytes.fromhex("00000000e40700"), 6, 0, 1002)) == [0, 1, 2, 3, 1000, 1001]


def test_slot_order_matches_the_spec_example():
    """KVW-SPARSE-7: layer, component, head, cell; one head per chunk; the spec's example
    (C = 4, two heads retaining 6 and 3 tokens) has 9 chunks and token_count 6."""
    dense = forge.small_cache(layers=1, heads=2, tokens=8, chunk_tokens=4)
    mask = [np.array([[1, 1, 1, 1, 1, 1, 0, 0], [0, 1, 0, 1, 0, 1, 0, 0]], bool)]
    s = SparseKVCache.from_mask(dense, mask)
    assert s.header.token_count == 6 and s.header.sparse.retained_counts == (6, 3)
    with kvwire.open(kvwire.encode(s)) as r:
        got = [(R.COMPONENT_BY_CODE[c], int(h), int(n), int(t)) for c, h, n, t in
               zip(r.records["component"], r.records["head_start"], r.records["head_count"], r.records["token_start"])]
        assert r.num_chunks(0, "k") == 3
        assert list(r.chunk(0, "positions", 2)) == [1, 3, 5]
        assert r.chunk(0, "v", 1).shape == (1, 2, 8)
    assert got == [(c, h, 1, t) for c in ("k", "v", "positions") for h, t in ((0, 0), (0, 4), (1, 0))]
    assert SparseTable.of(s.header).total == 9


def test_streaming_llm_constructor():
    """KVW-SPARSE-13/14: StreamingLLM keeps sinks + window in every head; next_position is
    the sequence length, not the retained count."""
    dense = forge.small_cache(layers=2, heads=2, tokens=50, first_position=100)
    s = SparseKVCache.streaming(dense, 4, 10)
    info = s.header.sparse
    assert (info.method, info.sink_tokens, info.window_tokens, info.next_position) == ("streaming_llm", 4, 10, 150)
    assert s.header.token_count == 14 and s.header.required_features & SPARSE_BIT
    want = list(range(100, 104)) + list(range(140, 150))
    assert all(list(s.positions(i, h)) == want for i in range(2) for h in range(2))
    k = dense.layers[1]["k"]
    assert np.array_equal(s.layers[1][1]["k"].view(np.uint16), k[1, [0, 1, 2, 3, *range(40, 50)]].view(np.uint16))
    assert kvwire.load(kvwire.encode(s, codec="zstd")).equal(s)


def mla_shared_full(rng, *, tokens: int, chunk_tokens: int, keep: float) -> SparseKVCache:
    """An MLA layer, a layer sharing it and a full-attention layer (bf16), each head keeping
    a random ``keep`` share of the tokens."""
    arch = Architecture((LayerSpec("mla_latent", 1, 12, 0, kv_lora_rank=8, qk_rope_head_dim=4),
                         LayerSpec("shared", source_layer=0), LayerSpec("full_attention", 2, 4, 6)))
    h = Header(arch=arch, token_count=tokens, dtype="bf16", chunk_tokens=chunk_tokens)
    layers = [{"latent": forge.random_tensor(rng, (1, tokens, 12), "bf16")}, {},
              {"k": forge.random_tensor(rng, (2, tokens, 4), "bf16"),
               "v": forge.random_tensor(rng, (2, tokens, 6), "bf16")}]
    return SparseKVCache.from_mask(kvwire.KVCache(h, layers),
                                   [rng.random((1, tokens)) < keep, None, rng.random((2, tokens)) < keep])


def test_mla_and_shared_layers():
    """KVW-SPARSE-2/3/6: an MLA layer has one head (LATENT + POSITIONS), a shared layer none."""
    s = mla_shared_full(np.random.default_rng(3), tokens=9, chunk_tokens=4, keep=0.5)
    assert len(s.header.sparse.retained_counts) == 3 and s.layers[1] == []
    for form in ("file", "stream"):
        data = kvwire.encode(s, form=form, codec="zstd")
        assert forge.read_all(data).equal(s)
        assert from_events(s.header, stream_events(data)).equal(s)


def test_heads_may_retain_nothing():
    """KVW-SPARSE-7: a head with count 0 has no chunks; token_count is the largest count."""
    dense = forge.small_cache(layers=1, heads=3, tokens=10)
    s = SparseKVCache.from_mask(dense, [np.array([[0] * 10, [1] * 10, [0, 1] * 5], bool)])
    data = kvwire.encode(s)
    assert forge.read_all(data).equal(s) and s.header.token_count == 10
    assert kvwire.open(data).chunk_count == 3 * (0 + 1 + 1)


# ---------------------------------------------------------------------------------------
# codec specs on sparse K/V chunks (spec/codecs.md, KVW-SPARSE-15, KVW-CSPEC-8)
# ---------------------------------------------------------------------------------------

LOSSLESS_CHOICES = ["byteplane", CodecSpec("byteplane_zstd")]
LOSSY_CHOICES = ["int8", "int8-asym", "int4-g32-zstd", "kivi2", "kivi4", "fp8-e4m3", "fp8-e4m3-token", "fp8-e5m2",
                 "fp8-e4m3fnuz", CodecSpec("fp8", scale_granularity="tensor", lossless="byteplane_zstd")]

windowed_specs = st.builds(
    lambda codec, bits, G, axis, sym, gran, sink, resid: (
        CodecSpec("int_affine", bits=bits, group_size=G, group_axis=axis, symmetric=sym, sink_tokens=sink,
                  residual_tokens=resid) if codec == "int_affine" else
        CodecSpec("fp8", scale_granularity=gran, sink_tokens=sink, residual_tokens=resid)),
    st.sampled_from(["int_affine", "fp8"]), st.sampled_from([2, 4, 8]), st.integers(1, 9),
    st.sampled_from(["tokens", "channels"]), st.booleans(), st.sampled_from(["tensor", "head", "token"]),
    st.integers(0, 6), st.integers(0, 12))


sparse_reference = ref.decode_sparse_container


def assert_every_read_path(data, want: SparseKVCache) -> None:
    """Reader.load, Reader.sparse_layer, Reader.chunk and StreamDecoder events (both
    forms) all decode to ``want``, bit for bit."""
    with kvwire.open(data) as r:
        r.validate()
        assert r.load().equal(want)
        h = r.header
        for layer in range(h.num_layers):
            got = SparseKVCache(h, [r.sparse_layer(i) if i == layer else want.layers[i] for i in range(h.num_layers)])
            assert got.equal(want)
        for layer, comp, t0, _, hd in planned_sparse_chunks(h):
            if comp == "positions":
                continue
            index = int(r.grid.head_base[int(r.grid.offsets[layer]) + hd]) + t0 // h.chunk_tokens
            x = r.chunk(layer, comp, index)
            n = x.shape[1]
            assert x.shape[0] == 1
            assert x[0].tobytes() == as_numpy(want.layers[layer][hd][comp])[t0 : t0 + n].tobytes()
    assert from_events(want.header, stream_events(data)).equal(want)


def _same_tensors(a: SparseKVCache, b: SparseKVCache) -> bool:
    return all(as_numpy(x[c]).tobytes() == as_numpy(y[c]).tobytes()
               for p, q in zip(a.layers, b.layers) for x, y in zip(p, q) for c in x)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(heads=st.integers(1, 3), tokens=st.integers(1, 40), density=st.floats(0, 1), chunk_tokens=st.integers(1, 12),
       codec=st.one_of(st.sampled_from(LOSSLESS_CHOICES + LOSSY_CHOICES), windowed_specs),
       dtype=st.sampled_from(["bf16", "f16", "f32"]), form=st.sampled_from(["file", "stream"]),
       seed=st.integers(0, 2**16))
def test_sparse_codec_specs_round_trip(heads, tokens, density, chunk_tokens, codec, dtype, form, seed):
    """KVW-SPARSE-9/15, KVW-CSPEC-8: every codec of the dense path encodes sparse K/V
    chunks; lossless pipelines round-trip exactly, lossy ones decode (on every read path)
    to the literal reference decoder's bytes with H = 1 and sink/residual tokens counted in
    the head's retained index space, whose kept rows are exact; POSITIONS stay raw/zstd."""
    dense = forge.small_cache(layers=2, heads=heads, tokens=tokens, seed=seed, dtype=dtype, chunk_tokens=chunk_tokens,
                              head_dim=8, head_dim_v=12)
    rng = np.random.default_rng(seed)
    s = SparseKVCache.from_mask(dense, [rng.random((heads, tokens)) < density for _ in range(2)])
    data = kvwire.encode(s, codec=codec, form=form)
    with kvwire.open(data) as r:
        recs, h = r.records, r.header
    pos = recs["component"] == R.COMPONENTS["positions"]
    assert (recs["reserved0"][pos] == 0).all() and np.isin(recs["codec"][pos], [0, 1]).all()  # KVW-SPARSE-9
    want = sparse_reference(data)
    assert want.header == h
    lossless = codec in LOSSLESS_CHOICES
    assert not lossless or _same_tensors(want, s)
    assert_every_read_path(data, want)
    spec = codecs.resolve(codec, "k")
    if not lossless and (spec.sink_tokens or spec.residual_tokens):  # KVW-CSPEC-8: kept rows are exact
        for i in range(2):
            for hd in range(heads):
                n = len(s.positions(i, hd))
                keep = [t for t in range(n) if t < spec.sink_tokens or t >= n - spec.residual_tokens]
                for comp in ("k", "v"):
                    a, b = as_uint(want.layers[i][hd][comp]), as_uint(s.layers[i][hd][comp])
                    assert a[keep].tobytes() == b[keep].tobytes()


def test_sparse_lossy_codecs_on_mla_and_shared_layers():
    """KVW-SPARSE-15: LATENT chunks of an MLA layer (one head) take lossy pipelines too;
    a shared layer has no chunks."""
    s = mla_shared_full(np.random.default_rng(5), tokens=30, chunk_tokens=8, keep=0.6)
    for codec in ("kivi2", "fp8-e4m3"):
        data = kvwire.encode(s, codec=codec)
        with kvwire.open(data) as r:
            assert (r.records["reserved0"][r.records["component"] == R.COMPONENTS["latent"]] > 0).all()
        assert_every_read_path(data, sparse_reference(data))


def test_sparse15_fp8_head_granularity_is_one_scale_per_chunk():
    """KVW-SPARSE-15 / KVW-FP8-2: a sparse chunk has H = 1, so `head` granularity stores one
    fp32 scale for the chunk (4 + tokens x dim bytes) and decodes like `tensor`."""
    s = sparse_cache(dtype="bf16", density=0.5)
    data = kvwire.encode(s, codec="fp8-e4m3")
    with kvwire.open(data) as r:
        for i, rec in enumerate(r.records):
            if rec["reserved0"]:
                c = r.info(i)
                assert c.shape[0] == 1 and rec["stored_length"] == 4 + c.token_count * c.shape[2]
        head = r.load()
    tensor = kvwire.load(kvwire.encode(s, codec=CodecSpec("fp8", scale_granularity="tensor")))
    assert _same_tensors(head, tensor)


def test_cspec8_windows_count_in_the_heads_retained_index_space():
    """KVW-CSPEC-8: in a sparse container sink_tokens / residual_tokens are valid and count
    the first / last retained tokens of each head (not positions, not the layer's range):
    with S = 1 and R = 2 exactly those rows of every head are kept bit for bit."""
    s = sparse_cache(dtype="f16", density=0.6, tokens=30, chunk_tokens=4)
    spec = CodecSpec("int_affine", bits=2, group_size=4, sink_tokens=1, residual_tokens=2)
    data = kvwire.encode(s, codec=spec)
    back = kvwire.load(data)
    assert back.header.codec_specs == (spec,)
    for i in range(2):
        for hd in range(3):
            n = len(s.positions(i, hd))
            kept = sorted({0, n - 2, n - 1} & set(range(n)))
            a, b = as_uint(back.layers[i][hd]["k"]), as_uint(s.layers[i][hd]["k"])
            assert a[kept].tobytes() == b[kept].tobytes()
            assert n <= 3 or a.tobytes() != b.tobytes()  # the middle rows are quantized to 2 bits


def test_sparse9_writer_refuses_codec_specs_chosen_for_positions():
    """KVW-SPARSE-9: a per-chunk choice (mapping or callable) of a codec spec for POSITIONS
    is refused by the writer; a single codec for the whole cache gives POSITIONS zstd."""
    s = sparse_cache()
    for bad in ({(0, "positions"): "fp8-e4m3", None: "raw"}, {(1, "positions"): "byteplane", None: "int8"},
                lambda layer, comp, t0: "int8"):
        with pytest.raises(ValueError, match="KVW-SPARSE-9"):
            kvwire.encode(s, codec=bad)
    with pytest.raises(ValueError, match="KVW-SPARSE-9"):
        kvwire.Encoder(s.header, codec=lambda layer, comp, t0, head: CodecSpec("int_affine") if head else "zstd")
    data = kvwire.encode(s, codec=lambda layer, comp, t0: "zstd" if comp == "positions" else "int8")
    with kvwire.open(data) as r:
        kinds = {(R.COMPONENT_BY_CODE[c], int(sp) > 0) for c, sp in zip(r.records["component"], r.records["reserved0"])}
    assert kinds == {("k", True), ("v", True), ("positions", False)}


def test_sparse_callable_may_choose_per_head():
    """KVW-SPARSE-15: a callable with a ``head`` keyword chooses per (layer, component, head,
    cell); mappings by (layer, component) apply to every head."""
    s = sparse_cache(dtype="bf16", density=0.7)

    def pick(layer, comp, t0, head):
        # int8-asym: f32 scales hold this cache's tiny values (f16 scales cannot: KVW-LOSSY-5)
        return "raw" if comp == "positions" else ("int8-asym" if head == 1 else "byteplane")

    data = kvwire.encode(s, codec=pick)
    with kvwire.open(data) as r:
        h, recs = r.header, r.records
        for rec in recs:
            if rec["component"] != R.COMPONENTS["positions"] and rec["reserved0"]:
                want = "int_affine" if rec["head_start"] == 1 else "byteplane_zstd"
                assert h.codec_specs[rec["reserved0"] - 1].codec == want
        assert {int(x) for x in recs["head_start"][recs["reserved0"] > 0]} >= {1}
    assert_every_read_path(data, sparse_reference(data))
    mapped = kvwire.encode(s, codec={(0, "k"): "int8-asym", None: "raw"})
    with kvwire.open(mapped) as r:
        lossy = r.records["reserved0"] > 0
        assert set(r.records["layer"][lossy]) == {0} and set(r.records["component"][lossy]) == {R.COMPONENTS["k"]}
        assert set(r.records["head_start"][lossy]) == {0, 1, 2}


# ---------------------------------------------------------------------------------------
# header rules
# ---------------------------------------------------------------------------------------


def _hdr(**changes) -> Header:
    return replace(sparse_cache().header, **changes)


def test_sparse1_table_and_bit_agree():
    """KVW-SPARSE-1: the table without the bit, and the bit without the table."""
    h = _hdr()
    forge.expect(header_container(replace(h, required_features=0)), SchemaError, "SPARSE_INVALID", "KVW-SPARSE-1")
    dense = forge.small_cache().header
    forge.expect(header_container(replace(dense, required_features=SPARSE_BIT)), SchemaError, "SPARSE_INVALID",
                 "KVW-SPARSE-1")


def test_sparse1_reader_without_the_feature_refuses(monkeypatch):
    """KVW-SPARSE-1 / KVW-EVOL-3: a reader that does not implement `sparse` refuses the bit."""
    data = kvwire.encode(sparse_cache())
    monkeypatch.setattr(R, "KNOWN_REQUIRED_FEATURES", R.KNOWN_REQUIRED_FEATURES & ~SPARSE_BIT)
    forge.expect(data, FeatureError, "UNSUPPORTED_FEATURE", "KVW-EVOL-3")


def test_sparse2_layer_kind_must_be_sparse_capable():
    """KVW-SPARSE-2: a state layer cannot be sparse (checked by the header rules)."""
    h = _hdr()
    state = replace(h.arch.layers[0], kind="state")
    bad = replace(h, arch=replace(h.arch, layers=(h.arch.layers[0], state)))
    with forge.raises_code(SchemaError, "SPARSE_INVALID", "KVW-SPARSE-2"):
        check_sparse(bad)


@pytest.mark.parametrize("counts", [(1, 2), (1,) * 7, ()])
def test_sparse3_retained_counts_length(counts):
    """KVW-SPARSE-3: one entry per (layer, kv head)."""
    h = _hdr()
    bad = h.replace(token_count=max(counts, default=0), sparse=replace(h.sparse, retained_counts=counts))
    forge.expect(header_container(bad), SchemaError, "SPARSE_INVALID", "KVW-SPARSE-3")


def test_sparse4_token_count_and_layer_tokens():
    """KVW-SPARSE-4: token_count is the largest retained count; no layer_tokens."""
    h = _hdr()
    top = max(h.sparse.retained_counts)
    forge.expect(header_container(h.replace(token_count=top + 1)), SchemaError, "SPARSE_INVALID", "KVW-SPARSE-4")
    forge.expect(header_container(h.replace(token_count=top - 1)), SchemaError, "SPARSE_INVALID", "KVW-SPARSE-4")
    ranges = (TokenRange(0, top), TokenRange(1, top - 1))
    forge.expect(header_container(replace(h, layer_tokens=ranges)), SchemaError, "SPARSE_INVALID", "KVW-SPARSE-4")


@pytest.mark.parametrize("nxt", [0, 12, 1 << 63, (1 << 64) - 1])
def test_sparse5_next_position_range(nxt):
    """KVW-SPARSE-5: first_position + token_count <= next_position < 2^63."""
    h = _hdr()
    assert h.token_count == 13
    forge.expect(header_container(replace(h, sparse=replace(h.sparse, next_position=nxt))), SchemaError,
                 "SPARSE_INVALID", "KVW-SPARSE-5")


def test_sparse5_next_position_at_the_lower_bound_is_valid():
    """KVW-SPARSE-5: next_position = first_position + token_count is allowed."""
    dense = forge.small_cache(layers=1, heads=1, tokens=6)
    s = SparseKVCache.from_mask(dense, [np.array([[1, 1, 1, 1, 1, 0]], bool)], next_position=5)
    assert forge.read_all(kvwire.encode(s)).next_position == 5


def test_sparse14_informational_fields_are_never_judged():
    """KVW-SPARSE-14: any method, sink and window values are accepted."""
    h = _hdr()
    odd = replace(h.sparse, method="\u00e9trange org.x", sink_tokens=(1 << 32) - 1, window_tokens=12345)
    s = sparse_cache()
    s2 = SparseKVCache(replace(h, sparse=odd), s.layers)
    assert forge.read_all(kvwire.encode(s2)).header.sparse == odd


# ---------------------------------------------------------------------------------------
# record rules
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def raw_container():
    return kvwire.encode(sparse_cache(), form="file")


def _edit(data, **fields):
    return forge.rebuild(data, edit=forge.set_records(**fields))


def test_sparse6_positions_component_needs_the_feature():
    """KVW-SPARSE-6 / KVW-EVOL-9: component 4 in a dense container is out of range."""
    data = kvwire.encode(forge.small_cache())
    forge.expect(_edit(data, component=(0, R.COMPONENTS["positions"])), LayoutError, "ENUM_OUT_OF_RANGE",
                 "KVW-CHUNK-1")


def test_sparse6_components_of_the_kind(raw_container):
    """KVW-SPARSE-6: an attention layer stores K, V, POSITIONS, not LATENT."""
    forge.expect(_edit(raw_container, component=(0, R.COMPONENTS["latent"])), LayoutError, "COMPONENT_INVALID",
                 "KVW-CHUNK-1")


@pytest.mark.parametrize("field,value", [("head_start", 3), ("head_count", 2), ("head_count", 0)])
def test_sparse7_one_head_per_chunk(raw_container, field, value):
    """KVW-SPARSE-7: head_start < heads and head_count = 1 (HEAD_RANGE)."""
    data = _edit(raw_container, **{field: (0, value)})
    forge.expect(data, LayoutError, "HEAD_RANGE", "KVW-SPARSE-7")
    stream = forge.rebuild(raw_container, form="stream", edit=forge.set_records(**{field: (0, value)}))
    stream_expect(stream, LayoutError, "HEAD_RANGE", "KVW-SPARSE-7")


@pytest.mark.parametrize("t0,n", [(1, 3), (0, 5), (0, 0), (12, 4)])
def test_sparse7_cells_of_the_head_grid(raw_container, t0, n):
    """KVW-SPARSE-7: a record's token range is one cell of [0, retained count) (CHUNK_BOUNDARY)."""
    # record 0 is K of layer 0 head 0, whose count is 10 (cells [0,4), [4,8), [8,10))
    with kvwire.open(raw_container) as r:
        assert r.header.sparse.retained_counts[0] == 10 and int(r.records[0]["token_count"]) == 4
    data = _edit(raw_container, token_start=(0, t0), token_count=(0, n))
    forge.expect(data, LayoutError, "CHUNK_BOUNDARY", "KVW-SPARSE-7")


def test_sparse7_every_slot_exactly_once(raw_container):
    """KVW-SPARSE-7 / KVW-CHUNK-8: a missing and a repeated chunk."""
    p = forge.split(raw_container)
    short = forge.Parts(p.header, p.records[:-1].copy(), p.bodies[:-1], p.alignment, p.form)
    forge.expect(forge.assemble(short), LayoutError, "CHUNK_MISSING", "KVW-CHUNK-8")
    # record 1 (K head 0 cell 1) claims head 1's cell 0 instead: head 1 retains 12 tokens, so 4 rows fit
    forge.expect(_edit(raw_container, head_start=(1, 1), token_start=(1, 0)), LayoutError, "CHUNK_DUPLICATE",
                 "KVW-CHUNK-8")


def test_sparse8_raw_length(raw_container):
    """KVW-SPARSE-8: K/V bodies are [1, tokens, dim]; POSITIONS between n and 9n bytes."""
    forge.expect(_edit(raw_container, raw_length=(0, 4 * 3 * 8 * 2), stored_length=(0, 4 * 3 * 8 * 2)), LayoutError,
                 "LENGTH_MISMATCH", "KVW-SPARSE-8")
    p = forge.split(raw_container)
    i = positions_record(p)
    n = int(p.records[i]["token_count"])
    for bad in (n - 1, 9 * n + 1):
        forge.expect(with_positions_body(raw_container, bytes(bad)), LayoutError, "LENGTH_MISMATCH", "KVW-SPARSE-8")
    assert kvwire.open(with_positions_body(raw_container, encode_positions(
        kvwire.open(raw_container).chunk(0, "positions", 0), 0)))  # the unmodified body is valid


def test_sparse9_positions_codec(raw_container):
    """KVW-SPARSE-9: POSITIONS chunks use raw or zstd, without a codec spec (POSITIONS_CODEC)."""
    with kvwire.open(raw_container) as r:
        h, rec = r.header, r.records.copy()
    i = positions_record(forge.Parts(b"", rec, [], 64, "file"))
    h2 = replace(h, required_features=h.required_features | R.REQUIRED_FEATURES["codec_specs"])
    for field, value in (("codec", R.CODECS["byteplane_zstd"]), ("reserved0", 1)):
        bad = rec.copy()
        bad[i][field] = value
        with forge.raises_code(CodecError, "POSITIONS_CODEC", "KVW-SPARSE-9"):
            layer, comp = bad["layer"].astype(np.int64), bad["component"].astype(np.int64)
            check_sparse_records(h2, SparseTable.of(h2), bad, layer, comp, chunks._fail)


def test_sparse9_positions_with_zstd_is_valid():
    """KVW-SPARSE-9: zstd POSITIONS bodies (the writer compresses them when it helps)."""
    s = SparseKVCache.streaming(forge.small_cache(layers=1, heads=1, tokens=300, chunk_tokens=256), 4, 250)
    data = kvwire.encode(s, codec="zstd")
    with kvwire.open(data) as r:
        pos = r.records[r.records["component"] == R.COMPONENTS["positions"]]
        assert (pos["codec"] == R.CODECS["zstd"]).any()
        assert r.load().equal(s)


# ---------------------------------------------------------------------------------------
# POSITIONS bodies
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("body", [
    bytes([0x80, 0x00, 0, 0]),  # non-minimal 2-byte zero
    bytes([0x81] * 9 + [0x01]) + bytes(3),  # a 10-byte varint
    bytes([0, 0, 0, 0x80]),  # ends inside a varint
    bytes([0, 0, 0x85, 0x01]),  # only 3 varints for 4 tokens
])
def test_sparse10_positions_encoding(raw_container, body):
    """KVW-SPARSE-10: exactly token_count minimal varints of at most 9 bytes."""
    data = with_positions_body(raw_container, body)
    forge.expect(data, CodecError, "POSITIONS_ENCODING", "KVW-SPARSE-10", stage="load")
    forge.expect(data, CodecError, "POSITIONS_ENCODING", "KVW-SPARSE-10", stage="validate")
    stream_expect(forge.rebuild(data, form="stream"), CodecError, "POSITIONS_ENCODING", "KVW-SPARSE-10")


def test_sparse11_positions_below_next_position(raw_container):
    """KVW-SPARSE-11: a position at or past next_position (or an overflowing delta sum)."""
    nxt = kvwire.probe(raw_container).sparse.next_position
    for body in (encode_positions([0, 1, 2, nxt], 0), bytes([0xFF] * 8 + [0x7F]) * 4):
        data = with_positions_body(raw_container, body)
        forge.expect(data, LayoutError, "POSITIONS_ORDER", "KVW-SPARSE-11", stage="load")
        stream_expect(forge.rebuild(data, form="stream"), LayoutError, "POSITIONS_ORDER", "KVW-SPARSE-11")


def test_sparse11_positions_increase_across_cells(raw_container):
    """KVW-SPARSE-11: cell 1 of a head must start after cell 0's last position, in any
    arrival order (the sequential reader compares neighbours)."""
    with kvwire.open(raw_container) as r:
        last = int(r.chunk(0, "positions", 0)[-1])
    data = with_positions_body(raw_container, encode_positions([last, last + 1, last + 2, last + 3], 0), cell=1)
    with kvwire.open(data) as r:
        assert int(r.chunk(0, "positions", 1)[0]) == last  # each cell alone is valid
    forge.expect(data, LayoutError, "POSITIONS_ORDER", "KVW-SPARSE-11", stage="load")
    forge.expect(data, LayoutError, "POSITIONS_ORDER", "KVW-SPARSE-11", stage="validate")
    stream = forge.rebuild(data, form="stream")
    stream_expect(stream, LayoutError, "POSITIONS_ORDER", "KVW-SPARSE-11")
    p = forge.split(stream)
    order = list(range(len(p.bodies)))[::-1]  # cell 1 arrives before cell 0
    rev = forge.Parts(p.header, p.records[order].copy(), [p.bodies[i] for i in order], p.alignment, p.form)
    stream_expect(forge.assemble(rev), LayoutError, "POSITIONS_ORDER", "KVW-SPARSE-11")


# ---------------------------------------------------------------------------------------
# API and writer obligations
# ---------------------------------------------------------------------------------------


def test_writer_refuses_what_a_reader_would_reject():
    """KVW-SPARSE-7/11 (writer side): the Encoder checks a sparse header's cells and
    positions; a dense header's chunks cover every head (KVW-CHUNK-3), so ``head=`` is refused."""
    s = sparse_cache()
    dense = forge.small_cache()
    enc = kvwire.Encoder(dense.header)
    enc.begin()
    with pytest.raises(ValueError, match="KVW-CHUNK-3"):
        enc.chunk(0, "k", 0, dense.layers[0]["k"][:, :16], head=1)
    with pytest.raises(ValueError, match="unknown codec"):
        kvwire.encode(s, codec="fp9")
    enc = kvwire.Encoder(s.header)
    enc.begin()
    head = s.layers[0][0]
    with pytest.raises(ValueError, match="one cell"):
        enc.chunk(0, "k", 1, head["k"][1:5])
    with pytest.raises(ValueError, match="no component"):
        enc.chunk(0, "latent", 0, head["k"][:4])
    with pytest.raises(ValueError, match="increasing"):
        enc.chunk(0, "positions", 0, head["positions"][:4][::-1].copy())
    enc.chunk(0, "positions", 0, head["positions"][:4])
    with pytest.raises(kvwire.LayoutError, match="cell 1"):
        enc.chunk(0, "positions", 4, head["positions"][:4])
    with pytest.raises(ValueError, match="never written"):
        enc.end()


def test_cache_constructor_checks_its_input():
    """SparseKVCache refuses positions out of order or range and mismatched shapes."""
    s = sparse_cache()
    layers = [[dict(hd) for hd in heads] for heads in s.layers]
    layers[0][0]["positions"] = layers[0][0]["positions"][::-1].copy()
    with pytest.raises(ValueError, match="increase strictly"):
        SparseKVCache(s.header, layers)
    layers = [[dict(hd) for hd in heads] for heads in s.layers]
    layers[1][2]["v"] = layers[1][2]["v"][:-1]
    with pytest.raises(ValueError, match="need"):
        SparseKVCache(s.header, layers)
    with pytest.raises(ValueError, match="keep_mask"):
        SparseKVCache.from_mask(forge.small_cache(), [np.ones((2, 3), bool)] * 2)


def test_reader_api_on_sparse_containers():
    """Reader.layer() refuses sparse containers (per-head lengths); sparse_layer() reads one."""
    s = sparse_cache()
    with kvwire.open(kvwire.encode(s)) as r:
        with pytest.raises(ValueError, match="sparse"):
            r.layer(0)
        heads = r.sparse_layer(1)
        assert all(np.array_equal(a["positions"], b["positions"]) for a, b in zip(heads, s.layers[1]))
        torch = pytest.importorskip("torch")
        t = r.load(backend="torch")
        assert isinstance(t.layers[0][0]["k"], torch.Tensor) and t.equal(s)
    with kvwire.open(kvwire.encode(forge.small_cache())) as r, pytest.raises(ValueError, match="not a sparse"):
        r.sparse_layer(0)


def test_save_and_load_files(tmp_path):
    """kvwire.save / kvwire.load accept and return sparse caches."""
    s = sparse_cache(dtype="bf16")
    kvwire.save(tmp_path / "s.kvw", s, codec="zstd", chunk_tokens=8)
    back = kvwire.load(tmp_path / "s.kvw")
    assert isinstance(back, SparseKVCache) and back.equal(s.with_header(chunk_tokens=8))


def test_sparse_bodies_are_compact():
    """KVW-SPARSE-10: StreamingLLM positions cost about one byte per retained token raw and
    almost nothing with zstd."""
    s = SparseKVCache.streaming(forge.small_cache(layers=1, heads=8, tokens=2048, chunk_tokens=256), 4, 1020)
    for codec, limit in (("raw", 1.01), ("zstd", 0.1)):
        with kvwire.open(kvwire.encode(s, codec=codec)) as r:
            pos = r.records[r.records["component"] == R.COMPONENTS["positions"]]
            assert pos["stored_length"].sum() <= limit * 8 * 1024


def test_sparse_info_defaults():
    """SparseInfo optional fields are omitted when zero and read back as defaults."""
    info = SparseInfo(next_position=10, retained_counts=(1,))
    dense = forge.small_cache(layers=1, heads=1, tokens=10)
    s = SparseKVCache.from_mask(dense, [np.eye(1, 10, 9, dtype=bool)])
    assert replace(s.header.sparse, method="") == info


def test_sparse_info_schema_is_pinned():
    """KVW-EVOL-7: SparseInfo (spec/sparse.md section 2) and Header.sparse keep names, types and ids."""
    from test_schema_evolution import current

    tables, _ = current()
    assert tables["SparseInfo"][:5] == [("method", "string", 0), ("next_position", "ulong", 1),
                                        ("retained_counts", "[uint]", 2), ("sink_tokens", "uint", 3),
                                        ("window_tokens", "uint", 4)]
    assert ("sparse", "SparseInfo", 19) in tables["Header"]


# ---------------------------------------------------------------------------------------
# damaged input
# ---------------------------------------------------------------------------------------

_DAMAGE = sparse_cache(layers=1, heads=2, tokens=20, density=0.5, seed=9)
_DAMAGE_ENC = {(f, c): kvwire.encode(_DAMAGE, form=f, codec=c) for f in ("file", "stream") for c in ("raw", "zstd")}


def _outcome(data) -> str:
    try:
        with kvwire.open(data) as r:
            r.validate()
            assert r.load().equal(_DAMAGE), "load succeeded with different data"
    except kvwire.FormatError:
        pass
    try:
        stream_events(data)
    except kvwire.FormatError:
        return "error"
    return "ok"


@settings(max_examples=150, deadline=None)
@given(combo=st.sampled_from(sorted(_DAMAGE_ENC)), pos=st.integers(0, 1 << 20), bit=st.integers(0, 7),
       cut=st.booleans())
def test_damaged_sparse_containers_fail_cleanly(combo, pos, bit, cut):
    """KVW-ERR-2 for sparse containers: a flipped bit or a cut raises a FormatError in both
    readers (never another exception) and a load that succeeds returns the encoded cache."""
    data = bytearray(_DAMAGE_ENC[combo])
    pos %= len(data)
    if cut:
        data = data[:pos]
    else:
        data[pos] ^= 1 << bit
    assert _outcome(bytes(data)) in ("ok", "error")


@settings(max_examples=150, deadline=None)
@given(counts=st.lists(st.integers(0, (1 << 32) - 1), max_size=8), token_count=st.integers(0, (1 << 32) - 1),
       nxt=st.integers(0, (1 << 64) - 1), first=st.integers(0, (1 << 64) - 1), method=st.text(max_size=5),
       bit=st.booleans())
def test_forged_sparse_headers_fail_cleanly(counts, token_count, nxt, first, method, bit):
    """KVW-SPARSE-1..5: any SparseInfo content is accepted or refused with a FormatError."""
    h = _hdr()
    forged = replace(h, token_count=token_count, first_position=first, layer_tokens=None,
                     required_features=SPARSE_BIT if bit else 0,
                     sparse=SparseInfo(nxt, tuple(counts), method.replace("\0", "")))
    data = header_container(replace(forged, layer_tokens=Header(h.arch, token_count=token_count).layer_tokens))
    try:
        with kvwire.open(data) as r:
            r.validate()
            r.load()
    except kvwire.FormatError:
        pass


def test_cli_inspect_shows_the_sparse_table(tmp_path, capsys):
    """`kvwire inspect` reports method, next position and retained counts of a sparse container."""
    from kvwire.tools import cli

    kvwire.save(tmp_path / "s.kvw", SparseKVCache.streaming(forge.small_cache(layers=1, heads=2, tokens=9), 1, 2))
    assert cli.main(["inspect", str(tmp_path / "s.kvw")]) == 0
    assert "sparse     streaming_llm, next position 9, sinks 1, window 2; retained [3, 3]" in capsys.readouterr().out


def test_lim1_retained_counts_vector_over_limit():
    """KVW-LIM-1 (spec/sparse.md section 2): retained_counts of more than 2^24 entries is refused
    from its length field, before its bytes are read."""
    from kvwire.format.sparse import MAX_RETAINED_ENTRIES

    h = _hdr()
    hb = bytearray(forge.header_of(h))
    counts = h.sparse.retained_counts
    needle = np.array([len(counts), *counts], "<u4").tobytes()
    at = bytes(hb).find(needle)
    assert at >= 0 and bytes(hb).find(needle, at + 1) < 0
    hb[at : at + 4] = np.array([MAX_RETAINED_ENTRIES + 1], "<u4").tobytes()
    forge.expect(forge.wrap_header(bytes(hb)), kvwire.LimitError, "LIMIT_EXCEEDED", "KVW-LIM-1")
