"""``LocalStore`` ("file://DIR"): the embedded default store, one regular file per key.

Why files: nothing needs a server to try kvwire, several processes on one machine share
the directory, and the kernel's page cache does the caching. The rules it keeps
(spec/store.md, KVW-STORE-7..10):

- *Atomic, no-overwrite publish.* An object is written to an unnamed ``O_TMPFILE`` in its
  directory (or, where that is refused, a dot-named temporary file) and then *linked* to
  its name. ``link`` fails when the name exists, so a concurrent writer of the same key
  loses cleanly (counted as skipped) and a reader sees either no file or the whole one.
  A killed writer leaves nothing behind (O_TMPFILE) or a dot file that ``gc`` removes.
- *Ranged reads* use ``pread`` of the range alone: the file is never read whole for a
  header.
- *LRU eviction under a size cap.* Every successful ``get`` stamps the file's atime with
  ``utime`` (explicitly, so it does not depend on the mount's relatime/noatime). When this
  process's estimate of the directory's size passes the cap (or every ``rescan_puts``
  puts), it walks the directory and unlinks the files with the oldest atime until the total
  is under 90% of the cap. Unlinking never disturbs a reader that already opened the
  file (POSIX keeps the inode until it is closed), so eviction can only turn a later
  lookup into a miss, never into a partial or wrong object.
"""

from __future__ import annotations

import errno
import os
import stat
import time
import secrets

from ..cache.files import write_all
from .base import LOCAL_BATCH_BYTES, Store, StoreError, check_key, check_keys, resolve_range

LOW_WATER = 0.9  # eviction stops below this fraction of the cap
TEMP_PREFIX = ".tmp-"
STALE_TEMP_SECONDS = 3600.0


