"""``kvwire store stats|ls|inspect|gc`` (spec/store.md) through the real CLI entry on a
file:// store filled by KVStore.put_cache, plus what it stands on: ``KeySpace.parse`` (the
inverse of ``KeySpace.key``, KVW-STORE-13..16), ``header_mismatches`` (KVW-STORE-17) and
the backends' ``sizes`` / ``info``."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_store import FP, make_cache

import forge
from kvwire.cache.reader import probe
from kvwire.codecs.presets import PRESETS
from kvwire.format import registry as R
from kvwire.format.crossmodel import PrefixChain
from kvwire.store import KeySpace, KVStore, LocalStore, MemoryStore
from kvwire.store.keys import LOSSLESS, LOSSLESS_CODECS, header_mismatches
from kvwire.store.kvstore import HEAD_BYTES
from kvwire.tools.cli import main

OTHER_FP = hashlib.sha256(b"store-cli-other-model").digest()
VECTOR_FP = bytes(range(32))
VECTOR_KEY = ("kvw1/000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f/f8_e4m3fn/tp1of2/l0-2/kivi2/c4/"
              "4e0afdcfd652d55b0ddfde72d75fd789d4aae06790c657e3929545d9cc0c0786")


def run(capsys, *args):
    """(status, stdout, stderr) of ``kvwire store ARGS``, as tests/tools/test_cli.py calls main."""
    status = main(["store", *map(str, args)])
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.fixture
def filled(tmp_path):
    """A file:// store: 10 tokens of model FP (chunks [0,4), [4,8) and the partial [8,10)),
    8 tokens of another model (int8), one object over HEAD_BYTES, and a non-kvw1 key."""
    store = LocalStore(tmp_path / "st")
    kv = KVStore(store)
    a = kv.put_cache(make_cache(10), np.arange(10), partial=True)
    b = kv.put_cache(make_cache(8, fp=OTHER_FP, seed=1), np.arange(8), codec="int8")
    big = kv.put_cache(make_cache(4, layers=4, heads=8, dim=512, seed=2), np.arange(100, 104))
    store.put("other/app/blob", b"not a kvwire object")
    assert store.sizes(big.keys)[0] > HEAD_BYTES + 1000
    return {"store": store, "url": store.url, "a": a.keys, "b": b.keys, "big": big.keys[0]}


def file_of(f, key):
    return f["store"].path(key)


def corrupt_last_body(f, key):
    """Flip a byte inside the last chunk body: only a whole read with checksums sees it."""
    path = file_of(f, key)
    with open(path, "rb") as fh:
        data = fh.read()
    off, n = forge.layout(data).bodies[-1]
    os.chmod(path, 0o644)
    with open(path, "wb") as fh:
        fh.write(forge.xor_byte(data, off + n // 2))
    return off


# -- KeySpace.parse (KVW-STORE-13..16) ---------------------------------------------------------

SPACES = st.builds(
    KeySpace, fingerprint=st.binary(min_size=1, max_size=64), dtype=st.sampled_from(sorted(R.DTYPES)),
    chunk_tokens=st.integers(1, (1 << 32) - 1),
    layers=st.tuples(st.integers(0, 10 ** 6), st.integers(1, 10 ** 6)).filter(lambda t: t[0] < t[1]),
    tp_rank=st.integers(0, 63), tp_size=st.just(64),
    fidelity=st.sampled_from([LOSSLESS] + [p for p in PRESETS if p not in LOSSLESS_CODECS]))


@settings(max_examples=200)
@given(space=SPACES, chunk_hash=st.binary(min_size=32, max_size=32), size_extra=st.integers(0, 10 ** 6))
def test_store13_to_16_parse_inverts_key_property(space, chunk_hash, size_extra):
    space = dataclasses.replace(space, tp_size=space.tp_rank + 1 + size_extra)
    key = space.key(chunk_hash)
    assert KeySpace.parse(key) == (space, chunk_hash)
    assert KeySpace.parse(key)[0].key(chunk_hash) == key


def test_store18_vector_parses():
    space, h = KeySpace.parse(VECTOR_KEY)
    assert space == KeySpace(VECTOR_FP, "f8_e4m3fn", 4, (0, 2), 1, 2, "kivi2")
    assert h.hex() == VECTOR_KEY.rsplit("/", 1)[1]


def _edit(i, segment):
    parts = VECTOR_KEY.split("/")
    parts[i] = segment
    return "/".join(parts)


@pytest.mark.parametrize("key, words", [
    (_edit(0, "kvw2"), ["version", "'kvw2'"]),
    (VECTOR_KEY + "/x", ["9 segments"]),
    (VECTOR_KEY.rsplit("/", 1)[0], ["7 segments"]),
    (_edit(1, VECTOR_FP.hex().upper()), ["fingerprint", "lower-case"]),
    (_edit(1, VECTOR_FP.hex()[:-1]), ["fingerprint"]),
    (_edit(1, "00" * 65), ["fingerprint", "1..64 bytes"]),
    (_edit(2, "f64"), ["dtype", "'f64'"]),
    (_edit(2, "BF16"), ["dtype"]),
    (_edit(3, "tp01of2"), ["shard", "leading zeros"]),
    (_edit(3, "tp2of2"), ["shard", "rank < size"]),
    (_edit(3, "tp0of0"), ["shard", "rank < size"]),
    (_edit(3, "tp-1of2"), ["shard"]),
    (_edit(4, "l00-2"), ["layers", "leading zeros"]),
    (_edit(4, "l2-2"), ["layers", "start < stop"]),
    (_edit(4, "l0-+2"), ["layers"]),
    (_edit(5, "byteplane"), ["fidelity", "KVW-STORE-15"]),
    (_edit(5, "zstd"), ["fidelity"]),
    (_edit(5, "Lossless"), ["fidelity"]),
    (_edit(6, "c04"), ["chunk size", "leading zeros"]),
    (_edit(6, "c0"), ["chunk size", "1 <= C"]),
    (_edit(6, f"c{1 << 32}"), ["chunk size"]),
    (_edit(6, "c٤"), ["chunk size"]),  # a non-ASCII digit
    (_edit(7, VECTOR_KEY.rsplit("/", 1)[1][:-2]), ["hash", "64 lower-case hex"]),
    (_edit(7, VECTOR_KEY.rsplit("/", 1)[1].upper()), ["hash"]),
])
def test_store13_to_16_parse_is_strict_and_names_the_segment(key, words):
    with pytest.raises(ValueError) as info:
        KeySpace.parse(key)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_parse_refuses_a_non_string():
    with pytest.raises(TypeError):
        KeySpace.parse(b"kvw1/00")


# -- header_mismatches (KVW-STORE-17) ----------------------------------------------------------

def test_store17_header_mismatches_names_each_disagreement(filled):
    key = filled["a"][1]
    space, h = KeySpace.parse(key)
    header = probe(filled["store"].get(key, (0, HEAD_BYTES)))
    assert header_mismatches(header, space, h) == []
    model = dataclasses.replace(header.model, compat_fingerprint=OTHER_FP)
    cases = [
        (header.replace(model=model), space, h, "compat fingerprint"),
        (header.replace(dtype="bf16"), space, h, "dtype bf16"),
        (header.replace(chunk_tokens=8), space, h, "chunk_tokens 8"),
        (header, dataclasses.replace(space, layers=(0, 3)), h, "2 layers"),
        (header.replace(token_count=5), space, h, "token_count 5 not in 1..4"),
        (header.replace(token_count=0), space, h, "token_count 0"),
        (header.replace(first_position=6), space, h, "first_position 6"),
        (header.replace(prefix=None), space, h, "no prefix chain"),
        (header.replace(prefix=PrefixChain(2, header.prefix.root, h)), space, h, "scheme 2"),
        (header, space, bytes(32), "prefix chain hashes"),
    ]
    for hd, sp, ch, words in cases:
        got = header_mismatches(hd, sp, ch)
        assert len(got) == 1 and words in got[0], (words, got)


# -- sizes / info on both backends -------------------------------------------------------------

def test_sizes_and_info_agree_with_the_objects(tmp_path):
    for store in (MemoryStore(max_bytes=10 ** 6), LocalStore(tmp_path / "l", max_bytes=10 ** 6)):
        store.put("a/x", b"12345")
        store.put("a/y", [b"12", b"345678"])
        assert store.sizes(["a/x", "a/y", "a/missing", "a"]) == [5, 8, None, None]
        assert store.sizes([]) == []
        with pytest.raises(ValueError):
            store.sizes(["../escape"])
        info = store.info()
        assert (info["objects"], info["bytes"], info["max_bytes"], info["url"]) == (2, 13, 10 ** 6, store.url)
        assert info["backend"] == type(store).__name__


def test_store7_local_info_counts_stale_temporaries(tmp_path):
    store = LocalStore(tmp_path / "l")
    store.put("k/obj", b"x" * 10)
    old, fresh = tmp_path / "l" / "k" / ".tmp-1-dead", tmp_path / "l" / "k" / ".tmp-2-1fe"
    old.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    os.utime(old, (1e9, 1e9))
    info = store.info()
    assert (info["objects"], info["bytes"], info["temporaries"], info["stale_temporaries"]) == (1, 10, 2, 1)
    assert info["root"] == str(tmp_path / "l")


# -- stats -------------------------------------------------------------------------------------

def test_stats_breaks_the_store_down_by_key_root(filled, capsys):
    status, out, _ = run(capsys, "stats", "--url", filled["url"], "--json")
    assert status == 0
    d = json.loads(out)
    store = filled["store"]
    assert d["info"]["objects"] == 7 and d["info"]["bytes"] == sum(store.sizes(store.list()))
    roots = {(r["fingerprint"], r["fidelity"], tuple(r["layers"])): (r["objects"], r["bytes"]) for r in d["roots"]}
    assert roots == {
        (FP.hex(), "lossless", (0, 2)): (3, sum(store.sizes(filled["a"]))),
        (OTHER_FP.hex(), "int8", (0, 2)): (2, sum(store.sizes(filled["b"]))),
        (FP.hex(), "lossless", (0, 4)): (1, store.sizes([filled["big"]])[0]),
    }
    assert all(r["dtype"] == "f16" and r["shard"] == "tp0of1" and r["chunk_tokens"] == 4 for r in d["roots"])
    assert d["other"] == {"objects": 1, "bytes": len(b"not a kvwire object")}
    status, out, _ = run(capsys, "stats", "--url", filled["url"])
    assert status == 0
    assert "LocalStore" in out and "stale_temporaries    0" in out
    assert f"{FP.hex()[:12]}  f16    tp0of1  0-2     lossless  4            3" in out
    assert "int8" in out and "(not kvw1)" in out


# -- ls ----------------------------------------------------------------------------------------

def test_ls_lists_keys_sizes_and_token_ranges(filled, capsys):
    store = filled["store"]
    status, out, _ = run(capsys, "ls", "--url", filled["url"])
    assert status == 0
    lines = out.splitlines()
    assert [ln.split()[1] for ln in lines] == store.list()
    assert all(int(ln.split()[0]) == store.sizes([ln.split()[1]])[0] for ln in lines)
    prefix = f"kvw1/{FP.hex()}/f16/tp0of1/l0-2/"
    status, out, _ = run(capsys, "ls", "--url", filled["url"], "--prefix", prefix, "--long", "--json")
    rows = json.loads(out)
    assert status == 0 and sorted(r["key"] for r in rows) == sorted(filled["a"])
    spans = {r["key"]: (r["first_position"], r["token_count"]) for r in rows}
    assert [spans[k] for k in filled["a"]] == [(0, 4), (4, 4), (8, 2)]
    status, out, _ = run(capsys, "ls", "--url", filled["url"], "--long", "--prefix", filled["big"])
    assert status == 0 and "[0, 4)" in out and filled["big"] in out


# -- inspect -----------------------------------------------------------------------------------

def test_inspect_reads_the_header_and_gives_the_store17_verdict(filled, capsys):
    key = filled["a"][2]
    status, out, err = run(capsys, "inspect", "--url", filled["url"], key)
    assert status == 0 and err == ""
    assert f"model {FP.hex()}, dtype f16, tp0of1, layers [0, 2), lossless, chunks of 4" in out
    assert "tokens     [8, 10): 2 from position 8" in out
    assert "KVW-STORE-17: ok" in out and "records    raw x4" in out
    status, out, _ = run(capsys, "inspect", "--url", filled["url"], filled["b"][0], "--verify", "--json")
    d = json.loads(out)
    assert status == 0 and d["ok"] and d["verified"] is True and d["mismatches"] == []
    assert d["parsed"]["fidelity"] == "int8" and d["header"]["compat_fingerprint"] == OTHER_FP.hex()


def test_store19_inspect_reads_only_the_header_and_verify_finds_the_corruption(filled, capsys):
    """An object over HEAD_BYTES with a flipped byte in its last body: inspect reads the
    first 64 KiB only (the header agrees with the key: exit 0, checksums not checked);
    --verify reads it whole and fails with the checksum's code (exit 1)."""
    key = filled["big"]
    assert corrupt_last_body(filled, key) > HEAD_BYTES
    status, out, _ = run(capsys, "inspect", "--url", filled["url"], key)
    assert status == 0 and "not checked" in out and "records" not in out
    status, out, err = run(capsys, "inspect", "--url", filled["url"], key, "--verify")
    assert status == 1
    assert err.splitlines()[0] == "BODY_CHECKSUM" and key in err.splitlines()[1]
    assert "checksums  FAILED" in out


