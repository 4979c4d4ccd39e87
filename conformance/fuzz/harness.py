"""What the fuzzers check, and how they get past the checksums.

``check(data)`` is the reader contract every input must satisfy:

* the random-access reader (``kvwire.open`` + ``validate`` + ``load``) and the sequential
  reader (``StreamDecoder``) either raise a ``FormatError`` or succeed; anything else
  (an ``IndexError``, a ``struct.error``, a hang, a huge allocation) is a finding;
* both readers accept or both reject (a parser differential is a finding), and when
  both accept they return the same chunks, byte for byte;
* every decoded tensor is touched (summed), so lazily mapped or mis-sized views fail here;
* the memory oracle: the peak of Python-tracked allocations (``tracemalloc``: Python
  objects, numpy arrays, zstd output) while both readers run stays within
  ``memory_bound(len(data), decoded)`` = 64 bytes per input byte + 6 per decoded byte +
  16 MiB. More is an ``OverAllocation`` finding: an allocation that neither the input's
  bytes nor a limit-checked decoded size justifies (a header DAG, a declared length
  allocated before its bytes arrive), found by the fuzzer rather than by a reviewer.

``reseal(data)`` recomputes every checksum it can find (preamble check, header
checksum, frame checks, body checksums, end frame count and digest, index checksum), so
a mutation of a structure reaches the structure's parser instead of its checksum.

Only a caller-configured decoded-size limit (KVW-LIM-6) differs from the defaults: 64 MiB,
so that inputs which legitimately declare gigabytes do not exhaust the fuzzer's memory.
"""

from __future__ import annotations

import struct
import tracemalloc

MAX_DECODED = 64 << 20
MEM_PER_INPUT_BYTE = 64
MEM_PER_DECODED_BYTE = 6  # the decoded cache, iter_chunks, and both readers' chunk copies kept here
MEM_BASE = 16 << 20
MEMORY = {"inputs": 0, "max_peak": 0, "max_peak_per_byte": 0.0, "largest_input": 0}  # figures for campaign reports


class Differential(AssertionError):
    """The random-access and the sequential reader disagree about an input."""


class OverAllocation(AssertionError):
    """Reading an input allocated more than ``memory_bound`` allows."""


def memory_bound(input_length: int, decoded: int) -> int:
    """Peak bytes the readers may allocate for an input of ``input_length`` bytes that
    decodes (or declares, limit-checked) ``decoded`` bytes."""
    return MEM_PER_INPUT_BYTE * input_length + MEM_PER_DECODED_BYTE * decoded + MEM_BASE


def _touch(x) -> int:
    import numpy as np

    a = np.ascontiguousarray(x)
    return int(a.view(np.uint8).sum()) if a.size else 0


