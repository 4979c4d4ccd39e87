"""The store protocol (spec/store.md, KVW-STORE-1..6): what every backend offers.

A store maps ASCII keys to immutable byte objects, in the manner of zarr-python v3's
``Store``: whole-object ``put`` (a reader never sees part of an object), ``get`` of the
whole object or of a byte range, ``exists``, ``delete``, ``list`` by prefix, and batch
forms that a networked backend answers in one round trip. It lives apart from the
backends so that ``KVStore`` and the tests hold every backend to one contract, and so a
later Redis or S3 backend is a thin adapter (ranged GET, PUT, HEAD).

A missing key is a *miss*, not an error: ``get`` returns ``None``. ``StoreError`` means
the store itself failed (I/O, a full disk, a dead server); it is not a ``FormatError``,
because the bytes were never the problem.
"""

from __future__ import annotations

import builtins
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..format.errors import Error
from .counters import Counters

KEY_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*(?:/[A-Za-z0-9_-][A-Za-z0-9._-]*)*")  # no segment starts with "."
MAX_KEY_LENGTH = 1024

# A byte range of an object (KVW-STORE-3, ``resolve_range``): None (the whole object),
# (offset, length), (offset, None) or (-n, None).
ByteRange = tuple[int, int | None] | None
# What ``put`` stores: one bytes-like object, or a sequence of them written as one object.
PutValue = Any


class StoreError(Error):
    """The store failed (I/O error, full disk, unreachable server, unsupported URL)."""

    code = "STORE_ERROR"


def check_key(key: object) -> str:
    """A key is ASCII ``[A-Za-z0-9._-]`` segments joined by "/", no segment starting with "."
    (KVW-STORE-2); anything else is refused before it reaches a backend."""
    if not isinstance(key, str):
        raise TypeError(f"a store key is a str, not {type(key).__name__}")
    if not 0 < len(key) <= MAX_KEY_LENGTH or not KEY_RE.fullmatch(key):
        raise ValueError(f"bad store key {key[:80]!r}: ASCII [A-Za-z0-9._-] segments joined by '/', none "
                         f"empty or starting with '.', 1..{MAX_KEY_LENGTH} characters")
    return key


SEGMENT = r"[A-Za-z0-9_-][A-Za-z0-9._-]*"
KEYS_RE = re.compile(rf"(?:{SEGMENT}(?:/{SEGMENT})*\n)*")


def check_keys(keys: Iterable[str]) -> list[str]:
    """``check_key`` of every key of a batch, as one regular-expression pass over the
    joined keys (a 512-key hit query is checked in microseconds, not a millisecond)."""
    keys = list(keys)
    if not all(type(k) is str and 0 < len(k) <= MAX_KEY_LENGTH and "\n" not in k for k in keys) or not (
            KEYS_RE.fullmatch("".join(k + "\n" for k in keys)) and all(k.isascii() for k in keys)):
        for k in keys:
            check_key(k)  # names the first bad key
    return keys


def resolve_range(byte_range: ByteRange, size: int) -> tuple[int, int]:
    """[start, stop) of ``byte_range`` in an object of ``size`` bytes (KVW-STORE-3).

    ``None``: the whole object. ``(offset, length)`` with offset >= 0 and length >= 0: the
    bytes [offset, offset + length), clipped to the object (empty when offset >= size).
    ``(offset, None)``: from offset to the end. ``(-n, None)`` with n > 0: the last n bytes
    (the whole object when n >= size). Anything else is a ValueError.
    """
    if byte_range is None:
        return 0, size
    if not isinstance(byte_range, tuple) or len(byte_range) != 2:
        raise ValueError(f"byte_range must be None, (offset, length), (offset, None) or (-n, None), not "
                         f"{byte_range!r}")
    off, length = byte_range
    if not isinstance(off, int) or isinstance(off, bool) or not (length is None or (
            isinstance(length, int) and not isinstance(length, bool))):
        raise ValueError(f"byte_range {byte_range!r}: offset and length must be integers")
    if off < 0:
        if length is not None:
            raise ValueError(f"byte_range {byte_range!r}: a suffix (-n, None) takes no length")
        return max(0, size + off), size
    if length is None:
        return min(off, size), size
    if length < 0:
        raise ValueError(f"byte_range {byte_range!r}: length must be >= 0")
    return min(off, size), min(off + length, size)


