"""The file store's directory (spec/store.md section 3, KVW-STORE-28..35): what makes a
directory a kvwire store, who may own it, and how a path inside it is reached.

Why a module of its own: a store that deletes files is dangerous in the wrong directory
(a ``gc`` once pointed through a ``..`` URL at ``/etc`` emptied it), so everything
that decides *which* files kvwire may touch lives here, small enough to read at once:

- the **marker** ``DIR/.kvwire-store`` that kvwire writes when it creates (or an operator
  adopts) a store; no marker, no deleting;
- the **ownership and mode** checks: a private store belongs to the user and nobody else
  may write it; ``shared=group`` stores are group-writable (setgid directories) on purpose;
- **no-follow resolution**: every directory below the root is opened one segment at a time
  with ``O_NOFOLLOW`` relative to its parent's descriptor, so a symbolic link planted
  inside the store never leads a get, put, delete, eviction or gc outside it;
- what counts as a **kvwire object** (a regular file at a valid key path that starts with
  the container magic, or the tag magic of an object's ``K.tag``, KVW-AUTH-3) and as one
  of **our temporaries** (``.tmp-<pid>-<hex>``).
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
import time

from ..format.container import MAGIC
from .auth import TAG_MAGIC
from .base import KEY_RE, MAX_KEY_LENGTH, SEGMENT, StoreError

MARKER = ".kvwire-store"
MARKER_MAX = 4096  # bytes of a marker read at most
KEYS_VERSION = "kvw1"
TEMP_PREFIX = ".tmp-"
TEMP_RE = re.compile(r"\.tmp-(?:probe-)?[0-9]+-[0-9a-f]+")  # the names LocalStore gives its temporaries
STALE_TEMP_SECONDS = 3600.0
SHARED = {  # the shared= choice -> (directory mode, object mode)
    "private": (0o700, 0o600),
    "group": (0o2770, 0o640),
}
SEGMENT_RE = re.compile(SEGMENT)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | NOFOLLOW | CLOEXEC
PROBE_FLAGS = os.O_RDONLY | NOFOLLOW | CLOEXEC | getattr(os, "O_NONBLOCK", 0)  # a FIFO never blocks a probe
NOATIME = getattr(os, "O_NOATIME", 0)
ESCAPES = (errno.ELOOP, errno.ENOTDIR)  # a segment is a symbolic link or not a directory


def check_shared(shared) -> str:
    if shared not in SHARED:
        raise StoreError(f"shared={shared!r} is not a store sharing mode; one of: {', '.join(SHARED)} "
                         "(private: only you, directories 0700 and objects 0600; group: directories 0770 + "
                         "setgid, objects 0640)")
    return shared


def check_root_path(path: str) -> str:
    """KVW-STORE-29: a store path with a ``..`` component is refused (it names a directory
    other than the one it seems to)."""
    if not path:
        raise StoreError("a file store needs a directory (file:///var/cache/kvwire)")
    if "\0" in path:
        raise StoreError(f"store directory {path!r} contains a NUL byte")
    if ".." in path.replace(os.sep, "/").split("/"):
        raise StoreError(f"store directory {path!r}: a '..' component is refused (KVW-STORE-29); name the "
                         "directory itself")
    return path


def marker_text(shared: str) -> bytes:
    return f"kvwire store\nkeys: {KEYS_VERSION}\nshared: {shared}\n".encode()


def read_marker(root_fd: int, where: str) -> str | None:
    """The ``shared`` mode a marker records, None when there is no marker; StoreError for
    a marker that is not a regular file or not one kvwire wrote (KVW-STORE-28)."""
    try:
        fd = os.open(MARKER, PROBE_FLAGS, dir_fd=root_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StoreError(f"{where}: cannot open the store marker {MARKER}: {exc}") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StoreError(f"{where}: {MARKER} is not a regular file; not a store kvwire made")
        text = os.pread(fd, MARKER_MAX, 0)
    finally:
        os.close(fd)
    lines = text.decode("utf-8", "replace").splitlines()
    fields = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    if not lines or lines[0] != "kvwire store" or fields.get("keys") != KEYS_VERSION or fields.get("shared") not in SHARED:
        raise StoreError(f"{where}: {MARKER} is not a kvwire store marker for keys {KEYS_VERSION} "
                         f"(it reads {text[:80]!r})")
    return fields["shared"]


def write_marker(root_fd: int, shared: str, where: str) -> None:
    """Publish the marker like an object (temporary, then link: never half a marker); a
    marker another process linked first is fine when it records the same mode."""
    tmp = f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, 0o600, dir_fd=root_fd)
    try:
        try:
            os.fchmod(fd, SHARED[shared][1])
            os.write(fd, marker_text(shared))
        finally:
            os.close(fd)
        try:
            os.link(tmp, MARKER, src_dir_fd=root_fd, dst_dir_fd=root_fd, follow_symlinks=False)
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp, dir_fd=root_fd)
    got = read_marker(root_fd, where)
    if got != shared:
        raise StoreError(f"{where}: created as shared={got} by another process, not shared={shared}")


def check_owner(st: os.stat_result, shared: str, where: str) -> None:
    """KVW-STORE-32: a private store is the user's own and writable by nobody else; a
    group store is not writable by others."""
    mode = stat.S_IMODE(st.st_mode)
    if shared == "private":
        if st.st_uid != os.geteuid():
            raise StoreError(f"{where}: the store directory is owned by uid {st.st_uid}, not by you (uid "
                             f"{os.geteuid()}); a private store is refused (KVW-STORE-32). A store shared on "
                             "purpose says so: file://DIR?shared=group")
        if mode & 0o022:
            raise StoreError(f"{where}: the store directory is writable by {'group' if mode & 0o020 else 'others'} "
                             f"(mode {mode:04o}); a private store is refused (KVW-STORE-32): chmod go-w it, or "
                             "open it as file://DIR?shared=group if it is shared on purpose")
    elif mode & 0o002:
        raise StoreError(f"{where}: the store directory is writable by others (mode {mode:04o}); refused even "
                         "when shared=group (KVW-STORE-32): chmod o-w it")


def make_dirs(path: str, mode: int) -> None:
    """Create ``path`` and its missing parents with ``mode`` (not umask's choice)."""
    parent = os.path.dirname(path)
    if parent != path and not os.path.isdir(parent):
        make_dirs(parent, mode & 0o755 if mode & 0o070 else mode)  # group stores: parents traversable
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        return
    os.chmod(path, mode)


def open_dir(name: str, parent_fd: int) -> int:
    return os.open(name, DIR_FLAGS, dir_fd=parent_fd)


class Dirs:
    """Directory descriptors of one operation or batch (KVW-STORE-30): the root once, and
    each key's directory opened segment by segment with ``O_NOFOLLOW`` from it; a batch's
    keys share their directory, so it is resolved once."""

    def __init__(self, root: str):
        try:
            # the root was resolved once, when the store was opened (KVW-STORE-29): a link put in
            # its place since is refused, never followed
            self.root_fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | NOFOLLOW | CLOEXEC)
        except OSError as exc:
            raise StoreError(f"file://{root}: cannot open the store directory: {exc}") from exc
        self.fds: dict[str, int | None] = {"": self.root_fd}

    def get(self, d: str, create_mode: int | None = None) -> int | None:
        """The descriptor of directory ``d`` (a key's directory part), None when a segment is
        missing, a symbolic link or not a directory. ``create_mode``: create what is missing
        with that mode (and fail with StoreError on a symbolic link)."""
        if d in self.fds and (self.fds[d] is not None or create_mode is None):
            return self.fds[d]
        parent, _, name = d.rpartition("/")
        pfd = self.get(parent, create_mode)
        fd = None
        if pfd is not None:
            try:
                fd = open_dir(name, pfd)
            except FileNotFoundError:
                if create_mode is not None:
                    fd = self._mkdir(name, pfd, create_mode, d)
            except OSError as exc:
                if exc.errno not in ESCAPES:
                    raise
                if create_mode is not None:
                    raise StoreError(f"store path {d!r}: a segment is a symbolic link or not a directory; "
                                     "kvwire never follows one inside a store (KVW-STORE-30)") from exc
        self.fds[d] = fd
        return fd

    @staticmethod
    def _mkdir(name: str, pfd: int, mode: int, d: str) -> int:
        try:
            os.mkdir(name, mode, dir_fd=pfd)
            made = True
        except FileExistsError:
            made = False  # another writer made it meanwhile
        try:
            fd = open_dir(name, pfd)
        except OSError as exc:
            raise StoreError(f"store path {d!r}: not a directory kvwire may use (KVW-STORE-30): {exc}") from exc
        if made:
            os.fchmod(fd, mode)  # the mode asked for, whatever the umask (KVW-STORE-31)
        return fd

    def close(self) -> None:
        for fd in set(self.fds.values()):
            if fd is not None:
                os.close(fd)
        self.fds = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_root(root: str, shared: str, create: bool, where: str) -> None:
    """Check (and with ``create``, make) the store at the resolved directory ``root``:
    KVW-STORE-28 (the marker; a non-empty directory without one is refused), 31 (a new
    store's modes), 32 (owner and modes) and 33 (the sharing mode the marker records)."""
    dir_mode = SHARED[shared][0]
    if not os.path.lexists(root):
        if not create:
            raise StoreError(f"{where}: no store here (the directory does not exist); a command that only "
                             "reads never creates one")
        try:
            make_dirs(root, dir_mode)
        except OSError as exc:
            raise StoreError(f"{where}: cannot create the store directory: {exc}") from exc
    if not os.path.isdir(root):
        raise StoreError(f"{where}: not a directory")
    with Dirs(root) as dirs:
        st = os.fstat(dirs.root_fd)
        found = read_marker(dirs.root_fd, where)
        if found is None:
            if os.listdir(dirs.root_fd):
                raise StoreError(f"{where}: this directory holds files but is not a kvwire store (no {MARKER} "
                                 f"marker); kvwire never writes to or deletes from such a directory "
                                 f"(KVW-STORE-28). To adopt it on purpose: kvwire store init --url {where}")
            if not create:
                raise StoreError(f"{where}: an empty directory, not a kvwire store yet (no {MARKER}); a command "
                                 "that only reads never creates one")
            if st.st_uid == os.geteuid():
                os.fchmod(dirs.root_fd, dir_mode)  # a new store is private (or group) from its start
                st = os.fstat(dirs.root_fd)
            check_owner(st, shared, where)
            try:
                write_marker(dirs.root_fd, shared, where)
            except OSError as exc:
                raise StoreError(f"{where}: cannot write the store marker: {exc}") from exc
            return
        if found != shared:
            raise StoreError(f"{where}: this store was created with shared={found}, not shared={shared} "
                             f"(KVW-STORE-33); open it as file://{root}" + ("" if found == "private" else
                                                                           f"?shared={found}"))
        check_owner(st, shared, where)


