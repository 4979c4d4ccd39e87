"""Layer-wise streaming over sockets, pipes and files: ``Writer``, ``Reader``, ``TransferStats``."""

from __future__ import annotations

import io
import math
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..format import registry as R
from ..cache.kvcache import KVCache
from ..format.chunks import ChunkTable, grid
from ..codecs import DEFAULT_ZSTD_LEVEL
from ..cache.decoder import IOV_MAX, ChunkEvent, HeaderEvent, Placed, StreamDecoder
from ..format.header import Header
from ..format.limits import DEFAULT_MAX_DECODED_BYTES
from ..cache.tensors import as_numpy, as_uint, torch_dtype
from ..cache.encoder import Encoder

__all__ = ["Layer", "Placed", "Reader", "TransferStats", "Writer"]


# ---------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------

@dataclass
class TransferStats:
    """Bytes moved and time taken by one reader or writer.

    ``seconds`` runs from the first transport call to the end of the last one;
    ``gbps`` is bytes / seconds in GB/s (1e9 B/s); ``utilization`` compares it with the
    declared ``link_gbps`` (None when no bandwidth was declared). ``layer_s[i]`` is when
    layer i was usable (reader) or fully handed to the transport (writer), in seconds
    from the start; ``first_byte_s`` is when the first transport call completed.
    """

    direction: str
    link_gbps: float | None = None
    bytes: int = 0
    calls: int = 0
    started: float | None = None
    finished: float | None = None
    first_byte: float | None = None
    layer_s: dict = field(default_factory=dict)

    def begin(self) -> None:
        if self.started is None:
            self.started = time.perf_counter()

    def add(self, nbytes: int) -> None:
        self.bytes += nbytes
        self.calls += 1
        self.finished = time.perf_counter()
        if self.first_byte is None:
            self.first_byte = self.finished

    def mark_layer(self, layer: int) -> None:
        self.layer_s[layer] = time.perf_counter() - (self.started or time.perf_counter())

    @property
    def seconds(self) -> float:
        if self.started is None or self.finished is None:
            return 0.0
        return self.finished - self.started

    @property
    def gbps(self) -> float:
        s = self.seconds
        return self.bytes / s / 1e9 if s > 0 else 0.0

    @property
    def utilization(self) -> float | None:
        return self.gbps / self.link_gbps if self.link_gbps else None

    @property
    def first_byte_s(self) -> float | None:
        return None if self.first_byte is None else self.first_byte - self.started

    @property
    def first_layer_s(self) -> float | None:
        return self.layer_s[min(self.layer_s)] if self.layer_s else None

    def as_dict(self) -> dict:
        return {"direction": self.direction, "bytes": self.bytes, "calls": self.calls, "seconds": self.seconds,
                "gbps": self.gbps, "link_gbps": self.link_gbps, "utilization": self.utilization,
                "first_byte_s": self.first_byte_s, "first_layer_s": self.first_layer_s}

    def __str__(self) -> str:
        u = self.utilization
        return (f"{self.direction}: {self.bytes} B in {self.seconds * 1e3:.2f} ms = {self.gbps:.3f} GB/s"
                + (f", {u:.0%} of {self.link_gbps:g} GB/s" if u is not None else "") + f", {self.calls} calls")


# ---------------------------------------------------------------------------------------
# Transports
# ---------------------------------------------------------------------------------------

def _fileno(obj):
    if isinstance(obj, int):
        return obj
    try:
        return obj.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None


def _send_all(call, buffers) -> int:
    """Send every buffer with ``call(list) -> bytes sent`` (sendmsg, writev), <= IOV_MAX per call."""
    bufs = [b for b in (memoryview(x).cast("B") for x in buffers) if b.nbytes]
    total, i = 0, 0
    while i < len(bufs):
        n = call(bufs[i : i + IOV_MAX])
        total += n
        while i < len(bufs) and n >= bufs[i].nbytes:
            n -= bufs[i].nbytes
            i += 1
        if n:
            bufs[i] = bufs[i][n:]
    return total


