"""Authenticated store objects (spec/store.md section 11, KVW-AUTH-1..9): a writer without
the key plants objects (wrong tensors with no tag, a garbage tag, a tag under another key,
a tagged object moved to another key, a body that is not the tagged one) and a keyed reader
never serves them, by whole loads, ``lookup`` or layer by layer, on the file store and on a
real Redis server; a keyed writer heals them; unkeyed readers keep working; the tag vector."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvwire
from kvwire.format.header import ModelIdentity
from kvwire.store import KeySpace, KVStore, LocalStore, MemoryStore, StoreError, open_store
from kvwire.store.auth import (
    ENV_KEY_FILE,
    ENV_KEYS,
    MAX_TAG_BYTES,
    Keyring,
    Tag,
    TagError,
    check_url,
    pack_tag,
    parse_tag,
    tag_key,
    tag_message,
)
from kvwire.store.layerwise import LayerwiseLoad
from kvwire.tools.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
FP = hashlib.sha256(b"auth-test-model").digest()
C = 4
TOKENS = np.arange(100, 112)  # three whole chunks
RING = Keyring([("ops-2026", bytes(range(1, 33)))])
OTHER = Keyring([("ops-2026", bytes(range(2, 34)))])  # the same key id, another secret
OLD_AND_NEW = Keyring([("ops-2027", os.urandom(32)), ("ops-2026", bytes(range(1, 33)))])


def make_cache(seed: int = 0):
    rng = np.random.default_rng(seed)
    ks = [rng.standard_normal((2, len(TOKENS), 8)).astype(np.float16) for _ in range(2)]
    vs = [rng.standard_normal((2, len(TOKENS), 8)).astype(np.float16) for _ in range(2)]
    return kvwire.KVCache.from_tensors(ks, vs, model=ModelIdentity(compat_fingerprint=FP), chunk_tokens=C)


GOOD, EVIL = make_cache(0), make_cache(1)
SPACE = KeySpace.of(GOOD.header)
KEYS = SPACE.keys(TOKENS)


@pytest.fixture(params=["file", "redis"])
def store(request, tmp_path):
    if request.param == "file":
        s = LocalStore(tmp_path / "store")
    else:
        s = open_store(request.getfixturevalue("redis_url"))
        for k in s.list():
            s.delete(k)  # the server is shared by this module's tests: start empty
    yield s
    s.close()


def k_of(cache):
    return np.asarray(cache.layers[0]["k"])


def served(kv):
    """Tokens a keyed reader serves: whole load, lookup and layer by layer must agree, and
    every served token must be the good cache's."""
    got = kv.get_cache(TOKENS, SPACE)
    look = kv.lookup(TOKENS, SPACE).tokens
    lw = LayerwiseLoad(kv, TOKENS, SPACE)
    layer = lw.load_layer(1) if lw.readers else {"v": np.zeros((2, 0, 8))}
    if got.cache is not None:
        assert np.array_equal(k_of(got.cache), k_of(GOOD)[:, :got.tokens])
    assert np.array_equal(layer["v"], np.asarray(GOOD.layers[1]["v"])[:, :lw.served])
    return got.tokens, min(look, C), lw.served


def test_auth3_keyed_round_trip_and_unkeyed_readers(store):
    """KVW-AUTH-3/6: a keyed writer tags every object (K.tag); keyed and unkeyed readers load them."""
    kv = KVStore(store, auth=RING)
    assert kv.put_cache(GOOD, TOKENS).written == 3
    assert sorted(store.list()) == sorted(KEYS + [tag_key(k) for k in KEYS])
    assert served(KVStore(store, auth=RING)) == (12, C, 12)
    assert served(KVStore(store)) == (12, C, 12)  # readers without keys ignore tags
    assert served(KVStore(store, auth=OLD_AND_NEW)) == (12, C, 12)  # rotation: any key of the ring
    assert kv.counts["auth_failures"] == 0


def plant(store, n, obj, tag=None):
    store.delete(KEYS[n])
    store.delete(tag_key(KEYS[n]))
    store.put(KEYS[n], obj)
    if tag is not None:
        store.put(tag_key(KEYS[n]), tag)


def evil_object(n):
    """A valid container with the wrong tensors for chunk ``n``: every KVW-STORE-17 check passes."""
    s = open_store("memory://")
    KVStore(s).put_cache(EVIL, TOKENS)
    return bytes(s.get(KEYS[n]))


