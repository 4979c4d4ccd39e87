"""KVStore (spec/store.md, KVW-STORE-5, 11..20): caches in and out of a store as one
container per chunk. Round trips over token counts, codecs, layer ranges and chunk
limits; one put_many and batched get_many; a corrupt or mismatched chunk trims the result
(without a second copy); layer ranges; what the store refuses; stats."""

from __future__ import annotations

import hashlib
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvwire
import kvwire.store.kvstore as kvstore_module
from kvwire.cache.sparse import SparseKVCache
from kvwire.format.crossmodel import StateTensor
from kvwire.format.header import Architecture, LayerMapEntry, LayerSpec, ModelIdentity
from kvwire.store import KeySpace, KVStore, LocalStore, MemoryStore, Store, codec_fidelity
from kvwire.store.kvstore import HEAD_BYTES, held_layers, range_map

FP = hashlib.sha256(b"kvstore-test-model").digest()
OTHER_FP = hashlib.sha256(b"another model").digest()
C = 4
LAYERS = 3


def make_cache(tokens: int, *, layers: int = LAYERS, heads: int = 2, dim: int = 8, seed: int = 0, fp: bytes = FP,
               model: ModelIdentity | None = None):
    rng = np.random.default_rng(seed)
    ks = [rng.standard_normal((heads, tokens, dim)).astype(np.float16) for _ in range(layers)]
    vs = [rng.standard_normal((heads, tokens, dim)).astype(np.float16) for _ in range(layers)]
    return kvwire.KVCache.from_tensors(ks, vs, model=model or ModelIdentity(compat_fingerprint=fp), chunk_tokens=C)


def big_cache(tokens: int, seed: int = 0):
    """Chunk objects of 128 KiB, larger than HEAD_BYTES: headers and bodies take separate reads."""
    return make_cache(tokens, layers=4, heads=8, dim=256, seed=seed)


def token_ids(n: int, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed + 100).integers(0, 50_000, n)]


