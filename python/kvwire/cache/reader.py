"""Decoding: ``Reader`` over a complete container in memory or mapped from a file.

Opening checks everything that can be checked without touching bodies: preamble,
header, index or frame chain, the record table against the header, the layout chain.
Bodies are checked when they are read: checksum (by default), then the inline frame is
compared with the index record (file form), then the codec. A raw chunk comes back as a
view into the buffer; ``layer()`` and ``load`` assemble whole layers with one copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ..codecs import decode_chunk, native
from ..format import registry as R
from ..format.chunks import ChunkTable, check_offsets, check_records
from ..format.container import (
    CHUNK_MARKER,
    END_MARKER,
    FRAME_SIZE,
    PREAMBLE_SIZE,
    RECORD_DTYPE,
    check_zero,
    has_trailer,
    next_frame_offset,
    parse_end_frame,
    parse_frame,
    parse_index,
    parse_trailer,
    read_header,
    xxh3,
)
from ..format.errors import LayoutError, LimitError, TruncatedError
from ..format.header import Header
from ..format.limits import DEFAULT_MAX_DECODED_BYTES, MAX_CHUNKS
from ..format.state import STATE, state_tensor_of
from .args import BACKENDS, check_choice, check_count, check_device, check_index
from .assemble import body_checksum_error, fill_layer, resolve_threads
from .assemble import run as run_jobs
from .kvcache import KVCache
from .tensors import carve, empty, view, writable

if TYPE_CHECKING:
    from ..format.layermap import LayerSource
    from .sparse import SparseKVCache


def probe(first_bytes: bytes | bytearray | memoryview) -> Header:
    """The header from the first bytes of a container alone.

    Raises ``TruncatedError`` whose ``needed`` says how many bytes (from the start)
    are required when ``first_bytes`` is too short.
    """
    try:
        memoryview(first_bytes)
    except TypeError:
        raise TypeError(f"probe() needs a bytes-like object, not {type(first_bytes).__name__}") from None
    return read_header(first_bytes)[0]


class ChunkInfo(NamedTuple):
    offset: int
    stored_length: int
    raw_length: int
    checksum: int
    layer: int
    component: str
    token_start: int
    token_count: int
    codec: str
    shape: tuple


class Reader:
    """A verified view of one container. Use ``kvwire.open`` to make one."""

    def __init__(self, buffer: Any, *, max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES,
                 known_header: tuple[Header, bytes | bytearray | memoryview] | None = None,
                 _closer: Callable[[], object] | None = None,
                 _guard: Callable[[], object] | None = None):
        """``known_header``: ``(header, first_bytes)`` parsed from another copy of this
        container's first bytes; used when the bytes are the same (``read_header``)."""
        try:
            memoryview(buffer)
        except TypeError:
            raise TypeError(f"Reader needs a bytes-like object (kvwire.open also takes a path), "
                            f"not {type(buffer).__name__}") from None
        max_decoded_bytes = check_count("max_decoded_bytes", max_decoded_bytes)
        self._buf = buffer
        self._guard = _guard  # a mapped file: raises TruncatedError once the file has shrunk (kvwire.open)
        self._readonly = memoryview(buffer).readonly
        self._closer = _closer
        self.size = len(buffer)
        self.header, hlen = read_header(buffer, known_header)
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
        self.slot_records = check_records(self.header, table, self.records)  # record index of each grid slot
        self.grid = table  # the header's chunk grid (format.chunks.ChunkTable or format.sparse.SparseTable)
        last_end = check_offsets(self.records, hlen, self.header.alignment, self.size)
        if next_frame_offset(last_end, self.header.alignment) != end_frame_at:
            raise LayoutError("BAD_OFFSET", f"end frame at {end_frame_at}, layout rule gives "
                              f"{next_frame_offset(last_end, self.header.alignment)}", rule="KVW-LAYOUT-1")
        marker, body = parse_frame(buffer, end_frame_at)
        if marker != END_MARKER:
            raise LayoutError("MISSING_END", f"no end frame at {end_frame_at}", rule="KVW-LAYOUT-3")
        count, digest = parse_end_frame(body)
        if count != len(self.records) or digest != xxh3(np.ascontiguousarray(self.records)):
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
        self._infos: list[ChunkInfo] | None = None

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

    @property
    def buffer(self) -> Any:
        """The container's bytes: the mapped file, or the buffer given to ``open``."""
        return self._buf

    def num_chunks(self, layer: int, component: str) -> int:
        """How many chunks (layer, component) has; 0 when the layer does not store it."""
        layer = check_index("layer", layer, self.header.num_layers)
        if component not in R.COMPONENTS:
            raise ValueError(f"component must be one of {', '.join(map(repr, R.COMPONENTS))}, not {component!r}")
        return int(self.grid.counts[layer, R.COMPONENTS[component]])

    # -- record-level access (the package's own layers and engine connectors use these) --

    def record_index(self, layer: int, component: str, index: int) -> int:
        """Index in ``records`` of the ``index``-th chunk of (layer, component), in token order."""
        n = self.num_chunks(layer, component)
        if not (isinstance(index, int) and 0 <= index < n):
            if n == 0:
                raise ValueError(f"layer {layer} stores no {component!r} chunks")
            index = check_index(f"chunk index of layer {layer} {component!r}", index, n)
        return int(self.slot_records[self.grid.base[layer, R.COMPONENTS[component]] + index])

    def record(self, layer: int, component: str, index: int = 0) -> np.void:
        """The chunk record of the ``index``-th chunk of (layer, component), in token order."""
        return self.records[self.record_index(layer, component, index)]

    def chunk(self, layer: int, component: str = "k", index: int = 0, *, verify: bool = True,
              backend: str = "numpy") -> Any:
        """Chunk tensor [heads, tokens, head_dim]; a view into the buffer for raw chunks."""
        check_choice("backend", backend, BACKENDS)
        return self.decode(self.record_index(layer, component, index), verify, backend)

    def iter_chunks(self, *, verify: bool = True, backend: str = "numpy") -> Iterator[tuple[int, str, int, Any]]:
        """(layer, component, token_start, tensor) in container order."""
        check_choice("backend", backend, BACKENDS)
        for i in range(len(self.records)):
            c = self.info(i)
            yield c.layer, c.component, c.token_start, self.decode(i, verify, backend)

    def info(self, i: int) -> ChunkInfo:
        """Record ``i`` as plain Python values (built for all records on first use: numpy
        scalar access per field would cost more than a small chunk's copy)."""
        if not (isinstance(i, int) and 0 <= i < len(self.records)):
            i = check_index("record", i, len(self.records))
        if self._infos is None:
            r, layers = self.records, self.header.arch.layers
            cols = [r[f].tolist() for f in ("offset", "stored_length", "raw_length", "checksum", "layer",
                                            "component", "token_start", "token_count", "codec", "head_count")]
            self._infos = [  # shape [head_count, tokens, dim]: all heads, or one in a sparse container
                ChunkInfo(off, sl, rl, cs, ly, R.COMPONENT_BY_CODE[cp], ts, tc, R.CODEC_BY_CODE[cd],
                          (hc, tc, layers[ly].shape(R.COMPONENT_BY_CODE[cp], tc)[2]))
                for off, sl, rl, cs, ly, cp, ts, tc, cd, hc in zip(*cols)]
        return self._infos[i]

    def stored(self, i: int, verify: bool = True) -> tuple[ChunkInfo, memoryview]:
        """(ChunkInfo, stored bytes) of record ``i``: a view of the container, its frame checked
        against the index once (file form) and its checksum verified unless ``verify=False``."""
        if self._guard is not None:
            self._guard()
        return self.stored_at(i, self._buf, 0, verify)

    def stored_at(self, i: int, window: Any, base: int, verify: bool = True) -> tuple[ChunkInfo, memoryview]:
        """``stored(i)`` over ``window``, a buffer holding the container's bytes from offset
        ``base`` on (a layer's frames read on their own, ``kvwire.store.LayerwiseLoad``): the
        same frame and checksum checks, the body a view of ``window``. A window that does
        not hold the record's frame and body is a ValueError (the caller's range is wrong)."""
        c = self.info(i)
        at = c.offset - base
        win = memoryview(window).cast("B")
        if base < 0 or at - FRAME_SIZE < 0 or at + c.stored_length > len(win):
            raise ValueError(f"window [{base}, {base + len(win)}) does not hold chunk {i}'s frame and body "
                             f"[{c.offset - FRAME_SIZE}, {c.offset + c.stored_length})")
        stored = win[at : at + c.stored_length]
        if self._frame_checked is not None and not self._frame_checked[i]:
            marker, body = parse_frame(win, at - FRAME_SIZE)
            if marker != CHUNK_MARKER or body != self.records[i : i + 1].tobytes():
                raise LayoutError("INDEX_MISMATCH", f"frame before body {i} disagrees with the index record",
                                  rule="KVW-FILE-4")
            self._frame_checked[i] = True
        if verify and xxh3(stored) != c.checksum:
            raise body_checksum_error(i, c.layer)
        return c, stored

    def decode(self, i: int, verify: bool = True, backend: str = "numpy", scratch: bool = False) -> Any:
        """Chunk ``i`` as a tensor; ``scratch``: a decoded body may live in a buffer the next
        call reuses (for callers that copy it at once: no fresh allocation per chunk)."""
        if self.header.sparse is not None and self.info(i).component == "positions":
            from .sparse import read_positions  # int64 [tokens], checked (spec/sparse.md)

            return read_positions(self, i, verify)
        c, stored = self.stored(i, verify)
        dtype, shape = self.header.dtype, c.shape
        if c.component == "state":  # a named state tensor in its own shape and dtype (spec/crossmodel.md)
            dtype, shape = state_tensor_of(self.header, c.layer, int(self.records["head_start"][i]))
        if c.codec == "raw":
            if backend == "torch" and self._readonly:
                # torch has no read-only tensors: a view of bytes would let callers write into them
                return view(bytearray(stored), 0, dtype, shape, backend)
            return view(self._buf, c.offset, dtype, shape, backend)
        out: memoryview | np.ndarray | None = None
        if scratch and backend == "numpy":
            if len(getattr(self, "_scratch", b"")) < c.raw_length:
                self._scratch = bytearray(c.raw_length)
            out = memoryview(self._scratch)[: c.raw_length]
        elif backend == "torch":  # decoded straight into fresh writable memory: no second copy for torch
            out = np.empty(c.raw_length, np.uint8)
        data = self.decode_stored(i, c, stored, out)
        return view(writable(data) if backend == "torch" else data, 0, dtype, shape, backend)

    def decode_stored(self, i: int, c: ChunkInfo, stored: memoryview, out: Any = None) -> Any:
        """Raw bytes of record ``i``'s stored body (or into ``out``), through its codec spec
        when the record names one (``reserved0``, spec/codecs.md)."""
        spec = int(self.records["reserved0"][i]) if self.header.codec_specs else 0
        head = int(self.records["head_start"][i]) if self.header.sparse is not None else 0  # its own token space
        return decode_chunk(self.header, c.codec, spec, stored, c.raw_length, c.shape, c.layer, c.token_start, out,
                            head)

    # -- whole layers ------------------------------------------------------------------

    def layer(self, layer: int, *, verify: bool = True, backend: str = "numpy", device: Any = None,
              out: dict | None = None, threads: int | None = None) -> dict:
        """{component: tensor [heads, layer tokens, head_dim]}, assembled with one copy.

        ``out`` supplies the destination tensors (e.g. an engine's preallocated buffers);
        otherwise they are allocated. ``threads``: chunks assembled on that many threads
        when native decoding is on (None: one per CPU; see ``kvwire.cache.assemble``).
        """
        if self.header.sparse is not None:
            raise ValueError("a sparse container has per-head token subsets: use sparse_layer() or load()")
        layer = check_index("layer", layer, self.header.num_layers)
        check_choice("backend", backend, BACKENDS)
        check_device(device)
        threads = resolve_threads(threads)
        spec, r = self.header.arch.layers[layer], self.header.layer_tokens[layer]
        if spec.kind == "state":  # {"state": {name: tensor}} (spec/crossmodel.md)
            return self._state_layer(layer, verify, backend)
        if out is None:
            out = {comp: empty(spec.shape(comp, r.count), self.header.dtype, backend, device)
                   for comp in spec.components}
        for comp in spec.components:
            if tuple(out[comp].shape) != spec.shape(comp, r.count):
                raise ValueError(f"out[{comp!r}] has shape {tuple(out[comp].shape)}, layer {layer} needs "
                                 f"{spec.shape(comp, r.count)}")
        jobs: list | None = [] if native.takes(self.header) else None
        fill_layer(self, layer, out, verify, jobs)
        run_jobs(self, jobs, verify, threads)
        return out

    def _state_layer(self, layer: int, verify: bool, backend: str) -> dict:
        """{"state": {name: tensor}} of a state layer; an empty dict for a cache of 0 tokens."""
        out = {}
        if self.header.token_count:
            for index, t in enumerate(self.header.arch.layers[layer].state_tensors):
                i = int(self.slot_records[self.grid.base[layer, STATE] + index])
                x = self.decode(i, verify, backend)
                if self.info(i).codec == "raw":  # a view of the container: layer()/load() own their memory
                    x = x.copy() if backend == "numpy" else x.clone()
                out[t.name] = x
        return {"state": out}

    def layer_for(self, receiver_layer: int) -> LayerSource:
        """Where a receiver layer's cache comes from under the header's layer map: a
        ``kvwire.format.layermap.LayerSource`` (op, transmitted_layer, owner) (KVW-MAP-6)."""
        from ..format.layermap import layer_for

        return layer_for(self.header, receiver_layer)

    def load_mapped(self, receiver_layers: int, *, verify: bool = True, backend: str = "numpy",
                    device: Any = None) -> list:
        """The layer map applied (KVW-MAP-6): for receiver layers ``0..receiver_layers-1``,
        the ``{component: tensor}`` each one uses, or None where it recomputes or drops.

        A ``copy`` gets a buffer of its own; an ``alias`` gets the very tensors of its owner
        (or of the one buffer shared by the aliases of an unowned transmitted layer), so a
        layer sent once is decoded once and held once however many receivers use it.
        """
        receiver_layers = check_count("receiver_layers", receiver_layers)
        check_choice("backend", backend, BACKENDS)
        out: list = []
        shared: dict[int, dict] = {}  # transmitted layer -> the tensors of its unowned aliases
        for r in range(receiver_layers):
            src = self.layer_for(r)
            if src.op == "copy":
                out.append(self.layer(src.transmitted_layer, verify=verify, backend=backend, device=device))
            elif src.op == "alias" and src.owner >= 0:
                out.append(out[src.owner])  # the owner is a lower receiver layer (KVW-MAP-4)
            elif src.op == "alias":
                if src.transmitted_layer not in shared:
                    shared[src.transmitted_layer] = self.layer(src.transmitted_layer, verify=verify,
                                                               backend=backend, device=device)
                out.append(shared[src.transmitted_layer])
            else:
                out.append(None)
        return out

    def sparse_layer(self, layer: int, *, verify: bool = True, backend: str = "numpy",
                     device: Any = None) -> list:
        """Sparse containers: per kv head of ``layer``, ``{"positions", "k", "v"}`` (spec/sparse.md)."""
        from .sparse import read_sparse_layer

        if self.header.sparse is None:
            raise ValueError("not a sparse container: use layer()")
        layer = check_index("layer", layer, self.header.num_layers)
        check_choice("backend", backend, BACKENDS)
        return read_sparse_layer(self, layer, verify=verify, backend=backend, device=device)

    def load(self, *, verify: bool = True, backend: str = "numpy", device: Any = None,
             threads: int | None = None) -> KVCache | SparseKVCache:
        """The whole cache in memory of its own (one allocation, carved into per-layer tensors);
        a ``SparseKVCache`` for a sparse container. ``threads`` as for ``layer``."""
        check_choice("backend", backend, BACKENDS)
        check_device(device)
        threads = resolve_threads(threads)
        if self.header.sparse is not None:
            from .sparse import read_sparse

            return read_sparse(self, verify=verify, backend=backend, device=device)
        if device is not None and str(device).startswith("cuda"):
            from .device_load import load_to_device

            return load_to_device(self, device, verify=verify)
        h = self.header
        shapes = [{c: s.shape(c, r.count) for c in s.components if c != "state"}
                  for s, r in zip(h.arch.layers, h.layer_tokens)]
        slabs = carve([shape for layer in shapes for shape in layer.values()], h.dtype, backend, device)
        it = iter(slabs)
        outs = [{c: next(it) for c in shapes[i]} for i in range(h.num_layers)]
        jobs: list | None = [] if native.takes(h) else None  # every layer's chunks in one batch: no barrier per layer
        for i, spec in enumerate(h.arch.layers):
            if spec.kind == "state":
                outs[i] = self._state_layer(i, verify, backend)
            else:
                fill_layer(self, i, outs[i], verify, jobs)
        run_jobs(self, jobs, verify, threads)
        return KVCache(h, outs)

    # -- full validation ---------------------------------------------------------------

    def validate(self) -> None:
        """Check every byte: frames, padding, checksums, and decode every body."""
        buf, a = self._buf, self.header.alignment
        end = PREAMBLE_SIZE + self._header_length
        for i in range(len(self.records)):
            c, stored = self.stored(i, True)  # file form: also compares the frame with the index
            check_zero(buf, end, c.offset - FRAME_SIZE)
            if c.codec != "raw":
                self.decode_stored(i, c, stored)
            end = c.offset + c.stored_length
        check_zero(buf, end, next_frame_offset(end, a))
        if self.header.sparse is not None:  # positions: encoding and order across cells (spec/sparse.md)
            from .sparse import check_positions

            check_positions(self)

    # -- lifetime ----------------------------------------------------------------------

    def close(self) -> None:
        if self._closer is not None:
            self._closer()
            self._closer = None

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        h = self.header
        return (f"<kvwire.Reader {self.form} form, {h.num_layers} layers, {h.token_count} tokens, {h.dtype}, "
                f"{self.chunk_count} chunks, {self.size} bytes>")
