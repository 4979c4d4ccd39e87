"""What ``kvwire store`` reads of a store's objects: keys parsed (objects and their tags),
sizes and headers in batches, and one object checked against its key (KVW-STORE-17).

Why apart from the commands: ``stats``, ``ls``, ``inspect`` and ``gc`` all read objects the
same way (one ranged get of ``HEAD_BYTES`` per header, KVW-STORE-19, batched), and ``gc``
deletes by what these helpers report, so there is one definition of "a kvwire object".
"""

from __future__ import annotations

from ..cache.reader import Reader, probe
from ..format import registry as R
from ..format.errors import FormatError, TruncatedError
from ..store.auth import TAG_SUFFIX, is_tag_key
from ..store.keys import KEY_VERSION, KeySpace, header_mismatches
from ..store.kvstore import HEAD_BYTES

BATCH = 256  # keys per batched sizes / ranged-get call


def batches(keys):
    for i in range(0, len(keys), BATCH):
        yield keys[i:i + BATCH]


def sizes_of(store, keys) -> list:
    return [s for b in batches(keys) for s in store.sizes(b)]


def parse_key(key):
    """(space, hash) of a kvw1 key or of its tag's key (``K.tag``, KVW-AUTH-3), else None."""
    try:
        return KeySpace.parse(key[:-len(TAG_SUFFIX)] if is_tag_key(key) else key)
    except ValueError:
        return None


def read_header(store, key, head):
    """(header, head bytes) from a first ranged read, with the second read when the header
    is longer (KVW-STORE-19); (None, None) when the object vanished. FormatError: corrupt."""
    try:
        return probe(head), head
    except TruncatedError as exc:
        if exc.needed is None or len(head) < HEAD_BYTES:
            raise  # the whole object was read and it is short
        head = store.get(key, (0, exc.needed))
        return (None, None) if head is None else (probe(head), head)


def heads(store, keys):
    """(key, header or None, head bytes or None, error or None) per key, in batches."""
    for batch in batches(keys):
        for key, head in zip(batch, store.get_many(batch, (0, HEAD_BYTES))):
            if head is None:
                yield key, None, None, "missing"
                continue
            try:
                h, head = read_header(store, key, head)
                yield key, h, head, None if h is not None else "missing"
            except FormatError as exc:
                yield key, None, head, exc


def space_dict(space: KeySpace, chunk_hash: bytes) -> dict:
    return {"version": KEY_VERSION, "fingerprint": space.fingerprint.hex(), "dtype": space.dtype,
            "shard": f"tp{space.tp_rank}of{space.tp_size}", "layers": list(space.layers),
            "fidelity": space.fidelity, "chunk_tokens": space.chunk_tokens, "hash": chunk_hash.hex()}


def header_dict(h) -> dict:
    p = h.prefix
    return {"model_type": h.model.model_type, "model_id": h.model.model_id,
            "compat_fingerprint": h.model.compat_fingerprint.hex(), "dtype": h.dtype, "num_layers": h.num_layers,
            "first_position": h.first_position, "token_count": h.token_count, "chunk_tokens": h.chunk_tokens,
            "codec_specs": [s.codec for s in h.codec_specs],
            "prefix": None if p is None else {"scheme": p.scheme, "root": p.root.hex(), "hashes": p.hashes.hex()}}


def check_object(store, key, verify: bool) -> dict:
    """What inspect and gc --verify know of one object: header, mismatches, records,
    verified, error (a FormatError) or missing."""
    space, chunk_hash = KeySpace.parse(key)
    out = {"key": key, "parsed": space_dict(space, chunk_hash), "size": store.sizes([key])[0], "header": None,
           "mismatches": [], "records": None, "verified": None, "error": None, "missing": False}
    head = store.get(key, (0, HEAD_BYTES))
    try:
        h, head = (None, None) if head is None else read_header(store, key, head)
        if h is None:
            out["missing"] = True
            return out
        assert head is not None  # read with its header
        out["header"] = header_dict(h)
        out["mismatches"] = header_mismatches(h, space, chunk_hash)
        whole = head if len(head) < HEAD_BYTES else (store.get(key) if verify else None)
        if whole is None and verify:
            out["missing"] = True
            return out
        if whole is not None:  # the records are cheap once the object is in hand
            r = Reader(whole)
            names = [R.CODEC_BY_CODE[int(c)] for c in r.records["codec"]]
            out["records"] = {n: names.count(n) for n in sorted(set(names))}
            if verify:
                r.load(verify=True)
                out["verified"] = True
    except FormatError as exc:
        out["error"] = {"code": exc.code, "message": str(exc)}
        out["verified"] = False if verify else None
    return out


def problem(d) -> str | None:
    if d["error"]:
        return d["error"]["message"]
    if d["mismatches"]:
        return "KVW-STORE-17: " + "; ".join(d["mismatches"])
    return None



__all__ = ["BATCH", "KEY_VERSION", "batches", "check_object", "header_dict", "heads", "parse_key", "problem",
           "read_header", "sizes_of", "space_dict"]