class CountingStore(MemoryStore):
    """A real MemoryStore that also counts the calls KVStore makes on it (and keeps what
    put_many was given); its behaviour is MemoryStore's own."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls = Counter()
        self.put_batches: list = []
        self.get_batches: list = []
        self._in_batch = False

    def put_many(self, items):
        items = list(items)
        self.calls["put_many"] += 1
        self.put_batches.append(items)
        self._in_batch = True
        try:
            return super().put_many(items)
        finally:
            self._in_batch = False

    def put(self, key, value):
        self.calls["put" if not self._in_batch else "put_in_batch"] += 1
        return super().put(key, value)

    def get_many(self, keys, byte_range=None):
        keys = list(keys)
        self.calls["get_many"] += 1
        self.get_batches.append((keys, byte_range))
        return [MemoryStore.get(self, k, byte_range) for k in keys]

    def get(self, key, byte_range=None):
        self.calls["get"] += 1
        return super().get(key, byte_range)

    def exists_many(self, keys):
        self.calls["exists_many"] += 1
        return super().exists_many(keys)


def served(T: int, partial: bool, n_chunks) -> tuple[int, int, int]:
    """(objects stored, chunks served, tokens served) of a put of T tokens and a get."""
    stored = T // C + (1 if partial and T % C else 0)
    chunks = stored if n_chunks is None else min(stored, n_chunks)
    return stored, chunks, min(chunks * C, T)


def replace_object(store, key: str, data: bytes) -> None:
    """Overwrite an object through the public protocol (puts never replace: delete first)."""
    store.delete(key)
    assert store.put(key, data)


def same_bits(x, y) -> bool:
    x, y = np.asarray(x), np.asarray(y)
    return x.shape == y.shape and np.array_equal(x.view(np.uint16), y.view(np.uint16))


# -- round trips ---------------------------------------------------------------------------

CODECS = ["raw", "zstd", "byteplane", "int8"]
RANGES = [None, (0, 3), (0, 1), (1, 3), (2, 3)]


@settings(max_examples=40)
@given(T=st.integers(0, 23), partial=st.booleans(), codec=st.sampled_from(CODECS), layers=st.sampled_from(RANGES),
       n_chunks=st.one_of(st.none(), st.integers(0, 7)), seed=st.integers(0, 3))
def test_store11_put_get_round_trip_property(T, partial, codec, layers, n_chunks, seed):
    """KVW-STORE-11/13/15/16: any token count (whole chunks, and the partial one when asked),
    any codec (lossless exact, int8 within its quantization error; the key's fidelity
    differs), any layer range, any chunk limit: get_cache serves the leading stored chunks."""
    cache, tokens = make_cache(T, seed=seed), token_ids(T, seed)
    kv = KVStore(MemoryStore())
    res = kv.put_cache(cache, tokens, codec=codec, partial=partial, layers=layers)
    a, b = layers or (0, LAYERS)
    space = KeySpace(FP, "f16", C, (a, b), fidelity=codec_fidelity(codec))
    stored, chunks, want = served(T, partial, n_chunks)
    assert res.keys == space.keys(tokens, partial=partial) and res.written == stored and res.skipped == 0
    assert all(f"/l{a}-{b}/{codec_fidelity(codec)}/c{C}/" in k for k in res.keys)
    got = kv.get_cache(tokens, space, n_chunks)
    assert (got.tokens, got.chunks) == (want, chunks)
    if not chunks:
        assert got.cache is None
        return
    h = got.cache.header
    assert h.num_layers == b - a and h.token_count == want and h.first_position == 0
    assert kvwire.covered_tokens(h, tokens) == want
    assert h.layer_map == (() if (a, b) == (0, LAYERS) else range_map(a, b))
    for i in range(b - a):
        for c in "kv":
            x, y = cache.layers[a + i][c][:, :want], got.cache.layers[i][c]
            if codec == "int8":
                assert y.shape == x.shape
                np.testing.assert_allclose(y.astype(np.float32), x.astype(np.float32),
                                           atol=float(np.abs(x).max()) / 64 + 1e-3)
                assert not same_bits(x, y) or not x.size  # lossy: int8 really changed the tensors
            else:
                assert same_bits(x, y)
    again = kv.put_cache(cache, tokens, codec=codec, partial=partial, layers=layers)
    assert again.written == 0 and again.skipped == stored


@pytest.mark.parametrize("codec", ["raw", "zstd"])
@pytest.mark.parametrize("backend", ["memory", "local"])
@pytest.mark.parametrize("size", ["small", "big"])
def test_store11_round_trip_on_both_backends(tmp_path, backend, codec, size):
    """KVW-STORE-11/19: exact round trip with the partial chunk, for objects read whole by the
    header read and for objects larger than HEAD_BYTES (header, then body)."""
    store = MemoryStore() if backend == "memory" else LocalStore(tmp_path)
    cache = make_cache(10) if size == "small" else big_cache(10)
    tokens = token_ids(10)
    kv = KVStore(store)
    assert kv.put_cache(cache, tokens, codec=codec, partial=True).written == 3
    got = kv.get_cache(tokens, KeySpace.of(cache.header, codec=codec))
    assert got.tokens == 10 and got.chunks == 3
    assert all(same_bits(got.cache.layers[i][c], cache.layers[i][c]) for i in range(cache.num_layers) for c in "kv")
    assert (len(store.get(kv.put_cache(cache, tokens).keys[0])) > HEAD_BYTES) == (size == "big")


def test_store15_lossless_codecs_share_objects():
    """KVW-STORE-15: raw, zstd and byteplane objects share one key (fidelity "lossless")."""
    cache, tokens = make_cache(8), token_ids(8)
    kv = KVStore(MemoryStore())
    assert kv.put_cache(cache, tokens, codec="zstd").written == 2
    assert kv.put_cache(cache, tokens, codec="byteplane").skipped == 2
    got = kv.get_cache(tokens, KeySpace.of(cache.header, codec="raw"))
    assert got.tokens == 8 and same_bits(got.cache.layers[2]["v"], cache.layers[2]["v"])
    assert kv.get_cache(tokens, KeySpace.of(cache.header, codec="int8")).cache is None  # lossy: its own keys


def test_store11_shared_prefix_objects_are_reused():
    """KVW-STORE-11: a request sharing whole chunks with a stored one writes (and encodes)
    only its own chunks, and reads the shared ones back from the first request's objects."""
    system = token_ids(8, seed=5)
    a_toks, b_toks = system + token_ids(6, seed=6), system + token_ids(7, seed=7)
    a = make_cache(14, seed=1)
    b_tail = make_cache(15, seed=2)
    b = kvwire.KVCache(b_tail.header, [{c: np.concatenate([a.layers[i][c][:, :8], x[:, 8:]], axis=1)
                                         for c, x in layer.items()} for i, layer in enumerate(b_tail.layers)])
    store = CountingStore()
    kv = KVStore(store)
    ra = kv.put_cache(a, a_toks, partial=True)
    rb = kv.put_cache(b, b_toks, partial=True)
    assert ra.keys[:2] == rb.keys[:2] and ra.keys[2:] != rb.keys[2:]
    assert (ra.written, rb.written, rb.skipped) == (4, 2, 2)
    assert [k for k, _ in store.put_batches[-1]] == rb.keys[2:]  # the shared chunks were not even encoded
    got = kv.get_cache(b_toks, KeySpace.of(b.header))
    assert got.tokens == 15 and all(same_bits(got.cache.layers[i][c], b.layers[i][c]) for i in range(3) for c in "kv")
    longer = b_toks + token_ids(9, seed=8)  # a longer prompt: its whole stored chunks are served; the
    assert kv.get_cache(longer, KeySpace.of(b.header)).tokens == 12  # partial chunk's hash covers 3 tokens only
    other = system + token_ids(4, seed=9)
    assert kv.get_cache(other, KeySpace.of(b.header)).tokens == 8


