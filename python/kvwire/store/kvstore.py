"""``KVStore``: KV caches in a store as one file-form container per chunk (spec/store.md).

Why per chunk: two requests that share a prefix share the objects of the shared chunks,
and a prompt's hit query is one batch ``exists`` over its chunk keys, reading no tensor
bytes. Each object is an ordinary container (all layers of ``chunk_tokens`` tokens,
``first_position`` = k * chunk_tokens, a one-hash ``PrefixChain`` rooted in the previous
chunk's hash, KVW-PREFIX-5), so ``kvwire validate`` reads it and nothing about the store
is hidden in the bytes.

Loading reads every object's header with one batched ranged get (``HEAD_BYTES`` from the
start; the rest only when the header says it is longer), checks that the object is the
one the key promises (fingerprint, dtype, position, prefix hash, architecture), and only
then reads and decodes the bodies with checksums verified. A corrupted or mismatched
object is counted, deleted and treated as a miss: never returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..cache.encoder import iter_buffers
from ..cache.kvcache import KVCache
from ..cache.reader import Reader, probe
from ..cache.tensors import as_numpy
from ..format.crossmodel import PrefixChain
from ..format.errors import ChecksumError, FormatError, TruncatedError
from ..format.header import TokenRange
from ..format.prefix import PREFIX_SCHEME, prefix_hashes, prefix_root
from .base import Store
from .keys import KeySpace

HEAD_BYTES = 64 << 10  # first ranged read of an object: enough for the header of any usual model


@dataclass
class PutResult:
    keys: list = field(default_factory=list)
    written: int = 0
    skipped: int = 0
    bytes_out: int = 0


@dataclass
class LoadResult:
    cache: KVCache | None  # None when no leading chunk was served
    tokens: int  # leading tokens covered
    chunks: int


class KVStore:
    """Chunk objects of KV caches in a ``Store`` (``MemoryStore``, ``LocalStore``, ...)."""

    def __init__(self, store: Store):
        if not isinstance(store, Store):
            raise TypeError(f"KVStore needs a kvwire.store.Store (open_store(url)), not {type(store).__name__}")
        self.store = store
        self.counts = dict(hits=0, misses=0, queries=0, objects_written=0, objects_skipped=0,
                           checksum_failures=0, corrupt=0, incompatible=0)

    # -- writing -------------------------------------------------------------------------
    def put_cache(self, cache, tokens, *, codec="raw", tp_rank: int = 0, tp_size: int = 1,
                  partial: bool = False) -> PutResult:
        """Store the whole chunks of ``cache`` (and its trailing partial chunk when
        ``partial``); chunks whose object exists are not encoded or written again."""
        space, toks = self._check_cache(cache, tokens, codec, tp_rank, tp_size)
        h, C = cache.header, space.chunk_tokens
        hashes = space.hashes(toks, partial=partial)
        keys = [space.key(x) for x in hashes]
        there = self.store.exists_many(keys)
        out = PutResult(keys=keys, skipped=sum(there))
        root = prefix_root(space.fingerprint, C)
        for k, (key, present) in enumerate(zip(keys, there)):
            if present:
                continue
            a, b = k * C, min((k + 1) * C, h.token_count)
            prev = root if k == 0 else hashes[k - 1]
            sub = KVCache(h.replace(token_count=b - a, first_position=a,
                                    prefix=PrefixChain(PREFIX_SCHEME, prev, hashes[k])),
                          [{c: x[:, a:b, :] for c, x in layer.items()} for layer in cache.layers])
            before = self.store.stats.bytes_out
            if self.store.put(key, iter_buffers(sub, form="file", codec=codec)):
                out.written += 1
                out.bytes_out += self.store.stats.bytes_out - before
            else:
                out.skipped += 1
        self.counts["objects_written"] += out.written
        self.counts["objects_skipped"] += out.skipped
        return out

    @staticmethod
    def _check_cache(cache, tokens, codec, tp_rank, tp_size):
        if not isinstance(cache, KVCache):
            raise TypeError(f"put_cache needs a kvwire.KVCache, not {type(cache).__name__}")
        h = cache.header
        if h.sparse is not None or any(s.kind != "full_attention" for s in h.arch.layers):
            raise ValueError("the store holds caches of full-attention layers (no sparse, state or "
                             "sliding-window layers yet)")
        if h.first_position != 0 or any(r != TokenRange(0, h.token_count) for r in h.layer_tokens):
            raise ValueError("the store holds caches from position 0 whose layers all hold every token")
        toks = np.asarray(tokens)
        if toks.ndim != 1 or len(toks) != h.token_count:
            raise ValueError(f"tokens: {len(toks) if toks.ndim == 1 else 'not 1-D'} token ids for a cache of "
                             f"{h.token_count} tokens")
        return KeySpace.of(h, tp_rank=tp_rank, tp_size=tp_size, codec=codec), toks

    # -- the hit query -------------------------------------------------------------------
    def leading_hits(self, keys) -> int:
        """How many leading ``keys`` have an object: one batch exists call, no bytes read."""
        self.counts["queries"] += 1
        return self.store.leading(list(keys))

    # -- reading -------------------------------------------------------------------------
    def get_cache(self, tokens, space: KeySpace, n_chunks: int | None = None) -> LoadResult:
        """The leading stored chunks of ``tokens`` (at most ``n_chunks``) as one KVCache."""
        if not isinstance(space, KeySpace):
            raise TypeError(f"space must be a kvwire.store.KeySpace (KeySpace.of(header)), not {type(space).__name__}")
        if n_chunks is not None and (not isinstance(n_chunks, int) or isinstance(n_chunks, bool) or n_chunks < 0):
            raise ValueError(f"n_chunks must be None or an int >= 0, not {n_chunks!r}")
        hashes = space.hashes(tokens, partial=True)[:n_chunks]
        keys = [space.key(x) for x in hashes]
        heads = self.store.get_many(keys, (0, HEAD_BYTES))
        parts: list[KVCache] = []
        for k, (key, head) in enumerate(zip(keys, heads)):
            got = None if head is None else self._object(key, head, k, hashes[k], space, parts)
            if got is None:
                break
            parts.append(got)
        self.counts["hits"] += len(parts)
        self.counts["misses"] += len(keys) - len(parts)
        if not parts:
            return LoadResult(None, 0, 0)
        first, total = parts[0].header, sum(p.header.token_count for p in parts)
        header = first.replace(token_count=total, first_position=0, prefix=PrefixChain(
            PREFIX_SCHEME, prefix_root(space.fingerprint, space.chunk_tokens),
            prefix_hashes(np.asarray(tokens)[:total], space.chunk_tokens, space.fingerprint)))
        layers = [{c: np.concatenate([as_numpy(p.layers[i][c]) for p in parts], axis=1) for c in first_layer}
                  for i, first_layer in enumerate(parts[0].layers)]
        return LoadResult(KVCache(header, layers), total, len(parts))

    load = get_cache

    def _object(self, key, head, k, want_hash, space, parts) -> KVCache | None:
        try:
            try:
                h = probe(head)
            except TruncatedError as exc:
                if exc.needed is None or len(head) < HEAD_BYTES:
                    raise  # the whole object was read and is short: corrupt
                head = self.store.get(key, (0, exc.needed))
                if head is None:
                    return None
                h = probe(head)
            if not self._matches(h, k, want_hash, space, parts):
                self.counts["incompatible"] += 1
                self.store.delete(key)
                return None
            buf = head if len(head) < HEAD_BYTES else self.store.get(key)
            if buf is None:
                return None  # evicted between the two reads: a miss
            return Reader(buf).load(verify=True)
        except ChecksumError:
            self.counts["checksum_failures"] += 1
        except FormatError:
            self.counts["corrupt"] += 1
        self.store.delete(key)
        return None

    @staticmethod
    def _matches(h, k, want_hash, space, parts) -> bool:
        C, p = space.chunk_tokens, h.prefix
        return (h.model.compat_fingerprint == space.fingerprint and h.dtype == space.dtype
                and h.chunk_tokens == C and h.first_position == k * C and 0 < h.token_count <= C
                and h.num_layers == space.layers[1] - space.layers[0] and h.sparse is None
                and p is not None and p.scheme == PREFIX_SCHEME and p.hashes == want_hash
                and (not parts or (h.arch == parts[0].header.arch and parts[-1].header.token_count == C)))

    # -- stats ---------------------------------------------------------------------------
    def stats(self) -> dict:
        """This KVStore's chunk counts (hits, misses, hit_rate, objects written/skipped,
        checksum failures...) and its store's byte and eviction counters."""
        s = self.store.stats
        asked = self.counts["hits"] + self.counts["misses"]
        return {**self.counts, "hit_rate": self.counts["hits"] / asked if asked else 0.0,
                "bytes_in": s.bytes_in, "bytes_out": s.bytes_out, "evictions": s.evictions}


__all__ = ["HEAD_BYTES", "KVStore", "LoadResult", "PutResult"]
