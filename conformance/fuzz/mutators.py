"""Structure-aware mutations: edit a chunk record where the readers look for it, then reseal.

A byte flip in a record is caught by a frame self-check or the index checksum, and a
record edited in its frame alone is caught by the frame/index agreement check (file form)
or the end frame digest. These mutations edit one record field consistently — in its
frame, in the file-form index, or in both — and recompute every checksum afterwards
(``harness.reseal``), so the structure checks behind them (record fields, chunk grid,
layout, frame/index agreement, decoded sizes) are what the input exercises. Shared by the
atheris target (``fuzz_reader.py``) and the hypothesis state machine (``statemachine.py``).
"""

from __future__ import annotations

import struct

import numpy as np
from harness import reseal

RECORD_FIELDS = {  # name -> (offset in the record, struct format)
    "offset": (0, "<Q"), "stored_length": (8, "<Q"), "raw_length": (16, "<Q"), "checksum": (24, "<Q"),
    "token_start": (32, "<I"), "token_count": (36, "<I"), "layer": (40, "<H"), "component": (42, "<B"),
    "codec": (43, "<B"), "flags": (44, "<H"), "head_start": (46, "<H"), "head_count": (48, "<H"),
    "reserved0": (50, "<H"), "reserved1": (52, "<I"),
}
INTERESTING = [0, 1, 2, 3, 7, 8, 63, 64, 255, 256, 4095, 4096, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
               2**63, 2**64 - 1]
WHERE = ("frame", "index", "both")


def frame_positions(data: bytes) -> list:
    """Positions of the chunk frames found by walking the layout rule (best effort)."""
    from kvwire.format.container import CHUNK_MARKER, MAGIC, next_frame_offset
    from kvwire.format.header import parse_header

    if len(data) < 32 or data[:8] != MAGIC:
        return []
    hlen = struct.unpack_from("<I", data, 12)[0]
    try:
        a = parse_header(data[32 : 32 + hlen]).alignment
    except Exception:  # noqa: BLE001  (a damaged header: the default alignment)
        a = 64
    pos, out = next_frame_offset(32 + hlen, a), []
    while pos + 64 <= len(data) and data[pos : pos + 4] == CHUNK_MARKER and len(out) < 1024:
        out.append(pos)
        off, length = struct.unpack_from("<QQ", data, pos + 8)
        if off != pos + 64:
            break
        pos = next_frame_offset(off + length, a)
    return out


def index_span(data: bytes) -> tuple[int, int] | None:
    """(offset, length) of the file-form index, when the trailer names one inside the input."""
    from kvwire.format.container import TRAILER_MAGIC

    if len(data) < 96 or data[-8:] != TRAILER_MAGIC:
        return None
    off, length = struct.unpack_from("<QI", data, len(data) - 32)
    return (off, length) if 32 <= off and off + length <= len(data) - 32 else None


def _index_records(data: bytes, span):
    from kvwire.format.container import parse_index

    try:
        return parse_index(data[span[0] : span[0] + span[1]]).copy()
    except Exception:  # noqa: BLE001 - a damaged index: nothing to edit
        return None


def edit_record(data: bytes, i: int, field: str, value: int, where: str = "both") -> bytes:
    """``data`` with field ``field`` of record ``i`` set to ``value`` in its frame, in the
    index, or in both (the index entry whose ``offset`` names that frame's body), then
    resealed. Inputs without frames or index are returned resealed, otherwise unchanged."""
    if field not in RECORD_FIELDS or where not in WHERE:
        raise ValueError(f"field {field!r} / where {where!r}: fields {sorted(RECORD_FIELDS)}, where one of {WHERE}")
    from kvwire.format.container import build_index

    out = bytearray(data)
    off, fmt = RECORD_FIELDS[field]
    value &= (1 << (8 * struct.calcsize(fmt))) - 1
    frames = frame_positions(data)
    frame = frames[i % len(frames)] if frames else None
    if frame is not None and where in ("frame", "both"):
        struct.pack_into(fmt, out, frame + 8 + off, value)
    span = index_span(data)
    if span is not None and where in ("index", "both"):
        recs = _index_records(data, span)
        if recs is not None and len(recs):
            j = i % len(recs)
            if frame is not None and where == "both":
                hit = (recs["offset"] == frame + 64).nonzero()[0]
                j = int(hit[0]) if len(hit) else j
            row = bytearray(recs[j : j + 1].tobytes())
            struct.pack_into(fmt, row, off, value)
            recs[j : j + 1] = np.frombuffer(bytes(row), recs.dtype)
            new = build_index(recs)
            if len(new) == span[1]:
                out[span[0] : span[0] + span[1]] = new
    return reseal(bytes(out))