def test_store11_n_chunks_limits_what_is_read():
    """At most n_chunks objects are asked for (headers and bodies alike)."""
    store = CountingStore()
    kv = KVStore(store)
    cache, tokens = big_cache(20), token_ids(20)
    kv.put_cache(cache, tokens)
    space = KeySpace.of(cache.header)
    for n in (0, 1, 3, 5, 9):
        store.get_batches.clear()
        got = kv.get_cache(tokens, space, n)
        assert got.chunks == min(n, 5) and got.tokens == min(n, 5) * C
        assert all(len(keys) <= n for keys, _ in store.get_batches)
        if got.chunks:
            assert same_bits(got.cache.layers[3]["k"], cache.layers[3]["k"][:, :got.tokens])


# -- batching --------------------------------------------------------------------------------

def test_store5_put_cache_writes_one_put_many_of_unjoined_buffers():
    """KVW-STORE-5: one exists_many, then all new objects in ONE put_many (one round trip on
    a networked backend), each value the encoder's list of buffers, raw bodies views of the
    caller's arrays (no copy before the backend)."""
    store = CountingStore()
    kv = KVStore(store)
    cache, tokens = make_cache(22), token_ids(22)
    res = kv.put_cache(cache, tokens, partial=True)
    assert res.written == 6
    assert store.calls["exists_many"] == 1 and store.calls["put_many"] == 1 and store.calls["put"] == 0
    (batch,) = store.put_batches
    assert [k for k, _ in batch] == res.keys
    for _, value in batch:
        assert isinstance(value, list) and len(value) > 2
    views = [np.frombuffer(b, np.uint8) for b in batch[0][1] if isinstance(b, memoryview)]
    assert any(np.shares_memory(v, cache.layers[0]["k"]) for v in views)
    assert res.bytes_out == sum(len(store.get(k)) for k in res.keys)
    store.calls.clear()
    assert kv.put_cache(cache, tokens, partial=True).skipped == 6
    assert store.calls["put_many"] == 0 and store.calls["put_in_batch"] == 0  # nothing new: nothing encoded


def test_store5_put_and_get_batches_are_bounded():
    """Objects go in put_many batches of at most batch_bytes (an object larger than that
    alone), and bodies come in get_many batches alike, so a very long prompt neither holds
    all its encoded objects at once nor takes one round trip per chunk."""
    cache, tokens = big_cache(20), token_ids(20)
    probe = MemoryStore()
    one = max(len(probe.get(k)) for k in KVStore(probe).put_cache(cache, tokens).keys)  # each chunk object's size
    store = CountingStore()
    kv = KVStore(store, batch_bytes=2 * one)
    assert kv.put_cache(cache, tokens).written == 5
    assert [len(b) for b in store.put_batches] == [2, 2, 1]
    store.get_batches.clear()
    got = kv.get_cache(tokens, KeySpace.of(cache.header))
    assert got.tokens == 20 and same_bits(got.cache.layers[3]["v"], cache.layers[3]["v"])
    assert [len(keys) for keys, r in store.get_batches if r is None] == [2, 2, 1]
    store = CountingStore()
    assert KVStore(store, batch_bytes=1).put_cache(cache, tokens).written == 5 and store.calls["put_many"] == 5
    assert KVStore(MemoryStore()).batch_bytes == kvstore_module.LOCAL_BATCH_BYTES
    assert KVStore(Store()).batch_bytes == kvstore_module.BATCH_BYTES  # a networked backend: bigger batches
    for bad in (0, -1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="batch_bytes"):
            KVStore(MemoryStore(), batch_bytes=bad)


