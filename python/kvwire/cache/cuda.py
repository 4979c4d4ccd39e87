"""Host <-> device copies: one reusable pinned staging ring, a side stream, events.

Every body crosses host->device once. Pageable memory would make the driver stage (and
block) on its own, so bodies are first placed (decoded or copied) into a slot of a
``StagingRing`` of pinned buffers, then copied with ``non_blocking=True`` on a side
stream; each slot remembers the event of the last copy that read it and is handed out
again only once that copy has completed. Pinning per call would cost as much as the
copy, so a ring is made once and can be reused (pass ``ring=``) across loads and
scatters. For long-lived maps, ``HostRegistration`` (``cudaHostRegister``) pins the
container bytes themselves and the staging copy disappears (``registered=True``).

The code is device-agnostic: a *stream* object provides allocation, ``launch`` (enqueue
work, return an event with ``query()``/``synchronize()``) and ``synchronize``.
``CudaStream`` is the real thing; ``SimulatedStream`` runs launched work on a worker
thread after a delay, so the ring logic (no slot reuse before its copy completed,
bit-exact results) is exercised on machines without a GPU.
"""

from __future__ import annotations

import queue
import threading
import time

import numpy as np

_INT_OF_SIZE = {1: "uint8", 2: "int16", 4: "int32"}


def int_view(t):
    """The same memory as integers of the element's width: copies of these are bit-exact
    and implemented for every dtype (fp8 indexing kernels are not, on every device)."""
    import torch

    return t.view(getattr(torch, _INT_OF_SIZE[t.element_size()]))


# ---------------------------------------------------------------------------------------
# Streams
# ---------------------------------------------------------------------------------------

class CudaStream:
    """Work enqueued on a CUDA side stream; events are ``torch.cuda.Event``."""

    simulated = False

    def __init__(self, device="cuda"):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(f"device {device!r} requested but torch reports no CUDA device")
        dev = torch.device(device)
        self.device = dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(device=self.device)
        # work on the side stream must not overtake what the caller already enqueued
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def host_empty(self, nbytes: int):
        import torch

        return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)

    def device_empty(self, shape, dtype):
        import torch

        with torch.cuda.stream(self.stream):
            return torch.empty(shape, dtype=dtype, device=self.device)

    def launch(self, fn):
        import torch

        with torch.cuda.stream(self.stream):
            fn()
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def record(self):
        import torch

        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def wait_current(self) -> None:
        """Make the side stream wait for what the caller's current stream enqueued so far."""
        import torch

        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def wait_event(self, ev) -> None:
        """Make the caller's current stream wait for ``ev`` (the host does not block)."""
        import torch

        torch.cuda.current_stream(self.device).wait_event(ev)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        pass


class SimEvent:
    __slots__ = ("_done", "error")

    def __init__(self):
        self._done = threading.Event()
        self.error = None

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error


class SimulatedStream:
    """A CPU stand-in for a device stream: launched work runs later, in order, on one
    worker thread (after ``delay`` seconds each), like kernels on a stream. Tests use it to
    prove that the host never touches memory a pending copy still reads or writes."""

    simulated = True

    def __init__(self, delay: float = 0.0, device="cpu"):
        import torch

        self.delay = delay
        self.device = torch.device(device)
        self.launched = 0
        self._q: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="kvwire-simstream", daemon=True)
        self._worker.start()

    def host_empty(self, nbytes: int):
        import torch

        return torch.empty(max(nbytes, 1), dtype=torch.uint8)

    def device_empty(self, shape, dtype):
        import torch

        return torch.empty(shape, dtype=dtype, device=self.device)

    def launch(self, fn) -> SimEvent:
        ev = SimEvent()
        self.launched += 1
        self._q.put((fn, ev))
        return ev

    def record(self) -> SimEvent:
        return self.launch(None)

    def wait_event(self, ev) -> None:
        ev.synchronize()

    def wait_current(self) -> None:
        pass

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            fn, ev = item
            if fn is not None:
                if self.delay:
                    time.sleep(self.delay)
                try:
                    fn()
                except BaseException as exc:  # reported by the event's synchronize()
                    ev.error = exc
            ev._done.set()

    def synchronize(self) -> None:
        self.record().synchronize()

    def close(self) -> None:
        if self._worker.is_alive():
            self._q.put(None)
            self._worker.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def stream_for(device, stream=None):
    """``stream`` if given, else a ``CudaStream`` for a CUDA device (None for the CPU)."""
    if stream is not None:
        return stream
    if device is not None and str(device).startswith("cuda"):
        return CudaStream(device)
    return None


# ---------------------------------------------------------------------------------------
# The staging ring
# ---------------------------------------------------------------------------------------

