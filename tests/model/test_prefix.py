"""Prefix hash chain (spec/crossmodel.md section 5, KVW-PREFIX-*)."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import forge
import kvwire
from kvwire import PrefixChain
from kvwire.format import registry as R
from kvwire.format.errors import SchemaError
from kvwire.format.header import build_header, parse_header
from kvwire.format.prefix import prefix_root
from kvwire.model.prefix import PrefixIndex

FP = hashlib.sha256(b"model").digest()
FULL = kvwire.LayerSpec("full_attention", 1, 4, 4)
STATE = kvwire.LayerSpec("state", state_tensors=(kvwire.StateTensor("s", (2,)),))


def root(fp: bytes, c: int) -> bytes:
    """R0 of KVW-PREFIX-2, computed independently."""
    return hashlib.sha256(b"kvwire.prefix.v1\0" + struct.pack("<HII", 1, c, len(fp)) + fp).digest()


def chain(tokens, c: int, start: bytes) -> bytes:
    out, prev = bytearray(), start
    for k in range(0, len(tokens), c):
        prev = hashlib.sha256(prev + b"".join(struct.pack("<I", t) for t in tokens[k:k + c])).digest()
        out += prev
    return bytes(out)


def header(tokens, c: int, *, fp: bytes = FP, first_position: int = 0, prefix_root_=None, layers=(FULL,)):
    model = kvwire.ModelIdentity(compat_fingerprint=fp)
    r = root(fp, c) if prefix_root_ is None else prefix_root_
    features = R.REQUIRED_FEATURES["state_layers"] if any(s.kind == "state" for s in layers) else 0
    return kvwire.Header(kvwire.Architecture(tuple(layers)), token_count=len(tokens), dtype="f16", chunk_tokens=c,
                         first_position=first_position, model=model, required_features=features,
                         prefix=PrefixChain(1, r, chain(list(tokens), c, r)))


def test_prefix2_prefix3_hashes_match_the_definition():
    """KVW-PREFIX-2/3: R0 binds fingerprint and chunk size; H_k chains u32le ids; the last chunk is partial."""
    toks = [5, 2**32 - 1, 0, 7, 9, 1, 1]
    assert prefix_root(FP, 3) == root(FP, 3) != root(FP, 4)
    assert root(b"", 3) == prefix_root(b"", 3)
    assert kvwire.prefix_hashes(toks, 3, FP) == chain(toks, 3, root(FP, 3))
    assert len(kvwire.prefix_hashes(toks, 3, FP)) == 3 * 32
    assert kvwire.prefix_hashes(np.array(toks, np.int64), 3, FP) == kvwire.prefix_hashes(toks, 3, FP)
    assert kvwire.prefix_hashes([], 3, FP) == b""
    # a partial chunk of 4 ids under C = 8 is not the full chunk of C = 4: the roots differ
    assert kvwire.prefix_hashes(toks[:4], 8, FP) != kvwire.prefix_hashes(toks[:4], 4, FP)


@pytest.mark.parametrize("bad", [[-1], [2**32], [[1, 2]], [1.5]])
def test_prefix3_token_ids_must_be_u32(bad):
    with pytest.raises(ValueError):
        kvwire.prefix_hashes(bad, 4, FP)


def test_prefix4_hash_of_a_chunk_record():
    """KVW-PREFIX-4: a record's key is hashes[token_start // C]."""
    h = header(list(range(10)), 4)
    assert h.prefix.hash_of(0, 4) == h.prefix.hashes[:32]
    assert h.prefix.hash_of(9, 4) == h.prefix.hashes[64:96]


def test_prefix_chain_round_trips_through_containers():
    h = header(list(range(100, 110)), 4)
    c = forge.small_cache(layers=1, heads=1, head_dim=4, tokens=10, dtype="f16")
    c = kvwire.KVCache(h, c.layers)
    back = kvwire.load(kvwire.encode(c))
    assert back.header.prefix == h.prefix and back.equal(c)


@pytest.mark.parametrize("change, rule", [
    (lambda p: PrefixChain(1, p.root, p.hashes[:-1]), "KVW-PREFIX-3"),
    (lambda p: PrefixChain(1, p.root, p.hashes + bytes(32)), "KVW-PREFIX-3"),
    (lambda p: PrefixChain(1, p.root, b""), "KVW-PREFIX-3"),
    (lambda p: PrefixChain(1, p.root[:31], p.hashes), "KVW-PREFIX-2"),
    (lambda p: PrefixChain(1, b"", p.hashes), "KVW-PREFIX-2"),
    (lambda p: PrefixChain(1, root(b"other", 4), p.hashes), "KVW-PREFIX-2"),
    (lambda p: PrefixChain(1, root(FP, 5), p.hashes), "KVW-PREFIX-2"),
], ids=["hashes-short", "hashes-long", "hashes-absent", "root-short", "root-absent", "root-other-model",
        "root-other-grid"])
def test_prefix_invalid_chains_are_rejected(change, rule):
    """KVW-PREFIX-2, KVW-PREFIX-3: lengths and the model root are checked when the header is read."""
    h = header(list(range(10)), 4)
    bad = h.replace(prefix=change(h.prefix))
    forge.expect(forge.wrap_header(forge.header_of(bad)), SchemaError, "PREFIX_INVALID", rule)
    with pytest.raises(SchemaError):
        build_header(bad)