def test_store19_get_cache_reads_headers_then_bodies_in_one_batch_each():
    """KVW-STORE-19/5: one ranged get_many for every header, one get_many for the bodies of
    all objects that passed (none for objects the header read got whole)."""
    store = CountingStore()
    kv = KVStore(store)
    big, tokens = big_cache(20), token_ids(20)
    kv.put_cache(big, tokens)
    store.calls.clear()
    store.get_batches.clear()
    got = kv.get_cache(tokens, KeySpace.of(big.header))
    assert got.tokens == 20 and store.calls["get_many"] == 2 and store.calls["get"] == 0
    (heads, r1), (bodies, r2) = store.get_batches
    assert r1 == (0, HEAD_BYTES) and r2 is None and heads == bodies and len(bodies) == 5
    small = make_cache(20, fp=OTHER_FP)
    kv.put_cache(small, tokens)
    store.calls.clear()
    assert kv.get_cache(tokens, KeySpace.of(small.header)).tokens == 20 and store.calls["get_many"] == 1


# -- corruption ------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["memory", "local"])
@pytest.mark.parametrize("size", ["small", "big"])
def test_store17_corrupt_middle_chunk_trims_to_the_chunks_before(tmp_path, backend, size):
    """KVW-STORE-17: a checksum failure in chunk 2 of 5 is a miss; the object is deleted,
    the hits end there, the result holds exactly chunks 0-1 with their data, as views of
    the arrays decoded into (no second copy)."""
    store = MemoryStore() if backend == "memory" else LocalStore(tmp_path)
    kv = KVStore(store)
    cache = make_cache(20) if size == "small" else big_cache(20)
    tokens = token_ids(20)
    keys = kv.put_cache(cache, tokens).keys
    data = bytearray(store.get(keys[2]))
    data[kvwire.open(bytes(data)).info(3).offset + 1] ^= 0x40  # one byte of one body
    replace_object(store, keys[2], bytes(data))
    space = KeySpace.of(cache.header)
    got = kv.get_cache(tokens, space)
    assert (got.tokens, got.chunks) == (8, 2)
    for i in range(cache.num_layers):
        for c in "kv":
            x = got.cache.layers[i][c]
            assert same_bits(x, cache.layers[i][c][:, :8])
            assert x.strides[0] == 20 * x.shape[2] * 2  # a view of the 20-token array: trimmed, not copied
    s = kv.stats()
    assert s["checksum_failures"] == 1 and s["hits"] == 2 and s["misses"] == 3
    assert not store.exists(keys[2]) and all(store.exists(k) for k in keys[:2] + keys[3:])
    again = kv.get_cache(tokens, space)  # the miss is now found by the header read: nothing extra allocated
    assert again.tokens == 8 and again.cache.layers[0]["k"].strides[0] == 8 * again.cache.layers[0]["k"].shape[2] * 2
    assert kvwire.covered_tokens(again.cache.header, tokens) == 8


def test_store17_mismatched_middle_object_is_a_miss_before_any_body_read():
    """KVW-STORE-17: an object whose header does not match its key (another model's chunk,
    a truncated object) ends the hits; it is deleted, and no body after it is read."""
    store = CountingStore()
    kv = KVStore(store)
    cache, tokens = big_cache(16), token_ids(16)
    keys = kv.put_cache(cache, tokens).keys
    other = big_cache(16, seed=3).with_header(model=ModelIdentity(compat_fingerprint=OTHER_FP))
    wrong_keys = KVStore(store).put_cache(other, tokens).keys
    replace_object(store, keys[1], store.get(wrong_keys[1]))
    store.get_batches.clear()
    got = kv.get_cache(tokens, KeySpace.of(cache.header))
    assert got.chunks == 1 and kv.stats()["incompatible"] == 1 and not store.exists(keys[1])
    assert store.get_batches[-1] == ([keys[0]], None)  # the body of chunk 0 only
    assert same_bits(got.cache.layers[0]["v"], cache.layers[0]["v"][:, :4])
    replace_object(store, keys[0], store.get(keys[2])[:100])  # truncated: corrupt
    assert kv.get_cache(tokens, KeySpace.of(cache.header)).cache is None
    assert kv.stats()["corrupt"] == 1 and not store.exists(keys[0])


