"""The file store owns only its objects and is private by default (spec/store.md section 3,
KVW-STORE-28..35; once, a ``kvwire store gc`` pointed through a ``..`` URL at ``/etc``
emptied it, a symlinked directory inside a store led puts, gets and deletes outside it,
and stores were world-readable in a world-writable ``/tmp``).

Every test works inside directories it made under ``tmp_path`` and checks that the files
it put *outside* the store survive byte for byte. The suite runs as root in CI, so "owned
by another user" is a real ``os.chown`` of a directory the test created."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
from test_store import FP, make_cache

from kvwire.format.container import MAGIC
from kvwire.store import KVStore, LocalStore, StoreError, open_store
from kvwire.tools.cli import main

KEY_DIR = "kvw1/" + "ab" * 16 + "/bf16/tp0of1/l0-2/lossless/c4"
OTHER_UID = 54321


def obj(n: int = 100, fill: bytes = b"k") -> bytes:
    """Bytes that start with the container magic: a kvwire object for KVW-STORE-34."""
    return MAGIC + fill * (n - len(MAGIC))


def key(i: int) -> str:
    return f"{KEY_DIR}/{i:064x}"


def run(capsys, *args):
    status = main(["store", *map(str, args)])
    out = capsys.readouterr()
    return status, out.out, out.err


def snapshot(root) -> dict:
    """path -> (bytes or link target, mode) of everything under ``root``."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            body = os.readlink(p) if stat.S_ISLNK(st.st_mode) else open(p, "rb").read() if stat.S_ISREG(st.st_mode) else None
            out[os.path.relpath(p, root)] = (body, stat.S_IMODE(st.st_mode))
    return out


@pytest.fixture
def outside(tmp_path):
    """A directory outside every store, holding what a symlink would lead to: kvwire objects
    at key-like names (so only the no-follow rule protects them) and a plain file."""
    d = tmp_path / "outside"
    (d / "sub").mkdir(parents=True)
    for i in range(3):
        (d / f"{i:064x}").write_bytes(obj(64))
        (d / "sub" / f"{i:064x}").write_bytes(obj(64))
    (d / "passwd").write_bytes(b"root:x:0:0\n")
    for p in d.rglob("*"):
        os.utime(p, (1, 1))  # oldest of all: the first an eviction would pick, the first gc would age out
    return d


# -- KVW-STORE-28: the marker ----------------------------------------------------------------

def test_store28_a_new_store_gets_the_marker(tmp_path):
    """KVW-STORE-28: creating a store (a missing directory, or an empty one) writes the marker."""
    s = LocalStore(tmp_path / "new" / "store")
    assert (tmp_path / "new" / "store" / ".kvwire-store").read_text() == "kvwire store\nkeys: kvw1\nshared: private\n"
    (tmp_path / "empty").mkdir()
    LocalStore(tmp_path / "empty")
    assert (tmp_path / "empty" / ".kvwire-store").is_file()
    assert s.list() == [] and s.put(key(1), obj()) and s.list() == [key(1)]  # the marker is no object


def test_store28_a_directory_with_files_and_no_marker_is_refused(tmp_path):
    """KVW-STORE-28: an existing non-empty directory without the marker is refused for
    writing and reading alike, with the way to adopt it; nothing is written there."""
    d = tmp_path / "data"
    d.mkdir()
    (d / "notes.txt").write_bytes(b"mine")
    before = snapshot(d)
    for make in (lambda: LocalStore(d), lambda: open_store(f"file://{d}"), lambda: LocalStore(d, create=False)):
        with pytest.raises(StoreError, match=r"not a kvwire store.*kvwire store init --url file://"):
            make()
    assert snapshot(d) == before
    (d / ".kvwire-store").write_bytes(b"something else\n")  # a marker kvwire did not write
    with pytest.raises(StoreError, match="not a kvwire store marker"):
        LocalStore(d)
    good = tmp_path / "good"
    LocalStore(good)
    for make in (lambda m: os.mkdir(m), lambda m: os.mkfifo(m), lambda m: os.symlink(good / ".kvwire-store", m)):
        e = tmp_path / f"e{len(os.listdir(tmp_path))}"
        e.mkdir()
        (e / "x").write_bytes(b"x")
        make(e / ".kvwire-store")  # a marker that is not a regular file is no marker
        with pytest.raises(StoreError):
            LocalStore(e)