def test_auth7_planted_objects_are_never_served(store):
    """KVW-AUTH-7: a writer without the key plants chunk 1 six ways; a keyed reader serves chunk 0 only
    (whole loads, lookup, layer by layer), counts the failures, and an unkeyed reader is fooled (why tags)."""
    KVStore(store, auth=RING).put_cache(GOOD, TOKENS)
    good1, good_tag1 = bytes(store.get(KEYS[1])), bytes(store.get(tag_key(KEYS[1])))
    bad = evil_object(1)
    other_tag = OTHER.tag(KEYS[1], bad)
    moved = Keyring.tag(RING, KEYS[2], bad)  # a valid tag, made for another key
    t = RING.open(KEYS[1], good_tag1)  # the key holder's digests with the last body's changed, HMAC valid:
    prefix = pack_tag(Tag(t.key_id, t.header, t.index, t.bodies[:-1] + (bytes(32),), b""))  # an XXH3 collision
    body = prefix + hmac.new(RING.secrets["ops-2026"], tag_message(KEYS[1], prefix), "sha256").digest()
    cases = {"untagged": (bad, None), "garbage tag": (bad, b"\x89KVT\r\n\x1a\n" + os.urandom(90)),
             "other key": (bad, other_tag), "moved": (bad, moved), "tag kept": (bad, good_tag1),
             "body digest": (good1, body)}
    for name, (obj, tag) in cases.items():
        plant(store, 1, obj, tag)
        kv = KVStore(store, auth=RING)
        assert served(kv) == (C, C, C), name
        assert kv.counts["auth_failures"] >= 1, name  # a forged one is deleted at the first failure
    plant(store, 1, bad)
    fooled = KVStore(store).get_cache(TOKENS, SPACE)  # without keys every check passes: the planted tensors
    assert fooled.tokens == 12 and np.array_equal(k_of(fooled.cache)[:, C:2 * C], k_of(EVIL)[:, C:2 * C])
    plant(store, 0, evil_object(0))  # the first chunk: lookup too says 0
    kv = KVStore(store, auth=RING)
    assert served(kv) == (0, 0, 0) and kv.lookup(TOKENS, SPACE).chunks == 0


def test_auth7_forged_tags_are_deleted_missing_ones_kept(store):
    """KVW-AUTH-7: a tag failing under a held key goes with its object; a missing or foreign tag deletes nothing."""
    KVStore(store, auth=RING).put_cache(GOOD, TOKENS)
    bad = evil_object(1)
    plant(store, 1, bad, OTHER.tag(KEYS[1], bad))
    KVStore(store, auth=RING).get_cache(TOKENS, SPACE)
    assert not store.exists(KEYS[1]) and not store.exists(tag_key(KEYS[1]))
    plant(store, 1, bad)
    KVStore(store, auth=RING).get_cache(TOKENS, SPACE)
    assert store.exists(KEYS[1])  # perhaps a writer between object and tag
    plant(store, 1, bad, Keyring([("elsewhere", os.urandom(32))]).tag(KEYS[1], bad))
    kv = KVStore(store, auth=RING)
    assert kv.get_cache(TOKENS, SPACE).tokens == C and store.exists(KEYS[1])


def test_auth8_keyed_writer_heals_planted_and_orphans(store):
    """KVW-AUTH-8: untagged and wrongly tagged objects are rewritten; an orphan tag is replaced."""
    KVStore(store).put_cache(EVIL, TOKENS)  # legacy or planted: no tags at all
    store.put(tag_key(KEYS[2]), b"junk")
    kv = KVStore(store, auth=RING)
    assert kv.put_cache(GOOD, TOKENS).written == 3 and kv.counts["auth_healed"] == 3
    assert served(KVStore(store, auth=RING)) == (12, C, 12)
    store.delete(KEYS[1])  # an orphan tag (object evicted)
    assert kv.put_cache(GOOD, TOKENS).written == 1
    assert served(KVStore(store, auth=RING)) == (12, C, 12)
    foreign = Keyring([("newer", os.urandom(32))])
    plant(store, 2, evil_object(2), foreign.tag(KEYS[2], evil_object(2)))
    assert kv.put_cache(GOOD, TOKENS).written == 0  # a newer writer's tag is left alone


def test_auth5_tag_binds_key_and_every_digest():
    """KVW-AUTH-4/5: each field of the tag is covered: flipping any byte fails the HMAC (or the parse)."""
    obj = evil_object(0)
    tag = RING.tag(KEYS[0], obj)
    assert RING.open(KEYS[0], tag).key_id == "ops-2026"
    for i in range(len(tag)):
        t = bytearray(tag)
        t[i] ^= 0x40
        with pytest.raises(TagError):
            RING.open(KEYS[0], bytes(t))
    with pytest.raises(TagError) as e:
        RING.open(KEYS[1], tag)
    assert e.value.kind == "forged"


IDS = st.text("abcXYZ019._-", min_size=1, max_size=64)
DIG = st.binary(min_size=32, max_size=32)


