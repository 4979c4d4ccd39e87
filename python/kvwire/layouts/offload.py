"""Saving from the GPU without stalling the engine: a pinned host ring of pages.

The engine hands pages (blocks of all layers) to the ring in sequence; position ``p`` of
that sequence lives in host slot ``p % num_slots`` of one pinned buffer in the
``kvwire.page`` layout (pages, L, 2, H, page_tokens, C). Three pointers over the sequence
manage it (``start <= current <= end``):

* ``end``: the planned offload boundary. ``plan(blocks)`` issues the asynchronous
  device->host copies of the next pages and advances it.
* ``current``: how far pages have been offloaded: the copies of every position below it
  have completed (advanced in order, as their events complete).
* ``start``: the beginning of the free region: pages below it have been handed back to
  the engine's allocator by ``allocate(n)``, which returns the engine blocks of positions
  [start, start+n). An allocation past ``current`` waits for the offload to complete, so
  the engine never overwrites a block whose copy is still in flight.

The gap ``end - start`` trades memory for allocation latency: planning further ahead
keeps more blocks (and host slots) committed to the offload but lets ``allocate`` find
its pages already copied. A fourth counter, ``released``, is the encoder's: a host slot
is planned again only after the page it held was released (``release(upto)``), so no page
is overwritten before it was encoded; ``plan`` waits for that (or raises
``RingFullError`` after ``timeout``).

Encoding reads straight from the ring: ``iter_buffers`` feeds ``kvwire.Encoder`` with
views of the pinned pages (a chunk of one page is a zero-copy view, heads outermost), so
the bytes go from the ring to the file or socket without another copy. Release the
pages only once those buffers were consumed (``save`` does it for you).
"""

from __future__ import annotations

import collections
import threading
import time

import numpy as np

from ..cache.cuda import int_view, stream_for
from ..cache.encoder import Encoder
from ..cache.files import atomic_write
from ..codecs import DEFAULT_ZSTD_LEVEL
from ..format.chunks import planned_chunks
from ..format.errors import Error
from .binding import EngineBuffers, LayoutMismatchError
from .engine import architecture_of
from .ids import id_runs


class RingFullError(Error, TimeoutError):
    """No free host slot: the encoder has not released enough pages within the timeout."""

    code = "OFFLOAD_RING_FULL"


