"""Which pipeline encodes each chunk: a writer's codec choice evaluated per planned chunk
before the header is built, so the header lists every codec spec before the first chunk
(spec/codecs.md, KVW-CSPEC-*)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import zstandard

from ..format import errors as E
from ..format import registry as R
from ..format.chunks import chunk_plan
from ..format.codec_specs import LOSSY_COMPONENTS, CodecSpec, features_of
from ..format.kv_scales import required_minor
from . import byteplane, native, quant
from .pipeline import lossy_range
from .presets import resolve
from .zstd import DEFAULT_ZSTD_LEVEL

Chosen = str | int  # "raw", "zstd" or a codec_spec index >= 1
Encoded = tuple[str, int, list[Any]]  # (codec name, codec_spec, stored pieces)


class CodecPlan:
    """Which pipeline encodes each chunk, decided before the header is built.

    ``codec`` is a name, preset or CodecSpec (every chunk), a mapping (keys
    ``(layer, component)``, ``component`` or ``None`` for the rest) or a callable
    ``(layer, component, token_start) -> choice``, evaluated once per planned chunk here,
    so the header can list every spec before the first chunk is written.
    """

    def __init__(self, header: Any, codec: Any, level: int = DEFAULT_ZSTD_LEVEL) -> None:
        specs = list(header.codec_specs)
        sparse = header.sparse is not None

        def index(choice: Any, comp: str, strict: bool = True) -> Chosen:  # "raw", "zstd" or a codec_spec >= 1, new specs in first-use order
            c: str | int | CodecSpec = resolve(choice, comp)
            if comp == "positions" and isinstance(c, CodecSpec):  # KVW-SPARSE-9: raw or zstd only
                if strict:
                    raise ValueError(f"codec {c.codec} chosen for POSITIONS chunks: they are raw or zstd "
                                     "(KVW-SPARSE-9)")
                c = "zstd"  # one codec for the whole cache: the varint positions take zstd instead
            elif isinstance(c, CodecSpec) and c.lossy and comp not in LOSSY_COMPONENTS:  # KVW-CSPEC-9
                if strict:
                    raise ValueError(f"lossy codec {c.codec} chosen for component {comp!r}: only k, v and latent")
                c = "raw"  # one codec for the whole cache: non-KV tensors (e.g. state) stay exact
            if isinstance(c, CodecSpec):
                if c not in specs:
                    specs.append(c)
                c = specs.index(c) + 1
            return c

        self._choice: dict[tuple[int, str, int, int], Chosen] | None = None
        pick: Any  # a callable (layer, component, token_start[, head]) -> choice, or None
        if callable(codec) and not isinstance(codec, (str, CodecSpec, dict)):
            pick = codec
        elif isinstance(codec, dict) and not set(codec) <= set(R.COMPONENTS):
            check_codec_map(header, codec)
            pick = lambda layer, comp, t0: codec.get((layer, comp), codec.get(comp, codec.get(None, "raw")))
        else:  # the same for every chunk of a component: no per-chunk table
            pick = None
            used = dict.fromkeys(comp for s_ in header.arch.layers for comp in s_.components)
            if sparse:
                used["positions"] = None
            if isinstance(codec, dict) and codec and not set(codec) & set(used):
                check_codec_map(header, codec)
            self._by_comp = {comp: index(codec, comp, strict=False) for comp in used}
        if pick is not None:  # keyed (layer, component, token_start, head); head 0 in dense containers
            # sparse: per-head cells (KVW-SPARSE-7); a callable taking ``head`` also gets the head
            with_head = sparse and _takes_head(pick)
            self._choice = {
                c[:3] + (c.head,): index(pick(*c[:3], head=c.head) if with_head else pick(*c[:3]), c.component)
                for c in chunk_plan(header) if c.component != "state"}  # state chunks: lossless (KVW-STATE-8)
        if len(specs) != len(header.codec_specs):
            rf = header.required_features | features_of(specs)  # codec_specs; rotation (KVW-ROT-1)
            header = header.replace(codec_specs=tuple(specs), required_features=rf, format_minor=max(
                header.format_minor, required_minor(rf)))  # KVW-EVOL-12
        self.header = header
        self._zstd = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=True)  # KVW-CODEC-4
        self._planes: Any = byteplane.plane_compressor(level) if any(  # None: never asked for
            s.codec == "byteplane_zstd" or s.lossless == "byteplane_zstd" for s in specs) else None

    def encode(self, layer: int, component: str, token_start: int, x: np.ndarray, pieces: list[Any], raw_length: int,
               head: int = 0) -> Encoded:
        """(codec name, codec_spec, stored pieces) of one chunk; ``pieces`` are its raw bytes,
        ``x`` its [heads, tokens, dim] array (``head``: a sparse chunk's one head)."""
        c: Any = self.chosen(layer, component, token_start, head)  # past "raw" and "zstd": a spec index
        if c == "raw":
            return "raw", 0, pieces
        if c == "zstd":
            return self._lossless(pieces, raw_length)
        h = self.header
        spec = h.codec_specs[c - 1]
        if spec.codec == "byteplane_zstd":
            stored = byteplane.encode(pieces[0] if len(pieces) == 1 else b"".join(pieces), h.itemsize, self._planes)
            if sum(memoryview(p).nbytes for p in stored) >= raw_length:  # KVW-BPZ-4
                return "raw", 0, pieces
            return spec.codec, c, stored
        lay = quant.layout(spec, h.dtype, x.shape[0], x.shape[2], token_start, token_start + x.shape[1],
                           *lossy_range(h, layer, head))
        try:
            body = self._native_lossy(spec, c, layer, token_start, x, pieces, raw_length, head)
            if body is None:
                body = quant.encode(spec, x, lay, h.dtype)
        except quant.NotFaithful:  # KVW-LOSSY-5/6: this chunk is stored losslessly
            return self._lossless(pieces, raw_length)
        return self._staged(spec, c, body)

    def chosen(self, layer: int, component: str, token_start: int, head: int = 0) -> Chosen:
        """The choice for one planned chunk: "raw", "zstd" or a codec_spec index >= 1."""
        if self._choice is None:
            return self._by_comp.get(component, "raw")
        return self._choice.get((layer, component, token_start, head), "raw")

    def carried(self, layer: int, component: str, token_start: int, shape: tuple[int, ...], body: Any) -> Encoded:
        """(codec name, codec_spec, stored pieces) of one dense chunk whose lossy body the
        caller already holds in the spec chosen for it: an engine's quantized cache carried
        as it is (``integrations.vllm_quantized``). The body is read as a reader reads it
        (length, scales, padding: the reader's rules and codes) and must decode to finite
        values: the engine's numbers are the cache, so KVW-LOSSY-5 holds by construction."""
        c = self.chosen(layer, component, token_start)
        if not isinstance(c, int):
            raise ValueError(f"layer {layer} {component} token {token_start}: the codec chosen is {c}, not a lossy "
                             "codec spec; pass the tensor to Encoder.chunk instead")
        h, spec = self.header, self.header.codec_specs[c - 1]
        lay = quant.layout(spec, h.dtype, shape[0], shape[2], token_start, token_start + shape[1],
                           *lossy_range(h, layer, 0))
        view = memoryview(body).cast("B")
        if len(view) != lay.length:
            raise ValueError(f"layer {layer} {component} token {token_start}: a body of {len(view)} bytes; its spec "
                             f"and shape {shape} take {lay.length} (KVW-LOSSY-2)")
        try:
            decoded = quant.decode(spec, view, lay, h.dtype)
        except E.FormatError as exc:
            raise ValueError(f"layer {layer} {component} token {token_start}: readers would reject this body "
                             f"({exc.code}, {exc.rule}): {exc}") from None
        if not np.isfinite(np.asarray(decoded, np.float32)).all():
            raise ValueError(f"layer {layer} {component} token {token_start}: the body decodes to NaN or infinity")
        return self._staged(spec, c, [view])

    def _staged(self, spec: CodecSpec, c: int, body: list[Any]) -> Encoded:
        """The lossy body with the spec's lossless stage, kept only when shorter (KVW-CSPEC-7)."""
        if spec.lossless != "raw":  # chained stage, kept only when it is shorter (KVW-CSPEC-7)
            h = self.header
            joined = b"".join(memoryview(p).cast("B") for p in body)
            if spec.lossless == "zstd":
                staged = [self._zstd.compress(joined)]
            else:
                staged = byteplane.encode(joined, h.itemsize, self._planes)
            if sum(memoryview(p).nbytes for p in staged) < len(joined):
                body = staged
        return spec.codec, c, body

    def _native_lossy(self, spec: CodecSpec, index: int, layer: int, token_start: int, x: np.ndarray, pieces: list[Any],
                      raw_length: int, head: int) -> list[Any] | None:
        """[the lossy body] from libkvwire when native codecs are on (``codecs.native``: the
        same bytes as ``quant.encode``, 2-3x faster), else None."""
        if not native.available():
            return None
        raw = pieces[0] if len(pieces) == 1 else b"".join(memoryview(p).cast("B") for p in pieces)
        rec = native.record(self.header, spec.codec, index, 0, raw_length, tuple(x.shape), layer, token_start, head)
        body = native.encode_lossy(self.header, rec, raw)
        return None if body is None else [body]

    def _lossless(self, pieces: list[Any], raw_length: int) -> Encoded:
        """zstd when its frame is shorter, else raw (KVW-CHUNK-6)."""
        frame = self._zstd.compress(pieces[0] if len(pieces) == 1 else b"".join(pieces))
        return ("zstd", 0, [frame]) if len(frame) < raw_length else ("raw", 0, pieces)


class CodecGrowthWarning(UserWarning):
    """A codec stored a cache in more bytes than its raw elements (e.g. kivi2 on a short cache,
    whose last 128 tokens stay in full precision): write it raw, or pick a codec of docs/codecs.md."""


def check_codec_map(header: Any, codec: dict[Any, Any]) -> None:
    """ValueError for a key of a ``{(layer, component): codec}`` map that matches no chunk of
    ``header`` (a mistyped key would otherwise leave those chunks raw, silently)."""
    comps = dict.fromkeys(c for s in header.arch.layers for c in s.components)
    if header.sparse is not None:
        comps["positions"] = None
    pairs = {(i, c) for i, s in enumerate(header.arch.layers) for c in s.components}
    if header.sparse is not None:  # every sparse layer's cells carry positions (spec/sparse.md)
        pairs |= {(i, "positions") for i, s in enumerate(header.arch.layers) if set(s.components) - {"state"}}
    bad = [k for k in codec if not (k is None or k in comps or (isinstance(k, tuple) and k in pairs))]
    if bad:
        raise ValueError(
            f"codec map key(s) {', '.join(map(repr, bad))} match no chunk of this cache; the keys are None (every "
            f"other chunk), a component ({', '.join(map(repr, comps))}) or a (layer, component) pair with layer in "
            f"[0, {header.num_layers}) and one of that layer's components, e.g. (0, {next(iter(comps), 'k')!r})")


def _takes_head(pick: Callable[..., Any]) -> bool:
    try:
        return "head" in inspect.signature(pick).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False
