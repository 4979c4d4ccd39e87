"""Scatter: decoded chunks -> engine buffers (``ScatterMixin``, ``ScatterHandle``).

``scatter`` copies each decoded chunk (a view of the container bytes for raw bodies)
into the engine's buffers with one ``index_put_`` (or ``copy_`` for contiguous runs):
one copy from the received bytes to the destination, none in between. On a device the
bytes pass through the pinned staging ring of ``kvwire.cache.cuda`` (host copy, DMA, device
scatter), layer by layer, with an event per layer; ``ScatterHandle`` waits for them.

A mixin of ``EngineBuffers`` (binding.py), which supplies the bound views and the
checks: ``layout``, ``block_size``, ``device``, ``int_views``, ``use_index_kernels()``,
``ids_within()`` and ``check_header()``. All copies go through integer views of the
elements' width, so they are bit-exact for every dtype (NaN payloads, fp8) and use
kernels every device implements.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..cache.cuda import StagingRing, host_chunk, stream_for
from ..format.header import Header
from .descriptor import BoundBuffers
from .ids import id_runs, run_start

__all__ = ["ScatterHandle", "ScatterMixin"]


class ScatterMixin(BoundBuffers):
    """The scatter methods of ``EngineBuffers``."""

    if TYPE_CHECKING:  # supplied by EngineBuffers (binding.py)
        def ids_within(self, ids, num_tokens: int, layer_capacity: int, *, unique: bool) -> np.ndarray: ...
        def check_header(self, h: Header) -> None: ...

    def _targets(self, a: np.ndarray, num_tokens: int, device):
        """Per token of the cache: engine (block, offset) or slot, as device index tensors."""
        import torch

        t = np.arange(num_tokens)
        if self.layout.addressing == "block":
            N = self.block_size
            return (torch.as_tensor(a[t // N], device=device), torch.as_tensor(t % N, device=device))
        return (torch.as_tensor(a, device=device),)

    def _put(self, layer: int, comp: str, a: np.ndarray, idx, t0: int, src) -> None:
        """One copy of ``src`` [H, tc, C] (integer view) to tokens [t0, t0+tc) of the engine:
        ``index_put_`` on devices, strided ``copy_`` per run of blocks/slots on the CPU."""
        dst = self.int_views[layer][comp]
        n = src.shape[1]
        vals = src.permute(1, 0, 2)  # (tokens, H, C): a view, never materialized
        if self.layout.addressing == "block":
            N = self.block_size
            b0, b1 = t0 // N, (t0 + n - 1) // N + 1
            if self.use_index_kernels() and run_start(a[b0:b1]) is None:
                dst.index_put_((idx[0][t0 : t0 + n], idx[1][t0 : t0 + n]), vals)
                return
            mergeable = dst.stride(0) == dst.shape[1] * dst.stride(1)
            for j, b, k in id_runs(a[b0:b1]):
                lo, hi = max(t0, (b0 + j) * N), min(t0 + n, (b0 + j + k) * N)  # tokens of this run
                off = lo - (b0 + j) * N
                if k == 1 or mergeable:
                    dst[b : b + k].flatten(0, 1)[off : off + hi - lo].copy_(vals[lo - t0 : hi - t0])
                else:
                    for q in range(k):
                        s, e = max(lo, (b0 + j + q) * N), min(hi, (b0 + j + q + 1) * N)
                        dst[b + q, s - (b0 + j + q) * N : e - (b0 + j + q) * N].copy_(vals[s - t0 : e - t0])
            return
        slots = a[t0 : t0 + n]
        if self.use_index_kernels() and run_start(slots) is None:
            dst.index_put_((idx[0][t0 : t0 + n],), vals)
            return
        for j, s0, k in id_runs(slots):
            dst[s0 : s0 + k].copy_(vals[j : j + k])

    def scatter(self, reader, ids, *, verify: bool = True, stream=None, ring: StagingRing | None = None,
                registered: bool = False) -> ScatterHandle:
        """Decode ``reader``'s chunks straight into these buffers at the positions of ``ids``.

        Checks the header against the buffers first (``check_header``). CPU buffers: one
        copy per chunk, done on return. Device buffers (or an explicit ``stream``): through
        a staging ring with a device mirror, asynchronously; the handle's ``wait_layer(i)``
        and ``synchronize()`` wait for the copies.
        """
        h = reader.header
        self.check_header(h)
        capacity = min([g.capacity for s, g in zip(h.arch.layers, self.geometry) if s.kind != "shared"] or [0])
        a = self.ids_within(ids, h.token_count, capacity, unique=True)
        stream = (ring.stream if ring is not None else None) or stream_for(self.device, stream)
        if stream is None and self.device.type != "cpu":
            raise ValueError(f"buffers on {self.device}: pass a stream for this device type")
        idx = self._targets(a, h.token_count, self.device if stream is None else stream.device)
        if stream is None:
            for layer, spec in enumerate(h.arch.layers):
                for comp in spec.components:
                    for j in range(reader.num_chunks(layer, comp)):
                        i = reader.record_index(layer, comp, j)
                        c, src = host_chunk(reader, i, verify)
                        self._put(layer, comp, a, idx, c.token_start, src)
            return ScatterHandle(None, [None] * h.num_layers)
        return self._scatter_async(reader, a, idx, verify, stream, ring, registered)

    def _scatter_async(self, reader, a, idx, verify, stream, ring, registered) -> ScatterHandle:
        h = reader.header
        recs = reader.records
        biggest = int(recs["raw_length"].max()) if len(recs) else 1
        if ring is None:
            ring = StagingRing(stream, biggest, 2, device_mirror=True)
        elif not ring.device_mirror:
            raise ValueError("scatter to a device needs a staging ring with device_mirror=True")
        ring.ensure(biggest)
        stream.wait_current()  # the engine's pending work on these buffers comes first
        events = []
        for layer, spec in enumerate(h.arch.layers):
            for comp in spec.components:
                for j in range(reader.num_chunks(layer, comp)):
                    i = reader.record_index(layer, comp, j)
                    if registered:
                        c, src = host_chunk(reader, i, verify)
                        slot = ring.acquire(c.raw_length)
                    else:
                        c, stored = reader.stored(i, verify)
                        slot = ring.acquire(c.raw_length)
                        host = ring.host[slot][: c.raw_length]
                        reader.decode_stored(i, c, stored, out=host.numpy())
                        src = host.view(self.int_views[layer][comp].dtype).view(c.shape)
                    dev = ring.device[slot][: c.raw_length].view(src.dtype).view(c.shape)

                    def work(dev=dev, src=src, layer=layer, comp=comp, t0=c.token_start):
                        dev.copy_(src, non_blocking=True)
                        self._put(layer, comp, a, idx, t0, dev)

                    ring.launch(slot, work, keep=src)
            events.append(stream.record())
        return ScatterHandle(stream, events, ring)


class ScatterHandle:
    """Completion of a scatter: one event per layer (None when already done)."""

    def __init__(self, stream, events, ring=None):
        self.stream = stream
        self.events = events
        self.ring = ring

    def done(self) -> bool:
        return all(e is None or e.query() for e in self.events)

    def wait_layer(self, layer: int) -> None:
        """Block the host until ``layer`` is in place."""
        if self.events[layer] is not None:
            self.events[layer].synchronize()

    def stream_wait_layer(self, layer: int) -> None:
        """Make the caller's current device stream wait for ``layer`` (the host goes on):
        what an engine's ``wait_for_layer_load`` needs."""
        if self.events[layer] is not None:
            self.stream.wait_event(self.events[layer])

    def synchronize(self) -> None:
        for e in self.events:
            if e is not None:
                e.synchronize()
        if self.ring is not None:
            self.ring.drain()
