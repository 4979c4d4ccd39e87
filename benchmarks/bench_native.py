#!/usr/bin/env python3
"""Native (libkvwire over ctypes) against numpy chunk decoding, per codec.

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

Encoding (``--encode``, on by default): the lossy body of every 256-token chunk of layer 0
(K and V) for a grid of codec specs (all fp8 formats and scale granularities, int_affine
8/4/2 bits on both group axes, symmetric and not, each scale dtype), by numpy
(``quant.encode``) and by ``native.encode_lossy`` into a reused buffer, paired per round;
bodies are checked byte-identical first. Goal: lossy encode >= 1 GB/s on one core. Revision 1.2's
rotated forms (the ``hadamard-*`` presets and ``ROT_TOKENS``) are in both tables (the k3v2 preset's
two specs are lloyd3 and lloyd2 in the encoding table).
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
from _common import cache_shape_args, cpu_model
from kvwire import CodecSpec
from kvwire.codecs import decode_chunk, native, quant
from kvwire.codecs.pipeline import lossy_range
from kvwire.codecs.presets import PRESETS, resolve
from kvwire.format.architecture import Architecture, LayerSpec
from kvwire.format.codec_specs import features_of
from kvwire.format.header import Header
from kvwire.format.kv_scales import required_minor
from kvwire.tools.synth import synth_cache

CODECS = ["zstd", "byteplane", "fp8-e4m3", "fp8-e4m3-token", "int8", "int8-asym", "int4-g32", "int4-g32-zstd",
          "kivi4", "kivi2", "hadamard-int4-g32", "hadamard-lloyd4", "hadamard-lloyd3", "hadamard-lloyd2",
          "hadamard-lloyd-k3v2", "hadamard-int2-tokens", "hadamard-int3-tokens", "kchan4-vlloyd4",
          "kchan3-vlloyd2", "vllm-turboquant-4bit-nc", "vllm-turboquant-k3v4-nc", "vllm-turboquant-3bit-nc",
          "vllm-int8-per-token-head"]
METHODS = ["numpy", "native_hook", "native_1t", "native_2t"]
GOAL_1, GOAL_2, GOAL_2_CODECS, GOAL_ENC = 1.25, 3.0, ("int8", "fp8", "byteplane"), 1.0


def _int(bits, axis, sym, sd, G=32, **kw):
    return CodecSpec("int_affine", bits=bits, group_size=G, group_axis=axis, symmetric=sym, scale_dtype=sd, **kw)


# Revision 1.2 forms without a preset name: rotated min-max codes over groups of 32 tokens (f16 scales).
ROT_TOKENS = {f"hadamard-int{b}-tokens": _int(b, "tokens", False, "f16", rotation="hadamard",
                                              rotation_seed=PRESETS["hadamard-lloyd3"].rotation_seed) for b in (2, 3)}


ENCODE = {  # name -> spec (lossless stage "raw": the stage is zstd's, measured in bench_codecs)
    "fp8-e4m3fn-tensor": CodecSpec("fp8", fp8_format="f8_e4m3fn", scale_granularity="tensor"),
    "fp8-e4m3fn-token": CodecSpec("fp8", fp8_format="f8_e4m3fn", scale_granularity="token"),
    "fp8-e5m2-head": CodecSpec("fp8", fp8_format="f8_e5m2", scale_granularity="head"),
    "fp8-e4m3fnuz-token": CodecSpec("fp8", fp8_format="f8_e4m3fnuz", scale_granularity="token"),
    "int8-sym-tokens-f32": _int(8, "tokens", True, "f32"),
    "int8-asym-channels-bf16": _int(8, "channels", False, "bf16"),
    "int4-g32-sym-tokens-f16": _int(4, "tokens", True, "f16"),
    "kivi4 (int4 asym, K tokens)": _int(4, "tokens", False, "f16"),
    "int4-asym-channels-f16": _int(4, "channels", False, "f16"),
    "kivi2 (int2 asym, K tokens)": _int(2, "tokens", False, "f16"),
    "int2-asym-channels-f16": _int(2, "channels", False, "f16"),
    "int2-sym-channels-f32": _int(2, "channels", True, "f32"),
    # revision 1.2 (spec/codecs.md section 8): rotation, Gaussian codebook, 3-bit codes
    **{n: PRESETS[n] for n in ("hadamard-int4-g32", "hadamard-lloyd4", "hadamard-lloyd3", "hadamard-lloyd2")},
    **ROT_TOKENS,
    # the kchan presets' keys: per channel over groups of 64 tokens (their values are lloyd4/lloyd2)
    **{f"{n} (K)": resolve(PRESETS[n], "k") for n in ("kchan4-vlloyd4", "kchan3-vlloyd2")},
    # revision 1.3 (section 9): vLLM's turboquant keys
    **{f"{n} (K)": resolve(PRESETS[n], "k") for n in ("vllm-turboquant-4bit-nc", "vllm-turboquant-3bit-nc")},
    **{f"{n} (V)": resolve(PRESETS[n], "v") for n in ("vllm-turboquant-4bit-nc", "vllm-turboquant-3bit-nc")},
    "vllm-int8-per-token-head": PRESETS["vllm-int8-per-token-head"],
}


def measure_encode(cache, spec, rounds: int) -> dict:
    """numpy vs native lossy encoding of layer 0's chunks (paired rounds, median)."""
    k = cache.layers[0]["k"]
    heads, tokens, dim = k.shape
    arch = Architecture((LayerSpec("full_attention", heads, dim, dim),))
    rf = features_of((spec,))  # revision 1.2 specs: the rotation bit and format 1.2
    h = Header(arch, token_count=tokens, dtype="bf16", chunk_tokens=256, codec_specs=(spec,),
               required_features=rf, format_minor=required_minor(rf))
    items = []
    for comp in ("k", "v"):
        for t0 in range(0, tokens, 256):
            x = np.ascontiguousarray(cache.layers[0][comp][:, t0:t0 + 256])
            lay = quant.layout(spec, "bf16", heads, dim, t0, t0 + x.shape[1], *lossy_range(h, 0))
            rec = native.record(h, spec.codec, 1, 0, x.nbytes, x.shape, 0, t0)
            ref = b"".join(bytes(memoryview(p).cast("B")) for p in quant.encode(spec, x, lay, "bf16"))
            out = np.empty(len(ref), np.uint8)
            assert bytes(native.encode_lossy(h, rec, x.view(np.uint8).reshape(-1), out=out)) == ref, "native differs"
            items.append((x, lay, rec, x.view(np.uint8).reshape(-1), out))
    nbytes = sum(it[0].nbytes for it in items)
    tn, tc = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        for x, lay, _rec, _raw, _out in items:
            quant.encode(spec, x, lay, "bf16")
        tn.append(time.perf_counter() - t)
        t = time.perf_counter()
        for _x, _lay, rec, raw, out in items:
            native.encode_lossy(h, rec, raw, out=out)
        tc.append(time.perf_counter() - t)
    return {"bytes": nbytes, "chunks": len(items), "numpy": nbytes / statistics.median(tn) / 1e9,
            "native": nbytes / statistics.median(tc) / 1e9,
            "speedup": statistics.median([a / b for a, b in zip(tn, tc)])}


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
             (f"Goals (the rotated, kchan and turboquant presets included): every codec >= "
              f"{GOAL_1} GB/s on one core; int8, fp8, byteplane >= {GOAL_2} GB/s on two."),
             "", "| codec | chunks | numpy GB/s | native hook | native 1t | native 2t | x 1t | x 2t | goal 1 core | goal 2 cores |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g2 = r["codec"].startswith(GOAL_2_CODECS)
        g2_txt = ("yes" if r["native_2t"] >= GOAL_2 else "**no**") if g2 else "-"
        lines.append(f"| {r['codec']} | {r['chunks']} | {r['numpy']:.2f} | {r['native_hook']:.2f} | {r['native_1t']:.2f} | "
                     f"{r['native_2t']:.2f} | {r['speedup_1t']:.2f} | {r['speedup_2t']:.2f} | "
                     f"{'yes' if r['native_1t'] >= GOAL_1 else '**no**'} | {g2_txt} |")
    enc = meta.get("encode_rows") or []
    if enc:
        lines += ["", "## Lossy encoding", "",
                  (f"Layer 0 of the same cache ({enc[0]['chunks']} chunks of 8 heads x 256 tokens x 128 bf16), "
                   f"{meta['rounds']} paired rounds (numpy `quant.encode` then `native.encode_lossy` into a reused "
                   "buffer), median; GB/s of raw input. Bodies byte-identical (checked). "
                   f"Goal: >= {GOAL_ENC} GB/s on one core."), "",
                  "| spec | numpy GB/s | native GB/s | x | goal |", "|---|---|---|---|---|"]
        for r in enc:
            lines.append(f"| {r['codec']} | {r['numpy']:.2f} | {r['native']:.2f} | {r['speedup']:.2f} | "
                         f"{'yes' if r['native'] >= GOAL_ENC else '**no**'} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cache_shape_args(ap, layers=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--codecs", default=",".join(CODECS))
    ap.add_argument("--no-encode", action="store_true", help="skip the lossy encoding table")
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
            "machine": f"{cpu_model()}, {os.cpu_count()} CPUs, Python "
                       f"{platform.python_version()}, numpy {np.__version__}"}
    rows = []
    for name in a.codecs.split(","):
        r = kvwire.open(kvwire.encode(cache, codec=ROT_TOKENS.get(name, name)))
        items = chunks(r)
        row = {"codec": name, **measure(r.header, items, a.rounds)}
        rows.append(row)
        print(f"{name:16s} numpy {row['numpy']:5.2f}  hook {row['native_hook']:5.2f}  1t {row['native_1t']:5.2f}  "
              f"2t {row['native_2t']:5.2f} GB/s  (x{row['speedup_1t']:.2f}, x{row['speedup_2t']:.2f})", flush=True)
    native.enable(a.lib)
    for name, spec in ({} if a.no_encode else ENCODE).items():
        row = {"codec": name, **measure_encode(cache, spec, a.rounds)}
        meta.setdefault("encode_rows", []).append(row)
        print(f"encode {name:28s} numpy {row['numpy']:5.2f}  native {row['native']:5.2f} GB/s  (x{row['speedup']:.2f})",
              flush=True)
    native.disable()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "codecs": rows}, indent=1) + "\n")
    render(meta, rows, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