def sender_for(sink):
    """``send(buffers) -> bytes`` for a sink, without copying the buffers."""
    if isinstance(sink, socket.socket):
        return lambda bufs: _send_all(sink.sendmsg, bufs)
    fd = _fileno(sink)
    if fd is not None:
        flush = getattr(sink, "flush", None)
        if flush is not None:
            flush()  # anything the file object buffered goes first
        return lambda bufs: _send_all(lambda b: os.writev(fd, b), bufs)
    if hasattr(sink, "write"):
        def send(bufs):
            n = 0
            for b in bufs:
                mv = memoryview(b).cast("B")
                sink.write(mv)
                n += mv.nbytes
            return n
        return send
    raise TypeError(f"cannot send to {type(sink).__name__}: need a socket, a file descriptor or write()")


def _receiver(source):
    """``recv(targets) -> bytes`` filling writable buffers in order (0 at end of input)."""
    if isinstance(source, socket.socket):
        def recv(targets):
            if len(targets) == 1:
                return source.recv_into(targets[0])
            return source.recvmsg_into(targets)[0]
        return recv
    if isinstance(source, int) or isinstance(source, io.FileIO):
        fd = _fileno(source)
        return lambda targets: os.readv(fd, targets)
    if hasattr(source, "readinto"):
        def recv(targets):
            total = 0
            for t in targets:
                n = source.readinto(t) or 0
                total += n
                if n < t.nbytes:
                    break
            return total
        return recv
    raise TypeError(f"cannot receive from {type(source).__name__}: need a socket, a file descriptor or readinto()")


# ---------------------------------------------------------------------------------------
# Layer-wise writer
# ---------------------------------------------------------------------------------------

class Writer:
    """Stream form, layer by layer: ``write_layer(i, k, v)`` as each layer is computed.

    The preamble and header are sent at construction. Each layer's chunks (canonical
    order within the layer) are encoded in the caller's thread (checksums) and sent
    from a background thread in ``sendmsg``/``writev`` batches of about ``batch_bytes``
    that point into the caller's tensors (the first batch leaves while the rest of the
    layer is still being checksummed). At most ``depth`` layers are queued or in
    flight; ``write_layer`` waits beyond that. The caller must not modify a layer's
    tensors until ``close()`` (or until ``depth`` more layers were written).
    ``close()`` sends the end frame once every layer was written (KVW-CHUNK-8); leaving
    a ``with`` block by an exception abandons the stream without an end frame
    (KVW-WRITE-2).
    """

    def __init__(self, sink, header: Header, *, codec: str = "raw", level: int = DEFAULT_ZSTD_LEVEL,
                 link_gbps: float | None = None, background: bool = True, depth: int = 2,
                 batch_bytes: int = 2 << 20):
        self.header = header
        self._enc = Encoder(header, codec=codec, level=level)
        self._send = sender_for(sink)
        self.stats = TransferStats("send", link_gbps)
        self._written: set[int] = set()
        self._failure: list[BaseException] = []
        self._closed = False
        self._queue: queue.SimpleQueue | None = None
        self._thread = None
        self._batch_bytes = batch_bytes
        self._layers_in_flight = threading.BoundedSemaphore(max(1, depth))
        if background:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._drain, name="kvwire-stream-send", daemon=True)
            self._thread.start()
        self.stats.begin()
        self._submit(None, self._enc.begin())

    def write_layer(self, layer: int, k=None, v=None, *, latent=None) -> None:
        """Send layer ``layer``: its [heads, tokens, dim] tensors (k and v, or latent)."""
        if self._closed:
            raise RuntimeError("write_layer() after close()")
        h = self.header
        if not 0 <= layer < h.num_layers:
            raise ValueError(f"layer {layer} outside [0, {h.num_layers})")
        if layer in self._written:
            raise ValueError(f"layer {layer} already written")
        spec, r = h.arch.layers[layer], h.layer_tokens[layer]
        given = {c: x for c, x in (("k", k), ("v", v), ("latent", latent)) if x is not None}
        if set(given) != set(spec.components):
            raise ValueError(f"layer {layer} ({spec.kind}) needs {spec.components}, got {tuple(given)}")
        arrays = {}
        for comp in spec.components:
            arrays[comp] = x = as_numpy(given[comp])
            if tuple(x.shape) != spec.shape(comp, r.count):
                raise ValueError(f"layer {layer} {comp}: shape {tuple(x.shape)}, header implies "
                                 f"{spec.shape(comp, r.count)}")
        self._written.add(layer)
        if self._queue is not None:
            self._layers_in_flight.acquire()  # released when the layer's last batch is sent
        buffers, size = [], 0
        for comp, x in arrays.items():
            for t0, n in grid(r.start, r.count, h.chunk_tokens):
                local = t0 - r.start
                bufs = self._enc.chunk(layer, comp, t0, x[:, local : local + n, :])
                buffers += bufs
                size += sum(memoryview(b).nbytes for b in bufs)
                if size >= self._batch_bytes:
                    self._submit(None, buffers)
                    buffers, size = [], 0
        self._submit(layer, buffers)  # the layer's last batch (possibly empty)

    def close(self) -> TransferStats:
        """Send the end frame (stream form) and wait until everything is sent."""
        if not self._closed:
            missing = sorted(set(range(self.header.num_layers)) - self._written)
            if missing:
                self._stop()
                raise ValueError(f"layers {missing[:8]} were never written; the stream gets no end frame")
            self._submit(None, self._enc.end(form="stream"))
            self._stop()
        if self._failure:
            raise self._failure[0]
        return self.stats

    def abort(self) -> None:
        """Stop without an end frame: the receiver sees a truncated stream (KVW-WRITE-2)."""
        self._stop()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _submit(self, layer, buffers) -> None:
        if self._failure:
            raise self._failure[0]
        if self._queue is None:
            self._send_batch(layer, buffers)
        else:
            self._queue.put((layer, buffers))

    def _send_batch(self, layer, buffers) -> None:
        if buffers:
            self.stats.add(self._send(buffers))
        if layer is not None:
            self.stats.mark_layer(layer)

    def _drain(self) -> None:
        while (item := self._queue.get()) is not None:
            layer, buffers = item
            try:
                if not self._failure:
                    self._send_batch(layer, buffers)
            except BaseException as exc:  # reported to the producer on its next call
                self._failure.append(exc)
            finally:
                if layer is not None:
                    self._layers_in_flight.release()

    def _stop(self) -> None:
        self._closed = True
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


