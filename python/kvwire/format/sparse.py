"""Sparse caches in the header and the chunk grid (spec/sparse.md, KVW-SPARSE-*).

A sparse (evicted) cache keeps, per (layer, kv head), its own sorted subset of token
positions. Everything a scheduler needs (how many tokens each head retains, where
generation continues) lives in ``Header.sparse``; the bodies carry the positions and the
K/V rows. Each (layer, head) has its own token index space ``[0, retained_count)`` cut
on the usual grid of ``chunk_tokens``, and every chunk holds exactly one head, so the
set of chunks still follows from the header alone (KVW-CHUNK-8).

This module is imported by ``header.py``; it must not import ``header`` itself.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

import flatbuffers
import numpy as np

from . import limits as L
from . import registry as R
from .errors import CodecError, FormatError, LayoutError, SchemaError
from .flatbuf import Table

SPARSE_BIT = R.REQUIRED_FEATURES["sparse"]
SPARSE_KINDS = ("full_attention", "sliding_attention", "chunked_attention", "mla_latent", "shared")
POSITIONS = R.COMPONENTS["positions"]
POSITIONS_CODECS = (R.CODECS["raw"], R.CODECS["zstd"])
MAX_VARINT_BYTES = 9  # a value below 2^63 needs at most 9 groups of 7 bits
MAX_RETAINED_ENTRIES = L.MAX_LAYERS * L.MAX_HEADS
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class SparseInfo:
    """``Header.sparse`` (schema table SparseInfo, spec/sparse.md section 3).

    ``retained_counts[offset(layer) + head]`` is how many tokens that kv head keeps,
    layer-major over the heads of every non-shared layer (one head for ``mla_latent``).
    ``next_position`` is the position the next token the model processes gets.
    ``method``, ``sink_tokens`` and ``window_tokens`` describe how the subset was chosen.
    """

    next_position: int
    retained_counts: tuple[int, ...]
    method: str = ""
    sink_tokens: int = 0
    window_tokens: int = 0


def layer_heads(spec: Any) -> int:
    """Heads that retain positions in one layer: kv heads, 1 for MLA, 0 for shared."""
    if spec.kind == "shared":
        return 0
    heads: int = 1 if spec.kind == "mla_latent" else spec.num_kv_heads
    return heads


def head_offsets(arch: Any) -> np.ndarray:
    """offsets[l] = index of (layer l, head 0) in ``retained_counts``; offsets[L] = entries."""
    heads = np.array([layer_heads(s) for s in arch.layers], np.int64)
    return np.concatenate(([0], np.cumsum(heads)))


def retained_count(h: Any, layer: int, head: int) -> int:
    """count(layer, head): how many tokens one (layer, kv head) retains (KVW-SPARSE-3)."""
    return int(h.sparse.retained_counts[sum(layer_heads(s) for s in h.arch.layers[:layer]) + head])


def planned_sparse_chunks(h: Any) -> Iterator[tuple[int, str, int, int, int]]:
    """(layer, component, token_start, token_count, head) of every chunk of a sparse
    header, in slot order (KVW-SPARSE-7): layer, component code, head, cell."""
    counts, C = iter(h.sparse.retained_counts), h.chunk_tokens
    for layer, spec in enumerate(h.arch.layers):
        n = [next(counts) for _ in range(layer_heads(spec))]
        for comp in sparse_components(spec):
            for hd, count in enumerate(n):
                for t0 in range(0, count, C):
                    yield layer, comp, t0, min(C, count - t0), hd


def _fail(rule: str, msg: str, code: str = "SPARSE_INVALID", exc: type[FormatError] = SchemaError) -> NoReturn:
    raise exc(code, msg, rule=rule)


def check_sparse(h: Any) -> None:
    """Header rules of sparse containers (KVW-SPARSE-1..5); a no-op for dense ones."""
    s = h.sparse
    bit = bool(h.required_features & SPARSE_BIT)
    if (s is not None) != bit:
        _fail("KVW-SPARSE-1", "Header.sparse is present iff required feature bit 'sparse' (1) is set: "
              f"sparse {'present' if s is not None else 'absent'}, bit {'set' if bit else 'clear'}")
    if s is None:
        return
    for i, spec in enumerate(h.arch.layers):
        if spec.kind not in SPARSE_KINDS:
            _fail("KVW-SPARSE-2", f"layer {i} of kind {spec.kind!r} cannot be sparse")
    off = head_offsets(h.arch)
    counts = s.retained_counts
    if len(counts) != off[-1]:
        _fail("KVW-SPARSE-3", f"retained_counts has {len(counts)} entries, the layers have {int(off[-1])} kv heads")
    top = max(counts, default=0)
    if h.token_count != top:
        _fail("KVW-SPARSE-4", f"token_count {h.token_count} != largest retained count {top}")
    default = tuple((0, 0) if spec.kind == "shared" else (0, h.token_count) for spec in h.arch.layers)
    if tuple((r.start, r.count) for r in h.layer_tokens) != default:
        _fail("KVW-SPARSE-4", "a sparse container has no layer_tokens (each head's range is [0, retained count))")
    if not h.first_position + h.token_count <= s.next_position < 1 << 63:
        _fail("KVW-SPARSE-5", f"next_position {s.next_position} must be in [first_position + token_count, 2^63): "
              f"first_position {h.first_position}, token_count {h.token_count}")


def check_sparse_writable(s: SparseInfo) -> None:
    """What the reader's FlatBuffers checks refuse, refused before it is written."""
    if "\0" in s.method or len(s.method.encode("utf-8")) > L.MAX_STRING_LENGTH:
        raise ValueError(f"sparse method {s.method[:40]!r}: no NUL, at most {L.MAX_STRING_LENGTH} UTF-8 bytes")
    if not (0 <= s.sink_tokens < 1 << 32 and 0 <= s.window_tokens < 1 << 32):
        raise ValueError("sink_tokens and window_tokens are u32")
    if any(not 0 <= c < 1 << 32 for c in s.retained_counts):
        raise ValueError("retained_counts entries are u32")


