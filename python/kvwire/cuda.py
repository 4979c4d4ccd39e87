"""Loading onto a CUDA device: every body crosses host->device once, from pinned memory.

Bodies are first placed (decoded or copied) into one of two reusable pinned staging
buffers, then copied to the device tensor with ``non_blocking=True`` on a side stream;
an event per staging buffer keeps the host from overwriting a buffer still in flight.
Pinning per call would cost as much as the copy, so the ring is allocated once per load
and sized to the largest chunk.
"""

from __future__ import annotations

from .cache import KVCache
from .codecs import decode_body
from .tensors import torch_dtype


def load_to_device(reader, device, *, verify: bool = True) -> KVCache:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} requested but torch reports no CUDA device")
    h = reader.header
    dt = torch_dtype(h.dtype)
    recs = reader.records
    biggest = int(recs["raw_length"].max()) if len(recs) else 1
    ring = [torch.empty(biggest, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    done = [None, None]
    stream = torch.cuda.Stream(device=device)
    layers = []
    with torch.cuda.stream(stream):
        dst = {}
        for i, spec in enumerate(h.arch.layers):
            n = h.layer_tokens[i].count
            dst[i] = {c: torch.empty(spec.shape(c, n), dtype=dt, device=device) for c in spec.components}
        for j in range(len(recs)):
            c, stored = reader._stored(j, verify)
            slot = j % 2
            if done[slot] is not None:
                done[slot].synchronize()
            staging = ring[slot][: c.raw_length]
            decode_body(c.codec, stored, c.raw_length, out=staging.numpy())
            a = c.token_start - h.layer_tokens[c.layer].start
            src = staging.view(dt).view(c.shape)
            dst[c.layer][c.component][:, a : a + c.token_count, :].copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
            done[slot] = ev
        stream.synchronize()
        layers = [dst[i] for i in range(h.num_layers)]
    return KVCache(h, layers)
