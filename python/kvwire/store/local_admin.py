"""``kvwire store init``: make a directory a file store on purpose (spec/store.md,
KVW-STORE-35).

Why apart from ``LocalStore``: opening a store never adopts a directory that already
holds files (KVW-STORE-28), because the marker is what later lets ``gc`` and eviction
delete there. Adopting one (a store written before the marker existed, or a directory an
operator prepared) is an explicit act that first proves every entry is kvwire's own.
"""

from __future__ import annotations

import os

from . import local_fs as fs
from .base import StoreError
from .local import LocalStore


def stray_error(where: str, path: str, why: str) -> StoreError:
    return StoreError(f"{where}: refusing to adopt a directory that holds other files: {path!r} is {why} "
                      "(KVW-STORE-35); move it out first. Nothing was changed.")


def init_store(root, *, shared: str = "private") -> dict:
    """Make ``root`` a store. A missing or empty directory is created as one; an existing
    one is adopted only when it holds nothing but kvwire objects (regular files at key paths
    that start with the container magic), their directories and this store's temporaries:
    the first stray entry is named and nothing is written. Adopting sets the modes of
    ``shared`` on every directory and object (KVW-STORE-31), then writes the marker.
    Returns {"url", "created", "adopted" (objects)}."""
    fs.check_shared(shared)
    path = os.path.realpath(fs.check_root_path(os.fspath(root)))
    where = "file://" + path
    dir_mode, file_mode = fs.SHARED[shared]
    if not os.path.isdir(path) or not os.listdir(path):
        return {"url": LocalStore(path, shared=shared).url, "created": True, "adopted": 0}
    with fs.Dirs(path) as dirs:
        found = fs.read_marker(dirs.root_fd, where)
        if found is not None:
            if found != shared:
                raise StoreError(f"{where}: already a store, created with shared={found}, not shared={shared}")
            return {"url": LocalStore(path, shared=shared, create=False).url, "created": False, "adopted": 0}
        fs.check_owner(os.fstat(dirs.root_fd), shared, where)
        objects = []  # (directory key prefix, name): proven first, changed only when all are kvwire's
        for rel, dfd, dnames, files in fs.walk(dirs.root_fd):
            for name in files:
                got = fs.probe_object(dfd, name)
                if fs.TEMP_RE.fullmatch(name) and got is not None:
                    continue
                if fs.key_of(rel, name) is None:
                    raise stray_error(where, os.path.join(path, rel, name), "not at a kvwire key path")
                if got is None or not got[1]:
                    raise stray_error(where, os.path.join(path, rel, name), "not a regular file" if got is None
                                      else "not a kvwire object (it does not start with the container magic)")
                objects.append((rel, name))
            stray = set(os.listdir(dfd)) - set(files) - set(dnames)
            if stray:
                raise stray_error(where, os.path.join(path, rel, min(stray)), "not at a kvwire key path")
        me = os.geteuid()
        for rel, dfd, _, files in fs.walk(dirs.root_fd):  # another member's files keep their modes
            if os.fstat(dfd).st_uid == me:
                os.fchmod(dfd, dir_mode)
            for name in files:
                if fs.key_of(rel, name) is not None:
                    fd = os.open(name, fs.PROBE_FLAGS, dir_fd=dfd)
                    try:
                        if os.fstat(fd).st_uid == me:
                            os.fchmod(fd, file_mode)
                    finally:
                        os.close(fd)
        fs.write_marker(dirs.root_fd, shared, where)
    return {"url": LocalStore(path, shared=shared, create=False).url, "created": False, "adopted": len(objects)}


__all__ = ["init_store"]
