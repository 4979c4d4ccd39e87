"""Request identity in the store's keys (spec/store.md section 10, KVW-IDENT-*): the encoding
and its pinned vectors, the adapter fingerprint, both key forms and their strict parse, and
KVStore / LayerwiseLoad serving a request only the objects of its own identity."""

from __future__ import annotations

import hashlib
import os
import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvwire
from kvwire.format.header import ModelIdentity
from kvwire.store import (
    Adapter,
    KeySpace,
    KVStore,
    LocalStore,
    MemoryStore,
    MultimodalItem,
    RequestIdentity,
    adapter_fingerprint,
)
from kvwire.store.identity import METADATA_KEY
from kvwire.store.keys import header_mismatches
from kvwire.store.layerwise import LayerwiseLoad

VFP = bytes(range(32))
R = "kvw1/000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f/bf16/tp0of1/l0-2/lossless/c4/"
H0 = "4e0afdcfd652d55b0ddfde72d75fd789d4aae06790c657e3929545d9cc0c0786"
H1 = "3c5c0c80786cbd0ed4d14e64654ae99dabea916b4a00dc42fa688355704ab482"
H2 = "7aff686700677cca4ec53262472cc05241057a12fe7a8f4a7bfb9198c64f9cde"
SALT = "i647a2a5c7244b661bff0c886f0f31b6960a220277450667261e9303c945f0ba8/"
ADAPTER = "ied6f82c4f0e3bd36fa03c697f2f55b44f1a6a960b24088d956d4c3f2d9115096/"
IMAGE = "i838210e741dee19ab10a2141e91c162f0c868d93ef227a2e3ef922d431de868c/"
TWO_A = "iab52d950376ee26d440bffeae7a1e88b96b98e119a0474b555f9ab9e506a70e6/"
TWO_B = "i9214bdda4061f5be35f9d51d3547dff8ca0f10a6d25a1cc170831bd31452e574/"
VECTORS = [  # spec/store.md KVW-IDENT-8
    (RequestIdentity(salt=b"tenant-a"), [R + SALT + H0, R + SALT + H1, R + SALT + H2]),
    (RequestIdentity(adapter=Adapter("sql-lora", bytes(range(32, 64)))), [R + ADAPTER + H0, R + ADAPTER + H1,
                                                                        R + ADAPTER + H2]),
    (RequestIdentity(items=(MultimodalItem(b"img-1", 5, 2),)), [R + H0, R + IMAGE + H1, R + IMAGE + H2]),
    (RequestIdentity(salt=b"tenant-a", items=(MultimodalItem(b"img-2", 9, 3), MultimodalItem(b"img-1", 1, 2))),
     [R + TWO_A + H0, R + TWO_A + H1, R + TWO_B + H2]),
]
DOMAIN_HEX = "6b76776972652072657175657374206964656e74697479203100"
FP = hashlib.sha256(b"identity-test-model").digest()
C = 4


