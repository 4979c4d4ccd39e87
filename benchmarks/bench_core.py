#!/usr/bin/env python3
"""kvwire core benchmark: save / open / load / probe against torch, safetensors, pickle
and the physical limits (memcpy, XXH3), all on the same synthetic KV cache.

    .venv/bin/python benchmarks/bench_core.py                       # full run (Llama-3-8B shape, 256 MiB)
    .venv/bin/python benchmarks/bench_core.py --layers 4 --repeat 3 # quick run
    .venv/bin/python benchmarks/bench_core.py --profile load        # cProfile one kvwire op, no table

Writes benchmarks/results/core.md (the table printed to stdout) and core.json (raw
samples in ns, config, machine info). Each row is the median (and min) of --repeat
timed runs after one untimed warm-up. See benchmarks/README.md for what each row does.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import mmap
import os
import pickle
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import xxhash

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "python"))  # harmless when kvwire is installed editable

import kvwire
from _common import cache_shape_args
from kvwire.cache.encoder import iter_buffers
from kvwire.cache.writev import write_all
from kvwire.tools.synth import synth_cache

PROBE_BYTES = 64 << 10
MALLOC_TUNABLE = "glibc.malloc.mmap_threshold=131072"
COMPS = ("k", "v")


# ---------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------

def measure(fn, *, repeat, setup=None, teardown=None, check=None, inner=1):
    """Median/min of ``repeat`` samples after one warm-up sample.

    A sample is the mean over ``inner`` calls of ``fn(setup())``; only ``fn`` is timed.
    ``check(out)`` runs once, untimed, on the output of the last call (to prove the work
    was done); ``teardown(out)`` runs untimed after every call (frees, closes).
    """
    samples = []
    last_checked = False
    for rep in range(repeat + 1):
        total = 0
        gc.collect()
        for j in range(inner):
            arg = setup() if setup else None
            gc.disable()
            try:
                t0 = time.perf_counter_ns()
                out = fn(arg) if setup else fn()
                t1 = time.perf_counter_ns()
            finally:
                gc.enable()
            total += t1 - t0
            if check and rep == repeat and j == inner - 1:
                check(out)
                last_checked = True
            if teardown:
                teardown(out)
            del out
        if rep:  # rep 0 is the warm-up
            samples.append(total / inner)
    assert last_checked or not check
    return {"samples_ns": [int(s) for s in samples], "median_ns": int(statistics.median(samples)),
            "min_ns": int(min(samples)), "inner": inner}


def paired(ref, cand, *, repeat, setup_ref=None, setup_cand=None, check=None):
    """Alternating pairs: ``ref`` then ``cand`` back to back (after one untimed warm-up pair),
    so both sides of a pair run under the same machine load; returns the samples and the
    per-pair ratios cand/ref (their median is the figure reported). ``setup_*`` run untimed
    before each call and hand it their result; ``check(out)`` runs once on ``cand``'s last output."""
    def once(fn, setup):
        arg = setup() if setup else None
        gc.collect()
        gc.disable()
        try:
            t0 = time.perf_counter_ns()
            out = fn(arg) if setup else fn()
            t1 = time.perf_counter_ns()
        finally:
            gc.enable()
        return t1 - t0, out

    refs, cands = [], []
    for rep in range(repeat + 1):
        a, _ = once(ref, setup_ref)
        b, out = once(cand, setup_cand)
        if check and rep == repeat:
            check(out)
        del out
        if rep:
            refs.append(a)
            cands.append(b)
    ratios = [b / a for a, b in zip(refs, cands)]
    return {"ref_ns": refs, "cand_ns": cands, "ratios": [round(r, 4) for r in ratios],
            "median_ratio": statistics.median(ratios), "ref_median_ns": int(statistics.median(refs)),
            "cand_median_ns": int(statistics.median(cands))}


# ---------------------------------------------------------------------------------------
# Data and checks
# ---------------------------------------------------------------------------------------

def tensor_names(layers):
    return [f"layers.{i}.{c}" for i in range(layers) for c in COMPS]


def np_bytes(a) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def torch_bytes(t) -> np.ndarray:
    import torch

    return t.contiguous().view(torch.int16).numpy().reshape(-1).view(np.uint8)


def digest(arrays) -> int:
    """XXH3 of the concatenated bytes of numpy arrays / torch tensors, canonical order."""
    h = xxhash.xxh3_64()
    for a in arrays:
        h.update(np_bytes(a) if isinstance(a, np.ndarray) else torch_bytes(a))
    return h.intdigest()


def cache_arrays(cache):
    return [layer[c] for layer in cache.layers for c in COMPS]


def expect(want, what):
    def check(out):
        got = digest(what(out))
        if got != want:
            raise AssertionError(f"digest mismatch: {got:016x} != {want:016x}")
    return check


def drop_caches_note():
    return "page cache warm (each file is read once before timing, plus the untimed warm-up)"


def warm(path):
    buf = bytearray(16 << 20)
    with open(path, "rb") as f:
        while f.readinto(buf):
            pass