# -- layer ranges ----------------------------------------------------------------------------

def test_store16_pipeline_stages_store_their_layers():
    """KVW-STORE-16: two pipeline stages store layers [0, 2) and [2, 3) under their own keys;
    each object is a valid container whose layer map says which model layers it holds
    (receiver a + i copies transmitted i), and get_cache of a range returns those layers."""
    store = MemoryStore()
    kv = KVStore(store)
    lw = bytes(range(32 * LAYERS))  # 32 bytes per layer, all different
    cache = make_cache(9, model=ModelIdentity(compat_fingerprint=FP, layer_weights_fingerprints=lw,
                                              fingerprint_scheme=1))
    tokens = token_ids(9)
    r1 = kv.put_cache(cache, tokens, layers=(0, 2), partial=True)
    r2 = kv.put_cache(cache, tokens, layers=(2, 3), partial=True)
    assert r1.written == r2.written == 3 and all("/l0-2/" in k for k in r1.keys) and all("/l2-3/" in k for k in r2.keys)
    obj = kvwire.open(bytes(store.get(r2.keys[1])))
    obj.validate()
    assert obj.header.num_layers == 1 and obj.header.layer_map == (LayerMapEntry(2, 0, "copy"),)
    assert obj.header.model.layer_weights_fingerprints == lw[64:96]
    assert obj.layer_for(2).transmitted_layer == 0 and obj.layer_for(0).op == "recompute"
    for (a, b) in [(0, 2), (2, 3)]:
        got = kv.get_cache(tokens, KeySpace(FP, "f16", C, (a, b)))
        assert got.tokens == 9 and got.cache.num_layers == b - a and held_layers(got.cache.header) == (a, b)
        assert all(same_bits(got.cache.layers[i][c], cache.layers[a + i][c]) for i in range(b - a) for c in "kv")
    assert kv.get_cache(tokens, KeySpace.of(cache.header)).cache is None  # all layers: other keys


def test_store16_a_stage_cache_is_keyed_under_its_layers_again():
    """A cache read from a layer range holds those model layers: put_cache keys it under them,
    and a narrower range of it selects by model layer index."""
    kv = KVStore(MemoryStore())
    cache, tokens = make_cache(8), token_ids(8)
    kv.put_cache(cache, tokens, layers=(1, 3))
    stage = kv.get_cache(tokens, KeySpace(FP, "f16", C, (1, 3))).cache
    kv2 = KVStore(MemoryStore())
    assert all("/l1-3/" in k for k in kv2.put_cache(stage, tokens).keys)
    assert all("/l2-3/" in k for k in kv2.put_cache(stage, tokens, layers=(2, 3)).keys)
    got = kv2.get_cache(tokens, KeySpace(FP, "f16", C, (2, 3)))
    assert got.tokens == 8 and same_bits(got.cache.layers[0]["k"], cache.layers[2]["k"])
    with pytest.raises(ValueError, match="1 <= start < stop <= 3"):
        kv2.put_cache(stage, tokens, layers=(0, 2))


def test_store17_layer_range_object_without_its_layer_map_is_refused():
    """KVW-STORE-17: under an l1-3 key, a 2-layer container that does not say it holds model
    layers 1-2 (no range map) is not the object the key promises."""
    store = MemoryStore()
    kv = KVStore(store)
    cache, tokens = make_cache(4), token_ids(4)
    two = kvwire.KVCache.from_tensors([cache.layers[i]["k"] for i in (1, 2)], [cache.layers[i]["v"] for i in (1, 2)],
                                      model=cache.header.model, chunk_tokens=C)
    (full_key,) = kv.put_cache(two, tokens).keys  # keyed l0-2: a 2-layer model's own cache
    (range_key,) = KeySpace(FP, "f16", C, (1, 3)).keys(tokens)
    store.put(range_key, store.get(full_key))
    assert kv.get_cache(tokens, KeySpace(FP, "f16", C, (1, 3))).cache is None
    assert kv.stats()["incompatible"] == 1 and not store.exists(range_key)
    assert kv.get_cache(tokens, KeySpace(FP, "f16", C, (0, 2))).tokens == 4


