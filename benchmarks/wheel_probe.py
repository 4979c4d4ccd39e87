#!/usr/bin/env python3
"""The measuring half of bench_wheel.py, run by the interpreter of a fresh venv that holds
only the installed wheel (and safetensors, the baseline): nothing from a checkout.

Prints one JSON object: per codec, load times on the default path (libkvwire, threads as
``kvwire.load`` picks them), on libkvwire with one thread, and on the numpy path (what
``KVWIRE_NATIVE=0`` selects: ``native.disable()`` at run time is the same switch), in
alternating rounds (numpy, native, native 1t, numpy, ...), with a digest of each path's
output; the same loads into buffers allocated once (``Reader.layer(i, out=)``, an engine's
way: no fresh memory per load); encode times both ways; ``kvwire.save`` against safetensors' ``save_file`` on
the same tensors; and the limits (a copy into fresh memory, XXH3 of the decoded bytes).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import xxhash

import kvwire
from kvwire.codecs import native
from kvwire.codecs.presets import PRESETS
from kvwire.tools.synth import synth_cache


def clock(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def digest(cache) -> str:
    h = hashlib.sha256()
    for layer in cache.layers:
        for c in sorted(layer):
            h.update(np.ascontiguousarray(layer[c]).view(np.uint8).tobytes())
    return h.hexdigest()


def into(path, outs) -> None:
    with kvwire.open(path) as r:
        for i, out in enumerate(outs):
            r.layer(i, out=out)


def paired(fns: dict, rounds: int) -> dict:
    """{name: [seconds per round]}: every round runs each fn once, in the given order."""
    for fn in fns.values():  # warm-up (first touch of the file, the library's tables)
        fn()
    out: dict = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            out[k].append(clock(fn))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--save-rounds", type=int, default=15, help="saves drift more than loads (page cache, ext4)")
    ap.add_argument("--codecs", default="", help="comma-separated (default: zstd and every preset)")
    a = ap.parse_args()
    lib = native.library()
    if lib is None:
        print(json.dumps({"error": f"not native by default: {native.status()}"}))
        return 1
    info = {"kvwire": kvwire.__file__, "status": native.status(), "cpus": len(os.sched_getaffinity(0)),
            "numpy": np.__version__}
    cache = synth_cache(a.layers, a.heads, a.head_dim, a.tokens, dtype="bf16")
    raw = sum(layer[c].nbytes for layer in cache.layers for c in ("k", "v"))
    codecs = a.codecs.split(",") if a.codecs else ["zstd", *PRESETS]
    on, off = (lambda: native.enable(lib)), native.disable
    outs = [{c: np.ones_like(layer[c]) for c in ("k", "v")} for layer in cache.layers]  # allocated and touched once
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in codecs:
            path, ref = Path(tmp) / f"{name}.kvw", Path(tmp) / f"{name}.numpy.kvw"
            enc = paired({"numpy": lambda: (off(), kvwire.save(ref, cache, codec=name)),
                          "native": lambda: (on(), kvwire.save(path, cache, codec=name))}, max(1, a.rounds // 2))
            same_file = path.read_bytes() == ref.read_bytes()
            off()
            d_numpy = digest(kvwire.load(path))
            on()
            d_native, d_1t = digest(kvwire.load(path)), digest(kvwire.load(path, threads=1))
            t = paired({"numpy": lambda: (off(), kvwire.load(path)),
                        "native": lambda: (on(), kvwire.load(path)),
                        "native_1t": lambda: (on(), kvwire.load(path, threads=1))}, a.rounds)
            # an engine's way: every layer into buffers it allocated (and touched) once
            t_into = paired({"numpy": lambda: (off(), into(path, outs)), "native": lambda: (on(), into(path, outs))},
                            a.rounds)
            on()
            rows[name] = {"stored_bytes": path.stat().st_size, "encode_s": enc, "load_s": t, "into_s": t_into,
                          "same_file": same_file, "same_tensors": d_numpy == d_native == d_1t}
            print(f"{name}: done", file=sys.stderr, flush=True)
        # kvwire.save (raw, the default codec) against safetensors' save_file, same tensors, same folder
        from safetensors.numpy import save_file

        tensors = {f"layers.{i}.{c}": np.ascontiguousarray(layer[c]).view(np.uint16)  # bf16 bits: safetensors.numpy
                   for i, layer in enumerate(cache.layers) for c in ("k", "v")}   # has no ml_dtypes bfloat16

        def writev(name="w.bin"):  # the bound of any saver: the tensors' bytes, one writev into a truncated file
            fd = os.open(os.path.join(tmp, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.writev(fd, [memoryview(x).cast("B") for x in tensors.values()])
            finally:
                os.close(fd)

        save = paired({"writev": lambda: writev(), "safetensors": lambda: save_file(tensors, Path(tmp) / "s.safetensors"),
                       "kvwire": lambda: (on(), kvwire.save(Path(tmp) / "s.kvw", cache)),
                       "kvwire_numpy": lambda: (off(), kvwire.save(Path(tmp) / "n.kvw", cache))}, a.save_rounds)
        # the same three writers, each round to a new name (a cache tier's new objects): nothing to replace
        new = {"writev": lambda k: writev(f"w{k}.bin"),
               "safetensors": lambda k: save_file(tensors, Path(tmp) / f"s{k}.safetensors"),
               "kvwire": lambda k: (on(), kvwire.save(Path(tmp) / f"k{k}.kvw", cache))}
        save_new: dict = {k: [] for k in new}
        for k in range(a.save_rounds + 1):  # round 0: warm-up
            for name, fn in new.items():
                t = clock(lambda fn=fn, k=k: fn(k))
                if k:
                    save_new[name].append(t)
            for f in Path(tmp).glob("[wsk][0-9]*"):  # outside the timing: the files this loop wrote
                f.unlink()
        on()
    flat = np.concatenate([np.ascontiguousarray(layer[c]).view(np.uint8).reshape(-1)
                           for layer in cache.layers for c in ("k", "v")])
    limits = paired({"copy_fresh": lambda: np.copyto(np.empty_like(flat), flat),
                     "xxh3": lambda: xxhash.xxh3_64_intdigest(flat)}, a.rounds)
    print(json.dumps({"info": info, "raw_bytes": raw, "rows": rows, "save_s": save, "save_new_s": save_new, "limits_s": limits}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