class OffloadRing:
    """A pinned host ring for the pages of ``eb`` (bound engine buffers).

    ``stream``: the copy engine (default: a side ``CudaStream`` for CUDA buffers; copies
    are synchronous for CPU buffers unless a ``SimulatedStream`` is given).
    ``page_tokens``: tokens per page for token-slot layouts (page ``p`` = slots
    ``p*page_tokens ...``); paged layouts use their block size.
    """

    def __init__(self, eb: EngineBuffers, num_slots: int, *, stream=None, page_tokens: int | None = None):
        import torch

        g0 = eb.geometry[0]
        if any(g.mla != g0.mla or g.heads != g0.heads or g.dim_k != g0.dim_k or g.dim_v != g0.dim_v
               for g in eb.geometry):
            raise LayoutMismatchError("the offload ring needs every layer to have the same geometry")
        if not g0.mla and g0.dim_k != g0.dim_v:
            raise LayoutMismatchError("the offload ring needs head_dim_k == head_dim_v")
        if eb.layout.addressing == "block":
            if page_tokens not in (None, eb.block_size):
                raise ValueError(f"pages of a paged layout are its blocks ({eb.block_size} tokens)")
            page_tokens = eb.block_size
        elif not page_tokens:
            raise ValueError(f"{eb.layout.name} addresses token slots: give page_tokens")
        if num_slots < 1:
            raise ValueError("num_slots must be >= 1")
        self.eb = eb
        self.num_slots = num_slots
        self.page_tokens = page_tokens
        self.stream = stream_for(eb.device, stream)
        L = eb.num_layers
        shape: tuple[int, ...]
        if g0.mla:
            shape, layout = (num_slots, L, 1, page_tokens, g0.dim_k), "kvwire.page.mla"
        else:
            shape, layout = (num_slots, L, 2, g0.heads, page_tokens, g0.dim_k), "kvwire.page"
        nbytes = int(np.prod(shape)) * eb.torch_dtype.itemsize
        raw = self.stream.host_empty(nbytes) if self.stream is not None else torch.empty(nbytes, dtype=torch.uint8)
        self.buffer = raw[:nbytes].view(eb.torch_dtype).view(shape)
        self.pages = EngineBuffers(layout, self.buffer, kv_lora_rank=eb.kv_lora_rank, num_layers=L,
                                   num_heads=None if g0.mla else g0.heads, block_size=page_tokens)
        self._ring = int_view(self.buffer)
        self.start = self.current = self.end = self.released = 0
        self._cv = threading.Condition()
        self._inflight: collections.deque = collections.deque()  # (position after the run, event)
        self._blocks: collections.deque = collections.deque()  # engine block of each position >= start
        self.stats = {"plan_waits": 0, "alloc_waits": 0, "alloc_wait_s": 0.0, "copies": 0}

    # -- producer: the engine ----------------------------------------------------------------

    def plan(self, blocks, *, timeout: float | None = None) -> range:
        """Offload the engine ``blocks`` (in sequence order): positions [end, end+n)."""
        b = np.asarray(blocks.cpu() if hasattr(blocks, "cpu") else blocks, dtype=np.int64).reshape(-1)
        n = len(b)
        if n > self.num_slots:
            raise ValueError(f"{n} pages exceed the ring's {self.num_slots} slots")
        cap = min(g.capacity for g in self.eb.geometry)
        limit = cap if self.eb.layout.addressing == "block" else cap // self.page_tokens
        if n and (b.min() < 0 or b.max() >= limit):
            raise LayoutMismatchError(f"pages outside [0, {limit}) of the engine buffers")
        with self._cv:
            if self.end + n - self.released > self.num_slots:
                self.stats["plan_waits"] += 1
                if not self._cv.wait_for(lambda: self.end + n - self.released <= self.num_slots, timeout):
                    raise RingFullError(f"{self.end - self.released} of {self.num_slots} slots hold pages not yet "
                                        f"released by the encoder; {n} more do not fit")
            pos0 = self.end
        if self.stream is not None:
            self.stream.wait_current()  # the pages must be complete on the engine's stream
        p, i = pos0, 0
        while i < n:  # one copy job per run of consecutive slots (a wrap splits the run)
            s = p % self.num_slots
            cnt = min(n - i, self.num_slots - s)
            job = self._job(s, b[i : i + cnt])
            ev = self.stream.launch(job) if self.stream is not None else job()
            self.stats["copies"] += 1
            with self._cv:
                self._inflight.append((p + cnt, ev))
            p, i = p + cnt, i + cnt
        with self._cv:
            self._blocks.extend(b.tolist())
            self.end = pos0 + n
        self.poll()
        return range(pos0, pos0 + n)

    def _job(self, slot: int, pages: np.ndarray):
        import torch

        eb, ring, P = self.eb, self._ring, self.page_tokens
        on_device = eb.device.type != "cpu"
        comps = eb.geometry[0].components
        mla = eb.geometry[0].mla

        def run():
            idx = torch.as_tensor(pages if eb.layout.addressing == "block"
                                  else (pages[:, None] * P + np.arange(P)).reshape(-1), device=eb.device)
            dst_all = ring[slot : slot + len(pages)]
            tmp = torch.empty(dst_all.shape, dtype=ring.dtype, device=eb.device) if on_device else dst_all
            for layer in range(eb.num_layers):
                for kv, comp in enumerate(comps):
                    v = eb.int_views[layer][comp]
                    if eb.layout.addressing == "block":
                        src = v.permute(0, 2, 1, 3)  # (B, H, N, C)
                    else:  # (T, H, C) -> pages of P slots
                        src = v.permute(1, 0, 2)
                    out = tmp[:, layer] if mla else tmp[:, layer, kv]  # (pages, H, N, C)
                    if eb.layout.addressing != "block":
                        out.copy_(torch.index_select(src, 1, idx).unflatten(1, (len(pages), P)).transpose(0, 1))
                    elif on_device:  # one gather kernel, then a device-local copy into the page tmp
                        out.copy_(torch.index_select(src, 0, idx))
                    else:  # strided copies per run of pages: far faster than CPU index kernels
                        for j, p0, k in id_runs(pages):
                            out[j : j + k].copy_(src[p0 : p0 + k])
            if on_device:
                dst_all.copy_(tmp, non_blocking=True)  # one DMA of whole pages

        return run

    def poll(self) -> int:
        """Advance ``current`` over completed copies (never blocks); returns it."""
        with self._cv:
            while self._inflight and (self._inflight[0][1] is None or self._inflight[0][1].query()):
                self.current = self._inflight.popleft()[0]
            return self.current

    def wait(self, pos: int) -> None:
        """Block until the pages below ``pos`` are in host memory."""
        if pos > self.end:
            raise ValueError(f"position {pos} is past the planned offload boundary {self.end}")
        while self.poll() < pos:
            with self._cv:
                ev = self._inflight[0][1]
            ev.synchronize()

    def allocate(self, n: int) -> list[int]:
        """Hand the engine blocks of positions [start, start+n) back to the engine; waits
        for their offload when they lie past ``current``."""
        if self.start + n > self.end:
            raise ValueError(f"allocation of {n} pages past the planned offload boundary (start {self.start}, "
                             f"end {self.end}): plan() them first")
        if self.poll() < self.start + n:
            t = time.perf_counter()
            self.wait(self.start + n)
            self.stats["alloc_waits"] += 1
            self.stats["alloc_wait_s"] += time.perf_counter() - t
        with self._cv:
            out = [self._blocks.popleft() for _ in range(n)]
            self.start += n
        return out

    # -- consumer: the encoder ---------------------------------------------------------------

    def slots(self, positions: range) -> np.ndarray:
        if positions.start < self.released or positions.stop > self.end:
            raise ValueError(f"positions [{positions.start}, {positions.stop}) outside the live pages "
                             f"[{self.released}, {self.end})")
        return np.arange(positions.start, positions.stop) % self.num_slots

    def page(self, pos: int):
        """Zero-copy view of the page at ``pos`` (waits for its offload)."""
        slot = int(self.slots(range(pos, pos + 1))[0])
        self.wait(pos + 1)
        return self.buffer[slot]

    def release(self, upto: int) -> None:
        """The encoder is done with every page below ``upto``: their slots may be reused."""
        with self._cv:
            if upto > self.current:
                raise ValueError(f"release({upto}) past the offloaded pages (current {self.current})")
            self.released = max(self.released, upto)
            self._cv.notify_all()

    def header(self, num_tokens: int, **fields):
        from .engine import header_for

        fields.setdefault("chunk_tokens", self.page_tokens)
        return header_for(self.eb, num_tokens, arch=fields.pop("arch", None) or architecture_of(self.eb), **fields)

    def iter_buffers(self, positions: range, num_tokens: int, *, codec: str = "raw", level: int = DEFAULT_ZSTD_LEVEL,
                     form: str = "file", **header_fields):
        """Container buffers of the sequence whose pages are ``positions`` (token order),
        read straight from the ring. ``chunk_tokens`` defaults to the page size, which
        makes every raw body a view of the pinned pages."""
        slots = self.slots(positions)
        if len(slots) * self.page_tokens < num_tokens:
            raise ValueError(f"{len(slots)} pages hold fewer than {num_tokens} tokens")
        self.wait(positions.stop)
        h = self.header(num_tokens, **header_fields)
        enc = Encoder(h, codec=codec, level=level)
        yield from enc.begin()
        for layer, comp, t0, n in planned_chunks(h):
            yield from enc.chunk(layer, comp, t0, self.pages.gather_range(layer, comp, slots, t0, t0 + n))
        yield from enc.end(form=form)

    def save(self, path, positions: range, num_tokens: int, *, release: bool = True, fsync: bool = False,
             **opts) -> int:
        """Write the sequence atomically; then release its pages (unless ``release=False``)."""
        size = atomic_write(path, self.iter_buffers(positions, num_tokens, form="file", **opts), fsync=fsync)
        if release:
            self.release(positions.stop)
        return size

    def __repr__(self) -> str:
        return (f"<OffloadRing {self.num_slots} slots of {self.page_tokens} tokens: start {self.start}, current "
                f"{self.current}, end {self.end}, released {self.released}>")