def test_store16_bad_layer_ranges_are_refused():
    kv = KVStore(MemoryStore())
    cache, tokens = make_cache(4), token_ids(4)
    for bad in [(2, 1), (0, 4), (-1, 2), (1, 1), [0, 1], (0.0, 1), (True, 2), (0, 1, 2), "0-1"]:
        with pytest.raises(ValueError, match="layers"):
            kv.put_cache(cache, tokens, layers=bad)
    aliased = cache.with_header(layer_map=(LayerMapEntry(0, 0, "copy"), LayerMapEntry(1, 0, "alias"),
                                           LayerMapEntry(2, 2, "copy")))
    with pytest.raises(ValueError, match="layer map"):
        kv.put_cache(aliased, tokens, layers=(0, 1))
    assert kv.store.list() == []


# -- what the store does not hold -------------------------------------------------------------

def test_store_refuses_what_it_does_not_hold_yet():
    """State, shared and sparse caches are refused with a ValueError naming what the store
    holds (layers of one row per token); nothing is written."""
    kv = KVStore(MemoryStore())
    cache, tokens = make_cache(8), token_ids(8)
    ssm = LayerSpec("state", state_tensors=(StateTensor("ssm", (1, 2, 3)),))
    state = kvwire.KVCache(cache.header.replace(arch=Architecture(cache.header.arch.layers[:1] + (ssm,)),
                                                layer_tokens=None),
                           [cache.layers[0], {"state": {"ssm": np.zeros((1, 2, 3), np.float32)}}])
    with pytest.raises(ValueError, match="full_attention, sliding_attention, chunked_attention, mla_latent layers; "
                                         "this one has state"):
        kv.put_cache(state, tokens)
    sparse = SparseKVCache.from_mask(cache, [np.ones((2, 8), bool)] * LAYERS)
    with pytest.raises(ValueError, match="sparse"):
        kv.put_cache(sparse, tokens)
    with pytest.raises(ValueError, match="position 0"):
        kv.put_cache(cache.with_header(first_position=4), tokens)
    with pytest.raises(ValueError, match="codec"):
        kv.put_cache(cache, tokens, codec="gzip")
    with pytest.raises(TypeError):
        kv.put_cache(cache.layers, tokens)
    assert kv.store.list() == []


def test_store11_sliding_chunked_and_mla_layers_round_trip():
    """KVW-STORE-11 on every layer kind of one row per token: sliding-window and chunked
    layers that hold every token from 0 and MLA latent layers ([1, T, rank + rope]) are cut
    into the same chunks; a sliding layer that kept only its window is refused."""
    rng = np.random.default_rng(3)
    T = 10
    specs = (LayerSpec("full_attention", 2, 8, 8), LayerSpec("sliding_attention", 2, 8, 8, window=4),
             LayerSpec("chunked_attention", 1, 4, 4, window=8),
             LayerSpec("mla_latent", 1, 12, 0, kv_lora_rank=8, qk_rope_head_dim=4))
    header = kvwire.Header(arch=Architecture(specs), token_count=T, dtype="f16", chunk_tokens=C,
                           model=ModelIdentity(compat_fingerprint=FP))
    layers = [{c: rng.standard_normal(s.shape(c, T)).astype(np.float16) for c in s.components} for s in specs]
    cache, tokens = kvwire.KVCache(header, layers), token_ids(T)
    for store in (MemoryStore(), LocalStore(__import__("tempfile").mkdtemp())):
        kv = KVStore(store)
        assert kv.put_cache(cache, tokens, partial=True).written == 3
        got = kv.get_cache(tokens, KeySpace.of(header))
        assert got.tokens == T and got.cache.header.arch == header.arch
        for want, have in zip(layers, got.cache.layers):
            assert want.keys() == have.keys()
            for c in want:
                assert np.array_equal(np.asarray(have[c]), want[c])
    window_only = kvwire.KVCache(header.replace(layer_tokens=(kvwire.TokenRange(0, T), kvwire.TokenRange(T - 4, 4),
                                                              kvwire.TokenRange(0, T), kvwire.TokenRange(0, T))),
                                 [layers[0], {c: x[:, T - 4:] for c, x in layers[1].items()}, layers[2], layers[3]])
    with pytest.raises(ValueError, match="sliding-window layer that kept only its window"):
        KVStore(MemoryStore()).put_cache(window_only, tokens)


# -- stats -----------------------------------------------------------------------------------

