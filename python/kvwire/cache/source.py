"""Reading a container file safely: regular files only, into memory or mapped.

A path handed to ``kvwire.open`` may name anything: a FIFO (a plain ``open`` would block
forever), a device (endless bytes), a directory, or a file in a shared store that another
process truncates or rewrites while it is being read. This module refuses everything but
regular files before reading a byte, reads files into memory with bounded reads, and maps
files with a guard that sees a shrunk file before a chunk access touches a lost page
(which would kill the process with SIGBUS).
"""

from __future__ import annotations

import builtins
import errno
import mmap
import os
import stat

import numpy as np

from ..format.errors import TruncatedError

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def refuse_non_regular(path, st) -> None:
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory, not a container file", os.fspath(path))
    if not stat.S_ISREG(st.st_mode):
        kind = next((k for test, k in _KINDS if test(st.st_mode)), "not a regular file")
        raise OSError(errno.EINVAL, f"is {kind}, not a regular file: kvwire.open reads regular files, "
                      "or the bytes you pass it", os.fspath(path))


def open_regular(path) -> tuple[int, os.stat_result]:
    """An fd and its stat for a regular file; anything else is refused before a byte is read
    (``stat`` first, so a device is never opened; O_NONBLOCK, so a FIFO swapped in never blocks)."""
    refuse_non_regular(path, os.stat(path))
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
                 | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        refuse_non_regular(path, st)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def only_this_user_can_write(st) -> bool:
    """The file is owned by this user and writable by no one else: no other user's process
    can truncate or rewrite it under a mapping (``open``'s default maps exactly these)."""
    if not hasattr(os, "geteuid"):  # Windows: a mapped file cannot be truncated by anyone
        return True
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def read_all(fd: int, size: int) -> memoryview:
    """The file's bytes in memory of their own: at most ``size`` (its ``st_size``), read in
    bounded pieces; a file that shrank meanwhile gives fewer bytes (the reader then says
    TRUNCATED), one that grew is read up to ``size``."""
    mv, n = np.empty(size, np.uint8).data, 0  # np.empty: no zero-fill before the bytes overwrite it
    with builtins.open(fd, "rb", buffering=0, closefd=False) as f:
        while n < size:
            got = f.readinto(mv[n : n + (64 << 20)])
            if not got:
                break
            n += got
    return mv[:n] if n < size else mv


def map_file(fd: int, st):
    """A private mapping and a guard that refuses chunk access once the file has shrunk."""
    size = st.st_size
    # ACCESS_COPY: a private, writable mapping, so torch.frombuffer gets a writable
    # buffer; writes to tensors never reach the file.
    mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)

    def guard() -> None:
        now = os.fstat(fd).st_size
        if now < size:
            raise TruncatedError(f"the mapped file shrank from {size} to {now} bytes while open: another process "
                                 "truncated it (open it with mmap=False to read files others may write)",
                                 needed=size)

    def close() -> None:
        try:
            mm.close()
        except BufferError:  # views still alive: the mapping goes when they do
            pass
        os.close(fd)

    return mm, guard, close