def test_store28_reading_commands_never_create_a_store(tmp_path, capsys):
    """KVW-STORE-28: ls, stats, inspect and gc never create a directory or a marker."""
    missing, empty = tmp_path / "missing", tmp_path / "empty"
    empty.mkdir()
    for d in (missing, empty):
        with pytest.raises(StoreError, match="never creates one"):
            LocalStore(d, create=False)
        for cmd in (["ls"], ["stats"], ["inspect", key(1)], ["gc"]):
            status, _, err = run(capsys, *cmd, "--url", f"file://{d}")
            assert status == 2 and "never creates one" in err, (cmd, err)
    assert not missing.exists() and os.listdir(empty) == []


def test_store28_deleting_refuses_a_directory_without_the_marker(tmp_path):
    """KVW-STORE-28: delete, eviction and gc look for the marker right before they delete."""
    s = LocalStore(tmp_path / "s", max_bytes=10_000)
    s.put(key(1), obj())
    (tmp_path / "s" / KEY_DIR / ".tmp-1-abc").write_bytes(b"half")
    os.utime(tmp_path / "s" / KEY_DIR / ".tmp-1-abc", (1, 1))
    os.unlink(tmp_path / "s" / ".kvwire-store")  # no longer a store
    before = snapshot(tmp_path / "s")
    for op in (lambda: s.delete(key(1)), lambda: s.evict(0), s.gc):
        with pytest.raises(StoreError, match="no .kvwire-store marker"):
            op()
    assert snapshot(tmp_path / "s") == before


# -- KVW-STORE-34: only kvwire objects ---------------------------------------------------------

def test_store34_gc_of_a_directory_of_other_files_deletes_nothing(tmp_path, capsys):
    """KVW-STORE-28, 29, 34: the /etc case: every gc mode, pointed at a directory that holds
    other files (directly or through '..'), deletes nothing."""
    etc = tmp_path / "etc"
    (etc / "ssl").mkdir(parents=True)
    (etc / "passwd").write_bytes(b"root:x:0:0\n")
    (etc / "ssl" / "cert.pem").write_bytes(b"-----BEGIN")
    (etc / ".tmp-1-abc").write_bytes(b"an old dot file")
    for p in etc.rglob("*"):
        os.utime(p, (1, 1))
    before = snapshot(etc)
    (tmp_path / "x").mkdir()
    for url in (f"file://{etc}", f"file://{tmp_path}/x/../etc"):
        for opts in (["--all"], ["--max-bytes", "0", "--all"], ["--max-bytes", "1"], ["--verify"],
                     ["--fingerprint", "ab" * 32], []):
            status, _, err = run(capsys, "gc", "--url", url, *opts)
            assert status == 2 and ("not a kvwire store" in err or "'..'" in err), (url, opts, err)
    assert snapshot(etc) == before


def test_store34_eviction_and_gc_remove_only_kvwire_objects(tmp_path, outside, capsys):
    """KVW-STORE-34: files that are not kvwire objects (no magic, a link, a FIFO) neither
    count toward the cap nor are removed; `gc --all` empties the kvwire objects only."""
    s = LocalStore(tmp_path / "s")
    root = tmp_path / "s"
    for i in range(4):
        assert s.put(key(i), obj(1000))
    assert s.put("app/blob", b"x" * 50_000)  # a foreign file at a valid key path, the biggest
    os.symlink(outside / "passwd", root / KEY_DIR / f"{9:064x}")  # a link at a key path
    os.mkfifo(root / KEY_DIR / f"{8:064x}")  # would block a careless magic check
    assert s.total_bytes == 4000 and s.info()["kvwire_bytes"] == 4000 and s.info()["bytes"] == 54_000
    assert s.evict(2500) == 2 and s.total_bytes == 2000  # not 50,000 over: the blob does not count
    status, out, err = run(capsys, "gc", "--url", s.url, "--max-bytes", "0")
    assert status == 2 and "--all" in err
    status, out, _ = run(capsys, "gc", "--url", s.url, "--all")
    assert status == 0 and "removed 2 objects" in out
    assert s.list() == ["app/blob"] and os.path.islink(root / KEY_DIR / f"{9:064x}")
    assert stat.S_ISFIFO(os.lstat(root / KEY_DIR / f"{8:064x}").st_mode)
    assert (outside / "passwd").read_bytes() == b"root:x:0:0\n"
    status, _, err = run(capsys, "gc", "--url", s.url, "--all", "--max-bytes", "10")
    assert status == 2 and "contradicts" in err


