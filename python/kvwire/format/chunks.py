"""The chunk grid: which chunks a header implies, and checking a record table against it.

A layer's token range is cut at multiples of ``chunk_tokens`` counted from cache token 0
(spec KVW-CHUNK-2), so every (layer, component, cell) has at most one chunk and the
expected set is known from the header alone. Record checks are vectorized over the
structured view of the records (an index of a million chunks is checked in numpy, not
in a Python loop), except the offset chain, which is inherently sequential.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import numpy as np

from . import limits as L
from . import registry as R
from .codec_specs import FEATURE_BIT as CODEC_SPECS_BIT
from .codec_specs import check_spec_refs
from .container import FRAME_SIZE, PREAMBLE_SIZE
from .errors import CodecError, FeatureError, LayoutError, LimitError
from .header import Header
from .sparse import SparseTable, check_sparse_records, planned_sparse_chunks
from .state import STATE, STATE_CODECS, state_rows, state_tables

NCOMP = len(R.COMPONENTS)


def grid(start: int, count: int, chunk_tokens: int) -> Iterator[tuple[int, int]]:
    """(token_start, token_count) of each chunk of the token range [start, start+count)."""
    t, stop = start, start + count
    while t < stop:
        end = min((t // chunk_tokens + 1) * chunk_tokens, stop)
        yield t, end - t
        t = end


def on_grid(t0: int, n: int, chunk_tokens: int, lo: int, hi: int) -> bool:
    """Is [t0, t0+n) exactly one grid cell of the layer token range [lo, hi)? (KVW-CHUNK-2)"""
    t1, C = t0 + n, chunk_tokens
    return (n >= 1 and lo <= t0 and t1 <= hi and (t0 == lo or t0 % C == 0) and (t1 == hi or t1 % C == 0)
            and t0 // C == (t1 - 1) // C)


class PlannedChunk(NamedTuple):
    """One chunk a header implies. ``head`` is the record's ``head_start`` where it names
    something: the kv head of a sparse chunk (KVW-SPARSE-7), the tensor index of a state
    chunk (KVW-STATE-7); 0 otherwise."""

    layer: int
    component: str
    token_start: int
    token_count: int
    head: int = 0


def chunk_plan(h: Header) -> Iterator[PlannedChunk]:
    """Every chunk of a container with header ``h``, in canonical order (KVW-CHUNK-9,
    KVW-STATE-7, KVW-SPARSE-7): layer-major; a layer's components in order, each on its
    token grid; a state layer's tensors in declaration order; a sparse layer's (component,
    head, cell). One plan serves dense, state and sparse caches alike."""
    if h.sparse is not None:
        for layer, comp, t0, n, head in planned_sparse_chunks(h):
            yield PlannedChunk(layer, comp, t0, n, head)
        return
    # strict=False: a plan may be drawn for a header not yet checked (KVW-HDR-13 checks the lengths)
    for layer, (spec, r) in enumerate(zip(h.arch.layers, h.layer_tokens, strict=False)):
        if spec.kind == "state":  # one chunk per state tensor, spanning the whole cache (none for 0 tokens)
            for index in range(len(spec.state_tensors) if h.token_count else 0):
                yield PlannedChunk(layer, "state", 0, h.token_count, index)
            continue
        for comp in spec.components:
            for t0, n in grid(r.start, r.count, h.chunk_tokens):
                yield PlannedChunk(layer, comp, t0, n)


def planned_chunks(h: Header) -> Iterator[tuple[int, str, int, int]]:
    """(layer, component, token_start, token_count) of every token-grid chunk of a dense
    header (K, V, latent), layer-major: what an engine gathers from its buffers."""
    for c in chunk_plan(h):
        if c.component != "state":
            yield c[:4]


@dataclass(frozen=True)
class ChunkTable:
    """Per (layer, component) geometry arrays derived from the header, for vectorized checks."""

    heads: np.ndarray  # [L, NCOMP], 0 where the component is not stored
    dims: np.ndarray  # [L, NCOMP]
    start: np.ndarray  # [L]
    stop: np.ndarray  # [L]
    base: np.ndarray  # [L, NCOMP] slot of the component's first chunk
    counts: np.ndarray  # [L, NCOMP] chunks of the component
    total: int  # chunks the header implies
    state: tuple[np.ndarray, np.ndarray] | None = None  # state.state_tables(h): state tensor counts and sizes (spec/crossmodel.md)

    @classmethod
    def of(cls, h: Header) -> ChunkTable | SparseTable:
        if h.sparse is not None:  # per-(layer, head) grids (spec/sparse.md)
            return SparseTable.of(h)
        n = h.num_layers
        rows: dict[int, list[list[int]]] = {}  # per distinct LayerSpec object
        for spec in h.arch.layers:
            if id(spec) not in rows:
                hd = [[0] * NCOMP, [0] * NCOMP]
                for comp in spec.components:
                    c = R.COMPONENTS[comp]
                    hd[0][c], _, hd[1][c] = spec.shape(comp, 1)
                rows[id(spec)] = hd
        per_layer = np.array([rows[id(spec)] for spec in h.arch.layers], np.int64).reshape(n, 2, NCOMP)
        heads, dims = per_layer[:, 0], per_layer[:, 1]
        start = np.array([r.start for r in h.layer_tokens], np.int64)
        stop = np.array([r.stop for r in h.layer_tokens], np.int64)
        C = h.chunk_tokens
        cells = np.where(stop > start, (stop - 1) // C - start // C + 1, 0)
        counts = np.where(heads > 0, cells[:, None], 0)
        state = state_tables(h)
        if state is not None:  # a state layer has one chunk per state tensor (KVW-STATE-7)
            counts[:, STATE] = np.where(cells > 0, state[0], 0)
        flat = counts.reshape(-1)
        base = (np.cumsum(flat) - flat).reshape(n, NCOMP)
        return cls(heads, dims, start, stop, base, counts, int(flat.sum()), state)

    def slot(self, layer: int, component: int, token_start: int, chunk_tokens: int) -> int:
        return int(self.base[layer, component] + token_start // chunk_tokens - self.start[layer] // chunk_tokens)


def _fail(mask: np.ndarray, exc: Callable[..., Exception], code: str, rule: str, what: str) -> None:
    if mask.any():
        i = int(np.argmax(mask))
        raise exc(code, f"chunk record {i}: {what}", rule=rule)


def check_record_fields(h: Header, table: ChunkTable | SparseTable, rec: np.ndarray) -> np.ndarray:
    """Per-record rules (KVW-CHUNK-1..7); returns each record's slot in the chunk grid."""
    layer = rec["layer"].astype(np.int64)
    comp = rec["component"].astype(np.int64)
    _fail(layer >= h.num_layers, LayoutError, "LAYER_OUT_OF_RANGE", "KVW-CHUNK-1", "layer index out of range")
    features = h.required_features
    _fail(~R.enabled_codes("component", features)[comp], LayoutError, "ENUM_OUT_OF_RANGE", "KVW-CHUNK-1",
          "component code not in the registry (or its feature bit is not set, KVW-EVOL-9)")
    # one flat index for the [L, NCOMP] tables (layer and component are in range now): a 1-D
    # take is several times cheaper than 2-D fancy indexing over 2^20 records
    cell = layer * NCOMP + comp
    heads = table.heads.reshape(-1).take(cell)
    _fail(heads == 0, LayoutError, "COMPONENT_INVALID", "KVW-CHUNK-1", "component not stored by this layer's kind")
    specs_on = bool(features & CODEC_SPECS_BIT)  # reserved0 is codec_spec (spec/codecs.md, KVW-CSPEC-9)
    reserved = rec["reserved1"] != 0
    if not specs_on:
        reserved |= rec["reserved0"] != 0
    _fail(reserved, LayoutError, "RESERVED_NONZERO", "KVW-CHUNK-7", "reserved field is not zero")
    flags_unknown = rec["flags"].astype(np.int64) & (R.CHUNK_FLAGS_REQUIRED_MASK & ~R.KNOWN_REQUIRED_CHUNK_FLAGS)
    _fail(flags_unknown != 0, FeatureError, "UNSUPPORTED_FEATURE", "KVW-EVOL-4", "unknown required flag bit")
    _fail(~R.enabled_codes("codec", features)[rec["codec"]], CodecError, "UNKNOWN_CODEC", "KVW-CHUNK-5",
          "codec not in the registry (or its feature bit is not set, KVW-EVOL-9)")
    if specs_on:
        check_spec_refs(h, rec)

    if h.sparse is not None:  # grid, heads and raw_length per (layer, head) (spec/sparse.md)
        slots = check_sparse_records(h, cast(SparseTable, table), rec, layer, comp, _fail)
    else:
        slots = _check_dense_grid(h, cast(ChunkTable, table), rec, layer, comp, cell, heads)
    stored = rec["stored_length"]
    _fail(stored == 0, LayoutError, "LENGTH_MISMATCH", "KVW-CHUNK-4", "stored_length is 0")
    _fail((rec["codec"] == R.CODECS["raw"]) & (stored != rec["raw_length"]), CodecError, "RAW_LENGTH_MISMATCH",
          "KVW-CHUNK-6", "raw codec with stored_length != raw_length")
    return slots