def rm(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# ---------------------------------------------------------------------------------------
# Machine info
# ---------------------------------------------------------------------------------------

def fs_of(path):
    """(mount point, fs type, device) holding ``path``, from /proc/mounts."""
    best = ("", "?", "?")
    p = os.path.realpath(path)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                inside = p == mnt or p.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best[0]):
                    best = (mnt, fstype, dev)
    except OSError:
        pass
    return best


def loadavg():
    try:
        return [float(x) for x in os.getloadavg()]
    except OSError:
        return [-1.0, -1.0, -1.0]


def cpu_busy(seconds=1.0):
    """Fraction of all CPUs busy over ``seconds`` while this process sleeps: other load."""
    def snap():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return v[3] + v[4], sum(v)  # idle + iowait, total
    try:
        i0, t0 = snap()
        time.sleep(seconds)
        i1, t1 = snap()
        return round(1 - (i1 - i0) / max(t1 - t0, 1), 3)
    except OSError:
        return -1.0


def cpu_snapshot():
    """(system busy CPU-seconds, this process's CPU-seconds, wall seconds)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        busy = (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        busy = float("nan")
    t = os.times()
    return busy, t.user + t.system + t.children_user + t.children_system, time.monotonic()


def other_cpu_share(a, b):
    """Share of the machine's CPU time used by other processes between two snapshots."""
    wall = (b[2] - a[2]) * (os.cpu_count() or 1)
    return round(max(0.0, ((b[0] - a[0]) - (b[1] - a[1])) / wall), 3) if wall > 0 else -1.0


def read_first(path):
    try:
        with open(path) as f:
            return f.readline().strip()
    except OSError:
        return "?"


def machine_info(tmpdir):
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = "?"
    try:
        with open("/proc/meminfo") as f:
            mem = f"{int(f.readline().split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    import ml_dtypes
    import safetensors
    import torch
    import zstandard

    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:
            return "?"

    mnt, fstype, dev = fs_of(tmpdir)
    return {
        "cpu": cpu, "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory": mem, "os": platform.platform(), "python": platform.python_version(),
        "numpy": np.__version__, "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "safetensors": safetensors.__version__, "xxhash": xxhash.VERSION, "zstandard": zstandard.__version__,
        "ml_dtypes": ml_dtypes.__version__, "kvwire": kvwire.__version__,
        "git": git("rev-parse", "--short", "HEAD") + (" (dirty)" if git("status", "--porcelain", "--", "python") else ""),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
        "transparent_hugepage": read_first("/sys/kernel/mm/transparent_hugepage/enabled"),
        "tmpdir": str(tmpdir), "filesystem": f"{fstype} on {dev} (mounted at {mnt})",
    }


# ---------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------