def test_store34_eviction_checks_the_magic_right_before_unlinking(tmp_path):
    """KVW-STORE-34: a kvwire object rewritten in place into another file of the same size
    and times (so nothing but its bytes tells) is left alone by eviction."""
    s = LocalStore(tmp_path / "s")
    for i in range(3):
        s.put(key(i), obj(100))
    assert s.total_bytes == 3 * len(obj(100))  # scanned once: the store knows them as objects
    p = tmp_path / "s" / KEY_DIR / f"{0:064x}"
    st = os.stat(p)
    with open(p, "r+b") as f:
        f.write(b"N" * st.st_size)  # same inode, same size: no longer a kvwire object
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    s.evict(0)
    assert p.read_bytes() == b"N" * st.st_size
    assert not (tmp_path / "s" / KEY_DIR / f"{1:064x}").exists()


def test_store34_evicting_an_object_removes_its_tag(tmp_path):
    """KVW-STORE-34: evicting object K removes its tag K.tag (an authenticated object's,
    KVW-AUTH-3) with it; the tags count toward the total."""
    from kvwire.store import auth

    s = LocalStore(tmp_path / "s")
    s.put(key(1), obj(100))
    s.put(key(1) + auth.TAG_SUFFIX, auth.TAG_MAGIC + b"\0" * 40)
    assert s.total_bytes == len(obj(100)) + len(auth.TAG_MAGIC) + 40
    s.evict(0)
    assert s.list() == [] and s.total_bytes == 0


def test_store34_gc_removes_only_its_own_old_temporaries(tmp_path, outside):
    """KVW-STORE-7, 34: gc removes regular files named .tmp-<pid>-<hex> older than an hour,
    nothing else."""
    s = LocalStore(tmp_path / "s")
    s.put(key(1), obj())
    d = tmp_path / "s" / KEY_DIR
    names = {".tmp-12-abc": True, ".tmp-probe-3-0f": True, ".tmp-12-xyz": False, ".tmpfile": False,
             ".tmp-12-abc.bak": False, "tmp-1-abc": False, ".tmp-1-fresh0": False}
    for n in names:
        (d / n).write_bytes(b"half")
        os.utime(d / n, (1, 1) if n != ".tmp-1-fresh0" else None)
    os.symlink(outside / "passwd", d / ".tmp-7-ab")  # a link with a temporary's name
    os.utime(d / ".tmp-7-ab", (1, 1), follow_symlinks=False)
    assert s.gc() == 2
    assert {n for n in names if (d / n).exists()} == {n for n, gone in names.items() if not gone}
    assert os.path.islink(d / ".tmp-7-ab") and (outside / "passwd").exists()


def test_store34_cli_gc_touches_only_keys_that_parse(tmp_path, capsys):
    """KVW-STORE-34 (every backend, here file://): --fingerprint and --verify skip kvw1/ keys
    that do not parse; nothing but kvwire keys is removed."""
    s = LocalStore(tmp_path / "s")
    kv = KVStore(s)
    kv.put_cache(make_cache(8), list(range(8)))
    odd = f"kvw1/{FP.hex()}/bf16/tp0of1/l0-2/lossless/c04/" + "00" * 32  # 'c04': no writer makes it
    s.put(odd, obj())
    status, out, _ = run(capsys, "gc", "--url", s.url, "--fingerprint", FP.hex())
    assert status == 0 and s.list() == [odd]
    status, out, _ = run(capsys, "gc", "--url", s.url, "--verify")
    assert status == 0 and s.list() == [odd] and "do not parse" in out


# -- KVW-STORE-29, 30: no escape ---------------------------------------------------------------