# ---------------------------------------------------------------------------------------
# Layer-wise reader
# ---------------------------------------------------------------------------------------

class Layer(NamedTuple):
    """One received layer: component name -> [heads, tokens, dim] array or tensor."""

    index: int
    tensors: dict

    @property
    def k(self):
        return self.tensors.get("k")

    @property
    def v(self):
        return self.tensors.get("v")

    @property
    def latent(self):
        return self.tensors.get("latent")


def _slab(nbytes: int, backend: str, pin: bool, buffer):
    """One uint8 allocation (numpy array or torch tensor) of at least ``nbytes``."""
    nbytes = max(nbytes, 1)
    if buffer is not None:
        b = buffer(nbytes) if callable(buffer) else buffer
        if hasattr(b, "data_ptr"):  # torch tensor
            b = b.view(-1).view(_torch().uint8) if b.is_contiguous() else None
            if b is None:
                raise ValueError("receive buffer tensor must be contiguous")
            if backend == "numpy":
                b = b.numpy()
        else:
            b = np.frombuffer(b, np.uint8)
            if not b.flags.writeable:
                raise ValueError("receive buffer must be writable")
            if backend == "torch":
                b = _torch().from_numpy(b)
        if b.shape[0] < nbytes:
            raise ValueError(f"receive buffer holds {b.shape[0]} bytes, {nbytes} needed")
        return b
    if pin:
        torch = _torch()
        try:
            t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:
            raise RuntimeError(f"pin=True needs a torch build with an accelerator: {exc}") from None
        return t if backend == "torch" else t.numpy()
    a = np.empty(nbytes, np.uint8)
    return _torch().from_numpy(a) if backend == "torch" else a


def _torch():
    import torch

    return torch


def _carve(slab, offset: int, shape: tuple, dtype: str, backend: str):
    n = math.prod(shape) * R.DTYPES[dtype][1]
    part = slab[offset : offset + n]
    if backend == "torch":
        return part.view(torch_dtype(dtype)).view(shape)
    return part.view(R.DTYPES[dtype][2]).reshape(shape)


def _layer_bytes(h: Header, layer: int) -> list[tuple[str, tuple, int]]:
    """(component, shape, bytes rounded up to 64) of a layer's tensors."""
    spec, r = h.arch.layers[layer], h.layer_tokens[layer]
    out = []
    for comp in spec.components:
        shape = spec.shape(comp, r.count)
        out.append((comp, shape, (math.prod(shape) * h.itemsize + 63) & ~63))
    return out


