"""Layer-wise streaming of a KV cache from one process to another over TCP (``kvwire.stream``).

What it shows: the producer (this process) listens on a loopback port and starts the
consumer as a second process; ``stream.LayerWriter(sock, header)`` sends the header at once and
each layer as soon as ``write_layer(i, k, v)`` is called (zero-copy ``sendmsg`` from a
background thread, so sending layer i overlaps computing layer i+1). The consumer's
``stream.LayerReader(sock)`` yields every layer, verified, as soon as its chunks have arrived,
while later layers are still in flight: it reports when each layer became usable and a
SHA-256 of its bytes, which the producer checks against what it sent.

Run it from the repository root (numpy only):

    python examples/stream_two_processes.py [--layers 8] [--tokens 512] [--codec zstd]

(the consumer side alone: ``python examples/stream_two_processes.py --consume HOST:PORT``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import socket
import subprocess
import sys
import time

import numpy as np

import kvwire
from kvwire import stream


def digest(k, v) -> str:
    return hashlib.sha256(np.ascontiguousarray(k).tobytes() + np.ascontiguousarray(v).tobytes()).hexdigest()


def consume(address: str) -> int:
    """The consumer process: connect, read layer by layer, print one JSON line per layer."""
    host, port = address.rsplit(":", 1)
    t0 = time.perf_counter()
    with socket.create_connection((host, int(port))) as sock:
        r = stream.LayerReader(sock, prefetch=2)
        for layer in r:                                  # layer i is usable before i+1 arrived
            print(json.dumps({"layer": layer.index, "ms": round((time.perf_counter() - t0) * 1e3, 2),
                              "sha256": digest(layer.k, layer.v)}), flush=True)
        print(json.dumps({"done": True, "bytes": r.stats.bytes, "gbps": round(r.stats.gbps, 3)}), flush=True)
    return 0


def produce(layers: int, kv_heads: int, head_dim: int, tokens: int, codec: str) -> int:
    specs = tuple(kvwire.LayerSpec("full_attention", kv_heads, head_dim, head_dim) for _ in range(layers))
    header = kvwire.Header(kvwire.Architecture(specs), token_count=tokens, dtype="f16")
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        child = subprocess.Popen([sys.executable, __file__, "--consume", f"127.0.0.1:{port}"],
                                 stdout=subprocess.PIPE, text=True)
        conn, _ = server.accept()
        sent = []
        with conn, stream.LayerWriter(conn, header, codec=codec) as w:
            for i in range(layers):                      # "compute" each layer, then send it at once
                rng = np.random.default_rng(i)
                k = rng.standard_normal((kv_heads, tokens, head_dim)).astype(np.float16)
                v = rng.standard_normal((kv_heads, tokens, head_dim)).astype(np.float16)
                w.write_layer(i, k, v)
                sent.append(digest(k, v))
        out, _ = child.communicate(timeout=120)
    lines = [json.loads(line) for line in out.splitlines()]
    got = [d["sha256"] for d in lines if "layer" in d]
    for d in lines:
        if "layer" in d:
            print(f"consumer: layer {d['layer']} usable after {d['ms']} ms")
    print(f"consumer received {lines[-1]['bytes']} bytes; every layer identical: {got == sent}")
    return 0 if child.returncode == 0 and got == sent else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--codec", default="raw", help="raw, zstd or a lossless preset such as byteplane")
    ap.add_argument("--consume", metavar="HOST:PORT", help="run as the consumer (started by the producer)")
    a = ap.parse_args(argv)
    if a.consume:
        return consume(a.consume)
    return produce(a.layers, a.kv_heads, a.head_dim, a.tokens, a.codec)


if __name__ == "__main__":
    raise SystemExit(main())
