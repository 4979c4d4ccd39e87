"""The Redis backend's wire side (spec/store.md section 8): RESP packing without copies,
URL parsing, the scripts' semantics on a real server, and the cost of a put in Python
memory (a 32 MiB object must reach the socket without a second full copy)."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwire.store import RedisClusterStore, RedisStore, StoreError, open_store
from kvwire.store.base import check_keys
from kvwire.store.cluster import RedisClusterStore as Cluster
from kvwire.store.redis import COALESCE, pack


def resp(args) -> bytes:
    """RESP of a command, built the obvious way (the reference for ``pack``)."""
    enc = [a if isinstance(a, bytes) else str(a).encode() for a in args]
    return b"*%d\r\n" % len(enc) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in enc)


@given(st.lists(st.one_of(st.binary(max_size=40), st.integers(-10**6, 10**6), st.text("abc/._-", max_size=20)),
                min_size=1, max_size=8))
def test_pack_small_arguments_is_resp(args):
    assert b"".join(pack(args)) == resp(args)


@given(st.lists(st.integers(0, 3 * COALESCE), min_size=1, max_size=5))
def test_pack_buffers_pass_large_views_through(sizes):
    """KVW-STORE-21: a value given as several buffers is one bulk string; buffers of
    COALESCE bytes or more go to the socket as the caller's memoryviews (no copy)."""
    bufs = [memoryview(np.full(n, i % 251, np.uint8)) for i, n in enumerate(sizes)]
    chunks = pack(["SET", "k", bufs, "NX"])
    assert b"".join(chunks) == resp(["SET", "k", b"".join(bufs), "NX"])
    passed = [c for c in chunks if isinstance(c, memoryview)]
    assert len(passed) == sum(n >= COALESCE for n in sizes)
    assert all(any(c.obj is b.obj for b in bufs) for c in passed)


def test_check_keys_batch_agrees_with_check_key():
    """KVW-STORE-2 on a batch: one regular-expression pass, the same verdicts."""
    good = ["a", "a/b", "kvw1/00ff/bf16/tp0of1/l0-2/lossless/c4/" + "0" * 64, "A-_.z/9"]
    assert check_keys(good) == good
    for bad in ["", "a//b", "/a", "a/", ".a", "a/.b", "a\nb", "a b", "é", "a" * 1025]:
        with pytest.raises(ValueError):
            check_keys(good + [bad])
    with pytest.raises(TypeError):
        check_keys(["a", b"b"])


def test_store6_redis_urls():
    """KVW-STORE-6: redis:// and redis-cluster:// URLs; bad ones are StoreErrors at once."""
    s = open_store("redis://127.0.0.1:1/3", timeout=0.5)  # nothing is contacted yet
    assert isinstance(s, RedisStore) and s.url == "redis://127.0.0.1:1/3"
    assert open_store("redis://localhost").url == "redis://localhost:6379/0"
    for bad in ["redis://127.0.0.1:x/0", "redis://127.0.0.1:6379/db", "redis://:99999", "redis-cluster://",
                "redis-cluster://127.0.0.1:7000/2"]:
        with pytest.raises(StoreError):
            open_store(bad)
    with pytest.raises(ValueError, match="timeout"):
        open_store("redis://127.0.0.1:6379/0", timeout=0)


def test_store25_unreachable_server_is_a_store_error(tmp_path):
    """KVW-STORE-25: nothing listens: every call is a StoreError, at once."""
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    s = open_store(f"redis://127.0.0.1:{port}/0", timeout=0.5)
    for call in (lambda: s.get("a"), lambda: s.put("a", b"x"), lambda: s.leading(["a"]), lambda: s.list()):
        with pytest.raises(StoreError, match="cannot connect|Connection"):
            call()
    with pytest.raises(StoreError, match="no seed node"):
        open_store(f"redis-cluster://127.0.0.1:{port}", timeout=0.5)


def test_store22_scripts_tell_misses_from_empty_ranges(redis_url):
    """KVW-STORE-22: an empty object, a range past the end and a zero-length range are
    hits (b""); the same ranges of a missing key are misses (None)."""
    s = open_store(redis_url, timeout=2)
    assert s.put("e", b"") and s.put("o", b"0123456789")
    for key, rng, want in [("e", None, b""), ("e", (0, 5), b""), ("o", (20, 5), b""), ("o", (3, 0), b""),
                           ("o", (0, 0), b""), ("o", (-3, None), b"789"), ("o", (8, None), b"89"),
                           ("o", (-30, None), b"0123456789"), ("o", (2, 3), b"234")]:
        assert s.get(key, rng) == want, (key, rng)
        assert s.get("missing", rng) is None
    assert s.sizes(["e", "o", "missing"]) == [0, 10, None]