def _check_dense_grid(h: Header, table: ChunkTable, rec: np.ndarray, layer: np.ndarray, comp: np.ndarray,
                      cell: np.ndarray, heads: np.ndarray) -> np.ndarray:
    """KVW-CHUNK-2, KVW-CHUNK-3 and raw_length (KVW-CHUNK-4); returns the slots. ``cell``:
    ``layer * NCOMP + comp``; ``heads``: the component's heads of each record."""
    C: Any = h.chunk_tokens  # an array where state chunks span their layer
    t0 = rec["token_start"].astype(np.int64)
    t1 = t0 + rec["token_count"].astype(np.int64)
    lo, hi = table.start.take(layer), table.stop.take(layer)
    st = state_rows(table.state, rec, layer, comp)
    head_max: Any = 0
    if st is not None:  # a state chunk: one cell spanning the layer, head_start names the tensor (KVW-STATE-7)
        _fail(st.mask & (~np.isin(rec["codec"], STATE_CODECS) | (rec["reserved0"] != 0)), LayoutError,
              "STATE_INVALID", "KVW-STATE-8", "state chunk with a codec other than raw or zstd, or a codec spec")
        C, head_max = np.where(st.mask, np.maximum(hi, 1), C), st.head_max
    bad_grid = (t1 <= t0) | (t0 < lo) | (t1 > hi) | ((t0 != lo) & (t0 % C != 0)) | ((t1 != hi) & (t1 % C != 0)) \
        | (t0 // C != (t1 - 1) // C)
    _fail(bad_grid, LayoutError, "CHUNK_BOUNDARY", "KVW-CHUNK-2",
          "token range is not one cell of the chunk grid within the layer's tokens")
    _fail((rec["head_start"] > head_max) | (rec["head_count"] != heads), LayoutError, "HEAD_RANGE", "KVW-CHUNK-3",
          "head range must cover all heads of the component")
    expected = heads * (t1 - t0) * table.dims.reshape(-1).take(cell) * h.itemsize
    if st is not None:
        expected = np.where(st.mask, st.nbytes, expected)
    _fail(rec["raw_length"].astype(np.int64) != expected, LayoutError, "LENGTH_MISMATCH", "KVW-CHUNK-4",
          "raw_length != heads x tokens x head_dim x dtype size")
    base = table.base.reshape(-1).take(cell)
    if st is not None:
        slots: np.ndarray = base + np.where(st.mask, rec["head_start"], t0 // C - lo // C)
        return slots
    dense: np.ndarray = base + t0 // C - lo // C
    return dense


def check_records(h: Header, table: ChunkTable | SparseTable, rec: np.ndarray) -> np.ndarray:
    """Validate a whole record table; return ``lookup[slot] -> record index`` (KVW-CHUNK-8)."""
    n = len(rec)
    if n > L.MAX_CHUNKS:
        raise LimitError("LIMIT_EXCEEDED", f"{n} chunks exceed {L.MAX_CHUNKS}", rule="KVW-LIM-1")
    slots = check_record_fields(h, table, rec)
    if n != table.total:
        raise LayoutError("CHUNK_MISSING" if n < table.total else "CHUNK_DUPLICATE",
                          f"{n} chunk records, the header implies {table.total}", rule="KVW-CHUNK-8")
    lookup = np.full(n, -1, np.int64)
    lookup[slots] = np.arange(n)
    if (lookup < 0).any():
        raise LayoutError("CHUNK_DUPLICATE", "two records describe the same chunk", rule="KVW-CHUNK-8")
    return lookup


def check_offsets(rec: np.ndarray, header_length: int, alignment: int, size: int) -> int:
    """Body offsets follow the layout chain (KVW-LAYOUT-1); returns the end of the last body.

    Each body must start where ``next_frame_offset`` puts it given the end of the previous
    body, which is one vectorized comparison once every body is known to lie inside the
    container (KVW-LAYOUT-5), so no intermediate sum can overflow.
    """
    end = PREAMBLE_SIZE + header_length
    if not len(rec):
        return end
    off = rec["offset"]
    length = rec["stored_length"]
    outside = (off > size) | (length > np.uint64(size) - np.minimum(off, np.uint64(size)))
    if outside.any():
        i = int(np.argmax(outside))
        raise LayoutError("BODY_OUT_OF_BOUNDS", f"chunk record {i}: body {int(off[i])}+{int(length[i])} "
                          f"outside the container of {size} bytes", rule="KVW-LAYOUT-5")
    off = off.astype(np.int64)
    ends = off + length.astype(np.int64)
    prev_end = np.concatenate(([end], ends[:-1]))
    a = alignment
    want = ((prev_end + FRAME_SIZE + a - 1) & ~(a - 1))  # next_frame_offset(prev_end) + FRAME_SIZE
    bad = off != want
    if bad.any():
        i = int(np.argmax(bad))
        raise LayoutError("BAD_OFFSET", f"chunk record {i}: body offset {int(off[i])}, layout rule gives "
                          f"{int(want[i])} (misaligned, overlapping or leaving a hole)", rule="KVW-LAYOUT-1")
    return int(ends[-1])
