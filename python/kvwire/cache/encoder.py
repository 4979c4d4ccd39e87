"""Encoding: a sans-IO ``Encoder`` that emits buffers, and ``iter_buffers``/``encode_bytes`` over it.

The encoder never concatenates tensor bytes: raw bodies are emitted as memoryviews of
the caller's arrays (one per head, since a token slice of a [heads, tokens, dim] layer
is contiguous per head), so ``writev``/``sendmsg`` can send a cache without a copy.
Dense, state and sparse chunks go through the one ``Encoder``: the header's chunk plan
(``format.chunks.chunk_plan``) says which chunks exist, and a cache says what each
holds (``chunk_arrays``). ``encode_bytes`` joins the buffers into ``bytes`` (the public
``kvwire.encode``, with typed keywords, is in ``kvwire.cache.files``, as is writing files).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from ..codecs import DEFAULT_ZSTD_LEVEL, BodyEncoder, CodecGrowthWarning, CodecPlan, native
from ..deprecation import former_names
from ..format import registry as R
from ..format.chunks import ChunkTable, PlannedChunk, on_grid
from ..format.container import (
    FRAME_SIZE,
    PREAMBLE_SIZE,
    RECORD_DTYPE,
    RECORD_STRUCT,
    build_end_frame,
    build_frame,
    build_index,
    build_preamble,
    build_trailer,
    next_frame_offset,
    xxh3,
)
from ..format.crossmodel import with_state_bit
from ..format.errors import FormatError
from ..format.header import Header, build_header, parse_header
from ..format.kv_scales import writer_header
from ..format.sparse import PositionOrder, SparseTable, encode_positions, layer_heads, sparse_components
from .args import check_choice, check_count
from .tensors import as_numpy, as_uint

if TYPE_CHECKING:
    from types import FrameType

    from .kvcache import KVCache
    from .sparse import SparseKVCache

FORMS = ("file", "stream")


class Encoder:
    """Builds one container incrementally: ``begin()``, ``chunk()`` (or ``state_chunk()``)
    per chunk in any order, then ``end()``. Each call returns the buffers to append, in
    order. Dense, state and sparse headers alike (spec/sparse.md: ``chunk(..., head=h)``)."""

    def __init__(self, header: Header, *, codec: Any = "raw", level: int = DEFAULT_ZSTD_LEVEL):
        """``codec``: "raw", "zstd", a preset of ``kvwire.codecs.PRESETS``, a ``CodecSpec``, a
        mapping ``{(layer, component): codec}`` or a callable ``(layer, component, token_start)
        -> codec`` (spec/codecs.md); codec specs are added to the header (``Encoder.header``)."""
        check_header_argument(header)
        header = with_state_bit(header)  # required bits follow from the header (KVW-STATE-1)
        header = writer_header(header)  # bit kv_scales iff Header.kv_scales, format_minor (KVW-SCALE-1, KVW-EVOL-12)
        # every chunk's pipeline, known before the header is built (spec/codecs.md; sparse: per head)
        self._plan = CodecPlan(header, codec, level)
        header = self._plan.header
        self.header = header
        self.codec = codec
        self._bodies = BodyEncoder(codec if isinstance(codec, str) and codec in ("raw", "zstd") else "raw", level)
        self._header_bytes = build_header(header)  # runs check_header
        try:  # KVW-WRITE-1: never emit what the reader rejects; its parse budget (KVW-LIM-7, HDR-8) needs the bytes
            parse_header(self._header_bytes)
        except FormatError as exc:
            raise ValueError(f"readers would reject this header ({exc.code}, {exc.rule}): {exc}") from None
        self._table = ChunkTable.of(header)
        self._filled = np.zeros(self._table.total, bool)
        self._records: list[bytes] = []  # RECORD_STRUCT-packed, in emission order
        self._pos = 0
        self._state = "new"
        self._order = PositionOrder(header.chunk_tokens) if header.sparse is not None else None

    @property
    def position(self) -> int:
        """Bytes emitted so far."""
        return self._pos

    def begin(self) -> list:
        self._expect("new", "begin")
        self._state = "chunks"
        self._pos = PREAMBLE_SIZE + len(self._header_bytes)
        return [build_preamble(self._header_bytes, self.header.format_minor), self._header_bytes]

    def chunk(self, layer: int, component: str, token_start: int, data: Any, *, head: int = 0) -> list:
        """Buffers of one chunk: ``data`` is its [heads, tokens, head_dim] array or tensor.

        Sparse headers (spec/sparse.md): one head per chunk, ``head=h``, ``data`` [tokens,
        dim] for K/V/LATENT and the absolute positions [tokens] for ``"positions"``; cells of
        a head are [token_start, token_start + tokens) of its own index space."""
        self._expect("chunks", "chunk")
        h = self.header
        if not 0 <= layer < h.num_layers:  # a negative index would wrap onto the last layers
            raise ValueError(f"layer {layer} outside [0, {h.num_layers})")
        if h.sparse is not None:
            return self._sparse_chunk(layer, component, token_start, data, head)
        if head:
            raise ValueError(f"head={head}: a dense chunk covers every head of its component (KVW-CHUNK-3)")
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
        assert isinstance(self._table, ChunkTable)  # a dense header's
        slot = self._table.slot(layer, R.COMPONENTS[component], token_start, C)
        if self._filled[slot]:
            raise ValueError(f"chunk (layer {layer}, {component}, token {token_start}) already written")
        self._filled[slot] = True

        return self._emit(layer, component, token_start, n, 0, x.shape[0], body_pieces(as_uint(x)), x=x)

    def encoded_chunk(self, layer: int, component: str, token_start: int, body: Any,
                      token_count: int) -> list:
        """Buffers of one dense chunk of ``token_count`` tokens given as its lossy body in the
        codec spec this encoder's codec choice picks for it: an engine's quantized cache (vLLM's
        turboquant slots, ``kvwire.integrations.vllm_quantized``) carried without
        re-quantizing. The body is checked as readers check it (``ValueError`` otherwise)."""
        self._expect("chunks", "encoded_chunk")
        h = self.header
        if h.sparse is not None or not 0 <= layer < h.num_layers:
            raise ValueError(f"layer {layer}: encoded chunks are dense chunks of a layer in [0, {h.num_layers})")
        spec, r = h.arch.layers[layer], h.layer_tokens[layer]
        if component not in spec.components or component == "state":
            raise ValueError(f"layer {layer} ({spec.kind}) has no {component!r} component of K/V chunks")
        if not on_grid(token_start, token_count, h.chunk_tokens, r.start, r.stop):
            raise ValueError(f"tokens [{token_start}, {token_start + token_count}) are not one chunk of layer "
                             f"{layer}'s grid")
        assert isinstance(self._table, ChunkTable)  # a dense header's
        slot = self._table.slot(layer, R.COMPONENTS[component], token_start, h.chunk_tokens)
        if self._filled[slot]:
            raise ValueError(f"chunk (layer {layer}, {component}, token {token_start}) already written")
        shape = spec.shape(component, token_count)
        codec, codec_spec, stored = self._plan.carried(layer, component, token_start, shape, body)
        self._filled[slot] = True
        raw_length = shape[0] * shape[1] * shape[2] * R.DTYPES[h.dtype][1]
        return self._frame(layer, component, token_start, token_count, 0, shape[0], codec, codec_spec, stored,
                           raw_length, None)

    def state_chunk(self, layer: int, index: int, data: Any) -> list:
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
        raw = np.ascontiguousarray(as_uint(x)).reshape(-1).data.cast("B")
        return self._emit(layer, "state", 0, h.token_count, index, 1, [raw])

    def _sparse_chunk(self, layer: int, component: str, token_start: int, data, head: int) -> list:
        h, t = self.header, self._table
        assert h.sparse is not None and self._order is not None and isinstance(t, SparseTable)  # a sparse header's
        spec = h.arch.layers[layer]
        if component not in sparse_components(spec) or not 0 <= head < layer_heads(spec):
            raise ValueError(f"layer {layer} ({spec.kind}) has no component {component!r} head {head}")
        x = as_numpy(data)
        n = len(x)
        count = int(t.retained[t.offsets[layer] + head])
        C = h.chunk_tokens
        if not (n >= 1 and token_start % C == 0 and token_start + n == min(count, token_start + C)):
            raise ValueError(f"tokens [{token_start}, {token_start + n}) are not one cell of layer {layer} head "
                             f"{head}'s grid over [0, {count})")
        slot = t.slot(layer, R.COMPONENTS[component], head, token_start, C)
        if self._filled[slot]:
            raise ValueError(f"chunk (layer {layer}, head {head}, {component}, token {token_start}) already written")
        if component == "positions":
            if x.shape != (n,) or (n and x[-1] >= h.sparse.next_position):
                raise ValueError(f"positions of layer {layer} head {head} must be [tokens] below next_position")
            body = encode_positions(x, h.first_position)
            self._order.add(layer, head, token_start, x)
            self._filled[slot] = True
            return self._emit(layer, component, token_start, n, head, 1, [memoryview(body)], x=x)
        want = (n, spec.shape(component, 1)[2])
        if tuple(x.shape) != want or x.dtype != R.DTYPES[h.dtype][2]:
            raise ValueError(f"layer {layer} head {head} {component}: {x.shape} {x.dtype}, need {want} {h.dtype}")
        self._filled[slot] = True
        u = as_uint(x)
        return self._emit(layer, component, token_start, n, head, 1,
                          [(u if u.flags.c_contiguous else np.ascontiguousarray(u)).data.cast("B")], x=x[None])

    def put(self, chunk: PlannedChunk, data: Any) -> list:
        """Buffers of one planned chunk (``format.chunks.chunk_plan``), whatever its kind."""
        if chunk.component == "state":
            return self.state_chunk(chunk.layer, chunk.head, data)
        return self.chunk(chunk.layer, chunk.component, chunk.token_start, data, head=chunk.head)

    def _emit(self, layer: int, component: str, token_start: int, n: int, head_start: int, head_count: int,
              pieces: list, bodies: BodyEncoder | None = None, x=None) -> list:
        """Frame and stored body of one chunk whose raw bytes are ``pieces`` (already checked)."""
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
        return self._frame(layer, component, token_start, n, head_start, head_count, codec, codec_spec, stored,
                           raw_length, x if stored is pieces else None)

    def _frame(self, layer: int, component: str, token_start: int, n: int, head_start: int, head_count: int,
               codec: str, codec_spec: int, stored: list, raw_length: int, raw_x) -> list:
        """Frame, record and buffers of one chunk's ``stored`` body (``raw_x``: the array whose
        heads are the raw pieces, hashed in place by libkvwire when native is on)."""
        h = self.header
        checksum = native.hash_runs(raw_x) if raw_x is not None and len(stored) > 1 else None
        if checksum is None and len(stored) == 1:
            checksum = xxhash.xxh3_64_intdigest(stored[0])
        elif checksum is None:
            hasher = xxhash.xxh3_64()
            for p in stored:
                hasher.update(p)
            checksum = hasher.intdigest()
        stored_length = sum(memoryview(p).nbytes for p in stored)

        frame_at = next_frame_offset(self._pos, h.alignment)
        rec = RECORD_STRUCT.pack(  # the record's bytes (RECORD_DTYPE): no numpy scalar per chunk
            frame_at + FRAME_SIZE, stored_length, raw_length, checksum, token_start, n, layer,
            R.COMPONENTS[component], R.CODECS[codec], 0, head_start, head_count, codec_spec, 0)
        self._records.append(rec)
        frame = build_frame(rec)
        out = [bytes(frame_at - self._pos) + frame if frame_at > self._pos else frame, *stored]
        self._pos = frame_at + FRAME_SIZE + stored_length
        return out

    def end(self, *, form: str = "file") -> list:
        self._expect("chunks", "end")
        check_choice("form", form, FORMS)
        if not self._filled.all():
            missing = int(np.argmin(self._filled))
            raise ValueError(f"{int((~self._filled).sum())} chunks were never written (first missing slot {missing})")
        self._state = "done"
        records = np.frombuffer(b"".join(self._records), RECORD_DTYPE).copy()
        self._warn_growth(records)
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

    def _warn_growth(self, records: np.ndarray) -> None:
        """CodecGrowthWarning when the chosen codec stored the bodies in more bytes than raw."""
        stored, raw = int(records["stored_length"].sum()), int(records["raw_length"].sum())
        if stored > raw and not (isinstance(self.codec, str) and self.codec == "raw"):
            codec = self.codec if isinstance(self.codec, str) else type(self.codec).__name__
            warnings.warn(f"codec {codec!r} stored this cache in {stored} bytes, more than its {raw} raw "
                          f"{self.header.dtype} bytes ({raw / stored:.2f}x): write it raw or choose another codec "
                          "(docs/codecs.md; kivi keeps the last 128 tokens in full precision and pays off only "
                          "on long caches)", CodecGrowthWarning, stacklevel=_caller_level())

    def _expect(self, state: str, call: str) -> None:
        if self._state != state:
            raise RuntimeError(f"Encoder.{call}() called in state {self._state!r}")


def body_pieces(u: np.ndarray) -> list:
    """The raw body of a [heads, tokens, dim] integer view as byte memoryviews, one per head
    (a token slice is contiguous within each head): zero-copy views of the caller's tensor
    (tests/layouts/test_offload.py counts them). The usual layout is tested once for all heads."""
    if u.strides[2] == u.itemsize and (u.shape[1] == 1 or u.strides[1] == u.shape[2] * u.itemsize):
        return [memoryview(u[h]).cast("B") for h in range(u.shape[0])]
    return [(hd if hd.flags.c_contiguous else np.ascontiguousarray(hd)).data.cast("B") for hd in u]


def _caller_level() -> int:
    """``stacklevel`` naming the first frame outside kvwire, so a warning points at the caller's line."""
    import os
    import sys

    root, level = os.path.dirname(os.path.dirname(__file__)), 1
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(root):
        frame, level = frame.f_back, level + 1
    return level