def build_sparse(b: flatbuffers.Builder, s: SparseInfo) -> int:
    """Serialize ``SparseInfo`` into builder ``b``; returns the table offset."""
    from .fbs import SparseInfo as fb

    check_sparse_writable(s)
    method = b.CreateString(s.method) if s.method else None
    counts = b.CreateNumpyVector(np.asarray(s.retained_counts, dtype="<u4"))
    fb.Start(b)
    if method is not None:
        fb.AddMethod(b, method)
    fb.AddNextPosition(b, s.next_position)
    fb.AddRetainedCounts(b, counts)
    if s.sink_tokens:
        fb.AddSinkTokens(b, s.sink_tokens)
    if s.window_tokens:
        fb.AddWindowTokens(b, s.window_tokens)
    end: int = fb.End(b)
    return end


def read_sparse(t: Table | None) -> SparseInfo | None:
    """Decode a verified ``SparseInfo`` table (``flatbuf.Table``) or None."""
    if t is None:
        return None
    v = t.vector(2, 4, 4, MAX_RETAINED_ENTRIES)
    counts: tuple[int, ...] = ()
    if v is not None:
        start, n = v
        counts = tuple(np.frombuffer(t.buf.data, "<u4", n, start).tolist())
    return SparseInfo(
        next_position=t.scalar(1, _U64, 0),
        retained_counts=counts,
        method=t.string(0, L.MAX_STRING_LENGTH) or "",
        sink_tokens=t.scalar(3, _U32, 0),
        window_tokens=t.scalar(4, _U32, 0),
    )


# ---------------------------------------------------------------------------------------
# The sparse chunk grid (KVW-SPARSE-7, KVW-SPARSE-8)
# ---------------------------------------------------------------------------------------

def sparse_components(spec: Any) -> tuple[str, ...]:
    """Components one layer stores in a sparse container, in canonical (code) order."""
    comps = R.KIND_COMPONENTS[spec.kind]
    return comps + ("positions",) if comps else ()