def test_store17_inspect_flags_an_object_under_the_wrong_key(filled, capsys):
    """Chunk 1's bytes under chunk 0's key: the prefix hash disagrees; exit 1."""
    first, second = filled["a"][:2]
    store = filled["store"]
    data = store.get(second)
    store.delete(first)
    store.put(first, data)
    status, out, err = run(capsys, "inspect", "--url", filled["url"], first, "--verify")
    assert status == 1
    assert err.splitlines()[0] == "STORE_KEY_MISMATCH"
    assert "KVW-STORE-17" in err and "prefix chain hashes" in err and "MISMATCH" in out


def test_inspect_missing_or_malformed_key_exits_2(filled, capsys):
    missing = filled["a"][0][:-4] + "0000"
    status, out, err = run(capsys, "inspect", "--url", filled["url"], missing)
    assert status == 2 and out == "" and "no object under" in err and len(err.splitlines()) == 1
    status, _, err = run(capsys, "inspect", "--url", filled["url"], _edit(6, "c04"))
    assert status == 2 and "chunk size" in err


# -- gc ----------------------------------------------------------------------------------------

def test_store17_gc_verify_removes_the_bad_objects_only(filled, capsys):
    store = filled["store"]
    corrupt_last_body(filled, filled["big"])
    first, second = filled["a"][:2]
    store.delete(first)
    store.put(first, store.get(second))  # wrong object under a key
    store.put("kvw1/00/bf16/tp0of1/l0-1/lossless/c04/" + "00" * 32, b"junk")  # a key no writer makes
    before = set(store.list())
    status, out, _ = run(capsys, "gc", "--url", filled["url"], "--verify", "--dry-run")
    assert status == 0 and set(store.list()) == before  # dry run: nothing removed
    assert "would remove 2 objects" in out
    status, out, _ = run(capsys, "gc", "--url", filled["url"], "--verify")
    assert status == 0
    gone = {filled["big"], first}  # the key that does not parse is not a kvwire object: left alone
    assert set(store.list()) == before - gone
    assert f"removed {filled['big']} (BODY_CHECKSUM" in out and "prefix chain hashes" in out
    assert "skipped 1 keys under kvw1/ that do not parse" in out and "skipped 1 keys outside kvw1/" in out
    assert store.exists("other/app/blob")  # not a kvwire object: left alone
    status, out, _ = run(capsys, "gc", "--url", filled["url"], "--verify")
    assert status == 0 and "removed 0 objects" in out


