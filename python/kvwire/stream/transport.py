"""Transport primitives shared by every reader and writer of ``kvwire.stream``.

* ``sender_for(sink)``: ``send(buffers)`` that hands the caller's buffers to a socket
  (``sendmsg``), a file descriptor or an object with ``fileno()`` (``writev``), at most
  ``IOV_MAX`` per call, without copying them; an object with ``write()`` otherwise.
* ``receiver_for(source)``: ``recv(targets)`` that fills writable buffers in order
  (``recv_into`` / ``recvmsg_into``, ``readv``, or ``readinto()``).
* ``TransferStats``: what those calls moved and how long they took.
* ``timeout``: both take the longest a call may wait for its peer to move a byte (None:
  block forever); a stalled peer raises ``StreamTimeout``, a ``TimeoutError``. The wait is
  ``poll`` on the socket or descriptor, which is then read or written without blocking
  (``MSG_DONTWAIT``; a descriptor is non-blocking during the write only), so the
  caller's socket timeout and descriptor flags are left as they were.

``LayerWriter`` (writer.py), ``LayerReader`` (reader.py), ``DecodeWriter`` /
``read_segments`` (segments.py) and ``fanout`` (fanout.py) all move their bytes through
these, so the zero-copy I/O and its accounting live in one place.
"""

from __future__ import annotations

import io
import math
import os
import select
import socket
import time
from dataclasses import dataclass, field

from ..cache.decoder import IOV_MAX
from ..format.errors import Error

__all__ = ["StreamTimeout", "TransferStats", "receiver_for", "sender_for"]


class StreamTimeout(Error, TimeoutError):
    """The peer moved no byte for ``timeout`` seconds: ``transferred`` is how many bytes
    the stalled reader or writer had moved by then (its message says what it waited for)."""

    code = "STREAM_TIMEOUT"

    def __init__(self, message: str, *, timeout: float, transferred: int = 0):
        super().__init__(message)
        self.timeout, self.transferred = timeout, transferred


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
        return None if self.first_byte is None or self.started is None else self.first_byte - self.started

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


def _check_timeout(timeout) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be a positive number of seconds or None (block forever), not {timeout!r}")
    return float(timeout)


def _timed(fd: int, events: int, timeout: float, call, transferred):
    """``call()`` once ``fd`` is ready for ``events``; ``StreamTimeout`` when it stays
    unready for ``timeout`` seconds (``call`` raising BlockingIOError waits again)."""
    deadline = time.monotonic() + timeout
    poller = select.poll()
    poller.register(fd, events)
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(max(1, int(left * 1000 + 0.999))):
            verb = "arrived" if events == select.POLLIN else "could be sent"
            raise StreamTimeout(f"no byte {verb} for {timeout:g} s", timeout=timeout, transferred=transferred())
        try:
            return call()
        except BlockingIOError:
            continue


def _without_blocking(fd: int, call):
    """``call()`` with ``fd`` non-blocking (as it was before, after)."""
    blocking = os.get_blocking(fd)
    if blocking:
        os.set_blocking(fd, False)
    try:
        return call()
    finally:
        if blocking:
            os.set_blocking(fd, True)


def _no_timeout(kind: str, obj) -> None:
    raise ValueError(f"timeout= needs a socket or a file descriptor (or an unbuffered file) to poll; "
                     f"cannot {kind} {type(obj).__name__} with a timeout")


def _send_all(call, buffers, timeout=None, fd=None) -> int:
    """Send every buffer with ``call(list) -> bytes sent`` (sendmsg, writev), <= IOV_MAX per
    call; with ``timeout``, each call waits at most that long for ``fd`` to take bytes."""
    bufs = [b for b in (memoryview(x).cast("B") for x in buffers) if b.nbytes]
    total, i = 0, 0
    while i < len(bufs):
        if timeout is None:
            n = call(bufs[i : i + IOV_MAX])
        else:
            batch = bufs[i : i + IOV_MAX]
            n = _timed(fd, select.POLLOUT, timeout, lambda batch=batch: call(batch), lambda total=total: total)
        total += n
        while i < len(bufs) and n >= bufs[i].nbytes:
            n -= bufs[i].nbytes
            i += 1
        if n:
            bufs[i] = bufs[i][n:]
    return total


def sender_for(sink, timeout: float | None = None):
    """``send(buffers) -> bytes`` for a sink, without copying the buffers. ``timeout``:
    the longest one transport call waits for the peer to take a byte (StreamTimeout)."""
    timeout = _check_timeout(timeout)
    if isinstance(sink, socket.socket):
        if timeout is None:
            return lambda bufs: _send_all(sink.sendmsg, bufs)
        return lambda bufs: _send_all(lambda b: sink.sendmsg(b, (), socket.MSG_DONTWAIT), bufs, timeout,
                                      sink.fileno())
    fd = _fileno(sink)
    if fd is not None:
        flush = getattr(sink, "flush", None)
        if flush is not None:
            flush()  # anything the file object buffered goes first
        if timeout is None:
            return lambda bufs: _send_all(lambda b: os.writev(fd, b), bufs)
        return lambda bufs: _send_all(lambda b: _without_blocking(fd, lambda: os.writev(fd, b)), bufs, timeout, fd)
    if timeout is not None and hasattr(sink, "write"):
        _no_timeout("send to", sink)
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


def receiver_for(source, timeout: float | None = None):
    """``recv(targets) -> bytes`` filling writable buffers in order (0 at end of input).
    ``timeout``: the longest one call waits for a byte to arrive (StreamTimeout)."""
    timeout = _check_timeout(timeout)
    if isinstance(source, socket.socket):
        def recv(targets):
            if len(targets) == 1:
                return source.recv_into(targets[0])
            return source.recvmsg_into(targets)[0]
        if timeout is None:
            return recv
        fd = source.fileno()
        return lambda targets: _timed(fd, select.POLLIN, timeout, lambda: recv(targets), lambda: 0)
    if isinstance(source, int) or isinstance(source, io.FileIO):
        fd = _fileno(source)
        if timeout is None:
            return lambda targets: os.readv(fd, targets)
        return lambda targets: _timed(fd, select.POLLIN, timeout, lambda: os.readv(fd, targets), lambda: 0)
    if timeout is not None and hasattr(source, "readinto"):
        _no_timeout("receive from", source)  # a buffered reader may hold bytes that poll cannot see
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