@pytest.mark.parametrize("url", ["file://{t}/a/../etc", "file://{t}/a/%2E%2E/etc", "file://../etc",
                                 "file://rel/../../x"])
def test_store29_dotdot_is_refused(url, tmp_path, monkeypatch):
    """KVW-STORE-29: a '..' component, percent-encoded or not, is refused (and nothing is
    created, even relative to the working directory)."""
    (tmp_path / "a" / "b").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "a" / "b")
    with pytest.raises(StoreError, match=r"'\.\.' component"):
        open_store(url.format(t=tmp_path))
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "b"]


def test_store29_a_root_replaced_by_a_link_is_not_followed(tmp_path, outside):
    """KVW-STORE-29: the root is resolved once, when the store is opened; a link put in its
    place afterwards is refused, never followed."""
    s = LocalStore(tmp_path / "s")
    s.put(key(1), obj())
    os.rename(tmp_path / "s", tmp_path / "moved")
    os.symlink(outside, tmp_path / "s")
    before = snapshot(outside)
    for op in (lambda: s.put(key(2), obj()), lambda: s.get(key(1)), lambda: s.evict(0)):
        with pytest.raises(StoreError, match="cannot open the store directory"):
            op()
    assert snapshot(outside) == before


def test_store29_a_symlinked_root_is_resolved_once(tmp_path):
    """KVW-STORE-29: a store directory reached through a link is the user's choice."""
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    s = open_store(f"file://{tmp_path}/link")
    assert s.root == str(tmp_path / "real") and s.put(key(1), obj())
    assert (tmp_path / "real" / KEY_DIR / f"{1:064x}").exists() and (tmp_path / "real" / ".kvwire-store").exists()
    with pytest.raises(StoreError, match=r"'\.\.'"):
        LocalStore(f"{tmp_path}/real/../real")


@pytest.mark.parametrize("where", ["kvw1", KEY_DIR])
def test_store30_a_planted_directory_link_is_never_followed(tmp_path, outside, where):
    """KVW-STORE-30: a symlinked directory inside the store (at the top or at a key's own
    directory) is never followed by put, get, exists, sizes, leading, delete, list, gc or
    eviction; the files it points at survive byte for byte."""
    s = LocalStore(tmp_path / "s")
    assert s.put("kvw2/keep", obj())
    link = tmp_path / "s" / where
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(outside / "sub" if where == KEY_DIR else outside, link)
    before = snapshot(outside)
    k = key(0) if where == KEY_DIR else "kvw1/" + f"{0:064x}"  # a key whose file exists through the link
    assert os.path.exists(os.path.join(s.root, k))  # the old code would have reached it
    assert s.get(k) is None and s.get_many([k]) == [None] and s.get_ranges([(k, (0, 8))]) == [None]
    assert not s.exists(k) and s.exists_many([k]) == [False] and s.sizes([k]) == [None] and s.leading([k]) == 0
    assert s.delete(k) is False
    with pytest.raises(StoreError, match="symbolic link"):
        s.put(k.rsplit("/", 1)[0] + "/new", obj())
    assert s.list() == ["kvw2/keep"] and s.total_bytes == 100
    s.gc()
    s.evict(0)
    assert s.list() == [] and snapshot(outside) == before and os.path.islink(link)


def test_store30_a_planted_file_link_is_never_followed(tmp_path, outside):
    """KVW-STORE-30: a link at an object's own name is a miss, is not deleted through, and
    a put under that key is a StoreError that writes nothing through it."""
    s = LocalStore(tmp_path / "s")
    s.put(key(1), obj())
    target = outside / f"{0:064x}"
    os.symlink(target, tmp_path / "s" / KEY_DIR / f"{0:064x}")
    before = snapshot(outside)
    assert s.get(key(0)) is None and not s.exists(key(0)) and s.delete(key(0)) is False
    with pytest.raises(StoreError, match="not a regular file"):
        s.put(key(0), obj(50, b"n"))
    s.evict(0)
    assert snapshot(outside) == before and os.path.islink(tmp_path / "s" / KEY_DIR / f"{0:064x}")


# -- KVW-STORE-31..33: private by default ------------------------------------------------------