def require_marker(root_fd: int, where: str, what: str) -> None:
    """KVW-STORE-28: nothing is deleted from a directory that is not (any more) a store."""
    if read_marker(root_fd, where) is None:
        raise StoreError(f"{where}: refusing to {what}: the directory has no {MARKER} marker, so it is not a "
                         f"kvwire store (KVW-STORE-28); to adopt it: kvwire store init --url {where}")


def lstat_at(dfd: int, name: str):
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def split_key(key: str) -> tuple[str, str]:
    d, _, name = key.rpartition("/")
    return d, name


def probe_object(dir_fd: int, name: str):
    """``(stat, is_kvwire_object)`` of the file ``name`` (not following a link), or None
    when it is missing or not a regular file; a kvwire object starts with the container
    magic or the tag magic (KVW-STORE-34). Reading the magic does not move the LRU clock:
    ``O_NOATIME`` where allowed, else the access time is put back."""
    fd = None
    for flags in ((PROBE_FLAGS | NOATIME, PROBE_FLAGS) if NOATIME else (PROBE_FLAGS,)):
        try:
            fd = os.open(name, flags, dir_fd=dir_fd)
            break
        except PermissionError:
            continue
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENXIO, errno.ENOTDIR):
                return None
            raise
    if fd is None:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        head = os.pread(fd, len(MAGIC), 0)
        if not flags & NOATIME and head:
            try:
                os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))
            except OSError:
                pass
        return st, head in (MAGIC, TAG_MAGIC)
    finally:
        os.close(fd)


