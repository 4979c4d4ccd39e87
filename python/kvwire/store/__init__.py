"""kvwire.store: KV caches shared through a store that outlives one process (spec/store.md).

Layers: ``base`` (the protocol, ``StoreError``, byte ranges), the backends ``MemoryStore``
(in process) and ``LocalStore`` (``file://DIR``, the embedded default), ``keys`` (the key
scheme every implementation must share) and ``KVStore`` (caches in and out as one
container per chunk). ``open_store(url)`` picks a backend from a URL. A Redis backend is
the next step (issue 14).
"""

from .base import Store, StoreError, StoreStats, resolve_range
from .keys import KeySpace, codec_fidelity
from .kvstore import KVStore, LoadResult, PutResult
from .local import LocalStore
from .memory import MemoryStore
from .urls import open_store

__all__ = ["KVStore", "KeySpace", "LoadResult", "LocalStore", "MemoryStore", "PutResult", "Store", "StoreError",
           "StoreStats", "codec_fidelity", "open_store", "resolve_range"]