def make_cache(tokens: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    ks = [rng.standard_normal((2, tokens, 8)).astype(np.float16) for _ in range(2)]
    vs = [rng.standard_normal((2, tokens, 8)).astype(np.float16) for _ in range(2)]
    return kvwire.KVCache.from_tensors(ks, vs, model=ModelIdentity(compat_fingerprint=FP), chunk_tokens=C)


# -- the encoding and the vectors (KVW-IDENT-2, -4, -5, -8) -----------------------------------

def test_ident8_key_vectors():
    """KVW-IDENT-8: the spec's identity key vectors (chunk 0 of the one-image row keeps the
    unscoped key of KVW-STORE-18)."""
    space = KeySpace(VFP, "bf16", 4, (0, 2))
    for identity, want in VECTORS:
        assert space.keys(list(range(1, 13)), identity=identity) == want
    assert space.keys(list(range(1, 13)), identity=None) == [R + H0, R + H1, R + H2]
    assert space.keys(list(range(1, 13)), identity=RequestIdentity()) == [R + H0, R + H1, R + H2]


def test_ident2_encoding_bytes():
    """KVW-IDENT-2: the encodings printed in the spec, byte for byte, and I_k = SHA-256(E_k)."""
    salt = RequestIdentity(salt=b"tenant-a")
    assert salt.encoding(0, 4).hex() == DOMAIN_HEX + "01" + "08000000" + b"tenant-a".hex() + "00000000"
    assert salt.digests(1, 4)[0] == hashlib.sha256(salt.encoding(0, 4)).digest()
    assert SALT == f"i{salt.digests(1, 4)[0].hex()}/"
    image = RequestIdentity(items=(MultimodalItem(b"img-1", 5, 2),))
    assert image.encoding(0, 4) is None  # KVW-IDENT-4: the item starts in chunk 1
    assert image.encoding(1, 4).hex() == (DOMAIN_HEX + "00" + "01000000" + "05000000" + b"img-1".hex()
                                          + "0500000000000000" + "0200000000000000")
    assert image.digests(3, 4)[0] is None and image.digests(3, 4)[1] == image.digests(3, 4)[2]


def test_ident4_item_binds_chunks_from_its_start():
    """KVW-IDENT-4: an item binds the chunks from the one it starts in, never earlier ones;
    the chunk it starts in is bound even when the item ends in a later one."""
    ident = RequestIdentity(items=(MultimodalItem(b"x", 7, 6),))
    assert [d is None for d in ident.digests(4, 4)] == [True, False, False, False]
    assert len(set(ident.digests(4, 4)[1:])) == 1
    at8 = RequestIdentity(items=(MultimodalItem(b"x", 8, 1),))
    assert [d is None for d in at8.digests(3, 4)] == [True, True, False]


IDENTS = st.builds(
    RequestIdentity,
    salt=st.one_of(st.none(), st.binary(min_size=1, max_size=6)),
    adapter=st.one_of(st.none(), st.builds(Adapter, st.text(min_size=1, max_size=4),
                                           st.binary(min_size=1, max_size=6))),
    items=st.lists(st.builds(MultimodalItem, st.binary(min_size=1, max_size=4), st.integers(0, 20),
                             st.integers(1, 5)), max_size=3).map(tuple))


@pytest.mark.slow
@settings(max_examples=300)
@given(a=IDENTS, b=IDENTS)
def test_ident2_encoding_is_unambiguous(a, b):
    """KVW-IDENT-2: two identities have the same encoding exactly when they are equal (all
    items bound: a chunk past every item), whatever the field boundaries."""
    ea, eb = a.encoding(10, 4), b.encoding(10, 4)
    assert (ea == eb) == (a == b)
    assert (ea is None) == (a.salt is None and a.adapter is None and not a.items)


def test_ident1_identity_refuses_what_it_cannot_encode():
    """KVW-IDENT-1: bounded, typed fields; an empty salt or identifier is refused."""
    for bad in (lambda: RequestIdentity(salt=b""), lambda: RequestIdentity(salt="text"),
                lambda: RequestIdentity(salt=bytes(65537)), lambda: MultimodalItem(b"", 0, 1),
                lambda: MultimodalItem(b"x", -1, 1), lambda: MultimodalItem(b"x", 0, 0),
                lambda: MultimodalItem(b"x", True, 1), lambda: Adapter("", b"f"), lambda: Adapter("a", b""),
                lambda: RequestIdentity(adapter=("a", b"f")), lambda: RequestIdentity(items=((b"x", 0, 1),))):
        with pytest.raises((TypeError, ValueError)):
            bad()
    with pytest.raises(TypeError, match="RequestIdentity"):
        KeySpace(VFP, "bf16", 4, (0, 2)).keys([1, 2, 3, 4], identity=b"tenant")


# -- the adapter fingerprint (KVW-IDENT-3) ---------------------------------------------------

def test_ident3_adapter_fingerprint(tmp_path):
    """KVW-IDENT-3: the spec's vector; other files ignored; the same weights elsewhere give
    the same fingerprint, changed weights another; a directory without config or weights
    has none."""
    a = tmp_path / "a"
    a.mkdir()
    (a / "adapter_config.json").write_bytes(b'{"r": 8}')
    (a / "adapter_model.safetensors").write_bytes(bytes(16))
    (a / "README.md").write_bytes(b"x")
    fp = adapter_fingerprint(a)
    assert fp.hex() == "c3a1876dc0f213e828b10611591ce09566a645da5abdac41a603e6ca9efa1b28"
    (a / "README.md").write_bytes(b"something else")
    assert adapter_fingerprint(a) == fp
    b = tmp_path / "b"
    shutil.copytree(a, b)
    assert adapter_fingerprint(b) == fp
    (b / "adapter_model.safetensors").write_bytes(bytes(15) + b"\1")
    os.utime(b / "adapter_model.safetensors", ns=(1, 1))  # another modification time: not served from the cache
    assert adapter_fingerprint(b) != fp
    (a / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="adapter_config.json"):
        adapter_fingerprint(a)
    with pytest.raises(OSError):
        adapter_fingerprint(tmp_path / "missing")


# -- keys and their parse (KVW-IDENT-5) --------------------------------------------------------

def test_ident5_parse_reads_both_forms():
    """KVW-IDENT-5: parse is the inverse of key for both forms; the digest lands in the space."""
    for _, keys in VECTORS:
        for key in keys:
            space, h = KeySpace.parse(key)
            assert space.key(h) == key
            assert (space.identity_digest is None) == (key.count("/") == 7)
    space, h = KeySpace.parse(R + SALT + H0)
    assert space.identity_digest.hex() == SALT[1:-1] and h.hex() == H0
    assert space.scoped(None) == KeySpace(VFP, "bf16", 4, (0, 2))


@pytest.mark.parametrize("key", [
    R + SALT.upper() + H0, R + "I" + SALT[1:] + H0, R + SALT[1:] + H0, R + "i" + SALT[2:] + H0,
    R + "i" + SALT[1:-1] + "0/" + H0, R + SALT + SALT + H0, R + H0 + "/" + SALT[:-1], R + "i/" + H0,
    R + SALT[:-1] + "g/" + H0,
])
def test_ident5_parse_refuses_other_forms(key):
    """KVW-IDENT-5: exactly ``i`` and 64 lower-case hex digits, just before the hash."""
    with pytest.raises(ValueError, match="segment"):
        KeySpace.parse(key)


def test_ident5_scoped_space_names_single_keys():
    space, _ = KeySpace.parse(R + SALT + H0)
    with pytest.raises(ValueError, match="scoped"):
        space.keys([1, 2, 3, 4], identity=RequestIdentity(salt=b"x"))
    with pytest.raises(ValueError, match="32 bytes"):
        KeySpace(VFP, "bf16", 4, (0, 2), identity_digest=b"short")


# -- KVStore: a request is served only its own identity's objects (KVW-IDENT-4..6) -----------

A, B = RequestIdentity(salt=b"tenant-a"), RequestIdentity(salt=b"tenant-b")
LORA1, LORA2 = (RequestIdentity(adapter=Adapter("lora", hashlib.sha256(x).digest())) for x in (b"w1", b"w2"))
IMG_X, IMG_Y = (RequestIdentity(items=(MultimodalItem(x, 5, 2),)) for x in (b"image-x", b"image-y"))


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_ident4_store_serves_only_the_requests_identity(tmp_path, backend):
    """KVW-IDENT-4/5: objects put under one salt or adapter serve that identity alone, and
    neither a request without identity nor one with another; an image's request shares the
    chunk before the image only."""
    cache, toks = make_cache(12), list(range(1, 13))
    space = KeySpace.of(cache.header)
    for n, (owner, others) in enumerate(((A, [B, None, LORA1]), (LORA1, [LORA2, None, A]), (IMG_X, [IMG_Y, None]))):
        store = MemoryStore() if backend == "memory" else LocalStore(tmp_path / f"s{n}")
        kv = KVStore(store)
        kv.put_cache(cache, toks, identity=owner)
        got = kv.get_cache(toks, space, identity=owner)
        assert got.tokens == 12
        np.testing.assert_array_equal(got.cache.layers[1]["v"], cache.layers[1]["v"])
        assert METADATA_KEY not in got.cache.header.metadata  # KVW-IDENT-6: a joined cache carries none
        assert kv.lookup(toks, space, identity=owner).tokens == 12
        for other in others:
            want = 4 if owner is IMG_X else 0  # chunk 0 precedes the image: shared (KVW-IDENT-4)
            assert kv.lookup(toks, space, identity=other).tokens == want, (owner, other)
            assert kv.get_cache(toks, space, identity=other).tokens == want
        assert kv.counts["incompatible"] == kv.counts["corrupt"] == 0  # misses, not failed checks
        assert store.get(space.keys(toks, identity=owner)[-1]) is not None
        assert store.get(space.keys(toks)[-1]) is None  # nothing stored under the unscoped keys after the image


def test_ident5_objects_carry_their_digest(tmp_path):
    """KVW-IDENT-5: an identified chunk's object carries kvwire.request_identity = I_k; an
    unscoped chunk's carries none; header_mismatches agrees with the key."""
    store, cache, toks = MemoryStore(), make_cache(12), list(range(1, 13))
    kv, space = KVStore(store), KeySpace.of(cache.header)
    kv.put_cache(cache, toks, identity=IMG_X)
    for key in space.keys(toks, identity=IMG_X):
        h = kvwire.probe(store.get(key))
        sp, ch = KeySpace.parse(key)
        assert h.metadata.get(METADATA_KEY) == sp.identity_digest
        assert header_mismatches(h, sp, ch) == []
        other = sp.scoped(None if sp.identity_digest else bytes(32))
        assert any("KVW-IDENT-6" in m for m in header_mismatches(h, other, ch))
    reloaded = kv.get_cache(toks, space, identity=IMG_X).cache
    kv2 = KVStore(MemoryStore())
    kv2.put_cache(reloaded, toks)  # a loaded cache stored again without identity: no stale entry
    assert all(METADATA_KEY not in kvwire.probe(kv2.store.get(k)).metadata for k in space.keys(toks))


def _plant(store, src_key, dst_key):
    store.put(dst_key, store.get(src_key))


@pytest.mark.parametrize("how", ["identified-under-plain", "plain-under-identified", "other-identity"])
def test_ident6_reader_refuses_an_object_of_another_identity(how):
    """KVW-IDENT-6: an object copied under a key of another identity (what a co-writer of
    the store could plant) is a miss: counted, deleted, never returned."""
    store, cache, toks = MemoryStore(), make_cache(8), list(range(1, 9))
    kv, space = KVStore(store), KeySpace.of(cache.header)
    src, dst = {"identified-under-plain": (A, None), "plain-under-identified": (None, A),
                "other-identity": (A, B)}[how]
    kv.put_cache(cache, toks, identity=src)
    for s, d in zip(space.keys(toks, identity=src), space.keys(toks, identity=dst)):
        _plant(store, s, d)
    assert kv.lookup(toks, space, identity=dst).tokens == 0
    assert kv.counts["incompatible"] == 1
    _plant(store, space.keys(toks, identity=src)[0], space.keys(toks, identity=dst)[0])
    assert kv.get_cache(toks, space, identity=dst).tokens == 0
    assert kv.counts["incompatible"] == 2
    assert store.get(space.keys(toks, identity=dst)[0]) is None  # deleted (KVW-STORE-17)
    assert kv.get_cache(toks, space, identity=src).tokens == 8  # the real objects are untouched


def test_ident6_layerwise_load_binds_identity():
    """KVW-IDENT-4/6 on the layer-by-layer reader (KVW-STORE-27)."""
    store, cache, toks = MemoryStore(), make_cache(12), list(range(1, 13))
    kv, space = KVStore(store), KeySpace.of(cache.header)
    kv.put_cache(cache, toks, identity=IMG_X)
    own = LayerwiseLoad(kv, toks, space, identity=IMG_X)
    assert own.tokens == 12
    np.testing.assert_array_equal(own.load_layer(1)["k"], cache.layers[1]["k"])
    assert LayerwiseLoad(kv, toks, space, identity=IMG_Y).tokens == 4
    assert LayerwiseLoad(kv, toks, space).tokens == 4
    assert LayerwiseLoad(kv, toks, space, identity=A).tokens == 0


def test_ident7_vllm_request_mapping(tmp_path):
    """KVW-IDENT-1, 7: a scheduler request (by vLLM's attribute names) maps to its identity:
    an empty salt is none, the adapter is its name and the fingerprint of its directory, each
    multimodal item its identifier and placeholder range; what cannot be bound faithfully
    (prompt embeddings, a salt that is not text, unreadable adapter files, an item without an
    identifier or range) gives no identity and a reason, whose kind is logged once."""
    from types import SimpleNamespace as NS

    from kvwire.integrations.vllm_identity import reason_kind, request_identity

    a = tmp_path / "lora"
    a.mkdir()
    (a / "adapter_config.json").write_bytes(b'{"r": 8}')
    (a / "adapter_model.safetensors").write_bytes(bytes(16))
    img = NS(identifier="img-1", mm_position=NS(offset=5, length=2))
    full = NS(prompt_embeds=None, cache_salt="tenant-a", lora_request=NS(lora_name="sql", lora_path=str(a)),
              mm_features=[img])
    got, why = request_identity(full)
    assert why is None and got == RequestIdentity(b"tenant-a", Adapter("sql", adapter_fingerprint(a)),
                                                   (MultimodalItem(b"img-1", 5, 2),))
    assert request_identity(NS(cache_salt=""))[0] == RequestIdentity(None, None, ())  # no identity at all
    bad = {"prompt embeddings": NS(prompt_embeds=[0.0]),
           "cache_salt of type bytes": NS(cache_salt=b"x"),
           "LoRA adapter files not readable": NS(lora_request=NS(lora_name="gone", lora_path=str(tmp_path / "no"))),
           "a multimodal item without an identifier or placeholder range": NS(mm_features=[NS(identifier="",
                                                                                             mm_position=img)])}
    for kind, req in bad.items():
        got, why = request_identity(req)
        assert got is None and reason_kind(why) == kind, (kind, why)
