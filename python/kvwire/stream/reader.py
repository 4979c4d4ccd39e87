"""The layer-wise stream reader: ``LayerReader(source)`` yields each ``Layer`` as it arrives.

Bodies are received with ``recvmsg_into`` / ``readv`` (``receiver_for``, transport.py)
straight into one preallocated (optionally pinned, or caller-supplied) buffer carved
into the layer tensors, and verified in place by the sans-IO ``StreamDecoder``; a
receive thread works up to ``prefetch`` layers ahead of the consumer. The receiving
side of ``LayerWriter`` (writer.py), kept apart because buffer carving, the prefetch
window and the consumer hand-off are a responsibility of their own.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, NamedTuple, cast

import numpy as np

from ..cache.decoder import ChunkEvent, HeaderEvent, Placed, StreamDecoder
from ..cache.kvcache import KVCache
from ..cache.tensors import as_numpy, as_uint, torch_dtype
from ..format import registry as R
from ..format.chunks import ChunkTable
from ..format.errors import Error, LimitError
from ..format.header import Header
from ..format.limits import DEFAULT_MAX_DECODED_BYTES
from .transport import StreamTimeout, TransferStats, receiver_for

__all__ = ["Layer", "LayerReader", "Placed", "SparseNotSupported"]



class SparseNotSupported(Error, ValueError):
    """A valid sparse container on a ``LayerReader``: its chunks hold one kv head each and
    no layer is complete before all its heads are, so it is read with ``StreamDecoder`` or
    ``kvwire.open`` instead (raised right after the header, before any allocation)."""

    code = "SPARSE_NOT_SUPPORTED"


class Layer(NamedTuple):
    """One received layer: component name -> [heads, tokens, dim] array or tensor."""

    index: int  # type: ignore[assignment]  # the field shadows tuple.index (public since the first release)
    tensors: dict

    @property
    def k(self) -> Any:
        return self.tensors.get("k")

    @property
    def v(self) -> Any:
        return self.tensors.get("v")

    @property
    def latent(self) -> Any:
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


def implied_bytes(h: Header) -> int:
    """Decoded bytes of a dense container, from its header alone: the sum of ``raw_length``
    over every chunk the header implies (what KVW-LIM-5 bounds; KVW-LIM-8)."""
    total = 0
    for spec, r in zip(h.arch.layers, h.layer_tokens):
        if spec.kind == "state":
            total += sum(t.nbytes for t in spec.state_tensors) if r.count else 0
        else:
            total += sum(math.prod(spec.shape(comp, r.count)) for comp in spec.components) * h.itemsize
    return total


def _layer_bytes(h: Header, layer: int) -> list[tuple[str, tuple, int]]:
    """(component, shape, bytes rounded up to 64) of a layer's tensors."""
    spec, r = h.arch.layers[layer], h.layer_tokens[layer]
    out = []
    for comp in (() if spec.kind == "state" else spec.components):  # state tensors: decoded apart
        shape = spec.shape(comp, r.count)
        out.append((comp, shape, (math.prod(shape) * h.itemsize + 63) & ~63))
    return out