def test_store13_gc_fingerprint_removes_one_model(filled, capsys):
    """After a weight update: every object under kvw1/<fp>/, nothing else."""
    store = filled["store"]
    before, nbytes = set(store.list()), sum(store.sizes(filled["b"]))
    status, out, _ = run(capsys, "gc", "--url", filled["url"], "--fingerprint", OTHER_FP.hex().upper(), "--dry-run")
    assert status == 0 and set(store.list()) == before and out.count("would remove kvw1/") == 2
    status, out, _ = run(capsys, "gc", "--url", filled["url"], "--fingerprint", OTHER_FP.hex())
    assert status == 0 and set(store.list()) == before - set(filled["b"])
    assert f"removed 2 objects ({nbytes} bytes)" in out
    assert all(f"removed {k} (model {OTHER_FP.hex()[:12]})" in out for k in filled["b"])


def test_store9_gc_max_bytes_evicts_least_recently_used(filled, capsys):
    store = filled["store"]
    keys = store.list("kvw1/")  # the kvwire objects (other/app/blob neither counts nor goes, KVW-STORE-34)
    for i, k in enumerate(keys):  # a known LRU order: the sorted order
        os.utime(store.path(k), ns=(10 ** 18 + i * 10 ** 9, 10 ** 18))
    sizes = dict(zip(keys, store.sizes(keys)))
    total = sum(sizes.values())
    target = total - sizes[keys[0]] - sizes[keys[1]]
    status, out, _ = run(capsys, "gc", "--url", filled["url"], "--max-bytes", target, "--dry-run")
    assert status == 0 and store.list("kvw1/") == keys and f"{total} bytes > --max-bytes {target}" in out
    status, out, _ = run(capsys, "gc", "--url", filled["url"], "--max-bytes", target)
    assert status == 0 and store.list("kvw1/") == keys[2:] and store.exists("other/app/blob")
    assert f"removed {keys[0]} (least recently used)" in out and f"removed {keys[1]} (least recently used)" in out
    status, out, _ = run(capsys, "gc", "--url", filled["url"], "--max-bytes", target)
    assert status == 0 and "nothing to evict" in out


