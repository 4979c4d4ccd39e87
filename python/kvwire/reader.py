"""Decoding: ``Reader`` over a complete container in memory or mapped from a file.

Opening checks everything that can be checked without touching bodies: preamble,
header, index or frame chain, the record table against the header, the layout chain.
Bodies are checked when they are read: checksum (by default), then the inline frame is
compared with the index record (file form), then the codec. A raw chunk comes back as a
view into the buffer; ``layer()`` and ``load`` assemble whole layers with one copy.
"""

from __future__ import annotations

import builtins
import mmap
import os

import numpy as np

from . import registry as R
from .cache import KVCache
from .chunks import ChunkTable, check_offsets, check_records
from .codecs import decode_body
from .container import (
    CHUNK_MARKER, END_MARKER, FRAME_SIZE, PREAMBLE_SIZE, RECORD_DTYPE, check_zero, has_trailer, header_bytes,
    next_frame_offset, parse_end_frame, parse_frame, parse_index, parse_preamble, parse_trailer, xxh3,
)
from .errors import ChecksumError, LayoutError, LimitError, TruncatedError, VersionError
from .header import Header, parse_header
from .limits import DEFAULT_MAX_DECODED_BYTES, MAX_CHUNKS
from .tensors import as_uint, empty, view


def _check_version(header: Header, minor: int) -> None:
    if (header.format_major, header.format_minor) != (R.FORMAT_MAJOR, minor):
        raise VersionError("VERSION_MISMATCH", f"header says {header.format_major}.{header.format_minor}, "
                           f"preamble {R.FORMAT_MAJOR}.{minor}", rule="KVW-HDR-9")


def _read_header(buf) -> tuple[Header, int]:
    minor, hlen, hsum = parse_preamble(buf)
    header = parse_header(header_bytes(buf, hlen, hsum))
    _check_version(header, minor)
    return header, hlen


def probe(first_bytes) -> Header:
    """The header from the first bytes of a container alone.

    Raises ``TruncatedError`` whose ``needed`` says how many bytes (from the start)
    are required when ``first_bytes`` is too short.
    """
    return _read_header(first_bytes)[0]


