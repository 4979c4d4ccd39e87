"""``open_store(url)``: a store from a URL, so configuration names a backend with one string.

Only the schemes implemented in this package are accepted; any other (``s3://`` ...) fails
at once with the list of supported schemes rather than at first use. redis-py is imported
only when a redis URL is opened, so the core needs no Redis client.
"""

from __future__ import annotations

import os
from urllib.parse import unquote, urlsplit

from .base import Store, StoreError
from .cluster import open_cluster
from .local import LocalStore
from .memory import MemoryStore
from .redis import open_redis
from .redis_url import redact_url

SCHEMES = ("file", "memory", "redis", "redis-cluster", "rediss", "rediss-cluster")


def default_store_dir() -> str:
    """The per-user store directory used when no store is configured (spec/store.md,
    private by default): ``$XDG_CACHE_HOME/kvwire/store``, else ``~/.cache/kvwire/store``.
    A per-user cache directory, never a predictable name in a world-writable one such as
    ``/tmp`` (another user could create it first and read or plant every object)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(base), "kvwire", "store")


def default_store_url() -> str:
    """``file://`` + ``default_store_dir()``."""
    return "file://" + default_store_dir()


def open_store(url: str, **options) -> Store:
    """``file:///abs/dir`` or ``file://rel/dir`` (LocalStore; options: max_bytes, fsync),
    ``memory://`` (MemoryStore; option: max_bytes), ``redis://[user:password@]host:port/db``
    (RedisStore) and ``redis-cluster://host:port[,host:port...]`` (RedisClusterStore; options:
    timeout, connect_timeout in seconds)."""
    if not isinstance(url, str):
        raise TypeError(f"open_store needs a URL string, not {type(url).__name__}")
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme == "memory":
        return MemoryStore(**options)
    if scheme == "file":
        rest = url[len("file://"):]
        parts = urlsplit("file://" + rest)
        path = unquote((parts.netloc + parts.path) if parts.netloc not in ("", "localhost") else parts.path)
        if not path:
            raise StoreError(f"{url!r}: a file:// URL needs a directory (file:///var/cache/kvwire)")
        return LocalStore(path, **options)
    if scheme in ("redis", "rediss"):  # rediss: TLS (spec/store.md KVW-STORE-36)
        return open_redis(url, **options)
    if scheme in ("redis-cluster", "rediss-cluster"):
        return open_cluster(url, **options)
    supported = ", ".join(f"{s}://" for s in SCHEMES)
    shown = scheme + "://" if scheme else "(none)"
    raise StoreError(f"store URL {redact_url(url)!r}: scheme {shown} is not supported; supported: {supported}")


__all__ = ["SCHEMES", "default_store_dir", "default_store_url", "open_store"]
