"""kvwire.store (spec/store.md, KVW-STORE-*): the store protocol on both backends, the key
scheme's pinned vectors, KVStore's chunk objects, hits, corruption and eviction."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvwire
from kvwire.format.container import MAGIC
from kvwire.format.header import ModelIdentity
from kvwire.store import (
    KeySpace,
    KVStore,
    LocalStore,
    MemoryStore,
    StoreError,
    codec_fidelity,
    open_store,
    resolve_range,
)

FP = hashlib.sha256(b"store-test-model").digest()
C = 4


def make_cache(tokens: int, *, layers: int = 2, heads: int = 2, dim: int = 8, seed: int = 0, dtype=np.float16,
               fp: bytes = FP):
    rng = np.random.default_rng(seed)
    ks = [rng.standard_normal((heads, tokens, dim)).astype(dtype) for _ in range(layers)]
    vs = [rng.standard_normal((heads, tokens, dim)).astype(dtype) for _ in range(layers)]
    return kvwire.KVCache.from_tensors(ks, vs, model=ModelIdentity(compat_fingerprint=fp), chunk_tokens=C)


def backends(tmp_path):
    return [MemoryStore(), LocalStore(tmp_path / "local")]


# -- the protocol -----------------------------------------------------------------------

def test_store3_resolve_range():
    assert resolve_range(None, 10) == (0, 10)
    assert resolve_range((2, 3), 10) == (2, 5)
    assert resolve_range((8, 5), 10) == (8, 10)  # clipped
    assert resolve_range((12, 5), 10) == (10, 10)  # empty past the end
    assert resolve_range((3, None), 10) == (3, 10)
    assert resolve_range((-4, None), 10) == (6, 10)  # the last 4 bytes
    assert resolve_range((-40, None), 10) == (0, 10)
    for bad in [(1,), (-1, 2), (1, -1), ("a", 1), [0, 1], (True, 1)]:
        with pytest.raises(ValueError):
            resolve_range(bad, 10)


RANGES = st.one_of(st.none(), st.tuples(st.integers(0, 300), st.integers(0, 300)),
                   st.tuples(st.integers(0, 300), st.none()), st.tuples(st.integers(-300, -1), st.none()))


@settings(max_examples=40)
@given(value=st.binary(max_size=257), ranges=st.lists(RANGES, min_size=1, max_size=4))
def test_store1_put_get_ranges_property(tmp_path_factory, value, ranges):
    for store in backends(tmp_path_factory.mktemp("p")):
        assert store.put("a/b/obj", value) is True
        assert store.put("a/b/obj", b"other") is False  # never rewritten, counted
        assert store.stats.skipped == 1
        for r in ranges:
            a, b = resolve_range(r, len(value))
            assert bytes(store.get("a/b/obj", r)) == value[a:b]
        assert store.get_many(["a/b/obj", "a/b/none"], ranges[0]) == [store.get("a/b/obj", ranges[0]), None]


def test_store1_protocol_both_backends(tmp_path):
    """KVW-STORE-1/4 (put, misses), KVW-STORE-5 (batch forms), KVW-STORE-2 (bad keys are refused
    before any I/O), on both backends."""
    for store in backends(tmp_path):
        assert store.get("x") is None and store.exists("x") is False  # a miss is None, not an error
        assert store.put_many([("p/1", b"one"), ("p/2", [b"t", memoryview(b"wo")]), ("q/3", b"3")]) == [True] * 3
        assert bytes(store.get("p/2")) == b"two"
        assert store.exists_many(["p/1", "p/9", "q/3"]) == [True, False, True]
        assert store.list("p/") == ["p/1", "p/2"] and store.list() == ["p/1", "p/2", "q/3"]
        assert store.delete("p/1") is True and store.delete("p/1") is False
        assert store.list("p") == ["p/2"]
        assert store.stats.misses == 1 and store.stats.written == 3
        for bad in ["", "/a", "a//b", "a/../b", "a/.hidden", "é", "a b", "x" * 2000]:
            with pytest.raises(ValueError):
                store.put(bad, b"")
        with pytest.raises(TypeError):
            store.put("k", "a str")


def test_store6_open_store(tmp_path):
    s = open_store(f"file://{tmp_path}/d")
    assert isinstance(s, LocalStore) and s.root == str(tmp_path / "d")
    assert isinstance(open_store("memory://"), MemoryStore)
    for url in ["s3://bucket/x", "nothing", "redis+tls://localhost:6379/0"]:
        with pytest.raises(StoreError, match="not supported.*file://, memory://, redis://, redis-cluster://, "
                                             "rediss://, rediss-cluster://"):
            open_store(url)
    with pytest.raises(StoreError):
        open_store("file://")


def test_store4_local_errors_are_store_errors(tmp_path):
    s = LocalStore(tmp_path / "s")
    s.put("a/b", b"x")
    with pytest.raises(StoreError):
        s.put("a/b/c", b"y")  # a/b is a file, not a directory
    (tmp_path / "s" / "d").mkdir()
    with pytest.raises(StoreError, match="not a regular file"):
        s.get("d")
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(StoreError):
        LocalStore(tmp_path / "f" / "sub")


def test_store7_named_temporary_fallback(tmp_path):
    s = LocalStore(tmp_path)
    s.use_tmpfile = False  # as on a file system that refuses to link an O_TMPFILE file
    assert s.put("a/x", b"1") is True and s.put("a/x", b"2") is False
    assert bytes(s.get("a/x")) == b"1" and os.listdir(tmp_path / "a") == ["x"]
    (tmp_path / "a" / ".tmp-1-dead").write_bytes(b"partial")  # a writer killed mid-put
    os.utime(tmp_path / "a" / ".tmp-1-dead", (1, 1))
    assert s.list() == ["a/x"] and s.gc() == 1


def test_store8_local_ranged_read_is_pread(tmp_path):
    s = LocalStore(tmp_path)
    big = os.urandom(1 << 20)
    s.put("big", big)
    assert bytes(s.get("big", (-10, None))) == big[-10:]
    assert s.stats.bytes_in == 10  # only the range came back
    assert sorted(os.listdir(tmp_path)) == [".kvwire-store", "big"]  # no temporary file left (and the marker)


def _writer(root, n, seed):
    s = LocalStore(root)
    for i in range(n):
        body = hashlib.sha256(f"{i}".encode()).digest() * 4096  # same key -> same bytes, 128 KiB
        s.put(f"obj/{i}", body)
        got = s.get(f"obj/{(i * 7 + seed) % n}")
        if got is not None and bytes(got) != hashlib.sha256(f"{(i * 7 + seed) % n}".encode()).digest() * 4096:
            raise SystemExit(3)  # a partial or wrong object


@pytest.mark.slow
def test_store10_concurrent_processes(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), 40, seed)) for seed in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 4
    s = LocalStore(tmp_path)
    assert s.list() == sorted(f"obj/{i}" for i in range(40))
    for i in range(40):
        assert bytes(s.get(f"obj/{i}")) == hashlib.sha256(f"{i}".encode()).digest() * 4096
    assert not [n for n in os.listdir(tmp_path / "obj") if n.startswith(".")]


def test_store9_lru_eviction(tmp_path):
    for store in [MemoryStore(max_bytes=10_000), LocalStore(tmp_path, max_bytes=10_000, rescan_puts=1)]:
        for i in range(5):
            store.put(f"k{i}", MAGIC + bytes(1992))  # kvwire objects: the only files eviction counts
            if isinstance(store, LocalStore):  # distinct access times, oldest first
                os.utime(store.path(f"k{i}"), ns=(10**18 + i * 10**9, 10**18))
        store.get("k0")  # k0 is now the most recently used
        store.put("k5", MAGIC + bytes(1992))
        assert store.exists("k0") and not store.exists("k1"), store.list()
        assert store.stats.evictions >= 1
        assert store.total_bytes <= 10_000
        with pytest.raises(StoreError, match="size cap"):
            store.put("huge", bytes(20_000))


# -- keys --------------------------------------------------------------------------------

# KVW-STORE-18 vectors, the same as in spec/store.md ("Key vectors"): fingerprint bytes 0..31
VECTOR_FP = bytes(range(32))
VFP = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
VECTORS = [  # (KeySpace arguments, tokens, keys)
    (dict(dtype="bf16", chunk_tokens=4, layers=(0, 2)), [1, 2, 3, 4, 5, 6, 7, 8],
     [f"kvw1/{VFP}/bf16/tp0of1/l0-2/lossless/c4/4e0afdcfd652d55b0ddfde72d75fd789d4aae06790c657e3929545d9cc0c0786",
      f"kvw1/{VFP}/bf16/tp0of1/l0-2/lossless/c4/3c5c0c80786cbd0ed4d14e64654ae99dabea916b4a00dc42fa688355704ab482"]),
    (dict(dtype="f8_e4m3fn", chunk_tokens=4, layers=(0, 2), tp_rank=1, tp_size=2, fidelity="kivi2"), [1, 2, 3, 4],
     [f"kvw1/{VFP}/f8_e4m3fn/tp1of2/l0-2/kivi2/c4/4e0afdcfd652d55b0ddfde72d75fd789d4aae06790c657e3929545d9cc0c0786"]),
    (dict(dtype="bf16", chunk_tokens=256, layers=(0, 32)), list(range(256)),
     [f"kvw1/{VFP}/bf16/tp0of1/l0-32/lossless/c256/89a6851099cd8b198d586be68317172cccd1c27bcc120a1a4d201032ad98f68a"]),
]


def test_store18_key_vectors():
    for args, tokens, want in VECTORS:
        assert KeySpace(VECTOR_FP, **args).keys(tokens) == want


def test_store13_key_layout_from_first_principles():
    """The last segment is KVW-PREFIX-3's chunk hash, recomputed here from its definition."""
    root = hashlib.sha256(b"kvwire.prefix.v1\0" + (1).to_bytes(2, "little") + (4).to_bytes(4, "little")
                          + (32).to_bytes(4, "little") + VECTOR_FP).digest()
    h0 = hashlib.sha256(root + np.array([1, 2, 3, 4], "<u4").tobytes()).digest()
    h1 = hashlib.sha256(h0 + np.array([5, 6, 7, 8], "<u4").tobytes()).digest()
    space = KeySpace(VECTOR_FP, "bf16", 4, (0, 2))
    assert space.keys([1, 2, 3, 4, 5, 6, 7, 8]) == [space.root + h0.hex(), space.root + h1.hex()]
    assert space.root == f"kvw1/{VFP}/bf16/tp0of1/l0-2/lossless/c4/"
    assert space.keys([1, 2, 3, 4, 5]) == space.keys([1, 2, 3, 4])  # whole chunks only
    assert len(space.keys([1, 2, 3, 4, 5], partial=True)) == 2
    assert all(k.isascii() for k in space.keys([1, 2, 3, 4]))


