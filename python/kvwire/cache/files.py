"""Files: the I/O adapters around the sans-IO ``Encoder`` and ``Reader``.

``save`` writes a container's buffers with ``writev`` to a temporary file next to the
target and renames it over the target, so a reader never sees a partial file
(KVW-FILE-6); ``write_all`` overlaps checksumming with the kernel copy, and the engine
connectors write through the same ``atomic_write``. ``open`` and ``load`` map a file and
read it through ``Reader``, which only ever sees a buffer.
"""

from __future__ import annotations

import builtins
import mmap
import os
import queue
import secrets
import threading

from ..format.limits import DEFAULT_MAX_DECODED_BYTES
from .encoder import iter_buffers
from .reader import Reader


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


def _map_file(path) -> tuple[object, object]:
    with builtins.open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return b"", None
        # ACCESS_COPY: a private, writable mapping, so torch.frombuffer gets a writable
        # buffer; writes to tensors never reach the file.
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)

    def close():
        try:
            mm.close()
        except BufferError:  # views still alive: the mapping goes when they do
            pass

    return mm, close


def open(source, *, max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES) -> Reader:  # noqa: A001
    """A ``Reader`` over a path (memory-mapped) or a bytes-like object (used in place)."""
    if isinstance(source, (str, os.PathLike)):
        buf, closer = _map_file(source)
        try:
            return Reader(buf, max_decoded_bytes=max_decoded_bytes, _closer=closer)
        except BaseException:
            if closer:
                closer()
            raise
    return Reader(source, max_decoded_bytes=max_decoded_bytes)


def load(source, *, device=None, backend: str | None = None, verify: bool = True,
         max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES):
    """A ``KVCache`` with its own memory (checksums verified unless ``verify=False``)."""
    if backend is None:
        backend = "torch" if device is not None else "numpy"
    with open(source, max_decoded_bytes=max_decoded_bytes) as r:
        return r.load(verify=verify, backend=backend, device=device)