def test_store23_leading_is_one_script_and_stops_at_the_first_miss(redis_url):
    """KVW-STORE-23: one round trip whatever the length; the hits end at the first miss."""
    s = open_store(redis_url, timeout=2)
    keys = [f"p/{i}" for i in range(600)]
    s.put_many([(k, b"x") for k in keys[:400]] + [(k, b"x") for k in keys[401:]])
    before = s.stats.round_trips
    assert s.leading(keys) == 400
    assert s.leading(keys[:400]) == 400
    assert s.leading(keys[401:]) == 199
    assert s.stats.round_trips - before == 3
    assert s.stats.bytes_in == 0


def test_store21_put_sends_the_encoders_buffers_without_a_full_copy(redis_url):
    """KVW-STORE-21 and the zero-copy write: a 32 MiB object given as buffers is
    sent with well under one object's worth of Python allocations."""
    s = open_store(redis_url, timeout=10)
    data = np.random.default_rng(0).integers(0, 255, 32 << 20, dtype=np.uint8)
    bufs = [memoryview(data[:4096]), memoryview(data[4096:16 << 20]), memoryview(data[16 << 20:])]
    s.put("warm", b"x")
    gc.collect()
    tracemalloc.start()
    try:
        assert s.put("big", bufs) is True
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"put allocated {peak} bytes for a 32 MiB object"
    assert s.get("big") == data.tobytes()
    assert s.get("big", (4090, 10)) == data[4090:4100].tobytes()


def test_cluster_slot_is_redis_crc16():
    """KVW-STORE-24: the slot function agrees with Redis's CRC16/XMODEM mod 16384."""
    from redis.crc import key_slot
    rng = np.random.default_rng(1)
    for _ in range(200):
        key = "kvw1/" + bytes(rng.integers(0, 256, 16, dtype=np.uint8)).hex()
        assert Cluster.slot(key) == key_slot(key.encode())
    assert Cluster.slot("123456789") == 0x31C3 & 16383  # the CRC16/XMODEM check value


def test_store24_cluster_routes_per_master(redis_cluster_url):
    """KVW-STORE-24: a batch costs at most one round trip per master; keys land on the
    master owning their slot."""
    s = open_store(redis_cluster_url, timeout=2)
    assert isinstance(s, RedisClusterStore) and len(s.nodes()) == 3
    keys = [f"kvw1/x/{i}" for i in range(300)]
    before = s.stats.round_trips
    assert all(s.put_many([(k, k.encode()) for k in keys]))
    assert s.stats.round_trips - before == 3
    before = s.stats.round_trips
    assert s.leading(keys) == 300 and s.stats.round_trips - before == 3
    assert s.get_many(keys[:5]) == [k.encode() for k in keys[:5]]
    assert s.list("kvw1/x/") == sorted(keys)
    assert s.delete(keys[150]) and s.leading(keys) == 150


def test_store24_moved_refreshes_the_slot_map_and_retries(redis_cluster_url, redis_cluster):
    """KVW-STORE-24: a slot moved to another master after the client read the slot map: the
    old owner answers MOVED, the client refreshes the map and retries once, and the object
    lands on (and is read from) the new owner."""
    s = open_store(redis_cluster_url, timeout=2)
    key = "kvw1/moved/probe"
    slot = s.slot(key)
    clients = [n.client() for n in redis_cluster.nodes]
    try:
        ids = [c.execute_command("CLUSTER", "MYID").decode() for c in clients]
        owner = redis_cluster.node_for_key(key)
        target = (owner + 1) % len(clients)
        for c in [clients[target]] + [c for i, c in enumerate(clients) if i != target]:
            c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target])  # the slot is empty: a plain move
        before = s.stats.round_trips
        assert s.put(key, b"moved") is True  # the stale map sends it to the old owner first
        assert s.stats.round_trips - before >= 3  # MOVED, CLUSTER SLOTS, the retry
        assert clients[target].get(key) == b"moved"  # the old owner now answers MOVED itself
        assert s.get(key) == b"moved" and s.leading([key]) == 1
    finally:
        clients[target].execute_command("DEL", key)
        for c in [clients[owner]] + [c for i, c in enumerate(clients) if i != owner]:
            c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[owner])
        for c in clients:
            c.close()