@settings(max_examples=60)
@given(kid=IDS, h=DIG, i=DIG, bodies=st.lists(DIG, max_size=20), mac=DIG)
def test_auth4_tag_layout_round_trip(kid, h, i, bodies, mac):
    """KVW-AUTH-4: pack/parse round trip; every strict cut or extension is refused."""
    t = Tag(kid, h, i, tuple(bodies), mac)
    data = pack_tag(t)
    assert len(data) == 112 + len(kid) + 32 * len(bodies) and parse_tag(data) == t
    for bad in (data[:-1], data + b"\0", data[:11] + b"\1" + data[12:], b"X" + data[1:]):
        with pytest.raises(TagError):
            parse_tag(bad)


def test_auth4_hostile_tags_are_misses_not_crashes():
    """KVW-AUTH-4: random and huge declared sizes never crash or allocate."""
    rng = np.random.default_rng(3)
    for n in range(300):
        data = bytes(rng.integers(0, 256, int(rng.integers(0, 400)), np.uint8))
        if n % 2:
            data = b"\x89KVT\r\n\x1a\n\x01\x00" + data[10:]
        with pytest.raises(TagError):
            RING.open(KEYS[0], data)
    with pytest.raises(TagError):
        parse_tag(b"\x89KVT\r\n\x1a\n\x01\x00\x05\x00\xff\xff\xff\xff" + bytes(MAX_TAG_BYTES))


def test_auth9_tag_vector():
    """KVW-AUTH-9: the frozen object and key give exactly the frozen tag (spec/store.md)."""
    d = ROOT / "conformance" / "store-tags"
    obj, tag = (d / "object.kvw").read_bytes(), (d / "object.kvw.tag").read_bytes()
    assert hashlib.sha256(obj).hexdigest() == "ba5f34b2de92057b374d4fbbe66808f459bff72ac2e4819e5df4d200f8c57c0d"
    key = KeySpace(bytes(range(32)), "bf16", 4, (0, 2)).keys([1, 2, 3, 4])[0]
    ring = Keyring([("test-key-1", bytes(range(32)))])
    assert ring.tag(key, obj) == tag
    assert tag.hex() in (ROOT / "spec" / "store.md").read_text().replace("\n", "")
    assert ring.open(key, tag).mac.hex() == "715d19d9992692ae7e7d370ded7f6a4cdfc5431d64e257170f3296630a5cb92c"


def test_auth2_key_sources(tmp_path):
    """KVW-AUTH-1/2: file (owner-only), environment, precedence, refusals; never a URL; no secret in repr."""
    secret = os.urandom(32)
    f = tmp_path / "keys"
    f.write_text(f"# fleet keys\nnew {secret.hex()}\n\nold base64:{__import__('base64').b64encode(secret[::-1]).decode()}\n")
    f.chmod(0o600)
    ring = Keyring.load(f)
    assert ring.current == "new" and ring.secrets == {"new": secret, "old": secret[::-1]}
    assert secret.hex() not in repr(ring)
    assert Keyring.load(environ={ENV_KEY_FILE: str(f)}).secrets == ring.secrets
    assert Keyring.load(environ={ENV_KEYS: f"a {secret.hex()},b {secret.hex()}"}).current == "a"
    assert Keyring.load(environ={}) is None
    f.chmod(0o640)
    with pytest.raises(StoreError, match="chmod 600"):
        Keyring.load(f)
    bad = {ENV_KEY_FILE: str(f), ENV_KEYS: f"a {secret.hex()}"}
    for env, match in [(bad, "set one"), ({ENV_KEYS: "a 00ff"}, "32 to 1024"), ({ENV_KEYS: "a zz"}, "hex"),
                       ({ENV_KEYS: f"a {secret.hex()},a {secret.hex()}"}, "twice"),
                       ({ENV_KEYS: f"a/b {secret.hex()}"}, "key id"), ({ENV_KEYS: "# nothing"}, "no keys")]:
        with pytest.raises(StoreError, match=match):
            Keyring.load(environ=env)
    for url in ["redis://h:6379/0?secret=abc", "file:///srv/kv?hmac=1", "redis://h/0?auth_key_file=/k"]:
        with pytest.raises(StoreError, match=ENV_KEY_FILE) as e:
            check_url(url)
        assert "abc" not in str(e.value)
    check_url("rediss://h:6380/0?key=/etc/tls/client.key")  # the TLS client key file is not a tag key
    with pytest.raises(TypeError, match="Keyring"):
        KVStore(open_store("memory://"), auth=secret)