def test_store14_15_16_no_collisions_across_the_root():
    base = dict(fingerprint=VECTOR_FP, dtype="bf16", chunk_tokens=4, layers=(0, 2))
    variants = [base, {**base, "dtype": "f8_e4m3fn"}, {**base, "tp_rank": 1, "tp_size": 2}, {**base, "tp_size": 2},
                {**base, "layers": (0, 1)}, {**base, "fidelity": "fp8-e4m3"}, {**base, "chunk_tokens": 2},
                {**base, "fingerprint": FP}]
    keys = {KeySpace(**v).keys([1, 2, 3, 4])[0] for v in variants}
    assert len(keys) == len(variants)
    assert codec_fidelity("raw") == codec_fidelity("zstd") == codec_fidelity("byteplane") == "lossless"
    assert codec_fidelity("kivi2") == "kivi2"
    for bad in [dict(base, fingerprint=b""), dict(base, dtype="bf17"), dict(base, tp_rank=2, tp_size=2),
                dict(base, layers=(2, 2)), dict(base, fidelity="zstd"), dict(base, chunk_tokens=0)]:
        with pytest.raises(ValueError):
            KeySpace(**bad)
    with pytest.raises(ValueError):
        codec_fidelity("nope")


# -- KVStore -----------------------------------------------------------------------------