def _touch_all(obj) -> None:
    """Read every decoded tensor of a cache: dense layers are dicts, sparse layers lists of
    per-head dicts (spec/sparse.md), state layers dicts of named tensors."""
    if isinstance(obj, dict):
        for v in obj.values():
            _touch_all(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _touch_all(v)
    else:
        _touch(obj)


def check(data: bytes, *, memory: bool = True) -> str:
    """Run both readers on ``data``; return "ok" or the error code. Raises on a finding
    (``Differential``, ``OverAllocation`` with ``memory``, anything not a FormatError)."""
    if not memory:
        return _check(data)[0]
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        outcome, decoded = _check(data)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        if started:
            tracemalloc.stop()
    n = len(data)
    MEMORY["inputs"] += 1
    if peak > MEMORY["max_peak"]:
        MEMORY["max_peak"], MEMORY["largest_input"] = peak, n
    MEMORY["max_peak_per_byte"] = max(MEMORY["max_peak_per_byte"], round(peak / max(n, 1), 1))
    bound = memory_bound(n, decoded)
    if peak > bound:
        raise OverAllocation(f"peak allocation {peak} bytes for a {n}-byte input decoding {decoded} bytes "
                             f"(bound {bound}); outcome {outcome}")
    return outcome


def _check(data: bytes) -> tuple[str, int]:
    """(outcome, decoded bytes): the decoded bytes are the records' limit-checked
    ``raw_length`` sum when the random-access reader got that far, or the chunk bytes the
    sequential reader produced, whichever is larger."""
    import kvwire
    from kvwire.format.errors import FormatError

    ra_chunks = {}
    declared = 0
    try:
        with kvwire.open(data, max_decoded_bytes=MAX_DECODED) as r:
            declared = min(int(r.records["raw_length"].sum()), MAX_DECODED) if len(r.records) else 0
            r.validate()
            cache = r.load()
            _touch_all(cache.layers)
            heads = r.records["head_start"]
            for i, (layer, comp, t0, x) in enumerate(r.iter_chunks()):
                ra_chunks[layer, comp, int(heads[i]), t0] = bytes(memoryview(x.reshape(-1).view("u1")))
        ra = "ok"
    except FormatError as exc:
        ra = exc.code
    seq_chunks = {}
    try:
        dec = kvwire.StreamDecoder(max_decoded_bytes=MAX_DECODED)
        step = max(1, len(data) // 3)
        for i in range(0, len(data), step):
            dec.feed(data[i : i + step])
            for ev in dec.events():
                if isinstance(ev, kvwire.ChunkEvent):
                    _touch(ev.data)
                    seq_chunks[ev.layer, ev.component, ev.head_start, ev.token_start] = bytes(
                        memoryview(ev.data.reshape(-1).view("u1")))
        for _ev in dec.events():
            pass
        dec.close()
        seq = "ok"
    except FormatError as exc:
        seq = exc.code
    if (ra == "ok") != (seq == "ok"):
        raise Differential(f"random-access reader: {ra}, sequential reader: {seq}")
    if ra == "ok" and ra_chunks != seq_chunks:
        raise Differential("both readers accept but decode different chunks")
    return ra, max(declared, sum(map(len, seq_chunks.values())))


# ---------------------------------------------------------------------------------------
# Resealing
# ---------------------------------------------------------------------------------------

def reseal(data: bytes) -> bytes:
    """``data`` with every checksum recomputed that can be located (best effort, never raises)."""
    b = bytearray(data)
    try:
        _reseal(b)
    except Exception:  # noqa: BLE001 - a damaged container is the normal case here
        pass
    return bytes(b)


def _reseal(b: bytearray) -> None:
    from kvwire.format.container import (
        CHUNK_MARKER,
        END_MARKER,
        MAGIC,
        TRAILER_MAGIC,
        check32,
        next_frame_offset,
        xxh3,
    )

    n = len(b)
    if n < 32 or bytes(b[:8]) != MAGIC:
        return
    hlen = struct.unpack_from("<I", b, 12)[0]
    if 32 + hlen <= n:
        struct.pack_into("<Q", b, 16, xxh3(bytes(b[32 : 32 + hlen])))
    struct.pack_into("<I", b, 28, check32(bytes(b[:28])))
    if 32 + hlen > n:
        return
    alignment = 64
    try:
        from kvwire.format.header import parse_header

        alignment = parse_header(bytes(b[32 : 32 + hlen])).alignment
    except Exception:  # noqa: BLE001  (a mutated header: the default alignment)
        pass
    file_form = n >= 64 and bytes(b[-8:]) == TRAILER_MAGIC
    pos = next_frame_offset(32 + hlen, alignment)
    records = []
    while pos + 64 <= n and len(records) < 4096:
        marker = bytes(b[pos : pos + 4])
        if marker == CHUNK_MARKER:
            off, length = struct.unpack_from("<QQ", b, pos + 8)
            if off == pos + 64 and off + length <= n:
                struct.pack_into("<Q", b, pos + 32, xxh3(bytes(b[off : off + length])))
            struct.pack_into("<I", b, pos + 4, check32(bytes(b[pos + 8 : pos + 64])))
            records.append(bytes(b[pos + 8 : pos + 64]))
            if off != pos + 64 or off + length > n:
                break  # the frames end here; the index checksum below is still recomputed
            pos = next_frame_offset(off + length, alignment)
        elif marker == END_MARKER:
            recs = b"".join(records)
            if file_form:
                recs = _index_records(b) or recs
            struct.pack_into("<QQ", b, pos + 8, len(recs) // 56, xxh3(recs))
            struct.pack_into("<I", b, pos + 4, check32(bytes(b[pos + 8 : pos + 64])))
            break
        else:
            break
    if file_form:
        index_offset, index_length = struct.unpack_from("<QI", b, n - 32)
        if index_offset + index_length <= n - 32:
            struct.pack_into("<Q", b, n - 16, xxh3(bytes(b[index_offset : index_offset + index_length])))


def _index_records(b: bytearray) -> bytes | None:
    from kvwire.format.container import parse_index

    index_offset, index_length = struct.unpack_from("<QI", b, len(b) - 32)
    if index_offset + index_length > len(b) - 32:
        return None
    try:
        return parse_index(bytes(b[index_offset : index_offset + index_length])).tobytes()
    except Exception:  # noqa: BLE001  (a mutated index: nothing to return)
        return None
