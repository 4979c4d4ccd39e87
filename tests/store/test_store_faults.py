"""kvwire.store under failure (spec/store.md, KVW-STORE-1/4/9/17): servers killed mid-put and
restarted, a cluster master down, corrupted and evicted objects, a full disk and a server
that never answers. Every case runs against real redis-server processes (tests/redisfix.py)
or a real file system; the store must raise StoreError within its timeout (never hang),
never publish part of an object, and never return wrong data.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import kvwire
from kvwire.format.header import ModelIdentity
from kvwire.store import KeySpace, KVStore, LocalStore, StoreError, open_store
from redisfix import RedisCluster, RedisServer, SilentServer, free_port

FP = hashlib.sha256(b"redis-fault-test-model").digest()
TIMEOUT = 2.0
MARGIN = 2.0  # scheduling slack on a loaded 2-core CI machine


def make_cache(tokens: int, *, layers: int = 2, heads: int = 2, dim: int = 8, chunk: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    ks = [rng.standard_normal((heads, tokens, dim)).astype(np.float16) for _ in range(layers)]
    vs = [rng.standard_normal((heads, tokens, dim)).astype(np.float16) for _ in range(layers)]
    return kvwire.KVCache.from_tensors(ks, vs, model=ModelIdentity(compat_fingerprint=FP), chunk_tokens=chunk)


def same_prefix(got, cache, tokens: int) -> bool:
    """Whether a loaded cache holds exactly the first ``tokens`` tokens of ``cache``."""
    return got.header.token_count == tokens and all(
        np.array_equal(got.layers[i][c], cache.layers[i][c][:, :tokens])
        for i in range(cache.header.num_layers) for c in "kv")


def objects(seed: int, sizes) -> dict:
    rng = random.Random(seed)
    return {f"keep/{seed}/{i}": rng.randbytes(n) for i, n in enumerate(sizes)}


def assert_intact(store, before: dict) -> None:
    got = store.get_many(list(before))
    bad = [k for k, v in zip(before, got) if v is None or bytes(v) != before[k]]
    assert not bad, f"objects lost or changed: {bad}"


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    return 0


class Timed(threading.Thread):
    """Runs ``fn`` in a thread; records its result or exception and when it ended."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.result, self.error, self.ended = fn, None, None, None

    def run(self):
        try:
            self.result = self.fn()
        except BaseException as exc:  # reported to the test
            self.error = exc
        self.ended = time.monotonic()


def fails_within(fn, limit: float, what: str = "") -> float:
    """Run ``fn`` in a thread and demand a StoreError within ``limit`` seconds; a call that
    hangs fails the test (it does not hang the suite). Returns the seconds it took."""
    t, start = Timed(fn), time.monotonic()
    t.start()
    t.join(limit)
    assert not t.is_alive(), f"{what}: still running after {limit:.1f} s (a hang)"
    assert isinstance(t.error, StoreError), f"{what}: expected StoreError, got {t.error!r} / {t.result!r}"
    return t.ended - start


# -- (a), (b): a server killed, mid-put and after puts, restarted with its AOF ---------------

def test_store4_kill_during_large_put_leaves_no_object(tmp_path):
    """KVW-STORE-1/4: SIGKILL while a 128 MiB put is half transferred: the put raises
    StoreError promptly; after an AOF restart the key holds nothing and every object put
    before is byte-identical. The server is throttled (SIGSTOP/SIGCONT bursts) and killed
    once its memory shows a quarter of the value received, so the kill lands mid-transfer."""
    server = RedisServer(tmp_path / "r", appendonly=True).start()
    store = open_store(server.url, timeout=TIMEOUT)
    before = objects(1, [0, 1, 1000, 70_000, 1 << 20, 5 << 20])
    assert store.put_many(before.items()) == [True] * len(before)
    big = np.random.default_rng(1).bytes(128 << 20)
    base = rss(server.proc.pid)
    server.pause()
    put = Timed(lambda: store.put("big/obj", [memoryview(big)[: 64 << 20], memoryview(big)[64 << 20:]]))
    put.start()
    deadline = time.monotonic() + 60
    while rss(server.proc.pid) - base < (32 << 20) and time.monotonic() < deadline and put.is_alive():
        server.resume()
        time.sleep(0.002)
        server.pause()
    received = rss(server.proc.pid) - base
    assert put.is_alive(), f"the put ended before the kill: {put.error or put.result}"
    assert (32 << 20) <= received < (128 << 20), f"server holds {received >> 20} MiB of the value"
    killed = time.monotonic()
    server.kill()
    put.join(TIMEOUT + MARGIN)
    assert not put.is_alive(), "the put hangs after the server was killed"
    assert isinstance(put.error, StoreError), put.error or put.result
    assert put.ended - killed < TIMEOUT + MARGIN
    server.start()  # same port, replays the AOF
    with open_store(server.url, timeout=TIMEOUT) as fresh:
        assert fresh.get("big/obj") is None and fresh.sizes(["big/obj"]) == [None]
        assert fresh.list() == sorted(before)
        assert_intact(fresh, before)
    # the old store object reconnects: its pooled connections to the dead server are dropped
    assert_intact(store, before)
    assert store.put("after/restart", b"ok") is True
    store.close()
    server.kill()


