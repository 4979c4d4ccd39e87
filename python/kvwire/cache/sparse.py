"""Sparse (evicted) caches: ``SparseKVCache`` and its encoding (spec/sparse.md).

Eviction methods (StreamingLLM sinks + window, H2O, SnapKV, PyramidKV, AdaKV, DMS) keep a
different subset of tokens per layer and often per kv head. A ``SparseKVCache`` holds,
for every (layer, kv head), the sorted absolute positions it retained and the K/V rows
of exactly those tokens. On the wire each (layer, head) is its own token index space
``[0, retained)`` chunked on the usual grid, with a POSITIONS chunk per cell whose body
is delta + LEB128 varints (KVW-SPARSE-10): a run of consecutive positions costs one byte
per token before zstd, and nothing after it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..codecs import decode_body
from ..codecs.zstd import checksum_required
from ..format import registry as R
from ..format.chunks import PlannedChunk, chunk_plan
from ..format.header import Header, check_header, default_layer_tokens
from ..format.sparse import (
    SPARSE_BIT,
    PositionOrder,
    SparseInfo,
    decode_positions,
    encode_positions,
    layer_heads,
    retained_count,
    sparse_components,
)
from .tensors import as_numpy, as_uint, carve, dtype_name, empty

if TYPE_CHECKING:
    from .kvcache import KVCache

# ---------------------------------------------------------------------------------------
# The cache
# ---------------------------------------------------------------------------------------

class SparseKVCache:
    """A sparse cache: ``layers[i][h]`` is ``{"positions": int64 [n], "k": [n, dk], "v": [n, dv]}``
    (``{"positions", "latent"}`` for MLA layers, ``[]`` for shared layers), n being how many
    tokens head h of layer i retained. Arrays may be numpy or torch."""

    __slots__ = ("header", "layers")
    is_sparse = True

    def __init__(self, header: Header, layers: Sequence[Sequence[Mapping[str, Any]]]):
        s = header.sparse
        if s is None:
            raise ValueError("a SparseKVCache needs a header with Header.sparse")
        check_header(header)
        if len(layers) != header.num_layers:
            raise ValueError(f"{len(layers)} layers given, header describes {header.num_layers}")
        counts = iter(s.retained_counts)
        lo, hi = header.first_position, s.next_position
        for i, (spec, heads) in enumerate(zip(header.arch.layers, layers)):
            if len(heads) != layer_heads(spec):
                raise ValueError(f"layer {i} ({spec.kind}) needs {layer_heads(spec)} heads, got {len(heads)}")
            for hd, head in enumerate(heads):
                n = next(counts)
                if set(head) != set(sparse_components(spec)):
                    raise ValueError(f"layer {i} head {hd} needs {sparse_components(spec)}, got {tuple(head)}")
                p = as_numpy(head["positions"])
                if p.shape != (n,) or p.dtype != np.int64:
                    raise ValueError(f"layer {i} head {hd}: positions {p.shape} {p.dtype}, need ({n},) int64")
                if n and (p[0] < lo or p[-1] >= hi or (np.diff(p) <= 0).any()):
                    raise ValueError(f"layer {i} head {hd}: positions must increase strictly within [{lo}, {hi})")
                for comp in R.KIND_COMPONENTS[spec.kind]:
                    x = head[comp]
                    want = (n, spec.shape(comp, 1)[2])
                    if tuple(x.shape) != want or dtype_name(x) != header.dtype:
                        raise ValueError(f"layer {i} head {hd} {comp}: {tuple(x.shape)} {dtype_name(x)}, need "
                                         f"{want} {header.dtype}")
        self.header = header
        self.layers = [[dict(head) for head in heads] for heads in layers]

    @classmethod
    def from_heads(cls, dense_header: Header, layers: Sequence[Sequence[Mapping[str, Any]]], *, next_position: int | None = None, method: str = "",
                   sink_tokens: int = 0, window_tokens: int = 0) -> SparseKVCache:
        """A sparse cache with ``dense_header``'s architecture, dtype, model and options;
        retained counts and token_count follow from ``layers``. ``next_position`` defaults
        to the dense header's ``first_position + token_count``."""
        counts = tuple(len(as_numpy(head["positions"])) for heads in layers for head in heads)
        h = dense_header
        info = SparseInfo(next_position=h.first_position + h.token_count if next_position is None else next_position,
                          retained_counts=counts, method=method, sink_tokens=sink_tokens, window_tokens=window_tokens)
        n = max(counts, default=0)
        header = replace(h, token_count=n, layer_tokens=default_layer_tokens(h.arch, n), sparse=info,
                         required_features=h.required_features | SPARSE_BIT)
        return cls(header, layers)

    @classmethod
    def from_mask(cls, dense: KVCache, keep_mask: Sequence[Any], *, method: str = "mask",
                  **info: Any) -> SparseKVCache:
        """Keep, per (layer, kv head), the tokens where ``keep_mask[layer][head, t]`` is true.

        ``keep_mask[layer]`` is a bool array [heads, layer tokens] (H2O, SnapKV, AdaKV, DMS
        decisions); shared layers take ``None`` or an empty array. Positions are
        ``first_position + token index``.
        """
        h = dense.header
        if len(keep_mask) != h.num_layers:
            raise ValueError(f"keep_mask has {len(keep_mask)} layers, the cache {h.num_layers}")
        layers: list[list[dict[str, Any]]] = []
        for i, (spec, r) in enumerate(zip(h.arch.layers, h.layer_tokens)):
            nh = layer_heads(spec)
            if nh == 0:
                layers.append([])
                continue
            m = np.asarray(as_numpy(keep_mask[i]), bool)
            if m.shape != (nh, r.count):
                raise ValueError(f"keep_mask[{i}] has shape {m.shape}, layer {i} needs {(nh, r.count)}")
            tensors = {c: as_numpy(dense.layers[i][c]) for c in spec.components}
            base = h.first_position + r.start
            layers.append([
                {"positions": (np.flatnonzero(m[hd]) + base).astype(np.int64),
                 **{c: np.ascontiguousarray(x[0 if c == "latent" else hd][m[hd]]) for c, x in tensors.items()}}
                for hd in range(nh)])
        return cls.from_heads(h, layers, method=method, **info)

    @classmethod
    def streaming(cls, dense: KVCache, sinks: int, window: int) -> SparseKVCache:
        """StreamingLLM: every head keeps the first ``sinks`` tokens and the last ``window``."""
        h = dense.header
        t = np.arange(h.token_count)
        keep = (t < sinks) | (t >= h.token_count - window)
        mask = [np.broadcast_to(keep[r.start:r.stop], (layer_heads(s), r.count)) if layer_heads(s) else None
                for s, r in zip(h.arch.layers, h.layer_tokens)]
        return cls.from_mask(dense, mask, method="streaming_llm", sink_tokens=sinks, window_tokens=window)

    @property
    def num_layers(self) -> int:
        return self.header.num_layers

    @property
    def next_position(self) -> int:
        assert self.header.sparse is not None  # checked by __init__
        return self.header.sparse.next_position

    def positions(self, layer: int, head: int) -> Any:
        """The absolute positions (int64 [count]) of the tokens ``head`` of ``layer`` retains."""
        return self.layers[layer][head]["positions"]

    @property
    def nbytes(self) -> int:
        return sum(as_numpy(x).nbytes for heads in self.layers for head in heads for c, x in head.items()
                   if c != "positions")

    def canonical_tensors(self) -> Iterator[tuple[int, str, Any]]:
        """(layer, component, array) per stored (layer, component): the heads' rows
        concatenated in head order ([sum of counts, dim]; positions int64 [sum of counts]),
        the neutral form of the conformance kit (conformance/PROTOCOL.md)."""
        h = self.header
        for i, (spec, heads) in enumerate(zip(h.arch.layers, self.layers)):
            for comp in sparse_components(spec):
                parts = [as_numpy(head[comp]) for head in heads]
                yield i, comp, np.concatenate(parts) if comp == "positions" else np.concatenate(parts).reshape(
                    -1, spec.shape(comp, 1)[2])

    @classmethod
    def from_canonical(cls, header: Header, tensors: Mapping) -> SparseKVCache:
        """Inverse of ``canonical_tensors``: ``tensors[(layer, component)]`` split by
        ``retained_counts``."""
        if header.sparse is None:
            raise ValueError("a SparseKVCache needs a header with Header.sparse")
        counts = iter(header.sparse.retained_counts)
        layers = []
        for i, spec in enumerate(header.arch.layers):
            n = [next(counts) for _ in range(layer_heads(spec))]
            cuts = np.cumsum([0, *n])
            layers.append([{c: tensors[i, c][cuts[hd]:cuts[hd + 1]] for c in sparse_components(spec)}
                           for hd in range(len(n))])
        return cls(header, layers)

    def chunk_arrays(self) -> Iterator[tuple[PlannedChunk, Any]]:
        """(PlannedChunk, array) of every chunk in canonical order (layer, component, head,
        cell; KVW-SPARSE-7): [tokens, dim] rows, or the cell's absolute positions."""
        key: tuple[int, int, str] | None = None
        host: Any = None
        for c in chunk_plan(self.header):
            if (c.layer, c.head, c.component) != key:
                key = (c.layer, c.head, c.component)
                host = as_numpy(self.layers[c.layer][c.head][c.component])
            yield c, host[c.token_start : c.token_start + c.token_count]

    def with_header(self, **changes: Any) -> SparseKVCache:
        """Same tensors, header fields replaced (``chunk_tokens``, ``model``, ``alignment`` ...)."""
        return SparseKVCache(replace(self.header, **changes), self.layers)

    def equal(self, other: SparseKVCache) -> bool:
        """Bit-exact equality of header, positions and every tensor."""
        if not getattr(other, "is_sparse", False) or self.header != other.header:
            return False
        for a, b in zip(self.layers, other.layers):
            for x, y in zip(a, b):
                if x.keys() != y.keys() or any(
                        as_numpy(x[c]).tobytes() != as_numpy(y[c]).tobytes() for c in x):
                    return False
        return True

    def __repr__(self) -> str:
        s = self.header.sparse
        assert s is not None  # checked by __init__
        return (f"SparseKVCache({self.num_layers} layers, {sum(s.retained_counts)} retained (layer, head) tokens, "
                f"next position {s.next_position}, method {s.method!r}, {self.header.dtype})")


