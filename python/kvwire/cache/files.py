"""Files: the I/O adapters around the sans-IO ``Encoder`` and ``Reader``.

``save`` writes a container's buffers with ``writev`` to a temporary file next to the
target and links or renames it over the target, so a reader never sees a partial file
(KVW-FILE-6, KVW-WRITE-3 to 5); ``write_all`` overlaps checksumming with the kernel copy,
and the engine connectors write through the same ``atomic_write``. ``open`` and ``load``
read a file into memory or map it (``mmap=``, see ``open``) and read it through
``Reader``, which only ever sees a buffer. Paths that are not regular files are refused
before any read (a FIFO would block, a device never end).
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import secrets
import socket
import stat
from collections.abc import Mapping
from typing import IO, TYPE_CHECKING, Any, Union

import xxhash

from ..codecs import DEFAULT_ZSTD_LEVEL
from ..format.limits import DEFAULT_MAX_DECODED_BYTES
from .args import BACKENDS, check_cache, check_choice, check_count, check_keywords, has_fileno
from .encoder import iter_buffers
from .kvcache import KVCache
from .reader import Reader
from .source import map_file, only_this_user_can_write, open_regular, read_all
from .writev import write_all

if TYPE_CHECKING:
    from ..format.header import ModelIdentity
    from .sparse import SparseKVCache

# Where a container is written: a path, or a binary file object (a file opened "wb", io.BytesIO).
Target = Union[str, "os.PathLike[str]", IO[bytes]]
# Where a container is read from: a path, a bytes-like object or a binary file object.
Source = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, IO[bytes]]


# -- atomic writes (KVW-FILE-6, KVW-WRITE-3 to 5) ----------------------------------------

TEMP_SUFFIX = ".kvwtmp"
_HOST = format(xxhash.xxh32_intdigest(socket.gethostname().encode()) & 0xFFFFFF, "06x")  # stable per host
USE_O_TMPFILE = hasattr(os, "O_TMPFILE")  # tests switch it off to exercise the named-temp path
_NO_LINK: set = set()  # st_dev of file systems where an O_TMPFILE file could not be linked


def _umask() -> int:
    """The process umask, without changing it where the platform says it (Linux 4.7+)."""
    try:
        with builtins.open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: read it by setting it, at once restored
    os.umask(mask)
    return mask


def _temp_name(target: str) -> str:
    """``.<name>.<host>.<pid>.<random>.kvwtmp`` next to ``target``: host and pid let a later
    save tell a stale temporary file (its writer died) from one being written (KVW-WRITE-5)."""
    d, base = os.path.split(target)
    return os.path.join(d, f".{base}.{_HOST}.{os.getpid()}.{secrets.token_hex(6)}{TEMP_SUFFIX}")


def remove_stale_temps(target: str) -> list[str]:
    """Remove the temporary files of ``target`` left by writers of this host that no longer
    run (killed mid-save); returns the paths removed. Temporaries of live writers, and of
    other hosts sharing the directory, are left alone."""
    d, base = os.path.split(target)
    removed: list[str] = []
    try:
        names = os.listdir(d or ".")
    except OSError:
        return removed
    for name in names:
        parts = name[len(base) + 2 :].split(".") if name.startswith(f".{base}.") else []
        if len(parts) != 4 or "." + parts[3] != TEMP_SUFFIX or parts[0] != _HOST or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        if pid == os.getpid() or _alive(pid):
            continue
        try:
            os.unlink(os.path.join(d, name))
            removed.append(os.path.join(d, name))
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _target_of(path) -> str:
    """The file a write to ``path`` replaces: a symbolic link is followed to its target,
    which is written, and the link kept (KVW-WRITE-4)."""
    path = os.path.abspath(os.fspath(path))
    return os.path.realpath(path) if os.path.islink(path) else path


def _new_mode(target: str) -> int:
    """The mode of the file ``target`` replaces, or 0o666 & ~umask for a new one (KVW-WRITE-3)."""
    try:
        st = os.stat(target)
    except FileNotFoundError:
        return 0o666 & ~_umask()
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory, cannot be replaced by a container file", target)
    return stat.S_IMODE(st.st_mode)


def _link_unnamed(fd: int, name: str) -> bool:
    """Give the O_TMPFILE file ``fd`` the name ``name``: linkat through /proc/self/fd, else
    linkat(AT_EMPTY_PATH) (needs CAP_DAC_READ_SEARCH); False when neither works here."""
    try:
        os.link(f"/proc/self/fd/{fd}", name, follow_symlinks=True)
        return True
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.ENOENT, errno.EPERM, errno.EACCES, errno.EINVAL):
            raise
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.linkat(fd, b"", -100, os.fsencode(name), 0x1000) == 0  # AT_FDCWD, AT_EMPTY_PATH
    except (OSError, AttributeError):
        return False


def _name_unnamed(fd: int, target: str, fsync: bool) -> str:
    """A name next to ``target`` for the complete O_TMPFILE file ``fd`` (it exists only
    until the rename that follows): a link where the platform allows, else a copy."""
    tmp = _temp_name(target)
    if os.fstat(fd).st_dev not in _NO_LINK and _link_unnamed(fd, tmp):
        return tmp
    _NO_LINK.add(os.fstat(fd).st_dev)  # later saves to this file system write a named file at once
    out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        size, pos = os.fstat(fd).st_size, 0
        while pos < size:
            n = os.sendfile(out, fd, pos, min(size - pos, 1 << 30))
            if n == 0:
                raise OSError(errno.EIO, "short copy of the temporary file", tmp)
            pos += n
        os.fchmod(out, os.fstat(fd).st_mode & 0o7777)
        if fsync:
            os.fsync(out)
    except BaseException:
        os.close(out)
        os.unlink(tmp)
        raise
    os.close(out)
    return tmp


def _open_temp(target: str) -> tuple[int, str | None]:
    """A writable file, mode 0600, in ``target``'s directory: unnamed (O_TMPFILE) where the
    file system allows, so a killed writer leaves nothing; else a named temporary file."""
    directory = os.path.dirname(target)
    if USE_O_TMPFILE and os.stat(directory).st_dev not in _NO_LINK:
        try:
            return os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600), None
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
                raise
    remove_stale_temps(target)
    tmp = _temp_name(target)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
    return os.open(tmp, flags, 0o600), tmp


def atomic_write(path, buffers, *, fsync: bool = False) -> int:
    """writev ``buffers`` to a temporary file next to ``path``, then put it in place of ``path``.

    ``path`` holds either its old content or all of the new bytes, never a mix; with
    ``fsync=True`` the file and its directory entry are durable before this returns. The
    new file keeps the mode of the one it replaces (a new file: 0o666 & ~umask) and is
    0600 until complete; a symbolic link is followed and kept; a writer killed at any
    moment leaves no temporary file on Linux (O_TMPFILE), elsewhere the next save of the
    same target removes it (KVW-WRITE-3 to 5).
    """
    target = _target_of(path)
    mode = _new_mode(target)
    fd, tmp = _open_temp(target)
    try:
        try:
            size = write_all(fd, buffers)
            if hasattr(os, "fchmod"):
                os.fchmod(fd, mode)
            if fsync:
                os.fsync(fd)
            if tmp is None:  # give the unnamed file a name for an instant, then rename it over
                tmp = _name_unnamed(fd, target, fsync)
        finally:
            os.close(fd)
        if tmp is not None and not hasattr(os, "fchmod"):
            os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        raise
    if fsync:
        dfd = os.open(os.path.dirname(target), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return size


ENCODE_KEYWORDS = ("codec", "level", "chunk_tokens", "alignment", "first_position", "model", "metadata", "header_changes")


def encode(cache: KVCache | SparseKVCache, *, codec: Any = "raw", level: int = DEFAULT_ZSTD_LEVEL, form: str = "file",
           chunk_tokens: int | None = None, alignment: int | None = None, first_position: int | None = None,
           model: ModelIdentity | None = None, metadata: dict | None = None, header_changes: dict | None = None,
           **unknown: Any) -> bytes:
    """The whole container as bytes. ``codec``: "raw" (default), "zstd", a preset of
    ``kvwire.codecs.PRESETS`` ("byteplane", "int8", "int4-g32-zstd", "kivi2", ...), a
    ``CodecSpec``, ``{(layer, component): codec}`` or a callable (spec/codecs.md); ``level``: the zstd level; ``form``: "file" (seekable, with an
    index) or "stream". ``chunk_tokens``, ``alignment``, ``first_position``, ``model`` and
    ``metadata`` replace those Header fields for this encoding (None: the cache's own);
    ``header_changes``: any other Header fields. An unknown keyword is a TypeError naming these.
    """
    changes = check_keywords("encode", unknown, ("form", *ENCODE_KEYWORDS), header_changes, chunk_tokens=chunk_tokens,
                             alignment=alignment, first_position=first_position, model=model, metadata=metadata)
    return b"".join(iter_buffers(cache, form=form, codec=codec, level=level, **changes))


def save(file: Target, cache: KVCache | SparseKVCache, *, codec: Any = "raw", level: int = DEFAULT_ZSTD_LEVEL,
         fsync: bool = False, chunk_tokens: int | None = None, alignment: int | None = None,
         first_position: int | None = None, model: ModelIdentity | None = None, metadata: dict | None = None,
         header_changes: dict | None = None, **unknown: Any) -> int:
    """Write ``cache`` (a ``KVCache`` or ``SparseKVCache``) in file form; returns the size.

    ``file``: a path (str or os.PathLike), written atomically (``atomic_write``: a reader
    sees the old file or the whole new one), or a binary file object opened for writing
    (``open(p, "wb")``, ``io.BytesIO()``, a pipe; seekable or not), written from its current
    position, not atomically, and left open. ``fsync=True``: durable before this returns (a
    file object needs a ``fileno()``). The other keywords are ``encode``'s."""
    if hasattr(file, "chunk_arrays"):
        raise TypeError("kvwire.save(file, cache): the file comes first (torch.save(obj, f) has the other order)")
    check_cache(cache, "save")
    changes = check_keywords("save", unknown, ("fsync", *ENCODE_KEYWORDS), header_changes, chunk_tokens=chunk_tokens,
                             alignment=alignment, first_position=first_position, model=model, metadata=metadata)
    buffers = iter_buffers(cache, form="file", codec=codec, level=level, **changes)
    if isinstance(file, (str, os.PathLike)):
        return atomic_write(file, buffers, fsync=fsync)
    if not callable(getattr(file, "write", None)) or isinstance(file, io.TextIOBase):
        raise TypeError(f"save() writes to a path (str or os.PathLike) or a binary file object (mode 'wb'), not "
                        f"{type(file).__name__}")
    if fsync and not has_fileno(file):
        raise ValueError(f"fsync=True needs a file with a descriptor (fileno()); a {type(file).__name__} has none")
    total = 0
    for mv in map(lambda b: memoryview(b).cast("B"), buffers):
        while mv.nbytes:  # a raw (unbuffered) file may take part of a buffer; None: all of it
            n = file.write(mv)
            total, mv = total + (mv.nbytes if n is None else n), mv[mv.nbytes if n is None else n :]
    if fsync:
        file.flush()
        os.fsync(file.fileno())
    return total


def save_tensors(tensors: Mapping[str, Any], file: Target, *, model: ModelIdentity | None = None,
                 first_position: int = 0, metadata: dict | None = None, codec: Any = "raw",
                 level: int = DEFAULT_ZSTD_LEVEL, fsync: bool = False) -> int:
    """``save`` for safetensors users: ``tensors`` is ``{"layers.<i>.k": K, "layers.<i>.v": V}``
    (i = 0 ... n-1, each [heads, tokens, head_dim], numpy or torch; ``KVCache.from_dict``), in
    safetensors' argument order (tensors, then file); returns the size."""
    cache = KVCache.from_dict(tensors, model=model, first_position=first_position, metadata=metadata)
    return save(file, cache, codec=codec, level=level, fsync=fsync)


def load_tensors(source: Source, *, device: Any = None, backend: str | None = None, verify: bool = True,
                 mmap: bool | None = None) -> dict:
    """``{"layers.<i>.<component>": tensor}`` of a container (``KVCache.to_dict``); ``source``
    and the keywords as for ``load``. A sparse container has no such flat form: ``kvwire.load``
    gives its ``SparseKVCache``."""
    cache = load(source, device=device, backend=backend, verify=verify, mmap=mmap)
    if not isinstance(cache, KVCache):
        raise ValueError("load_tensors reads dense containers; this one is sparse (per-head retained tokens): "
                         "read it with kvwire.load, which returns a SparseKVCache")
    return cache.to_dict()


# -- reading files ------------------------------------------------------------------------

def open(source: Source, *, mmap: bool | None = None,  # noqa: A001 (kvwire.open, named like the builtin on purpose)
         max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES) -> Reader:
    """A ``Reader`` over a path, a bytes-like object or a binary file object.

    ``mmap`` (paths): ``False`` reads the file into memory of the reader's own, immune to
    whatever other processes do to the file afterwards; ``True`` maps it (privately), so
    raw chunks are zero-copy views of the page cache; ``None`` (default) maps a file that
    only this user can write (owned by this user, no group/other write bit) and reads any
    other into memory, since a file in a shared store may be truncated or rewritten by
    another user's process. Hazard of a mapping: if the file is truncated while the reader
    or one of its views is alive, touching the lost pages kills the process with SIGBUS,
    and a rewrite in place changes already-verified views. The reader checks the file's
    size before each chunk access and raises ``TruncatedError`` instead of touching a
    shrunk file, but views already handed out cannot be protected. kvwire's own writers
    replace files atomically (new inode), which never affects a mapping.

    A bytes-like ``source`` is used in place (``mmap=False``: copied first). A file object
    (``open(p, "rb")``, ``io.BytesIO``, a pipe or socket file; seekable or not) is read from
    its current position to its end into memory of the reader's own. Paths that
    are not regular files are refused before any read: ``IsADirectoryError`` for a
    directory, ``OSError`` (EINVAL) for a FIFO, device or socket.
    """
    check_choice("mmap", mmap, (None, True, False))
    max_decoded_bytes = check_count("max_decoded_bytes", max_decoded_bytes)
    if isinstance(source, (str, os.PathLike)):
        fd: int | None
        fd, st = open_regular(source)
        guard = closer = None
        try:
            use_map = only_this_user_can_write(st) if mmap is None else mmap
            buf: bytes | memoryview
            if st.st_size == 0:
                buf = b""
            elif use_map:
                buf, guard, closer = map_file(fd, st)
                fd = None
            else:
                buf = read_all(fd, st.st_size)
        finally:
            if fd is not None:
                os.close(fd)
        try:
            return Reader(buf, max_decoded_bytes=max_decoded_bytes, _closer=closer, _guard=guard)
        except BaseException:
            if closer:
                closer()
            raise
    data: Any = source  # a bytes-like object, or a binary file object until it is read
    try:
        memoryview(data)
    except TypeError:
        if not callable(getattr(data, "read", None)):
            raise TypeError(f"kvwire.open() needs a path (str or os.PathLike), a binary file object or a bytes-like "
                            f"object, not {type(data).__name__}") from None
        if mmap:
            raise ValueError("mmap=True maps a file: pass its path, not a file object") from None
        data, mmap = data.read(), None  # the reader's own bytes
        if not isinstance(data, bytes):
            raise TypeError(f"kvwire.open() needs a binary file object (mode 'rb'); read() gave "
                            f"{type(data).__name__}") from None
    if mmap:
        raise ValueError("mmap=True maps a file: pass a path, or a buffer with mmap=None/False")
    return Reader(bytes(data) if mmap is False else data, max_decoded_bytes=max_decoded_bytes)


def load(source: Source, *, device: Any = None, backend: str | None = None, verify: bool = True,
         mmap: bool | None = None, max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES,
         threads: int | None = None) -> KVCache | SparseKVCache:
    """A ``KVCache`` with its own memory (checksums verified unless ``verify=False``) from a
    path, bytes-like object or binary file object (as for ``open``); ``mmap`` as for ``open``;
    ``device`` ("cpu", "cuda:0", ...) implies ``backend="torch"``; ``threads``: chunks
    assembled on that many threads when native codecs are on (``Reader.load``)."""
    if backend is None:
        backend = "torch" if device is not None else "numpy"
    check_choice("backend", backend, BACKENDS)
    with open(source, mmap=mmap, max_decoded_bytes=max_decoded_bytes) as r:
        return r.load(verify=verify, backend=backend, device=device, threads=threads)