def test_store4_aof_restart_keeps_every_object(tmp_path):
    """KVW-STORE-1: with appendonly yes / appendfsync always, every object acknowledged
    before a SIGKILL is intact after the restart, raw objects and KVStore chunk caches alike."""
    server = RedisServer(tmp_path / "r", appendonly=True).start()
    store = open_store(server.url, timeout=TIMEOUT)
    before = objects(2, [0, 7, 4096, 65_536, 65_537, 300_000, 3 << 20])
    store.put_many(before.items())
    kv = KVStore(store)
    caches = [(make_cache(40, seed=s), list(range(s * 100, s * 100 + 40))) for s in range(5)]
    for cache, tokens in caches:
        assert kv.put_cache(cache, tokens).written == 10
    server.kill()
    fails_within(lambda: store.get(next(iter(before))), TIMEOUT + MARGIN, "get from a killed server")  # not a miss
    server.start()
    with open_store(server.url, timeout=TIMEOUT) as fresh:
        assert_intact(fresh, before)
        assert fresh.info()["objects"] == len(before) + 50
        kv2 = KVStore(fresh)
        for cache, tokens in caches:
            got = kv2.get_cache(tokens, KeySpace.of(cache.header))
            assert got.tokens == 40 and same_prefix(got.cache, cache, 40)
        assert kv2.stats()["checksum_failures"] == 0 and kv2.stats()["corrupt"] == 0
    store.close()
    server.kill()


def test_store4_down_server_is_an_error_within_the_timeout(tmp_path):
    """KVW-STORE-4: a server that is gone (connection refused) fails every call fast."""
    server = RedisServer(tmp_path / "r").start()
    store = open_store(server.url, timeout=TIMEOUT)
    store.put("a", b"1")
    server.kill()
    for name, call in CALLS.items():
        fails_within(lambda call=call: call(store), TIMEOUT + MARGIN, name)
    store.close()


# -- (c): a cluster with one master down ------------------------------------------------------