# ---------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------

def read_positions(reader, i: int, verify: bool = True) -> np.ndarray:
    """Decoded positions of record ``i`` (a POSITIONS chunk) of a ``Reader``."""
    c, stored = reader.stored(i, verify)
    h = reader.header
    raw = decode_body(c.codec, stored, c.raw_length, checksum_required=checksum_required(h))
    return decode_positions(raw, c.token_count, h.first_position, h.sparse.next_position)


def _row_shapes(h: Header, layer: int) -> list[dict]:
    """Per head of ``layer``: {component: (retained tokens, dim)} of its K/V/LATENT rows."""
    spec = h.arch.layers[layer]
    return [{c: (retained_count(h, layer, hd), spec.shape(c, 1)[2]) for c in R.KIND_COMPONENTS[spec.kind]}
            for hd in range(layer_heads(spec))]


def read_sparse_layer(reader, layer: int, *, verify: bool = True, backend: str = "numpy", device=None,
                      order: PositionOrder | None = None, out: list | None = None) -> list[dict]:
    """One layer of a sparse container: per head ``{"positions", "k", "v"}`` (or latent).
    ``out`` supplies each head's destination tensors (``{"k": ..., "v": ...}``)."""
    h = reader.header
    spec, t, C = h.arch.layers[layer], reader.grid, h.chunk_tokens
    order = order or PositionOrder(C)
    shapes = _row_shapes(h, layer)
    if out is None:
        out = [{c: empty(shape, h.dtype, backend, device) for c, shape in head.items()} for head in shapes]
    heads = []
    for hd, (dsts, head_shapes) in enumerate(zip(out, shapes)):
        head = {"positions": None, **dsts}
        count = next(iter(head_shapes.values()))[0]
        head["positions"] = np.empty(count, np.int64)
        for comp in sparse_components(spec):
            dst = head[comp]
            for t0, n in t.head_chunks(layer, hd, C):
                i = int(reader.slot_records[t.slot(layer, R.COMPONENTS[comp], hd, t0, C)])
                if comp == "positions":
                    dst[t0 : t0 + n] = p = read_positions(reader, i, verify)
                    order.add(layer, hd, t0, p)
                elif backend == "numpy" and h.codec_specs and reader.records["reserved0"][i]:
                    c, stored = reader.stored(i, verify)  # a codec spec decodes straight into place
                    reader.decode_stored(i, c, stored, out=as_uint(dst)[None, t0 : t0 + n])
                elif backend == "numpy":  # one copy (zstd through the reader's scratch buffer)
                    as_uint(dst)[t0 : t0 + n] = as_uint(reader.decode(i, verify, "numpy", scratch=True)[0])
                else:
                    dst[t0 : t0 + n].copy_(reader.decode(i, verify, "torch")[0])
        heads.append(head)
    return heads


