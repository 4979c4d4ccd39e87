"""Cache hits from headers alone (spec/crossmodel.md, KVW-PREFIX-6): how many leading
tokens of a request a stored cache covers, and an index of many caches' chains, so a
scheduler decides a hit without loading tensors. The chain itself is
``kvwire.format.prefix``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from ..format.header import Header
from ..format.prefix import HASH_SIZE, PREFIX_SCHEME, chain, num_chunks, prefix_root, token_bytes


def covered_tokens(header: Header, tokens: Sequence[int], *, fingerprint: bytes | None = None) -> int:
    """How many leading tokens of ``tokens`` (a request from position 0) the cache's chain covers.

    Decided from the header alone (KVW-PREFIX-6). Returns 0 without a (known-scheme) prefix
    chain or when ``fingerprint`` (the receiver's compat fingerprint) differs from the
    header's. For a cache with ``first_position`` p > 0 the count is from position 0 and
    is either 0 or at least p + 1: the tokens before p must come from elsewhere. A cache
    with state layers covers all of its tokens or none (KVW-STATE-6).
    """
    if not isinstance(header, Header):
        raise TypeError(f"header must be a kvwire.Header (Reader.header, kvwire.probe(...)), not "
                        f"{type(header).__name__}")
    p = header.prefix
    if p is None or p.scheme != PREFIX_SCHEME:
        return 0
    fp = header.model.compat_fingerprint
    if fingerprint is not None and bytes(fingerprint) != fp:
        return 0
    C, start = header.chunk_tokens, header.first_position
    toks = np.asarray(tokens)
    if len(toks) <= start:
        return 0
    prev = prefix_root(fp, C)
    if start:
        head = chain(toks[:start], C, prev)
        if head[-HASH_SIZE:] != p.root:
            return 0
        prev = p.root
    covered = start
    raw = token_bytes(toks[start:start + header.token_count])
    for k in range(num_chunks(header.token_count, C)):
        want = p.hashes[k * HASH_SIZE:(k + 1) * HASH_SIZE]
        n = min(C, header.token_count - k * C)
        piece = raw[4 * k * C:4 * (k * C + n)]
        if len(piece) != 4 * n:
            break
        prev = hashlib.sha256(prev + piece).digest()
        if prev != want:
            break
        covered += n
    if covered < start + header.token_count and any(s.kind == "state" for s in header.arch.layers):
        return 0  # a state is only valid after exactly token_count tokens
    return covered if covered > start else 0


@dataclass(frozen=True)
class Hit:
    key: Hashable
    tokens: int  # leading tokens of the request covered, counted from position 0


class PrefixIndex:
    """Longest-prefix lookup over many caches' prefix chains, keyed by their 32-byte hashes.

    ``add(key, header)`` registers a cache; ``lookup(tokens, fingerprint, chunk_tokens)``
    hashes the request once and returns the cache covering the most leading tokens. Only
    caches starting at position 0 or continuing a chain present here are reachable.
    """

    def __init__(self):
        # chunk hash -> (key, tokens covered through this chunk, whether the cache ends here with state layers)
        self._by_hash: dict[bytes, list[tuple[Hashable, int]]] = {}
        self._partial: dict[tuple[bytes, int], list[tuple[bytes, Hashable, int]]] = {}

    def add(self, key: Hashable, header: Header) -> int:
        """Register a cache's chain; returns the number of chunk hashes added (0 without a chain)."""
        p = header.prefix
        if p is None or p.scheme != PREFIX_SCHEME:
            return 0
        C, T, start = header.chunk_tokens, header.token_count, header.first_position
        has_state = any(s.kind == "state" for s in header.arch.layers)
        prev = p.root if start else prefix_root(header.model.compat_fingerprint, C)
        n = num_chunks(T, C)
        for k in range(n):
            h = p.hashes[k * HASH_SIZE:(k + 1) * HASH_SIZE]
            end = start + min((k + 1) * C, T)
            if has_state and k != n - 1:
                prev = h
                continue  # a state layer's cache is usable at its end only
            if T - k * C < C:
                self._partial.setdefault((prev, C), []).append((h, key, end))
            else:
                self._by_hash.setdefault(h, []).append((key, end))
            prev = h
        return n

    def lookup(self, tokens: Sequence[int], fingerprint: bytes, chunk_tokens: int) -> Hit | None:
        """The cache covering the most leading tokens of ``tokens``, or None."""
        raw = token_bytes(tokens)
        prev = prefix_root(fingerprint, chunk_tokens)
        best: Hit | None = None
        step = 4 * chunk_tokens
        for off in range(0, len(raw), step):
            for h, key, end in self._partial.get((prev, chunk_tokens), ()):
                r = 4 * (end - off // 4)  # the partial chunk's length in bytes
                if 0 < r <= len(raw) - off and hashlib.sha256(prev + raw[off:off + r]).digest() == h:
                    if best is None or end > best.tokens:
                        best = Hit(key, end)
            if len(raw) - off < step:
                break
            prev = hashlib.sha256(prev + raw[off:off + step]).digest()
            hits = self._by_hash.get(prev)
            if hits:
                key, end = hits[0]
                if best is None or end > best.tokens:
                    best = Hit(key, end)
        return best
