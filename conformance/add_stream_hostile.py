"""Conformance vectors for KVW-LIM-8 (allocation follows bytes), appended to format 1.0
with ``generate.py --add stream_hostile``.

Each vector is about 320 bytes: a preamble, a header and one chunk frame whose zstd body
declares far more bytes than the input holds (1 GiB, 2^64 - 1). The only defect is that
the body never arrives, so every reader must report ``TRUNCATED``; what the vectors check
is that it gets there without allocating the declared length (a reader that does fails
with an out-of-memory or overflow error, or is killed, instead of reporting a code).
"""

from __future__ import annotations

import numpy as np

import forge
import kvwire
from kvwire.format.container import RECORD_STRUCT
from kvwire.format.header import Architecture, Header

PRODUCER = kvwire.Producer("kvwire-conformance-generator", "1.0")
_STORED, _CODEC = 1, 8  # RECORD_STRUCT fields: stored_length, codec


def declared_body(stored_length: int) -> bytes:
    """The container up to and including its first chunk frame (a zstd body), the frame's
    ``stored_length`` set to ``stored_length`` and its self-check recomputed."""
    h = Header(arch=Architecture.uniform(1, 1, 8), token_count=64, dtype="f16", chunk_tokens=64,
               producer=PRODUCER)
    zeros = np.zeros((1, 64, 8), np.float16)
    data = kvwire.encode(kvwire.KVCache(h, [{"k": zeros, "v": zeros}]), form="stream", codec="zstd")
    f0 = forge.layout(data).frames[0]
    out = bytearray(data[: f0 + 64])
    rec = list(RECORD_STRUCT.unpack_from(out, f0 + 8))
    assert rec[_CODEC] == 1 and rec[_STORED] < 64, rec  # a small zstd body
    rec[_STORED] = stored_length
    RECORD_STRUCT.pack_into(out, f0 + 8, *rec)
    return forge.refix_frame(bytes(out), f0)


def gen_stream_hostile(g) -> None:
    """KVW-LIM-8: declared lengths that no byte backs."""
    for name, n, what in (("lim8-zstd-body-declares-1gib", 1 << 30, "1 GiB"),
                          ("lim8-zstd-body-declares-2e64", (1 << 64) - 1, "2^64 - 1 bytes")):
        g.invalid(name, declared_body(n), rule="KVW-LAYOUT-5", code="TRUNCATED",
                  description=f"320 bytes: preamble, header and one chunk frame whose zstd body declares {what}; "
                              "the input ends there. A reader must report TRUNCATED without allocating the "
                              "declared stored_length (KVW-LIM-8: it is bounded by no limit) and without an "
                              "overflow (KVW-ERR-2).",
                  rules=["KVW-LIM-8", "KVW-ERR-2", "KVW-LAYOUT-3"])


ADDITION = {
    "make": gen_stream_hostile,
    "spec": "spec/kvwire-v1.md section 17 (KVW-LIM-8, allocation follows bytes)",
    "rules_without_vector": {
        "KVW-LIM-8": "Its second case (a reader that allocates for the whole container once the header arrives "
                     "checks the header-implied decoded size against its KVW-LIM-5 limit) concerns how a reader "
                     "allocates, not which containers it accepts; tests/stream/test_stream_hostile.py covers it for "
                     "kvwire.stream.Reader.",
    },
}