@dataclass
class StoreStats(Counters):
    """Counters of one store object (this process): gets and their bytes, puts written or
    skipped because the key existed, deletes and evictions."""

    gets: int = 0
    hits: int = 0
    misses: int = 0
    bytes_in: int = 0  # bytes returned by get
    puts: int = 0
    written: int = 0
    skipped: int = 0
    bytes_out: int = 0  # bytes written by put
    exists_calls: int = 0
    deletes: int = 0
    evictions: int = 0
    round_trips: int = 0  # requests to a server (a pipelined batch is one per node)
    unavailable: int = 0  # keys answered as misses because their node was down (a cluster)


def as_buffers(value: PutValue) -> list:
    """A put value as a list of byte buffers: one bytes-like object, or a sequence of them
    (the encoder's buffers, written without joining them first)."""
    try:
        return [memoryview(value).cast("B")]
    except TypeError:
        pass
    if isinstance(value, str) or not hasattr(value, "__iter__"):
        raise TypeError(f"a store value is bytes-like or a sequence of bytes-like buffers, not {type(value).__name__}")
    out = []
    for b in value:
        try:
            out.append(memoryview(b).cast("B"))
        except TypeError:
            raise TypeError(f"a store value buffer is {type(b).__name__}, not bytes-like") from None
    return out


# Object bytes per put_many / get_many batch that KVStore sends: one round trip per batch on a
# networked backend, and a bound on the memory one batch holds. In-process and local-file stores
# pay nothing per call, and batches that stay in the CPU's cache measured 20-25% faster there
# (zstd puts, LocalStore gets) than 64-256 MiB ones, so they declare the small bound.
BATCH_BYTES = 256 << 20
LOCAL_BATCH_BYTES = 16 << 20


class Store:
    """Base of the backends: the batch forms loop over the single ones; a networked
    backend overrides them to answer in one round trip (KVW-STORE-5)."""

    url = "store://"
    batch_bytes = BATCH_BYTES  # what a batch of this backend should hold (see above)

    def __init__(self) -> None:
        self.stats = StoreStats()

    def count(self, **deltas: int) -> None:
        self.stats.add(**deltas)  # under the counters' lock: batch calls may come from several threads

    # single-key operations, provided by a backend
    def get(self, key: str, byte_range: ByteRange = None) -> bytes | None:
        raise NotImplementedError

    def put(self, key: str, value: PutValue) -> bool:
        """Store ``value`` under ``key`` unless it exists; True when written, False when skipped."""
        raise NotImplementedError

    def exists(self, key: str) -> bool:
        raise NotImplementedError

    def delete(self, key: str) -> bool:
        """Remove ``key``; True when it existed. Deleting a missing key is not an error."""
        raise NotImplementedError

    def list(self, prefix: str = "") -> list[str]:
        """Every key starting with ``prefix``, sorted."""
        raise NotImplementedError

    def sizes(self, keys: Sequence[str]) -> builtins.list:
        """The size in bytes of each key's object (None for a miss), in one batch: what
        ``kvwire store ls`` and ``stats`` show, without reading object bytes."""
        raise NotImplementedError

    def info(self) -> dict:
        """What the backend knows of itself (objects, bytes, cap, server counters) beyond
        this process's ``stats``: ``kvwire store stats`` prints it."""
        keys = self.list()
        return {"url": self.url, "backend": type(self).__name__, "objects": len(keys),
                "bytes": sum(s or 0 for s in self.sizes(keys))}

    # batch forms
    def get_many(self, keys: Sequence[str], byte_range: ByteRange = None) -> builtins.list:
        return [self.get(k, byte_range) for k in keys]

    def get_ranges(self, requests: Sequence[tuple[str, ByteRange]]) -> builtins.list:
        """The bytes of each ``(key, byte_range)`` of ``requests`` (None for a miss), each
        with its own range, in one batch: a layer-by-layer reader fetches one layer's frames
        from every object of a request at once (KVW-STORE-5)."""
        return [self.get(k, r) for k, r in requests]

    def put_many(self, items: Iterable[tuple[str, PutValue]]) -> builtins.list[bool]:
        return [self.put(k, v) for k, v in items]

    def exists_many(self, keys: Sequence[str]) -> builtins.list[bool]:
        return [self.exists(k) for k in keys]

    def leading(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` exist (the hit query, KVW-STORE-5): one batch exists;
        a backend may stop at the first miss."""
        n = 0
        for present in self.exists_many(keys):
            if not present:
                break
            n += 1
        return n

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


__all__ = ["BATCH_BYTES", "LOCAL_BATCH_BYTES", "MAX_KEY_LENGTH", "Store", "StoreError", "StoreStats", "as_buffers", "check_key", "check_keys", "resolve_range"]