def test_stats_report_hits_bytes_rates_and_failures():
    """stats(): hits, misses, hit_rate, bytes read and written by this KVStore, the last
    get/put's seconds and GB/s (tensor bytes / wall seconds), evictions, checksum failures,
    with the earlier keys kept."""
    store = MemoryStore()
    kv = KVStore(store)
    cache, tokens = make_cache(16), token_ids(16)
    res = kv.put_cache(cache, tokens)
    s = kv.stats()
    sizes = sum(len(store.get(k)) for k in res.keys)
    assert s["bytes_written"] == sizes == res.bytes_out and s["last_put_bytes"] == sizes
    assert s["last_put_tensor_bytes"] == cache.nbytes and s["last_put_gbps"] > 0
    assert s["last_put_gbps"] == pytest.approx(cache.nbytes / s["last_put_seconds"] / 1e9)
    got = kv.get_cache(tokens + token_ids(8, seed=4), KeySpace.of(cache.header))
    s = kv.stats()
    assert (s["hits"], s["misses"]) == (4, 2) and s["hit_rate"] == pytest.approx(4 / 6)
    assert s["bytes_read"] == sizes  # small objects: the header read got each whole
    assert s["last_get_tensor_bytes"] == got.cache.nbytes and s["last_get_gbps"] > 0
    for key in ("queries", "objects_written", "objects_skipped", "checksum_failures", "corrupt", "incompatible",
                "bytes_in", "bytes_out", "evictions"):
        assert key in s
    capped = KVStore(MemoryStore(max_bytes=len(store.get(res.keys[2])) + len(store.get(res.keys[3]))))
    capped.put_cache(cache, tokens)
    assert capped.stats()["evictions"] == 2 and capped.get_cache(tokens, KeySpace.of(cache.header)).cache is None
    assert capped.stats()["misses"] == 4 and capped.stats()["hit_rate"] == 0.0


# -- over real Redis servers (tests/redisfix.py: a missing redis-server fails, never skips) ----

def test_store23_kvstore_over_redis_is_two_round_trips_each_way(redis_url):
    """KVW-STORE-5/23 on a real redis-server: put_cache of a multi-chunk cache is one
    exists_many and one put_many (two round trips), get_cache one round trip for the headers
    and one for the bodies; a corrupt middle chunk trims the result and is deleted."""
    store = kvwire.store.open_store(redis_url)
    try:
        kv = KVStore(store)
        assert kv.batch_bytes == kvstore_module.BATCH_BYTES
        cache, tokens = big_cache(20), token_ids(20)
        before = store.stats.round_trips
        assert kv.put_cache(cache, tokens, partial=True).written == 5
        assert store.stats.round_trips - before == 2
        before = store.stats.round_trips
        got = kv.get_cache(tokens, KeySpace.of(cache.header))
        assert store.stats.round_trips - before == 2 and got.tokens == 20
        assert all(same_bits(got.cache.layers[i][c], cache.layers[i][c]) for i in range(4) for c in "kv")
        keys = KeySpace.of(cache.header).keys(tokens)
        data = bytearray(store.get(keys[3]))
        data[kvwire.open(bytes(data)).info(0).offset] ^= 0x01
        replace_object(store, keys[3], bytes(data))
        got = kv.get_cache(tokens, KeySpace.of(cache.header))
        assert got.tokens == 12 and kv.stats()["checksum_failures"] == 1 and not store.exists(keys[3])
        assert same_bits(got.cache.layers[1]["k"], cache.layers[1]["k"][:, :12])
    finally:
        store.close()


def test_store24_kvstore_over_a_redis_cluster(redis_cluster_url):
    """KVW-STORE-24: the chunks of one prompt spread over the masters; a layer range and the
    partial chunk round-trip exactly."""
    store = kvwire.store.open_store(redis_cluster_url)
    try:
        kv = KVStore(store)
        cache, tokens = make_cache(30), token_ids(30)
        assert kv.put_cache(cache, tokens, partial=True, layers=(1, 3), codec="zstd").written == 8
        got = kv.get_cache(tokens, KeySpace(FP, "f16", C, (1, 3)))
        assert got.tokens == 30 and got.cache.header.layer_map == range_map(1, 3)
        assert all(same_bits(got.cache.layers[i][c], cache.layers[1 + i][c]) for i in range(2) for c in "kv")
    finally:
        store.close()


# -- the scheduler's lookup ----------------------------------------------------------------

