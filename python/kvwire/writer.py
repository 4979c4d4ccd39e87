"""Encoding: a sans-IO ``Encoder`` that emits buffers, and thin adapters over it.

The encoder never concatenates tensor bytes: raw bodies are emitted as memoryviews of
the caller's arrays (one per head, since a token slice of a [heads, tokens, dim] layer
is contiguous per head), so ``writev``/``sendmsg`` can send a cache without a copy.
``encode`` joins the buffers into ``bytes``; ``save`` writes them to a temporary file
and renames it into place, so a reader never sees a partial file (KVW-FILE-6).
"""

from __future__ import annotations

import os
import queue
import secrets
import threading

import numpy as np
import xxhash

from . import registry as R
from .cache import KVCache
from .chunks import ChunkTable, on_grid, planned_chunks
from .codecs import DEFAULT_ZSTD_LEVEL, BodyEncoder, CodecPlan
from .container import (
    FRAME_SIZE, PREAMBLE_SIZE, RECORD_DTYPE, build_end_frame, build_frame, build_index, build_preamble,
    build_trailer, next_frame_offset, xxh3,
)
from .crossmodel_header import with_state_bit
from .decoder import RECORD_STRUCT
from .header import Header, build_header
from .state import planned_state_chunks
from .tensors import as_numpy, as_uint

FORMS = ("file", "stream")