def test_prefix5_continuations():
    """KVW-PREFIX-5: first_position on the grid, root = chain value of the earlier tokens (not checkable)."""
    toks = list(range(50, 70))
    whole = chain(toks, 4, root(FP, 4))
    tail = header(toks[8:], 4, first_position=8, prefix_root_=whole[32:64])
    assert tail.prefix.hashes == whole[64:]  # the same keys as one cache of the whole sequence
    assert parse_header(build_header(tail)).prefix == tail.prefix
    assert kvwire.covered_tokens(tail, toks) == 20
    assert kvwire.covered_tokens(tail, toks[:8] + [0] * 12) == 0  # nothing beyond the part held elsewhere
    assert kvwire.covered_tokens(tail, [1] + toks[1:]) == 0  # the earlier tokens do not reach the root
    off = header(toks[6:], 4, first_position=6, prefix_root_=bytes(32))
    forge.expect(forge.wrap_header(forge.header_of(off)), SchemaError, "PREFIX_INVALID", "KVW-PREFIX-5")


def test_prefix1_unknown_scheme_is_ignored():
    """KVW-PREFIX-1: a scheme other than 1 is not checked and covers nothing."""
    h = header(list(range(10)), 4).replace(prefix=PrefixChain(7, b"x", b"garbage"))
    assert kvwire.probe(forge.wrap_header(forge.header_of(h))).prefix == PrefixChain(7, b"x", b"garbage")
    assert kvwire.covered_tokens(h, list(range(10))) == 0
    assert PrefixIndex().add("k", h) == 0


def test_prefix6_covered_tokens():
    """KVW-PREFIX-6: whole matching chunks; a partial last chunk only over its own length."""
    toks = list(range(10))
    h = header(toks, 4)
    assert kvwire.covered_tokens(h, toks) == 10
    assert kvwire.covered_tokens(h, toks + [99, 98]) == 10
    assert kvwire.covered_tokens(h, toks[:9] + [0]) == 8  # the partial chunk differs
    assert kvwire.covered_tokens(h, toks[:5] + [0] + toks[6:]) == 4
    assert kvwire.covered_tokens(h, [1] + toks[1:]) == 0
    assert kvwire.covered_tokens(h, toks[:7]) == 4  # chunk 1 is not complete in the request
    assert kvwire.covered_tokens(h, toks, fingerprint=FP) == 10
    assert kvwire.covered_tokens(h, toks, fingerprint=bytes(32)) == 0
    assert kvwire.covered_tokens(h.replace(prefix=None), toks) == 0


def test_prefix6_state_layers_cover_all_or_nothing():
    """KVW-PREFIX-6, KVW-STATE-6: a cache with a state layer is reusable only for exactly its tokens."""
    toks = list(range(10))
    h = header(toks, 4, layers=(FULL, STATE))
    assert kvwire.covered_tokens(h, toks) == 10
    assert kvwire.covered_tokens(h, toks[:9] + [0]) == 0
    assert kvwire.covered_tokens(h, toks + [5]) == 10
    idx = PrefixIndex()
    idx.add("s", h)
    assert idx.lookup(toks + [1, 2], FP, 4).tokens == 10
    assert idx.lookup(toks[:9] + [0], FP, 4) is None


@settings(max_examples=60, deadline=None)
@given(toks=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40), c=st.integers(1, 9), data=st.data())
def test_prefix6_property(toks, c, data):
    """KVW-PREFIX-6: covered = T on a match; else the start of the first chunk holding the first difference."""
    h = header(toks, c)
    assert kvwire.covered_tokens(h, toks) == len(toks)
    d = data.draw(st.integers(0, len(toks) - 1))
    other = list(toks)
    other[d] = (other[d] + 1) % 2**32
    assert kvwire.covered_tokens(h, other) == d // c * c


def test_prefix_index_longest_match():
    """A PrefixIndex finds the cache covering the most leading tokens, from headers only."""
    base = list(range(1000, 1032))
    idx = PrefixIndex()
    assert idx.add("short", header(base[:8], 4)) == 2
    assert idx.add("long", header(base[:24], 4)) == 6
    assert idx.add("partial", header(base[:10], 4)) == 3
    assert idx.add("fork", header(base[:12] + [7, 7, 7, 7], 4)) == 4
    assert idx.add("other-model", header(base, 4, fp=bytes(32))) == 8
    assert idx.add("other-grid", header(base, 8)) == 4
    assert idx.lookup(base, FP, 4) == kvwire.model.prefix.Hit("long", 24)
    assert idx.lookup(base[:11], FP, 4) == kvwire.model.prefix.Hit("partial", 10)
    assert idx.lookup(base[:9], FP, 4).tokens == 8
    assert idx.lookup(base[:12] + [7, 7, 7, 7, 1], FP, 4) == kvwire.model.prefix.Hit("fork", 16)
    assert idx.lookup(base, bytes(32), 4) == kvwire.model.prefix.Hit("other-model", 32)
    assert idx.lookup(base, FP, 8) == kvwire.model.prefix.Hit("other-grid", 32)
    assert idx.lookup([1, 2, 3, 4], FP, 4) is None
    whole = chain(base, 4, root(FP, 4))
    assert idx.add("tail", header(base[24:], 4, first_position=24, prefix_root_=whole[5 * 32:6 * 32])) == 2
    assert idx.lookup(base, FP, 4) == kvwire.model.prefix.Hit("tail", 32)


@pytest.mark.slow
def test_prefix_chain_longer_than_its_limit_is_refused_by_the_writer():
    """KVW-PREFIX-7: up to 2^18 token chunks (2^23 bytes of hashes) are written and read back
    (40,000 chunks: over the old 2^20-byte cap); one chunk more, the writer says so before writing."""
    toks = np.arange(40000) % 1000
    assert parse_header(build_header(header(toks, 1))).prefix.hashes == kvwire.prefix_hashes(toks, 1, FP)
    with pytest.raises(ValueError, match="KVW-PREFIX-7"):
        build_header(header(np.arange((1 << 18) + 1) % 1000, 1))