class Bench:
    def __init__(self, args, tmpdir):
        self.args, self.tmp = args, Path(tmpdir)
        self.rows: dict[str, dict] = {}
        self.extra: dict[str, object] = {}
        self.goals: list[dict] = []

    def row(self, key, label, res, *, nbytes, group, baseline=None, notes=""):
        res.update(label=label, bytes=nbytes, group=group, baseline=baseline, notes=notes)
        self.rows[key] = res
        ms = res["median_ns"] / 1e6
        print(f"  {label:<58} {ms:10.3f} ms  (min {res['min_ns'] / 1e6:.3f})", file=sys.stderr, flush=True)

    def run(self):
        a, R = self.args, self.args.repeat
        torch = __import__("torch")
        t0 = time.time()
        cache = synth_cache(a.layers, a.heads, a.head_dim, a.tokens, seed=a.seed)
        names = tensor_names(a.layers)
        arrays = cache_arrays(cache)
        N = sum(x.nbytes for x in arrays)
        ref = digest(arrays)
        self.extra.update(payload_bytes=N, reference_xxh3=f"{ref:016x}", chunk_tokens=cache.header.chunk_tokens)
        print(f"cache: {cache!r}, digest {ref:016x}, built in {time.time() - t0:.1f}s", file=sys.stderr)
        if a.goals_only:
            self.goals = goals(self, cache, arrays, ref, max(R, 11))
            return self.rows

        # ---- physical limits ----------------------------------------------------------
        print("physical limits", file=sys.stderr)
        flat = np.concatenate([np_bytes(x) for x in arrays])
        dst = np.zeros_like(flat)  # allocated and prefaulted outside timing
        self.row("memcpy_prefaulted", "numpy memcpy into prefaulted buffer (np.copyto)",
                 measure(lambda: np.copyto(dst, flat) or dst, repeat=R,
                         check=lambda out: assert_eq(xxhash.xxh3_64_intdigest(out), ref)),
                 nbytes=N, group="limits", baseline="memcpy_prefaulted")
        dst = None  # releases the buffer; rebound, not deleted, as the closures above name it

        def fresh():
            d = np.empty_like(flat)
            np.copyto(d, flat)
            return d
        self.row("memcpy_fresh", "numpy memcpy into fresh allocation (np.empty + copyto)",
                 measure(fresh, repeat=R, check=lambda out: assert_eq(xxhash.xxh3_64_intdigest(out), ref)),
                 nbytes=N, group="limits", baseline="memcpy_prefaulted")
        self.row("xxh3_mem", "xxhash.xxh3_64 over the payload in memory",
                 measure(lambda: xxhash.xxh3_64_intdigest(flat), repeat=R, check=lambda h: assert_eq(h, ref)),
                 nbytes=N, group="limits", baseline="memcpy_prefaulted")
        wpath = self.tmp / "raw.bin"

        def raw_write(p):
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                mv, done = memoryview(flat), 0
                while done < N:
                    done += os.write(fd, mv[done:])
            finally:
                os.close(fd)
            return p
        self.row("write_raw", "write(2) of the payload to a new file (page cache)",
                 measure(raw_write, setup=lambda: (rm(wpath), os.sync(), wpath)[2], repeat=R,
                         check=lambda p: assert_eq(xxhash.xxh3_64_intdigest(p.read_bytes()), ref)),
                 nbytes=N, group="limits", baseline="memcpy_prefaulted")
        warm(wpath)

        def raw_read():
            d = np.empty(N, np.uint8)
            with open(wpath, "rb", buffering=0) as f:
                got = f.readinto(d)
            assert got == N
            return d
        self.row("read_raw", "readinto(2) of the file into a fresh buffer (page cache warm)",
                 measure(raw_read, repeat=R, check=lambda d: assert_eq(xxhash.xxh3_64_intdigest(d), ref)),
                 nbytes=N, group="limits", baseline="memcpy_prefaulted")
        rm(wpath)
        flat = None
        self.goals = goals(self, cache, arrays, ref, max(R, 11))

        # ---- save ---------------------------------------------------------------------
        print("save", file=sys.stderr)
        kvw, kvz = self.tmp / "cache.kvw", self.tmp / "cache_zstd.kvw"
        pt, st, pk = self.tmp / "cache.pt", self.tmp / "cache.safetensors", self.tmp / "cache.pkl"
        tdict = {n: torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) for n, x in zip(names, arrays)}
        npdict = dict(zip(names, arrays))

        def before_write(path):
            def setup():
                rm(path)
                os.sync()  # no dirty backlog from the previous writer (untimed)
                return path
            return setup

        file_size = lambda p: os.path.getsize(p)
        self.row("kvwire_save", "kvwire.save (page cache, no fsync)",
                 measure(lambda p: kvwire.save(p, cache), setup=before_write(kvw), repeat=R),
                 nbytes=N, group="save", baseline="torch_save", notes=f"file {file_size(kvw)} B")
        def before_overwrite(path, write):
            def setup():
                if not path.exists():
                    write(path)
                os.sync()
                return path
            return setup
        self.row("kvwire_save_replace", "kvwire.save over an existing file (no fsync)",
                 measure(lambda p: kvwire.save(p, cache), setup=before_overwrite(kvw, lambda p: kvwire.save(p, cache)),
                         repeat=R),
                 nbytes=N, group="save", baseline="torch_save_replace",
                 notes="rename over the old file (ext4 auto_da_alloc starts writeback)")
        self.row("kvwire_save_fsync", "kvwire.save fsync=True (file + directory fsync)",
                 measure(lambda p: kvwire.save(p, cache, fsync=True), setup=before_write(kvw), repeat=R),
                 nbytes=N, group="save", baseline="torch_save")
        self.row("kvwire_save_zstd", 'kvwire.save codec="zstd" (level 3)',
                 measure(lambda p: kvwire.save(p, cache, codec="zstd"), setup=before_write(kvz), repeat=R),
                 nbytes=N, group="save", baseline="torch_save")
        zsize = file_size(kvz)
        self.extra.update(kvwire_file_bytes=file_size(kvw), kvwire_zstd_file_bytes=zsize,
                          zstd_size_ratio=file_size(kvw) / zsize)
        self.rows["kvwire_save_zstd"]["notes"] = (f"file {zsize} B = {zsize / file_size(kvw):.3f} of raw "
                                                  f"(ratio {file_size(kvw) / zsize:.3f}x)")

        def torch_save(p):
            torch.save(tdict, p)
        self.row("torch_save", "torch.save(dict of bf16 tensors)",
                 measure(torch_save, setup=before_write(pt), repeat=R),
                 nbytes=N, group="save", baseline="torch_save", notes=f"file {file_size(pt)} B")

        self.row("torch_save_replace", "torch.save over an existing file",
                 measure(torch_save, setup=before_overwrite(pt, torch_save), repeat=R),
                 nbytes=N, group="save", baseline="torch_save", notes="truncate + rewrite in place")

        from safetensors.torch import load_file, safe_open, save_file
        self.row("st_save", "safetensors.torch.save_file",
                 measure(lambda p: save_file(tdict, str(p)), setup=before_write(st), repeat=R),
                 nbytes=N, group="save", baseline="torch_save", notes=f"file {file_size(st)} B")

        def pickle_save(p):
            data = pickle.dumps(npdict, protocol=5)
            with open(p, "wb") as f:
                f.write(data)
        self.row("pickle_save", "pickle.dumps(numpy dict, protocol 5) + file write",
                 measure(pickle_save, setup=before_write(pk), repeat=R),
                 nbytes=N, group="save", baseline="torch_save", notes=f"file {file_size(pk)} B")
        os.sync()
        tdict = npdict = None

        # the zstd file round-trips (untimed)
        assert_eq(digest(cache_arrays(kvwire.load(kvz))), ref)
        # memcpy / XXH3 with the file mapped: what the readers are up against
        warm(kvw)

        def xxh3_mmap():
            with open(kvw, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                return xxhash.xxh3_64_intdigest(m)
        kvw_digest = xxhash.xxh3_64_intdigest(kvw.read_bytes())
        self.row("xxh3_mmap", "xxhash.xxh3_64 over an mmap of the kvwire file (map+hash)",
                 measure(xxh3_mmap, repeat=R, check=lambda h: assert_eq(h, kvw_digest)),
                 nbytes=file_size(kvw), group="limits", baseline="memcpy_prefaulted")
        cache = arrays = None

        # ---- load (full copy into process memory) ------------------------------------
        print(f"load ({drop_caches_note()})", file=sys.stderr)
        for p in (kvw, pt, st, pk):
            warm(p)
        kv_check = expect(ref, lambda c: cache_arrays(c))
        for verify in (True, False):
            for backend in ("numpy", "torch"):
                key = f"kvwire_load_{backend}" + ("" if verify else "_noverify")
                label = f"kvwire.load verify={verify} backend={backend}"
                self.row(key, label,
                         measure(lambda v=verify, b=backend: kvwire.load(kvw, verify=v, backend=b), repeat=R,
                                 check=kv_check),
                         nbytes=N, group="load", baseline="torch_load")

        by_name = lambda d: [d[n] for n in names]

        def eager(loader, path, label):
            """``loader`` as timed in the load group: if it hands back tensors backed by a
            mapping of the file (lazy), each is cloned so the row ends with the data in
            process memory, like kvwire.load. Decided once, untimed."""
            d = loader()
            lazy = mapped_from(path, d.values())
            del d
            if not lazy:
                return loader, label, False
            return (lambda: {k: v.clone() for k, v in loader().items()}), label + " + clone() each", True

        def st_open_all():
            with safe_open(str(st), framework="pt") as f:
                return {k: f.get_tensor(k) for k in f.keys()}
        lazy_rows = []
        for key, loader, path, label in [
            ("torch_load", lambda: torch.load(pt, weights_only=True), pt, "torch.load(weights_only=True)"),
            ("st_load_file", lambda: load_file(str(st)), st, "safetensors.torch.load_file"),
            ("st_safe_open", st_open_all, st, "safetensors safe_open + get_tensor(every tensor)"),
        ]:
            fn, lab, lazy = eager(loader, path, label)
            self.row(key, lab, measure(fn, repeat=R, check=expect(ref, by_name)), nbytes=N, group="load",
                     baseline="torch_load", notes="returns mmap-backed tensors; cloned to load" if lazy else "")
            if lazy:
                lazy_rows.append((key + "_lazy", loader, label + " as returned (mmap-backed, untouched)"))
        self.extra["lazy_loaders"] = [k for k, _, _ in lazy_rows]

        def pickle_load():
            with open(pk, "rb") as f:
                return pickle.loads(f.read())
        self.row("pickle_load", "file read + pickle.loads (protocol 5)",
                 measure(pickle_load, repeat=R, check=expect(ref, by_name)),
                 nbytes=N, group="load", baseline="torch_load")

        # ---- zero-copy open / probe ---------------------------------------------------
        print("open / probe", file=sys.stderr)

        def close_reader(r):
            r.close()
        self.row("kvwire_open", "kvwire.open(path) alone (mmap + index checks)",
                 measure(lambda: kvwire.open(kvw), repeat=R, inner=a.inner_fast, teardown=close_reader,
                         check=lambda r: assert_eq(r.chunk_count, len(names) * chunks_per(r))),
                 nbytes=N, group="open", baseline="torch_load")

        def open_views():
            return open_all_views(kvw, a.layers)

        def check_views(out):
            r, views = out
            assert all(isinstance(v, np.ndarray) and v.base is not None for v in views)
            per = chunks_per(r)
            layers = [np.concatenate(views[j * per:(j + 1) * per], axis=1) for j in range(len(names))]
            assert_eq(digest(layers), ref)

        def close_views(out):
            r, views = out
            views.clear()
            r.close()
        self.row("kvwire_open_views", "kvwire.open + r.chunk(verify=False) view of every chunk",
                 measure(open_views, repeat=R, inner=a.inner_fast, check=check_views, teardown=close_views),
                 nbytes=N, group="open", baseline="torch_load")
        self.row("torch_load_mmap", "torch.load(mmap=True, weights_only=True) (lazy, untouched)",
                 measure(lambda: torch.load(pt, mmap=True, weights_only=True), repeat=R, check=expect(ref, by_name)),
                 nbytes=N, group="open", baseline="torch_load")
        for key, loader, label in lazy_rows:
            self.row(key, label, measure(loader, repeat=R, check=expect(ref, by_name)), nbytes=N, group="open",
                     baseline="torch_load")

        with open(kvw, "rb") as f:
            first = f.read(PROBE_BYTES)
        self.row("kvwire_probe", f"kvwire.probe(first {PROBE_BYTES >> 10} KiB)",
                 measure(lambda: kvwire.probe(first), repeat=R, inner=a.inner_probe,
                         check=lambda h: assert_eq(h.token_count, a.tokens)),
                 nbytes=None, group="open", baseline="kvwire_open")
        return self.rows


def goals(bench, cache, arrays, ref, pairs):
    """The fast paths' goals, each a paired comparison in this one run (``paired``):
    kvwire.save against write(2) of the same bytes and against safetensors' save_file, with
    the bounds of the save: XXH3 of the bytes, one memcpy of them (the page-cache copy's share
    of write(2)) and write_all of save's own buffer list with the checksums already computed;
    checksummed loads into caller buffers (prefaulted, as an engine's) against XXH3 over the
    same bytes; and, against XXH3 too, the copies that bound the load: one memcpy of the whole
    payload, and the same copy cut at the container's contiguous runs (one per chunk and head)."""
    import torch
    from safetensors.torch import save_file

    out, tmp = [], bench.tmp
    data = kvwire.encode(cache)
    flat = np.frombuffer(data, np.uint8)
    bench.extra.setdefault("kvwire_file_bytes", len(data))
    payload = np.concatenate([np_bytes(x) for x in arrays])
    N = payload.nbytes
    kvw, raw, st = tmp / "goal.kvw", tmp / "goal.bin", tmp / "goal.safetensors"
    names = tensor_names(len(cache.layers))
    tdict = {n: torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) for n, x in zip(names, arrays)}

    def fresh(path):
        def setup():
            rm(path)
            os.sync()  # no dirty backlog from the previous writer (untimed)
            return path
        return setup

    def write2(p):
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            mv, done = memoryview(flat), 0
            while done < len(flat):
                done += os.write(fd, mv[done:])
        finally:
            os.close(fd)
        return p

    def add(key, goal, res, *, kind, threshold, ref_label, cand_label, nbytes):
        # kind "time": cand time / ref time must be <= threshold ("<" when strict); "speed": ref/cand >= threshold
        r = res["median_ratio"] if kind == "time" else 1 / res["median_ratio"]
        ok = None if threshold is None else (r <= threshold if kind == "time" else r >= threshold)
        res.update(key=key, goal=goal, kind=kind, threshold=threshold, ratio=r, ok=ok, ref=ref_label, cand=cand_label,
                   bytes=nbytes)
        out.append(res)
        print(f"  {goal:<70} {r:6.3f}{'' if ok is None else (' PASS' if ok else ' MISS')}  ({ref_label} "
              f"{res['ref_median_ns'] / 1e6:.1f} ms, {cand_label} {res['cand_median_ns'] / 1e6:.1f} ms)",
              file=sys.stderr, flush=True)

    print("goals (paired: reference then kvwire, back to back)", file=sys.stderr)
    save_check = lambda p: assert_eq(xxhash.xxh3_64_intdigest(p.read_bytes()), xxhash.xxh3_64_intdigest(flat))
    add("save_vs_write", "kvwire.save time / write(2) of the same bytes (goal <= 1.1)",
        paired(write2, lambda p: (kvwire.save(p, cache), p)[1], repeat=pairs, setup_ref=fresh(raw),
               setup_cand=fresh(kvw), check=save_check),
        kind="time", threshold=1.1, ref_label="write(2)", cand_label="kvwire.save", nbytes=len(flat))
    add("save_vs_safetensors", "kvwire.save time / safetensors save_file (goal < 1)",
        paired(lambda p: save_file(tdict, str(p)), lambda p: (kvwire.save(p, cache), p)[1], repeat=pairs,
               setup_ref=fresh(st), setup_cand=fresh(kvw), check=save_check),
        kind="time", threshold=0.9999, ref_label="save_file", cand_label="kvwire.save", nbytes=N)
    add("hash_vs_write", "XXH3 of the file's bytes / write(2) of them (one core: save >= 1 + this)",
        paired(write2, lambda: xxhash.xxh3_64_intdigest(flat), repeat=pairs, setup_ref=fresh(raw)),
        kind="time", threshold=None, ref_label="write(2)", cand_label="XXH3", nbytes=len(flat))
    dst_file = np.zeros_like(flat)  # prefaulted: the copy alone, no page faults
    add("memcpy_vs_write", "limit: memcpy of the file's bytes (prefaulted) / write(2) of them (the copy's share)",
        paired(write2, lambda: np.copyto(dst_file, flat), repeat=pairs, setup_ref=fresh(raw)),
        kind="time", threshold=None, ref_label="write(2)", cand_label="memcpy", nbytes=len(flat))
    buffers = list(iter_buffers(cache))  # checksums done before timing: the buffer-list write alone

    def writev_buffers(p):
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            write_all(fd, buffers)
        finally:
            os.close(fd)
        return p
    add("writev_vs_write", "limit: write_all of save's buffer list, checksums precomputed / write(2)",
        paired(write2, writev_buffers, repeat=pairs, setup_ref=fresh(raw), setup_cand=fresh(kvw), check=save_check),
        kind="time", threshold=None, ref_label="write(2)", cand_label="write_all", nbytes=len(flat))
    buffers = None
    rm(raw), rm(st), rm(kvw)
    os.sync()

    kvwire.save(kvw, cache)
    warm(kvw)
    outs = [{c: np.empty_like(layer[c]) for c in COMPS} for layer in cache.layers]
    for o in outs:  # caller buffers: allocated and touched once, like an engine's
        for x in o.values():
            x.view(np.uint8).fill(0)
    out_check = lambda _: assert_eq(digest([o[c] for o in outs for c in COMPS]), ref)
    hash_ref = lambda: xxhash.xxh3_64_intdigest(payload)

    def layers_out(verify=True):
        with kvwire.open(kvw) as r:
            for i, o in enumerate(outs):
                r.layer(i, out=o, verify=verify)

    add("load_out_vs_xxh3", "open + layer(i, out=caller buffers) every layer, checksums, speed / XXH3 (goal >= 0.7)",
        paired(hash_ref, layers_out, repeat=pairs, check=out_check),
        kind="speed", threshold=0.7, ref_label="XXH3", cand_label="layer(out=)", nbytes=N)
    add("load_out_noverify_vs_xxh3", "the same without checksums (verify=False), speed / XXH3",
        paired(hash_ref, lambda: layers_out(False), repeat=pairs, check=out_check),
        kind="speed", threshold=None, ref_label="XXH3", cand_label="layer(out=, verify=False)", nbytes=N)
    dst = np.zeros_like(payload)
    add("memcpy_vs_xxh3", "limit: one memcpy of the payload into a prefaulted buffer, speed / XXH3",
        paired(hash_ref, lambda: np.copyto(dst, payload), repeat=pairs),
        kind="speed", threshold=None, ref_label="XXH3", cand_label="memcpy", nbytes=N)
    with kvwire.open(kvw) as r:
        runs = [(np.frombuffer(r.buffer, np.uint16, c.raw_length // 2, c.offset).reshape(c.shape),
                 outs[c.layer][c.component].view(np.uint16), c.token_start, c.token_count)
                for c in map(r.info, range(r.chunk_count))]

        def piecewise():
            for src, d, a, n in runs:
                d[:, a : a + n, :] = src
        add("runs_vs_xxh3", "limit: the same copy in the container's runs (chunk x head), speed / XXH3",
            paired(hash_ref, piecewise, repeat=pairs, check=out_check),
            kind="speed", threshold=None, ref_label="XXH3", cand_label="copy per run", nbytes=N)
    rm(kvw)
    h = cache.header
    bench.extra["contiguous_run_bytes"] = h.chunk_tokens * h.arch.layers[0].head_dim_k * 2
    return out


def open_all_views(path, layers):
    r = kvwire.open(path)
    return r, [r.chunk(layer, c, i, verify=False)
               for layer in range(layers) for c in COMPS for i in range(r.num_chunks(layer, c))]


def mapped_from(path, tensors) -> int:
    """How many of ``tensors`` point into a mapping of ``path`` (i.e. are lazy, mmap-backed)."""
    real, spans = os.path.realpath(path), []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip() == real:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                spans.append((lo, hi))
    return sum(any(lo <= t.data_ptr() < hi for lo, hi in spans) for t in tensors)


def chunks_per(r):
    return r.num_chunks(0, "k")


def assert_eq(got, want):
    if got != want:
        raise AssertionError(f"{got!r} != {want!r}")


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------

GROUPS = [
    ("limits", "Physical limits"),
    ("save", "Save (ratio = torch.save time / this time)"),
    ("load", "Load into process memory (ratio = torch.load time / this time)"),
    ("open", "Zero-copy open and probe (ratio = baseline time / this time)"),
]
SHORT = {"memcpy_prefaulted": "memcpy", "torch_save": "torch.save", "torch_save_replace": "torch.save over existing", "torch_load": "torch.load",
         "kvwire_open": "kvwire.open"}
ZERO_COPY = {"kvwire_open", "kvwire_open_views", "torch_load_mmap", "kvwire_probe", "torch_load_lazy",
             "st_load_file_lazy", "st_safe_open_lazy"}


def gbps(row):
    return row["bytes"] / row["median_ns"] if row["bytes"] else None  # bytes/ns == GB/s


def fmt_ms(ns):
    ms = ns / 1e6
    return f"{ms:.4f}" if ms < 1 else f"{ms:.1f}" if ms >= 100 else f"{ms:.2f}"


def targets(rows):
    g = lambda k: rows[k]["median_ns"]
    rate = lambda k: gbps(rows[k])
    out = []

    def t(name, ok, value):
        out.append({"target": name, "pass": bool(ok), "value": value})
    t("open <= 1 ms", g("kvwire_open") <= 1e6,
      f"{g('kvwire_open') / 1e6:.3f} ms (open + every chunk view: {g('kvwire_open_views') / 1e6:.3f} ms)")
    t("open >= 100x faster than plain torch.load", g("torch_load") / g("kvwire_open") >= 100,
      f"{g('torch_load') / g('kvwire_open'):.0f}x")
    t("load() into fresh memory with checksums >= 0.7x XXH3 throughput", rate("kvwire_load_numpy") >= 0.7 * rate("xxh3_mem"),
      f"{rate('kvwire_load_numpy'):.2f} GB/s = {rate('kvwire_load_numpy') / rate('xxh3_mem'):.2f}x of "
      f"{rate('xxh3_mem'):.2f} GB/s (in-memory XXH3)")
    t("save (page cache, no fsync) >= 0.6x memcpy", rate("kvwire_save") >= 0.6 * rate("memcpy_prefaulted"),
      f"{rate('kvwire_save'):.2f} GB/s = {rate('kvwire_save') / rate('memcpy_prefaulted'):.2f}x of "
      f"{rate('memcpy_prefaulted'):.2f} GB/s (prefaulted memcpy)")
    t("save >= 6x faster than torch.save", g("torch_save") / g("kvwire_save") >= 6,
      f"{g('torch_save') / g('kvwire_save'):.2f}x")
    t("probe <= 100 us", g("kvwire_probe") <= 100e3, f"{g('kvwire_probe') / 1e3:.1f} us")
    return out


def render(rows, info, cfg, extra, tgts, goal_rows=()):
    L = []
    L.append("# kvwire core benchmark\n")
    L.append(f"Cache: {cfg['layers']} layers x {cfg['heads']} KV heads x head_dim {cfg['head_dim']} x "
             f"{cfg['tokens']} tokens, bf16, K and V = {extra['payload_bytes']} B "
             f"({extra['payload_bytes'] / 2**20:.0f} MiB); kvwire chunk_tokens {extra['chunk_tokens']}, "
             f"file {extra['kvwire_file_bytes']} B. Synthetic data, seed {cfg['seed']}.  ")
    L.append(f"Timing: median of {cfg['repeat']} runs after 1 warm-up (min also shown); "
             f"sub-ms rows average {cfg['inner_fast']} (open) / {cfg['inner_probe']} (probe) calls per run. "
             "GB/s = payload bytes / median time (1 GB = 1e9 B).  ")
    L.append(f"Files: {info['tmpdir']} ({info['filesystem']}), not /dev/shm. Saves: target deleted (kept for the "
             "\"over an existing file\" rows) and `os.sync()` before each run (untimed); no fsync unless stated. Loads: "
             f"{drop_caches_note()}. Every result is checked once against an XXH3 of the source data.\n")
    L.append(f"Machine: {info['cpu']}, {info['usable_cores']} usable cores ({info['logical_cores']} logical), "
             f"{info['memory']} RAM, {info['os']}; other processes used "
             f"{info['cpu_busy_before']:.0%} of the CPUs just before the run and {info['cpu_other_during']:.0%} during it"
             f"{' (CONTAMINATED: re-run on an idle machine)' if info['cpu_other_during'] > 0.05 else ''}.  ")
    L.append(f"Memory: GLIBC_TUNABLES={info['glibc_tunables'] or '(unset)'} "
             f"({'every large allocation is fresh pages: loads pay page faults' if MALLOC_TUNABLE in info['glibc_tunables'] else 'adaptive malloc: loads may reuse faulted pages'}); "
             f"transparent hugepages: {info['transparent_hugepage']}.  ")
    L.append(f"Python {info['python']}, numpy {info['numpy']}, torch {info['torch']} ({info['torch_threads']} threads), "
             f"safetensors {info['safetensors']}, xxhash {info['xxhash']}, zstandard {info['zstandard']}, "
             f"kvwire {info['kvwire']} @ {info['git']}.\n")
    if goal_rows:
        L.append("## Goals of the fast paths (paired: reference then kvwire back to back, median of the pair ratios)\n")
        L.append("| goal | ratio | result | reference median ms | kvwire median ms | pair ratios |")
        L.append("|---|---:|---|---:|---:|---|")
        for g in goal_rows:
            verdict = "-" if g["ok"] is None else "PASS" if g["ok"] else "MISS"
            L.append(f"| {g['goal']} | {g['ratio']:.3f} | {verdict} | {g['ref']} {g['ref_median_ns'] / 1e6:.1f} | "
                     f"{g['cand']} {g['cand_median_ns'] / 1e6:.1f} | "
                     f"{', '.join(f'{x:.2f}' for x in sorted(r if g['kind'] == 'time' else 1 / r for r in g['ratios']))} |")
        L.append(f"\nSpeed ratios are reference time / kvwire time, time ratios the inverse. Caller buffers: "
                 f"numpy arrays allocated and touched before timing; the container's contiguous runs are "
                 f"{extra.get('contiguous_run_bytes', 0) >> 10} KiB (one chunk of one head).\n")
        L.append("## All rows\n" if rows else "")
    if not rows:  # --goals-only
        return "\n".join(L) + "\n"
    L.append("| operation | time ms (median) | min ms | GB/s | ratio | vs | notes |")
    L.append("|---|---:|---:|---:|---:|---|---|")
    for group, title in GROUPS:
        L.append(f"| **{title}** | | | | | | |")
        for key, r in rows.items():
            if r["group"] != group:
                continue
            rate = gbps(r)
            gb = "-" if rate is None or key in ZERO_COPY else f"{rate:.2f}"
            base = r["baseline"]
            ratio = rows[base]["median_ns"] / r["median_ns"] if base in rows else None
            L.append(f"| {r['label']} | {fmt_ms(r['median_ns'])} | {fmt_ms(r['min_ns'])} | {gb} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}x'} | {SHORT.get(base, base) if base in rows else '-'}"
                     f" | {r['notes']} |")
    L.append("\n## Targets\n")
    L.append("| target | result | measured |")
    L.append("|---|---|---|")
    for t in tgts:
        L.append(f"| {t['target']} | {'PASS' if t['pass'] else 'MISS'} | {t['value']} |")
    return "\n".join(L) + "\n"


# ---------------------------------------------------------------------------------------

def profile(args, tmpdir, what):
    import cProfile
    import pstats

    cache = synth_cache(args.layers, args.heads, args.head_dim, args.tokens, seed=args.seed)
    p = Path(tmpdir) / "cache.kvw"
    kvwire.save(p, cache)
    warm(p)
    with open(p, "rb") as f:
        first = f.read(PROBE_BYTES)
    ops = {
        "save": lambda: kvwire.save(p, cache),
        "save_zstd": lambda: kvwire.save(Path(tmpdir) / "z.kvw", cache, codec="zstd"),
        "load": lambda: kvwire.load(p),
        "load_noverify": lambda: kvwire.load(p, verify=False),
        "load_torch": lambda: kvwire.load(p, backend="torch"),
        "open": lambda: [kvwire.open(p).close() for _ in range(args.inner_fast)],
        "open_views": lambda: [open_all_views(p, args.layers)[0].close() for _ in range(args.inner_fast)],
        "probe": lambda: [kvwire.probe(first) for _ in range(args.inner_probe)],
    }
    ops[what]()
    pr = cProfile.Profile()
    pr.enable()
    ops[what]()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(15)
    print(s.getvalue())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cache_shape_args(ap)
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per row (after 1 warm-up)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch.set_num_threads (default: torch's own default); recorded in the report")
    ap.add_argument("--inner-fast", type=int, default=20, help="calls averaged per run for kvwire.open rows")
    ap.add_argument("--inner-probe", type=int, default=200, help="calls averaged per run for kvwire.probe")
    ap.add_argument("--tmpdir", default=None,
                    help="where files are written (default: a fresh dir under benchmarks/out/, same disk as the repo)")
    ap.add_argument("--results", default=str(HERE / "results"), help="directory for core.md / core.json")
    ap.add_argument("--goals-only", action="store_true",
                    help="only the paired goal comparisons (save vs write(2) and save_file, load into caller buffers "
                         "vs XXH3), written to --results like a full run")
    ap.add_argument("--profile", choices=["save", "save_zstd", "load", "load_noverify", "load_torch", "open", "open_views", "probe"],
                    help="cProfile one kvwire operation (top 15 by own time) instead of benchmarking")
    ap.add_argument("--malloc", choices=["fresh", "default"], default="fresh",
                    help="fresh (default): re-exec with glibc's mmap threshold pinned at 128 KiB, so every large "
                         "allocation gets new pages and every load pays its page faults, run after run; default: "
                         "glibc's adaptive threshold (results depend on allocation history)")
    args = ap.parse_args(argv)
    if args.malloc == "fresh" and MALLOC_TUNABLE not in os.environ.get("GLIBC_TUNABLES", ""):
        env = dict(os.environ)
        env["GLIBC_TUNABLES"] = ":".join(filter(None, [env.get("GLIBC_TUNABLES"), MALLOC_TUNABLE]))
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *(sys.argv[1:] if argv is None else argv)],
                  env)

    base = Path(args.tmpdir) if args.tmpdir else HERE / "out"
    base.mkdir(parents=True, exist_ok=True)
    tmpdir = tempfile.mkdtemp(prefix="bench-core-", dir=base)
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    try:
        if args.profile:
            profile(args, tmpdir, args.profile)
            return 0
        info = machine_info(tmpdir)
        if info["filesystem"].startswith("tmpfs"):
            print(f"warning: {tmpdir} is on tmpfs: save/load numbers will not reflect a disk", file=sys.stderr)
        info["loadavg_start"], info["cpu_busy_before"] = loadavg(), cpu_busy()
        if info["cpu_busy_before"] > 0.1:
            print(f"warning: CPUs {info['cpu_busy_before']:.0%} busy before starting: another process is using "
                  "them; numbers will be noisy (torch's thread pool suffers most)", file=sys.stderr)
        b = Bench(args, tmpdir)
        snap0 = cpu_snapshot()
        rows = b.run()
        info["loadavg_end"], info["cpu_other_during"] = loadavg(), other_cpu_share(snap0, cpu_snapshot())
        if info["cpu_other_during"] > 0.05:
            print(f"warning: other processes used {info['cpu_other_during']:.0%} of the CPUs during the run: "
                  "numbers are contaminated, re-run on an idle machine", file=sys.stderr)
        cfg = {k: getattr(args, k) for k in ("layers", "heads", "head_dim", "tokens", "repeat", "seed",
                                             "inner_fast", "inner_probe")}
        tgts = targets(rows) if rows else []
        md = render(rows, info, cfg, b.extra, tgts, b.goals)
        print(md)
        out = Path(args.results)
        out.mkdir(parents=True, exist_ok=True)
        (out / "core.md").write_text(md)
        doc = {"schema": "kvwire-bench-core/1", "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "config": cfg, "machine": info, "extra": b.extra, "goals": b.goals, "rows": rows, "targets": tgts}
        (out / "core.json").write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
        print(f"wrote {out / 'core.md'} and {out / 'core.json'}", file=sys.stderr)
        return 0
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
