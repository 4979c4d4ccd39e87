#!/usr/bin/env python3
"""libkvwire (c/) benchmark: open / validate / decode in C against memcpy and XXH3 over the
same bytes, and against the Python reference on the same file.

    .venv/bin/python benchmarks/bench_c.py                 # full run (the bench_core cache: 256 MiB bf16)
    .venv/bin/python benchmarks/bench_c.py --layers 4 --repeat 3   # quick run
    .venv/bin/python benchmarks/bench_c.py --baseline OLD/build/c/bench_c   # against another build

The container is the one benchmarks/bench_core.py measures (synth_cache, 32 layers x 8 KV
heads x head_dim 128 x 2048 tokens, bf16, chunk_tokens 256, raw, file form), written by
the Python reference (kvwire.save). build/c/bench_c times the C rows (median and min of
--repeat samples after one warm-up; open rows average --inner-open calls), this script
times kvwire.open / Reader.validate / kvwire.load on the same file, and writes
benchmarks/results/c.md (the table printed to stdout) and c.json (raw samples and config).
Goals: validate >= 0.8x XXH3, open in microseconds.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "python"))

import kvwire
from _common import cache_shape_args
from kvwire.tools.synth import synth_cache

BENCH = REPO / "build" / "c" / "bench_c"


def measure(fn, *, repeat, inner=1, teardown=None):
    samples = []
    for rep in range(repeat + 1):
        gc.collect()
        total = 0
        for _ in range(inner):
            gc.disable()
            try:
                t0 = time.perf_counter_ns()
                out = fn()
                t1 = time.perf_counter_ns()
            finally:
                gc.enable()
            total += t1 - t0
            if teardown:
                teardown(out)
            del out
        if rep:
            samples.append(total / inner)
    return {"median_ns": statistics.median(samples), "min_ns": min(samples), "samples_ns": samples, "inner": inner}


def machine():
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cc = subprocess.run(["gcc", "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    return {"cpu": cpu, "usable_cores": len(os.sched_getaffinity(0)), "platform": platform.platform(),
            "python": platform.python_version(), "gcc": cc[0] if cc else "?", "kvwire": kvwire.__version__}


def fmt_time(ns):
    if ns < 1e6:
        return f"{ns / 1e3:.1f} us"
    ms = ns / 1e6
    return f"{ms:.1f} ms" if ms >= 100 else f"{ms:.2f} ms"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cache_shape_args(ap)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per row (after 1 warm-up)")
    ap.add_argument("--inner-open", type=int, default=200, help="open calls averaged per C sample")
    ap.add_argument("--inner-open-py", type=int, default=20, help="kvwire.open calls averaged per Python sample")
    ap.add_argument("--tmpdir", default=None, help="where the container goes (default: benchmarks/out)")
    ap.add_argument("--results", default=str(HERE / "results"), help="directory for c.md / c.json")
    ap.add_argument("--no-build", action="store_true", help="use build/c/bench_c as it is")
    ap.add_argument("--baseline", metavar="BENCH_C", default=None,
                    help="another build's bench_c (an earlier commit's build/c/bench_c): both run in alternation, "
                         "--rounds times each, on the same file, and a table gives this build's speed against it")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds with --baseline")
    args = ap.parse_args(argv)

    if not args.no_build:
        subprocess.run(["make", "-C", str(REPO / "c"), "-j2", str(BENCH)], check=True, stdout=subprocess.DEVNULL)
    tmp_root = Path(args.tmpdir) if args.tmpdir else REPO / "benchmarks" / "out"
    tmp_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-c-", dir=tmp_root) as td:
        path = Path(td) / "cache.kvw"
        print(f"writing the cache ({args.layers}x{args.heads}x{args.head_dim}x{args.tokens} bf16) with kvwire.save",
              file=sys.stderr)
        cache = synth_cache(args.layers, args.heads, args.head_dim, args.tokens, seed=args.seed)
        kvwire.save(path, cache)
        del cache
        path.read_bytes()  # page cache warm

        print("C rows (build/c/bench_c)", file=sys.stderr)
        config, c_rows = run_bench(BENCH, path, args)
        baseline = None
        if args.baseline:  # alternate: baseline, this build, baseline, ... (both see the same load)
            print(f"baseline {args.baseline}: {args.rounds} alternating rounds", file=sys.stderr)
            pairs = [(run_bench(Path(args.baseline), path, args)[1], run_bench(BENCH, path, args)[1])
                     for _ in range(args.rounds)]
            baseline = {"path": args.baseline, "rounds": args.rounds,
                        "ratio": {k: statistics.median(old[k]["min_ns"] / new[k]["min_ns"] for old, new in pairs)
                                  for k in LABELS if all(k in old and k in new for old, new in pairs)}}

        print("Python rows (kvwire reference)", file=sys.stderr)
        py_rows = {
            "open_file": measure(lambda: kvwire.open(path), repeat=args.repeat, inner=args.inner_open_py,
                                 teardown=lambda r: r.close()),
        }

        def py_validate():
            with kvwire.open(path) as r:
                r.validate()
        py_rows["validate_file"] = measure(py_validate, repeat=args.repeat)
        py_rows["read_tensor_file"] = measure(lambda: kvwire.load(path, verify=True), repeat=args.repeat)
        py_rows["read_tensor_nocheck"] = measure(lambda: kvwire.load(path, verify=False), repeat=args.repeat)
        for key, nbytes in (("open_file", config["payload_bytes"]), ("validate_file", config["file_bytes"]),
                            ("read_tensor_file", config["payload_bytes"]),
                            ("read_tensor_nocheck", config["payload_bytes"])):
            py_rows[key]["bytes"] = nbytes

    info = machine()
    md = render(c_rows, py_rows, config, info, args)
    if baseline:
        md += "\n".join(["", f"Against `{baseline['path']}` ({baseline['rounds']} rounds, the two builds alternating on "
                          "the same file): this build's speed over the baseline's, median of the rounds' best-run "
                          "ratios (1.00x: as fast).", "", "| operation (C) | speed vs baseline |", "|---|---:|"]
                         + [f"| {LABELS[k][0]} | {r:.2f}x |" for k, r in baseline["ratio"].items()]) + "\n"
    print(md)
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "c.md").write_text(md)
    (out / "c.json").write_text(json.dumps({"config": config, "args": vars(args), "machine": info,
                                            "c": c_rows, "python": py_rows, "baseline": baseline}, indent=1) + "\n")
    return 0


def run_bench(binary: Path, path: Path, args) -> tuple[dict, dict]:
    """(config, rows by name) of one run of a bench_c binary on ``path``."""
    p = subprocess.run([str(binary), str(path), str(args.repeat), str(args.inner_open)], capture_output=True,
                       text=True, check=False)
    if p.returncode != 0:
        sys.exit(f"{binary} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.strip()]
    return lines[0]["config"], {r["name"]: r for r in lines[1:]}


LABELS = {
    "memcpy": ("memcpy of the container (prefaulted destination)", None),
    "xxh3": ("XXH3-64 over the container (libxxhash)", None),
    "open_buffer": ("kvw_open over a buffer in memory (+ kvw_close)", None),
    "open_file": ("kvw_open_file: mmap + open (+ kvw_close)", "kvwire.open(path) + close"),
    "validate_buffer": ("kvw_validate, buffer (every checksum, padding, frame)", None),
    "validate_file": ("kvw_open_file + kvw_validate (mmap)", "kvwire.open(path).validate()"),
    "read_tensor_buffer": ("kvw_open + kvw_read_tensor of every tensor, buffer", None),
    "read_tensor_file": ("kvw_open_file + kvw_read_tensor of every tensor (mmap)", "kvwire.load(path, verify=True)"),
    "read_tensor_nocheck": ("the same, skip_body_checksums (buffer)", "kvwire.load(path, verify=False)"),
    "stream_decoder": ("sans-IO decoder fed 1 MiB pieces (checksums)", None),
}


def render(c_rows, py_rows, config, info, args):
    gb = lambda r: r["bytes"] / r["median_ns"]  # bytes/ns == GB/s
    gbmin = lambda r: r["bytes"] / r["min_ns"]  # the best run: least disturbed by other load
    xxh = gbmin(c_rows["xxh3"])
    mem = gbmin(c_rows["memcpy"])
    L = ["# libkvwire (C) benchmark", ""]
    L.append(f"Cache: {args.layers} layers x {args.heads} KV heads x head_dim {args.head_dim} x {args.tokens} tokens, "
             f"bf16, raw, file form, chunk_tokens {config['chunk_tokens']} ({config['chunks']} chunks): payload "
             f"{config['payload_bytes']} B ({config['payload_bytes'] / 2**20:.0f} MiB), file {config['file_bytes']} B, "
             f"written by the Python reference (kvwire.save), the same cache as benchmarks/results/core.md.  ")
    L.append(f"Timing: median of {args.repeat} runs after 1 warm-up (min also shown); open rows average "
             f"{config['inner_open']} (C) / {args.inner_open_py} (Python) calls per run. Page cache warm; decode "
             "destinations prefaulted. GB/s = bytes / median time (1 GB = 1e9 B): the container's bytes for "
             "memcpy, XXH3, validate and the stream decoder, the payload for open and decode rows. The ratio "
             "columns compare best runs (min / min), which other load on the machine disturbs least.  ")
    L.append(f"Machine: {info['cpu']}, {info['usable_cores']} usable cores, {info['platform']}; {info['gcc']} -O2; "
             f"Python {info['python']}, kvwire {info['kvwire']}, libkvwire {config['library']}.")
    L += ["", "| operation (C) | median | min | GB/s | vs XXH3 | vs memcpy | Python reference | Python median | C speedup |",
          "|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for key, (label, py_label) in LABELS.items():
        r = c_rows.get(key)
        if r is None:
            continue
        is_open = key.startswith("open")
        rate = "" if is_open else f"{gb(r):.2f}"
        vx = "" if is_open else f"{gbmin(r) / xxh:.2f}x"
        vm = "" if is_open else f"{gbmin(r) / mem:.2f}x"
        py = py_rows.get(key) if py_label else None
        pyt = fmt_time(py["median_ns"]) if py else ""
        speed = f"{py['median_ns'] / r['median_ns']:.1f}x" if py else ""
        L.append(f"| {label} | {fmt_time(r['median_ns'])} | {fmt_time(r['min_ns'])} | {rate} | {vx} | {vm} | "
                 f"{py_label or ''} | {pyt} | {speed} |")
    v = c_rows["validate_buffer"]
    o = c_rows["open_file"]
    pv = c_rows["validate_vs_xxh3"]
    L += ["", "Paired runs (each sample runs the reference and then the operation back to back, so both see the "
          "same load; median of the per-pair speed ratios, with the range):", "",
          "| operation | reference | speed ratio (median) | range |", "|---|---|---:|---|"]
    for key, label, ref in (("validate_vs_xxh3", "kvw_validate (buffer)", "XXH3-64 over the container"),
                            ("read_tensor_vs_xxh3", "kvw_open + kvw_read_tensor of every tensor", "XXH3-64 over the container"),
                            ("read_tensor_nocheck_vs_memcpy", "the same, skip_body_checksums", "memcpy of the container")):
        p = c_rows[key]
        L.append(f"| {label} | {ref} | {p['ratio_median']:.2f}x | {p['ratio_min']:.2f}x - {p['ratio_max']:.2f}x |")
    L += ["", "Goals:", "",
          f"- validate >= 0.8x XXH3: kvw_validate {gbmin(v):.2f} GB/s, {pv['ratio_median']:.2f}x XXH3 in paired runs "
          f"(best runs: {gbmin(v) / xxh:.2f}x): " + ("met" if pv["ratio_median"] >= 0.8 else "NOT met"),
          f"- open in microseconds: kvw_open_file {o['median_ns'] / 1e3:.1f} us, kvw_open (buffer) "
          f"{c_rows['open_buffer']['median_ns'] / 1e3:.1f} us: " + ("met" if o["median_ns"] < 1e6 else "NOT met"),
          "", "Reproduce: `make bench-c` (or `.venv/bin/python benchmarks/bench_c.py`).", ""]
    return "\n".join(L)


if __name__ == "__main__":
    sys.exit(main())