class Encoder:
    """Builds one container incrementally: ``begin()``, ``chunk()`` per chunk in any order,
    then ``end()``. Each call returns the buffers to append, in order."""

    _SPARSE = False  # kvwire.sparse.SparseEncoder writes sparse headers (spec/sparse.md)

    def __init__(self, header: Header, *, codec="raw", level: int = DEFAULT_ZSTD_LEVEL):
        """``codec``: "raw", "zstd", a preset of ``kvwire.codecs.PRESETS``, a ``CodecSpec``, a
        mapping ``{(layer, component): codec}`` or a callable ``(layer, component, token_start)
        -> codec`` (spec/codecs.md); codec specs are added to the header (``Encoder.header``)."""
        if (header.sparse is not None) != self._SPARSE:
            raise ValueError("a sparse header is written by kvwire.sparse.SparseEncoder, a dense one by Encoder")
        header = with_state_bit(header)  # required bits follow from the header (KVW-STATE-1)
        # every chunk's pipeline, known before the header is built (spec/codecs.md; sparse: per head)
        self._plan = CodecPlan(header, codec, level)
        header = self._plan.header
        self.header = header
        self.codec = codec
        self._bodies = BodyEncoder(codec if isinstance(codec, str) and codec in ("raw", "zstd") else "raw", level)
        self._header_bytes = build_header(header)  # runs check_header
        self._table = ChunkTable.of(header)
        self._filled = np.zeros(self._table.total, bool)
        self._records: list[np.ndarray] = []
        self._pos = 0
        self._state = "new"

    @property
    def position(self) -> int:
        """Bytes emitted so far."""
        return self._pos

    def begin(self) -> list:
        self._expect("new", "begin")
        self._state = "chunks"
        self._pos = PREAMBLE_SIZE + len(self._header_bytes)
        return [build_preamble(self._header_bytes), self._header_bytes]

    def chunk(self, layer: int, component: str, token_start: int, data) -> list:
        """Buffers of one chunk: ``data`` is its [heads, tokens, head_dim] array or tensor."""
        self._expect("chunks", "chunk")
        h = self.header
        if not 0 <= layer < h.num_layers:  # a negative index would wrap onto the last layers
            raise ValueError(f"layer {layer} outside [0, {h.num_layers})")
        spec, r = h.arch.layers[layer], h.layer_tokens[layer]
        x = as_numpy(data)
        n = int(x.shape[1]) if x.ndim == 3 else -1
        if component not in spec.components or tuple(x.shape) != spec.shape(component, n):
            raise ValueError(f"layer {layer} ({spec.kind}) {component}: array {tuple(x.shape)} does not match "
                             f"{spec.shape(component, n)}")
        if x.dtype != R.DTYPES[h.dtype][2]:
            raise ValueError(f"array dtype {x.dtype} != header dtype {h.dtype}")
        C = h.chunk_tokens
        if not on_grid(token_start, n, C, r.start, r.stop):
            raise ValueError(f"tokens [{token_start}, {token_start + n}) are not one chunk of layer {layer}'s grid")
        slot = self._table.slot(layer, R.COMPONENTS[component], token_start, C)
        if self._filled[slot]:
            raise ValueError(f"chunk (layer {layer}, {component}, token {token_start}) already written")
        self._filled[slot] = True

        # one piece per head (a token slice of a [heads, T, dim] tensor is contiguous per head), viewed
        # as unsigned integers of the same width, which export the buffer protocol for any dtype
        pieces = [memoryview(hd if hd.flags.c_contiguous else np.ascontiguousarray(hd)).cast("B")
                  for hd in as_uint(x)]
        return self._emit(layer, component, token_start, n, 0, x.shape[0], pieces, x=x)

    def state_chunk(self, layer: int, index: int, data) -> list:
        """Buffers of state tensor ``index`` of state layer ``layer`` (spec/crossmodel.md, KVW-STATE-7)."""
        self._expect("chunks", "state_chunk")
        h = self.header
        if not 0 <= layer < h.num_layers or h.arch.layers[layer].kind != "state" or h.token_count == 0:
            raise ValueError(f"layer {layer} is not a state layer of a cache with tokens")
        tensors = h.arch.layers[layer].state_tensors
        if not 0 <= index < len(tensors):
            raise ValueError(f"state layer {layer} has {len(tensors)} state tensors, no tensor {index}")
        t, x = tensors[index], as_numpy(data)
        if tuple(x.shape) != t.shape or x.dtype != R.DTYPES[t.dtype][2]:
            raise ValueError(f"state {t.name!r}: array {tuple(x.shape)} {x.dtype}, header declares {t.shape} {t.dtype}")
        slot = int(self._table.base[layer, R.COMPONENTS["state"]]) + index
        if self._filled[slot]:
            raise ValueError(f"state chunk (layer {layer}, tensor {index}) already written")
        self._filled[slot] = True
        raw = memoryview(np.ascontiguousarray(as_uint(x)).reshape(-1)).cast("B")
        return self._emit(layer, "state", 0, h.token_count, index, 1, [raw])

    def _emit(self, layer: int, component: str, token_start: int, n: int, head_start: int, head_count: int,
              pieces: list, bodies: BodyEncoder | None = None, x=None) -> list:
        """Frame and stored body of one chunk whose raw bytes are ``pieces`` (already checked)."""
        h = self.header
        bodies = bodies or self._bodies
        raw_length = sum(p.nbytes for p in pieces)
        codec, stored, codec_spec = bodies.codec, pieces, 0
        if x is not None and self._plan is not None:
            codec, codec_spec, stored = self._plan.encode(layer, component, token_start, x, pieces, raw_length,
                                                          head_start)
        elif codec != "raw":
            stored = bodies.encode(pieces)
            if len(stored[0]) >= raw_length:  # incompressible: store raw (KVW-CHUNK-6)
                codec, stored = "raw", pieces
        hasher = xxhash.xxh3_64()
        for p in stored:
            hasher.update(p)
        stored_length = raw_length if stored is pieces else sum(memoryview(p).nbytes for p in stored)

        frame_at = next_frame_offset(self._pos, h.alignment)
        rec = np.frombuffer(RECORD_STRUCT.pack(
            frame_at + FRAME_SIZE, stored_length, raw_length, hasher.intdigest(), token_start, n, layer,
            R.COMPONENTS[component], R.CODECS[codec], 0, head_start, head_count, codec_spec, 0), RECORD_DTYPE)[0]
        self._records.append(rec)
        out = [bytes(frame_at - self._pos) + build_frame(rec), *stored]
        self._pos = frame_at + FRAME_SIZE + stored_length
        return out

    def end(self, *, form: str = "file") -> list:
        self._expect("chunks", "end")
        if form not in FORMS:
            raise ValueError(f"form must be one of {FORMS}")
        if not self._filled.all():
            missing = int(np.argmin(self._filled))
            raise ValueError(f"{int((~self._filled).sum())} chunks were never written (first missing slot {missing})")
        self._state = "done"
        records = np.array(self._records, RECORD_DTYPE) if self._records else np.zeros(0, RECORD_DTYPE)
        frame_at = next_frame_offset(self._pos, self.header.alignment)
        out = [bytes(frame_at - self._pos) + build_end_frame(len(records), xxh3(records.tobytes()))]
        self._pos = frame_at + FRAME_SIZE
        if form == "file":
            index = build_index(records)
            index_offset = self._pos
            pad = -(index_offset + len(index)) % 8
            out += [index, bytes(pad) + build_trailer(index_offset, index)]
            self._pos += len(index) + pad + 32
        return out

    def _expect(self, state: str, call: str) -> None:
        if self._state != state:
            raise RuntimeError(f"Encoder.{call}() called in state {self._state!r}")


