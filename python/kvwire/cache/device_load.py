"""``load(device=...)``: a whole container onto a device through the pinned staging ring,
lossy chunks dequantized on the device.

Why its own module: the ring and streams (``cuda``) are shared with the engine scatter
paths; this is the one consumer that decides per chunk what crosses the link. Raw bodies
are staged (or, ``registered=True``, copied from page-locked container bytes) as they are;
lossless codecs are decoded on the host; fp8 and int_affine bodies cross as
their lossy body (sink and residual tokens, scales, zeros, packed codes: 0.3-0.5 of the
decoded bytes), after the lossless stage and the parameter checks on the host, and
``codecs.torch_dequant`` decodes them on the device, bit-exact with the numpy decoder.
"""

from __future__ import annotations

import numpy as np

from ..codecs import byteplane, quant
from ..codecs import torch_dequant as TD
from ..codecs.pipeline import lossy_range
from ..codecs.zstd import checksum_required, decode_body
from .cuda import StagingRing, host_chunk, int_view, stream_for
from .kvcache import KVCache
from .tensors import torch_dtype


def load_to_device(reader, device, *, verify: bool = True, ring: StagingRing | None = None, stream=None,
                   registered: bool = False, device_dequant: bool = True) -> KVCache:
    """The whole cache on ``device``, chunk by chunk through ``ring`` (made if not given).

    ``device_dequant=False``: lossy chunks are decoded on the host and cross decoded (the
    comparison ``benchmarks/gpu_check.py`` times, and a fallback).

    ``registered=True``: the reader's buffer is page-locked (``HostRegistration``), so raw
    bodies are copied straight from it. ``stream`` selects the copy engine (default: a
    ``CudaStream``; tests pass a ``SimulatedStream`` and a CPU device)."""
    h = reader.header
    if any(s.kind == "state" for s in h.arch.layers):  # per-tensor dtypes and shapes (spec/crossmodel.md)
        raise ValueError("load_to_device does not place state layers yet: load on the host, then move them")
    stream = (ring.stream if ring is not None else None) or stream_for(device, stream)
    if stream is None:
        raise ValueError(f"load_to_device needs a CUDA device or an explicit stream, not {device!r}")
    dt = torch_dtype(h.dtype)
    recs = reader.records
    biggest = int(recs["raw_length"].max()) if len(recs) else 1
    if ring is None:
        ring = StagingRing(stream, biggest, 2)
    ring.ensure(biggest)
    stream.wait_current()
    dst = []
    for spec, r in zip(h.arch.layers, h.layer_tokens):
        dst.append({c: stream.device_empty(spec.shape(c, r.count), dt) for c in spec.components})
    pending = []  # registered mode: (event, source view) kept alive until copied
    for j in range(len(recs)):
        c, stored = reader.stored(j, verify)
        a = c.token_start - h.layer_tokens[c.layer].start
        d = int_view(dst[c.layer][c.component])[:, a : a + c.token_count, :]
        if registered and c.codec == "raw":
            _, src = host_chunk(reader, j, verify, stored)
            pending.append((stream.launch(lambda d=d, s=src: d.copy_(s, non_blocking=True)), src))
            while pending and pending[0][0].query():
                pending.pop(0)
            continue
        lossy = lossy_body(reader, j, c, stored) if device_dequant else None
        if lossy is not None:  # compressed over the link, dequantized on the device
            spec, lay, body = lossy
            slot = ring.acquire(lay.length)
            host = ring.host[slot][: lay.length]
            host.numpy()[:] = np.frombuffer(body, np.uint8, lay.length)
            ring.staged += lay.length
            ring.launch(slot, lambda d=d, s=host, sp=spec, ly=lay: TD.dequant(
                sp, s.to(d.device, non_blocking=True), ly, h.dtype, d, checked=True))
            continue
        slot = ring.acquire(c.raw_length)
        host = ring.host[slot][: c.raw_length]
        ring.staged += c.raw_length
        reader.decode_stored(j, c, stored, out=host.numpy())
        src = int_view(host.view(dt)).view(c.shape)
        ring.launch(slot, lambda d=d, s=src: d.copy_(s, non_blocking=True))
    stream.synchronize()
    ring.drain()
    return KVCache(h, dst)


def lossy_body(reader, j: int, c, stored):
    """(spec, layout, checked lossy body on the host) for a fp8 / int_affine record, else
    None: the lossless stage runs here, the parameter checks too (a few bytes, no sync).
    Rotated, codebook and 3-bit specs (revisions 1.2 and 1.3) have no device kernel yet: None,
    so they are decoded on the host and cross decoded."""
    h = reader.header
    k = int(reader.records["reserved0"][j]) if h.codec_specs else 0
    if not k or h.codec_specs[k - 1].codec not in ("fp8", "int_affine"):
        return None
    if h.codec_specs[k - 1].needs_rotation_bit:  # revisions 1.2/1.3 (rotations, codebooks, 3 bits): host decode
        return None
    spec = h.codec_specs[k - 1]
    head = int(reader.records["head_start"][j]) if h.sparse is not None else 0
    heads, tokens, dim = c.shape
    lay = quant.layout(spec, h.dtype, heads, dim, c.token_start, c.token_start + tokens,
                       *lossy_range(h, c.layer, head))
    n = memoryview(stored).nbytes
    if n == lay.length:
        body = stored
    elif spec.lossless == "zstd" and n < lay.length:
        body = decode_body("zstd", stored, lay.length, checksum_required=checksum_required(h))
    elif spec.lossless != "raw" and n < lay.length:
        body = byteplane.decode(stored, lay.length, h.itemsize, rule="KVW-CSPEC-7",
                                checksum_required=checksum_required(h))
    else:  # the numpy decoder says why
        reader.decode_stored(j, c, stored)
        return None
    TD.check(spec, body, lay)
    return spec, lay, body
