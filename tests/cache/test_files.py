"""Files: reading modes (``mmap=``), non-regular files, and the safe ``save``.

``open``/``load`` read a file into memory or map it; ``mmap=None`` maps only files no
other user can write, and the mapping's hazards (SIGBUS after truncation) are shown in a
subprocess so the test process survives. ``save`` keeps the replaced file's mode, follows
symbolic links, and leaves no temporary file behind even when killed at random moments
(KVW-WRITE-3 to KVW-WRITE-5).
"""

import hashlib
import mmap
import os
import random
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import forge
import kvwire
from kvwire.cache import files

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "python"), os.path.join(ROOT, "tests")]))
posix = pytest.mark.skipif(os.name != "posix", reason="POSIX file semantics (FIFOs, modes, SIGBUS)")


def _saved(tmp_path, name="c.kvw", **kw):
    cache = forge.small_cache(compressible=False, **kw)
    path = tmp_path / name
    kvwire.save(path, cache)
    return path, cache


def _run(code: str, timeout=60):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=ENV, cwd=ROOT)


# -- reading modes ------------------------------------------------------------------------


def test_mmap_false_reads_into_memory_and_survives_truncation(tmp_path):
    """A reader with mmap=False owns its bytes: truncating the file under it (and under
    its views) changes nothing, in this very process."""
    path, cache = _saved(tmp_path)
    with kvwire.open(path, mmap=False) as r:
        assert not isinstance(r.buffer, mmap.mmap)
        before = r.chunk(1, "v", 2).copy()
        view = r.chunk(1, "v", 2)
        os.truncate(path, 0)
        assert np.array_equal(view.view(np.uint8), before.view(np.uint8))
        assert forge.cache_bytes_equal(r.load(), cache)
        r.validate()


def test_mmap_true_maps_and_refuses_chunk_access_after_truncation(tmp_path):
    path, _ = _saved(tmp_path)
    with kvwire.open(path, mmap=True) as r:
        assert isinstance(r.buffer, mmap.mmap)
        r.chunk(0, "k", 0)
        os.truncate(path, 100)
        with pytest.raises(kvwire.TruncatedError, match="shrank"):
            r.chunk(0, "k", 1)
        with pytest.raises(kvwire.TruncatedError):
            r.load()


@posix
def test_default_maps_private_files_and_copies_files_others_can_write(tmp_path):
    """mmap=None: a file only this user can write is mapped; a group- or world-writable one
    (a shared store) is read into memory."""
    path, cache = _saved(tmp_path)
    os.chmod(path, 0o600)
    with kvwire.open(path) as r:
        assert isinstance(r.buffer, mmap.mmap)
    for mode in (0o660, 0o606):
        os.chmod(path, mode)
        with kvwire.open(path) as r:
            assert not isinstance(r.buffer, mmap.mmap)
            os.truncate(path, 0)
            assert forge.cache_bytes_equal(r.load(), cache)
        kvwire.save(path, cache)
    if os.geteuid() == 0:  # a file of another user is never mapped by default
        os.chmod(path, 0o644)
        os.chown(path, 65534, 65534)
        with kvwire.open(path) as r:
            assert not isinstance(r.buffer, mmap.mmap)


@pytest.mark.slow
@posix
def test_truncation_under_a_mapped_view_is_sigbus_as_documented(tmp_path):
    """The documented hazard of mmap=True (and of the default for private files): the guard
    turns a chunk access after truncation into TruncatedError, but touching a view already
    handed out kills the process with SIGBUS. mmap=False in the same script survives."""
    path, _ = _saved(tmp_path, tokens=4000)
    script = f"""
        import os, kvwire, shutil
        src = {str(path)!r}
        for mode in (False, None):
            p = src + str(mode)
            shutil.copyfile(src, p)
            os.chmod(p, 0o600)
            r = kvwire.open(p, mmap=mode)
            x = r.chunk(0, "k", 0)
            os.truncate(p, 0)
            try:
                r.chunk(0, "k", 1)
                print(mode, "chunk ok", flush=True)
            except kvwire.TruncatedError:
                print(mode, "TRUNCATED", flush=True)
            print(mode, "view", float(x.astype("float32").sum()), flush=True)
    """
    out = _run(script)
    lines = out.stdout.splitlines()
    assert lines[0] == "False chunk ok" and lines[1].startswith("False view"), out
    assert lines[2] == "None TRUNCATED", out
    assert len(lines) == 3 and out.returncode == -signal.SIGBUS, out