def iter_buffers(cache: KVCache, *, form: str = "file", codec="raw", level: int = DEFAULT_ZSTD_LEVEL,
                 **header_changes):
    """Yield the container's buffers (bytes and zero-copy memoryviews), layer-major.

    ``header_changes`` override header fields for this encoding (``chunk_tokens``,
    ``alignment``, ``model``, ``metadata`` ...).
    """
    if header_changes:
        cache = cache.with_header(**header_changes)
    if getattr(cache, "is_sparse", False):  # a SparseKVCache (spec/sparse.md)
        from .sparse import iter_sparse_buffers

        yield from iter_sparse_buffers(cache, form=form, codec=codec, level=level)
        return
    h = cache.header
    enc = Encoder(h, codec=codec, level=level)
    yield from enc.begin()
    host = {}  # one host view per tensor (a GPU tensor is copied to the host once, not per chunk)
    states = list(planned_state_chunks(h))  # written in canonical (layer-major) order with the rest
    for layer, comp, t0, n in planned_chunks(h):
        while states and states[0][0] < layer:
            yield from _state_chunk(enc, cache, *states.pop(0))
        if (layer, comp) not in host:
            host = {(layer, comp): as_numpy(cache.layers[layer][comp])}
        local = t0 - h.layer_tokens[layer].start
        yield from enc.chunk(layer, comp, t0, host[layer, comp][:, local : local + n, :])
    for layer, index in states:
        yield from _state_chunk(enc, cache, layer, index)
    yield from enc.end(form=form)


def _state_chunk(enc: Encoder, cache: KVCache, layer: int, index: int) -> list:
    return enc.state_chunk(layer, index, cache.state(layer)[cache.header.arch.layers[layer].state_tensors[index].name])


def encode(cache: KVCache, **opts) -> bytes:
    """The whole container as bytes (see ``iter_buffers`` for the options)."""
    return b"".join(iter_buffers(cache, **opts))


def write_all(fd: int, buffers, *, batch_bytes: int = 8 << 20) -> int:
    """writev every buffer in order; returns bytes written.

    Buffers are grouped into batches of about ``batch_bytes`` that a second thread
    writes while this one produces (and checksums) the next batch: ``os.writev``
    releases the GIL, so hashing and the kernel copy overlap.
    """
    iov_max = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
    batches: queue.Queue = queue.Queue(maxsize=2)
    failure: list[BaseException] = []

    def drain() -> None:
        while (batch := batches.get()) is not None:
            if not failure:
                try:
                    _writev(fd, batch)
                except BaseException as exc:  # reported to the producer below
                    failure.append(exc)

    writer = threading.Thread(target=drain, name="kvwire-writev", daemon=True)
    writer.start()
    total, batch, size = 0, [], 0
    try:
        for buf in buffers:
            if failure:
                break
            mv = memoryview(buf).cast("B")
            if mv.nbytes:
                batch.append(mv)
                size += mv.nbytes
            if len(batch) >= iov_max or size >= batch_bytes:
                batches.put(batch)
                total += size
                batch, size = [], 0
        if batch and not failure:
            batches.put(batch)
            total += size
    finally:
        batches.put(None)
        writer.join()
    if failure:
        raise failure[0]
    return total


def _writev(fd: int, batch: list) -> int:
    written = 0
    while batch:
        n = os.writev(fd, batch)
        written += n
        while batch and n >= batch[0].nbytes:
            n -= batch[0].nbytes
            batch.pop(0)
        if batch and n:
            batch[0] = batch[0][n:]
    return written


def atomic_write(path, buffers, *, fsync: bool = False) -> int:
    """writev ``buffers`` to a temporary file next to ``path``, then rename it over ``path``.

    ``path`` holds either its old content or all of the new bytes, never a mix; with
    ``fsync=True`` the file and its directory entry are durable before this returns.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o644)
    try:
        try:
            size = write_all(fd, buffers)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if fsync:
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return size


def save(path, cache: KVCache, *, fsync: bool = False, **opts) -> int:
    """Write ``cache`` to ``path`` in file form, atomically (``atomic_write``); returns the size."""
    return atomic_write(path, iter_buffers(cache, form="file", **opts), fsync=fsync)