class LocalStore(Store):
    batch_bytes = LOCAL_BATCH_BYTES
    def __init__(self, root, *, max_bytes: int | None = None, rescan_puts: int = 64, fsync: bool = False):
        super().__init__()
        if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0):
            raise ValueError(f"max_bytes must be a positive int or None, not {max_bytes!r}")
        self.root = os.path.abspath(os.fspath(root))
        self.url = "file://" + self.root
        self.max_bytes, self.rescan_puts, self.fsync = max_bytes, max(1, int(rescan_puts)), fsync
        self._estimate: int | None = None
        self._puts_since_scan = 0
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"{self.url}: cannot create the store directory: {exc}") from exc
        self.use_tmpfile = self._can_link_unnamed()

    def _can_link_unnamed(self) -> bool:
        """Whether this file system links an O_TMPFILE file to a name (some refuse: EXDEV,
        EOPNOTSUPP); probed once, with a dot name that listings skip."""
        if not hasattr(os, "O_TMPFILE") or not os.path.isdir("/proc/self/fd"):
            return False
        probe = os.path.join(self.root, f"{TEMP_PREFIX}probe-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            fd = os.open(self.root, os.O_TMPFILE | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError:
            return False
        try:
            os.link(f"/proc/self/fd/{fd}", probe, follow_symlinks=True)
            os.unlink(probe)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def path(self, key: str) -> str:
        check_key(key)
        return self.root + os.sep + (key if os.sep == "/" else key.replace("/", os.sep))

    # -- reads ---------------------------------------------------------------------------
    def get(self, key, byte_range=None):
        path = self.path(key)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        except (FileNotFoundError, NotADirectoryError):
            self.count(gets=1, misses=1)
            return None
        except OSError as exc:
            raise StoreError(f"{self.url}: cannot open {key!r}: {exc}") from exc
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

    def exists(self, key) -> bool:
        self.count(exists_calls=1)
        return self._is_file(self.path(key))

    def exists_many(self, keys) -> list[bool]:
        paths = [self.path(k) for k in keys]
        self.count(exists_calls=1)
        return [self._is_file(p) for p in paths]

    def leading(self, keys) -> int:
        """Leading keys that exist, stopping at the first miss. The keys are checked in one
        pass, and each is ``stat``-ed relative to its open directory (a request's chunk
        keys share one), so the kernel does not walk the key's eight path segments 512
        times."""
        self.count(exists_calls=1)
        n, dir_name, dir_fd = 0, None, None
        try:
            for k in check_keys(keys):
                d, _, name = k.rpartition("/")
                if d != dir_name:
                    if dir_fd is not None:
                        os.close(dir_fd)
                        dir_fd = None
                    dir_name = d
                    try:
                        dir_fd = os.open(self.root + ("/" + d if d else ""), os.O_RDONLY | os.O_DIRECTORY)
                    except (FileNotFoundError, NotADirectoryError):
                        break
                try:
                    if not stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                        break
                except (FileNotFoundError, NotADirectoryError):
                    break
                n += 1
        except OSError as exc:
            raise StoreError(f"{self.url}: stat failed: {exc}") from exc
        finally:
            if dir_fd is not None:
                os.close(dir_fd)
        return n

    def _is_file(self, path: str) -> bool:
        try:
            return stat.S_ISREG(os.lstat(path).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as exc:
            raise StoreError(f"{self.url}: stat of {path!r} failed: {exc}") from exc

    def list(self, prefix: str = "") -> list[str]:
        return sorted(k for k, _, _ in self._walk() if k.startswith(prefix))

    def sizes(self, keys) -> list:
        """Each key's file size by ``lstat`` (None: no regular file), reading no bytes."""
        out = []
        for path in [self.path(k) for k in keys]:
            try:
                st = os.lstat(path)
            except (FileNotFoundError, NotADirectoryError):
                out.append(None)
                continue
            except OSError as exc:
                raise StoreError(f"{self.url}: stat of {path!r} failed: {exc}") from exc
            out.append(st.st_size if stat.S_ISREG(st.st_mode) else None)
        return out

    def info(self) -> dict:
        """Objects and bytes of the directory (one walk), its cap, and the dot-named
        temporaries: all of them and those older than an hour that ``gc`` removes."""
        objects = total = 0
        for _, size, _ in self._walk():
            objects += 1
            total += size
        temps = stale = 0
        now = time.time()
        for dirpath, _, files in os.walk(self.root):
            for name in files:
                if not name.startswith(TEMP_PREFIX):
                    continue
                try:
                    age = now - os.lstat(os.path.join(dirpath, name)).st_mtime
                except FileNotFoundError:
                    continue
                temps += 1
                stale += age > STALE_TEMP_SECONDS
        return {"url": self.url, "backend": type(self).__name__, "root": self.root, "objects": objects,
                "bytes": total, "max_bytes": self.max_bytes, "temporaries": temps, "stale_temporaries": stale}

    def _walk(self):
        """(key, size, atime_ns) of every object; dot names (temporaries) are skipped."""
        for dirpath, dirs, files in os.walk(self.root):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            rel = os.path.relpath(dirpath, self.root)
            base = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            for name in files:
                if name.startswith("."):
                    continue
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue  # evicted or deleted meanwhile
                if stat.S_ISREG(st.st_mode):
                    yield base + name, st.st_size, st.st_atime_ns

    # -- writes --------------------------------------------------------------------------
    def put(self, key, value) -> bool:
        path = self.path(key)
        if self._is_file(path):
            self.count(puts=1, skipped=1)
            return False
        try:
            single = memoryview(value).cast("B")
        except TypeError:
            single = None
        if single is None and (isinstance(value, str) or not hasattr(value, "__iter__")):
            raise TypeError(f"a store value is bytes-like or a sequence of bytes-like buffers, not "
                            f"{type(value).__name__}")
        buffers = [single] if single is not None else value
        if self.max_bytes is not None and single is not None and single.nbytes > self.max_bytes:
            raise StoreError(f"object {key!r} of {single.nbytes} bytes exceeds the size cap of {self.max_bytes}")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            written, size = self._publish(path, buffers)
        except StoreError:
            raise
        except OSError as exc:
            raise StoreError(f"{self.url}: writing {key!r} failed ({errno.errorcode.get(exc.errno, exc.errno)}: "
                             f"{exc.strerror}); no partial object was published") from exc
        if not written:
            self.count(puts=1, skipped=1)
            return False
        self.count(puts=1, written=1, bytes_out=size)
        self._after_put(size)
        return True

    def _publish(self, path: str, buffers) -> tuple[bool, int]:
        d = os.path.dirname(path)
        if self.use_tmpfile:
            try:
                fd = os.open(d, os.O_TMPFILE | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0), 0o644)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
                    raise
                self.use_tmpfile = False
            else:
                try:
                    size = self._fill(fd, buffers)
                    try:
                        os.link(f"/proc/self/fd/{fd}", path, follow_symlinks=True)
                    except FileExistsError:
                        return False, size
                    return True, size
                finally:
                    os.close(fd)
        tmp = os.path.join(d, f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            try:
                size = self._fill(fd, buffers)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False, size
            return True, size
        finally:
            os.unlink(tmp)

    def _fill(self, fd: int, buffers) -> int:
        size = write_all(fd, buffers)
        if self.fsync:
            os.fsync(fd)
        return size

    def delete(self, key) -> bool:
        try:
            os.unlink(self.path(key))
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as exc:
            raise StoreError(f"{self.url}: deleting {key!r} failed: {exc}") from exc
        self.count(deletes=1)
        return True

    # -- size cap ------------------------------------------------------------------------
    @property
    def total_bytes(self) -> int:
        return sum(size for _, size, _ in self._walk())

    def _after_put(self, size: int) -> None:
        if self.max_bytes is None:
            return
        self._puts_since_scan += 1
        if self._estimate is not None:
            self._estimate += size
        if self._estimate is None or self._estimate > self.max_bytes or self._puts_since_scan >= self.rescan_puts:
            self.evict()

    def evict(self, target: int | None = None) -> int:
        """Unlink least-recently-used objects until the directory holds at most ``target``
        bytes (default: 90% of the cap when over the cap); returns how many were removed."""
        objects = sorted(self._walk(), key=lambda o: o[2])
        total = sum(o[1] for o in objects)
        self._puts_since_scan = 0
        if target is None:
            if self.max_bytes is None or total <= self.max_bytes:
                self._estimate = total
                return 0
            target = int(self.max_bytes * LOW_WATER)
        removed = 0
        for key, size, _ in objects:
            if total <= target:
                break
            try:
                os.unlink(self.path(key))
                removed += 1
            except FileNotFoundError:
                pass  # another process evicted or deleted it
            total -= size
        self._estimate = total
        self.count(evictions=removed)
        return removed

    def gc(self) -> int:
        """Remove dot-named temporary files older than an hour (writers killed mid-put)."""
        removed, now = 0, time.time()
        for dirpath, _, files in os.walk(self.root):
            for name in files:
                p = os.path.join(dirpath, name)
                try:
                    if name.startswith(TEMP_PREFIX) and now - os.lstat(p).st_mtime > STALE_TEMP_SECONDS:
                        os.unlink(p)
                        removed += 1
                except FileNotFoundError:
                    pass
        return removed


__all__ = ["LocalStore"]