def check_kvstore_round_trip(store) -> None:
    """KVW-STORE-11/17/20 on any backend (tests/store/test_store_redis.py runs it on Redis): put_cache,
    leading_hits and get_cache return the tensors bit for bit; a second put writes only the
    new (partial) chunk."""
    kv = KVStore(store)
    cache, tokens = make_cache(10), list(range(100, 110))
    res = kv.put_cache(cache, tokens)
    assert res.written == 2 and res.skipped == 0 and len(store.list()) == 2  # 2 whole chunks; 2 tokens left out
    space = KeySpace.of(cache.header)
    assert kv.leading_hits(space.keys(tokens)) == 2
    got = kv.get_cache(tokens, space)
    assert got.tokens == 8 and got.chunks == 2
    for i in range(2):
        for c in "kv":
            assert np.array_equal(got.cache.layers[i][c], cache.layers[i][c][:, :8])
    assert kvwire.covered_tokens(got.cache.header, tokens) == 8
    # objects are ordinary containers: chunk 1 is a continuation from position 4
    one = kvwire.load(bytes(store.get(space.keys(tokens)[1])))
    assert one.header.first_position == 4 and one.header.token_count == 4
    again = kv.put_cache(cache, tokens, partial=True)
    assert again.written == 1 and again.skipped == 2  # only the partial chunk is new
    full = kv.get_cache(tokens, space)
    assert full.tokens == 10
    assert all(np.array_equal(full.cache.layers[i][c], cache.layers[i][c]) for i in range(2) for c in "kv")
    st_ = kv.stats()
    assert st_["objects_written"] == 3 and st_["objects_skipped"] == 2 and st_["hit_rate"] > 0
    assert st_["checksum_failures"] == 0


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_store11_put_get_cache_round_trip(tmp_path, backend):
    check_kvstore_round_trip(MemoryStore() if backend == "memory" else LocalStore(tmp_path))


