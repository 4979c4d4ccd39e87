#!/usr/bin/env python3
"""Codec throughput: encode / decode GB/s on one core and ratio, per codec of spec/codecs.md,
against plain zstd and lz4 (when installed) on the same bytes.

    .venv/bin/python benchmarks/bench_codecs.py              # 256 MiB reference cache (Llama-3-8B shape)
    .venv/bin/python benchmarks/bench_codecs.py --layers 4   # quick run (32 MiB)

Data: ``kvwire.tools.synth.synth_cache``, the cache of bench_core.py: bf16 Gaussian K and V,
K with ~5% outlier channels 8x larger (a synthetic stand-in for a trained model's
cache, not a real one). GB/s are decoded (raw) bytes per second, one thread: numpy and
zstd run single-threaded here, and the machine's load is printed with the results.

Rows: ``kvwire.encode(cache, codec=...)`` (buffers consumed, not joined) and
``Reader.load()`` (checksums verified, one allocation) for each codec; ``decode body`` is
the codec alone (``decode_chunk`` over every stored body, no checksum, no assembly). The
baselines compress each chunk's raw bytes as one frame, as the ``zstd`` codec does.
``--previous COMMIT`` (default: the numpy kernels before the native-speed work) adds paired rows: the
lossy codec of that commit (quant.py and scales.py read with ``git show``) against the current
one on the same chunks, alternating old/new chunk by chunk; reported as medians of the per-
chunk time ratios, next to ``one pass``: the time of one in-place fp32 multiply over a chunk's
elements, which prices a kernel as "equivalent whole-array passes".
Writes benchmarks/results/codecs.md and codecs.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import zstandard

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python"))

import kvwire
from _common import cache_shape_args, cpu_model, timed
from kvwire.codecs import decode_chunk, native, quant
from kvwire.codecs.pipeline import lossy_range
from kvwire.tools.synth import synth_cache

CODECS = ["raw", "zstd", "byteplane", "fp8-e4m3", "fp8-e4m3-token", "int8", "int8-asym", "int4-g32", "int4-g32-zstd",
          "kivi4", "kivi2",
          # revisions 1.2 and 1.3 (spec/codecs.md sections 8, 9): `kvwire plan` reads their figures here
          "hadamard-int4-g32", "hadamard-lloyd4", "hadamard-lloyd3", "hadamard-lloyd2", "hadamard-lloyd-k3v2",
          "kchan4-vlloyd4", "kchan3-vlloyd2", "vllm-turboquant-4bit-nc", "vllm-turboquant-k3v4-nc",
          "vllm-turboquant-3bit-nc", "vllm-int8-per-token-head"]
LINK_GBPS = 10  # a 10 Gbps link carries 1.25 GB/s
PREVIOUS = "34011f1cfc98b4f7540bcc7f3daa6b8dc2fb7952"  # numpy codecs before the native-speed kernels


def previous_quant(commit: str):
    """``kvwire.codecs.quant`` as of ``commit`` (with its own ``scales``), or None."""
    mods = {}
    for name in ("scales", "quant"):
        try:
            src = subprocess.run(["git", "-C", str(HERE.parent), "show", f"{commit}:python/kvwire/codecs/{name}.py"],
                                 capture_output=True, check=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        mod = types.ModuleType(f"kvwire.codecs.previous_{name}")
        mod.__package__ = "kvwire.codecs"
        if name == "quant":
            src = src.replace(b"from . import scales as SC", b"SC = PREVIOUS_SCALES").replace(
                b"from .scales import NotFaithful", b"NotFaithful = PREVIOUS_SCALES.NotFaithful")
            mod.PREVIOUS_SCALES = mods["scales"]
        sys.modules[mod.__name__] = mod
        exec(compile(src, f"{commit[:8]}:{name}.py", "exec"), mod.__dict__)
        mods[name] = mod
    return mods["quant"]


def one_pass_s(n: int, repeat: int = 50) -> float:
    """Median seconds of one in-place fp32 multiply over ``n`` elements (warm buffer)."""
    a = np.ones(n, np.float32)
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.multiply(a, np.float32(1.0), out=a)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def stages(x: np.ndarray, repeat: int = 30) -> dict:
    """Median microseconds of the kernels' building blocks on one chunk ``x`` [H, T, D] bf16:
    what each whole-array pass costs, so a kernel's time reads as a sum of passes."""
    from kvwire.codecs import kernels as K

    v = x.astype(np.float32)
    v *= np.float32(448 / max(float(np.abs(v).max()), 1e-30))  # within fp8 range, as after the scale
    n = v.size
    codes = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    out = np.empty_like(x)
    s32 = np.ones(v.shape[:-1] + (v.shape[-1] // 32, 1), np.float32)
    blk = v.reshape(s32.shape[:-1] + (32,))
    tests = {
        "fp32 multiply in place (one pass)": lambda: np.multiply(v, np.float32(1.0), out=v),
        "fp32 -> bf16 into the output (ml_dtypes cast)": lambda: K.to_header(v, "bf16", out.dtype, out),
        "plain copy of the bf16 output": lambda: np.copyto(out, x),
        "fp8 codes -> fp32 x scale (fp8_times)": lambda: K.fp8_times(codes.reshape(v.shape), "f8_e4m3fn",
                                                                      np.float32(0.01)),
        "int4 codes -> fp32 (unpack_f32)": lambda: K.unpack_f32(codes[: n // 2], 4, n),
        "int8 codes -> fp32 (unpack_f32)": lambda: K.unpack_f32(codes, 8, n),
        "x scale per group of 32 channels (broadcast multiply)": lambda: np.multiply(blk, s32, out=blk),
        "max per group of 32 channels (group_extreme)": lambda: K.group_extreme(blk, 3, np.maximum),
        "fp32 -> fp8 codes (f32_to_fp8)": lambda: K.f32_to_fp8(v, "f8_e4m3fn", quant.FP8["f8_e4m3fn"][0]),
        "fp32 -> fp8 codes by ml_dtypes' cast (the previous encoder)": lambda: v.astype(quant.FP8["f8_e4m3fn"][0]),
        "np.take from a 256-entry table (a lookup per element)": lambda: np.take(
            np.arange(256, dtype=np.uint16), codes, out=out.reshape(-1).view(np.uint16)),
    }
    return {name: timed(fn, repeat)[0] * 1e6 for name, fn in tests.items()}


def paired(cache, r, old, rounds: int = 3) -> dict:
    """Old vs new ``quant.decode`` / ``quant.encode`` of every lossy chunk of ``r``, each chunk
    old then new back to back; medians of per-chunk seconds and of old/new ratios."""
    h = r.header
    jobs = []
    for i in range(r.chunk_count):
        c, k = r.info(i), int(r.records["reserved0"][i])
        if not k or h.codec_specs[k - 1].codec == "byteplane_zstd" or h.codec_specs[k - 1].needs_rotation_bit:
            continue  # the previous kernels predate revisions 1.2 and 1.3
        spec = h.codec_specs[k - 1]
        H, T, D = c.shape
        geo = (spec, h.dtype, H, D, c.token_start, c.token_start + T, *lossy_range(h, c.layer))
        lay, olay = quant.layout(*geo), old.layout(*geo)
        x = np.ascontiguousarray(cache.layers[c.layer][c.component][:, c.token_start : c.token_start + T])
        body = b"".join(bytes(memoryview(p).cast("B")) for p in quant.encode(spec, x, lay, h.dtype))
        out = np.empty_like(x)
        jobs.append((lambda s=spec, b=body, l=olay, o=out: old.decode(s, b, l, h.dtype, out=o),
                     lambda s=spec, b=body, l=lay, o=out: quant.decode(s, b, l, h.dtype, out=o),
                     lambda s=spec, x=x, l=olay: old.encode(s, x, l, h.dtype),
                     lambda s=spec, x=x, l=lay: quant.encode(s, x, l, h.dtype), x.nbytes))
    if not jobs:
        return {}
    res = {}
    for what, (io, inew) in {"decode": (0, 1), "encode": (2, 3)}.items():
        to, tn = [], []
        for _ in range(rounds):
            for j in jobs:
                t0 = time.perf_counter()
                j[io]()
                t1 = time.perf_counter()
                j[inew]()
                t2 = time.perf_counter()
                to.append(t1 - t0)
                tn.append(t2 - t1)
        nb = jobs[0][4]
        res[what] = {"old_gbs": nb / statistics.median(to) / 1e9, "new_gbs": nb / statistics.median(tn) / 1e9,
                     "speedup": statistics.median([a / b for a, b in zip(to, tn)]),
                     "new_us": statistics.median(tn) * 1e6}
    return res


def chunks_of(cache):
    h = cache.header
    for layer in cache.layers:
        for comp in ("k", "v"):
            x = layer[comp]
            for t0 in range(0, x.shape[1], h.chunk_tokens):
                yield np.ascontiguousarray(x[:, t0 : t0 + h.chunk_tokens]).tobytes()


def error_stats(cache, loaded) -> dict:
    num = den = 0.0
    worst = 0.0
    for a, b in zip(cache.layers, loaded.layers):
        for comp in ("k", "v"):
            x, y = a[comp].astype(np.float32), b[comp].astype(np.float32)
            num += float(((x - y) ** 2).sum())
            den += float((x ** 2).sum())
            worst = max(worst, float(np.abs(x - y).max()))
    return {"rel_rmse": (num / den) ** 0.5, "max_abs_err": worst}


def render(meta: dict, rows: list, base: list, out: Path) -> None:
    """results/codecs.md from the measurements (``--render`` redoes it from codecs.json)."""
    L, H, T, D = meta["shape"]
    load, end = meta["loadavg_at_start"], meta["loadavg_at_end"]
    lines = [
        "# Codec throughput (benchmarks/bench_codecs.py)", "",
        f"Synthetic bf16 cache {L} layers x {H} KV heads x {T} tokens x head_dim {D} "
        f"({meta['raw_bytes'] / 2**20:.0f} MiB), K with ~5% outlier channels 8x larger (kvwire.tools.synth; not a trained "
        f"model's cache). One thread; median of {meta['repeat']}. Load average {load[0]:.2f} at start, {end[0]:.2f} at "
        "end (a 2-core VM shared with other jobs: absolute numbers are pessimistic and vary by up to 2x between "
        "runs; compare rows of one run).", "",
        "GB/s count decoded (raw) bytes. *load*: `Reader.load()` (checksums verified, one allocation, chunks "
        "decoded into place); *body*: the codec alone over every stored body (fresh output per chunk); "
        "*native*: encode and `Reader.load(threads=1)` again with libkvwire's codecs on (the default; "
        "`kvwire plan` reads this column when native decoding is on). "
        f"CPU: {meta.get('cpu', '?')}. "
        f"A {LINK_GBPS} Gbps link carries {LINK_GBPS / 8:.2f} GB/s.", "",
        "| codec | ratio | encode GB/s | load GB/s | body decode GB/s | native encode | native load | rel. RMSE | max abs err |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r_ in rows:
        body = "—" if r_["codec"] == "raw" else f"{r_['decode_body_gbs']:.2f}"
        nat = (f"{r_['native_encode_gbs']:.2f} | {r_['native_load_gbs']:.2f}" if "native_load_gbs" in r_ else "— | —")
        lines.append(f"| `{r_['codec']}` | {r_['ratio']:.2f} | {r_['encode_gbs']:.2f} | {r_['load_gbs']:.2f} | "
                     f"{body} | {nat} | {r_['rel_rmse']:.2e} | {r_['max_abs_err']:.3g} |")
    lines += ["", "Baselines (each chunk's raw bytes as one frame, as the `zstd` codec stores them):", "",
              "| compressor | ratio | encode GB/s | decode GB/s |", "|---|---|---|---|"]
    for r_ in base:
        lines.append(f"| {r_['codec']} | {r_['ratio']:.2f} | {r_['encode_gbs']:.2f} | {r_['decode_body_gbs']:.2f} |")
    pr = [r_ for r_ in rows if r_.get("paired")]
    if pr:
        t_pass = meta["one_pass_us"]
        budget = meta["chunk_elements"] * 2 / (LINK_GBPS / 8 * 1e9) * 1e6
        lines += ["", f"Lossy kernels, paired against commit `{meta['previous'][:10]}` (the numpy codecs before the "
                  "native-speed work) on the same chunks, old then new back to back; median of per-chunk time ratios. *passes*: "
                  f"the new kernel's median chunk time over one in-place fp32 multiply of the chunk's "
                  f"{meta['chunk_elements']} elements ({t_pass:.0f} us in this run). A {LINK_GBPS} Gbps link "
                  f"leaves {budget:.0f} us per bf16 chunk, i.e. {budget / t_pass:.1f} such passes.", "",
                  "| codec | decode GB/s old | new | speedup | passes | encode GB/s old | new | speedup | passes |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r_ in pr:
            d, e = r_["paired"]["decode"], r_["paired"]["encode"]
            lines.append(f"| `{r_['codec']}` | {d['old_gbs']:.2f} | {d['new_gbs']:.2f} | {d['speedup']:.2f}x | "
                         f"{d['new_us'] / t_pass:.1f} | {e['old_gbs']:.2f} | {e['new_gbs']:.2f} | "
                         f"{e['speedup']:.2f}x | {e['new_us'] / t_pass:.1f} |")
    if meta.get("stages_us"):
        one = meta["one_pass_us"]
        lines += ["", f"Building blocks of the kernels on one chunk ({meta['chunk_elements']} elements), median "
                  "microseconds, and as multiples of the one-pass fp32 multiply measured at the start:", "",
                  "| pass | us | x one pass |", "|---|---|---|"]
        lines += [f"| {k} | {v:.0f} | {v / one:.1f} |" for k, v in meta["stages_us"].items()]
        st = {k.split(" (")[0]: v for k, v in meta["stages_us"].items()}
        cast, mul = st["fp32 -> bf16 into the output"], st["x scale per group of 32 channels"]
        dec_budget = meta["chunk_elements"] * 2 / (LINK_GBPS / 8 * 1e9) * 1e6
        enc_budget = meta["chunk_elements"] * 2 / 1e9 * 1e6
        floors = {  # the passes each kernel cannot skip, from the building blocks above
            "fp8 decode (codes -> fp32 x scale, cast)": st["fp8 codes -> fp32 x scale"] + cast,
            "int8 symmetric decode (codes -> fp32, x scale, cast)": st["int8 codes -> fp32"] + mul + cast,
            "int4 asymmetric decode (unpack, x scale, + zero, cast)": st["int4 codes -> fp32"] + 2 * mul + cast,
            "fp8 encode (fp32 -> fp8 codes only)": st["fp32 -> fp8 codes"],
            "int4-g32 asymmetric encode (group min and max only)": 2 * st["max per group of 32 channels"],
        }
        lines += ["", "What bounds the numpy kernels: a chunk costs at least the sum of its passes (the chunk "
                  f"is cache-resident: the in-place fp32 pass reads and writes 8 bytes an element, "
                  f"{meta['chunk_elements'] * 8 / one / 1e3:.0f} GB/s, several times what one core gets from DRAM; "
                  "a pass costs numpy's per-element loop, not memory bandwidth). The "
                  f"{LINK_GBPS / 8:.2f} "
                  f"GB/s decode goal leaves {dec_budget:.0f} us per chunk, the 1 GB/s encode goal {enc_budget:.0f} us:",
                  "", "| kernel | floor us (sum of its passes) | goal us | floor GB/s |", "|---|---|---|---|"]
        for k, v in floors.items():
            goal = enc_budget if "encode" in k else dec_budget
            lines.append(f"| {k} | {v:.0f} | {goal:.0f} | {meta['chunk_elements'] * 2 / v / 1e3:.2f} |")
    bp = next((r_ for r_ in rows if r_["codec"] == "byteplane"), None)
    if bp is not None:
        best = max((r_ for r_ in base if r_["codec"].startswith("zstd")), key=lambda r_: r_["ratio"], default=None)
        verdict = "meets" if bp["load_gbs"] >= LINK_GBPS / 8 else "is below"
        lines += ["", f"Lossless: `byteplane` reaches ratio {bp['ratio']:.2f}"
                  + (f" where no plain zstd level measured exceeds {best['ratio']:.2f}" if best else "")
                  + f" (lz4 does not compress bf16 at all); its one-core `Reader.load` of {bp['load_gbs']:.2f} GB/s "
                  f"(codec alone {bp['decode_body_gbs']:.2f} GB/s) {verdict} the {LINK_GBPS / 8:.2f} GB/s of a "
                  f"{LINK_GBPS} Gbps link at this load."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cache_shape_args(ap)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--codecs", default=",".join(CODECS))
    ap.add_argument("--out", default=str(HERE / "results" / "codecs"))
    ap.add_argument("--render", action="store_true", help="only rewrite codecs.md from codecs.json")
    ap.add_argument("--no-native", action="store_true", help="numpy only (default: also libkvwire when built)")
    ap.add_argument("--previous", default=PREVIOUS, help="commit whose lossy kernels are paired against (\"\": none)")
    a = ap.parse_args(argv)
    if a.render:
        d = json.loads(Path(a.out).with_suffix(".json").read_text())
        render(d["meta"], d["codecs"], d["baselines"], Path(a.out))
        return 0
    cache = synth_cache(a.layers, a.heads, a.head_dim, a.tokens)
    raw = sum(layer[c].nbytes for layer in cache.layers for c in ("k", "v"))
    load = os.getloadavg()
    rows = []
    lib = None if a.no_native else native.default_path()
    native.disable()  # the numpy columns measure the reference path, whatever the default is
    old = previous_quant(a.previous) if a.previous else None
    chunk_elems = a.heads * a.head_dim * cache.header.chunk_tokens
    t_pass = one_pass_s(chunk_elems)
    stage_us = stages(np.ascontiguousarray(cache.layers[0]["k"][:, : cache.header.chunk_tokens]))

    for name in a.codecs.split(","):
        size = 0

        def enc(name=name):
            nonlocal size
            size = sum(memoryview(b).nbytes for b in kvwire.iter_buffers(cache, codec=name))
            return size

        te = timed(enc, a.repeat)
        data = kvwire.encode(cache, codec=name)
        r = kvwire.open(data)
        td = timed(lambda r=r: r.load(), a.repeat)
        infos = [(r.info(i), int(r.records["reserved0"][i])) for i in range(r.chunk_count)]
        stored = [bytes(r.stored(i, False)[1]) for i in range(r.chunk_count)]
        h = r.header

        def body_only(h=h, infos=infos, stored=stored):
            for (c, spec), s in zip(infos, stored):
                if c.codec != "raw":
                    decode_chunk(h, c.codec, spec, s, c.raw_length, c.shape, c.layer, c.token_start)

        tb = timed(body_only, a.repeat)
        row = {"codec": name, "ratio": raw / size, "encode_gbs": raw / te[0] / 1e9, "load_gbs": raw / td[0] / 1e9,
               "decode_body_gbs": raw / tb[0] / 1e9, **error_stats(cache, r.load())}
        if lib is not None:  # the same two calls through libkvwire, one thread (`kvwire plan` reads them, native on)
            native.enable(lib)
            try:
                ne = timed(enc, a.repeat)
                nd = timed(lambda r=r: r.load(threads=1), a.repeat)
            finally:
                native.disable()
            row.update(native_encode_gbs=raw / ne[0] / 1e9, native_load_gbs=raw / nd[0] / 1e9)
        if old is not None:
            row["paired"] = paired(cache, r, old)
        rows.append(row)
        print(f"{name:16s} ratio {row['ratio']:5.2f}  encode {row['encode_gbs']:6.2f}  load {row['load_gbs']:6.2f}  "
              + (f"native encode {row['native_encode_gbs']:6.2f}  load {row['native_load_gbs']:6.2f}  " if lib else "")
              + f"body decode {row['decode_body_gbs']:6.2f} GB/s  rel.rmse {row['rel_rmse']:.2e}  "
              + "  ".join(f"{k} {v['old_gbs']:.2f}->{v['new_gbs']:.2f} x{v['speedup']:.2f}"
                          for k, v in row.get("paired", {}).items()), flush=True)
        r.close()

    # baselines: one frame per chunk of raw bytes
    chunks = list(chunks_of(cache))
    base = []
    try:
        import lz4.frame as lz4f
    except ImportError:
        lz4f = None
    comps = [(f"zstd level {lv}", zstandard.ZstdCompressor(level=lv, write_content_size=True).compress,
              zstandard.ZstdDecompressor().decompress) for lv in (-3, 1, 3, 9)]
    if lz4f is not None:
        comps += [("lz4 frame (default)", lz4f.compress, lz4f.decompress),
                  ("lz4 frame HC level 9", lambda b: lz4f.compress(b, compression_level=9), lz4f.decompress)]
    for label, c, d in comps:
        frames = [c(x) for x in chunks]
        te = timed(lambda: [c(x) for x in chunks], a.repeat)
        td = timed(lambda: [d(f) for f in frames], a.repeat)
        row = {"codec": label, "ratio": raw / sum(len(f) for f in frames), "encode_gbs": raw / te[0] / 1e9,
               "decode_body_gbs": raw / td[0] / 1e9}
        base.append(row)
        print(f"{label:16s} ratio {row['ratio']:5.2f}  encode {row['encode_gbs']:6.2f}  "
              f"decode {row['decode_body_gbs']:6.2f} GB/s", flush=True)

    meta = {"raw_bytes": raw, "shape": [a.layers, a.heads, a.tokens, a.head_dim], "repeat": a.repeat,
            "previous": a.previous if old is not None else None, "chunk_elements": chunk_elems,
            "one_pass_us": t_pass * 1e6, "stages_us": stage_us,
            "loadavg_at_start": load, "loadavg_at_end": os.getloadavg(),
            "cpu": cpu_model(), "native": str(lib) if lib else None,
            "python": platform.python_version(), "numpy": np.__version__, "zstandard": zstandard.__version__,
            "lz4": getattr(lz4f, "__version__", None) if lz4f else None}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "codecs": rows, "baselines": base}, indent=1) + "\n")
    render(meta, rows, base, out)
    print(f"wrote {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
