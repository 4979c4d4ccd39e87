"""Layer-by-layer loading (spec/store.md KVW-STORE-27, kvwire.store.layerwise): a request's
chunk objects opened with two batched reads (headers, tails), then one batched ranged read
per layer; every layer equals what get_cache returns; a failing object cuts the served
tokens for the layers after it; hostile tails never allocate; Redis and the cluster."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kvstore import CODECS, C, big_cache, make_cache, replace_object, same_bits, token_ids

import kvwire
from kvwire.store import KeySpace, KVStore, LocalStore, MemoryStore
from kvwire.store.layerwise import LayerwiseLoad, fetch_layer


class RangeCountingStore(MemoryStore):
    """A real MemoryStore that records each batch call and its ranges."""

    def __init__(self):
        super().__init__()
        self.batches: list = []

    def get_many(self, keys, byte_range=None):
        keys = list(keys)
        self.batches.append(("get_many", len(keys), byte_range))
        return super().get_many(keys, byte_range)

    def get_ranges(self, requests):
        requests = list(requests)
        self.batches.append(("get_ranges", len(requests), [r for _, r in requests]))
        return super().get_ranges(requests)


def layers_of(load, n_layers):
    return [load.load_layer(i) for i in range(n_layers)]


@settings(max_examples=30, deadline=None)
@given(T=st.integers(0, 23), partial=st.booleans(), codec=st.sampled_from(CODECS), n_chunks=st.sampled_from([None, 0, 1, 3]),
       big=st.booleans(), seed=st.integers(0, 3))
def test_store27_layerwise_equals_get_cache_property(T, partial, codec, n_chunks, big, seed):
    """KVW-STORE-27: for any cache, codec and chunk limit, the layers of a layer-wise load
    are bit-identical to get_cache's, over the same served tokens."""
    kv = KVStore(MemoryStore())
    cache = big_cache(T, seed) if big else make_cache(T, seed=seed)
    tokens = token_ids(T, seed)
    kv.put_cache(cache, tokens, codec=codec, partial=partial)
    space = KeySpace.of(cache.header, codec=codec)
    want = kv.get_cache(tokens, space, n_chunks=n_chunks)
    load = LayerwiseLoad(kv, tokens, space, n_chunks=n_chunks)
    assert load.tokens == load.served == want.tokens
    if not want.tokens:
        assert load.header is None
        return
    for i, layer in enumerate(layers_of(load, cache.num_layers)):
        for c in "kv":
            assert same_bits(layer[c], want.cache.layers[i][c])
    assert load.served == want.tokens


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_store27_one_batched_read_per_layer_after_two_to_open(tmp_path, backend):
    """Opening is one header batch and one tail batch (suffix reads); each layer is one
    get_ranges batch of one range per object, covering that layer's frames only."""
    store = RangeCountingStore() if backend == "memory" else LocalStore(tmp_path)
    kv = KVStore(store)
    cache, tokens = big_cache(20), token_ids(20)
    kv.put_cache(cache, tokens)
    space = KeySpace.of(cache.header)
    load = LayerwiseLoad(kv, tokens, space)
    obj = len(kvwire.store.KeySpace.of(cache.header).keys(tokens))
    if backend == "memory":
        assert [b[0] for b in store.batches] == ["get_many", "get_many"]
        assert store.batches[1][2][0] < 0  # a suffix: end frame, index, trailer
    layer_bytes = 2 * 8 * C * 256 * 2  # K and V of one layer of one chunk
    for i in range(4):
        got = load.load_layer(i)
        assert same_bits(got["k"], cache.layers[i]["k"]) and same_bits(got["v"], cache.layers[i]["v"])
        if backend == "memory":
            name, n, ranges = store.batches[-1]
            assert name == "get_ranges" and n == obj
            assert all(layer_bytes < length < layer_bytes + 4 * 64 for _, length in ranges)
    whole = sum(len(store.get(k)) for k in space.keys(tokens))
    assert kv.counts["bytes_read"] < whole + (64 + 4) * 1024 * obj  # the heads (64 KiB) and tails, every body once


def test_store27_several_loads_share_one_round_trip_per_layer(redis_url):
    """Over a real redis-server: two requests' loads open in 2 round trips each and then
    fetch each layer together: one pipelined round trip per layer for the whole step."""
    store = kvwire.store.open_store(redis_url)
    try:
        kv = KVStore(store)
        a, b = big_cache(12, 1), big_cache(8, 2)
        ta, tb = token_ids(12, 1), token_ids(8, 2)
        kv.put_cache(a, ta)
        kv.put_cache(b, tb)
        space = KeySpace.of(a.header)
        before = store.stats.round_trips
        la, lb = LayerwiseLoad(kv, ta, space), LayerwiseLoad(kv, tb, space)
        assert store.stats.round_trips - before == 4
        for i in range(4):
            before = store.stats.round_trips
            fetch_layer([la, lb], i)
            assert store.stats.round_trips - before == 1
            assert same_bits(la.decode(i)["k"], a.layers[i]["k"]) and same_bits(lb.decode(i)["v"], b.layers[i]["v"])
    finally:
        store.close()


