"""Multi-target writes: one encoded container, several sinks, the same buffers."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterable
from typing import Any

from ..cache.encoder import iter_buffers
from ..cache.kvcache import KVCache
from .transport import TransferStats, sender_for


class SharedBuffers:
    """The buffers of one encoded container, shared by several sinks without copies.

    Reference counted: the creator holds one reference; ``acquire()`` adds one per
    holder (a sink being written, a store entry) and ``release()`` drops it. When the
    last reference goes, every buffer is released (``owned_nbytes`` of frames, header
    and compressed bodies freed; the views of the cache's tensors dropped) and
    ``on_free(self)`` runs. Raw bodies are views of the caller's tensors
    (``owned_nbytes`` counts only what the encoding allocated).
    """

    def __init__(self, buffers: Iterable[Any], *, on_free: Callable[[SharedBuffers], object] | None = None):
        self._buffers = [memoryview(b).cast("B") for b in buffers]
        self.nbytes = sum(b.nbytes for b in self._buffers)
        self.owned_nbytes = sum(b.nbytes for b in self._buffers if isinstance(b.obj, (bytes, bytearray)))
        self._refs = 1
        self._lock = threading.Lock()
        self._on_free = on_free

    @property
    def refcount(self) -> int:
        return self._refs

    @property
    def freed(self) -> bool:
        return self._refs == 0

    def acquire(self) -> SharedBuffers:
        with self._lock:
            if self._refs == 0:
                raise RuntimeError("buffers already freed")
            self._refs += 1
        return self

    def release(self) -> None:
        with self._lock:
            if self._refs == 0:
                raise RuntimeError("release() without a reference")
            self._refs -= 1
            if self._refs:
                return
            buffers, self._buffers = self._buffers, []
        for b in buffers:
            b.release()
        if self._on_free is not None:
            self._on_free(self)

    @property
    def buffers(self) -> list:
        if self._refs == 0:
            raise RuntimeError("buffers already freed")
        return list(self._buffers)

    def tobytes(self) -> bytes:
        return b"".join(self.buffers)


def encode_shared(cache: KVCache, *, form: str = "stream", on_free: Callable[[SharedBuffers], object] | None = None,
                  **opts: Any) -> SharedBuffers:
    """Encode ``cache`` once (options as ``iter_buffers``) into shareable buffers."""
    return SharedBuffers(list(iter_buffers(cache, form=form, **opts)), on_free=on_free)


class MemorySink:
    """A ``fanout`` target that keeps encoded containers in memory by key: references to
    the ``SharedBuffers``, not copies (formerly ``kvwire.stream.MemoryStore``).

    Not a store of ``kvwire.store``: ``kvwire.store.MemoryStore`` copies bytes under
    checked keys behind the store protocol; this holds the sender's own buffers alive
    until ``evict``, so a fan-out to memory costs no copy. ``lookup(keys)`` counts how
    many leading keys are held (a prefix hit, as engines look up chunk-key chains);
    ``get`` and ``lookup`` count hits and misses.
    """

    def __init__(self) -> None:
        self._items: dict = {}
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def put(self, key: Hashable, shared: SharedBuffers) -> None:
        shared.acquire()
        with self._lock:
            old = self._items.pop(key, None)
            self._items[key] = shared
        if old is not None:
            old.release()

    def sink(self, key: Hashable) -> _KeySink:
        """A ``fanout`` target that stores the container under ``key``."""
        return _KeySink(self, key)

    def get(self, key: Hashable) -> SharedBuffers | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.misses += 1
            else:
                self.hits += 1
            return item

    def lookup(self, keys: Iterable[Hashable]) -> int:
        """Number of leading ``keys`` present; each present key checked is a hit, the first absent one a miss."""
        n = 0
        with self._lock:
            for key in keys:
                if key not in self._items:
                    self.misses += 1
                    break
                self.hits += 1
                n += 1
        return n

    def evict(self, key: Hashable) -> bool:
        with self._lock:
            item = self._items.pop(key, None)
        if item is None:
            return False
        item.release()
        return True

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._items.values())

    @property
    def hit_rate(self) -> float | None:
        total = self.hits + self.misses
        return self.hits / total if total else None


class _KeySink:
    def __init__(self, store: MemorySink, key: Hashable) -> None:
        self.store, self.key = store, key

    def take(self, shared: SharedBuffers) -> None:
        self.store.put(self.key, shared)


def fanout(shared: SharedBuffers, sinks: Iterable[Any], *, link_gbps: float | None = None,
           timeout: float | None = None) -> list[TransferStats]:
    """Write ``shared`` to every sink at once (one thread per sink), from the same buffers.

    Each sink holds a reference while it is written; a ``MemorySink.sink(key)`` keeps
    one until the key is evicted. Returns one ``TransferStats`` per sink; the first
    failure is raised after all sinks finished. ``timeout``: as for ``LayerWriter``, the
    longest a sink may take no byte (``StreamTimeout``; sockets and descriptors).
    """
    senders = [None if isinstance(sink, _KeySink) else sender_for(sink, timeout) for sink in sinks]
    stats = [TransferStats("send", link_gbps) for _ in sinks]
    failures: list[BaseException] = []

    def run(sink, send, st: TransferStats) -> None:
        try:
            st.begin()
            if isinstance(sink, _KeySink):
                sink.take(shared)
                st.add(shared.nbytes)
            else:
                st.add(send(shared.buffers))
        except BaseException as exc:
            failures.append(exc)
        finally:
            shared.release()

    threads = []
    for sink, send, st in zip(sinks, senders, stats):
        shared.acquire()
        t = threading.Thread(target=run, args=(sink, send, st), name="kvwire-fanout", daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    return stats
