"""The layer-wise stream writer: ``LayerWriter(sink, header)`` then ``write_layer`` per layer.

The header goes out at once, then each layer as the producer hands it over, encoded by
the sans-IO ``Encoder`` in the caller's thread and sent as zero-copy ``sendmsg`` /
``writev`` batches of the caller's tensor memory from a background thread, so sending
layer i overlaps computing layer i+1. The sending side of ``LayerReader`` (reader.py);
the transport itself is ``sender_for`` (transport.py).
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from ..cache.encoder import Encoder
from ..cache.tensors import as_numpy
from ..codecs import DEFAULT_ZSTD_LEVEL
from ..format.chunks import grid
from ..format.header import Header
from .transport import StreamTimeout, TransferStats, sender_for

__all__ = ["LayerWriter"]


class LayerWriter:
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

    ``timeout``: seconds one transport call may wait for the receiver to take a byte
    (None, the default: block forever). A stalled receiver raises ``StreamTimeout`` (a
    ``TimeoutError``) from the next ``write_layer`` or ``close``, saying what was being
    sent and how many bytes had gone out; the stream is then abandoned. It needs a
    socket or a file descriptor (``poll``).
    """

    def __init__(self, sink: Any, header: Header, *, codec: str = "raw", level: int = DEFAULT_ZSTD_LEVEL,
                 link_gbps: float | None = None, background: bool = True, depth: int = 2,
                 batch_bytes: int = 2 << 20, timeout: float | None = None):
        self.header = header
        self._enc = Encoder(header, codec=codec, level=level)
        self._send = sender_for(sink, timeout)
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
        self._submit(None, self._enc.begin(), "the preamble and header")

    def write_layer(self, layer: int, k: Any = None, v: Any = None, *, latent: Any = None) -> None:
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
                    self._submit(None, buffers, f"chunks of layer {layer}")
                    buffers, size = [], 0
        self._submit(layer, buffers, f"chunks of layer {layer}")  # the layer's last batch (possibly empty)

    def close(self) -> TransferStats:
        """Send the end frame (stream form) and wait until everything is sent."""
        if not self._closed:
            missing = sorted(set(range(self.header.num_layers)) - self._written)
            if missing:
                self._stop()
                raise ValueError(f"layers {missing[:8]} were never written; the stream gets no end frame")
            self._submit(None, self._enc.end(form="stream"), "the end frame")
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

    def _submit(self, layer, buffers, what: str) -> None:
        if self._failure:
            raise self._failure[0]
        if self._queue is None:
            self._send_batch(layer, buffers, what)
        else:
            self._queue.put((layer, buffers, what))

    def _send_batch(self, layer, buffers, what: str) -> None:
        if buffers:
            try:
                self.stats.add(self._send(buffers))
            except StreamTimeout as exc:
                sent = self.stats.bytes + exc.transferred
                raise StreamTimeout(f"stream.LayerWriter: the receiver took no byte for {exc.timeout:g} s while "
                                    f"sending {what}; {sent} bytes had been sent", timeout=exc.timeout,
                                    transferred=sent) from None
        if layer is not None:
            self.stats.mark_layer(layer)

    def _drain(self) -> None:
        assert self._queue is not None  # the sending thread's queue
        while (item := self._queue.get()) is not None:
            layer, buffers, what = item
            try:
                if not self._failure:
                    self._send_batch(layer, buffers, what)
            except BaseException as exc:  # reported to the producer on its next call
                self._failure.append(exc)
            finally:
                if layer is not None:
                    self._layers_in_flight.release()

    def _stop(self) -> None:
        self._closed = True
        if self._thread is not None and self._thread.is_alive():
            assert self._queue is not None  # the thread's queue
            self._queue.put(None)
            self._thread.join()