def test_store27_over_a_redis_cluster(redis_cluster_url):
    store = kvwire.store.open_store(redis_cluster_url)
    try:
        kv = KVStore(store)
        cache, tokens = big_cache(20, 3), token_ids(20, 3)
        kv.put_cache(cache, tokens)
        load = LayerwiseLoad(kv, tokens, KeySpace.of(cache.header))
        assert load.tokens == 20
        for i, layer in enumerate(layers_of(load, 4)):
            assert same_bits(layer["k"], cache.layers[i]["k"]) and same_bits(layer["v"], cache.layers[i]["v"])
    finally:
        store.close()


@pytest.mark.parametrize("size", ["small", "big"])
def test_store17_corrupt_body_in_layer_2_cuts_the_later_layers(size):
    """KVW-STORE-17 layer by layer: a flipped byte in layer 2 of chunk 3 of 5 leaves layers
    0-1 whole (20 tokens), cuts layers 2-3 to the 12 tokens before it, deletes the object,
    and ``served`` (what every layer holds) is 12."""
    store = MemoryStore()
    kv = KVStore(store)
    cache = make_cache(20, layers=4) if size == "small" else big_cache(20)
    tokens = token_ids(20)
    keys = kv.put_cache(cache, tokens).keys
    r = kvwire.open(store.get(keys[3]))
    i = next(j for j in range(r.chunk_count) if r.info(j).layer == 2)
    data = bytearray(store.get(keys[3]))
    data[r.info(i).offset + 3] ^= 0x10
    replace_object(store, keys[3], bytes(data))
    load = LayerwiseLoad(kv, tokens, KeySpace.of(cache.header))
    assert load.tokens == 20
    got = layers_of(load, 4)
    assert [x["k"].shape[1] for x in got] == [20, 20, 12, 12]
    assert load.served == 12
    assert all(same_bits(got[j]["v"], cache.layers[j]["v"][:, :got[j]["v"].shape[1]]) for j in range(4))
    assert kv.counts["checksum_failures"] == 1 and not store.exists(keys[3])


def test_store27_object_evicted_between_open_and_a_layer_is_a_miss_from_there():
    store = MemoryStore()
    kv = KVStore(store)
    cache, tokens = big_cache(20), token_ids(20)
    keys = kv.put_cache(cache, tokens).keys
    load = LayerwiseLoad(kv, tokens, KeySpace.of(cache.header))
    first = load.load_layer(0)
    assert first["k"].shape[1] == 20
    store.delete(keys[1])  # evicted by another node's LRU before layer 1 is read
    second = load.load_layer(1)
    assert second["k"].shape[1] == 4 and load.served == 4
    assert same_bits(second["k"], cache.layers[1]["k"][:, :4])


def test_store27_hostile_trailer_never_allocates_and_is_a_miss():
    """A tail whose trailer claims a 1 TiB object is refused before any buffer is made
    (the header bounds an object's size), counted corrupt, deleted; the chunks before it
    are served."""
    import struct

    store = MemoryStore()
    kv = KVStore(store)
    cache, tokens = big_cache(12), token_ids(12)
    keys = kv.put_cache(cache, tokens).keys
    data = bytearray(store.get(keys[1]))
    struct.pack_into("<Q", data, len(data) - 32, 1 << 40)  # index_offset
    replace_object(store, keys[1], bytes(data))
    load = LayerwiseLoad(kv, tokens, KeySpace.of(cache.header))
    assert load.tokens == 4 and kv.counts["corrupt"] == 1 and not store.exists(keys[1])
    assert all(isinstance(b, np.ndarray) and b.nbytes < 2 * len(data) for b in load.buffers)


def test_store27_small_objects_are_read_whole_at_open():
    """Objects under HEAD_BYTES are whole after the header read: no tail, no layer reads."""
    store = RangeCountingStore()
    kv = KVStore(store)
    cache, tokens = make_cache(12), token_ids(12)
    kv.put_cache(cache, tokens)
    load = LayerwiseLoad(kv, tokens, KeySpace.of(cache.header))
    assert [b[0] for b in store.batches] == ["get_many"]
    for i, x in enumerate(layers_of(load, 3)):
        assert same_bits(x["k"], cache.layers[i]["k"])
    assert [b[0] for b in store.batches] == ["get_many"]


def test_store27_misuse_is_refused_clearly():
    kv = KVStore(MemoryStore())
    with pytest.raises(TypeError, match="KVStore"):
        LayerwiseLoad(MemoryStore(), [1, 2], None)
    with pytest.raises(TypeError, match="KeySpace"):
        LayerwiseLoad(kv, [1, 2], "space")
    space = KeySpace.of(make_cache(4).header)
    with pytest.raises(ValueError, match="n_chunks"):
        LayerwiseLoad(kv, [1, 2], space, n_chunks=-1)
    with pytest.raises(ValueError, match="nothing to decode"):
        LayerwiseLoad(kv, [1, 2, 3, 4], space).decode(0)