@pytest.mark.slow
def test_store4_cluster_master_down(tmp_path):
    """A killed master costs its own keys only: reads of its keys are misses (counted in
    stats.unavailable), get_cache serves the chunks before the first of them and leading_hits
    stops there, the other masters keep serving and taking puts, a put of a key on the dead
    master raises StoreError quickly. Restarted, the master serves again."""
    cluster = RedisCluster(tmp_path / "c").start()
    try:
        store = open_store(cluster.url, timeout=TIMEOUT)
        kv = KVStore(store)
        cache, tokens = make_cache(96, seed=7), list(range(96))
        keys = kv.put_cache(cache, tokens).keys
        owners = [cluster.node_for_key(k) for k in keys]
        victim = next(o for o in owners if o != owners[0])
        first_miss = owners.index(victim)
        saved = {k: bytes(v) for k, v in zip(keys, store.get_many(keys))}
        space = KeySpace.of(cache.header)
        cluster.kill(victim)

        load = Timed(lambda: kv.get_cache(tokens, space))
        load.start()
        load.join(TIMEOUT + MARGIN)
        assert not load.is_alive() and load.error is None, load.error
        got = load.result
        assert got.tokens == first_miss * 4 and same_prefix(got.cache, cache, got.tokens)
        assert store.stats.unavailable > 0
        assert kv.leading_hits(keys) == first_miss
        live = [k for k, o in zip(keys, owners) if o != victim]
        dead = [k for k, o in zip(keys, owners) if o == victim]
        assert store.exists_many(dead) == [False] * len(dead)
        new_live = next(f"new/{i}" for i in range(1000) if cluster.node_for_key(f"new/{i}") != victim)
        new_dead = next(f"new/{i}" for i in range(1000) if cluster.node_for_key(f"new/{i}") == victim)
        assert store.put(new_live, b"live") is True and bytes(store.get(new_live)) == b"live"
        fails_within(lambda: store.put(new_dead, b"dead"), TIMEOUT + MARGIN, "put to the dead master")
        time.sleep(2.5)  # past cluster-node-timeout: the live masters have marked the victim failed
        for _ in range(3):
            got_live = store.get_many(live)
            assert [bytes(v) for v in got_live] == [saved[k] for k in live]
        with open_store(cluster.url, timeout=TIMEOUT) as fresh:  # a new client finds the degraded cluster
            assert [bytes(v) for v in fresh.get_many(live)] == [saved[k] for k in live]
            assert fresh.get_many(dead) == [None] * len(dead)

        cluster.nodes[victim].start()  # back, empty (no AOF): its chunks are plain misses now
        cluster.wait_ok()
        time.sleep(1.2)  # the store retries a down node after retry_after (1 s)
        assert store.put(new_dead, b"dead") is True and bytes(store.get(new_dead)) == b"dead"
        before = store.stats.unavailable
        assert kv.get_cache(tokens, space).tokens == first_miss * 4
        assert store.stats.unavailable == before
        assert kv.put_cache(cache, tokens).written == len(dead)  # the lost chunks are written again
        assert kv.get_cache(tokens, space).tokens == 96
        store.close()
    finally:
        cluster.stop()


# -- (d): corruption in the server -------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("backend", ["server", "cluster"])
def test_store17_corrupted_redis_object_is_a_miss_and_deleted(request, backend):
    """KVW-STORE-17: one byte of a chunk's tensor bytes flipped in Redis (SETRANGE): get_cache
    counts a checksum failure, serves only the chunks before it, deletes the object."""
    url = request.getfixturevalue("redis_url" if backend == "server" else "redis_cluster_url")
    if backend == "server":
        raw_for = lambda key: request.getfixturevalue("redis_server").client()
    else:
        cluster = request.getfixturevalue("redis_cluster")
        raw_for = lambda key: cluster.nodes[cluster.node_for_key(key)].client()
    store = open_store(url, timeout=TIMEOUT)
    kv = KVStore(store)
    cache, tokens = make_cache(12), list(range(12))
    keys = kv.put_cache(cache, tokens).keys
    space = KeySpace.of(cache.header)
    raw = raw_for(keys[1])
    obj = raw.get(keys[1])
    off = kvwire.open(obj).info(1).offset  # inside chunk 1's tensor bytes
    raw.setrange(keys[1], off, bytes([obj[off] ^ 0xFF]))
    assert raw.get(keys[1]) != obj and len(raw.get(keys[1])) == len(obj)
    got = kv.get_cache(tokens, space)
    assert got.tokens == 4 and got.chunks == 1 and same_prefix(got.cache, cache, 4)
    assert kv.stats()["checksum_failures"] == 1
    assert raw.exists(keys[1]) == 0 and store.exists_many(keys) == [True, False, True]
    assert kv.leading_hits(keys) == 1
    # a corrupted header is refused as well, never decoded into wrong tensors
    raw0 = raw_for(keys[0])
    raw0.setrange(keys[0], 8, b"\xff\xff\xff\xff")
    assert kv.get_cache(tokens, space).cache is None and raw0.exists(keys[0]) == 0
    assert kv.stats()["checksum_failures"] + kv.stats()["corrupt"] == 2
    raw.close()
    raw0.close()
    store.close()


# -- (e): eviction under maxmemory ---------------------------------------------------------------

