"""kvwire.store on Redis (spec/store.md, KVW-STORE-1..6 and 17..20): the store protocol, the
batch forms' round trips and KVStore's chunk caches on RedisStore (one server) and
RedisClusterStore (three masters), against real redis-server processes (tests/redisfix.py).
The failure cases (killed servers, corruption, eviction, silence) are in test_store_faults.py.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import threading
import uuid

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_store import check_kvstore_round_trip

import kvwire
from kvwire.format.header import ModelIdentity
from kvwire.store import KeySpace, KVStore, StoreError, open_store, resolve_range

FP = hashlib.sha256(b"redis-store-test-model").digest()
C = 4
TIMEOUT = 2.0
BACKENDS = ["server", "cluster"]


def make_cache(tokens: int, *, layers: int = 2, heads: int = 2, dim: int = 8, seed: int = 0, chunk: int = C,
               fp: bytes = FP):
    rng = np.random.default_rng(seed)
    ks = [rng.standard_normal((heads, tokens, dim)).astype(np.float16) for _ in range(layers)]
    vs = [rng.standard_normal((heads, tokens, dim)).astype(np.float16) for _ in range(layers)]
    return kvwire.KVCache.from_tensors(ks, vs, model=ModelIdentity(compat_fingerprint=fp), chunk_tokens=chunk)


@pytest.fixture(params=BACKENDS)
def store(request):
    """A RedisStore on the session server or a RedisClusterStore on the session cluster, emptied."""
    url = request.getfixturevalue("redis_url" if request.param == "server" else "redis_cluster_url")
    s = open_store(url, timeout=TIMEOUT)
    yield s
    s.close()


def test_store6_open_store_picks_the_redis_backends(redis_url, redis_cluster_url):
    """KVW-STORE-6: redis:// and redis-cluster:// name the two Redis backends."""
    from kvwire.store.cluster import RedisClusterStore
    from kvwire.store.redis import RedisStore
    with open_store(redis_url, timeout=TIMEOUT) as s:
        assert type(s) is RedisStore and s.url == redis_url
    with open_store(redis_cluster_url, timeout=TIMEOUT) as s:
        assert type(s) is RedisClusterStore


def test_store1_protocol_on_redis(store):
    """KVW-STORE-1/4 (put, skipped rewrites, misses), KVW-STORE-5 (batch forms), KVW-STORE-2
    (bad keys refused before any I/O): the contract of test_store.py's backends, on Redis."""
    assert store.get("x") is None and store.exists("x") is False  # a miss is None, not an error
    assert store.put_many([("p/1", b"one"), ("p/2", [b"t", memoryview(b"wo")]), ("q/3", b"3")]) == [True] * 3
    assert bytes(store.get("p/2")) == b"two"
    assert store.put("p/2", b"other") is False and bytes(store.get("p/2")) == b"two"  # never replaced
    assert store.exists_many(["p/1", "p/9", "q/3"]) == [True, False, True]
    assert store.list("p/") == ["p/1", "p/2"] and store.list() == ["p/1", "p/2", "q/3"]
    assert store.sizes(["p/1", "p/9", "q/3"]) == [3, None, 1]
    assert store.delete("p/1") is True and store.delete("p/1") is False
    assert store.list("p") == ["p/2"]
    assert store.stats.misses == 1 and store.stats.written == 3 and store.stats.skipped == 1
    assert store.stats.deletes == 1 and store.stats.bytes_out == 7
    trips = store.stats.round_trips
    for bad in ["", "/a", "a//b", "a/../b", "a/.hidden", "é", "a b", "x" * 2000]:
        with pytest.raises(ValueError):
            store.put(bad, b"")
        with pytest.raises(ValueError):
            store.get_many(["ok", bad])
    with pytest.raises(TypeError):
        store.put("k", "a str")
    assert store.stats.round_trips == trips  # refused before any I/O
    # empty objects and empty ranges still tell a hit from a miss
    assert store.put("e", b"") is True and store.get("e") == b"" and store.get("e", (0, 0)) == b""
    assert store.get("none", (0, 0)) is None and store.sizes(["e"]) == [0]