def head_cells(count: int, chunk_tokens: int) -> int:
    return -(-count // chunk_tokens)


@dataclass(frozen=True)
class SparseTable:
    """The chunk grid of a sparse header, with the attributes of ``chunks.ChunkTable``.

    Slot of a record: ``base[layer, comp] + head_base[offset(layer) + head] + t0 // C``,
    i.e. layer-major, then component code, then head, then cell (KVW-SPARSE-7).
    ``counts[layer, comp]`` is the chunks of (layer, comp) over all its heads.
    """

    heads: np.ndarray  # [L, NCOMP] heads of each stored component (POSITIONS included), 0 if not stored
    dims: np.ndarray  # [L, NCOMP] row width in elements (0 for POSITIONS)
    start: np.ndarray  # [L] zeros
    stop: np.ndarray  # [L] token_count (largest retained count)
    base: np.ndarray  # [L, NCOMP]
    counts: np.ndarray  # [L, NCOMP]
    total: int
    offsets: np.ndarray  # [L + 1] head offsets into retained_counts
    retained: np.ndarray  # [entries] retained count per (layer, head)
    head_base: np.ndarray  # [entries] first cell of each head within its (layer, comp)

    @classmethod
    def of(cls, h: Any) -> SparseTable:
        ncomp = len(R.COMPONENTS)
        n, C = h.num_layers, h.chunk_tokens
        heads = np.zeros((n, ncomp), np.int64)
        dims = np.zeros((n, ncomp), np.int64)
        for i, spec in enumerate(h.arch.layers):
            for comp in sparse_components(spec):
                c = R.COMPONENTS[comp]
                heads[i, c] = layer_heads(spec)
                dims[i, c] = 0 if comp == "positions" else spec.shape(comp, 1)[2]
        offsets = head_offsets(h.arch)
        retained = np.array(h.sparse.retained_counts, np.int64)
        cells = -(-retained // C)
        csum = np.concatenate(([0], np.cumsum(cells)))
        head_base = csum[:-1] - csum[offsets[:-1]].repeat(np.diff(offsets))
        layer_cells = csum[offsets[1:]] - csum[offsets[:-1]]
        counts = np.where(heads > 0, layer_cells[:, None], 0)
        flat = counts.reshape(-1)
        base = (np.cumsum(flat) - flat).reshape(n, ncomp)
        return cls(heads, dims, np.zeros(n, np.int64), np.full(n, h.token_count, np.int64), base, counts,
                   int(flat.sum()), offsets, retained, head_base)

    def slot(self, layer: int, component: int, head: int, token_start: int, chunk_tokens: int) -> int:
        return int(self.base[layer, component] + self.head_base[self.offsets[layer] + head]
                   + token_start // chunk_tokens)

    def head_chunks(self, layer: int, head: int, chunk_tokens: int) -> list[tuple[int, int]]:
        """(token_start, token_count) of the cells of one (layer, head)."""
        count = int(self.retained[self.offsets[layer] + head])
        return [(t, min(chunk_tokens, count - t)) for t in range(0, count, chunk_tokens)]


def check_sparse_records(h: Any, table: SparseTable, rec: np.ndarray, layer: np.ndarray, comp: np.ndarray,
                         fail: Callable[..., None]) -> np.ndarray:
    """Grid, head range and raw_length of sparse records (KVW-SPARSE-7..9).

    Called by ``chunks.check_record_fields`` after the rules common to every container;
    returns each record's slot. ``fail(mask, exc, code, rule, what)`` reports the first
    failing record.
    """
    C = h.chunk_tokens
    fail((comp == POSITIONS) & (~np.isin(rec["codec"], POSITIONS_CODECS) | (rec["reserved0"] != 0)), CodecError,
         "POSITIONS_CODEC", "KVW-SPARSE-9", "POSITIONS chunk with a codec other than raw or zstd, or a codec spec")
    heads = table.heads[layer, comp]
    head = rec["head_start"].astype(np.int64)
    bad_head = (head >= heads) | (rec["head_count"] != 1)
    fail(bad_head, LayoutError, "HEAD_RANGE", "KVW-SPARSE-7", "a sparse chunk holds exactly one head: head_start "
         "< heads, head_count 1")
    entry = table.offsets[layer] + head
    count = table.retained[entry]
    t0 = rec["token_start"].astype(np.int64)
    n = rec["token_count"].astype(np.int64)
    t1 = t0 + n
    fail((n < 1) | (t1 > count) | (t0 % C != 0) | ((t1 != count) & (t1 % C != 0)), LayoutError, "CHUNK_BOUNDARY",
         "KVW-SPARSE-7", "token range is not one cell of the head's grid [0, retained count)")
    raw = rec["raw_length"].astype(np.int64)
    is_pos = comp == POSITIONS
    expected = n * table.dims[layer, comp] * h.itemsize
    fail(np.where(is_pos, (raw < n) | (raw > MAX_VARINT_BYTES * n), raw != expected), LayoutError,
         "LENGTH_MISMATCH", "KVW-SPARSE-8", "raw_length disagrees with the chunk (tokens x head_dim x dtype size; "
         "POSITIONS: between tokens and 9 x tokens bytes)")
    slots: np.ndarray = table.base[layer, comp] + table.head_base[entry] + t0 // C
    return slots


# ---------------------------------------------------------------------------------------
# POSITIONS bodies (KVW-SPARSE-10, KVW-SPARSE-11)
# ---------------------------------------------------------------------------------------

_SHIFTS = np.arange(MAX_VARINT_BYTES, dtype=np.uint64) * np.uint64(7)


def encode_positions(positions: np.ndarray, first_position: int) -> bytes:
    """Raw POSITIONS body of one cell: v0 = p0 - first_position, vj = pj - p(j-1) - 1, as
    minimal unsigned LEB128 varints (7 bits per byte, least significant group first)."""
    p = np.asarray(positions, np.int64)
    if p.ndim != 1 or not len(p):
        raise ValueError("a POSITIONS cell holds a non-empty 1-D array of positions")
    if p[0] < first_position or (np.diff(p) <= 0).any():
        raise ValueError("positions must be strictly increasing and at least first_position")
    v = np.empty(len(p), np.uint64)
    v[0] = p[0] - first_position
    v[1:] = np.diff(p) - 1
    groups = (v[:, None] >> _SHIFTS[None, :]) & np.uint64(0x7F)
    nbytes = np.maximum(1, MAX_VARINT_BYTES - np.argmax((groups[:, ::-1] != 0), axis=1))
    nbytes = np.where((groups != 0).any(axis=1), nbytes, 1)
    k = np.arange(MAX_VARINT_BYTES)[None, :]
    cont = (k < (nbytes[:, None] - 1)).astype(np.uint64) << np.uint64(7)
    out = (groups | cont).astype(np.uint8)
    body: bytes = out[k < nbytes[:, None]].tobytes()
    return body


def decode_positions(raw: Any, count: int, first_position: int, next_position: int) -> np.ndarray:
    """Absolute positions (int64 [count]) of one POSITIONS body, every byte checked."""
    b = np.frombuffer(raw, np.uint8)
    ends = np.flatnonzero(b < 0x80)
    if len(ends) != count or (len(b) and b[-1] >= 0x80):
        raise CodecError("POSITIONS_ENCODING", f"POSITIONS body of {len(b)} bytes holds {len(ends)} complete "
                         f"varints (and must end with one), the record says {count}", rule="KVW-SPARSE-10")
    if len(b) == count:  # every varint is one byte (runs of nearby positions): nothing to group
        v = b.astype(np.uint64)
    else:
        starts = np.concatenate(([0], ends[:-1] + 1))
        lengths = ends - starts + 1
        if (lengths > MAX_VARINT_BYTES).any() or ((lengths > 1) & (b[ends] == 0)).any():
            raise CodecError("POSITIONS_ENCODING", "a varint is longer than 9 bytes or not minimal (ends with a "
                             "zero group)", rule="KVW-SPARSE-10")
        shift = (np.arange(len(b)) - np.repeat(starts, lengths)).astype(np.uint64) * np.uint64(7)
        v = np.add.reduceat((b & 0x7F).astype(np.uint64) << shift, starts)
    span = next_position - first_position
    step = v + np.uint64(1)
    step[0] = v[0]
    with np.errstate(over="ignore"):
        rel = np.cumsum(step, dtype=np.uint64)
    # every step is below 2^63, so a wrap shows as a decrease; positions must stay below next_position
    if (v >= np.uint64(span)).any() or (count > 1 and (rel[1:] <= rel[:-1]).any()) or rel[-1] >= np.uint64(span):
        raise LayoutError("POSITIONS_ORDER", f"positions leave [first_position, next_position) = "
                          f"[{first_position}, {next_position})", rule="KVW-SPARSE-11")
    positions: np.ndarray = rel.astype(np.int64) + np.int64(first_position)
    return positions


class PositionOrder:
    """Checks that the cells of each (layer, head) continue each other's positions
    (KVW-SPARSE-11) whatever order the cells arrive in: each cell is compared with its
    neighbours on arrival, so no whole head is ever held."""

    def __init__(self, chunk_tokens: int):
        self._C = chunk_tokens
        self._cells: dict[tuple[int, int, int], tuple[int, int]] = {}

    def add(self, layer: int, head: int, token_start: int, positions: np.ndarray) -> None:
        cell = token_start // self._C
        first, last = int(positions[0]), int(positions[-1])
        prev = self._cells.get((layer, head, cell - 1))
        nxt = self._cells.get((layer, head, cell + 1))
        if (prev is not None and prev[1] >= first) or (nxt is not None and last >= nxt[0]):
            raise LayoutError("POSITIONS_ORDER", f"layer {layer} head {head}: positions of cell {cell} do not "
                              "increase strictly from the previous cell to the next", rule="KVW-SPARSE-11")
        self._cells[layer, head, cell] = (first, last)
