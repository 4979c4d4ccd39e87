"""Opening a request's chunk objects: the one step every reader of a ``KVStore`` starts with.

Why one step: ``KVStore.get_cache``, ``KVStore.lookup`` and the layer-wise loader
(``LayerwiseLoad``) all begin alike: the request's chunk keys; the first ``HEAD_BYTES``
of each object (and, with a keyring, its tag) in one batched read; each header checked
against what its key promises (KVW-STORE-17) and each tag verified (KVW-AUTH-6, 7); the
hits ending at the first object that fails, which is counted and, when corrupt or not the
key's, deleted. Written once, a check added for one reader cannot be missing from another.
What follows differs (whole bodies by ``get_many``, or one layer's frames at a time), so it
stays with each reader.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..cache.reader import probe
from ..format.errors import FormatError, TruncatedError
from ..format.header import Header
from .keys import KeySpace, header_mismatches
from .tagged import read_heads

HEAD_BYTES = 64 << 10  # first ranged read of an object: enough for the header of any usual model


class Head(NamedTuple):
    """One object whose header (and tag) passed: its key, its header, its first bytes as
    read, and with a keyring its verified ``Tag`` (KVW-AUTH-6)."""

    key: str
    header: Header
    first: bytes  # the object's first bytes: the whole object when shorter than HEAD_BYTES
    tag: object = None

    @property
    def whole(self) -> bool:
        """The first read got the whole object (it is shorter than ``HEAD_BYTES``)."""
        return len(self.first) < HEAD_BYTES


@dataclass
class Opened:
    """What opening a request's objects found: every chunk key and chain hash of the
    request, the ``Head`` of each leading object that passed, and the object bytes read."""

    keys: list
    hashes: list
    heads: list = field(default_factory=list)
    bytes_read: int = 0


def request_keys(space: KeySpace, tokens, *, partial: bool = True, n_chunks: int | None = None,
                 identity=None) -> tuple[list, list, list]:
    """(chain hashes, per-chunk key spaces, keys) of the chunks of ``tokens`` (the first
    ``n_chunks`` when given: the chain is sequential, later tokens change nothing) for a
    request of ``identity`` (KVW-IDENT-4)."""
    toks = np.asarray(tokens)
    if n_chunks is not None and toks.ndim == 1:
        toks = toks[:n_chunks * space.chunk_tokens]
    hashes = space.hashes(toks, partial=partial)
    spaces = space.chunk_spaces(len(hashes), identity)
    return hashes, spaces, [sp.key(x) for sp, x in zip(spaces, hashes)]


def open_heads(kv, keys, hashes, spaces, count: int | None = None) -> Opened:
    """Open the leading objects of a request on ``kv`` (a ``KVStore``): the first ``count``
    keys (all by default) read in one batch with their tags, then checked in order until
    one fails (a miss; counted, and deleted when it is corrupt or not the key's)."""
    want = list(keys) if count is None else list(keys)[:count]
    firsts, tags = read_heads(kv.store, want, kv.auth, HEAD_BYTES)  # with auth: the tags in the batch
    out = Opened(list(keys), hashes, bytes_read=sum(len(x) for x in firsts + tags if x is not None))
    for k, (key, first) in enumerate(zip(want, firsts)):
        got = None if first is None else _check_head(kv, out, key, first, k, hashes[k], spaces[k])
        if got is not None and kv.auth is not None:
            tag = kv.verify_head(key, got.first, tags[k])  # KVW-AUTH-6, 7
            got = None if tag is None else got._replace(tag=tag)
        if got is None:
            break
        out.heads.append(got)
    return out


def _check_head(kv, out: Opened, key, first, k, want_hash, space) -> Head | None:
    """The ``Head`` of object ``k`` of the request when it is the one its key promises
    (KVW-STORE-17), else None (the object discarded: counted and deleted). A header longer
    than ``first`` costs one more ranged read, counted in ``out.bytes_read``."""
    try:
        try:
            h = probe(first)
        except TruncatedError as exc:
            if exc.needed is None or len(first) < HEAD_BYTES:
                raise  # the whole object was read and is short: corrupt
            first = kv.store.get(key, (0, exc.needed))
            if first is None:
                return None
            out.bytes_read += len(first)
            h = probe(first)
    except FormatError:
        kv.discard(key, "corrupt")
        return None
    if not _matches(h, k, want_hash, space, out.heads):
        kv.discard(key, "incompatible")
        return None
    return Head(key, h, first)


def _matches(h, k, want_hash, space, heads) -> bool:
    """KVW-STORE-17: the header is the key's (``header_mismatches``), at the key's position
    in this request, and joins the chunks before it (same architecture and fp8 scales: one
    request's cache has one set, KVW-SCALE-7)."""
    return (not header_mismatches(h, space, want_hash) and h.first_position == k * space.chunk_tokens
            and (not heads or (h.arch == heads[0].header.arch and h.kv_scales == heads[0].header.kv_scales
                               and heads[-1].header.token_count == space.chunk_tokens)))


__all__ = ["HEAD_BYTES", "Head", "Opened", "open_heads", "request_keys"]