def test_mmap_argument_is_checked():
    data = kvwire.encode(forge.small_cache())
    with pytest.raises(ValueError, match="None, True, False"):
        kvwire.open(data, mmap="yes")
    with pytest.raises(ValueError, match="pass a path"):
        kvwire.open(data, mmap=True)
    copy = bytearray(data)
    with kvwire.open(copy, mmap=False) as r:  # a buffer with mmap=False is copied first
        view = r.chunk(0, "k", 0)
        before = view.copy()
        copy[:] = bytes(len(copy))
        assert np.array_equal(view.view(np.uint8), before.view(np.uint8))


# -- non-regular files ----------------------------------------------------------------------


@posix
def test_a_fifo_is_refused_at_once(tmp_path):
    """open() on a FIFO used to block forever waiting for a writer."""
    fifo = tmp_path / "f.kvw"
    os.mkfifo(fifo)
    out = {}

    def attempt():
        try:
            kvwire.open(fifo)
        except OSError as exc:
            out["exc"] = exc

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "open() on a FIFO blocked"
    assert "FIFO" in str(out["exc"]) and "regular file" in str(out["exc"])
    with pytest.raises(OSError, match="FIFO"):
        kvwire.load(fifo)


@posix
@pytest.mark.parametrize("path, error, text", [
    ("{tmp}", IsADirectoryError, "directory"),
    ("/dev/null", OSError, "character device"),
    ("/dev/zero", OSError, "character device"),
])
def test_non_regular_files_are_refused(tmp_path, path, error, text):
    with pytest.raises(error, match=text):
        kvwire.open(path.format(tmp=tmp_path))


# -- save: mode, symlinks, temporary files (KVW-WRITE-3 to 5) --------------------------------


@posix
def test_save_keeps_the_mode_of_the_file_it_replaces(tmp_path):
    """KVW-WRITE-3: replacing a 0600 file keeps 0600 (not the old fixed 0644)."""
    path, cache = _saved(tmp_path)
    for mode in (0o600, 0o640, 0o604):
        os.chmod(path, mode)
        kvwire.save(path, cache)
        assert stat.S_IMODE(os.stat(path).st_mode) == mode


@posix
@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_a_new_file_gets_0666_under_the_umask(tmp_path, mask):
    """KVW-WRITE-3: a new file is 0666 & ~umask, like any file the user creates."""
    old = os.umask(mask)
    try:
        path, _ = _saved(tmp_path, name=f"n{mask:o}.kvw")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~mask


@posix
@pytest.mark.parametrize("tmpfile", [True, False])
def test_temporary_file_is_private_until_complete(tmp_path, monkeypatch, tmpfile):
    """KVW-WRITE-3: while the bytes are written the file is 0600, whatever its final mode."""
    monkeypatch.setattr(files, "USE_O_TMPFILE", tmpfile)
    path, cache = _saved(tmp_path)
    os.chmod(path, 0o644)
    seen = []
    real = files.write_all

    def spy(fd, buffers):
        seen.append(stat.S_IMODE(os.fstat(fd).st_mode))
        return real(fd, buffers)

    monkeypatch.setattr(files, "write_all", spy)
    kvwire.save(path, cache)
    assert seen == [0o600] and stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert os.listdir(tmp_path) == ["c.kvw"]


@posix
def test_save_through_a_symlink_writes_the_target_and_keeps_the_link(tmp_path):
    """KVW-WRITE-4: the link stays a link; its target gets the new container atomically."""
    (tmp_path / "store").mkdir()
    target, old = _saved(tmp_path / "store", name="real.kvw")
    link = tmp_path / "link.kvw"
    link.symlink_to(os.path.relpath(target, tmp_path))
    new = forge.small_cache(seed=9)
    kvwire.save(link, new)
    assert link.is_symlink() and os.readlink(link) == os.path.relpath(target, tmp_path)
    assert forge.cache_bytes_equal(kvwire.load(target), new)
    dangling = tmp_path / "dangling.kvw"
    dangling.symlink_to("store/created.kvw")
    kvwire.save(dangling, new)
    assert dangling.is_symlink() and (tmp_path / "store" / "created.kvw").is_file()
    assert sorted(os.listdir(tmp_path / "store")) == ["created.kvw", "real.kvw"]


