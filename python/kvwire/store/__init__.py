"""kvwire.store: KV caches shared through a store that outlives one process (spec/store.md).

Layers: ``base`` (the protocol, ``StoreError``, byte ranges), the backends ``MemoryStore``
(in process), ``LocalStore`` (``file://DIR``, the embedded default), ``RedisStore``
(``redis://``) and ``RedisClusterStore`` (``redis-cluster://``) for caches shared by many
nodes, ``keys`` (the key scheme every implementation must share) and ``KVStore`` (caches in
and out as one container per chunk). ``open_store(url)`` picks a backend from a URL;
redis-py is imported only when a Redis store is opened.
"""

from .base import Store, StoreError, StoreStats, resolve_range
from .cluster import RedisClusterStore
from .identity import Adapter, MultimodalItem, RequestIdentity, adapter_fingerprint
from .keys import KeySpace, codec_fidelity
from .kvstore import KVStore, LoadResult, Lookup, PutResult
from .local import LocalStore
from .memory import MemoryStore
from .redis import RedisStore
from .urls import default_store_dir, default_store_url, open_store

__all__ = ["Adapter", "KVStore", "MultimodalItem", "RequestIdentity", "adapter_fingerprint", "KeySpace", "LoadResult", "LocalStore", "Lookup", "MemoryStore", "PutResult", "RedisClusterStore", "RedisStore", "Store", "StoreError",
           "StoreStats", "codec_fidelity", "default_store_dir", "default_store_url", "open_store", "resolve_range"]