@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
@pytest.mark.parametrize("shared", ["private", "group"])
def test_store31_modes_whatever_the_umask(tmp_path, umask, shared):
    """KVW-STORE-31: directories 0700 / objects 0600 (group: 2770 / 0640), whatever the
    umask, for both publish paths."""
    old = os.umask(umask)
    try:
        s = open_store(f"file://{tmp_path}/s?shared={shared}")
        s.put(key(1), obj())
        s.use_tmpfile = False
        s.put("named/" + f"{2:064x}", obj())
    finally:
        os.umask(old)
    dmode, fmode = (0o700, 0o600) if shared == "private" else (0o2770, 0o640)
    root = tmp_path / "s"
    for dirpath, _dirs, files in os.walk(root):
        assert stat.S_IMODE(os.stat(dirpath).st_mode) == dmode, dirpath
        for f in files:
            assert stat.S_IMODE(os.stat(os.path.join(dirpath, f)).st_mode) == fmode, f


def test_store31_default_store_is_per_user(monkeypatch, tmp_path):
    """KVW-STORE-31: the default store lives in the user's cache directory, created private."""
    from kvwire.store import default_store_url
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    s = open_store(default_store_url())
    assert s.root == str(tmp_path / "cache" / "kvwire" / "store")
    assert stat.S_IMODE(os.stat(s.root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "cache").st_mode) == 0o700  # parents it made too


def test_store32_another_users_or_writable_store_is_refused(tmp_path):
    """KVW-STORE-32: a private store owned by another user, or group/other-writable, is
    refused; shared=group accepts another owner but never a world-writable root."""
    a = tmp_path / "a"
    LocalStore(a)
    os.chown(a, OTHER_UID, -1)
    with pytest.raises(StoreError, match=f"owned by uid {OTHER_UID}, not by you"):
        LocalStore(a)
    (tmp_path / "fresh").mkdir()
    os.chown(tmp_path / "fresh", OTHER_UID, -1)  # an empty directory someone else made first (the /tmp attack)
    with pytest.raises(StoreError, match="owned by uid"):
        LocalStore(tmp_path / "fresh")
    assert os.listdir(tmp_path / "fresh") == []
    b = tmp_path / "b"
    LocalStore(b)
    for mode, words in ((0o720, "writable by group"), (0o702, "writable by others")):
        os.chmod(b, mode)
        with pytest.raises(StoreError, match=words):
            LocalStore(b)
    g = open_store(f"file://{tmp_path}/g?shared=group")
    os.chown(g.root, OTHER_UID, -1)
    open_store(f"file://{tmp_path}/g?shared=group").put(key(1), obj())  # another member's store: fine
    os.chmod(g.root, 0o2777)
    with pytest.raises(StoreError, match="writable by others"):
        open_store(f"file://{tmp_path}/g?shared=group")


@pytest.mark.parametrize("query, words", [("shared=world", "one of: private, group"),
                                          ("mode=0700", r"unknown parameter .mode.*shared=private\|group"),
                                          ("shared=group&shared=private", "given 2 times"),
                                          ("shared", "malformed query; the only parameter is shared=private"),
                                          ("token=s3cr3t", "unknown parameter .token.")])
def test_store33_url_parameters(tmp_path, query, words):
    """KVW-STORE-33: only shared=private|group; anything else names the valid choices."""
    with pytest.raises(StoreError, match=words) as info:
        open_store(f"file://{tmp_path}/s?{query}")
    assert not (tmp_path / "s").exists()
    assert "s3cr3t" not in str(info.value)  # KVW-STORE-39: a query's values are never repeated


def test_store33_the_marker_keeps_the_sharing_mode(tmp_path):
    """KVW-STORE-33: a store is opened with the mode it was created with, or refused."""
    open_store(f"file://{tmp_path}/g?shared=group")
    assert (tmp_path / "g" / ".kvwire-store").read_text().endswith("shared: group\n")
    with pytest.raises(StoreError, match=r"created with shared=group.*\?shared=group"):
        open_store(f"file://{tmp_path}/g")
    open_store(f"file://{tmp_path}/p")
    with pytest.raises(StoreError, match="created with shared=private"):
        open_store(f"file://{tmp_path}/p?shared=group")
    with pytest.raises(StoreError, match="fragment"):
        open_store(f"file://{tmp_path}/p#x")


