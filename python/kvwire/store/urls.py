"""``open_store(url)``: a store from a URL, so configuration names a backend with one string.

Only the schemes implemented in this package are accepted; any other (``redis://``,
``s3://`` ...) fails at once with the list of supported schemes rather than at first use.
"""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

from .base import Store, StoreError
from .local import LocalStore
from .memory import MemoryStore

SCHEMES = ("file", "memory")


def open_store(url: str, **options) -> Store:
    """``file:///abs/dir`` or ``file://rel/dir`` (LocalStore; options: max_bytes, fsync),
    ``memory://`` (MemoryStore; option: max_bytes)."""
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
    supported = ", ".join(f"{s}://" for s in SCHEMES)
    raise StoreError(f"store URL {url!r}: scheme {scheme + '://' if scheme else '(none)'} is not supported yet; "
                     f"supported: {supported}")


__all__ = ["SCHEMES", "open_store"]