def test_auth3_store_cli_knows_tags(tmp_path, capsys):
    """KVW-AUTH-3 through `kvwire store`: a tag is listed as one, counted beside its object's
    key root, left alone by `gc --verify` (which holds no keys) and removed with its object
    by `gc --fingerprint`."""
    url = f"file://{tmp_path}/store"
    KVStore(open_store(url), auth=RING).put_cache(GOOD, TOKENS)
    assert cli_main(["store", "ls", "--long", "--url", url]) == 0
    listed = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert sorted(r[1] for r in listed if r[2].endswith(".tag")) == ["tag"] * 3
    assert cli_main(["store", "stats", "--url", url, "--json"]) == 0
    (root,) = json.loads(capsys.readouterr().out)["roots"]
    assert (root["objects"], root["tags"]) == (3, 3)
    assert cli_main(["store", "gc", "--verify", "--url", url]) == 0
    assert len(open_store(url).list()) == 6, capsys.readouterr().out
    assert cli_main(["store", "gc", "--fingerprint", FP.hex(), "--url", url]) == 0
    assert open_store(url).list() == []


class CountingStore(MemoryStore):
    """A memory store that counts round trips: each outermost call of the protocol is one."""

    def __init__(self):
        super().__init__()
        self.calls, self.depth = 0, 0


def _counted(name):
    def call(self, *args, **kwargs):
        self.depth += 1
        try:
            self.calls += self.depth == 1
            return getattr(MemoryStore, name)(self, *args, **kwargs)
        finally:
            self.depth -= 1
    return call


for _name in ("get", "get_many", "get_ranges", "leading", "exists", "exists_many", "sizes"):
    setattr(CountingStore, _name, _counted(_name))


def test_auth6_tags_cost_no_round_trip():
    """KVW-AUTH-6: a keyed reader fetches each tag in the batch of its header, so whole loads,
    lookups and layer-by-layer loads take as many store round trips as an unkeyed reader's."""
    s = CountingStore()
    KVStore(s, auth=RING).put_cache(GOOD, TOKENS)
    trips = {}
    for name, ring in (("unkeyed", None), ("keyed", RING)):
        kv, trips[name] = KVStore(s, auth=ring), []
        for step in (lambda: kv.get_cache(TOKENS, SPACE), lambda: kv.lookup(TOKENS, SPACE),
                     lambda: LayerwiseLoad(kv, TOKENS, SPACE).load_layer(1)):
            before = s.calls
            step()
            trips[name].append(s.calls - before)
    assert trips["keyed"] == trips["unkeyed"] and min(trips["keyed"]) >= 1, trips
    assert kv.stats()["auth_failures"] == 0


def test_auth5_digests_on_threads_are_the_same(monkeypatch):
    """KVW-AUTH-5/6 on the threaded path (large objects hash their bodies in parallel):
    the same tag bytes as on one thread, and a forged body is still caught."""
    from kvwire.store import auth

    one = KVStore(MemoryStore(), auth=RING)
    one.put_cache(GOOD, TOKENS)
    monkeypatch.setattr(auth, "PARALLEL_BYTES", 0)
    assert auth.digests_of([(0, 3), (1, 4)], lambda a, b: bytes(range(a, b))) == [b"\0\1\2", b"\1\2\3"]
    many = KVStore(MemoryStore(), auth=RING)
    many.put_cache(GOOD, TOKENS)
    tags = [k for k in one.store.list() if k.endswith(".tag")]
    assert tags and all(one.store.get(k) == many.store.get(k) for k in tags)
    assert many.get_cache(TOKENS, SPACE).tokens == len(TOKENS)
    plant(many.store, 1, evil_object(1), bytes(many.store.get(tag_key(KEYS[1]))))  # the victim's tag kept
    assert served(many) == (C, C, C) and many.counts["auth_failures"] >= 1


def test_auth6_body_count_and_garbage_tags(store):
    """KVW-AUTH-6: a tag with a valid HMAC that lists one body fewer than the index is a
    miss (checked before any body is used); KVW-AUTH-7: an object whose tag does not parse
    is a miss but is kept (its writer may be between object and tag)."""
    KVStore(store, auth=RING).put_cache(GOOD, TOKENS)
    t = RING.open(KEYS[1], bytes(store.get(tag_key(KEYS[1]))))
    prefix = pack_tag(Tag(t.key_id, t.header, t.index, t.bodies[:-1], b""))
    short = prefix + hmac.new(RING.secrets["ops-2026"], tag_message(KEYS[1], prefix), "sha256").digest()
    good1 = bytes(store.get(KEYS[1]))
    plant(store, 1, good1, short)
    kv = KVStore(store, auth=RING)
    assert served(kv) == (C, C, C) and kv.counts["auth_failures"] >= 1
    plant(store, 1, good1, b"\x89KVT\r\n\x1a\n" + b"\xff" * 40)
    kv = KVStore(store, auth=RING)
    assert served(kv) == (C, C, C) and kv.counts["auth_failures"] >= 1
    assert store.get(KEYS[1]) == good1  # not deleted: a tag that does not parse proves nothing
