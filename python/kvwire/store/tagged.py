"""The tag hooks of ``KVStore`` (spec/store.md section 11, KVW-AUTH-6..8): where tags are
written, fetched and checked.

Why apart from ``auth``: that module is the keys and the tag format, which any tool can
use on its own; this one is the store's use of them, written once for the whole-object
reader (``KVStore``) and the layer-wise one (``LayerwiseLoad``). Tags are fetched in the
batch that fetches the headers, so authentication costs no round trip; each stored body's
SHA-256 is compared before that body is decoded.
"""

from __future__ import annotations

import hashlib
import hmac

from ..format.container import PREAMBLE_SIZE, parse_preamble, trailer_fields
from .auth import MAX_TAG_BYTES, Keyring, Tag, TagError, digests_of, tag_key
from .base import Store
from .counters import KVStoreCounts


def read_heads(store, keys, keyring, head_bytes: int) -> tuple[list, list]:
    """Each object's first ``head_bytes`` and, with a keyring, each object's tag, in one
    batch: authentication costs no round trip (KVW-AUTH-6)."""
    keys = list(keys)
    if keyring is None or not keys:
        return store.get_many(keys, (0, head_bytes)), [None] * len(keys)
    got = store.get_ranges([(k, (0, head_bytes)) for k in keys] + [(tag_key(k), (0, MAX_TAG_BYTES)) for k in keys])
    return got[:len(keys)], got[len(keys):]


class TagChecks:
    """The tag hooks of ``KVStore`` (it has ``store``, ``counts`` and ``auth``): writers tag
    and heal (KVW-AUTH-8), readers verify before they use a byte (KVW-AUTH-6, 7)."""

    store: Store
    counts: KVStoreCounts
    auth: Keyring | None = None  # every object written is tagged and every object read verified

    # -- writing -------------------------------------------------------------------------
    def present(self, keys) -> list:
        """Which objects of ``keys`` a writer skips: those that exist, and with a keyring
        have a tag that verifies (or is under a key id it does not hold: a writer with a
        newer key). An object without such a tag is deleted with its tag and written again;
        a tag without its object is deleted (one batch to find them, a delete each)."""
        if self.auth is None:
            return list(self.store.exists_many(keys))
        n = len(keys)
        got = self.store.get_ranges([(k, (0, 0)) for k in keys] + [(tag_key(k), (0, MAX_TAG_BYTES)) for k in keys])
        out = []
        for key, obj, tag in zip(keys, got[:n], got[n:]):
            try:
                if obj is not None:
                    self.auth.open(key, tag)
                    out.append(True)
                    continue
            except TagError as exc:
                if exc.kind == "foreign":
                    out.append(True)
                    continue
                self.store.delete(key)
                self.counts.add("auth_healed")
            if tag is not None:
                self.store.delete(tag_key(key))
            out.append(False)
        return out

    def put_tagged(self, items) -> list:
        """``put_many`` of ``(key, buffers)`` items, each followed by its tag when there is a
        keyring (KVW-AUTH-3); the objects' results."""
        if self.auth is None:
            return self.store.put_many(items)
        tagged = []
        for key, bufs in items:
            tagged += [(key, bufs), (tag_key(key), self.auth.tag(key, bufs))]
        return self.store.put_many(tagged)[::2]

    # -- reading -------------------------------------------------------------------------
    def verify_head(self, key, head, data):
        """The Tag of the object ``key`` whose first bytes ``head`` passed the header checks,
        when its tag ``data`` verifies and covers those header bytes, else None (a miss,
        counted)."""
        assert self.auth is not None  # called only with a keyring
        try:
            t = self.auth.open(key, data)
            _, hlen, _ = parse_preamble(head)
            if not hmac.compare_digest(t.header, hashlib.sha256(memoryview(head)[:PREAMBLE_SIZE + hlen]).digest()):
                raise TagError("the header is not the one tagged", "forged")
            return t
        except TagError as exc:
            return self.auth_failed(key, exc)

    def verify_index(self, key, t: Tag, reader, buf) -> bool:
        """Before any body is used: the tag covers the index ``reader`` opened on ``buf``
        and one digest per record."""
        try:
            if reader.form != "file" or len(t.bodies) != len(reader.records):
                raise TagError("the tag's body count is not the object's", "forged")
            off, n = trailer_fields(buf)
            if not hmac.compare_digest(t.index, hashlib.sha256(memoryview(buf)[off:off + n]).digest()):
                raise TagError("the index is not the one tagged", "forged")
            return True
        except TagError as exc:
            self.auth_failed(key, exc)
            return False

    def verify_bodies(self, key, t: Tag, reader, buf, records=None, *, base: int = 0) -> bool:
        """Before they are decoded: the SHA-256 of each stored body (of the index
        ``records``, e.g. one layer's, or all) is the tag's digest for its record; ``buf``
        holds the object's bytes from offset ``base`` on (a layer's frames read on their
        own: ``LayerwiseLoad``)."""
        recs, view = reader.records, memoryview(buf).cast("B")
        which = range(len(recs)) if records is None else records
        spans = [(int(recs["offset"][i]) - base, int(recs["offset"][i]) - base + int(recs["stored_length"][i]))
                 for i in which]
        if any(a < 0 or b > len(view) for a, b in spans):
            raise ValueError(f"the bytes from offset {base} do not hold every body asked for")
        got = digests_of(spans, lambda a, b: hashlib.sha256(view[a:b]).digest())
        for i, d in zip(which, got):
            if not hmac.compare_digest(d, t.bodies[i]):
                self.auth_failed(key, TagError(f"body {i} is not the one tagged", "forged"))
                return False
        return True

    def auth_failed(self, key, exc: TagError) -> None:
        """Count a tag failure; a forged tag's object and tag are deleted (KVW-AUTH-7)."""
        self.counts.add("auth_failures")
        if exc.kind == "forged":
            self.store.delete(key)
            self.store.delete(tag_key(key))
        return None


__all__ = ["TagChecks", "read_heads"]