def test_store7_gc_removes_stale_temporaries(filled, capsys):
    d = os.path.dirname(file_of(filled, filled["a"][0]))
    old, fresh = os.path.join(d, ".tmp-9-dead"), os.path.join(d, ".tmp-9-1fe")
    for p in (old, fresh):
        with open(p, "wb") as fh:
            fh.write(b"half an object")
    os.utime(old, (1e9, 1e9))
    status, out, _ = run(capsys, "gc", "--url", filled["url"], "--dry-run")
    assert status == 0 and "would remove 1 stale temporaries" in out and os.path.exists(old)
    status, out, _ = run(capsys, "gc", "--url", filled["url"])
    assert status == 0 and "removed 1 stale temporaries" in out
    assert not os.path.exists(old) and os.path.exists(fresh) and len(filled["store"].list()) == 7


def test_gc_refuses_what_a_backend_does_not_offer(capsys):
    status, _, err = run(capsys, "gc", "--url", "memory://", "--max-bytes", "10")
    assert status == 2 and "--max-bytes is not supported by MemoryStore" in err
    status, _, err = run(capsys, "gc", "--url", "memory://")
    assert status == 2 and "stale temporaries is not supported by MemoryStore" in err
    status, out, _ = run(capsys, "gc", "--url", "memory://", "--verify")
    assert status == 0 and "stale temporaries: not supported by MemoryStore, skipped" in out