def check_header_argument(header) -> None:
    """A ``Header`` whose integer fields are non-negative integers: a wrong value is named here,
    not reported by the FlatBuffers builder (``bad number -1 for type uint64``)."""
    if not isinstance(header, Header):
        raise TypeError(f"need a kvwire.Header, not {type(header).__name__}")
    for name in ("token_count", "first_position", "required_features", "optional_features"):
        check_count(f"Header.{name}", getattr(header, name))


def iter_buffers(cache: KVCache | SparseKVCache, *, form: str = "file", codec: Any = "raw",
                 level: int = DEFAULT_ZSTD_LEVEL, **header_changes: Any) -> Iterator[bytes | memoryview]:
    """Yield the container's buffers (bytes and zero-copy memoryviews) in canonical order.

    ``cache`` is a ``KVCache`` or a ``SparseKVCache``; ``header_changes`` override header
    fields for this encoding (``chunk_tokens``, ``alignment``, ``model``, ``metadata`` ...).
    """
    if not hasattr(cache, "header") or not hasattr(cache, "chunk_arrays"):
        raise TypeError(f"need a kvwire.KVCache (or SparseKVCache), not {type(cache).__name__}; build one from "
                        "per-layer tensors with kvwire.KVCache.from_tensors(keys, values)")
    check_choice("form", form, FORMS)
    if header_changes:
        unknown = sorted(set(header_changes) - set(Header.__dataclass_fields__))
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(unknown)}: the options are form, codec, level and the "
                            f"Header fields {', '.join(sorted(Header.__dataclass_fields__))}")
        cache = cache.with_header(**header_changes)
    enc = Encoder(cache.header, codec=codec, level=level)
    yield from enc.begin()
    for chunk, data in cache.chunk_arrays():
        yield from enc.put(chunk, data)
    yield from enc.end(form=form)


def encode_bytes(cache: KVCache | SparseKVCache, **opts: Any) -> bytes:
    """The whole container as bytes (see ``iter_buffers`` for the options): the untyped
    core of ``kvwire.encode``, for callers that pass Header fields through as they come."""
    return b"".join(iter_buffers(cache, **opts))


# ``encode``, the former name of ``encode_bytes``: one public ``encode`` (``kvwire.encode``) is enough
__getattr__ = former_names(__name__, lambda name: (encode_bytes, "kvwire.encode (typed keywords) or "
                                                   "kvwire.cache.encoder.encode_bytes (the same function)")
                           if name == "encode" else None)