class LayerReader:
    """Receive one stream-form container layer by layer; iterate to get ``Layer`` objects.

    The constructor reads up to the header (``EOFError`` if the source ends before its
    first byte). Layers are yielded in layer order, each as soon as it and the layers
    before it are complete and verified; the iteration ends after the end frame has
    been verified (KVW-STREAM-2: a failure raises, and everything received must then be
    discarded).

    ``keep=True`` (default): one buffer for the whole cache, layers stay valid and
    ``cache()`` returns a ``KVCache`` over them. ``keep=False``: a ring of
    ``prefetch + 1`` layer slots in one buffer (chunks must arrive layer by layer, as
    ``LayerWriter`` sends them); a layer is valid until the next one is taken. ``buffer``: a
    writable buffer or uint8 tensor (or ``callable(nbytes)`` returning one) to carve
    instead of allocating (a buffer kept across transfers avoids the page faults of a
    fresh allocation, which can cost more than the transfer itself); ``pin=True``
    allocates pinned host memory (torch with an accelerator). ``prefetch``: layers the receive thread may complete ahead of the one
    in use (0: no thread, the consumer's ``next()`` receives). ``to_eof``: the container
    is the whole input, so a file-form tail is read and checked (KVW-LAYOUT-4); by
    default reading stops at the end frame and the source is left at the next
    container (KVW-STREAM-3).

    ``max_decoded_bytes`` (KVW-LIM-5): a header whose decoded size exceeds it is refused
    with ``DECODED_SIZE_LIMIT`` before the receive buffer is allocated (KVW-LIM-8).
    ``timeout``: seconds one transport call may wait for a byte (None, the default:
    block forever); a stalled sender raises ``StreamTimeout`` (a ``TimeoutError``) saying
    what was awaited and how many bytes had arrived. It needs a socket, a file
    descriptor or an unbuffered file (a buffered reader's bytes are invisible to poll).
    """

    header: Header  # set by the stream's HeaderEvent, before the constructor returns

    def __init__(self, source: Any, *, verify: bool = True, backend: str = "numpy", prefetch: int = 2,
                 keep: bool = True, pin: bool = False, buffer: Any = None, link_gbps: float | None = None,
                 to_eof: bool = False, max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES,
                 timeout: float | None = None):
        if backend not in ("numpy", "torch"):
            raise ValueError(f"backend must be 'numpy' or 'torch', not {backend!r}")
        if isinstance(max_decoded_bytes, bool) or not isinstance(max_decoded_bytes, int) or max_decoded_bytes < 0:
            raise ValueError(f"max_decoded_bytes must be a non-negative int, not {max_decoded_bytes!r}")
        self.backend, self.prefetch, self.keep = backend, max(0, prefetch), keep
        self.stats = TransferStats("recv", link_gbps)
        self._recv = receiver_for(source, timeout)
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
        self.stats.begin()
        while not hasattr(self, "header"):  # set by the HeaderEvent
            self._step()
        h = self.header
        if h.sparse is not None:
            raise SparseNotSupported("stream.LayerReader reads dense containers; a sparse one (chunks of one head "
                                     "each) is read with kvwire.StreamDecoder or kvwire.open")
        if implied_bytes(h) > max_decoded_bytes:  # before the receive buffer is sized from the header
            raise LimitError("DECODED_SIZE_LIMIT", f"the header implies {implied_bytes(h)} decoded bytes, more than "
                             f"max_decoded_bytes={max_decoded_bytes}", rule="KVW-LIM-8")
        self.form: str | None = None
        table = ChunkTable.of(h)
        self._remaining: list[int] = [int(table.counts[i].sum()) for i in range(h.num_layers)]  # chunks to come
        self._complete: list[bool] = [n == 0 for n in self._remaining]
        self._started: list[bool] = [False] * h.num_layers
        sizes = [_layer_bytes(h, i) for i in range(h.num_layers)]
        if keep:
            self._slots = 0
            self._offsets: list[int] = []
            total = 0
            for layer in sizes:
                self._offsets.append(total)
                total += sum(n for _, _, n in layer)
        else:
            self._slots = min(self.prefetch + 1, max(1, h.num_layers))  # no slot beyond what the header implies
            self._slot_bytes = max(sum(n for _, _, n in layer) for layer in sizes)
            total = self._slots * self._slot_bytes
        self._sizes: list[list[tuple[str, tuple, int]]] = sizes
        self._slab: Any = _slab(total, backend, pin, buffer)
        self._tensors: list[dict | None] = [None] * h.num_layers
        self._flat: list[dict | None] = [None] * h.num_layers
        for i, done in enumerate(self._complete):
            if done:  # no chunks: shared layers, empty token ranges
                self._tensors[i] = self._carve_layer(i, 0)  # zero-size tensors, if any
                self.stats.mark_layer(i)
        self._thread: threading.Thread | None = None
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
        if comp == "state":  # a state tensor has its own shape and dtype: the decoder decodes it (KVW-STATE-7)
            return None
        tensors, flats = self._tensors[layer], self._flat[layer]
        assert tensors is not None and flats is not None  # carved by _start_layer
        x = tensors[comp]
        flat, heads, per_head, row = flats[comp]
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
            out[comp] = (u.reshape(-1).data.cast("B"), heads, tokens * dim * u.itemsize, dim * u.itemsize)
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
        tensors = self._carve_layer(layer, offset)  # views of the slab, carved on first use
        self._tensors[layer] = tensors
        self._flat[layer] = self._flatten(tensors)
        self._started[layer] = True

    def _step(self) -> None:
        """One transport call and the events it completes."""
        dec = self._dec
        targets = dec.read_targets()
        if not targets:
            self.form = dec.close()
            self._finish()
            return
        try:
            n = self._recv(targets)
        except StreamTimeout as exc:
            raise StreamTimeout(f"stream.LayerReader: no byte arrived for {exc.timeout:g} s while waiting for "
                                f"{dec.waiting_for()}; {dec.received} bytes had arrived",
                                timeout=exc.timeout, transferred=dec.received) from None
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
                if ev.component == "state":
                    name = self.header.arch.layers[ev.layer].state_tensors[ev.head_start].name
                    tensors = self._tensors[ev.layer]
                    assert tensors is not None  # carved when the chunk was placed
                    tensors.setdefault("state", {})[name] = ev.data
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
        tensors = self._tensors[i]
        assert tensors is not None  # a complete layer is carved
        return Layer(i, tensors)

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
        return KVCache(self.header, cast("list[dict]", self._tensors))  # every layer carved: all were taken

    def close(self) -> None:
        """Stop consuming. A receive thread blocked in the transport ends when the source closes."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
