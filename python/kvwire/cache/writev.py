"""Writing a list of buffers to a file descriptor with ``writev``, without concatenating them.

Kept apart from ``files`` (atomic saves) because the stores write containers the same way
(``store.local``). ``write_all`` overlaps the producer (which checksums the next buffers)
with the kernel copy on a second thread when the container spans several batches.
"""

from __future__ import annotations

import os
import queue
import threading


def write_all(fd: int, buffers, *, batch_bytes: int = 8 << 20) -> int:
    """writev every buffer in order; returns bytes written.

    Buffers go in batches of about ``batch_bytes``; a container of one batch is written by
    this thread (a hand-off costs more than it saves). Otherwise a second thread writes each
    batch while this one checksums the next: ``os.writev`` releases the GIL.
    """
    iov_max = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
    it = iter(buffers)

    def take() -> tuple[list, int, bool]:
        batch, size = [], 0
        for buf in it:
            mv = memoryview(buf).cast("B")
            if mv.nbytes:
                batch.append(mv)
                size += mv.nbytes
            if len(batch) >= iov_max or size >= batch_bytes:
                return batch, size, False
        return batch, size, True

    batch, total, done = take()
    if done:
        return _writev(fd, batch)
    batches: queue.Queue = queue.Queue(maxsize=2)
    failure: list[BaseException] = []

    def drain() -> None:
        while (batch := batches.get()) is not None:
            if not failure:
                try:
                    _writev(fd, batch)
                except BaseException as exc:  # reported to the producer below
                    failure.append(exc)

    writer = threading.Thread(target=drain, name="kvwire-writev", daemon=True)
    writer.start()
    try:
        batches.put(batch)
        while not done and not failure:
            batch, size, done = take()
            if batch:
                batches.put(batch)
                total += size
    finally:
        batches.put(None)
        writer.join()
    if failure:
        raise failure[0]
    return total


def _writev(fd: int, batch: list) -> int:
    written = 0
    while batch:
        n = os.writev(fd, batch)
        written += n
        while batch and n >= batch[0].nbytes:
            n -= batch[0].nbytes
            batch.pop(0)
        if batch and n:
            batch[0] = batch[0][n:]
    return written
