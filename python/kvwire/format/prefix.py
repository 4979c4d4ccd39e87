"""Prefix hash chain (spec/crossmodel.md, KVW-PREFIX-*): portable keys for cache hits.

The chain is computed here, below the header, because a reader checks a header's
``PrefixChain`` against it; the scheduler side (``covered_tokens``, ``PrefixIndex``)
lives in ``kvwire.model.prefix``.

Every engine that hashes the same token ids with the same model and chunk size gets the
same 32-byte keys, so a scheduler can tell how many leading tokens of a request a stored
cache covers from headers alone, without Python's salted ``hash`` (the LMCache bug).
Chunk k's hash is SHA-256(hash of chunk k-1 || token ids of chunk k as little-endian u32);
chunk -1's "hash" is the root, which binds the model (compat fingerprint) and chunk size.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

PREFIX_SCHEME = 1  # PrefixChain.scheme of this computation
TAG_ROOT = b"kvwire.prefix.v1\x00"
HASH_SIZE = 32


def prefix_root(fingerprint: bytes, chunk_tokens: int) -> bytes:
    """The chain's starting value for a cache that starts at position 0 (KVW-PREFIX-2)."""
    fp = bytes(fingerprint)
    if not 1 <= chunk_tokens < 1 << 32:
        raise ValueError(f"chunk_tokens {chunk_tokens} is not a positive u32")
    return hashlib.sha256(TAG_ROOT + struct.pack("<HII", PREFIX_SCHEME, chunk_tokens, len(fp)) + fp).digest()


def token_bytes(tokens: Any) -> bytes:
    a = np.asarray(tokens)
    if a.ndim != 1:
        raise ValueError("tokens must be a 1-D sequence of token ids")
    if a.size and (a.dtype.kind not in "iu" or int(a.min()) < 0 or int(a.max()) >= 1 << 32):
        raise ValueError("token ids must be integers in [0, 2**32)")
    return a.astype("<u4").tobytes()


def chain(tokens: Any, chunk_tokens: int, root: bytes) -> bytes:
    """Hashes of the chunks of ``tokens`` (cut every ``chunk_tokens``; the last may be partial), concatenated."""
    raw = memoryview(token_bytes(tokens))  # slices of a memoryview: the chunk's bytes are hashed in place
    step = 4 * chunk_tokens
    out = bytearray()
    prev = bytes(root)
    sha256 = hashlib.sha256
    for off in range(0, len(raw), step):
        h = sha256(prev)
        h.update(raw[off:off + step])
        prev = h.digest()
        out += prev
    return bytes(out)


def prefix_hashes(tokens: Sequence[int], chunk_tokens: int, fingerprint: bytes) -> bytes:
    """32 bytes per chunk of ``tokens`` from position 0 (KVW-PREFIX-3); the last chunk may be partial."""
    return chain(tokens, chunk_tokens, prefix_root(fingerprint, chunk_tokens))


def num_chunks(token_count: int, chunk_tokens: int) -> int:
    return -(-token_count // chunk_tokens)
