"""Decoding one chunk body, whatever its pipeline: raw and zstd (spec section 13) or a
codec spec of spec/codecs.md (``byteplane_zstd``, ``fp8``, ``int_affine``, each with its
chained lossless stage). A lossy pipeline's intermediate body has a length fixed by the
chunk geometry (``quant.layout``), so its lossless stage is bounded like a zstd body.

When native decoding is enabled (``codecs.native``: ``KVWIRE_NATIVE`` or ``enable()``),
every codec but raw decodes through libkvwire instead; numpy stays the reference and the
default, and takes any request the native path does not (an ``out`` given as pieces or
strided).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..format.codec_specs import CodecSpec
from ..format.errors import CodecError, FormatError
from ..format.header import Header
from ..format.sparse import retained_count
from . import byteplane, native, quant
from .kernels import scratch
from .zstd import checksum_required, decode_body


def lossy_range(h: Header, layer: int, head: int = 0) -> tuple[int, int]:
    """``[lo, hi)`` in which sink and residual tokens are counted (KVW-LOSSY-1): the layer's
    token range, or in a sparse container the head's retained index space
    ``[0, count(layer, head))`` (KVW-CSPEC-8)."""
    if h.sparse is not None:
        return 0, retained_count(h, layer, head)
    r = h.layer_tokens[layer]
    return r.start, r.stop


def decode_chunk(header: Header, codec: str, spec_index: int, stored: Any, raw_length: int, shape: tuple[int, ...],
                 layer: int, token_start: int, out: Any = None, head: int = 0) -> Any:
    """Raw bytes (header dtype) of one chunk body, whatever its pipeline.

    ``spec_index`` is the record's ``codec_spec`` (``reserved0``; 0 without the feature),
    ``shape`` the chunk's [heads, tokens, dim], ``head`` a sparse chunk's ``head_start``
    (lossy specs count sink and residual tokens in its index space, KVW-CSPEC-8). Like
    ``decode_body``, returns a buffer of ``raw_length`` bytes, or fills ``out``: a buffer,
    or (codec specs only) an array
    [heads, tokens, dim] of the dtype's width with any strides, decoded in place.
    """
    if codec != "raw" and native.available():
        got = _native(header, codec, spec_index, stored, raw_length, shape, layer, token_start, out, head)
        if got is not None:
            return got
    need = checksum_required(header)  # KVW-CODEC-5
    if not spec_index:
        return decode_body(codec, stored, raw_length, out, checksum_required=need)
    h = header
    spec = h.codec_specs[spec_index - 1]  # in range and matching: checked with the records (KVW-CSPEC-9)
    target: Any
    if isinstance(out, np.ndarray) and out.ndim == 3:  # [H, T, D] of the dtype's width, any strides
        if tuple(out.shape) != tuple(shape) or out.dtype.itemsize != h.itemsize:
            raise ValueError(f"out is {out.shape} {out.dtype}, the chunk is {tuple(shape)} {h.dtype}")
        target = out
    elif out is not None and memoryview(out).nbytes < raw_length:
        raise ValueError(f"out holds {memoryview(out).nbytes} bytes, the chunk decodes to {raw_length}")
    else:
        target = None if out is None else memoryview(out).cast("B")
    if spec.codec == "byteplane_zstd":
        data = byteplane.decode(stored, raw_length, h.itemsize, out=target, checksum_required=need)
    else:
        heads, tokens, dim = shape
        lay = quant.layout(spec, h.dtype, heads, dim, token_start, token_start + tokens, *lossy_range(h, layer, head))
        body = _lossless_stage(spec, stored, lay.length, h.itemsize, need)
        data = quant.decode(spec, body, lay, h.dtype, out=target)
    if target is not None and target is out:
        return out
    data = data.view(np.uint8).reshape(-1)
    if len(data) != raw_length:  # unreachable after KVW-CHUNK-4; kept as a guard
        raise CodecError("DECODED_SIZE_MISMATCH", f"decoded {len(data)} bytes, record says {raw_length}",
                         rule="KVW-CHUNK-4")
    return data if out is None else out


def _lossless_stage(spec: CodecSpec, stored: Any, length: int, width: int, need_checksum: bool = False) -> Any:
    """The lossy body (``length`` bytes) under a chunk's stored bytes (KVW-CSPEC-7); with a
    lossless stage, a per-thread scratch buffer valid until this thread's next call."""
    n = memoryview(stored).nbytes
    if n == length:
        return stored
    if spec.lossless == "raw" or n > length:  # KVW-LOSSY-2 without a stage, KVW-CSPEC-7 with one
        raise CodecError("DECODE_FAILED", f"{spec.codec} body of {n} bytes; its geometry needs {length}"
                         + ("" if spec.lossless == "raw" else " (or fewer through its lossless stage)"),
                         rule="KVW-LOSSY-2" if spec.lossless == "raw" else "KVW-CSPEC-7")
    body = scratch(40, length, np.uint8)  # reused: the lossy decoder reads it once, right away
    if spec.lossless == "zstd":
        return decode_body("zstd", stored, length, out=body, checksum_required=need_checksum)
    return byteplane.decode(stored, length, width, rule="KVW-CSPEC-7", out=body, checksum_required=need_checksum)


def _native(header: Header, codec: str, spec_index: int, stored: Any, raw_length: int, shape: tuple[int, ...],
            layer: int, token_start: int, out: Any, head: int) -> Any:
    """``decode_chunk`` through libkvwire, or None when it does not take the request."""
    if isinstance(out, list):
        return None
    if isinstance(out, np.ndarray) and out.ndim == 3:
        if tuple(out.shape) != tuple(shape) or out.dtype.itemsize != header.itemsize or not out.flags.c_contiguous:
            return None  # numpy says what is wrong, or writes the strides
    elif out is not None:
        n = memoryview(out).nbytes
        if n < raw_length or (not spec_index and n != raw_length):
            return None  # numpy's ValueError
    rec = native.record(header, codec, spec_index, memoryview(stored).nbytes, raw_length, shape, layer,
                        token_start, head)
    try:
        return native.decode_wire(header, rec, stored, out)
    except ValueError as exc:  # not a FormatError: an out buffer C cannot write (read-only, strided)
        if isinstance(exc, FormatError):
            raise
        return None
