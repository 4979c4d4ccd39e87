"""``MemoryStore``: the store protocol inside one process, for tests and single-process use.

Objects are immutable bytes held in a dict under a lock, so it shows the contract
(whole-object puts, ranged gets, skipped rewrites, misses as ``None``) without any I/O;
an optional size cap evicts least-recently-used objects, as ``LocalStore`` does.
"""

from __future__ import annotations

import builtins
import threading
from collections import OrderedDict
from collections.abc import Sequence

from .base import LOCAL_BATCH_BYTES, ByteRange, PutValue, Store, StoreError, as_buffers, check_key, resolve_range


class MemoryStore(Store):
    """The store protocol in this process's memory (``memory://``): objects are copied in
    on ``put``; ``max_bytes`` caps the total, evicting the least recently used objects.

    Not ``kvwire.stream.MemorySink``, which holds a fan-out's shared buffers without copying.
    """

    url = "memory://"
    batch_bytes = LOCAL_BATCH_BYTES

    def __init__(self, *, max_bytes: int | None = None):
        super().__init__()
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes <= 0):
            raise ValueError(f"max_bytes must be a positive int or None, not {max_bytes!r}")
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def get(self, key: str, byte_range: ByteRange = None) -> bytes | None:
        check_key(key)
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
        if value is None:
            self.count(gets=1, misses=1)
            return None
        a, b = resolve_range(byte_range, len(value))
        out = value[a:b]
        self.count(gets=1, hits=1, bytes_in=len(out))
        return out

    def put(self, key: str, value: PutValue) -> bool:
        check_key(key)
        bufs = as_buffers(value)
        size = sum(b.nbytes for b in bufs)
        if self.max_bytes is not None and size > self.max_bytes:
            raise StoreError(f"object {key!r} of {size} bytes exceeds the store's size cap of {self.max_bytes}")
        with self._lock:
            if key in self._items:
                self.count(puts=1, skipped=1)
                return False
            self._items[key] = b"".join(bufs)
            self._size += size
            evicted = 0
            while self.max_bytes is not None and self._size > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self._size -= len(old)
                evicted += 1
        self.count(puts=1, written=1, bytes_out=size, evictions=evicted)
        return True

    def exists(self, key: str) -> bool:
        check_key(key)
        self.count(exists_calls=1)
        return key in self._items

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        keys = [check_key(k) for k in keys]
        self.count(exists_calls=1)
        with self._lock:
            return [k in self._items for k in keys]

    def delete(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            value = self._items.pop(key, None)
            if value is not None:
                self._size -= len(value)
        self.count(deletes=int(value is not None))
        return value is not None

    def list(self, prefix: str = "") -> list[str]:
        with self._lock:
            return sorted(k for k in self._items if k.startswith(prefix))

    def sizes(self, keys: Sequence[str]) -> builtins.list:
        keys = [check_key(k) for k in keys]
        with self._lock:
            return [None if (v := self._items.get(k)) is None else len(v) for k in keys]

    def info(self) -> dict:
        with self._lock:
            objects, total = len(self._items), self._size
        return {"url": self.url, "backend": type(self).__name__, "objects": objects, "bytes": total,
                "max_bytes": self.max_bytes}

    @property
    def total_bytes(self) -> int:
        return self._size


__all__ = ["MemoryStore"]