# -- the command line as a user meets it -------------------------------------------------------

def _kvwire(*args):
    return subprocess.run([sys.executable, "-m", "kvwire", *map(str, args)], capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.mark.slow
def test_store_cli_as_a_subprocess(filled):
    ok = _kvwire("store", "stats", "--url", filled["url"])
    assert ok.returncode == 0 and "by key root:" in ok.stdout, ok.stderr
    for args, words in [
        (["store", "gc", "--url", filled["url"], "--fingerprint", "xyz"], ["--fingerprint", "hex digits"]),
        (["store", "gc", "--url", filled["url"], "--max-bytes", "-1"], ["--max-bytes", "negative"]),
        (["store", "ls"], ["--url"]),
        (["store", "frob", "--url", filled["url"]], ["invalid choice"]),
        (["store", "stats", "--url", "s3://bucket"], ["not supported", "file://"]),
    ]:
        proc = _kvwire(*args)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and all(w in proc.stderr for w in words), proc.stderr
    helptext = " ".join(_kvwire("--help").stdout.split())
    assert "store" in helptext and "inspect KEY, gc" in helptext
    sub = _kvwire("store", "--help").stdout
    assert all(c in sub for c in ("stats", "ls", "inspect", "gc", "KVW-STORE-17", "--dry-run"))


def test_store17_inspect_of_bytes_that_are_no_container_exits_1(filled, capsys):
    key = KeySpace(FP, "bf16", 4, (0, 1)).key(bytes(32))
    filled["store"].put(key, b"junk" * 10)
    status, out, err = run(capsys, "inspect", "--url", filled["url"], key, "--json")
    assert status == 1 and err.splitlines()[0] == "BAD_MAGIC"
    d = json.loads(out)
    assert d["ok"] is False and d["header"] is None and d["error"]["code"] == "BAD_MAGIC" and d["size"] == 40
