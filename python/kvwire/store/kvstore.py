"""``KVStore``: KV caches in a store as one file-form container per chunk (spec/store.md).

Why per chunk: two requests that share a prefix share the objects of the shared chunks,
and a prompt's hit query is one batch ``exists`` over its chunk keys, reading no tensor
bytes. Each object is an ordinary container (the key's layers of ``chunk_tokens`` tokens,
``first_position`` = k * chunk_tokens, a one-hash ``PrefixChain`` rooted in the previous
chunk's hash, KVW-PREFIX-5), so ``kvwire validate`` reads it and nothing about the store
is hidden in the bytes.

Writing checks which objects exist first (one ``exists_many``; existing ones are not even
encoded), then hands the encoder's buffers (raw bodies are views of the caller's arrays)
to ``put_many`` unjoined, in batches of at most ``batch_bytes`` (256 MiB on a networked
backend: one round trip for a usual prompt, not one per chunk; 16 MiB in process and on
local files, where a call costs nothing and a batch that stays in the CPU cache is faster).

Loading reads every object's header with one batched ranged get (``HEAD_BYTES`` from the
start; the rest only when the header says it is longer), checks that the object is the
one the key promises (fingerprint, dtype, position, prefix hash, layers, architecture),
then reads the bodies of all the objects that passed with one ``get_many`` (per
``batch_bytes`` of them) and decodes each chunk, checksums verified, straight into its
token slice of the result: arrays of the final size cut from one allocation (which gets
huge pages: faulted in 2-3x faster than one allocation per array), no per-chunk cache,
no concatenation. A corrupted or mismatched object is counted, deleted
and treated as a miss, never returned (KVW-STORE-17); the hits end at the first miss,
and the result is then a view of the leading tokens of those arrays (no second copy).

Layer ranges (KVW-STORE-16, ``l<start>-<stop>``): ``put_cache(..., layers=(a, b))`` stores
model layers [a, b) alone (a pipeline-parallel stage, a layer-wise writer). The container
says which model layers it holds with the format's own means, a layer map (kvwire-v1.md
section 7): receiver layer ``a + i`` is a ``copy`` of transmitted layer ``i``, and the
model's other layers, not listed, are recomputed by a receiver (KVW-MAP-6); the
compatibility check (crossmodel.md, KVW-XM-6) then compares the right layers, and
``layer_weights_fingerprints`` and the fp8 ``kv_scales`` (KVW-SCALE-8) are cut to the held
layers. A cache that holds every layer keeps its header's map (usually none). The reader
checks ``num_layers == b - a`` and, for ``a > 0``, that the object's layer map is exactly
that range map. A cache whose header carries such a range map (a ``get_cache`` of a layer
range) holds those model layers, so ``put_cache`` keys it under them again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..cache.encoder import iter_buffers
from ..cache.kvcache import KVCache
from ..cache.reader import Reader
from ..cache.tensors import as_numpy, carve
from ..format.container import tensor_bytes_per_token
from ..format.crossmodel import PrefixChain
from ..format.errors import ChecksumError, FormatError
from ..format.header import TokenRange
from ..format.prefix import PREFIX_SCHEME, prefix_root
from ..model.compat import LocalModel, check_compatible
from .auth import Keyring
from .base import BATCH_BYTES, LOCAL_BATCH_BYTES, Store
from .counters import KVStoreCounts
from .identity import with_identity
from .keys import KeySpace, codec_fidelity, held_layers, range_map
from .objects import HEAD_BYTES, Opened, open_heads, request_keys
from .tagged import TagChecks

# Layer kinds whose cache is one row per token, so a chunk of tokens is a slice of every layer.
TOKEN_KINDS = ("full_attention", "sliding_attention", "chunked_attention", "mla_latent")


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


@dataclass
class Lookup:
    """The scheduler's answer for one prompt (``KVStore.lookup``): how many leading chunks
    (and tokens) the store can serve, decided without loading a tensor."""

    chunks: int  # leading chunk objects that exist and whose first header passed
    tokens: int  # tokens they cover: an upper bound, a later object may still fail its checks
    header: object = None  # the first hit's header (one ranged read), None without a hit
    verdict: object = None  # kvwire.check_compatible(header, local) when ``local`` was given
    bytes_read: int = 0  # object bytes this lookup read (the first hit's header only)
    round_trips: int = 0  # requests to the store's servers (0 on local backends)


class KVStore(TagChecks):
    """Chunk objects of KV caches in a ``Store`` (``MemoryStore``, ``LocalStore``, ...)."""

    def __init__(self, store: Store, *, batch_bytes: int | None = None, auth: Keyring | None = None):
        """``batch_bytes``: object bytes per ``put_many``/``get_many`` batch (default: the
        backend's ``batch_bytes``, 256 MiB on a networked store, 16 MiB in process and on
        local files). ``auth``: a ``kvwire.store.auth.Keyring``: every object written is
        tagged, and an object is served only when its tag verifies (KVW-AUTH-*)."""
        if auth is not None and not isinstance(auth, Keyring):
            raise TypeError(f"auth must be None or a kvwire.store.auth.Keyring (Keyring.load()), not "
                            f"{type(auth).__name__}")
        if not isinstance(store, Store):
            raise TypeError(f"KVStore needs a kvwire.store.Store (open_store(url)), not {type(store).__name__}")
        if batch_bytes is None:
            batch_bytes = store.batch_bytes
        if not isinstance(batch_bytes, int) or isinstance(batch_bytes, bool) or batch_bytes < 1:
            raise ValueError(f"batch_bytes must be None or a positive int, not {batch_bytes!r}")
        self.store, self.batch_bytes, self.auth = store, batch_bytes, auth
        self.counts = KVStoreCounts()  # updated under its lock: a layer-wise load runs on a thread
        self.last_get = dict(seconds=0.0, bytes=0, tensor_bytes=0)
        self.last_put = dict(seconds=0.0, bytes=0, tensor_bytes=0)

    # -- writing -------------------------------------------------------------------------
    def put_cache(self, cache, tokens, *, codec="raw", tp_rank: int = 0, tp_size: int = 1,
                  partial: bool = False, layers: tuple[int, int] | None = None, identity=None) -> PutResult:
        """Store the whole chunks of ``cache`` (and its trailing partial chunk when
        ``partial``); chunks whose object exists are not encoded or written again.

        ``layers=(a, b)``: only model layers [a, b) (default: all the cache holds), keyed
        under ``l<a>-<b>`` (KVW-STORE-16); read them back with ``KeySpace(..., layers=(a, b))``.

        A cache may start at a chunk boundary ``first_position = f * chunk_tokens`` (an
        engine that saves the chunks a prefill step completed): ``tokens`` are then every
        token from position 0 to its end, since a chunk's key binds all tokens before it,
        and chunks ``f, f + 1, ...`` are stored. ``identity``: the request's ``RequestIdentity``
        (KVW-IDENT-4), None: none."""
        t0 = time.perf_counter()
        space, toks, sub = self._check_cache(cache, tokens, codec, tp_rank, tp_size, layers)
        h, C = sub.header, space.chunk_tokens
        F = h.first_position // C  # the cache's first chunk
        hashes, spaces, keys = request_keys(space, toks, partial=partial, identity=identity)  # KVW-IDENT-4
        keys = keys[F:]
        there = [True] * F + self.present(keys)  # with auth: an untagged object is written again
        keys = [None] * F + keys
        out = PutResult(keys=keys[F:], skipped=sum(map(bool, there[F:])))
        root = prefix_root(space.fingerprint, C)
        per_token = tensor_bytes_per_token(h)
        batch: list = []
        size = tensor = 0
        for k, (key, present) in enumerate(zip(keys, there)):
            if present:
                continue
            a, b = k * C, min((k + 1) * C, h.first_position + h.token_count)
            md = with_identity(h.metadata, spaces[k].identity_digest)  # KVW-IDENT-5
            obj = KVCache(h.replace(token_count=b - a, first_position=a, metadata=md,
                                    prefix=PrefixChain(PREFIX_SCHEME, root if k == 0 else hashes[k - 1], hashes[k])),
                          [{c: x[:, a - h.first_position:b - h.first_position, :] for c, x in layer.items()}
                           for layer in sub.layers])
            bufs = list(iter_buffers(obj, form="file", codec=codec))  # raw bodies: views of the caller's arrays
            n = sum(memoryview(x).nbytes for x in bufs)
            if batch and size + n > self.batch_bytes:
                self._put_batch(batch, out)
                batch, size = [], 0
            batch.append((key, bufs, n))
            size += n
            tensor += per_token * (b - a)
        if batch:
            self._put_batch(batch, out)
        self.counts.add(objects_written=out.written, objects_skipped=out.skipped, bytes_written=out.bytes_out)
        self.last_put = dict(seconds=time.perf_counter() - t0, bytes=out.bytes_out, tensor_bytes=tensor)
        return out

    def _put_batch(self, batch, out: PutResult) -> None:
        """One ``put_many`` of (key, buffers) items: one round trip on a networked backend."""
        done = self.put_tagged([(key, bufs) for key, bufs, _ in batch])  # each with its tag (KVW-AUTH-3)
        for (_, _, n), written in zip(batch, done):
            if written:
                out.written += 1
                out.bytes_out += n
            else:
                out.skipped += 1  # another writer published it first (KVW-STORE-1)

    @staticmethod
    def _check_cache(cache, tokens, codec, tp_rank, tp_size, layers):
        h = getattr(cache, "header", None)
        if getattr(h, "sparse", None) is not None:
            raise ValueError("the store holds dense caches of full-attention layers, not sparse (evicted) ones "
                             "(spec/sparse.md): store the dense cache")
        if not isinstance(cache, KVCache):
            raise TypeError(f"put_cache needs a kvwire.KVCache, not {type(cache).__name__}")
        other = sorted({s.kind for s in h.arch.layers} - set(TOKEN_KINDS))
        if other:
            raise ValueError(f"the store holds caches of {', '.join(TOKEN_KINDS)} layers; this one has "
                             f"{', '.join(other)} layers (a state or shared layer is not cut into token chunks)")
        F = h.first_position
        if F % h.chunk_tokens or any(r != TokenRange(F, h.token_count) for r in h.layer_tokens):
            raise ValueError("the store holds caches from position 0 (or a chunk boundary) whose layers all hold "
                             "every token (a sliding-window layer that kept only its window cannot be cut into "
                             "chunks from 0)")
        toks = np.asarray(tokens)
        if toks.ndim != 1 or len(toks) != F + h.token_count:
            raise ValueError(f"tokens: {len(toks) if toks.ndim == 1 else 'not 1-D'} token ids for a cache of "
                             f"{h.token_count} tokens from position {F} (give every token from position 0)")
        held = held_layers(h)
        a, b = held if layers is None else _layer_range(layers, held)
        if (a, b) != held and h.layer_map and h.layer_map != range_map(*held):
            raise ValueError("a layer range of a cache with a layer map is not supported: store all its layers "
                             "(layers=None)")
        space = KeySpace(fingerprint=h.model.compat_fingerprint, dtype=h.dtype, chunk_tokens=h.chunk_tokens,
                         layers=(a, b), tp_rank=tp_rank, tp_size=tp_size, fidelity=codec_fidelity(codec))
        lo, hi = a - held[0], b - held[0]
        arrays = [{c: as_numpy(x) for c, x in layer.items()} for layer in cache.layers[lo:hi]]  # a GPU layer: once
        if (a, b) == held:
            return space, toks, KVCache(h, arrays)
        # every per-layer value cut to the held layers: specs, token ranges, layer_weights_fingerprints
        # (KVW-ID-7) and the fp8 kv_scales (KVW-SCALE-8); then the range map (KVW-STORE-16)
        return space, toks, KVCache(h.layer_slice(lo, hi).replace(layer_map=range_map(a, b)), arrays)

    # -- the hit query -------------------------------------------------------------------
    def leading_hits(self, keys) -> int:
        """How many leading ``keys`` have an object: one batch exists call, no bytes read."""
        self.counts.add("queries")
        return self.store.leading(list(keys))

    def lookup(self, tokens, space: KeySpace, *, local=None, partial: bool = False, identity=None) -> Lookup:
        """How much of ``tokens`` the store serves, for a scheduler deciding a cache hit:
        the hit query over the prompt's chunk keys (one round trip, no object bytes), then,
        when there is a hit, the first hit's header alone (one ranged get of HEAD_BYTES),
        checked against its key (KVW-STORE-17) and, with ``local`` (a ``kvwire.LocalModel``),
        for compatibility (``kvwire.check_compatible``: a foreign model never matches). A
        first object that fails is a miss (deleted when it is corrupt or not the key's);
        ``identity`` as in ``put_cache``."""
        if not isinstance(space, KeySpace):
            raise TypeError(f"space must be a kvwire.store.KeySpace (KeySpace.of(header)), not {type(space).__name__}")
        if local is not None and not isinstance(local, LocalModel):
            raise TypeError(f"local must be None or a kvwire.LocalModel, not {type(local).__name__}")
        trips0 = self.store.stats.round_trips
        hashes, spaces, keys = request_keys(space, tokens, partial=partial, identity=identity)
        n = self.leading_hits(keys)
        if not n:
            return Lookup(0, 0, round_trips=self.store.stats.round_trips - trips0)
        opened = open_heads(self, keys, hashes, spaces, count=1)  # one batch, with the tag (KVW-AUTH-7)
        trips, read = self.store.stats.round_trips - trips0, opened.bytes_read
        if not opened.heads:
            return Lookup(0, 0, bytes_read=read, round_trips=trips)
        header = opened.heads[0].header
        verdict = None if local is None else check_compatible(header, local)
        if verdict is not None and not verdict:
            return Lookup(0, 0, header, verdict, read, trips)
        C, T = space.chunk_tokens, len(np.asarray(tokens))
        return Lookup(n, min(n * C, T), header, verdict, read, trips)

    # -- reading -------------------------------------------------------------------------
    def get_cache(self, tokens, space: KeySpace, n_chunks: int | None = None, *, identity=None) -> LoadResult:
        """The leading stored chunks of ``tokens`` (at most ``n_chunks``) of a request of
        ``identity`` (as in ``put_cache``) as one KVCache of the space's layers."""
        t0 = time.perf_counter()
        if not isinstance(space, KeySpace):
            raise TypeError(f"space must be a kvwire.store.KeySpace (KeySpace.of(header)), not {type(space).__name__}")
        if n_chunks is not None and (not isinstance(n_chunks, int) or isinstance(n_chunks, bool) or n_chunks < 0):
            raise ValueError(f"n_chunks must be None or an int >= 0, not {n_chunks!r}")
        hashes, spaces, keys = request_keys(space, tokens, n_chunks=n_chunks, identity=identity)
        opened = open_heads(self, keys, hashes, spaces)  # headers checked, tags verified (KVW-STORE-17, AUTH-6)
        cache, hits, total = self._decode_all(opened, space)
        self.counts.add(hits=hits, misses=len(opened.keys) - hits, bytes_read=opened.bytes_read)
        self.last_get = dict(seconds=time.perf_counter() - t0, bytes=opened.bytes_read,
                             tensor_bytes=cache.nbytes if cache is not None else 0)
        return LoadResult(cache, total, hits)

    load = get_cache

    def discard(self, key: str, reason: str) -> None:
        """Count a bad object under ``reason`` ("corrupt", "incompatible" or
        "checksum_failures") and delete it: it is never served again (KVW-STORE-17). For
        this package's readers (``objects``, ``layerwise``), not an API."""
        self.counts.add(reason)
        self.store.delete(key)

    def _decode_all(self, opened: Opened, space):
        """(cache, chunks served, tokens) of the opened objects: bodies by batched
        ``get_many``, each decoded into its token slice of arrays of the final size."""
        checked = opened.heads
        if not checked:
            return None, 0, 0
        first = checked[0].header
        total = sum(x.header.token_count for x in checked)
        shapes = [s.shape(c, total) for s in first.arch.layers for c in s.components]
        slabs = iter(carve(shapes, first.dtype, "numpy"))  # one allocation of the final size: huge pages
        outs = [{c: next(slabs) for c in s.components} for s in first.arch.layers]
        per_token, C = tensor_bytes_per_token(first), space.chunk_tokens
        hits, i = 0, 0
        while i == hits < len(checked):
            j, size = i, 0  # the next batch: objects i..j-1 of at most batch_bytes (estimated: tensor bytes)
            while j < len(checked) and (j == i or size + per_token * checked[j].header.token_count <= self.batch_bytes):
                size += per_token * checked[j].header.token_count
                j += 1
            need = [n for n in range(i, j) if not checked[n].whole]  # the rest were read whole
            bodies: dict[int, Any] = dict(zip(need, self.store.get_many([checked[n].key for n in need]))) if need else {}
            opened.bytes_read += sum(len(x) for x in bodies.values() if x is not None)
            for n in range(i, j):
                buf = bodies.pop(n, checked[n].first)
                if buf is None or not self._decode_into(checked[n], buf, outs, n * C):
                    break  # evicted between the two reads, or corrupt: the hits end here
                hits += 1
            i = j
        if not hits:
            return None, 0, 0
        served = sum(x.header.token_count for x in checked[:hits])
        if served < total:  # the leading tokens only: views, no second copy
            outs = [{c: x[:, :served, :] for c, x in layer.items()} for layer in outs]
        header = first.replace(token_count=served, first_position=0, metadata=with_identity(first.metadata, None),
                               prefix=PrefixChain(
            PREFIX_SCHEME, prefix_root(space.fingerprint, C), b"".join(opened.hashes[:hits])))
        return KVCache(header, outs), hits, served

    def _decode_into(self, head, buf, outs, start: int) -> bool:
        """Decode one opened object (``head``: an ``objects.Head``), checksums (and with a
        tag, its digests: KVW-AUTH-6) verified, into tokens [start, start + count) of
        ``outs``; False (the object counted and deleted) when it fails."""
        key, h, tag = head.key, head.header, head.tag
        try:
            r = Reader(buf, known_header=(h, head.first))  # header bytes as checked: not parsed again
            if r.header != h:  # objects are immutable: a changed one is not the one checked
                self.discard(key, "incompatible")
                return False
            if tag is not None and not (self.verify_index(key, tag, r, buf) and self.verify_bodies(key, tag, r, buf)):
                return False  # counted (and a forged one deleted) by the tag checks
            stop = start + h.token_count
            for i, layer in enumerate(outs):  # bodies whose SHA-256 the tag vouched for need no XXH3 pass (CSUM-3)
                r.layer(i, verify=tag is None, out={c: x[:, start:stop, :] for c, x in layer.items()})
            return True
        except ChecksumError:
            self.discard(key, "checksum_failures")
        except FormatError:
            self.discard(key, "corrupt")
        return False

    # -- stats ---------------------------------------------------------------------------
    def stats(self) -> dict:
        """This KVStore's chunk counts (hits, misses, hit_rate, objects written/skipped,
        checksum failures, bytes_read/bytes_written of its own objects), the last
        ``get_cache``/``put_cache`` (``last_get_*``/``last_put_*``: seconds, object bytes,
        tensor bytes, and ``*_gbps`` = tensor bytes / wall seconds / 1e9; a put counts only
        the chunks it encoded) and its store's byte and eviction counters."""
        s, counts = self.store.stats, self.counts.as_dict()
        asked = counts["hits"] + counts["misses"]
        last = {}
        for name, d in (("get", self.last_get), ("put", self.last_put)):
            last.update({f"last_{name}_{k}": v for k, v in d.items()})
            last[f"last_{name}_gbps"] = d["tensor_bytes"] / d["seconds"] / 1e9 if d["seconds"] else 0.0
        return {**counts, "hit_rate": counts["hits"] / asked if asked else 0.0, **last,
                "bytes_in": s.bytes_in, "bytes_out": s.bytes_out, "evictions": s.evictions}


def _layer_range(layers, held) -> tuple[int, int]:
    if (not isinstance(layers, tuple) or len(layers) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers)):
        raise ValueError(f"layers must be None or a (start, stop) tuple of ints, not {layers!r}")
    a, b = layers
    if not held[0] <= a < b <= held[1]:
        raise ValueError(f"layers {layers!r}: need {held[0]} <= start < stop <= {held[1]} (the model layers "
                         "the cache holds)")
    return a, b


__all__ = ["BATCH_BYTES", "HEAD_BYTES", "LOCAL_BATCH_BYTES", "KVStore", "LoadResult", "Lookup", "PutResult", "held_layers",
           "range_map"]