class ObjectProbe:
    """``probe_object`` that remembers the files it found to be kvwire objects by (inode,
    mtime, size): objects are immutable, so an eviction scan reads each magic once. A
    remembered file is checked again before it is unlinked (``probe_object``)."""

    def __init__(self, limit: int = 1 << 20):
        self.seen: set = set()
        self.limit = limit

    def __call__(self, dfd: int, name: str):
        st = lstat_at(dfd, name)
        if st is None or not stat.S_ISREG(st.st_mode):
            return None
        if (st.st_ino, st.st_mtime_ns, st.st_size) in self.seen:
            return st, True
        got = probe_object(dfd, name)
        if got is not None and got[1]:
            if len(self.seen) > self.limit:
                self.seen.clear()
            self.seen.add((got[0].st_ino, got[0].st_mtime_ns, got[0].st_size))
        return got


def scan_counts(root_fd: int, probe) -> dict:
    """objects / bytes (regular files at key paths), kvwire_objects / kvwire_bytes (KVW-STORE-34)
    and temporaries / stale_temporaries (KVW-STORE-7) of one walk."""
    c = dict.fromkeys(("objects", "bytes", "kvwire_objects", "kvwire_bytes", "temporaries", "stale_temporaries"), 0)
    now = time.time()
    for rel, dfd, _, files in walk(root_fd):
        for name in files:
            if TEMP_RE.fullmatch(name):
                st = lstat_at(dfd, name)
                if st is not None and stat.S_ISREG(st.st_mode):
                    c["temporaries"] += 1
                    c["stale_temporaries"] += now - st.st_mtime > STALE_TEMP_SECONDS
            elif key_of(rel, name) is not None and (got := probe(dfd, name)) is not None:
                c["objects"] += 1
                c["bytes"] += got[0].st_size
                c["kvwire_objects"] += got[1]
                c["kvwire_bytes"] += got[0].st_size if got[1] else 0
    return c