class StagingRing:
    """``slots`` reusable pinned host buffers of ``slot_bytes`` each, optionally mirrored by
    device buffers (``device_mirror``), used round-robin. ``acquire`` returns a slot once
    the copy that last used it has completed; ``launch`` enqueues the copy out of it and
    records its event. ``waits`` counts acquisitions that had to block."""

    def __init__(self, stream, slot_bytes: int, slots: int = 2, *, device_mirror: bool = False):
        if slots < 1:
            raise ValueError("a staging ring needs at least one slot")
        self.stream = stream
        self.slots = slots
        self.slot_bytes = 0
        self.device_mirror = device_mirror
        self.staged = 0  # bytes placed in slots (load(device=): compressed bodies count as staged)
        self.host: list = []
        self.device: list = []
        self._events: list = [None] * slots
        self._keep: list = [None] * slots
        self._next = 0
        self.waits = 0
        self.ensure(slot_bytes)

    def ensure(self, slot_bytes: int) -> None:
        """Grow the slots to at least ``slot_bytes`` (after draining pending copies)."""
        if slot_bytes <= self.slot_bytes:
            return
        import torch

        self.drain()
        self.slot_bytes = slot_bytes
        self.host = [self.stream.host_empty(slot_bytes) for _ in range(self.slots)]
        if self.device_mirror:
            self.device = [self.stream.device_empty((slot_bytes,), torch.uint8) for _ in range(self.slots)]

    def acquire(self, nbytes: int) -> int:
        if nbytes > self.slot_bytes:
            raise ValueError(f"{nbytes} bytes do not fit a {self.slot_bytes}-byte staging slot")
        i = self._next
        self._next = (i + 1) % self.slots
        ev = self._events[i]
        if ev is not None:
            if not ev.query():
                self.waits += 1
            ev.synchronize()
        self._events[i] = self._keep[i] = None
        return i

    def launch(self, slot: int, fn, keep=None):
        """Enqueue ``fn`` (which reads slot ``slot``); ``keep`` stays referenced until it ran."""
        ev = self.stream.launch(fn)
        self._events[slot], self._keep[slot] = ev, keep
        return ev

    def drain(self) -> None:
        for i, ev in enumerate(self._events):
            if ev is not None:
                ev.synchronize()
                self._events[i] = self._keep[i] = None


def staging_ring(device="cuda", slot_bytes: int = 4 << 20, slots: int = 2, *, stream=None,
                 device_mirror: bool = True) -> StagingRing:
    """A ring to reuse across ``load(device=...)`` and ``scatter`` calls."""
    return StagingRing(stream_for(device, stream) or CudaStream(device), slot_bytes, slots,
                       device_mirror=device_mirror)


class HostRegistration:
    """Page-lock an existing host buffer (an mmap'ed container) with ``cudaHostRegister`` so
    copies from it are asynchronous DMA, without a staging copy. Read-only registration is
    tried first (it does not break copy-on-write mappings), then the default flags."""

    READ_ONLY = 8  # cudaHostRegisterReadOnly

    def __init__(self, buffer, *, read_only: bool = True):
        import torch

        arr = np.frombuffer(buffer, np.uint8)
        self.ptr, self.nbytes = int(arr.ctypes.data), int(arr.nbytes)
        del arr
        self._cudart = torch.cuda.cudart()
        flags = [self.READ_ONLY, 0] if read_only else [0]
        last = None
        for f in flags:
            try:
                torch.cuda.check_error(self._cudart.cudaHostRegister(self.ptr, self.nbytes, f))
                self.flags = f
                break
            except Exception as exc:  # noqa: BLE001 - try the next flag set
                last = exc
        else:
            raise RuntimeError(f"cudaHostRegister failed: {last}")

    def close(self) -> None:
        if self.ptr:
            import torch

            torch.cuda.check_error(self._cudart.cudaHostUnregister(self.ptr))
            self.ptr = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------------------
# load(device=...)
# ---------------------------------------------------------------------------------------

def host_chunk(reader, i: int, verify: bool, stored=None):
    """Record ``i``'s raw body as a CPU integer tensor viewing the container bytes (raw
    codec; no copy) or a fresh decode (zstd), with the info tuple."""
    import warnings

    import torch

    if stored is None:
        c, stored = reader.stored(i, verify)
    else:
        c = reader.info(i)
    data = stored if c.codec == "raw" else reader.decode_stored(i, c, stored)
    itemsize = reader.header.itemsize
    arr = np.frombuffer(data, _INT_OF_SIZE[itemsize], c.raw_length // itemsize).reshape(c.shape)
    with warnings.catch_warnings():  # read-only container bytes: only ever read from
        warnings.simplefilter("ignore", UserWarning)
        return c, torch.from_numpy(arr)