# -- KVW-STORE-35: adopting -------------------------------------------------------------------

def test_store35_init_adopts_only_a_directory_of_kvwire_objects(tmp_path, capsys):
    """KVW-STORE-35: init adopts a directory of kvwire objects and temporaries (setting the
    private modes), and refuses one with any other entry, naming it and changing nothing."""
    d = tmp_path / "old"
    (d / KEY_DIR).mkdir(parents=True, mode=0o755)
    for i in range(3):
        (d / KEY_DIR / f"{i:064x}").write_bytes(obj())
        os.chmod(d / KEY_DIR / f"{i:064x}", 0o644)
    (d / KEY_DIR / ".tmp-4-abc").write_bytes(b"half")
    for stray, make in ((d / "README", lambda p: p.write_bytes(b"hi")),
                        (d / KEY_DIR / f"{7:064x}", lambda p: p.write_bytes(b"no magic")),
                        (d / "kvw1" / "link", lambda p: os.symlink(tmp_path, p)),
                        (d / ".hidden", lambda p: p.mkdir())):
        make(stray)
        before = snapshot(d)
        status, out, err = run(capsys, "init", "--url", f"file://{d}")
        assert status == 2 and repr(str(stray)) in err and "Nothing was changed" in err, (stray, status, out, err)
        assert snapshot(d) == before
        os.rmdir(stray) if stray.is_dir() and not stray.is_symlink() else os.unlink(stray)
    status, out, _ = run(capsys, "init", "--url", f"file://{d}")
    assert status == 0 and "adopted as a store (3 kvwire objects)" in out
    assert (d / ".kvwire-store").is_file() and LocalStore(d).list() == [key(i) for i in range(3)]
    assert stat.S_IMODE(os.stat(d / KEY_DIR).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(d / KEY_DIR / f"{0:064x}").st_mode) == 0o600
    status, out, _ = run(capsys, "init", "--url", f"file://{d}")
    assert status == 0 and "already a store" in out
    status, out, _ = run(capsys, "init", "--url", f"file://{tmp_path}/brand/new")
    assert status == 0 and "created a store" in out and (tmp_path / "brand" / "new" / ".kvwire-store").exists()
    from kvwire.store.local_admin import init_store
    with pytest.raises(StoreError, match="created with shared=private"):
        init_store(d, shared="group")


@pytest.mark.slow
def test_store_cli_init_and_gc_all_in_help():
    """The CLI documents init and --all."""
    out = subprocess.run([sys.executable, "-m", "kvwire", "store", "gc", "--help"], capture_output=True, text=True)
    assert "--all" in out.stdout
    out = subprocess.run([sys.executable, "-m", "kvwire", "store", "init", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--url" in out.stdout


def test_store34_redis_gc_touches_only_keys_that_parse(tmp_path, capsys):
    """KVW-STORE-34 on Redis (a real redis-server): gc --fingerprint / --verify / plain gc
    remove only keys that parse as kvwire keys; the server's other keys, and kvw1/ keys no
    writer makes, survive."""
    from redisfix import RedisServer
    with RedisServer(tmp_path / "r") as server:
        s = open_store(server.url)
        kv = KVStore(s)
        good = kv.put_cache(make_cache(8), list(range(8))).keys
        odd = f"kvw1/{FP.hex()}/bf16/tp0of1/l0-2/lossless/c04/" + "00" * 32
        others = {odd: obj(), "app/session-42": b"user data", f"kvw1/{FP.hex()}/x": b"junk", "kvw1": b"?"}
        for k, v in others.items():
            s.put(k, v)
        status, out, _ = run(capsys, "gc", "--url", server.url, "--fingerprint", FP.hex())
        assert status == 0 and f"removed {len(good)} objects" in out
        status, out, _ = run(capsys, "gc", "--url", server.url, "--verify")
        assert status == 0 and "removed 0 objects" in out
        status, _, err = run(capsys, "gc", "--url", server.url, "--all")
        assert status == 2 and "not supported" in err
        assert sorted(s.list()) == sorted(others) and [bytes(s.get(k)) for k in sorted(others)] == [
            others[k] for k in sorted(others)]
        s.close()
