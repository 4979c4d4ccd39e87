"""Body codecs: ``raw`` and ``zstd`` (spec section 13) and the codec-spec pipelines of
spec/codecs.md (``byteplane_zstd``, ``fp8``, ``int_affine``, chained lossless stages).

A codec maps the canonical raw bytes of one chunk to its stored bytes and back. Decoding
never produces more than the record's ``raw_length`` bytes and fails with a
``CodecError`` on anything else, so a decompression bomb costs at most the size the
header already declared (and the reader checked against its limit). A lossy pipeline's
intermediate body has a length fixed by the chunk geometry (``quant.layout``), so its
lossless stage is bounded the same way.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import replace

import numpy as np
import zstandard

from . import byteplane, quant
from . import registry as R
from .codec_spec import FEATURE_BIT, LOSSY_COMPONENTS, CodecSpec
from .errors import CodecError

DEFAULT_ZSTD_LEVEL = 3


class BodyEncoder:
    """Encodes bodies with one codec, reusing its compression context across chunks."""

    def __init__(self, codec: str, level: int = DEFAULT_ZSTD_LEVEL):
        if codec not in ("raw", "zstd"):
            raise ValueError(f"unknown codec {codec!r}")
        self.codec = codec
        self._cctx = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False) \
            if codec == "zstd" else None

    def encode(self, pieces: list) -> list:
        """Stored form of a body given as buffers whose concatenation is the raw body."""
        if self._cctx is None:
            return list(pieces)
        return [self._cctx.compress(pieces[0] if len(pieces) == 1 else b"".join(pieces))]


_LOCAL = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    """One decompression context per thread (contexts are not thread-safe; making one per
    body costs more than decoding a small plane)."""
    d = getattr(_LOCAL, "zstd", None)
    if d is None:
        d = _LOCAL.zstd = zstandard.ZstdDecompressor()
    return d


def decode_body(codec: str, stored, raw_length: int, out=None):
    """Raw bytes of a body. ``raw`` returns ``stored`` itself (a view); ``zstd`` decodes,
    into ``out`` when given (a writable buffer of raw_length bytes)."""
    if codec == "raw":
        if out is not None:
            memoryview(out).cast("B")[:] = memoryview(stored).cast("B")
            return out
        return stored
    try:
        declared = zstandard.frame_content_size(stored)
    except zstandard.ZstdError as exc:
        raise CodecError("DECODE_FAILED", f"zstd frame header invalid: {exc}", rule="KVW-CODEC-2") from None
    if declared != raw_length:
        raise CodecError("DECODED_SIZE_MISMATCH", f"zstd frame declares {declared} bytes, record says {raw_length}",
                         rule="KVW-CODEC-2")
    try:
        dict_id = zstandard.get_frame_parameters(stored).dict_id
    except zstandard.ZstdError as exc:
        raise CodecError("DECODE_FAILED", f"zstd frame header invalid: {exc}", rule="KVW-CODEC-2") from None
    if dict_id:
        raise CodecError("DECODE_FAILED", f"zstd frame needs dictionary {dict_id}", rule="KVW-CODEC-3")
    try:
        data = _decompressor().decompress(stored, max_output_size=raw_length, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CodecError("DECODE_FAILED", f"zstd: {exc}", rule="KVW-CODEC-2") from None
    if len(data) != raw_length:
        raise CodecError("DECODED_SIZE_MISMATCH", f"zstd produced {len(data)} bytes, record says {raw_length}",
                         rule="KVW-CODEC-2")
    if out is not None:
        memoryview(out).cast("B")[:] = data
        return out
    return data


# ---------------------------------------------------------------------------------------
# Codec specs (spec/codecs.md)
# ---------------------------------------------------------------------------------------

def _kivi(bits: int) -> dict:
    """KIVI (arXiv 2402.02750): keys per channel over groups of 32 tokens, values per token
    over groups of 32 channels, min-max asymmetric, the last 128 tokens in full precision."""
    base = CodecSpec("int_affine", bits=bits, group_size=32, scale_dtype="f16", residual_tokens=128)
    return {"k": base, "v": replace(base, group_axis="channels"), "latent": replace(base, group_axis="channels")}


# Named pipelines: a CodecSpec for every component, or {component: CodecSpec}.
PRESETS = {
    "byteplane": CodecSpec("byteplane_zstd"),
    "fp8-e4m3": CodecSpec("fp8", fp8_format="f8_e4m3fn", scale_granularity="head"),
    "fp8-e4m3-token": CodecSpec("fp8", fp8_format="f8_e4m3fn", scale_granularity="token"),
    "fp8-e4m3fnuz": CodecSpec("fp8", fp8_format="f8_e4m3fnuz", scale_granularity="head"),
    "fp8-e5m2": CodecSpec("fp8", fp8_format="f8_e5m2", scale_granularity="head"),
    # per token and head; symmetric with an f16 scale: 8.125 bits per element at head_dim 128
    "int8": CodecSpec("int_affine", bits=8, group_size=128, group_axis="channels", symmetric=True, scale_dtype="f16"),
    # SGLang's int8: asymmetric, f32 scale and zero per token and head (8.5 bits at head_dim 128)
    "int8-asym": CodecSpec("int_affine", bits=8, group_size=128, group_axis="channels"),
    "int4-g32": CodecSpec("int_affine", bits=4, group_size=32, group_axis="channels", scale_dtype="f16"),
    "int4-g32-zstd": CodecSpec("int_affine", bits=4, group_size=32, group_axis="channels", scale_dtype="f16",
                               lossless="zstd"),
    "kivi2": _kivi(2),
    "kivi4": _kivi(4),
}


def resolve(choice, component: str):
    """A codec choice (name, CodecSpec, preset or None) for one component: "raw", "zstd"
    or a CodecSpec."""
    if choice is None:
        return "raw"
    if isinstance(choice, CodecSpec):
        return choice
    if isinstance(choice, dict):  # a preset's {component: spec}
        return resolve(choice.get(component, "raw"), component)
    if choice in ("raw", "zstd"):
        return choice
    if choice in PRESETS:
        return resolve(PRESETS[choice], component)
    if choice in R.CODECS:  # "byteplane_zstd", "fp8", "int_affine" with default parameters
        return CodecSpec(choice)
    raise ValueError(f"unknown codec {choice!r}: raw, zstd, a registry codec, a preset ({sorted(PRESETS)}), a "
                     "CodecSpec, a {(layer, component): codec} mapping or a callable")


class CodecPlan:
    """Which pipeline encodes each chunk, decided before the header is built.

    ``codec`` is a name, preset or CodecSpec (every chunk), a mapping (keys
    ``(layer, component)``, ``component`` or ``None`` for the rest) or a callable
    ``(layer, component, token_start) -> choice``, evaluated once per planned chunk here,
    so the header can list every spec before the first chunk is written.
    """

    def __init__(self, header, codec, level: int = DEFAULT_ZSTD_LEVEL):
        from .chunks import planned_chunks
        from .sparse_header import planned_sparse_chunks

        specs = list(header.codec_specs)
        sparse = header.sparse is not None

        def index(choice, comp, strict=True):  # "raw", "zstd" or a codec_spec >= 1, new specs in first-use order
            c = resolve(choice, comp)
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

        self._choice: dict | None = None
        if callable(codec) and not isinstance(codec, (str, CodecSpec, dict)):
            pick = codec
        elif isinstance(codec, dict) and not set(codec) <= set(R.COMPONENTS):
            pick = lambda layer, comp, t0: codec.get((layer, comp), codec.get(comp, codec.get(None, "raw")))  # noqa: E731
        else:  # the same for every chunk of a component: no per-chunk table
            pick = None
            used = dict.fromkeys(comp for s_ in header.arch.layers for comp in s_.components)
            if sparse:
                used["positions"] = None
            self._by_comp = {comp: index(codec, comp, strict=False) for comp in used}
        if pick is not None:  # keyed (layer, component, token_start, head); head 0 in dense containers
            if sparse:  # per-head cells (KVW-SPARSE-7); a callable taking ``head`` also gets the head
                call = (lambda layer, comp, t0, hd: pick(layer, comp, t0, head=hd)) if _takes_head(pick) else \
                    (lambda layer, comp, t0, hd: pick(layer, comp, t0))
                self._choice = {(layer, comp, t0, hd): index(call(layer, comp, t0, hd), comp)
                                for layer, comp, t0, hd in planned_sparse_chunks(header)}
            else:
                self._choice = {(layer, comp, t0, 0): index(pick(layer, comp, t0), comp)
                                for layer, comp, t0, _ in planned_chunks(header)}
        if len(specs) != len(header.codec_specs):
            header = header.replace(codec_specs=tuple(specs), required_features=header.required_features | FEATURE_BIT)
        self.header = header
        self._zstd = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)
        self._planes = byteplane.plane_compressor(level) if any(
            s.codec == "byteplane_zstd" or s.lossless == "byteplane_zstd" for s in specs) else None

    def encode(self, layer: int, component: str, token_start: int, x: np.ndarray, pieces: list, raw_length: int,
               head: int = 0):
        """(codec name, codec_spec, stored pieces) of one chunk; ``pieces`` are its raw bytes,
        ``x`` its [heads, tokens, dim] array (``head``: a sparse chunk's one head)."""
        c = self._by_comp.get(component, "raw") if self._choice is None else \
            self._choice.get((layer, component, token_start, head), "raw")
        if c == "raw":
            return "raw", 0, pieces
        if c == "zstd":
            frame = self._zstd.compress(pieces[0] if len(pieces) == 1 else b"".join(pieces))
            return ("zstd", 0, [frame]) if len(frame) < raw_length else ("raw", 0, pieces)  # KVW-CHUNK-6
        h = self.header
        spec = h.codec_specs[c - 1]
        if spec.codec == "byteplane_zstd":
            stored = byteplane.encode(pieces[0] if len(pieces) == 1 else b"".join(pieces), h.itemsize, self._planes)
            if sum(memoryview(p).nbytes for p in stored) >= raw_length:  # KVW-BPZ-4
                return "raw", 0, pieces
            return spec.codec, c, stored
        lay = quant.layout(spec, h.dtype, x.shape[0], x.shape[2], token_start, token_start + x.shape[1],
                           *lossy_range(h, layer, head))
        body = quant.encode(spec, x, lay)
        if spec.lossless != "raw":  # chained stage, kept only when it is shorter (KVW-CSPEC-7)
            joined = b"".join(memoryview(p).cast("B") for p in body)
            if spec.lossless == "zstd":
                staged = [self._zstd.compress(joined)]
            else:
                staged = byteplane.encode(joined, h.itemsize, self._planes)
            if sum(memoryview(p).nbytes for p in staged) < len(joined):
                body = staged
        return spec.codec, c, body


def _takes_head(pick) -> bool:
    try:
        return "head" in inspect.signature(pick).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False


def lossy_range(h, layer: int, head: int = 0) -> tuple[int, int]:
    """``[lo, hi)`` in which sink and residual tokens are counted (KVW-LOSSY-1): the layer's
    token range, or in a sparse container the head's retained index space
    ``[0, count(layer, head))`` (KVW-CSPEC-8)."""
    if h.sparse is not None:
        from .sparse_header import retained_count

        return 0, retained_count(h, layer, head)
    r = h.layer_tokens[layer]
    return r.start, r.stop


def decode_chunk(header, codec: str, spec_index: int, stored, raw_length: int, shape: tuple, layer: int,
                 token_start: int, out=None, head: int = 0):
    """Raw bytes (header dtype) of one chunk body, whatever its pipeline.

    ``spec_index`` is the record's ``codec_spec`` (``reserved0``; 0 without the feature),
    ``shape`` the chunk's [heads, tokens, dim], ``head`` a sparse chunk's ``head_start``
    (lossy specs count sink and residual tokens in its index space, KVW-CSPEC-8). Like
    ``decode_body``, returns a buffer of ``raw_length`` bytes, or fills ``out``: a buffer,
    or (codec specs only) an array
    [heads, tokens, dim] of the dtype's width with any strides, decoded in place.
    """
    if not spec_index:
        return decode_body(codec, stored, raw_length, out)
    h = header
    spec = h.codec_specs[spec_index - 1]  # in range and matching: checked with the records (KVW-CSPEC-9)
    if isinstance(out, np.ndarray) and out.ndim == 3:  # [H, T, D] of the dtype's width, any strides
        if tuple(out.shape) != tuple(shape) or out.dtype.itemsize != h.itemsize:
            raise ValueError(f"out is {out.shape} {out.dtype}, the chunk is {tuple(shape)} {h.dtype}")
        target = out
    elif out is not None and memoryview(out).nbytes < raw_length:
        raise ValueError(f"out holds {memoryview(out).nbytes} bytes, the chunk decodes to {raw_length}")
    else:
        target = None if out is None else memoryview(out).cast("B")
    if spec.codec == "byteplane_zstd":
        data = byteplane.decode(stored, raw_length, h.itemsize, out=target)
    else:
        heads, tokens, dim = shape
        lay = quant.layout(spec, h.dtype, heads, dim, token_start, token_start + tokens, *lossy_range(h, layer, head))
        body = _lossless_stage(spec, stored, lay.length, h.itemsize)
        data = quant.decode(spec, body, lay, h.dtype, out=target)
    if target is not None and target is out:
        return out
    data = data.view(np.uint8).reshape(-1)
    if len(data) != raw_length:  # unreachable after KVW-CHUNK-4; kept as a guard
        raise CodecError("DECODED_SIZE_MISMATCH", f"decoded {len(data)} bytes, record says {raw_length}",
                         rule="KVW-CHUNK-4")
    return data if out is None else out


def _lossless_stage(spec: CodecSpec, stored, length: int, width: int):
    """The lossy body (``length`` bytes) under a chunk's stored bytes (KVW-CSPEC-7)."""
    n = memoryview(stored).nbytes
    if n == length:
        return stored
    if spec.lossless == "raw" or n > length:  # KVW-LOSSY-2 without a stage, KVW-CSPEC-7 with one
        raise CodecError("DECODE_FAILED", f"{spec.codec} body of {n} bytes; its geometry needs {length}"
                         + ("" if spec.lossless == "raw" else " (or fewer through its lossless stage)"),
                         rule="KVW-LOSSY-2" if spec.lossless == "raw" else "KVW-CSPEC-7")
    if spec.lossless == "zstd":
        return decode_body("zstd", stored, length)
    return byteplane.decode(stored, length, width, rule="KVW-CSPEC-7")
