"""Files: a container's buffers written with ``writev`` and renamed into place.

``save`` writes to a temporary file next to the target and renames it over the target,
so a reader never sees a partial file (KVW-FILE-6); ``write_all`` overlaps checksumming
with the kernel copy. The engine connectors write through the same ``atomic_write``.
"""

from __future__ import annotations

import os
import queue
import secrets
import threading

from .encoder import iter_buffers


def write_all(fd: int, buffers, *, batch_bytes: int = 8 << 20) -> int:
    """writev every buffer in order; returns bytes written.

    Buffers are grouped into batches of about ``batch_bytes`` that a second thread
    writes while this one produces (and checksums) the next batch: ``os.writev``
    releases the GIL, so hashing and the kernel copy overlap.
    """
    iov_max = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
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
    total, batch, size = 0, [], 0
    try:
        for buf in buffers:
            if failure:
                break
            mv = memoryview(buf).cast("B")
            if mv.nbytes:
                batch.append(mv)
                size += mv.nbytes
            if len(batch) >= iov_max or size >= batch_bytes:
                batches.put(batch)
                total += size
                batch, size = [], 0
        if batch and not failure:
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


def atomic_write(path, buffers, *, fsync: bool = False) -> int:
    """writev ``buffers`` to a temporary file next to ``path``, then rename it over ``path``.

    ``path`` holds either its old content or all of the new bytes, never a mix; with
    ``fsync=True`` the file and its directory entry are durable before this returns.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o644)
    try:
        try:
            size = write_all(fd, buffers)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if fsync:
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return size


def save(path, cache, *, fsync: bool = False, **opts) -> int:
    """Write ``cache`` to ``path`` in file form, atomically (``atomic_write``); returns the size."""
    return atomic_write(path, iter_buffers(cache, form="file", **opts), fsync=fsync)