def walk(root_fd: int):
    """``(dir, dir_fd, dirnames, filenames)`` of every directory at a valid key-prefix path
    under the root, not following links (``os.fwalk``); dot names and names no key has are
    pruned. ``dir`` is "" for the root, else the key prefix without a trailing "/"."""
    for dirpath, dirs, files, dfd in os.fwalk(".", dir_fd=root_fd, follow_symlinks=False):
        rel = "" if dirpath == "." else dirpath[2:]
        dirs[:] = [d for d in dirs if SEGMENT_RE.fullmatch(d) and is_real_dir(d, dfd)]  # fwalk lists links too
        yield rel, dfd, dirs, files


def is_real_dir(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


def key_of(rel: str, name: str) -> str | None:
    key = f"{rel}/{name}" if rel else name
    return key if KEY_RE.fullmatch(key) and len(key) <= MAX_KEY_LENGTH else None


__all__ = ["Dirs", "MARKER", "ObjectProbe", "scan_counts", "SHARED", "STALE_TEMP_SECONDS", "TEMP_PREFIX", "TEMP_RE", "check_owner", "check_root_path",
           "check_shared", "key_of", "lstat_at", "make_dirs", "open_root", "require_marker", "probe_object", "read_marker", "split_key", "walk", "write_marker"]