@pytest.mark.parametrize("backend", ["memory", "local", "redis", "cluster"])
def test_store5_get_ranges_gives_each_key_its_own_range(tmp_path, backend, request):
    """KVW-STORE-5: get_ranges answers (key, range) pairs in order, each with its own range
    (prefix, middle, suffix, whole, empty), a missing key as None; one round trip on Redis."""
    if backend in ("redis", "cluster"):
        url = request.getfixturevalue("redis_url" if backend == "redis" else "redis_cluster_url")
        store = kvwire.store.open_store(url)
    else:
        store = MemoryStore() if backend == "memory" else LocalStore(tmp_path)
    try:
        data = {f"k/{i}": bytes(range(i, i + 50)) for i in range(6)}
        for k, v in data.items():
            store.put(k, v)
        reqs = [("k/0", (0, 10)), ("k/1", (5, 7)), ("k/2", (-8, None)), ("k/3", None), ("k/4", (3, 0)),
                ("gone", (0, 4)), ("k/5", (45, None)), ("k/0", (40, 100))]
        before = store.stats.round_trips
        got = store.get_ranges(reqs)
        want = [data["k/0"][:10], data["k/1"][5:12], data["k/2"][-8:], data["k/3"], b"", None, data["k/5"][45:],
                data["k/0"][40:]]
        assert [None if g is None else bytes(g) for g in got] == want
        if backend == "redis":
            assert store.stats.round_trips - before == 1
        assert store.get_ranges([]) == []
    finally:
        store.close()


@settings(max_examples=20, deadline=None)
@given(T=st.integers(1, 23), codec=st.sampled_from(CODECS), big=st.booleans(), seed=st.integers(0, 3))
def test_store27_parts_are_the_layer_as_views_of_the_replies_property(T, codec, big, seed):
    """``parts`` hands out each object's layer in token order, bit-identical to ``decode``;
    a raw body is a read-only view of the store's reply (no copy between the store and the
    caller), and a decoded codec body an array of its own."""
    kv = KVStore(MemoryStore())
    cache = big_cache(T, seed) if big else make_cache(T, seed=seed)
    tokens = token_ids(T, seed)
    kv.put_cache(cache, tokens, codec=codec, partial=True)
    space = KeySpace.of(cache.header, codec=codec)
    want = kv.get_cache(tokens, space)
    load = LayerwiseLoad(kv, tokens, space)
    for i in range(cache.num_layers):
        fetch_layer([load], i)
        parts = load.parts(i)
        assert [a for a, _ in parts] == load.starts[:len(parts)]
        assert sum(p["k"].shape[1] for _, p in parts) == load.served == want.tokens
        for a, p in parts:
            for c in "kv":
                n = p[c].shape[1]
                assert same_bits(p[c], want.cache.layers[i][c][:, a:a + n])
                if codec == "raw" and not big:
                    assert not p[c].flags.writeable  # a view of the reply, not a copy
    assert load.served == want.tokens


def test_store27_a_corrupt_body_in_a_reply_cuts_served_and_ends_the_parts():
    """KVW-CSUM-1 on the reply itself: a body corrupted between the store and the loader
    (flipped in the reply) fails its checksum, the object is counted and deleted, and the
    parts stop before it."""
    kv = KVStore(MemoryStore())
    cache, tokens = big_cache(3 * C), token_ids(3 * C)
    kv.put_cache(cache, tokens)
    space = KeySpace.of(cache.header)
    load = LayerwiseLoad(kv, tokens, space)
    reqs = load.layer_requests(1)
    replies = kv.store.get_ranges(reqs)
    bad = bytearray(replies[1])
    bad[-1] ^= 0xFF  # the last byte of the layer's last body in object 1
    load.take(1, [replies[0], bytes(bad), replies[2]])
    parts = load.parts(1)
    assert [a for a, _ in parts] == [0] and load.served == C
    assert kv.counts.checksum_failures == 1 and not kv.store.exists(load.keys[1])


def test_reader_stored_at_checks_the_window_like_the_whole_object():
    """``Reader.stored_at`` over a window of the object's bytes gives the same body as
    ``stored``, checks frame and checksum there, and refuses a window that does not hold
    the record (the caller's range is wrong: a ValueError, not a format error)."""
    from kvwire.format.container import FRAME_SIZE
    from kvwire.format.errors import ChecksumError

    cache = big_cache(C)
    blob = kvwire.encode(cache)
    r = kvwire.open(blob)
    i = 3
    c, body = r.stored(i)
    lo = c.offset - FRAME_SIZE
    window = blob[lo:c.offset + c.stored_length]
    c2, body2 = kvwire.open(blob).stored_at(i, window, lo)
    assert c2 == c and bytes(body2) == bytes(body)
    with pytest.raises(ValueError, match="does not hold"):
        kvwire.open(blob).stored_at(i, window[:-1], lo)
    with pytest.raises(ValueError, match="does not hold"):
        kvwire.open(blob).stored_at(i, window, lo + FRAME_SIZE)
    bad = bytearray(window)
    bad[-1] ^= 1
    with pytest.raises(ChecksumError):
        kvwire.open(blob).stored_at(i, bytes(bad), lo)
