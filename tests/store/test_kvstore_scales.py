"""KVStore with scaled fp8 caches (revision 1.1, kvwire-v1.md KVW-SCALE-8; spec/store.md).

A scaled fp8 cache goes in and out of the store with its elements bit for bit and its
scales exact, whole and as layer ranges (each object of model layers [a, b) carries the
scales of those layers, KVW-SCALE-8), raw and zstd, on the in-process, file and Redis
backends; the key's dtype segment is the fp8 dtype (KVW-STORE-14); keys do not bind
scales, so an object with other scales under the same key is still served, and the
receiver's compatibility check (``lookup(local=...)``, crossmodel.md KVW-XM-10) is what
tells it to rescale or refuse.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import forge
import kvwire
from kvwire.format.header import ModelIdentity
from kvwire.format.kv_scales import KV_SCALES_BIT, KVScale
from kvwire.model.rescale import rescale_cache
from kvwire.store import KeySpace, KVStore, LocalStore, MemoryStore, open_store
from kvwire.store.kvstore import held_layers

FP = hashlib.sha256(b"kvstore-scales-model").digest()
C = 4
FP8 = ("f8_e4m3fn", "f8_e5m2", "f8_e4m3fnuz")
SCALES = ((0.0234375, 0.01171875), (0.10000000149011612, 0.5), (3.5, 0.0078125))
OTHER = ((0.5, 0.25), (0.10000000149011612, 0.5), (1.0, 2.0))  # layers 0 and 2 differ from SCALES


def scaled_cache(tokens: int, scales=SCALES, *, dtype="f8_e4m3fn", seed=0) -> kvwire.KVCache:
    rng = np.random.default_rng(seed)
    n = len(scales)
    ks = [forge.random_tensor(rng, (2, tokens, 8), dtype) for _ in range(n)]
    vs = [forge.random_tensor(rng, (2, tokens, 8), dtype) for _ in range(n)]
    return kvwire.KVCache.from_tensors(ks, vs, model=ModelIdentity(compat_fingerprint=FP), chunk_tokens=C,
                                       kv_scales=scales)


def token_ids(n: int, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed + 7).integers(0, 50_000, n)]


def same_bits(x, y) -> bool:
    x, y = np.asarray(x), np.asarray(y)
    return x.shape == y.shape and np.array_equal(x.view(np.uint8), y.view(np.uint8))


def check_objects(store, keys, scales, a, b) -> None:
    """Every object is a valid scaled container (bit 3, format 1.1) with the scales of model
    layers [a, b) (KVW-SCALE-8) and, for a range, its range map."""
    for key in keys:
        with kvwire.open(bytes(store.get(key))) as r:
            r.validate()
            h = r.header
            assert h.required_features & KV_SCALES_BIT and h.format_minor == 1
            assert h.kv_scales == tuple(KVScale(*e) for e in scales[a:b])
            assert held_layers(h) == (a, b)


@settings(max_examples=25, deadline=None)
@given(T=st.integers(1, 14), layers=st.sampled_from([None, (0, 3), (0, 1), (1, 3), (2, 3)]),
       codec=st.sampled_from(["raw", "zstd"]), dtype=st.sampled_from(FP8), seed=st.integers(0, 3))
def test_scale8_store16_scaled_round_trip_property(T, layers, codec, dtype, seed):
    """KVW-SCALE-8, KVW-STORE-11/14/16: any token count, layer range, lossless codec and fp8
    dtype: every object carries its layers' scales, and get_cache returns the elements bit
    for bit with exactly those scales, so the values (KVW-SCALE-6) are the original's."""
    cache, tokens = scaled_cache(T, dtype=dtype, seed=seed), token_ids(T, seed)
    store = MemoryStore()
    kv = KVStore(store)
    put = kv.put_cache(cache, tokens, layers=layers, codec=codec, partial=True)
    a, b = layers or (0, 3)
    assert put.written == -(-T // C) and all(f"/{dtype}/" in k and f"/l{a}-{b}/" in k for k in put.keys)
    check_objects(store, put.keys, SCALES, a, b)
    space = KeySpace(FP, dtype, C, (a, b))
    assert space.keys(tokens, partial=True) == put.keys
    got = kv.get_cache(tokens, space)
    assert got.tokens == T and got.cache.kv_scales == tuple(KVScale(*e) for e in SCALES[a:b])
    for i in range(b - a):
        for c in "kv":
            assert same_bits(got.cache.layers[i][c], cache.layers[a + i][c])
            want = cache.dequantize_layer(a + i)[c]
            assert np.array_equal(got.cache.dequantize_layer(i)[c].view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_scale8_store_round_trip_on_files_and_redis(tmp_path, redis_url, codec):
    """The same on a LocalStore and a real Redis server: whole cache and a stage of layers
    [1, 3), scales and elements exact."""
    cache, tokens = scaled_cache(10), token_ids(10)
    for store in (LocalStore(tmp_path / codec), open_store(redis_url)):
        kv = KVStore(store)
        for layers in (None, (1, 3)):
            a, b = layers or (0, 3)
            put = kv.put_cache(cache, tokens, layers=layers, codec=codec, partial=True)
            assert put.written == 3
            check_objects(store, put.keys, SCALES, a, b)
            got = kv.get_cache(tokens, KeySpace(FP, "f8_e4m3fn", C, (a, b)))
            assert got.tokens == 10 and got.cache.kv_scales == tuple(KVScale(*e) for e in SCALES[a:b])
            assert all(same_bits(got.cache.layers[i][c], cache.layers[a + i][c]) for i in range(b - a) for c in "kv")
        store.close()


def test_store14_the_dtype_segment_is_the_fp8_dtype():
    """KVW-STORE-14: the key's dtype segment is the cache's fp8 dtype, so a bf16 and an fp8
    cache of one model and prompt never share objects, and the scales are not in the key."""
    tokens = token_ids(8)
    for dtype in FP8:
        space = KeySpace.of(scaled_cache(8, dtype=dtype).header)
        assert space.dtype == dtype and space.root.split("/")[2] == dtype
        assert KeySpace.parse(space.keys(tokens)[0])[0] == space
    a = KeySpace.of(scaled_cache(8).header)
    b = KeySpace.of(scaled_cache(8, OTHER).header)
    assert a == b and a.keys(tokens) == b.keys(tokens)  # keys do not bind scales


def test_xm10_other_scales_under_the_same_key_are_served_and_the_check_says_rescale():
    """Keys do not bind scales: a writer with other scales finds the objects there (skipped),
    a reader gets the first writer's scales with its elements, exactly; lookup with the
    second engine's LocalModel says "rescale layers 0, 2" (KVW-XM-10), rescale_cache then
    gives that engine's scales; a receiver stating no scales is refused, 0 tokens."""
    first, second = scaled_cache(8, SCALES), scaled_cache(8, OTHER, seed=1)
    tokens = token_ids(8)
    store = MemoryStore()
    kv = KVStore(store)
    assert kv.put_cache(first, tokens).written == 2
    assert kv.put_cache(second, tokens).skipped == 2  # same keys: the other scales change nothing
    space = KeySpace.of(second.header)
    got = kv.get_cache(tokens, space)
    assert got.tokens == 8 and got.cache.kv_scales == first.kv_scales
    assert all(same_bits(got.cache.layers[i][c], first.layers[i][c]) for i in range(3) for c in "kv")
    me = kvwire.LocalModel(second.header.arch, "f8_e4m3fn", second.header.model, kv_scales=OTHER,
                           require_fingerprints=False)
    hit = kv.lookup(tokens, space, local=me)
    assert (hit.chunks, hit.tokens) == (2, 8)
    assert hit.verdict == kvwire.Verdict("convertible", ("rescale layers 0, 2",))
    mine = rescale_cache(got.cache, me.kv_scales)
    assert mine.kv_scales == second.kv_scales
    assert kvwire.check_compatible(mine.header, me) == kvwire.Verdict("exact")
    blind = kvwire.LocalModel(second.header.arch, "f8_e4m3fn", second.header.model, require_fingerprints=False)
    refused = kv.lookup(tokens, space, local=blind)
    assert (refused.chunks, refused.tokens) == (0, 0) and refused.verdict.reasons[0].startswith("scales: ")
    # a stage object checked against the whole model: its layers [1, 3) against the receiver's 1 and 2
    kv.put_cache(first, tokens, layers=(1, 3))
    stage = kv.lookup(tokens, KeySpace(FP, "f8_e4m3fn", C, (1, 3)), local=me)
    assert stage.chunks == 2 and stage.verdict.conversions == ("layer map: copy 2, recompute 1", "rescale layers 2")


def test_store17_objects_with_other_scales_do_not_join_a_request():
    """Chunk 0 stored by an engine with SCALES, chunk 1 by one with OTHER (chunk 0 skipped):
    one cache cannot hold both under one set of scales, so the hits must end at chunk 1
    (or chunk 1 be rescaled); never chunk 1's elements under chunk 0's scales."""
    tokens = token_ids(8)
    kv = KVStore(MemoryStore())
    kv.put_cache(scaled_cache(4, SCALES), tokens[:4])
    other = scaled_cache(8, OTHER, seed=1)
    assert kv.put_cache(other, tokens).written == 1
    got = kv.get_cache(tokens, KeySpace.of(other.header))
    values = got.cache.dequantize_layer(0)["k"][:, 4:8] if got.tokens == 8 else None
    want = other.dequantize_layer(0)["k"][:, 4:8]
    assert got.tokens == 4 or np.array_equal(values.view(np.uint32), want.view(np.uint32))