@pytest.mark.slow
def test_store9_eviction_under_maxmemory_is_a_miss_never_a_wrong_object(tmp_path):
    """allkeys-lru with 20 MB: 200 caches of 4 chunks (about 53 MB) do not fit; every cache
    that comes back is bit for bit the original for the tokens it covers, the rest are misses,
    and info() reports the evictions."""
    server = RedisServer(tmp_path / "r", maxmemory="20mb", policy="allkeys-lru").start()
    store = open_store(server.url, timeout=TIMEOUT)
    kv = KVStore(store)
    caches = []
    for s in range(200):
        cache, tokens = make_cache(64, layers=4, heads=4, dim=64, chunk=16, seed=s), list(range(s * 1000, s * 1000 + 64))
        assert kv.put_cache(cache, tokens).written == 4
        caches.append((cache, tokens))
    served = []
    for cache, tokens in caches:
        got = kv.get_cache(tokens, KeySpace.of(cache.header))
        assert got.tokens % 16 == 0
        if got.tokens:
            assert same_prefix(got.cache, cache, got.tokens)
        served.append(got.tokens)
    info = store.info()
    assert info["evicted_keys"] > 0 and info["maxmemory_policy"] == "allkeys-lru"
    assert 0 < info["objects"] < 800 and info["used_memory"] <= 22 * 10**6
    assert any(served) and served.count(64) < 200  # some chunks were served, some evicted
    assert kv.stats()["checksum_failures"] == 0 and kv.stats()["corrupt"] == 0
    store.close()
    server.kill()


# -- (f): the file store on a full disk -----------------------------------------------------------

FULL_DISK_CHILD = textwrap.dedent("""
    import json, os, random, resource, signal, sys
    from kvwire.store import LocalStore, StoreError
    root, mode, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit is EFBIG, not a killed process
    s = LocalStore(root)
    if mode.endswith("named"):
        s.use_tmpfile = False  # the dot-named temporary file path of KVW-STORE-7
    rng = random.Random(5)
    before = {f"keep/{i}": rng.randbytes(n) for i, n in enumerate([1, 1000, 100_000, 200_000])}
    for k, v in before.items():
        assert s.put(k, v)
    if mode.startswith("fsize"):
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    free = os.statvfs(root).f_bfree
    out = {}
    try:
        s.put("big/obj", [bytes(limit // 2 + 1), rng.randbytes(limit)])
        out["big"] = "written"
    except StoreError as exc:
        out["big"] = "StoreError: " + str(exc)
    except BaseException as exc:
        out["big"] = "other: " + repr(exc)
    out["free_blocks_kept"] = os.statvfs(root).f_bfree == free  # no leaked temporary blocks
    out["intact"] = all(bytes(s.get(k)) == v for k, v in before.items())
    out["listed"] = s.list()
    out["files"] = sorted(os.path.relpath(os.path.join(d, n), root) for d, _, ns in os.walk(root) for n in ns)
    out["small_after"] = s.put("small/after", b"x" * 100)
    print(json.dumps(out))
""")


def check_full_disk(out: dict, what: str) -> None:
    assert out["big"].startswith("StoreError"), (what, out["big"])
    assert "no partial object" in out["big"]
    assert out["listed"] == ["keep/0", "keep/1", "keep/2", "keep/3"], out["listed"]
    assert "big/obj" not in out["files"]  # and no temporary: the one dot file is the store marker (KVW-STORE-28)
    assert [f for f in out["files"] if os.path.basename(f).startswith(".")] == [".kvwire-store"]
    assert out["intact"] and out["small_after"] is True
    if what.startswith("enospc"):  # a private file system: its free blocks are ours alone to count
        assert out["free_blocks_kept"], "the failed put leaked a temporary file's blocks"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fsize", "fsize-named"])
