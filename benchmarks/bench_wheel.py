#!/usr/bin/env python3
"""Native speed from ``pip install``: the wheel as users get it, measured in a
fresh venv outside the repository against its own numpy path, safetensors and the limits.

    .venv/bin/python benchmarks/bench_wheel.py                    # build the wheel as `make wheel` does
    .venv/bin/python benchmarks/bench_wheel.py --wheel dist/kvwire-0.1.0-py3-none-manylinux_2_34_x86_64.whl

Steps: the wheel is built from this checkout with libkvwire required (``KVWIRE_BUILD_NATIVE=1``)
and repaired by auditwheel (libzstd and libxxhash copied in), unless ``--wheel`` names one;
a venv is made in a new temporary folder, the wheel and safetensors are installed into it
(dependencies from the package index pip is configured with), and ``wheel_probe.py`` runs
there from that folder (nothing of the checkout on its path; it checks that kvwire is the
installed one and native by default). Per codec (zstd and every preset) of a synthetic
bf16 cache (64 MiB by default): the container written on both paths (byte-identical?), then
rounds of ``kvwire.load`` on the numpy path (what ``KVWIRE_NATIVE=0`` selects), on the
default path (libkvwire, threads as ``load`` picks them) and on libkvwire with one thread,
alternating; outputs compared by digest. ``kvwire.save`` (the default raw codec) runs in
alternating rounds with safetensors' ``save_file`` of the same tensors into the same
folder. GB/s are decoded (raw) bytes over the median round; "x" is the median of per-round
ratios. Writes benchmarks/results/wheel.md and wheel.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _common import cpu_model

LOSSLESS = ("zstd", "byteplane")
GOAL_1T, GOAL_X, GOAL_X_CODECS, DONE = 1.25, 3.0, ("int8", "fp8-e4m3", "byteplane"), ("int8", "hadamard-lloyd4")


def sh(argv, **kw):
    return subprocess.run([str(a) for a in argv], check=True, **kw)


def build_wheel(tmp: Path) -> Path:
    """`make wheel`'s two steps, into ``tmp``: setup.py's platform wheel, then auditwheel."""
    env = {**os.environ, "KVWIRE_BUILD_NATIVE": "1"}
    sh([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp / "linux", ROOT],
       env=env, cwd=tmp)
    (linux,) = (tmp / "linux").glob("kvwire-*.whl")
    bin_dir = Path(sys.executable).parent
    sh([bin_dir / "auditwheel", "repair", "-w", tmp / "wheel", linux], cwd=tmp, capture_output=True,
       env={**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"})
    (wheel,) = (tmp / "wheel").glob("kvwire-*.whl")
    return wheel


def fresh_venv(tmp: Path, wheel: Path) -> Path:
    env_dir = tmp / "env"
    sh([sys.executable, "-m", "venv", "--without-pip", env_dir], cwd=tmp)
    py = env_dir / "bin" / "python"
    sh([sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", py, "install", "-q", wheel,
        "safetensors>=0.4"], cwd=tmp)
    return py


def med(xs) -> float:
    return statistics.median(xs)


def ratio(num, den) -> float:
    """Median of per-round ratios num[i] / den[i]."""
    return med([a / b for a, b in zip(num, den)])


def summarize(d: dict) -> dict:
    raw = d["raw_bytes"]
    rows = []
    for name, r in d["rows"].items():
        t = r["load_s"]
        row = {"codec": name, "ratio": raw / r["stored_bytes"], "numpy_gbs": raw / med(t["numpy"]) / 1e9,
               "native_gbs": raw / med(t["native"]) / 1e9, "native_1t_gbs": raw / med(t["native_1t"]) / 1e9,
               "x": ratio(t["numpy"], t["native"]), "x_1t": ratio(t["numpy"], t["native_1t"]),
               "into_numpy_gbs": raw / med(r["into_s"]["numpy"]) / 1e9,
               "into_native_gbs": raw / med(r["into_s"]["native"]) / 1e9,
               "x_into": ratio(r["into_s"]["numpy"], r["into_s"]["native"]),
               "encode_numpy_gbs": raw / med(r["encode_s"]["numpy"]) / 1e9,
               "encode_native_gbs": raw / med(r["encode_s"]["native"]) / 1e9,
               "same": r["same_file"] and r["same_tensors"]}
        if name not in LOSSLESS:
            row["goal_1t"] = row["native_1t_gbs"] >= GOAL_1T
        if name in GOAL_X_CODECS:
            row["goal_x"] = row["x"] >= GOAL_X
        rows.append(row)
    s = d["save_s"]
    save = {"writev_gbs": raw / med(s["writev"]) / 1e9, "x_writev": ratio(s["writev"], s["kvwire"]),
            "safetensors_gbs": raw / med(s["safetensors"]) / 1e9, "kvwire_gbs": raw / med(s["kvwire"]) / 1e9,
            "kvwire_numpy_gbs": raw / med(s["kvwire_numpy"]) / 1e9, "x": ratio(s["safetensors"], s["kvwire"]),
            "x_numpy": ratio(s["safetensors"], s["kvwire_numpy"])}
    n = d["save_new_s"]
    save.update(new_writev_gbs=raw / med(n["writev"]) / 1e9, new_safetensors_gbs=raw / med(n["safetensors"]) / 1e9,
                new_kvwire_gbs=raw / med(n["kvwire"]) / 1e9, new_x=ratio(n["safetensors"], n["kvwire"]),
                new_x_writev=ratio(n["writev"], n["kvwire"]))
    save["goal"] = save["x"] >= 1.0 and save["new_x"] >= 1.0
    limits = {k: raw / med(v) / 1e9 for k, v in d["limits_s"].items()}
    by = {r["codec"]: r for r in rows}
    done = all(c in by and by[c]["x"] >= GOAL_X and by[c]["same"] for c in DONE)
    done_into = all(c in by and by[c]["x_into"] >= GOAL_X and by[c]["same"] for c in DONE)
    return {"rows": rows, "save": save, "limits": limits, "done": done, "done_into": done_into}


def yes(b) -> str:
    return "yes" if b else "**no**"


def render(meta: dict, s: dict, out: Path) -> None:
    L = ["# Native speed from the installed wheel", "",
         f"{meta['wheel']}, installed in a fresh venv outside the repository ({meta['status']}). "
         f"{meta['mib']:.0f} MiB synthetic bf16 cache ({meta['shape']}), {meta['rounds']} alternating rounds, "
         f"median. {meta['cpu']}, {meta['cpus']} CPUs, Python {meta['python']}, numpy {meta['numpy']}; load average "
         f"at start {meta['load']}; {meta['seconds']:.0f} s. *numpy*: `kvwire.load` with libkvwire off (what "
         "`KVWIRE_NATIVE=0` selects); *native*: the default path (libkvwire, one thread per CPU); *native 1t*: "
         "`threads=1` (all three into fresh tensors, as `kvwire.load` returns them); *into*: `Reader.layer(i, out=)` "
         "into buffers allocated and touched once, an engine's way, numpy then default path. GB/s are decoded bytes "
         "over the median round (checksums verified); x is the median of per-round ratios. *same*: the container "
         "both paths write, and the tensors all three loads give, are byte-identical.", "",
         f"Goals: every lossy preset >= {GOAL_1T} GB/s on one core; int8, fp8-e4m3 and byteplane >= "
         f"{GOAL_X}x numpy; done when int8 and hadamard-lloyd4 are >= {GOAL_X}x numpy with identical bytes: "
         f"through `kvwire.load` **{'met' if s['done'] else 'not met'}**, into an engine's buffers "
         f"**{'met' if s['done_into'] else 'not met'}**.", "",
         "| codec | ratio | numpy GB/s | native GB/s | x | native 1t GB/s | x 1t | into: numpy | into: native | "
         "x into | same | encode numpy | encode native | goal 1 core | goal 3x |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in s["rows"]:
        L.append(f"| {r['codec']} | {r['ratio']:.2f} | {r['numpy_gbs']:.2f} | {r['native_gbs']:.2f} | {r['x']:.2f} | "
                 f"{r['native_1t_gbs']:.2f} | {r['x_1t']:.2f} | {r['into_numpy_gbs']:.2f} | "
                 f"{r['into_native_gbs']:.2f} | {r['x_into']:.2f} | {yes(r['same'])} | {r['encode_numpy_gbs']:.2f} | "
                 f"{r['encode_native_gbs']:.2f} | {yes(r['goal_1t']) if 'goal_1t' in r else '-'} | "
                 f"{yes(r['goal_x']) if 'goal_x' in r else '-'} |")
    v = s["save"]
    L += ["", "## kvwire.save against safetensors", "",
          f"The same tensors (bf16 bits as U16 for safetensors.numpy), the default raw codec, the same folder, "
          f"{meta['save_rounds']} alternating rounds, two ways: *replace* (each round replaces the file of the "
          "round before, as a cache rewritten in place: kvwire writes a new file and renames it over the old one, "
          "atomic; safetensors truncates and rewrites) and *new file* (each round a new name, the files removed "
          "between rounds outside the timing). x is the median of safetensors' time over kvwire's (> 1: kvwire "
          "faster). Goal: >= 1.0 both ways.", "",
          "| files | writev(2) of the tensors GB/s | safetensors save_file GB/s | kvwire.save GB/s | x | x writev | "
          "kvwire.save, numpy path GB/s | x |",
          "|---|---|---|---|---|---|---|---|",
          f"| replace | {v['writev_gbs']:.2f} | {v['safetensors_gbs']:.2f} | {v['kvwire_gbs']:.2f} | {v['x']:.2f} | "
          f"{v['x_writev']:.2f} | {v['kvwire_numpy_gbs']:.2f} | {v['x_numpy']:.2f} |",
          f"| new file | {v['new_writev_gbs']:.2f} | {v['new_safetensors_gbs']:.2f} | {v['new_kvwire_gbs']:.2f} | "
          f"{v['new_x']:.2f} | {v['new_x_writev']:.2f} | - | - |", "",
          f"Goal met: {yes(v['goal'])}.", "",
          "*writev(2)*: the tensors' bytes in one `os.writev` into a truncated file, the bound of any saver "
          "(x writev: its time over kvwire's).", "",
          "## Limits", "",
          "Of the decoded bytes, same run: a copy into fresh memory (page faults included, as a load's fresh "
          f"tensors) {s['limits']['copy_fresh']:.2f} GB/s; XXH3-64 (xxhash-python) {s['limits']['xxh3']:.2f} GB/s.",
          ""]
    out.write_text("\n".join(L))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", help="a built wheel (default: build one as make wheel does)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--save-rounds", type=int, default=15)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--codecs", default="", help="comma-separated (default: zstd and every preset)")
    ap.add_argument("--out", default=str(HERE / "results" / "wheel.md"))
    a = ap.parse_args(argv)
    t0, load = time.time(), os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="kvwire-bench-wheel-"))
    try:
        wheel = Path(a.wheel).resolve() if a.wheel else build_wheel(tmp)
        py = fresh_venv(tmp, wheel)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "KVWIRE_"))}
        p = sh([py, HERE / "wheel_probe.py", "--rounds", a.rounds, "--save-rounds", a.save_rounds,
                "--layers", a.layers, "--tokens", a.tokens,
                *(["--codecs", a.codecs] if a.codecs else [])], cwd=tmp, env=env, capture_output=True, text=True)
        d = json.loads(p.stdout)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the folder this run made, nothing else
    if not Path(d["info"]["kvwire"]).is_relative_to(tmp):
        raise SystemExit(f"kvwire was imported from {d['info']['kvwire']}, not the fresh venv")
    s = summarize(d)
    meta = {"wheel": wheel.name, "status": d["info"]["status"].split(",")[0] + ")", "cpus": d["info"]["cpus"],
            "numpy": d["info"]["numpy"], "cpu": cpu_model(), "python": sys.version.split()[0],
            "load": [round(x, 2) for x in load], "rounds": a.rounds, "save_rounds": a.save_rounds, "seconds": time.time() - t0,
            "mib": d["raw_bytes"] / 2**20, "shape": f"{a.layers} layers x 8 heads x {a.tokens} tokens x 128"}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    render(meta, s, out)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, **s, "raw": d}, indent=1))
    print(out.read_text())
    return 0 if s["done"] and s["done_into"] else 1


if __name__ == "__main__":
    sys.exit(main())