def test_save_of_something_that_is_not_a_cache_points_to_from_tensors(tmp_path):
    with pytest.raises(TypeError, match="KVCache.from_tensors"):
        kvwire.save(tmp_path / "x.kvw", {"k": np.zeros((1, 2, 3))})
    assert os.listdir(tmp_path) == []


KILL_CHILD = """
import os, sys
import kvwire
from kvwire.cache import files
import forge
files.USE_O_TMPFILE = sys.argv[2] == "1"
caches = [forge.small_cache(compressible=False, tokens=3000, heads=8, head_dim=64, seed=s) for s in (1, 2)]
print("ready", flush=True)
i = 0
while True:
    kvwire.save(sys.argv[1], caches[i % 2])
    i += 1
"""


@pytest.mark.slow
@posix
@pytest.mark.parametrize("tmpfile", [True, False], ids=["o_tmpfile", "named-temp"])
def test_save_killed_at_random_moments_leaves_old_or_new_and_no_temp(tmp_path, tmpfile):
    """KVW-WRITE-5 (and FILE-6): a writer saving in a loop is SIGKILLed at random moments;
    the target is always one complete container, and no temporary file remains: with
    O_TMPFILE the file has a name only for the instant between linkat and the rename, so a
    kill rarely leaves one; the next save removes those of dead writers."""
    caches = [forge.small_cache(compressible=False, tokens=3000, heads=8, head_dim=64, seed=s) for s in (1, 2)]
    digests = {hashlib.sha256(kvwire.encode(c)).hexdigest() for c in caches}
    target = tmp_path / "big.kvw"
    kvwire.save(target, caches[0])
    rng, kills, deadline = random.Random(12), 0, time.monotonic() + 90
    leftovers = 0
    while kills < 20 and time.monotonic() < deadline:
        child = subprocess.Popen([sys.executable, "-c", KILL_CHILD, str(target), "1" if tmpfile else "0"],
                                 stdout=subprocess.PIPE, env=ENV, cwd=ROOT)
        assert child.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.0, 0.4))
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        child.stdout.close()
        kills += 1
        names = os.listdir(tmp_path)
        assert "big.kvw" in names
        assert hashlib.sha256(target.read_bytes()).hexdigest() in digests
        leftovers += len(names) - 1
    assert kills >= 10
    if tmpfile:  # named only between linkat and the rename: a kill must land in that instant
        assert leftovers <= kills // 5, leftovers
    files.USE_O_TMPFILE, saved = False, files.USE_O_TMPFILE
    try:
        kvwire.save(target, caches[1])  # the named-temp path removes the temporaries of dead writers
    finally:
        files.USE_O_TMPFILE = saved
    assert os.listdir(tmp_path) == ["big.kvw"]
    kvwire.open(target).validate()


@posix
def test_stale_temp_cleanup_spares_live_writers_and_other_hosts(tmp_path):
    """KVW-WRITE-5: only temporaries of this host's dead writers are removed."""
    target = str(tmp_path / "c.kvw")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    names = {
        "dead": f".c.kvw.{files._HOST}.{dead}.aaaaaaaaaaaa{files.TEMP_SUFFIX}",
        "live": f".c.kvw.{files._HOST}.{os.getppid()}.bbbbbbbbbbbb{files.TEMP_SUFFIX}",
        "other host": f".c.kvw.zzzzzz.{dead}.cccccccccccc{files.TEMP_SUFFIX}",
        "other file": f".c.kvw.x.{files._HOST}.{dead}.dddddddddddd{files.TEMP_SUFFIX}",
    }
    for n in names.values():
        (tmp_path / n).write_bytes(b"partial")
    assert files.remove_stale_temps(target) == [str(tmp_path / names["dead"])]
    assert sorted(os.listdir(tmp_path)) == sorted(v for k, v in names.items() if k != "dead")