def test_store11_shared_prefix_reuse(tmp_path):
    kv = KVStore(LocalStore(tmp_path))
    system = list(range(8))
    a_toks, b_toks = system + [50, 51, 52, 53], system + [60, 61, 62, 63]
    full = make_cache(12, seed=1)
    a = kv.put_cache(full, a_toks)
    b_cache = kvwire.KVCache(full.header, [{c: x.copy() for c, x in layer.items()} for layer in full.layers])
    b = kv.put_cache(b_cache, b_toks)
    assert a.keys[:2] == b.keys[:2] and a.keys[2] != b.keys[2]
    assert a.written == 3 and b.written == 1 and b.skipped == 2
    assert len(kv.store.list()) == 4
    space = KeySpace.of(full.header)
    assert kv.leading_hits(space.keys(system + [70, 71, 72, 73])) == 2


def test_store20_leading_hits_reads_no_bytes(tmp_path):
    kv = KVStore(LocalStore(tmp_path))
    cache, tokens = make_cache(16), list(range(16))
    kv.put_cache(cache, tokens)
    space = KeySpace.of(cache.header)
    before = kv.store.stats.bytes_in
    longer = tokens + list(range(1000, 1000 + 4 * 100))
    assert kv.leading_hits(space.keys(longer)) == 4
    assert kv.store.stats.bytes_in == before and kv.store.stats.gets == 0
    assert kv.leading_hits(space.keys([9] + tokens[1:])) == 0  # a different first token: no hits at all


