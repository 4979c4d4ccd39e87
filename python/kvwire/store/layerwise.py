"""``LayerwiseLoad``: a request's chunk objects read and decoded one layer at a time.

Why: an engine computes layer by layer, and layer ``i`` needs only layer ``i``'s KV. A
loader that fetches everything before the forward pass makes the first layer wait for the
last layer's bytes; one that reads layer ``i + 1`` while layer ``i`` computes hides all
but one layer of the transfer (layer-wise pipelining, spec/store.md KVW-STORE-27).

How, without a format of its own: every chunk object is an ordinary file-form container
whose frames follow its index, a layer's frames next to each other (canonical order,
KVW-CHUNK-9), so one layer of one object is one byte range. Opening a load reads, for all
its objects at once, the header (one batched ranged get of ``HEAD_BYTES``, checked by the
step ``KVStore.get_cache`` opens objects with, ``objects.open_heads``: KVW-STORE-17) and the
tail (one batched suffix get: the end frame, the index and the trailer, whose sizes
``format.container`` bounds). Each layer is then one batched ``get_ranges`` of
that layer's frames from every object, checked where the store's reply lies and handed out
as views of it (``parts``; ``decode`` copies them into the caller's arrays).

Head and tail land in a buffer of the size the object's trailer states (only their pages
are touched), and a ``Reader`` over it runs the checks of a whole object (index checksum,
end frame); each layer's frames are then checked in the reply that holds them
(``Reader.stored_at``: each frame against the index, body checksums), so no byte is copied
between the store and the caller's buffers. The size is refused when it exceeds what the
header's tensors can need, so a hostile trailer cannot make the loader allocate.

An object that fails (evicted between two reads, corrupt, not the key's) is counted and
deleted like any bad object, and ends the hits: ``served`` is the tokens that every layer
decoded so far holds, the minimum over layers (layers may be read on several threads), and
the caller recomputes the rest.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ..cache.reader import Reader
from ..cache.tensors import empty, view
from ..format.container import FRAME_SIZE, TRAILER_SIZE, file_size, size_bound, tail_bound, trailer_fields
from ..format.errors import ChecksumError, FormatError
from .keys import KeySpace
from .kvstore import KVStore
from .objects import open_heads, request_keys


class LayerwiseLoad:
    """The leading stored chunks of ``tokens`` (at most ``n_chunks``), to be read layer by
    layer with ``load_layer`` (or ``fetch_layer`` over several loads, then ``decode``), for a
    request of ``identity`` (a ``RequestIdentity``, KVW-IDENT-4; None: none)."""

    def __init__(self, kv: KVStore, tokens, space: KeySpace, n_chunks: int | None = None, *, identity=None):
        if not isinstance(kv, KVStore):
            raise TypeError(f"LayerwiseLoad needs a kvwire.store.KVStore, not {type(kv).__name__}")
        if not isinstance(space, KeySpace):
            raise TypeError(f"space must be a kvwire.store.KeySpace (KeySpace.of(header)), not {type(space).__name__}")
        if n_chunks is not None and (not isinstance(n_chunks, int) or isinstance(n_chunks, bool) or n_chunks < 0):
            raise ValueError(f"n_chunks must be None or an int >= 0, not {n_chunks!r}")
        self.kv, self.space = kv, space
        hashes, spaces, keys = request_keys(space, tokens, n_chunks=n_chunks, identity=identity)
        opened = open_heads(kv, keys, hashes, spaces)  # as get_cache opens them (KVW-STORE-17, KVW-AUTH-6)
        self.keys = opened.keys
        self.readers: list[Reader] = []
        self.buffers: list = []
        self.tags: list = []  # with auth: each opened object's verified tag (KVW-AUTH-6)
        self.frames: list[dict] = []  # each object's frames_by_layer
        self._open(opened)
        self.header = self.readers[0].header if self.readers else None
        self.starts = [r.header.first_position for r in self.readers]
        self.tokens = sum(r.header.token_count for r in self.readers)  # what the objects that opened hold
        self.served = self.tokens
        self._pending: dict[int, list] = {}
        self._windows: dict[int, dict] = {}  # layer -> {object: (bytes read, their offset in the object)}
        self._lock = threading.Lock()
        kv.counts.add(bytes_read=opened.bytes_read, hits=len(self.readers), misses=len(self.keys) - len(self.readers))

    # -- opening: headers checked, then every object's end frame, index and trailer --------
    def _open(self, opened) -> None:
        heads = opened.heads
        tails: dict[int, Any] = {}
        need = [n for n, x in enumerate(heads) if not x.whole]  # the rest: the first read got the whole object
        if need:
            size = max(tail_bound(heads[n].header) for n in need)  # end frame, index and trailer
            got = self.kv.store.get_many([heads[n].key for n in need], (-size, None))
            opened.bytes_read += sum(len(x) for x in got if x is not None)
            tails = dict(zip(need, got))
        for n, x in enumerate(heads):
            buf = x.first if x.whole else self._assemble(x, tails.get(n), opened)
            if buf is None:
                break  # evicted between the two reads, or corrupt: the hits end here
            try:
                r = Reader(buf, known_header=(x.header, x.first))  # the header checked above is not parsed again
            except FormatError:
                self.kv.discard(x.key, "corrupt")
                break
            if r.header != x.header:  # objects are immutable: a changed one is not the one checked
                self.kv.discard(x.key, "incompatible")
                break
            if x.tag is not None and not self.kv.verify_index(x.key, x.tag, r, buf):
                break  # the index is not the tagged one: counted, deleted (KVW-AUTH-6)
            self.readers.append(r)
            self.buffers.append(buf)
            self.tags.append(x.tag)
            self.frames.append(frames_by_layer(r))

    def _assemble(self, x, tail, opened):
        """An object-sized buffer holding the first bytes of ``x`` (an ``objects.Head``) and
        the tail (end frame, index, trailer), or None (a miss: evicted, or corrupt and
        deleted)."""
        if tail is None:
            return None
        head = x.first
        try:
            index_offset, index_length = trailer_fields(tail)
        except FormatError:
            return self.kv.discard(x.key, "corrupt")
        size = file_size(index_offset, index_length)  # KVW-FILE-2
        want = size - (index_offset - FRAME_SIZE)  # end frame, index, padding, trailer
        if not (len(head) <= size <= size_bound(x.header, len(head)) and FRAME_SIZE + TRAILER_SIZE <= want <= size) \
                or len(tail) > size:
            return self.kv.discard(x.key, "corrupt")  # no allocation on a size the header cannot justify
        if len(tail) < want:  # the index is longer than guessed: one more suffix read
            tail = self.kv.store.get(x.key, (-want, None))
            if tail is None:
                return None
            opened.bytes_read += len(tail)
            if len(tail) != want:
                return self.kv.discard(x.key, "corrupt")
        buf = np.empty(size, np.uint8)  # every byte a check reads is filled before it is read
        buf[:len(head)] = np.frombuffer(head, np.uint8)
        buf[size - len(tail):] = np.frombuffer(tail, np.uint8)
        return buf

    # -- one layer ----------------------------------------------------------------------
    def layer_requests(self, layer: int) -> list:
        """``(key, (offset, length))`` of ``layer``'s frames in each object still served that
        was not read whole (what ``fetch_layer`` asks the store for)."""
        out = []
        self._pending[layer] = []
        for n in range(len(self.readers)):
            if self.starts[n] >= self.served:
                break
            if not isinstance(self.buffers[n], np.ndarray):
                continue  # read whole at open
            if layer not in self.frames[n]:
                continue
            _, lo, hi = self.frames[n][layer]
            out.append((self.keys[n], (lo, hi - lo)))
            self._pending[layer].append((n, lo, hi))
        return out

    def take(self, layer: int, replies) -> None:
        """Keep the replies of ``layer_requests(layer)`` as that layer's windows: each reply
        is decoded where it lies (no copy into the object's buffer)."""
        wins = self._windows.setdefault(layer, {})
        for (n, lo, hi), data in zip(self._pending.pop(layer, []), replies):
            if data is None or len(data) != hi - lo:
                self._cut(n, None if data is None else "corrupt")  # evicted, or shorter than its index says
                continue
            wins[n] = (data, lo)
            self.kv.counts.add("bytes_read", hi - lo)

    def _cut(self, n: int, what) -> None:
        if what:
            self.kv.discard(self.keys[n], what)
        with self._lock:  # layers may be read on several threads: no cut is lost
            self.served = min(self.served, self.starts[n])

    def parts(self, layer: int) -> list:
        """Layer ``layer`` of the served tokens as ``[(first token, {component: array [heads,
        tokens, dim]})]``, one entry per object in token order, checksums and frames verified
        (KVW-CSUM-1, KVW-FILE-4): a raw body is a read-only view of the bytes the store
        returned, so the caller's copy into its own buffers is the only one. A failing object
        cuts ``served`` and ends the list."""
        if self.header is None:
            raise ValueError("nothing to decode: no stored chunk of this request opened")
        wins = self._windows.pop(layer, {})
        out: list = []
        for n, r in enumerate(self.readers):
            a = self.starts[n]
            if a >= self.served:
                break
            if isinstance(self.buffers[n], np.ndarray):  # read layer by layer: this layer's reply
                window, base = wins.get(n, (None, 0))
            else:  # read whole when opened
                window, base = self.buffers[n], 0
            if window is None:
                continue  # the object has no frame in this layer
            records = self.frames[n][layer][0] if layer in self.frames[n] else []
            if self.tags[n] is not None and not self.kv.verify_bodies(self.keys[n], self.tags[n], r, window, records,
                                                                       base=base):
                self._cut(n, None)  # a body is not the tagged one: counted, deleted (KVW-AUTH-6)
                break
            try:
                out.append((a, self._arrays(r, records, window, base, verify=self.tags[n] is None)))
            except ChecksumError:
                self._cut(n, "checksum_failures")
                break
            except FormatError:
                self._cut(n, "corrupt")
                break
        return out

    def _arrays(self, r: Reader, records: list, window, base: int, verify: bool) -> dict:
        """{component: [heads, tokens, dim]} of one object's layer (its index ``records``)
        from ``window``."""
        got = {}
        for i in records:
            c, stored = r.stored_at(i, window, base, verify)
            if c.codec == "raw":
                got[c.component] = view(stored, 0, r.header.dtype, c.shape, "numpy")
            else:
                got[c.component] = view(r.decode_stored(i, c, stored), 0, r.header.dtype, c.shape, "numpy")
        return got

    def decode(self, layer: int, out: dict | None = None) -> dict:
        """Layer ``layer`` of the served tokens, checksums verified, copied into ``out``
        ({component: array [heads, >= served, dim]}, e.g. staging arrays; allocated when
        None); returns {component: the served tokens' view}. A failing object cuts
        ``served``. (``parts`` gives the same without the copy.)"""
        if self.header is None:
            raise ValueError("nothing to decode: no stored chunk of this request opened")
        spec = self.header.arch.layers[layer]
        got = self.parts(layer)
        if out is None:
            out = {c: empty(spec.shape(c, self.served), self.header.dtype, "numpy") for c in spec.components}
        for a, arrays in got:
            if a >= self.served:
                break
            for c, x in arrays.items():
                b = min(a + x.shape[1], self.served)
                out[c][:, a:b, :] = x[:, : b - a, :]
        return {c: x[:, :self.served, :] for c, x in out.items()}

    def load_layer(self, layer: int, out: dict | None = None) -> dict:
        """``fetch_layer([self], layer)`` then ``decode(layer, out)``."""
        fetch_layer([self], layer)
        return self.decode(layer, out)


def frames_by_layer(r: Reader) -> dict:
    """{layer: (index records, first frame's offset, end of the last body)} of one object:
    grouped once when it opens, then each layer's request and decode look theirs up."""
    rec = r.records
    groups: dict[int, list] = {}
    for i, layer in enumerate(rec["layer"].tolist()):
        groups.setdefault(layer, []).append(i)
    ends = rec["offset"] + rec["stored_length"]
    return {layer: (idx, int(rec["offset"][idx].min()) - FRAME_SIZE, int(ends[idx].max()))
            for layer, idx in groups.items()}


def fetch_layer(loads, layer: int) -> None:
    """Fetch ``layer``'s frames of every object of ``loads`` (LayerwiseLoads on one store)
    in one batched ``get_ranges``: one round trip per layer (per 16 MiB of it on Redis) for
    a whole engine step."""
    loads = [x for x in loads if x.readers]
    if not loads:
        return
    parts = [x.layer_requests(layer) for x in loads]
    flat = [req for p in parts for req in p]
    replies = iter(loads[0].kv.store.get_ranges(flat) if flat else [])
    for x, p in zip(loads, parts):
        x.take(layer, [next(replies) for _ in p])


__all__ = ["LayerwiseLoad", "fetch_layer"]
