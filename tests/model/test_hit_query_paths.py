"""The hit query's hot paths, made cheaper (benchmarks/bench_scaling.py), keep
their exact results: the prefix chain hashes chunks in place instead of copying them, and a
KeySpace builds its key root once instead of once per key."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.format.prefix import chain, prefix_hashes, prefix_root
from kvwire.store import KeySpace


def naive_chain(tokens, chunk_tokens, root):
    """KVW-PREFIX-3 as written: H_k = SHA-256(H_{k-1} || u32le tokens of chunk k)."""
    raw = np.asarray(tokens, "<u4").tobytes()
    prev, out = root, b""
    for off in range(0, len(raw), 4 * chunk_tokens):
        prev = hashlib.sha256(prev + raw[off:off + 4 * chunk_tokens]).digest()
        out += prev
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=300), st.integers(1, 40), st.binary(min_size=1, max_size=64))
def test_chain_equals_the_definition(tokens, chunk_tokens, fp):
    root = prefix_root(fp, chunk_tokens)
    for dtype in ("<u4", "<i8", "<u2"):
        a = np.asarray(tokens, np.uint64)
        if dtype == "<u2":
            a = a % 65536
        elif dtype == "<i8":
            a = a.astype(np.int64)
        got = chain(a.astype(dtype), chunk_tokens, root)
        assert got == naive_chain(a, chunk_tokens, root)
        assert len(got) == 32 * -(-len(tokens) // chunk_tokens)
    assert prefix_hashes(tokens, chunk_tokens, fp) == naive_chain(tokens, chunk_tokens, root)


@settings(max_examples=40, deadline=None)
@given(st.binary(min_size=1, max_size=64), st.sampled_from(["bf16", "f16", "f8_e4m3fn"]), st.integers(1, 4096),
       st.integers(0, 7), st.integers(1, 8), st.integers(1, 64))
def test_key_root_is_the_spaces_own(fp, dtype, chunk_tokens, rank, size_extra, layers):
    size = rank + size_extra
    space = KeySpace(fp, dtype, chunk_tokens, (0, layers), rank, size)
    want = f"kvw1/{fp.hex()}/{dtype}/tp{rank}of{size}/l0-{layers}/lossless/c{chunk_tokens}/"
    h = hashlib.sha256(fp).digest()
    assert space.root == want and space.key(h) == want + h.hex()
    assert space.key(h) == want + h.hex()  # the cached root, second use
    other = dataclasses.replace(space, chunk_tokens=chunk_tokens + 1, layers=(1, layers + 1))
    assert other.root == f"kvw1/{fp.hex()}/{dtype}/tp{rank}of{size}/l1-{layers + 1}/lossless/c{chunk_tokens + 1}/"
    assert space.root == want  # a replaced space does not share the cache
    assert space == KeySpace(fp, dtype, chunk_tokens, (0, layers), rank, size)  # equality ignores the cache
    assert hash(space) == hash(KeySpace(fp, dtype, chunk_tokens, (0, layers), rank, size))
    assert KeySpace.parse(space.key(h)) == (space, h)