def test_store4_local_store_full_disk_rlimit(tmp_path, mode):
    """KVW-STORE-4/7: a write that fails for lack of room (RLIMIT_FSIZE: EFBIG, on any
    machine) raises StoreError, publishes nothing (O_TMPFILE and named temporaries alike), and
    the objects stored before stay intact and readable."""
    root = tmp_path / "store"
    proc = subprocess.run([sys.executable, "-c", FULL_DISK_CHILD, str(root), mode, str(1 << 20)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    check_full_disk(json.loads(proc.stdout), mode)
    s = LocalStore(root)  # and from another process's view
    assert s.list() == ["keep/0", "keep/1", "keep/2", "keep/3", "small/after"]
    assert len(bytes(s.get("keep/3"))) == 200_000


def tmpfs_prefix() -> list | None:
    """A command prefix that runs its command with a private tmpfs mount allowed, or None."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    for prefix in ([unshare, "--mount"], [unshare, "--user", "--map-root-user", "--mount"]):
        probe = "mount -t tmpfs -o size=1m none /mnt 2>/dev/null || mount -t tmpfs -o size=1m none /tmp"
        if subprocess.run([*prefix, "sh", "-c", probe], capture_output=True, check=False).returncode == 0:
            return prefix
    return None


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["enospc", "enospc-named"])
def test_store4_local_store_full_tmpfs(tmp_path, mode):
    """KVW-STORE-4: the same on a real full file system (a 2 MiB tmpfs, ENOSPC), where this
    machine lets a private mount namespace mount one; the RLIMIT test above covers the rest."""
    prefix = tmpfs_prefix()
    if prefix is None:
        pytest.skip("no private tmpfs mount here (unshare/mount refused); RLIMIT_FSIZE covers full disks")
    root = tmp_path / "mnt"
    root.mkdir()
    script = f'mount -t tmpfs -o size=2m kvwire-test "{root}" && exec "{sys.executable}" -c "$0" "{root}" {mode} {4 << 20}'
    proc = subprocess.run(prefix + ["sh", "-c", script, FULL_DISK_CHILD], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    check_full_disk(out, mode)
    assert "ENOSPC" in out["big"]


# -- (g): a server that never answers --------------------------------------------------------------

CALLS = {
    "get": lambda s: s.get("k"), "get_range": lambda s: s.get("k", (0, 10)), "put": lambda s: s.put("k", b"v"),
    "exists": lambda s: s.exists("k"), "leading": lambda s: s.leading(["k", "l"]),
    "get_many": lambda s: s.get_many(["k", "l"]), "put_many": lambda s: s.put_many([("k", b"v")]),
    "sizes": lambda s: s.sizes(["k"]), "list": lambda s: s.list(), "delete": lambda s: s.delete("k"),
}


@pytest.mark.slow
def test_store4_silent_server_times_out():
    """KVW-STORE-4: a listener that accepts and never replies: every call is a StoreError
    within the timeout (plus scheduling slack), never a hang."""
    timeout = 0.5
    with SilentServer() as silent:
        store = open_store(f"redis://127.0.0.1:{silent.port}/0", timeout=timeout)
        for name, call in CALLS.items():
            fails_within(lambda call=call: call(store), timeout + 1.0, name)
        store.close()
        fails_within(lambda: open_store(f"redis-cluster://127.0.0.1:{silent.port}", timeout=timeout),
                     timeout + 1.0, "open a cluster store (reads the slot map at once)")


@pytest.mark.slow
def test_store4_debug_sleep_and_paused_server(tmp_path):
    """KVW-STORE-1/4: a real server that stops answering (DEBUG SLEEP, then SIGSTOP) fails the
    calls within the timeout; once it answers again the same store works, and a large put cut
    off by the timeout left no object."""
    timeout, calls = 0.5, ("get", "exists", "leading", "put_many")
    server = RedisServer(tmp_path / "r", extra=("--enable-debug-command", "yes")).start()
    store = open_store(server.url, timeout=timeout)
    store.put("k", b"value")
    sleeper = server.client(socket_timeout=30)
    nap_s = 0.3 + len(calls) * (timeout + 1.0)  # outlasts the calls even when each takes its whole bound
    nap = Timed(lambda: sleeper.execute_command("DEBUG", "SLEEP", nap_s))
    nap.start()
    time.sleep(0.3)
    for name in calls:
        fails_within(lambda name=name: CALLS[name](store), timeout + 1.0, name)
    nap.join(nap_s + 10)
    assert nap.error is None
    assert bytes(store.get("k")) == b"value"  # the store recovered, on the same object
    sleeper.close()

    server.pause()
    try:
        big = bytes(64 << 20)  # the put blocks on a full socket buffer, then times out
        fails_within(lambda: store.put("big", big), timeout + MARGIN, "a large put to a paused server")
    finally:
        server.resume()
    assert store.get("big") is None and store.list() == ["k"]  # the cut-off command was never applied
    store.close()
    server.kill()


@pytest.mark.slow
def test_free_port_and_restart_on_a_taken_port(tmp_path):
    """The fixture's own robustness: a server whose port another process took meanwhile
    fails with its log, and a fresh server finds another port."""
    import socket
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    taken = holder.getsockname()[1]
    try:
        blocked = RedisServer(tmp_path / "b", port=taken)
        with pytest.raises(pytest.fail.Exception, match="Address already in use"):
            blocked.start()
        with RedisServer(tmp_path / "ok") as fine:
            assert fine.port != taken and fine.client().ping()
    finally:
        holder.close()
    assert free_port() > 0