def test_store1_binary_values_and_buffer_lists(store):
    """Every byte value survives (NUL, CR LF, high bytes), values given as many buffers are
    stored as their concatenation, and large memoryviews are not copied wrong."""
    body = bytes(range(256)) * 1000 + b"\r\n$-1\r\n*3\r\n"
    big = np.arange(1 << 18, dtype=np.uint32)  # 1 MiB
    parts = [b"head", memoryview(big).cast("B"), bytearray(b"\r\n"), memoryview(body)[10:5000]]
    assert store.put("bin/a", body) and store.put("bin/b", parts)
    assert bytes(store.get("bin/a")) == body
    assert bytes(store.get("bin/b")) == b"".join(bytes(p) for p in parts)
    assert store.stats.bytes_out == len(body) + sum(memoryview(p).nbytes for p in parts)


def test_store3_ranges_are_transferred_alone(store):
    """KVW-STORE-3: a ranged get returns (and counts) only the range."""
    value = np.random.default_rng(3).bytes(1 << 20)
    store.put("r/big", value)
    before = store.stats.bytes_in
    assert bytes(store.get("r/big", (-10, None))) == value[-10:]
    assert bytes(store.get("r/big", (1000, 24))) == value[1000:1024]
    assert store.stats.bytes_in - before == 34
    for bad in [(1,), (-1, 2), (1, -1), ("a", 1), [0, 1], (True, 1)]:
        with pytest.raises(ValueError):
            store.get("r/big", bad)


RANGES = st.one_of(st.none(), st.tuples(st.integers(0, 300), st.integers(0, 300)),
                   st.tuples(st.integers(0, 300), st.none()), st.tuples(st.integers(-300, -1), st.none()))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=30)
@given(value=st.binary(max_size=257), ranges=st.lists(RANGES, min_size=1, max_size=4))
def test_store3_put_get_ranges_property(redis_server, redis_cluster, backend, value, ranges):
    """KVW-STORE-1/3 as a property: any value, any range, the Python slice of the value."""
    url = redis_server.url if backend == "server" else redis_cluster.url
    key = f"prop/{uuid.uuid4().hex}/obj"
    with open_store(url, timeout=TIMEOUT) as store:
        assert store.put(key, value) is True
        assert store.put(key, b"other") is False  # never rewritten, counted
        assert store.stats.skipped == 1
        for r in ranges:
            a, b = resolve_range(r, len(value))
            assert bytes(store.get(key, r)) == value[a:b]
        assert store.get_many([key, key + "-none"], ranges[0]) == [store.get(key, ranges[0]), None]
        assert store.delete(key)


def test_store5_batches_are_one_round_trip_per_node(store):
    """KVW-STORE-5: get_many, put_many and exists_many of 100 keys take one round trip on
    one server and at most one per node on the cluster."""
    nodes = 1 if type(store).__name__ == "RedisStore" else 3
    keys = [f"b/{i}" for i in range(100)]
    for call in [lambda: store.put_many([(k, k.encode()) for k in keys]), lambda: store.exists_many(keys),
                 lambda: store.get_many(keys), lambda: store.get_many(keys, (0, 2))]:
        before = store.stats.round_trips
        call()
        assert 1 <= store.stats.round_trips - before <= nodes
    assert [bytes(v) for v in store.get_many(keys)] == [k.encode() for k in keys]
    assert store.stats.unavailable == 0


def test_store20_leading_is_one_round_trip_and_reads_no_bytes(store):
    """KVW-STORE-5/20: leading() over 512 keys is one round trip on a server (at most one per
    node on the cluster), reads no object bytes and stops at the first miss."""
    nodes = 1 if type(store).__name__ == "RedisStore" else 3
    keys = [f"lead/{i:04d}" for i in range(512)]
    store.put_many([(k, bytes(1000)) for k in keys[:300]] + [(keys[301], b"after the gap")])
    before = (store.stats.round_trips, store.stats.bytes_in, store.stats.gets)
    assert store.leading(keys) == 300
    trips, read, gets = (a - b for a, b in zip((store.stats.round_trips, store.stats.bytes_in, store.stats.gets),
                                               before))
    assert (trips == 1) if nodes == 1 else (1 <= trips <= nodes)
    assert read == 0 and gets == 0
    assert store.leading(keys[:300]) == 300 and store.leading(keys[300:]) == 0 and store.leading([]) == 0


