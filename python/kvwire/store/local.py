"""``LocalStore`` ("file://DIR"): the embedded default store, one regular file per key.

Why files: nothing needs a server to try kvwire, several processes on one machine share
the directory, and the kernel's page cache does the caching. The rules it keeps
(spec/store.md section 3, KVW-STORE-7..10 and 28..35):

- *The store owns only its objects* (``local_fs`` holds these rules): a directory is a
  store when it has the marker ``.kvwire-store`` that kvwire wrote (or ``kvwire store
  init`` after checking); nothing is deleted elsewhere, and eviction and ``gc`` touch only
  kvwire objects (magic checked right before each unlink) and our own temporaries.
- *No escape from the root:* resolved once (``realpath``), then every directory is opened
  segment by segment with ``O_NOFOLLOW`` and every file relative to its directory's fd.
- *Private by default:* directories 0700, objects 0600 (``fchmod``, whatever the umask);
  another user's or a writable store is refused unless the URL says ``?shared=group``.
- *Atomic, no-overwrite publish.* An object is written to an unnamed ``O_TMPFILE`` in its
  directory (or, where that is refused, a dot-named temporary file) and then *linked* to
  its name. ``link`` fails when the name exists, so a concurrent writer of the same key
  loses cleanly (counted as skipped) and a reader sees either no file or the whole one.
- *Ranged reads* use ``pread`` of the range alone: the file is never read whole for a
  header.
- *LRU eviction under a size cap.* Every successful ``get`` stamps the file's atime with
  ``utime`` (explicitly, so it does not depend on the mount's relatime/noatime). When this
  process's estimate of the store's size passes the cap (or every ``rescan_puts`` puts), it
  walks the directory and unlinks the objects with the oldest atime until the total is
  under 90% of the cap. Unlinking never disturbs a reader that already opened the file
  (POSIX keeps the inode until it is closed), so eviction can only turn a later lookup into
  a miss, never into a partial or wrong object.
"""

from __future__ import annotations

import builtins
import errno
import os
import secrets
import stat
import time
from collections.abc import Iterable, Sequence

from ..cache.files import write_all
from . import local_fs as fs
from .base import (
    LOCAL_BATCH_BYTES,
    ByteRange,
    PutValue,
    Store,
    StoreError,
    as_buffers,
    check_key,
    check_keys,
    resolve_range,
)

LOW_WATER = 0.9  # eviction stops below this fraction of the cap
TEMP_PREFIX, STALE_TEMP_SECONDS, MARKER = fs.TEMP_PREFIX, fs.STALE_TEMP_SECONDS, fs.MARKER
RDONLY = os.O_RDONLY | fs.NOFOLLOW | fs.CLOEXEC


