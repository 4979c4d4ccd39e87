"""Decode phase: tokens batched into whole chunks and sent as segments (spec KVW-STREAM-3..10).

``DecodeWriter`` sends attention caches as segments; ``read_segments`` and ``Reassembler``
receive them. A segment's state layers carry the state after its own last token
(KVW-STREAM-8), each segment's prefix chain covers its own tokens and continues the chain
of the segments before it (KVW-STREAM-9), sparse caches are never segments and a stream
without any segment is ``TRUNCATED`` (KVW-STREAM-7, KVW-STREAM-10).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ..cache.encoder import Encoder
from ..cache.kvcache import KVCache
from ..cache.tensors import as_numpy
from ..codecs import DEFAULT_ZSTD_LEVEL
from ..format import registry as R
from ..format.crossmodel import PrefixChain
from ..format.errors import LayoutError, TruncatedError
from ..format.header import Header, default_layer_tokens
from ..format.prefix import HASH_SIZE, PREFIX_SCHEME
from .reader import LayerReader, SparseNotSupported
from .transport import TransferStats, sender_for


def _segment_base(h: Header) -> Header:
    """Everything that the segments of one sequence share (KVW-STREAM-7): the resolved
    header without first_position, token_count, layer_tokens and the prefix chain (whose
    presence and scheme are shared too, compared apart)."""
    return h.replace(first_position=0, token_count=0, prefix=None)


def _chain_kind(h: Header):
    return None if h.prefix is None else h.prefix.scheme


def _mismatch(msg: str, rule: str = "KVW-STREAM-5"):
    raise LayoutError("SEGMENT_MISMATCH", msg, rule=rule)


class DecodeWriter:
    """Decode-phase tokens, sent as whole chunks (spec KVW-STREAM-4..6).

    ``append`` copies the new tokens of every layer into a staging chunk; when the
    tokens reach a multiple of ``chunk_tokens`` in absolute positions, the staged chunk
    goes out as one segment: a stream-form container whose header has
    ``first_position`` = the segment's first position, ``token_count`` = its tokens, and
    otherwise the fields of ``header`` (architecture, dtype, model ...). One send per
    segment, none per token. ``flush()`` sends the tokens staged so far as a partial
    segment; the next segment of the same cell starts at the same position and
    supersedes it.
    """

    def __init__(self, sink: Any, header: Header, *, first_position: int | None = None, chunk_tokens: int | None = None,
                 codec: str = "raw", level: int = DEFAULT_ZSTD_LEVEL, link_gbps: float | None = None):
        if header.sparse is not None or any(spec.kind == "state" for spec in header.arch.layers):
            raise ValueError("DecodeWriter sends attention caches only: a sparse cache is never sent as segments "
                             "(KVW-STREAM-7) and a state layer's state is not sliceable by tokens (send it whole "
                             "with each segment, KVW-STREAM-8)")
        self.chunk_tokens = C = chunk_tokens or header.chunk_tokens
        self.base = _segment_base(header).replace(chunk_tokens=C)
        self.position = header.first_position + header.token_count if first_position is None else first_position
        self.codec, self.level = codec, level
        self.segments = 0
        self._send = sender_for(sink)
        self.stats = TransferStats("send", link_gbps)
        self._start = self.position  # first position of the staged segment
        self._flushed = self.position  # position up to which the staged tokens were sent
        np_dtype = R.DTYPES[header.dtype][2]
        self._staging = [{c: np.empty(spec.shape(c, C), np_dtype) for c in spec.components}
                         for spec in header.arch.layers]

    def append(self, k: Any = None, v: Any = None, *, latent: Any = None) -> int:
        """Add tokens: per-layer sequences of [heads, dim] (one token) or [heads, n, dim]
        arrays (None for a layer that stores nothing). Returns the segments sent."""
        given = {c: x for c, x in (("k", k), ("v", v), ("latent", latent)) if x is not None}
        layers = self.base.arch.layers
        views = []
        for c, seq in given.items():
            if len(seq) != len(layers):
                raise ValueError(f"{c}: {len(seq)} layers given, the header has {len(layers)}")
        n = None
        for i, spec in enumerate(layers):
            per = {}
            for c in spec.components:
                if c not in given or given[c][i] is None:
                    raise ValueError(f"layer {i} ({spec.kind}) needs {c}")
                x = as_numpy(given[c][i])
                if x.ndim == 2:
                    x = x[:, None, :]
                if (x.shape[0], x.shape[2]) != (spec.shape(c, 1)[0], spec.shape(c, 1)[2]) or \
                        (n is not None and x.shape[1] != n):
                    raise ValueError(f"layer {i} {c}: shape {tuple(x.shape)} does not fit {spec.shape(c, 1)}")
                n = x.shape[1]
                per[c] = x
            views.append(per)
        if not n:
            return 0
        sent, done = 0, 0
        C = self.chunk_tokens
        while done < n:
            cell_end = (self.position // C + 1) * C
            m = min(n - done, cell_end - self.position)
            at = self.position - self._start
            for staged, per in zip(self._staging, views):
                for c, x in per.items():
                    staged[c][:, at : at + m, :] = x[:, done : done + m, :]
            self.position += m
            done += m
            if self.position == cell_end:
                self._emit()
                self._start = self._flushed = self.position
                sent += 1
        return sent

    def flush(self) -> bool:
        """Send the staged tokens as a partial segment (if any are unsent); True if sent."""
        if self.position == self._flushed:
            return False
        self._emit()
        self._flushed = self.position
        return True

    def close(self) -> TransferStats:
        self.flush()
        return self.stats

    def _emit(self) -> None:
        n = self.position - self._start
        h = self.base.replace(first_position=self._start, token_count=n)
        enc = Encoder(h, codec=self.codec, level=self.level)
        buffers = enc.begin()
        for i, staged in enumerate(self._staging):
            for c, x in staged.items():
                buffers += enc.chunk(i, c, 0, x[:, :n, :])
        buffers += enc.end(form="stream")
        self.stats.begin()
        self.stats.add(self._send(buffers))
        self.segments += 1


def read_segments(source: Any, **reader_options: Any) -> Iterator[KVCache]:
    """Yield each container on ``source`` as a ``KVCache``, until the source ends
    between two containers (KVW-STREAM-3). ``reader_options`` go to ``LayerReader``."""
    reader_options.setdefault("prefetch", 0)
    while True:
        try:
            r = LayerReader(source, **reader_options)
        except EOFError:
            return
        except SparseNotSupported:  # refused right after the header, before its chunks are received
            _mismatch("a sparse cache is not sent as segments: its token indices are per-head retained tokens, "
                      "not positions")
        yield r.cache()


class Reassembler:
    """Receiver side of KVW-STREAM-5..10: segments of one sequence into one cache.

    ``add(segment)`` appends a segment that starts where the cache ends, or replaces
    the last segment when that one was partial and the new one starts at the same
    position and reaches at least as far. ``cache()`` is the sequence so far (views);
    ``partial`` tells whether its last segment was partial. State layers take the state
    of the last segment (KVW-STREAM-8); prefix chains are joined (KVW-STREAM-9).
    """

    def __init__(self):
        self.base: Header | None = None
        self.start = self.end = 0
        self.partial = False
        self._last_start = 0
        self._store: list[dict] = []
        self._state: dict[int, dict] = {}  # state layer -> {tensor name: array} of the last segment
        self._capacity = 0
        self._chain: tuple | None = None  # (scheme, root, [hash of each chunk from start]); None: no chain
        self._scheme: int | None = None  # the first segment's PrefixChain.scheme (None: no chain)

    def add(self, segment: KVCache) -> None:
        h = segment.header
        s, e = h.first_position, h.first_position + h.token_count
        if getattr(h, "sparse", None) is not None:
            _mismatch("a sparse cache is not sent as segments: its token indices are per-head retained tokens, "
                      "not positions")
        if h.token_count < 1 or h.layer_tokens != default_layer_tokens(h.arch, h.token_count):
            _mismatch("a segment carries at least one token in every stored layer (default layer token ranges)")
        if self.base is None:
            if h.prefix is not None and h.prefix.scheme == PREFIX_SCHEME and s % h.chunk_tokens:
                _mismatch(f"a segment with a prefix chain starts at {s}, off the chunk grid", "KVW-STREAM-9")
            base = _segment_base(h)
        else:
            base = self.base
            if _segment_base(h) != base or _chain_kind(h) != self._scheme:
                _mismatch("segment header differs from the first segment's beyond first_position, token_count, "
                          "layer_tokens and the prefix chain's hashes (resolved values compared)")
        if self.base is not None and not (s == self.end or (self.partial and s == self._last_start and e >= self.end)):
            raise LayoutError("SEGMENT_ORDER", f"segment [{s}, {e}) neither continues the sequence at {self.end} "
                              f"nor supersedes a partial segment at {self._last_start}", rule="KVW-STREAM-6")
        chain = self._joined_chain(h, s, self.start if self.base is not None else s)
        if self.base is None:
            self.base, self.start, self.end = base, s, s
            self._scheme = _chain_kind(h)
        self._chain = chain
        self._grow(e - self.start)
        at = s - self.start
        for i, (store, layer) in enumerate(zip(self._store, segment.layers)):
            if base.arch.layers[i].kind == "state":
                self._state[i] = {name: np.array(as_numpy(x)) for name, x in layer.get("state", {}).items()}
                continue
            for c, x in layer.items():
                store[c][:, at : at + h.token_count, :] = as_numpy(x)
        self._last_start, self.end = s, e
        self.partial = e % h.chunk_tokens != 0

    def _joined_chain(self, h: Header, s: int, start: int):
        """The chain after accepting segment ``h`` at ``s`` (KVW-STREAM-9), checked against the chain so far."""
        p = h.prefix
        if p is None or p.scheme != PREFIX_SCHEME:
            return None if p is None else (p.scheme, b"", [])
        C = h.chunk_tokens
        if (s - start) % C:
            _mismatch(f"segment at {s} carries a prefix chain but does not start on the chunk grid of the "
                      f"sequence (from {start}, chunks of {C})", "KVW-STREAM-9")
        k0 = (s - start) // C
        if self._chain is None or s == start:
            expected_root = p.root if self._chain is None else self._chain[1]
            hashes = []
        else:
            hashes = self._chain[2][:k0]
            expected_root = hashes[k0 - 1]
        if p.root != expected_root:
            _mismatch(f"the prefix root of segment [{s}, ...) is not the chain value of the sequence before "
                      f"position {s}", "KVW-STREAM-9")
        own = [bytes(p.hashes[j : j + HASH_SIZE]) for j in range(0, len(p.hashes), HASH_SIZE)]
        return (p.scheme, self._chain[1] if self._chain is not None else p.root, hashes + own)

    def _grow(self, tokens: int) -> None:
        if tokens <= self._capacity:
            return
        base = self.base
        assert base is not None  # set by the first segment
        cap = max(tokens, 2 * self._capacity, base.chunk_tokens)
        np_dtype = R.DTYPES[base.dtype][2]
        used = self.end - self.start
        new = []
        for i, spec in enumerate(base.arch.layers):
            layer = {}
            for c in (() if spec.kind == "state" else spec.components):
                a = np.empty(spec.shape(c, cap), np_dtype)
                if self._store:
                    a[:, :used, :] = self._store[i][c][:, :used, :]
                layer[c] = a
            new.append(layer)
        self._store, self._capacity = new, cap

    def cache(self) -> KVCache:
        """The reassembled sequence; a stream without any segment is ``TRUNCATED`` (KVW-STREAM-10)."""
        if self.base is None:
            raise TruncatedError("no segment: the stream ended before the first segment's preamble",
                                 needed=32, rule="KVW-STREAM-10")
        n = self.end - self.start
        prefix = None
        if self._chain is not None and self._chain[0] == PREFIX_SCHEME:
            prefix = PrefixChain(PREFIX_SCHEME, self._chain[1], b"".join(self._chain[2]))
        h = self.base.replace(first_position=self.start, token_count=n, prefix=prefix)
        layers = []
        for i, layer in enumerate(self._store):
            if self.base.arch.layers[i].kind == "state":
                layers.append({"state": dict(self._state.get(i, {}))})
            else:
                layers.append({c: a[:, :n, :] for c, a in layer.items()})
        return KVCache(h, layers)
