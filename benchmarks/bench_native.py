#!/usr/bin/env python3
"""Native (libkvwire over ctypes) against numpy chunk decoding, per codec (issue #18).

    make c && .venv/bin/python benchmarks/bench_native.py             # 64 MiB (8 layers)
    .venv/bin/python benchmarks/bench_native.py --layers 32           # 256 MiB, the bench_codecs cache

Data: the bench_codecs.py cache (``kvwire.tools.synth.synth_cache``: bf16 Gaussian K and V
with outlier channels, Llama-3-8B head shape), encoded with each codec by ``kvwire.encode``.
Every stored body that is not raw is decoded (no checksum, no assembly) into preallocated
buffers by: numpy (``decode_chunk``, native off), native through the same ``decode_chunk``
hook (one thread), and ``native.decode_chunks`` with 1 and 2 threads. The four run back to
back in each round (paired: they see the same machine load), ``--rounds`` rounds; GB/s are
decoded bytes over the median round time. Outputs are checked byte-identical first.
Goals of the issue: every codec >= 1.25 GB/s on one core; int8, fp8 and byteplane >= 3 GB/s
on two. Writes benchmarks/results/native.md and native.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python"))

import kvwire
from kvwire.codecs import decode_chunk, native
from kvwire.tools.synth import synth_cache

CODECS = ["zstd", "byteplane", "fp8-e4m3", "fp8-e4m3-token", "int8", "int8-asym", "int4-g32", "int4-g32-zstd",
          "kivi4", "kivi2"]
METHODS = ["numpy", "native_hook", "native_1t", "native_2t"]
GOAL_1, GOAL_2, GOAL_2_CODECS = 1.25, 3.0, ("int8", "fp8", "byteplane")


def chunks(r):
    """(info, spec index, sparse head, stored bytes) of every non-raw chunk."""
    out = []
    for i in range(r.chunk_count):
        c = r.info(i)
        if c.codec == "raw":
            continue
        spec = int(r.records["reserved0"][i]) if r.header.codec_specs else 0
        out.append((c, spec, bytes(r.stored(i, False)[1])))
    return out


def run(method, h, items, outs):
    if method in ("numpy", "native_hook"):
        for (c, spec, s), o in zip(items, outs):
            decode_chunk(h, c.codec, spec, s, c.raw_length, c.shape, c.layer, c.token_start, o)
        return
    recs = [native.record(h, c.codec, spec, len(s), c.raw_length, c.shape, c.layer, c.token_start)
            for c, spec, s in items]
    native.decode_chunks(h, [(rec, s, o) for rec, (_c, _sp, s), o in zip(recs, items, outs)],
                         threads=1 if method == "native_1t" else 2)


def measure(h, items, rounds: int) -> dict:
    outs = [np.empty(c.raw_length, np.uint8) for c, _, _ in items]
    nbytes = sum(c.raw_length for c, _, _ in items)
    # byte identity first (numpy is the reference)
    native.disable()
    run("numpy", h, items, outs)
    ref = [o.copy() for o in outs]
    native.enable()
    for m in METHODS[1:]:
        for o in outs:
            o.fill(0xA5)
        run(m, h, items, outs)
        assert all(np.array_equal(a, b) for a, b in zip(ref, outs)), f"{m} differs from numpy"
    del ref
    times = {m: [] for m in METHODS}
    for _ in range(rounds):
        for m in METHODS:
            (native.disable if m == "numpy" else native.enable)()
            t0 = time.perf_counter()
            run(m, h, items, outs)
            times[m].append(time.perf_counter() - t0)
    native.disable()
    return {"bytes": nbytes, "chunks": len(items),
            **{m: nbytes / statistics.median(ts) / 1e9 for m, ts in times.items()},
            "speedup_1t": statistics.median([a / b for a, b in zip(times["numpy"], times["native_1t"])]),
            "speedup_2t": statistics.median([a / b for a, b in zip(times["numpy"], times["native_2t"])])}


def render(meta: dict, rows: list, out: Path) -> None:
    lines = ["# Native (libkvwire) vs numpy chunk decoding", "",
             (f"{meta['cache_mib']:.0f} MiB synthetic bf16 cache ({meta['layers']} layers x {meta['heads']} heads x "
             f"{meta['tokens']} tokens x {meta['head_dim']}), {meta['rounds']} paired rounds, median. "
             f"{meta['machine']}; load average at start {meta['load']}. GB/s count decoded (raw) bytes of the "
             "non-raw chunks; no checksums, no assembly. *hook*: `decode_chunk` with native on (one thread); "
             "*1t / 2t*: `native.decode_chunks(threads=1/2)`. Outputs byte-identical with numpy (checked)."), "",
             f"Goals (issue #18): every codec >= {GOAL_1} GB/s on one core; int8, fp8, byteplane >= {GOAL_2} GB/s on two.",
             "", "| codec | chunks | numpy GB/s | native hook | native 1t | native 2t | x 1t | x 2t | goal 1 core | goal 2 cores |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g2 = r["codec"].startswith(GOAL_2_CODECS)
        g2_txt = ("yes" if r["native_2t"] >= GOAL_2 else "**no**") if g2 else "-"
        lines.append(f"| {r['codec']} | {r['chunks']} | {r['numpy']:.2f} | {r['native_hook']:.2f} | {r['native_1t']:.2f} | "
                     f"{r['native_2t']:.2f} | {r['speedup_1t']:.2f} | {r['speedup_2t']:.2f} | "
                     f"{'yes' if r['native_1t'] >= GOAL_1 else '**no**'} | {g2_txt} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--codecs", default=",".join(CODECS))
    ap.add_argument("--lib", default=None, help="libkvwire.so (default: the checkout's build/c)")
    ap.add_argument("--out", default=str(HERE / "results" / "native"))
    ap.add_argument("--render", action="store_true", help="only rewrite native.md from native.json")
    a = ap.parse_args(argv)
    if a.render:
        d = json.loads(Path(a.out).with_suffix(".json").read_text())
        render(d["meta"], d["codecs"], Path(a.out))
        return 0
    native.enable(a.lib)
    native.disable()
    cache = synth_cache(a.layers, a.heads, a.head_dim, a.tokens)
    raw = sum(layer[c].nbytes for layer in cache.layers for c in ("k", "v"))
    meta = {"layers": a.layers, "heads": a.heads, "head_dim": a.head_dim, "tokens": a.tokens, "rounds": a.rounds,
            "cache_mib": raw / 2**20, "load": [round(x, 2) for x in os.getloadavg()],
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python "
                       f"{platform.python_version()}, numpy {np.__version__}"}
    rows = []
    for name in a.codecs.split(","):
        r = kvwire.open(kvwire.encode(cache, codec=name))
        items = chunks(r)
        row = {"codec": name, **measure(r.header, items, a.rounds)}
        rows.append(row)
        print(f"{name:16s} numpy {row['numpy']:5.2f}  hook {row['native_hook']:5.2f}  1t {row['native_1t']:5.2f}  "
              f"2t {row['native_2t']:5.2f} GB/s  (x{row['speedup_1t']:.2f}, x{row['speedup_2t']:.2f})", flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "codecs": rows}, indent=1) + "\n")
    render(meta, rows, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