def check_positions(reader) -> None:
    """Every POSITIONS chunk decoded and the order of positions checked across cells
    (KVW-SPARSE-10/11) without decoding K/V again: ``Reader.validate`` has done that."""
    h, t, order = reader.header, reader.grid, PositionOrder(reader.header.chunk_tokens)
    pos = R.COMPONENTS["positions"]
    for layer, spec in enumerate(h.arch.layers):
        if "positions" not in sparse_components(spec):
            continue
        for hd in range(layer_heads(spec)):
            for t0, _ in t.head_chunks(layer, hd, h.chunk_tokens):
                i = int(reader.slot_records[t.slot(layer, pos, hd, t0, h.chunk_tokens)])
                order.add(layer, hd, t0, read_positions(reader, i))


def read_sparse(reader, *, verify: bool = True, backend: str = "numpy", device=None) -> SparseKVCache:
    """The whole sparse cache of a ``Reader`` in one allocation carved into per-head tensors
    (as ``Reader.load`` does for dense caches), positions checked across cells (KVW-SPARSE-11)."""
    h = reader.header
    shapes = [_row_shapes(h, i) for i in range(h.num_layers)]
    slabs = iter(carve([s for layer in shapes for head in layer for s in head.values()], h.dtype, backend, device))
    order = PositionOrder(h.chunk_tokens)
    layers = [read_sparse_layer(reader, i, verify=verify, backend=backend, device=device, order=order,
                                out=[{c: next(slabs) for c in head} for head in shapes[i]])
              for i in range(h.num_layers)]
    return SparseKVCache(h, layers)


__all__ = ["check_positions", "PositionOrder", "SparseInfo", "SparseKVCache", "decode_positions", "encode_positions",
           "read_sparse", "read_sparse_layer"]