def test_store20_lookup_reads_the_first_header_only(tmp_path):
    """KVW-STORE-20 and -19: ``lookup`` is the hit query plus the first hit's header (one
    ranged read, far less than the object), checked against the key and, given a
    ``LocalModel``, for compatibility; an incompatible receiver gets 0 tokens."""
    cache, tokens = big_cache(3 * C + 2), token_ids(3 * C + 2)
    for store in (MemoryStore(), LocalStore(tmp_path / "s")):
        kv = KVStore(store)
        kv.put_cache(cache, tokens)
        space = KeySpace.of(cache.header)
        size = store.sizes([space.keys(tokens)[0]])[0]
        hit = kv.lookup(tokens, space)
        assert (hit.chunks, hit.tokens) == (3, 3 * C) and hit.header.first_position == 0
        assert 0 < hit.bytes_read <= HEAD_BYTES < size and hit.verdict is None
        same = kvwire.LocalModel(cache.header.arch, cache.header.dtype, cache.header.model, require_fingerprints=False)
        ok = kv.lookup(tokens, space, local=same)
        assert ok.verdict and ok.tokens == 3 * C
        other = kvwire.LocalModel(Architecture(cache.header.arch.layers[:1]), cache.header.dtype, cache.header.model,
                                  require_fingerprints=False)
        refused = kv.lookup(tokens, space, local=other)
        assert not refused.verdict and (refused.chunks, refused.tokens) == (0, 0) and refused.verdict.reasons
        assert kv.lookup(token_ids(3 * C, seed=9), space).chunks == 0  # another prompt: no hit, no bytes
        assert kv.lookup(token_ids(3 * C, seed=9), space).bytes_read == 0
    with pytest.raises(TypeError, match="LocalModel"):
        kv.lookup(tokens, space, local="llama")


def test_store17_lookup_drops_a_first_object_that_is_not_the_keys():
    """KVW-STORE-17: a first object whose header disagrees with its key is a miss and deleted."""
    cache, tokens = make_cache(2 * C), token_ids(2 * C)
    kv = KVStore(MemoryStore())
    kv.put_cache(cache, tokens)
    space = KeySpace.of(cache.header)
    keys = space.keys(tokens)
    kv.store.delete(keys[0])
    kv.store.put(keys[0], kv.store.get(keys[1]))  # chunk 1's object under chunk 0's key
    hit = kv.lookup(tokens, space)
    assert (hit.chunks, hit.tokens) == (0, 0) and not kv.store.exists(keys[0])
    assert kv.counts["incompatible"] == 1


def test_store20_lookup_on_redis_is_two_round_trips(redis_url):
    """On Redis: one round trip for the hit query, one for the first header."""
    from kvwire.store import open_store
    cache, tokens = big_cache(4 * C), token_ids(4 * C)
    kv = KVStore(open_store(redis_url, timeout=5))
    kv.put_cache(cache, tokens)
    hit = kv.lookup(tokens, KeySpace.of(cache.header))
    assert (hit.chunks, hit.round_trips) == (4, 2) and 0 < hit.bytes_read <= HEAD_BYTES


@settings(max_examples=20)
@given(total=st.integers(1, 6), first=st.integers(0, 5))
def test_store11_put_from_a_chunk_boundary_equals_one_put(total, first):
    """KVW-STORE-11: a cache starting at chunk ``f`` (an engine saving the chunks one prefill
    step completed), with every token from 0, writes exactly the objects one whole put writes."""
    first = min(first, total - 1)
    T = total * C
    cache, tokens = make_cache(T), token_ids(T)
    whole, steps = MemoryStore(), MemoryStore()
    KVStore(whole).put_cache(cache, tokens)
    kv = KVStore(steps)
    h = cache.header
    if first:
        head = kvwire.KVCache(h.replace(token_count=first * C),
                              [{c: x[:, :first * C] for c, x in layer.items()} for layer in cache.layers])
        assert kv.put_cache(head, tokens[:first * C]).written == first
    F = first * C
    tail = kvwire.KVCache(h.replace(token_count=T - F, first_position=F,
                                    layer_tokens=tuple(kvwire.TokenRange(F, T - F) for _ in h.layer_tokens)),
                          [{c: x[:, F:] for c, x in layer.items()} for layer in cache.layers])
    res = kv.put_cache(tail, tokens)
    assert res.written == total - first and len(res.keys) == total - first
    assert steps.list() == whole.list()
    assert all(steps.get(k) == whole.get(k) for k in whole.list())
    if F:
        with pytest.raises(ValueError, match="every token from position 0"):
            kv.put_cache(tail, tokens[F:])
