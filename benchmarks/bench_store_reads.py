#!/usr/bin/env python3
"""Large reads from Redis: kvwire's ``RedisStore`` against raw redis-py, its parsers,
pipelining depth, parallel connections and a server with I/O threads, in one run.

    .venv/bin/python benchmarks/bench_store_reads.py            # full run (about a minute)
    .venv/bin/python benchmarks/bench_store_reads.py --quick

Why: a KV cache hit from Redis is a few hundred MiB of large values, and how they are
asked for decides the speed more than the client: Redis 7 answers one large reply several
times slower than the same bytes in replies of about 1 MiB. The workload is a 4K-token hit
of bench_vllm.py's model (16 layers x 8 KV heads x 128, bf16: 16 chunk objects of 16 MiB,
a layer of each chunk 1 MiB), read as the vLLM connector does (one layer of every chunk per
batch), as whole objects (``KVStore.get_cache``), and as an 8K- and 16K-token prompt's
layer (32 and 64 ranges of 1 MiB per batch). Every row moves the same bytes; limits of the
same bytes in the same run: a numpy copy and a plain loopback TCP transfer (one Python
``sendall`` to ``recv_into``). It starts its own redis-server processes on free loopback
ports (tests/redisfix.py) and stops them.

Writes benchmarks/results/store_reads.md and store_reads.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "tests"))

from _common import cpu_model, timed
from kvwire.store import open_store
from redisfix import RedisServer

MiB = 1 << 20
CHUNKS, LAYERS, RANGE = 16, 16, MiB  # a 4K-token hit: 16 objects x 16 layers x 1 MiB = 256 MiB
OLD_SCRIPT = "if redis.call('EXISTS', KEYS[1]) == 0 then return false end " \
             "return redis.call('GETRANGE', KEYS[1], ARGV[1], ARGV[2])"  # kvwire's ranged read before 2026-12


def layer_batches(keys, ranges_per_batch):
    """(key, offset) batches: one layer of every chunk per batch, ``ranges_per_batch``
    ranges each (more than the chunks: the same chunks again, as a longer prompt's)."""
    out = []
    for layer in range(LAYERS * CHUNKS // ranges_per_batch):
        out.append([(keys[i % CHUNKS], ((layer * ranges_per_batch + i) // CHUNKS % LAYERS) * RANGE)
                    for i in range(ranges_per_batch)])
    return out


def raw_pipeline(client, batches):
    def go():
        for batch in batches:
            p = client.pipeline(transaction=False)
            for key, off in batch:
                p.getrange(key, off, off + RANGE - 1)
            p.execute()
    return go


def kvwire_batches(store, batches):
    def go():
        for batch in batches:  # each batch's replies dropped before the next, as raw_pipeline's
            store.get_ranges([(key, (off, RANGE)) for key, off in batch])
    return go


def rows_for_server(port, keys, label, repeat):
    """(row name, seconds) of every way of reading the 256 MiB from the server at ``port``."""
    import redis
    from redis._parsers import _RESP2Parser
    hi = redis.Redis(port=port, socket_timeout=30)
    py = redis.Redis(connection_pool=redis.ConnectionPool(port=port, parser_class=_RESP2Parser, socket_timeout=30))
    store = open_store(f"redis://127.0.0.1:{port}/0?timeout=30")
    per_layer = layer_batches(keys, CHUNKS)
    rows = [(f"{label}raw redis-py + hiredis, pipelined GETRANGE, one trip per layer (16 MiB)",
             raw_pipeline(hi, per_layer)),
            (f"{label}kvwire RedisStore.get_ranges, one call per layer", kvwire_batches(store, per_layer))]
    if label:
        return [(n, timed(f, repeat)) for n, f in rows]
    script = hi.register_script(OLD_SCRIPT)

    def old_kvwire():
        for batch in per_layer:
            p = hi.pipeline(transaction=False)
            for key, off in batch:
                script(keys=[key], args=[off, off + RANGE - 1], client=p)
            p.execute()

    def parallel(n):
        clients = [redis.Redis(port=port, socket_timeout=30) for _ in range(n)]

        def go():
            threads = [threading.Thread(target=raw_pipeline(clients[j], per_layer[j::n])) for j in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        return go

    rows += [
        ("raw redis-py, pure-Python parser, one trip per layer", raw_pipeline(py, per_layer)),
        ("the former kvwire read: a Lua script per range (EXISTS + GETRANGE), one trip per layer", old_kvwire),
        ("raw redis-py + hiredis, one trip per range (1 MiB)", raw_pipeline(hi, layer_batches(keys, 1))),
        ("raw redis-py + hiredis, all 256 ranges in one trip (256 MiB)", raw_pipeline(hi, layer_batches(keys, 256))),
        ("raw redis-py + hiredis, 2 connections in 2 threads, one trip per layer each", parallel(2)),
        ("raw redis-py MGET of the 16 whole objects (16 MiB values)", lambda: hi.mget(keys)),
        ("kvwire RedisStore.get_many of the 16 whole objects (1 MiB slices)", lambda: store.get_many(keys)),
        ("raw redis-py + hiredis, an 8K prompt's layer per trip (32 MiB)", raw_pipeline(hi, layer_batches(keys, 32))),
        ("kvwire get_ranges, an 8K prompt's layer per call (trips of 16 MiB)",
         kvwire_batches(store, layer_batches(keys, 32))),
        ("raw redis-py + hiredis, a 16K prompt's layer per trip (64 MiB)", raw_pipeline(hi, layer_batches(keys, 64))),
        ("kvwire get_ranges, a 16K prompt's layer per call (trips of 16 MiB)",
         kvwire_batches(store, layer_batches(keys, 64))),
    ]
    out = [(n, timed(f, repeat)) for n, f in rows]
    store.close()
    return out


def loopback_tcp(data, repeat):
    """A plain loopback TCP transfer of ``data``: one sendall in a thread, recv_into a buffer."""
    srv = socket.create_server(("127.0.0.1", 0))
    cli = socket.create_connection(srv.getsockname())
    peer, _ = srv.accept()
    view = memoryview(bytearray(16 * MiB))
    total = len(data)

    def go():
        t = threading.Thread(target=peer.sendall, args=(data,))
        t.start()
        got = 0
        while got < total:
            got += cli.recv_into(view[:min(len(view), total - got)])
        t.join()
    try:
        return timed(go, repeat)
    finally:
        for s in (cli, peer, srv):
            s.close()


def report(res) -> str:
    total = res["bytes"]
    base = res["rows"][0][1][0]
    lines = ["# Large reads from Redis: kvwire against raw redis-py", "",
             f"Machine: {res['machine']}; load average before/after {res['load'][0]:.2f}/{res['load'][1]:.2f}; "
             f"redis-server {res['redis_version']}, redis-py {res['redis_py']} (hiredis {res['hiredis']}), "
             f"loopback. Median (min) of {res['repeat']} runs after a warm-up, one run of the script.", "",
             f"Every row reads the same {total / MiB:.0f} MiB: a 4K-token hit of bench_vllm.py's model (16 chunk "
             "objects of 16 MiB; a layer of one chunk is 1 MiB), by layer as the vLLM connector reads, as whole "
             "objects, or in the batches of a longer prompt's layer.", "",
             "| read | ms | GB/s | speed vs the first row |", "|---|---:|---:|---:|"]
    for name, (med, lo) in res["rows"]:
        lines.append(f"| {name} | {med * 1e3:.1f} ({lo * 1e3:.1f}) | {total / med / 1e9:.2f} | {base / med:.2f}x |")
    lines += ["", "Rows starting \"io-threads 2\" ran against a second server started with `--io-threads 2 "
              "--io-threads-do-reads yes`; the others against a default one. kvwire's `get_ranges` sends each range "
              "as `MULTI`, `EXISTS`, `GETRANGE`s of at most 1 MiB, `EXEC` (KVW-STORE-22) and a batch in round trips "
              "of at most 16 MiB of replies (KVW-STORE-23); a whole object first with its length and first MiB, "
              "then in slices."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="3 repeats")
    ap.add_argument("--results", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    repeat = 3 if args.quick else args.repeat
    import hiredis
    import redis
    load0 = os.getloadavg()[0]
    data = np.random.default_rng(0).integers(0, 256, CHUNKS * LAYERS * RANGE, dtype=np.uint8)
    blob = data.tobytes()
    keys = [f"bench/chunk{i:02d}" for i in range(CHUNKS)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvwire-bench-reads-") as tmp:
        for label, extra in (("", ()), ("io-threads 2: ", ("--io-threads", "2", "--io-threads-do-reads", "yes"))):
            server = RedisServer(os.path.join(tmp, "threads" if label else "plain"), extra=extra).start()
            try:
                client = server.client()
                version = client.info("server")["redis_version"]
                for i, k in enumerate(keys):
                    client.set(k, blob[i * LAYERS * RANGE:(i + 1) * LAYERS * RANGE])
                rows += rows_for_server(server.port, keys, label, repeat)
            finally:
                server.stop()
    dst = np.empty_like(data)
    rows += [("limit: one numpy copy of the same bytes", timed(lambda: np.copyto(dst, data), repeat)),
             ("limit: plain loopback TCP (one sendall -> recv_into, Python)", loopback_tcp(blob, repeat))]
    res = dict(machine=f"{cpu_model()}, {os.cpu_count()} cores", load=(load0, os.getloadavg()[0]),
               redis_version=version, redis_py=redis.__version__, hiredis=hiredis.__version__, repeat=repeat,
               bytes=len(blob), rows=rows)
    text = report(res)
    print(text)
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "store_reads.md").write_text(text)
    (out / "store_reads.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