def test_info_reports_objects_and_server_counters(store):
    store.put_many([("i/a", bytes(100)), ("i/b", bytes(23))])
    info = store.info()
    assert info["objects"] == 2 and info["bytes"] == 123
    assert info["evicted_keys"] == 0 and info["used_memory"] > 0 and "maxmemory_policy" in info


def test_cluster_keys_spread_over_the_three_masters(redis_cluster, redis_cluster_url):
    """Each object lives on the master that owns its key's slot, and 60 chunk keys use all three."""
    kv = KVStore(open_store(redis_cluster_url, timeout=TIMEOUT))
    cache, tokens = make_cache(240), list(range(240))
    res = kv.put_cache(cache, tokens)
    assert res.written == 60
    owners = [redis_cluster.node_for_key(k) for k in res.keys]
    assert sorted(set(owners)) == [0, 1, 2]
    clients = [n.client() for n in redis_cluster.nodes]
    try:
        assert [c.dbsize() for c in clients] == [owners.count(i) for i in range(3)]
        for k, i in zip(res.keys, owners):
            assert clients[i].exists(k) == 1
            assert clients[i].get(k) == bytes(kv.store.get(k))
    finally:
        for c in clients:
            c.close()
    kv.store.close()


def test_store11_kvstore_round_trip_on_redis(store):
    """KVW-STORE-11/17/20 on Redis and the cluster: test_store.check_kvstore_round_trip."""
    check_kvstore_round_trip(store)


def test_store11_kvstore_zstd_and_bigger_chunks(store):
    """Chunk objects over the 64 KiB header read (a header read, then the body) and a zstd codec."""
    kv = KVStore(store)
    cache, tokens = make_cache(64, layers=4, heads=8, dim=128, chunk=16, seed=5), list(range(64))
    assert kv.put_cache(cache, tokens, codec="zstd").written == 4
    got = kv.get_cache(tokens, KeySpace.of(cache.header, codec="zstd"))
    assert got.tokens == 64
    assert all(np.array_equal(got.cache.layers[i][c], cache.layers[i][c]) for i in range(4) for c in "kv")


def _put_same_keys(url, keys, tag, barrier, queue):
    with open_store(url, timeout=10.0) as s:
        barrier.wait(30)
        queue.put((tag, [s.put(k, f"{tag}:{k}".encode() * 100) for k in keys]))


def _check_one_writer(store, keys, results):
    """Exactly one writer wrote each key, and the stored object is that writer's."""
    for i, k in enumerate(keys):
        winners = [tag for tag, wrote in results.items() if wrote[i]]
        assert len(winners) == 1, (k, winners)
        assert bytes(store.get(k)) == f"{winners[0]}:{k}".encode() * 100


def test_store1_racing_threads_one_writer_per_key(store):
    """KVW-STORE-1: two threads put the same keys at once through one store: one writes, one skips."""
    keys = [f"race/t/{i}" for i in range(200)]
    barrier, results = threading.Barrier(2), {}

    def run(tag):
        barrier.wait(30)
        results[tag] = [store.put(k, f"{tag}:{k}".encode() * 100) for k in keys]

    threads = [threading.Thread(target=run, args=(t,)) for t in ("A", "B")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == ["A", "B"]
    _check_one_writer(store, keys, results)
    assert store.stats.written == 200 and store.stats.skipped == 200


@pytest.mark.parametrize("backend", BACKENDS)
def test_store1_racing_processes_one_writer_per_key(request, backend):
    """KVW-STORE-1: two processes put the same keys at once: exactly one writes each."""
    url = request.getfixturevalue("redis_url" if backend == "server" else "redis_cluster_url")
    ctx = mp.get_context("spawn")
    keys = [f"race/p/{i}" for i in range(200)]
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_put_same_keys, args=(url, keys, tag, barrier, queue)) for tag in ("A", "B")]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0]
    with open_store(url, timeout=TIMEOUT) as s:
        _check_one_writer(s, keys, results)


def test_store4_bad_urls_and_options(redis_server):
    """KVW-STORE-4/6: a malformed URL or option is refused at once with a clear message."""
    for url in ["redis://127.0.0.1:notaport/0", "redis://127.0.0.1:6379/db"]:
        with pytest.raises(StoreError):
            open_store(url)
    with pytest.raises(ValueError):
        open_store(redis_server.url, timeout=-1)