class LocalStore(Store):
    """``root``: the store directory. ``shared``: "private" (default) or "group"
    (KVW-STORE-33). ``create``: make a missing or empty directory a store (False: open an
    existing store only; ``kvwire store ls/stats/inspect/gc`` never create one)."""

    batch_bytes = LOCAL_BATCH_BYTES

    def __init__(self, root: str | os.PathLike[str], *, max_bytes: int | None = None, rescan_puts: int = 64, fsync: bool = False,
                 shared: str = "private", create: bool = True):
        super().__init__()
        if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0):
            raise ValueError(f"max_bytes must be a positive int or None, not {max_bytes!r}")
        self.shared = fs.check_shared(shared)
        given = fs.check_root_path(os.fspath(root))
        self.root = os.path.realpath(given)  # once: a symlinked store directory is the user's choice
        self.url = "file://" + self.root + ("" if shared == "private" else f"?shared={shared}")
        self.dir_mode, self.file_mode = fs.SHARED[shared]
        self.max_bytes, self.rescan_puts, self.fsync = max_bytes, max(1, int(rescan_puts)), fsync
        self._estimate: int | None = None
        self._puts_since_scan = 0
        self._probe = fs.ObjectProbe()  # remembers the files seen to be kvwire objects (immutable)
        fs.open_root(self.root, self.shared, create, self.url)
        self.use_tmpfile = self._can_link_unnamed()

    def _dirs(self) -> fs.Dirs:
        return fs.Dirs(self.root)

    def require_marker(self, dirs: fs.Dirs, what: str) -> None:
        fs.require_marker(dirs.root_fd, self.url, what)

    def _can_link_unnamed(self) -> bool:
        """Whether this file system links an O_TMPFILE file to a name (some refuse: EXDEV,
        EOPNOTSUPP); probed once, with a dot name that listings skip."""
        if not hasattr(os, "O_TMPFILE") or not os.path.isdir("/proc/self/fd"):
            return False
        probe = f"{TEMP_PREFIX}probe-{os.getpid()}-{secrets.token_hex(4)}"
        with self._dirs() as dirs:
            try:
                fd = os.open(".", os.O_TMPFILE | os.O_WRONLY | fs.CLOEXEC, 0o600, dir_fd=dirs.root_fd)
            except OSError:
                return False
            try:
                os.link(f"/proc/self/fd/{fd}", probe, dst_dir_fd=dirs.root_fd, follow_symlinks=True)
                os.unlink(probe, dir_fd=dirs.root_fd)
                return True
            except OSError:
                return False
            finally:
                os.close(fd)

    def path(self, key: str) -> str:
        """The file of ``key`` (for people and tests; the store itself never opens by path)."""
        check_key(key)
        return self.root + os.sep + (key if os.sep == "/" else key.replace("/", os.sep))

    # -- reads ---------------------------------------------------------------------------
    def get(self, key: str, byte_range: ByteRange = None) -> bytes | None:
        check_key(key)
        with self._dirs() as dirs:
            return self._get(dirs, key, byte_range)

    def get_many(self, keys: Sequence[str], byte_range: ByteRange = None) -> list:
        with self._dirs() as dirs:
            return [self._get(dirs, k, byte_range) for k in check_keys(keys)]

    def get_ranges(self, requests: Sequence[tuple[str, ByteRange]]) -> list:
        requests = list(requests)
        check_keys([k for k, _ in requests])
        with self._dirs() as dirs:
            return [self._get(dirs, k, r) for k, r in requests]

    def _get(self, dirs: fs.Dirs, key: str, byte_range):
        d, name = fs.split_key(key)
        try:
            dfd = dirs.get(d)
            fd = None if dfd is None else os.open(name, RDONLY, dir_fd=dfd)
        except (FileNotFoundError, NotADirectoryError):
            fd = None
        except OSError as exc:
            if exc.errno != errno.ELOOP:  # a link planted at the key: not an object, a miss
                raise StoreError(f"{self.url}: cannot open {key!r}: {exc}") from exc
            fd = None
        if fd is None:
            self.count(gets=1, misses=1)
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise StoreError(f"{self.url}: {key!r} is not a regular file")
            a, b = resolve_range(byte_range, st.st_size)
            out = os.pread(fd, b - a, a)  # the range only; one read in the usual case
            if len(out) < b - a:
                parts = [out]
                while (got := sum(map(len, parts))) < b - a:
                    more = os.pread(fd, b - a - got, a + got)
                    if not more:
                        raise StoreError(f"{self.url}: {key!r} shrank while being read (objects are immutable)")
                    parts.append(more)
                out = b"".join(parts)
            try:  # the LRU clock (module docstring); a file we may not stamp keeps its write time
                os.utime(fd, ns=(time.time_ns(), st.st_mtime_ns))
            except OSError:
                pass
        except OSError as exc:
            raise StoreError(f"{self.url}: reading {key!r} failed: {exc}") from exc
        finally:
            os.close(fd)
        self.count(gets=1, hits=1, bytes_in=len(out))
        return out

    def _stat(self, dirs: fs.Dirs, key: str):
        """The ``lstat`` of ``key``'s file, None when missing (or a segment is a link)."""
        d, name = fs.split_key(key)
        try:
            dfd = dirs.get(d)
            return None if dfd is None else os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise StoreError(f"{self.url}: stat of {key!r} failed: {exc}") from exc

    def exists(self, key: str) -> bool:
        return self.exists_many([key])[0]

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        keys = check_keys(keys)
        self.count(exists_calls=1)
        with self._dirs() as dirs:
            return [(st := self._stat(dirs, k)) is not None and stat.S_ISREG(st.st_mode) for k in keys]

    def leading(self, keys: Sequence[str]) -> int:
        """Leading keys that exist, stopping at the first miss. The keys are checked in one
        pass, and each is ``stat``-ed relative to its directory's descriptor (a request's
        chunk keys share one, resolved once)."""
        self.count(exists_calls=1)
        n = 0
        with self._dirs() as dirs:
            for k in check_keys(keys):
                st = self._stat(dirs, k)
                if st is None or not stat.S_ISREG(st.st_mode):
                    break
                n += 1
        return n

    def sizes(self, keys: Sequence[str]) -> list:
        """Each key's file size by ``lstat`` (None: no regular file), reading no bytes."""
        keys = check_keys(keys)
        with self._dirs() as dirs:
            return [st.st_size if (st := self._stat(dirs, k)) is not None and stat.S_ISREG(st.st_mode) else None
                    for k in keys]

    def list(self, prefix: str = "") -> list[str]:
        return sorted(k for k, _, _ in self._files() if k.startswith(prefix))

    def info(self) -> dict:
        """Objects and bytes of the store (one walk), the kvwire objects among them (what
        the cap counts and eviction may remove), its cap, and this store's temporaries: all
        of them and those older than an hour that ``gc`` removes."""
        with self._dirs() as dirs:
            counts = fs.scan_counts(dirs.root_fd, self._probe)
        return {"url": self.url, "backend": type(self).__name__, "root": self.root, "shared": self.shared,
                **counts, "max_bytes": self.max_bytes}

    def _files(self, containers_only: bool = False):
        """(key, size, atime_ns) of every regular file at a valid key path (with
        ``containers_only``: of every kvwire object, KVW-STORE-34); links are not followed."""
        with self._dirs() as dirs:
            for rel, dfd, _, files in fs.walk(dirs.root_fd):
                for name in files:
                    key = fs.key_of(rel, name)
                    if key is None:
                        continue
                    if containers_only:
                        got = self._probe(dfd, name)
                        if got is not None and got[1]:
                            yield key, got[0].st_size, got[0].st_atime_ns
                        continue
                    st = fs.lstat_at(dfd, name)
                    if st is not None and stat.S_ISREG(st.st_mode):
                        yield key, st.st_size, st.st_atime_ns

    # -- writes --------------------------------------------------------------------------
    def put(self, key: str, value: PutValue) -> bool:
        check_key(key)
        with self._dirs() as dirs:
            return self._put(dirs, key, value)

    def put_many(self, items: Iterable[tuple[str, PutValue]]) -> builtins.list[bool]:
        items = list(items)
        check_keys([k for k, _ in items])
        with self._dirs() as dirs:
            return [self._put(dirs, k, v) for k, v in items]

    def _put(self, dirs: fs.Dirs, key: str, value) -> bool:
        st = self._stat(dirs, key)
        if st is not None and stat.S_ISREG(st.st_mode):
            self.count(puts=1, skipped=1)
            return False
        if st is not None:  # a link or other file where the object should be (KVW-STORE-30)
            raise StoreError(f"{self.url}: {key!r} is taken by something that is not a regular file (a symbolic "
                             "link?); nothing was written")
        buffers = as_buffers(value)
        if self.max_bytes is not None and len(buffers) == 1 and buffers[0].nbytes > self.max_bytes:
            raise StoreError(f"object {key!r} of {buffers[0].nbytes} bytes exceeds the size cap of {self.max_bytes}")
        d, name = fs.split_key(key)
        try:
            dfd = dirs.get(d, self.dir_mode)
            assert dfd is not None  # with a create mode: the directory's descriptor, or StoreError
            written, size = self._publish(dfd, name, buffers)
        except StoreError:
            raise
        except OSError as exc:
            raise StoreError(f"{self.url}: writing {key!r} failed ({errno.errorcode.get(exc.errno or 0, exc.errno)}: "
                             f"{exc.strerror}); no partial object was published") from exc
        if not written:
            self.count(puts=1, skipped=1)
            return False
        self.count(puts=1, written=1, bytes_out=size)
        self._after_put(size)
        return True

    def _publish(self, dfd: int, name: str, buffers) -> tuple[bool, int]:
        if self.use_tmpfile:
            try:
                fd = os.open(".", os.O_TMPFILE | os.O_WRONLY | fs.CLOEXEC, 0o600, dir_fd=dfd)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
                    raise
                self.use_tmpfile = False
            else:
                try:
                    size = self._fill(fd, buffers)
                    try:
                        os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dfd, follow_symlinks=True)
                    except FileExistsError:
                        return False, size
                    return True, size
                finally:
                    os.close(fd)
        tmp = f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | fs.NOFOLLOW | fs.CLOEXEC, 0o600, dir_fd=dfd)
        try:
            try:
                size = self._fill(fd, buffers)
            finally:
                os.close(fd)
            try:
                os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
            except FileExistsError:
                return False, size
            return True, size
        finally:
            os.unlink(tmp, dir_fd=dfd)

    def _fill(self, fd: int, buffers) -> int:
        os.fchmod(fd, self.file_mode)  # KVW-STORE-31: the mode is the store's, not the umask's
        size = write_all(fd, buffers)
        if self.fsync:
            os.fsync(fd)
        return size

    def delete(self, key: str) -> bool:
        """Unlink the regular file of ``key`` (never a link, never through one); refused
        where the store marker is missing (KVW-STORE-28)."""
        check_key(key)
        d, name = fs.split_key(key)
        with self._dirs() as dirs:
            self.require_marker(dirs, f"delete {key!r}")
            st = self._stat(dirs, key)
            if st is None or not stat.S_ISREG(st.st_mode):
                return False
            try:
                os.unlink(name, dir_fd=dirs.get(d))
            except (FileNotFoundError, NotADirectoryError):
                return False
            except OSError as exc:
                raise StoreError(f"{self.url}: deleting {key!r} failed: {exc}") from exc
        self.count(deletes=1)
        return True

    # -- size cap ------------------------------------------------------------------------
    @property
    def total_bytes(self) -> int:
        """Bytes of the kvwire objects: what the cap counts (KVW-STORE-34)."""
        return sum(size for _, size, _ in self._files(containers_only=True))

    def _after_put(self, size: int) -> None:
        if self.max_bytes is None:
            return
        self._puts_since_scan += 1
        if self._estimate is not None:
            self._estimate += size
        if self._estimate is None or self._estimate > self.max_bytes or self._puts_since_scan >= self.rescan_puts:
            self.evict()

    def evict(self, target: int | None = None) -> int:
        """Unlink least-recently-used kvwire objects until they hold at most ``target``
        bytes (default: 90% of the cap when over the cap); returns how many were removed.
        Files that are not kvwire objects are neither counted nor removed (KVW-STORE-34)."""
        objects = sorted(self._files(containers_only=True), key=lambda o: o[2])
        total = sum(o[1] for o in objects)
        self._puts_since_scan = 0
        if target is None:
            if self.max_bytes is None or total <= self.max_bytes:
                self._estimate = total
                return 0
            target = int(self.max_bytes * LOW_WATER)
        removed = 0
        with self._dirs() as dirs:
            if total > target:
                self.require_marker(dirs, "evict")
            sizes = {key: size for key, size, _ in objects}
            for key, _size, _ in objects:
                if total <= target:
                    break
                if key in sizes and self._unlink_object(dirs, key):
                    removed += 1
                    if key + ".tag" in sizes and self._unlink_object(dirs, key + ".tag"):  # KVW-AUTH-3
                        total -= sizes.pop(key + ".tag")
                total -= sizes.pop(key, 0)
        self._estimate = total
        self.count(evictions=removed)
        return removed

    def _unlink_object(self, dirs: fs.Dirs, key: str) -> bool:
        """Unlink ``key`` after checking, right before, that it is still a kvwire object."""
        d, name = fs.split_key(key)
        dfd = dirs.get(d)
        got = None if dfd is None else fs.probe_object(dfd, name)
        if got is None or not got[1]:
            return False  # gone meanwhile, or no longer a kvwire object: left alone
        try:
            os.unlink(name, dir_fd=dfd)
            return True
        except FileNotFoundError:
            return False  # another process evicted or deleted it

    def gc(self) -> int:
        """Remove this store's temporary files older than an hour (writers killed mid-put);
        no other file (KVW-STORE-34)."""
        removed, now = 0, time.time()
        with self._dirs() as dirs:
            self.require_marker(dirs, "gc")
            for _, dfd, _, files in fs.walk(dirs.root_fd):
                for name in files:
                    if not fs.TEMP_RE.fullmatch(name):
                        continue
                    st = fs.lstat_at(dfd, name)
                    if st is not None and stat.S_ISREG(st.st_mode) and now - st.st_mtime > STALE_TEMP_SECONDS:
                        try:
                            os.unlink(name, dir_fd=dfd)
                            removed += 1
                        except FileNotFoundError:
                            pass
        return removed


__all__ = ["LocalStore", "MARKER"]