class Reader:
    """A verified view of one container. Use ``kvwire.open`` to make one."""

    def __init__(self, buffer, *, max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES, _closer=None):
        self._buf = buffer
        self._readonly = memoryview(buffer).readonly
        self._closer = _closer
        self.size = len(buffer)
        self.header, hlen = _read_header(buffer)
        self._header_length = hlen
        table = ChunkTable.of(self.header)
        if table.total > MAX_CHUNKS:
            raise LimitError("LIMIT_EXCEEDED", f"header implies {table.total} chunks, limit {MAX_CHUNKS}",
                             rule="KVW-LIM-1")
        if has_trailer(buffer):
            self.form = "file"
            index_offset, index = parse_trailer(buffer)
            self.records = parse_index(index)
            end_frame_at = index_offset - FRAME_SIZE
        else:
            self.form = "stream"
            self.records, end_frame_at = self._walk_frames()
        self._lookup = check_records(self.header, table, self.records)
        self._table = table
        last_end = check_offsets(self.records, hlen, self.header.alignment, self.size)
        if next_frame_offset(last_end, self.header.alignment) != end_frame_at:
            raise LayoutError("BAD_OFFSET", f"end frame at {end_frame_at}, layout rule gives "
                              f"{next_frame_offset(last_end, self.header.alignment)}", rule="KVW-LAYOUT-1")
        marker, body = parse_frame(buffer, end_frame_at)
        if marker != END_MARKER:
            raise LayoutError("MISSING_END", f"no end frame at {end_frame_at}", rule="KVW-LAYOUT-3")
        count, digest = parse_end_frame(body)
        if count != len(self.records) or digest != xxh3(self.records.tobytes()):
            raise LayoutError("INDEX_MISMATCH", "end frame count/digest disagree with the chunk records",
                              rule="KVW-STREAM-1")
        if self.form == "stream" and end_frame_at + FRAME_SIZE != self.size:
            raise LayoutError("TRAILING_BYTES", f"{self.size - end_frame_at - FRAME_SIZE} bytes after the end frame",
                              rule="KVW-LAYOUT-4")
        decoded = int(self.records["raw_length"].sum(dtype=np.uint64)) if len(self.records) else 0
        if decoded > max_decoded_bytes:
            raise LimitError("DECODED_SIZE_LIMIT", f"container decodes to {decoded} bytes, limit {max_decoded_bytes}",
                             rule="KVW-LIM-5")
        self._frame_checked = np.zeros(len(self.records), bool) if self.form == "file" else None

    def _walk_frames(self):
        """Stream form: hop from frame to frame (never reading bodies) to the end frame."""
        buf, a = self._buf, self.header.alignment
        pos = next_frame_offset(PREAMBLE_SIZE + self._header_length, a)
        records = []
        while True:
            marker, body = parse_frame(buf, pos)
            if marker == END_MARKER:
                break
            if len(records) >= MAX_CHUNKS:
                raise LimitError("LIMIT_EXCEEDED", f"more than {MAX_CHUNKS} chunk frames", rule="KVW-LIM-1")
            rec = np.frombuffer(body, RECORD_DTYPE, 1)
            off, length = int(rec["offset"][0]), int(rec["stored_length"][0])
            if off != pos + FRAME_SIZE:
                raise LayoutError("BAD_OFFSET", f"frame at {pos} records body offset {off}, expected {pos + FRAME_SIZE}",
                                  rule="KVW-LAYOUT-1")
            if off + length > self.size:
                raise TruncatedError(f"body at {off}+{length} runs past the end ({self.size} bytes)",
                                     needed=off + length, rule="KVW-LAYOUT-5")
            records.append(body)
            pos = next_frame_offset(off + length, a)
        recs = np.frombuffer(b"".join(records), RECORD_DTYPE) if records else np.zeros(0, RECORD_DTYPE)
        return recs, pos

    # -- chunk access ------------------------------------------------------------------

    @property
    def chunk_count(self) -> int:
        return len(self.records)

    def num_chunks(self, layer: int, component: str) -> int:
        c = R.COMPONENTS[component]
        t = self._table
        flat = t.base.reshape(-1)
        i = layer * t.base.shape[1] + c
        nxt = flat[i + 1] if i + 1 < len(flat) else t.total
        return int(nxt - flat[i]) if t.heads[layer, c] else 0

    def record(self, layer: int, component: str, index: int = 0) -> np.void:
        """The chunk record of the ``index``-th chunk of (layer, component), in token order."""
        if not 0 <= index < self.num_chunks(layer, component):
            raise IndexError(f"layer {layer} {component} has {self.num_chunks(layer, component)} chunks")
        return self.records[self._lookup[self._table.base[layer, R.COMPONENTS[component]] + index]]

    def chunk(self, layer: int, component: str = "k", index: int = 0, *, verify: bool = True,
              backend: str = "numpy"):
        """Chunk tensor [heads, tokens, head_dim]; a view into the buffer for raw chunks."""
        i = int(self._lookup[self._table.base[layer, R.COMPONENTS[component]] + index]) \
            if 0 <= index < self.num_chunks(layer, component) else None
        if i is None:
            raise IndexError(f"layer {layer} {component} has {self.num_chunks(layer, component)} chunks")
        return self._decode(i, verify, backend)

    def iter_chunks(self, *, verify: bool = True, backend: str = "numpy"):
        """(layer, component, token_start, tensor) in container order."""
        for i, rec in enumerate(self.records):
            yield (int(rec["layer"]), R.COMPONENT_BY_CODE[int(rec["component"])], int(rec["token_start"]),
                   self._decode(i, verify, backend))

    def _stored(self, i: int, verify: bool):
        rec = self.records[i]
        off, length = int(rec["offset"]), int(rec["stored_length"])
        stored = memoryview(self._buf)[off : off + length]
        if self._frame_checked is not None and not self._frame_checked[i]:
            marker, body = parse_frame(self._buf, off - FRAME_SIZE)
            if marker != CHUNK_MARKER or body != self.records[i : i + 1].tobytes():
                raise LayoutError("INDEX_MISMATCH", f"frame before body {i} disagrees with the index record",
                                  rule="KVW-FILE-4")
            self._frame_checked[i] = True
        if verify and xxh3(stored) != int(rec["checksum"]):
            raise ChecksumError("BODY_CHECKSUM", f"chunk {i} (layer {int(rec['layer'])}) body checksum mismatch",
                                rule="KVW-CSUM-1")
        return rec, stored

    def _decode(self, i: int, verify: bool, backend: str):
        rec, stored = self._stored(i, verify)
        spec = self.header.arch.layers[int(rec["layer"])]
        shape = spec.shape(R.COMPONENT_BY_CODE[int(rec["component"])], int(rec["token_count"]))
        codec = R.CODEC_BY_CODE[int(rec["codec"])]
        if codec == "raw":
            if backend == "torch" and self._readonly:
                # torch has no read-only tensors: a view of bytes would let callers write into them
                return view(bytearray(stored), 0, self.header.dtype, shape, backend)
            return view(self._buf, int(rec["offset"]), self.header.dtype, shape, backend)
        data = decode_body(codec, stored, int(rec["raw_length"]))
        return view(bytearray(data) if backend == "torch" else data, 0, self.header.dtype, shape, backend)

    # -- whole layers ------------------------------------------------------------------

    def layer(self, layer: int, *, verify: bool = True, backend: str = "numpy", device=None) -> dict:
        """{component: tensor [heads, layer tokens, head_dim]}, assembled with one copy."""
        spec, r = self.header.arch.layers[layer], self.header.layer_tokens[layer]
        out = {}
        for comp in spec.components:
            dst = empty(spec.shape(comp, r.count), self.header.dtype, backend, device)
            for j in range(self.num_chunks(layer, comp)):
                i = int(self._lookup[self._table.base[layer, R.COMPONENTS[comp]] + j])
                rec = self.records[i]
                a = int(rec["token_start"]) - r.start
                src = self._decode(i, verify, "numpy" if backend == "numpy" else "torch")
                if backend == "numpy":  # copy through integer views: memcpy speed for bf16/fp8 too
                    as_uint(dst)[:, a : a + src.shape[1], :] = as_uint(src)
                else:
                    dst[:, a : a + src.shape[1], :].copy_(src)
            out[comp] = dst
        return out

    def load(self, *, verify: bool = True, backend: str = "numpy", device=None) -> KVCache:
        if device is not None and str(device).startswith("cuda"):
            from .cuda import load_to_device

            return load_to_device(self, device, verify=verify)
        return KVCache(self.header, [self.layer(i, verify=verify, backend=backend, device=device)
                                     for i in range(self.header.num_layers)])

    # -- full validation ---------------------------------------------------------------

    def validate(self) -> None:
        """Check every byte: frames, padding, checksums, and decode every body."""
        buf, a = self._buf, self.header.alignment
        end = PREAMBLE_SIZE + self._header_length
        for i, rec in enumerate(self.records):
            frame_at = int(rec["offset"]) - FRAME_SIZE
            check_zero(buf, end, frame_at)
            _, stored = self._stored(i, True)  # file form: also compares the frame with the index
            codec = R.CODEC_BY_CODE[int(rec["codec"])]
            if codec != "raw":
                decode_body(codec, stored, int(rec["raw_length"]))
            end = int(rec["offset"]) + int(rec["stored_length"])
        check_zero(buf, end, next_frame_offset(end, a))

    # -- lifetime ----------------------------------------------------------------------

    def close(self) -> None:
        if self._closer is not None:
            self._closer()
            self._closer = None

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        h = self.header
        return (f"<kvwire.Reader {self.form} form, {h.num_layers} layers, {h.token_count} tokens, {h.dtype}, "
                f"{self.chunk_count} chunks, {self.size} bytes>")


def _map_file(path) -> tuple[object, object]:
    with builtins.open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return b"", None
        # ACCESS_COPY: a private, writable mapping, so torch.frombuffer gets a writable
        # buffer; writes to tensors never reach the file.
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)

    def close():
        try:
            mm.close()
        except BufferError:  # views still alive: the mapping goes when they do
            pass

    return mm, close


def open(source, *, max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES) -> Reader:  # noqa: A001
    """A ``Reader`` over a path (memory-mapped) or a bytes-like object (used in place)."""
    if isinstance(source, (str, os.PathLike)):
        buf, closer = _map_file(source)
        try:
            return Reader(buf, max_decoded_bytes=max_decoded_bytes, _closer=closer)
        except BaseException:
            if closer:
                closer()
            raise
    return Reader(source, max_decoded_bytes=max_decoded_bytes)


def load(source, *, device=None, backend: str | None = None, verify: bool = True,
         max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES) -> KVCache:
    """A ``KVCache`` with its own memory (checksums verified unless ``verify=False``)."""
    if backend is None:
        backend = "torch" if device is not None else "numpy"
    with open(source, max_decoded_bytes=max_decoded_bytes) as r:
        return r.load(verify=verify, backend=backend, device=device)
