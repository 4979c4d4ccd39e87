#!/usr/bin/env python3
"""kvwire.store benchmark: the file store, one Redis server (plain and over TLS) and a
three-master Redis Cluster against raw redis-py and plain file I/O, in one run.

    .venv/bin/python benchmarks/bench_store.py            # full run (a few minutes)
    .venv/bin/python benchmarks/bench_store.py --quick    # fewer repeats, smaller workload

It starts its own redis-server processes on free loopback ports (tests/redisfix.py; the TLS
one with certificates made by tests/redisfakes.py's openssl calls) and stops them. The TLS
server is in sections 1 and 2 only. Sections:

1. objects: put and get of one 256-token chunk of a Llama-3-8B-shaped bf16 cache (32
   layers x 8 KV heads x 128, K and V: 32 MiB) against raw redis-py SET/GET of the same
   bytes, and on the file store against write(2)/read(2) of a file. Store level
   (``put``/``get`` of the container's bytes) and cache level (``KVStore.put_cache`` =
   encode + checksums + SET, ``get_cache`` = GET + header checks + verified decode).
2. the hit query: ``leading`` over a prompt's chunk keys (1K to 1M tokens; 512 keys for
   128K), all hits, with the round trips it took.
3. workloads: 200 requests over 10 documents behind a common system prompt, and a
   multi-turn chat; per backend: chunk and token hit rate, bytes read, bytes not written
   again, wall time.

Writes benchmarks/results/store.md and store.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "tests"))

import kvwire
from kvwire.cache.encoder import iter_buffers
from kvwire.format.header import ModelIdentity
from kvwire.store import KeySpace, KVStore, open_store
from redisfakes import make_certs
from redisfix import RedisCluster, RedisServer

FP = bytes(range(32))
MiB = 1 << 20


def median_ms(fn, repeat, setup=None):
    """Median and min wall time (ms) of ``fn`` over ``repeat`` runs after one warm-up;
    ``setup`` runs untimed before each."""
    out = []
    for i in range(repeat + 1):
        if setup:
            setup()
        t0 = time.perf_counter()
        fn()
        dt = (time.perf_counter() - t0) * 1e3
        if i:
            out.append(dt)
    return statistics.median(out), min(out)


def llama_chunk(tokens=256, layers=32, heads=8, dim=128, seed=0, fp=FP):
    rng = np.random.default_rng(seed)
    ks = [rng.standard_normal((heads, tokens, dim), dtype=np.float32).astype(ml_dtypes.bfloat16) for _ in range(layers)]
    vs = [rng.standard_normal((heads, tokens, dim), dtype=np.float32).astype(ml_dtypes.bfloat16) for _ in range(layers)]
    return kvwire.KVCache.from_tensors(ks, vs, model=ModelIdentity(compat_fingerprint=fp), chunk_tokens=tokens)


# -- 1. objects ---------------------------------------------------------------------------

def rm(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def bench_objects(backends, raw_client, tmp, repeat):
    cache = llama_chunk()
    tokens = np.arange(256, dtype=np.int64)
    bufs = [memoryview(b).cast("B") for b in iter_buffers(cache, form="file", codec="raw")]
    blob = b"".join(bufs)
    rows = []
    # Every timed put writes a key deleted just before (untimed), so each path reuses the memory
    # (Redis's allocator, the page cache) the previous one freed: puts of ever new keys measure
    # the kernel's page zeroing instead, and vary 2-3x between runs on this VM.
    rc = raw_client
    set_ms = median_ms(lambda: rc.set("bench/put", blob), repeat, setup=lambda: rc.delete("bench/put"))
    rc.set("bench/raw", blob)
    get_ms = median_ms(lambda: rc.get("bench/raw"), repeat)
    rows.append(dict(path="raw redis-py SET / GET (bytes; hiredis packs the command, copying the value)", put=set_ms,
                     get=get_ms, size=len(blob)))
    # the same client with redis-py's own packer, which passes a large value through uncopied
    from redis.connection import ConnectionPool, PythonRespSerializer
    py = rc.__class__(connection_pool=ConnectionPool(
        host="127.0.0.1", port=rc.connection_pool.connection_kwargs["port"],
        command_packer=PythonRespSerializer(6000, rc.connection_pool.get_encoder().encode)))
    py_set = median_ms(lambda: py.set("bench/put", blob), repeat, setup=lambda: py.delete("bench/put"))
    rows.append(dict(path="raw redis-py SET / GET (bytes; redis-py's Python packer)", put=py_set,
                     get=median_ms(lambda: py.get("bench/raw"), repeat), size=len(blob)))
    py.close()
    # plain file
    fpath = os.path.join(tmp, "plain.bin")

    def write_file():
        with open(fpath, "wb") as f:
            f.write(blob)

    def read_file():
        with open(fpath, "rb") as f:
            f.read()

    rows.append(dict(path="plain file write(2) / read(2)", put=median_ms(write_file, repeat, setup=lambda: rm(fpath)),
                     get=median_ms(read_file, repeat), size=len(blob)))
    for name, store in backends.items():
        put = median_ms(lambda: store.put("bench/put", bufs), repeat, setup=lambda: store.delete("bench/put"))
        store.put("bench/kv", bufs)
        get = median_ms(lambda: store.get("bench/kv"), repeat)
        assert store.get("bench/kv") == blob
        rows.append(dict(path=f"{name}: Store.put (encoder buffers) / get", put=put, get=get, size=len(blob)))
        kv = KVStore(store)
        space = KeySpace.of(cache.header)

        def clear():
            for key in space.keys(tokens):
                store.delete(key)

        put_c = median_ms(lambda: kv.put_cache(cache, tokens), repeat, setup=clear)
        kv.put_cache(cache, tokens)
        got = kv.get_cache(tokens, space)
        assert got.tokens == 256 and np.array_equal(np.asarray(got.cache.layers[5]["k"]).view(np.uint16),
                                                    np.asarray(cache.layers[5]["k"]).view(np.uint16))
        get_c = median_ms(lambda: kv.get_cache(tokens, space), repeat)
        rows.append(dict(path=f"{name}: KVStore.put_cache / get_cache (verified)", put=put_c, get=get_c,
                         size=len(blob)))
    return rows


# -- 2. the hit query ---------------------------------------------------------------------

def bench_hits(backends, repeat):
    space = KeySpace(FP, "bf16", 256, (0, 32))
    rows = []
    for tokens in (1 << 10, 8 << 10, 32 << 10, 128 << 10, 1 << 20):
        toks = np.arange(tokens, dtype=np.int64) % 50000
        keys = space.keys(toks)
        for name, store in backends.items():
            store.put_many([(k, b"x") for k in keys])
            assert store.leading(keys) == len(keys)
            rt0 = store.stats.round_trips
            med, mn = median_ms(lambda: store.leading(keys), repeat)
            trips = (store.stats.round_trips - rt0) / (repeat + 1)
            rows.append(dict(backend=name, tokens=tokens, keys=len(keys), median_ms=med, min_ms=mn, round_trips=trips))
            for k in keys:
                store.delete(k)
    return rows


# -- 3. workloads -------------------------------------------------------------------------

SHAPE = dict(layers=4, heads=4, dim=64)  # 256 KiB per 256-token chunk (f16): many objects, little memory


def chunk_kv(space, chunk_hash, n):
    """The 'model's' KV of one chunk: a function of its prefix hash, as a real model's KV is a
    function of the tokens before it, so stored and recomputed chunks must agree."""
    rng = np.random.default_rng(int.from_bytes(chunk_hash[:8], "little"))
    return [{c: rng.standard_normal((SHAPE["heads"], n, SHAPE["dim"]), dtype=np.float32).astype(np.float16)
             for c in ("k", "v")} for _ in range(SHAPE["layers"])]


def request_cache(space, toks):
    hashes = space.hashes(toks, partial=True)
    C = space.chunk_tokens
    parts = [chunk_kv(space, h, min(C, len(toks) - i * C)) for i, h in enumerate(hashes)]
    ks = [np.concatenate([p[i]["k"] for p in parts], axis=1) for i in range(SHAPE["layers"])]
    vs = [np.concatenate([p[i]["v"] for p in parts], axis=1) for i in range(SHAPE["layers"])]
    return kvwire.KVCache.from_tensors(ks, vs, model=ModelIdentity(compat_fingerprint=FP), chunk_tokens=C)


def documents_workload(rng, n_requests, n_docs, system=512, doc=(1024, 4096), question=(16, 300)):
    sys_toks = rng.integers(0, 50000, system)
    docs = [rng.integers(0, 50000, int(rng.integers(*doc))) for _ in range(n_docs)]
    out = []
    for _ in range(n_requests):
        d = docs[int(rng.integers(n_docs))]
        out.append(np.concatenate([sys_toks, d, rng.integers(0, 50000, int(rng.integers(*question)))]))
    return out


def chat_workload(rng, n_chats, turns, system=256, user=(20, 200), answer=(50, 400)):
    sys_toks = rng.integers(0, 50000, system)
    out = []
    for _ in range(n_chats):
        hist = sys_toks
        for _ in range(turns):
            hist = np.concatenate([hist, rng.integers(0, 50000, int(rng.integers(*user)))])
            out.append(hist)  # the prompt of this turn
            hist = np.concatenate([hist, rng.integers(0, 50000, int(rng.integers(*answer)))])
    return out


def run_workload(store, prompts, C=256):
    kv = KVStore(store)
    space = KeySpace(FP, "f16", C, (0, SHAPE["layers"]))
    hit_chunks = total_chunks = hit_tokens = total_tokens = bytes_in = skipped = written = 0
    store_s = 0.0  # time inside the store calls (the synthetic 'prefill' is not counted)
    t0 = time.perf_counter()
    for toks in prompts:
        keys = space.keys(toks)
        a = time.perf_counter()
        n = kv.leading_hits(keys)
        store_s += time.perf_counter() - a
        total_chunks += len(keys)
        total_tokens += len(toks)
        if n:
            b0, a = store.stats.bytes_in, time.perf_counter()
            got = kv.get_cache(toks, space, n_chunks=n)
            store_s += time.perf_counter() - a
            bytes_in += store.stats.bytes_in - b0
            hit_chunks += got.chunks
            hit_tokens += got.tokens
            want = chunk_kv(space, space.hashes(toks)[got.chunks - 1], C)  # the last served chunk
            assert np.array_equal(np.asarray(got.cache.layers[0]["k"])[:, -C:], want[0]["k"])
        cache = request_cache(space, toks)
        a = time.perf_counter()
        res = kv.put_cache(cache, toks)  # the engine stores the new whole chunks
        store_s += time.perf_counter() - a
        skipped += res.skipped
        written += res.written
    wall = time.perf_counter() - t0
    chunk_bytes = 2 * SHAPE["layers"] * SHAPE["heads"] * C * SHAPE["dim"] * 2
    return dict(requests=len(prompts), chunk_hit_rate=hit_chunks / max(1, total_chunks),
                token_hit_rate=hit_tokens / max(1, total_tokens), tokens=total_tokens, bytes_read=bytes_in,
                objects_written=written, objects_not_rewritten=skipped,
                bytes_not_rewritten=skipped * chunk_bytes, wall_s=wall, store_s=store_s)


# -- report -------------------------------------------------------------------------------

def report(res) -> str:
    o = res["objects"]
    raw = o[0]
    best_put = min(o[0]["put"][0], o[1]["put"][0])  # the faster raw redis-py client
    best_get = min(o[0]["get"][0], o[1]["get"][0])
    lines = ["# kvwire.store benchmark", "",
             f"Machine: {res['machine']}, load average before/after {res['load'][0]:.2f}/{res['load'][1]:.2f}; "
             f"redis-server {res['redis_version']}, redis-py {res['redis_py']} (hiredis {res['hiredis']}), loopback. "
             f"Median (min) of {res['repeat']} runs after a warm-up.", "",
             f"## 1. One 256-token chunk of a Llama-3-8B bf16 cache ({raw['size'] / MiB:.1f} MiB)", "",
             "| path | put ms | get ms | put GB/s | get GB/s | put vs raw redis-py | get vs raw redis-py |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in o:
        lines.append(f"| {r['path']} | {r['put'][0]:.1f} ({r['put'][1]:.1f}) | {r['get'][0]:.1f} ({r['get'][1]:.1f}) | "
                     f"{r['size'] / r['put'][0] / 1e6:.2f} | {r['size'] / r['get'][0] / 1e6:.2f} | "
                     f"{best_put / r['put'][0]:.2f}x | {best_get / r['get'][0]:.2f}x |")
    lines += ["", "Ratios are speed ratios against the faster of the two raw redis-py clients (its time / this "
              "time): >= 1 is at least as fast as raw redis-py moving the same bytes. The raw clients run in "
              "plaintext, so the TLS rows' ratios include what TLS costs.",
              "", "## 2. The hit query (`leading`, every key a hit)", "",
              "| backend | prompt tokens | keys | median ms | min ms | round trips |", "|---|---:|---:|---:|---:|---:|"]
    for r in res["hits"]:
        lines.append(f"| {r['backend']} | {r['tokens']:,} | {r['keys']} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | "
                     f"{r['round_trips']:.0f} |")
    for wl, rows in res["workloads"].items():
        lines += ["", f"## 3. Workload: {wl}", "",
                  "| backend | requests | chunk hit rate | token hit rate | MiB read | objects written | "
                  "objects not rewritten (MiB) | s in store calls | wall s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for name, r in rows.items():
            lines.append(f"| {name} | {r['requests']} | {r['chunk_hit_rate']:.1%} | {r['token_hit_rate']:.1%} | "
                         f"{r['bytes_read'] / MiB:.0f} | {r['objects_written']} | {r['objects_not_rewritten']} "
                         f"({r['bytes_not_rewritten'] / MiB:.0f}) | {r['store_s']:.2f} | {r['wall_s']:.2f} |")
    lines += ["", f"Workload model: {SHAPE['layers']} layers x {SHAPE['heads']} KV heads x {SHAPE['dim']}, f16, "
              "chunks of 256 tokens; the token hit rate counts prompt tokens served from the store (a partial "
              "trailing chunk is never stored, so it is recomputed)."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="3 repeats, a smaller workload")
    ap.add_argument("--results", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    repeat = 3 if args.quick else args.repeat
    import hiredis
    import redis
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="kvwire-bench-store-") as tmp:
        single = RedisServer(os.path.join(tmp, "redis")).start()
        cluster = RedisCluster(os.path.join(tmp, "cluster")).start()
        tls = RedisServer(os.path.join(tmp, "redis-tls"), tls=make_certs(os.path.join(tmp, "certs"))).start()
        try:
            raw = single.client()
            version = raw.info("server")["redis_version"]
            stores = {"file": open_store(f"file://{tmp}/store"), "redis": open_store(single.url),
                      "redis cluster (3 masters)": open_store(cluster.url)}
            with_tls = {**stores, "redis over TLS (rediss://)": open_store(tls.url)}  # objects and hits only
            objects = bench_objects(with_tls, raw, tmp, repeat)
            for s in with_tls.values():
                for k in s.list("bench/") + s.list("kvw1/"):
                    s.delete(k)
            leftover = raw.keys("bench/*")
            if leftover:
                raw.delete(*leftover)
            hits = bench_hits(with_tls, max(repeat, 20))
            rng_seed = 1
            n_req = 60 if args.quick else 200
            workloads = {}
            for wl in ("documents", "chat"):
                rows = {}
                for name, s in stores.items():
                    rng = np.random.default_rng(rng_seed)
                    prompts = (documents_workload(rng, n_req, 10) if wl == "documents"
                               else chat_workload(rng, 6 if args.quick else 20, 10))
                    rows[name] = run_workload(s, prompts)
                    for k in s.list("kvw1/"):
                        s.delete(k)
                title = (f"{n_req} requests over 10 documents (1K-4K tokens) behind a 512-token system prompt"
                         if wl == "documents" else f"multi-turn chat ({6 if args.quick else 20} chats x 10 turns)")
                workloads[title] = rows
        finally:
            tls.stop()
            cluster.stop()
            single.stop()
    res = dict(machine=f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
               load=(load0, os.getloadavg()[0]), redis_version=version, redis_py=redis.__version__,
               hiredis=hiredis.__version__, repeat=repeat, objects=objects, hits=hits, workloads=workloads)
    text = report(res)
    print(text)
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "store.md").write_text(text)
    (out / "store.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
