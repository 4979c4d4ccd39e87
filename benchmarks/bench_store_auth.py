"""Cost of authenticated store objects (spec/store.md section 11, KVW-AUTH-*): put and load
throughput of one cache with and without a keyring, same cache, same store kind, same run.

Why: a keyed writer hashes every stored byte with SHA-256 (the tag's body digests) and a keyed
reader hashes every byte again before decoding it; this measures what that costs against the
unkeyed path. Each store lives in a directory this script creates (and removes) itself.

    python benchmarks/bench_store_auth.py [--tokens 2048 --layers 32 ...] [--repeat 3]

The table goes to stdout and to benchmarks/results/store_auth.md; its last row is the bound:
SHA-256 of the cache's bytes alone, on one thread and on the worker threads the store uses.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvwire
from _common import cache_shape_args, cpu_model
from kvwire.format.header import ModelIdentity
from kvwire.store import KeySpace, KVStore, LocalStore, MemoryStore
from kvwire.store.auth import Keyring, digests_of

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "store_auth.md")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cache_shape_args(ap)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--results", default=os.path.dirname(RESULTS), help="where store_auth.md goes")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    shape = (a.heads, a.tokens, a.head_dim)
    ks = [rng.standard_normal(shape, np.float32).astype(np.float16) for _ in range(a.layers)]
    vs = [rng.standard_normal(shape, np.float32).astype(np.float16) for _ in range(a.layers)]
    cache = kvwire.KVCache.from_tensors(ks, vs, model=ModelIdentity(compat_fingerprint=b"\1" * 32),
                                        chunk_tokens=a.chunk_tokens)
    tokens, space, ring = np.arange(a.tokens), KeySpace.of(cache.header), Keyring([("bench", os.urandom(32))])
    out = [f"# Authenticated objects: cost ({cpu_model()}; {cache.nbytes / 2**20:.0f} MiB f16 cache, "
           f"{a.tokens // a.chunk_tokens} chunks, raw codec, best of {a.repeat})", "",
           "| store | auth | put GB/s | load GB/s |", "|---|---|---|---|"]
    root = tempfile.mkdtemp(prefix="kvwire-bench-auth-")
    try:
        for kind in ("memory", "file"):
            rows = {}
            for auth in (None, ring):
                puts, gets = [], []
                for r in range(a.repeat):
                    store = MemoryStore() if kind == "memory" else LocalStore(os.path.join(root, f"{auth is None}{r}"))
                    kv = KVStore(store, auth=auth)
                    t = time.perf_counter()
                    kv.put_cache(cache, tokens)
                    puts.append(cache.nbytes / (time.perf_counter() - t) / 1e9)
                    t = time.perf_counter()
                    got = kv.get_cache(tokens, space)
                    gets.append(cache.nbytes / (time.perf_counter() - t) / 1e9)
                    assert got.tokens == a.tokens
                rows[auth is not None] = (max(puts), max(gets))
                out.append(f"| {kind} | {'keyed' if auth else 'none'} | {max(puts):.2f} | {max(gets):.2f} |")
            (p0, g0), (p1, g1) = rows[False], rows[True]
            out.append(f"| {kind} | ratio keyed/none | {p1 / p0:.2f}x | {g1 / g0:.2f}x |")
    finally:
        shutil.rmtree(root)
    arrays = [t for layer in cache.layers for t in layer.values()]
    views = [memoryview(np.ascontiguousarray(t)).cast("B") for t in arrays]
    one = min(_timed(lambda: [hashlib.sha256(v).digest() for v in views]) for _ in range(a.repeat))
    ends = np.cumsum([v.nbytes for v in views]).tolist()
    spans = list(zip([0] + ends[:-1], ends))  # each array as a span of the cache's bytes, as a store object's bodies
    at = {start: v for (start, _), v in zip(spans, views)}
    many = min(_timed(lambda: digests_of(spans, lambda start, _: hashlib.sha256(at[start]).digest()))
               for _ in range(a.repeat))
    out.append(f"| bound: SHA-256 of the bytes | 1 thread / worker threads | {cache.nbytes / one / 1e9:.2f} | "
               f"{cache.nbytes / many / 1e9:.2f} |")
    print("\n".join(out))
    os.makedirs(a.results, exist_ok=True)
    with open(os.path.join(a.results, "store_auth.md"), "w") as f:
        f.write("\n".join(out) + "\n")


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
