"""Request identity (spec/store.md section 10, KVW-IDENT-*): what besides the tokens and the
model decides what a chunk's KV is, or who may see it, bound into the chunk's key.

Why: a key binds the tokens and the model, but the same tokens have other KV under another
LoRA adapter, or after another image (an image's placeholder tokens are the same for every
image), and one tenant must never be served another tenant's KV (vLLM's ``cache_salt``,
CVE-2025-46570). A ``RequestIdentity`` names the isolation salt, the adapter (its name and
a fingerprint of its weights, never a numeric id) and the multimodal items (each item's
content hash as the engine computes it and its placeholder range). Chunk ``k`` depends on
the salt, the adapter and on the items whose placeholder starts before the chunk ends, so
its identity digest ``I_k`` is SHA-256 over an unambiguous encoding of exactly those
(``encoding``); a chunk with no identity at all keeps the unscoped key, so every existing
key and object stays valid, and the prefix before a request's first image is still shared.
The object carries ``I_k`` in its header's metadata entry ``kvwire.request_identity``, and
a reader checks it against the key (KVW-IDENT-6, through ``keys.header_mismatches``).
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
from dataclasses import dataclass

from ..format.header import REQUEST_IDENTITY_KEY

DOMAIN = b"kvwire request identity 1\x00"  # KVW-IDENT-2
ADAPTER_DOMAIN = b"kvwire adapter 1\x00"  # KVW-IDENT-3
METADATA_KEY = REQUEST_IDENTITY_KEY  # KVW-IDENT-5
DIGEST_SIZE = 32
MAX_FIELD = 1 << 16  # bytes of a salt, adapter name, fingerprint or item identifier
MAX_ITEMS = 1 << 16
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = (".safetensors", ".bin", ".pt")


def _field(name: str, value, *, empty: bool = False) -> bytes:
    if isinstance(value, bytearray | memoryview):
        value = bytes(value)
    if not isinstance(value, bytes):
        raise TypeError(f"{name} must be bytes, not {type(value).__name__}")
    if not (0 if empty else 1) <= len(value) <= MAX_FIELD:
        raise ValueError(f"{name}: {len(value)} bytes; need 1..{MAX_FIELD}")
    return value


@dataclass(frozen=True)
class Adapter:
    """A weight adapter (LoRA): its name and a fingerprint of its weights
    (``adapter_fingerprint`` of a PEFT directory, KVW-IDENT-3)."""

    name: str
    fingerprint: bytes

    def __post_init__(self):
        if not isinstance(self.name, str) or not 1 <= len(self.name.encode("utf-8")) <= MAX_FIELD:
            raise ValueError(f"adapter name must be a non-empty str of at most {MAX_FIELD} UTF-8 bytes, "
                             f"not {self.name!r}")
        object.__setattr__(self, "fingerprint", _field("adapter fingerprint", self.fingerprint))


@dataclass(frozen=True)
class MultimodalItem:
    """One multimodal input: the engine's content hash of it (``identifier``, bytes) and its
    placeholder range in the prompt, tokens [offset, offset + length)."""

    identifier: bytes
    offset: int
    length: int

    def __post_init__(self):
        object.__setattr__(self, "identifier", _field("multimodal item identifier", self.identifier))
        for name in ("offset", "length"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 63:
                raise ValueError(f"multimodal item {name} must be an int in 0..2**63-1, not {v!r}")
        if self.length < 1:
            raise ValueError("a multimodal item's placeholder has at least one token (length >= 1)")


@dataclass(frozen=True)
class RequestIdentity:
    """Everything besides tokens and model that a request's keys bind (KVW-IDENT-1): the
    isolation ``salt`` (bytes or None), the ``adapter`` (``Adapter`` or None) and the
    multimodal ``items`` (kept sorted by offset)."""

    salt: bytes | None = None
    adapter: Adapter | None = None
    items: tuple = ()

    def __post_init__(self):
        if self.salt is not None:
            object.__setattr__(self, "salt", _field("salt", self.salt))
        if self.adapter is not None and not isinstance(self.adapter, Adapter):
            raise TypeError(f"adapter must be None or a kvwire.store.identity.Adapter, not "
                            f"{type(self.adapter).__name__}")
        items = tuple(self.items)
        if len(items) > MAX_ITEMS or not all(isinstance(x, MultimodalItem) for x in items):
            raise ValueError(f"items must be at most {MAX_ITEMS} kvwire.store.identity.MultimodalItem")
        object.__setattr__(self, "items", tuple(sorted(items, key=lambda x: (x.offset, x.length, x.identifier))))

    def bound_items(self, chunk: int, chunk_tokens: int) -> tuple:
        """The items chunk ``chunk`` depends on: those starting before its end (KVW-IDENT-4)."""
        end = (chunk + 1) * chunk_tokens
        return tuple(x for x in self.items if x.offset < end)

    def encoding(self, chunk: int, chunk_tokens: int) -> bytes | None:
        """The bytes of KVW-IDENT-2 for chunk ``chunk``; None when it has no identity."""
        items = self.bound_items(chunk, chunk_tokens)
        if self.salt is None and self.adapter is None and not items:
            return None
        out = [DOMAIN, bytes([(self.salt is not None) | (self.adapter is not None) << 1])]
        if self.salt is not None:
            out += [struct.pack("<I", len(self.salt)), self.salt]
        if self.adapter is not None:
            name = self.adapter.name.encode("utf-8")
            out += [struct.pack("<I", len(name)), name, struct.pack("<I", len(self.adapter.fingerprint)),
                    self.adapter.fingerprint]
        out.append(struct.pack("<I", len(items)))
        for x in items:
            out += [struct.pack("<I", len(x.identifier)), x.identifier, struct.pack("<QQ", x.offset, x.length)]
        return b"".join(out)

    def digests(self, n_chunks: int, chunk_tokens: int) -> list:
        """``I_k`` (32 bytes, or None for a chunk without identity) of chunks 0..n_chunks-1;
        one SHA-256 per distinct set of bound items."""
        out, last = [], None
        for k in range(n_chunks):
            n = len(self.bound_items(k, chunk_tokens))
            if last is None or n != last[0]:
                enc = self.encoding(k, chunk_tokens)
                last = (n, None if enc is None else hashlib.sha256(enc).digest())
            out.append(last[1])
        return out


def check_identity(identity) -> RequestIdentity | None:
    """``identity`` as given when it is None or a RequestIdentity, else a TypeError."""
    if identity is not None and not isinstance(identity, RequestIdentity):
        raise TypeError(f"identity must be None or a kvwire.store.RequestIdentity, not {type(identity).__name__}")
    return identity


def with_identity(metadata: dict, digest: bytes | None) -> dict:
    """``metadata`` with the request identity entry set to ``digest`` (KVW-IDENT-5), or
    without one for None (a cache ``get_cache`` returns spans chunks of several digests)."""
    md = {k: v for k, v in metadata.items() if k != METADATA_KEY}
    if digest is not None:
        md[METADATA_KEY] = bytes(digest)
    return md


_ADAPTER_CACHE: dict = {}


def adapter_files(directory: str) -> list:
    """(name, path, stat) of the files an adapter fingerprint covers (KVW-IDENT-3): its
    ``adapter_config.json`` and its weight files (``*.safetensors``, ``*.bin``, ``*.pt``) at
    the top of the directory, in byte order of their names; a ValueError when either is missing."""
    names = sorted(os.listdir(directory), key=lambda n: n.encode("utf-8"))
    out = []
    for name in names:
        if name == ADAPTER_CONFIG or name.endswith(ADAPTER_WEIGHTS):
            path = os.path.join(directory, name)
            st = os.stat(path)
            if stat.S_ISREG(st.st_mode):
                out.append((name, path, st))
    if not any(n == ADAPTER_CONFIG for n, _, _ in out) or not any(n.endswith(ADAPTER_WEIGHTS) for n, _, _ in out):
        raise ValueError(f"{directory}: an adapter directory holds {ADAPTER_CONFIG} and weight files "
                         f"({', '.join('*' + e for e in ADAPTER_WEIGHTS)})")
    return out


def adapter_fingerprint(directory) -> bytes:
    """SHA-256 of an adapter directory (KVW-IDENT-3): the domain, then per file of
    ``adapter_files`` its name (u32 length + UTF-8), size (u64) and bytes. Cached per path,
    sizes, modification and change times and inodes (the change time, which no tool can set
    back, catches weights rewritten in place with their old size and mtime). OSError or ValueError when it cannot be read."""
    directory = os.path.realpath(os.fspath(directory))
    files = adapter_files(directory)
    stamp = (directory, tuple((n, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino) for n, _, st in files))
    if stamp in _ADAPTER_CACHE:
        return _ADAPTER_CACHE[stamp]
    h = hashlib.sha256(ADAPTER_DOMAIN)
    for name, path, st in files:
        raw = name.encode("utf-8")
        h.update(struct.pack("<I", len(raw)) + raw + struct.pack("<Q", st.st_size))
        seen = 0
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(8 << 20), b""):
                h.update(block)
                seen += len(block)
        if seen != st.st_size:
            raise ValueError(f"{path} changed while it was fingerprinted")
    digest = h.digest()
    if len(_ADAPTER_CACHE) > 256:
        _ADAPTER_CACHE.clear()
    _ADAPTER_CACHE[stamp] = digest
    return digest


__all__ = ["ADAPTER_DOMAIN", "Adapter", "DIGEST_SIZE", "DOMAIN", "METADATA_KEY", "MultimodalItem", "RequestIdentity",
           "adapter_files", "adapter_fingerprint", "check_identity", "with_identity"]
