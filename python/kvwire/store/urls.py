"""``open_store(url)``: a store from a URL, so configuration names a backend with one string.

Only the schemes implemented in this package are accepted; any other (``s3://`` ...) fails
at once with the list of supported schemes rather than at first use. redis-py is imported
only when a redis URL is opened, so the core needs no Redis client.
"""

from __future__ import annotations

import os
from urllib.parse import parse_qs, unquote, urlsplit

from .auth import check_url
from .base import Store, StoreError
from .cluster import open_cluster
from .local import LocalStore
from .local_fs import SHARED, check_root_path, check_shared
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


def file_url(url: str) -> tuple[str, dict]:
    """(directory, {"shared": mode}) of a ``file://`` URL: ``file:///abs/dir``,
    ``file://rel/dir`` or ``file://localhost/abs/dir``, percent-decoded, with one optional
    query parameter ``shared=private|group`` (KVW-STORE-6, 33). A ``..`` component
    (KVW-STORE-29), any other parameter or a fragment is refused, naming what is valid."""
    parts = urlsplit(url)
    shown = "file://" + parts.netloc + parts.path  # messages never repeat a query's values (KVW-STORE-39)
    path = unquote((parts.netloc + parts.path) if parts.netloc not in ("", "localhost") else parts.path)
    if not path:
        raise StoreError(f"{shown!r}: a file:// URL needs a directory (file:///var/cache/kvwire)")
    if parts.fragment:
        raise StoreError(f"{shown!r}: a file:// URL takes no fragment ('#...'); percent-encode a '#' in a directory "
                         "name as %23")
    check_root_path(path)
    try:
        query = parse_qs(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError:
        raise StoreError(f"{shown!r}: malformed query; the only parameter is "
                         f"shared={'|'.join(SHARED)}") from None
    unknown = sorted(set(query) - {"shared"})
    if unknown:
        raise StoreError(f"{shown!r}: unknown parameter {unknown[0]!r} of a file:// URL; the only parameter is "
                         f"shared={'|'.join(SHARED)}")
    shared = query.get("shared", ["private"])
    if len(shared) != 1:
        raise StoreError(f"{shown!r}: shared= is given {len(shared)} times; give it once")
    return path, {"shared": check_shared(shared[0])}


def open_store(url: str, **options) -> Store:
    """``file:///abs/dir[?shared=group]`` or ``file://rel/dir`` (LocalStore; options: max_bytes,
    fsync, create: False opens an existing store only),
    ``memory://`` (MemoryStore; option: max_bytes), ``redis://[user:password@]host:port/db``
    (RedisStore) and ``redis-cluster://host:port[,host:port...]`` (RedisClusterStore; options:
    timeout, connect_timeout in seconds)."""
    if not isinstance(url, str):
        raise TypeError(f"open_store needs a URL string, not {type(url).__name__}")
    check_url(url)  # KVW-AUTH-2: keys never come from a URL (the message says where they go)
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    create = options.pop("create", True)  # file:// only: the other backends have no directory to create
    if scheme == "memory":
        return MemoryStore(**options)
    if scheme == "file":
        path, query = file_url(url)
        return LocalStore(path, **query, create=create, **options)
    if scheme in ("redis", "rediss"):  # rediss: TLS (spec/store.md KVW-STORE-36)
        return open_redis(url, **options)
    if scheme in ("redis-cluster", "rediss-cluster"):
        return open_cluster(url, **options)
    supported = ", ".join(f"{s}://" for s in SCHEMES)
    shown = scheme + "://" if scheme else "(none)"
    raise StoreError(f"store URL {redact_url(url)!r}: scheme {shown} is not supported; supported: {supported}")


__all__ = ["SCHEMES", "default_store_dir", "default_store_url", "file_url", "open_store"]