def test_store17_corruption_is_a_miss_and_deleted(tmp_path):
    store = LocalStore(tmp_path)
    kv = KVStore(store)
    cache, tokens = make_cache(12), list(range(12))
    kv.put_cache(cache, tokens)
    space = KeySpace.of(cache.header)
    keys = space.keys(tokens)
    path = store.path(keys[1])
    raw = bytearray(open(path, "rb").read())
    raw[kvwire.open(bytes(raw)).info(1).offset] ^= 0xFF  # one byte of a chunk body
    with open(path, "r+b") as f:
        f.write(raw)
    got = kv.get_cache(tokens, space)
    assert got.tokens == 4 and got.chunks == 1  # chunk 1 failed: served only the first
    assert kv.stats()["checksum_failures"] == 1 and kv.stats()["misses"] == 2
    assert not store.exists(keys[1]) and store.exists(keys[0]) and store.exists(keys[2])
    assert kv.leading_hits(keys) == 1
    store.put(keys[0], b"not a container")  # skipped: exists; overwrite by hand instead
    with open(store.path(keys[0]), "wb") as f:
        f.write(b"garbage" * 10)
    assert kv.get_cache(tokens, space).cache is None and not store.exists(keys[0])


def test_store17_incompatible_object_is_never_returned():
    store = MemoryStore()
    kv = KVStore(store)
    cache, tokens = make_cache(8), list(range(8))
    space = KeySpace.of(cache.header)
    other = make_cache(8, fp=hashlib.sha256(b"other model").digest())
    wrong = kvwire.encode(kvwire.KVCache(other.header.replace(token_count=4, prefix=None),
                                         [{c: x[:, :4] for c, x in layer.items()} for layer in other.layers]))
    store.put(space.keys(tokens)[0], wrong)
    got = kv.get_cache(tokens, space)
    assert got.cache is None and kv.stats()["incompatible"] == 1 and not store.list()


def test_store12_put_cache_refuses_what_it_cannot_key():
    kv = KVStore(MemoryStore())
    with pytest.raises(ValueError, match="compat fingerprint"):
        kv.put_cache(make_cache(4, fp=b""), range(4))
    with pytest.raises(ValueError, match="token ids"):
        kv.put_cache(make_cache(4), range(5))
    with pytest.raises(TypeError):
        kv.put_cache("cache", range(4))
    with pytest.raises(TypeError):
        KVStore({})
    space = KeySpace.of(make_cache(4).header)
    for bad in [-1, 1.5, True]:
        with pytest.raises(ValueError):
            kv.get_cache(range(4), space, bad)
    with pytest.raises(ValueError):
        kv.get_cache([-1, 2], space)
    with pytest.raises(TypeError):
        kv.get_cache(range(4), "space")
    assert kv.get_cache(range(4), space, 0).cache is None and kv.get_cache([], space).tokens == 0


def test_store19_headers_by_one_batched_ranged_get(tmp_path):
    from kvwire.store.kvstore import HEAD_BYTES
    store = LocalStore(tmp_path)
    kv = KVStore(store)
    small, tokens = make_cache(8), list(range(8))
    kv.put_cache(small, tokens)
    kv.get_cache(tokens, KeySpace.of(small.header))
    assert store.stats.gets == 2  # objects under HEAD_BYTES: the first ranged read was the whole object
    big = make_cache(8, heads=8, dim=512, layers=4, fp=hashlib.sha256(b"big").digest())  # 256 KiB per chunk
    kv.put_cache(big, tokens)
    before, read = store.stats.gets, store.stats.bytes_in
    got = kv.get_cache(tokens, KeySpace.of(big.header))
    assert got.tokens == 8 and store.stats.gets - before == 4  # a header read, then the object, per chunk
    sizes = sum(os.path.getsize(store.path(k)) for k in KeySpace.of(big.header).keys(tokens))
    assert store.stats.bytes_in - read == sizes + 2 * HEAD_BYTES