class Reader:
    """Receive one stream-form container layer by layer; iterate to get ``Layer`` objects.

    The constructor reads up to the header (``EOFError`` if the source ends before its
    first byte). Layers are yielded in layer order, each as soon as it and the layers
    before it are complete and verified; the iteration ends after the end frame has
    been verified (KVW-STREAM-2: a failure raises, and everything received must then be
    discarded).

    ``keep=True`` (default): one buffer for the whole cache, layers stay valid and
    ``cache()`` returns a ``KVCache`` over them. ``keep=False``: a ring of
    ``prefetch + 1`` layer slots in one buffer (chunks must arrive layer by layer, as
    ``Writer`` sends them); a layer is valid until the next one is taken. ``buffer``: a
    writable buffer or uint8 tensor (or ``callable(nbytes)`` returning one) to carve
    instead of allocating (a buffer kept across transfers avoids the page faults of a
    fresh allocation, which can cost more than the transfer itself); ``pin=True``
    allocates pinned host memory (torch with an accelerator). ``prefetch``: layers the receive thread may complete ahead of the one
    in use (0: no thread, the consumer's ``next()`` receives). ``to_eof``: the container
    is the whole input, so a file-form tail is read and checked (KVW-LAYOUT-4); by
    default reading stops at the end frame and the source is left at the next
    container (KVW-STREAM-3).
    """

    def __init__(self, source, *, verify: bool = True, backend: str = "numpy", prefetch: int = 2,
                 keep: bool = True, pin: bool = False, buffer=None, link_gbps: float | None = None,
                 to_eof: bool = False, max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES):
        if backend not in ("numpy", "torch"):
            raise ValueError(f"backend must be 'numpy' or 'torch', not {backend!r}")
        self.backend, self.prefetch, self.keep = backend, max(0, prefetch), keep
        self.stats = TransferStats("recv", link_gbps)
        self._recv = _receiver(source)
        threaded = self.prefetch > 0
        # Checksums are computed on the receive thread, in place, right after each body
        # arrives (still in cache). A second verifying thread measured slower on 2 cores:
        # GIL hand-offs between it and the receive thread cost more than the overlap gained.
        self._dec = StreamDecoder(verify=verify, placement=self._place, stop_at_end=not to_eof,
                                  max_decoded_bytes=max_decoded_bytes)
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._ended = False  # end frame verified (and tail checked with to_eof)
        self._released = 0  # layers the consumer is finished with
        self._next = 0  # next layer to hand out
        self._waiting = False  # the consumer waits for a layer
        self._closing = False
        self.header = None
        self.stats.begin()
        while self.header is None:
            self._step()
        h = self.header
        self.form = None
        table = ChunkTable.of(h)
        self._remaining = [int(table.counts[i].sum()) for i in range(h.num_layers)]  # chunks still to come
        self._complete = [n == 0 for n in self._remaining]
        self._started = [False] * h.num_layers
        sizes = [_layer_bytes(h, i) for i in range(h.num_layers)]
        if keep:
            self._slots = 0
            self._offsets, total = [], 0
            for layer in sizes:
                self._offsets.append(total)
                total += sum(n for _, _, n in layer)
        else:
            self._slots = self.prefetch + 1
            self._slot_bytes = max(sum(n for _, _, n in layer) for layer in sizes)
            total = self._slots * self._slot_bytes
        self._sizes = sizes
        self._slab = _slab(total, backend, pin, buffer)
        self._tensors: list[dict | None] = [None] * h.num_layers
        self._flat: list[dict | None] = [None] * h.num_layers
        for i, done in enumerate(self._complete):
            if done:  # no chunks: shared layers, empty token ranges
                self._tensors[i] = self._carve_layer(i, 0)  # zero-size tensors, if any
                self.stats.mark_layer(i)
        self._thread = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name="kvwire-stream-recv", daemon=True)
            self._thread.start()

    # -- receive side --------------------------------------------------------------------

    def _carve_layer(self, layer: int, offset: int) -> dict:
        out = {}
        for comp, shape, n in self._sizes[layer]:
            out[comp] = _carve(self._slab, offset, shape, self.header.dtype, self.backend)
            offset += n
        return out

    def _place(self, layer: int, comp: str, t0: int, n: int):
        """Where a chunk goes: its token slice of the layer tensor, as one byte run per head."""
        if not self._started[layer]:
            self._start_layer(layer)
        x = self._tensors[layer][comp]
        flat, heads, per_head, row = self._flat[layer][comp]
        a = (t0 - self.header.layer_tokens[layer].start) * row
        b = a + n * row
        pieces = [flat[h * per_head + a : h * per_head + b] for h in range(heads)]
        return Placed(x[:, a // row : b // row, :], pieces)

    def _flatten(self, tensors: dict) -> dict:
        """Per component: (flat byte view, heads, bytes per head, bytes per token row)."""
        out = {}
        for comp, x in tensors.items():
            u = as_uint(as_numpy(x))
            heads, tokens, dim = u.shape
            out[comp] = (memoryview(u.reshape(-1)).cast("B"), heads, tokens * dim * u.itemsize, dim * u.itemsize)
        return out

    def _start_layer(self, layer: int) -> None:
        """First chunk of ``layer``: wait until it is within the prefetch window (unless the
        consumer waits for a layer whose chunks are still to come: chunks may arrive in any
        order, KVW-CHUNK-9)."""
        if not self.keep and any(self._remaining[i] for i in range(layer)):
            raise RuntimeError("keep=False needs the chunks of each layer before those of the next")
        if self._thread is not None:
            with self._cond:
                while (layer > self._released + self.prefetch and not self._closing
                       and not (self.keep and self._waiting and self._remaining[self._next])):
                    self._cond.wait()
        offset = self._offsets[layer] if self.keep else layer % self._slots * self._slot_bytes
        self._tensors[layer] = self._carve_layer(layer, offset)  # views of the slab, carved on first use
        self._flat[layer] = self._flatten(self._tensors[layer])
        self._started[layer] = True

    def _step(self) -> None:
        """One transport call and the events it completes."""
        dec = self._dec
        targets = dec.read_targets()
        if not targets:
            self.form = dec.close()
            self._finish()
            return
        n = self._recv(targets)
        if n == 0:
            if dec.received == 0:
                raise EOFError("the source ended before a container started")
            if dec.done:  # to_eof: a complete container, its tail (if any) is checked now
                self.form = dec.close()
                self._finish()
                return
            dec.close()  # raises TruncatedError (KVW-LAYOUT-3)
        self.stats.add(n)
        dec.filled(n)
        for ev in dec.events():
            if isinstance(ev, ChunkEvent):  # verified, in place
                self._remaining[ev.layer] -= 1
                if self._remaining[ev.layer] == 0:
                    self.stats.mark_layer(ev.layer)
                    with self._cond:
                        self._complete[ev.layer] = True
                        self._cond.notify_all()
            elif isinstance(ev, HeaderEvent):
                self.header = ev.header

    def _finish(self) -> None:
        self.stats.finished = time.perf_counter()  # the transfer ends when the last chunk is verified
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()

    def _run(self) -> None:
        try:
            while not self._ended and not self._closing:
                self._step()
        except BaseException as exc:  # handed to the consumer
            self._fail(exc)

    # -- consumer side -------------------------------------------------------------------

    @property
    def layers_ready(self) -> int:
        """Layers complete and verified so far (the consumer may not have taken them yet)."""
        return sum(self._complete)

    def __iter__(self):
        while self._next < self.header.num_layers:
            yield self._take()
        self._wait_end()

    def _take(self) -> Layer:
        i = self._next
        with self._cond:
            self._released = i  # the consumer is done with every layer before i
            self._cond.notify_all()
        if self._thread is None:
            while not self._complete[i]:
                self._step()
        else:
            with self._cond:
                self._waiting = True
                self._cond.notify_all()
                while not self._complete[i] and self._error is None:
                    self._cond.wait()
                self._waiting = False
                if self._error is not None:
                    raise self._error
        self._next = i + 1
        return Layer(i, self._tensors[i])

    def _wait_end(self) -> None:
        with self._cond:
            self._released = self.header.num_layers
            self._cond.notify_all()
        if self._thread is None:
            while not self._ended:
                self._step()
        else:
            with self._cond:
                while not self._ended and self._error is None:
                    self._cond.wait()
            if self._error is not None:
                raise self._error
            self._thread.join()

    def cache(self) -> KVCache:
        """Receive the rest and return the whole cache (``keep=True``): no copy, views of the buffer."""
        if not self.keep:
            raise RuntimeError("cache() needs keep=True")
        for _ in self:
            pass
        return KVCache(self.header, self._tensors)

    def close(self) -> None:
        """Stop consuming. A receive thread blocked in the transport ends when the source closes."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
