#!/usr/bin/env python3
"""GPU check of kvwire's device paths: throughput against a plain pinned copy, and bit-exactness.

    .venv/bin/python benchmarks/gpu_check.py                  # on a machine with a CUDA GPU
    .venv/bin/python benchmarks/gpu_check.py --tokens 1024    # smaller / quicker
    .venv/bin/python benchmarks/gpu_check.py --simulate       # dry run on the CPU (SimulatedStream)

Measures, on one synthetic cache (Llama-3-8B shape by default: 32 layers x 8 KV heads x
128, bf16) and reports GB/s of cache bytes (median of --repeat runs after a warm-up):

  baseline   pinned host tensor -> device, one copy_(non_blocking) + synchronize: the
             physical host->device rate every other row is compared with
  pageable   the same from ordinary (pageable) memory
  load       kvwire.load(bytes, device="cuda"): verify checksums, stage through the
             pinned ring, copy layer by layer on a side stream
  load-noverify / load-registered   the same without checksums / from an mmap'ed file
             registered with cudaHostRegister (no staging copy)
  load lossy fp8 / int8 / int4 / kivi2 containers: their lossy bodies cross the link and
             kvwire.codecs.torch_dequant decodes them on the device, against decoding on
             the host and copying decoded bytes; bit-exact with the numpy decoder, and the
             256 fp8 codes at scales giving subnormal and overflowing results
  scatter    decode a container straight into vLLM HND paged buffers on the GPU at
             shuffled block ids (ring + device scatter)
  offload    save from the GPU: engine blocks -> pinned offload ring (device->host), with
             the time allocate() spent waiting when planning 0 or --ahead pages ahead
  encode     container bytes produced from the ring (zero-copy bodies)
  vllm       the vLLM connector's device path (kvwire.integrations): vLLM 0.32's per-layer
             [blocks, heads, block_size, 2*head_dim] views on the GPU (KVCacheLayout LBHNC
             and the non-contiguous LBNHC view), chunks gathered from them and stored in
             a MemoryStore, then loaded layer by layer (LayerPipeline: a thread a layer
             ahead) and scattered into other device buffers at shuffled block ids

and checks bit-exactness of every path (bf16, f16, fp8 e4m3, f32 for load; the rest in
bf16) with NaN payloads included. Exit status: 0 when every check passed (or, without
--strict, when no GPU is present: it prints SKIP), 1 when a check failed, 2 with
--strict and no GPU. Results: a table on stdout and JSON in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python"))  # harmless when kvwire is installed editable

import numpy as np


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--ring-slots", type=int, default=4, help="slots of the staging ring")
    p.add_argument("--ahead", type=int, default=64, help="pages planned ahead of allocation in the offload row")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--simulate", action="store_true", help="run on the CPU with simulated asynchronous copies")
    p.add_argument("--strict", action="store_true", help="exit 2 instead of 0 when no GPU is present")
    p.add_argument("--out", default=str(Path(os.environ.get("OUT", HERE / "out")) / "gpu_check.json"))
    return p.parse_args(argv)


class Env:
    """Device, streams and pinned memory: real CUDA, or the CPU with SimulatedStream."""

    def __init__(self, args):
        import torch

        from kvwire.cache.cuda import CudaStream, SimulatedStream

        self.torch = torch
        self.simulated = args.simulate
        self.device = torch.device("cpu" if args.simulate else args.device)
        self._streams = []
        self._make = (lambda: SimulatedStream(0.0)) if args.simulate else (lambda: CudaStream(self.device))

    def stream(self):
        s = self._make()
        self._streams.append(s)
        return s

    def pinned(self, nbytes):
        t = self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=not self.simulated)
        return t

    def sync(self):
        if not self.simulated:
            self.torch.cuda.synchronize(self.device)

    def close(self):
        for s in self._streams:
            s.close()


def timed(env, fn, repeat):
    fn()  # warm-up (allocations, pinned pools)
    env.sync()
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        env.sync()
        out.append(time.perf_counter() - t)
    return out


def int_view(t):
    from kvwire.cache.cuda import int_view as iv

    return iv(t)


def same_bits(a, b) -> bool:
    torch = __import__("torch")
    a, b = int_view(a), int_view(b)
    if a.device != b.device:
        b = b.to(a.device)
    return a.shape == b.shape and bool(torch.equal(a, b))


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        print("SKIP: torch is not installed; nothing measured.")
        return 2 if args.strict else 0
    if not args.simulate and not torch.cuda.is_available():
        print("SKIP: no CUDA device (torch.cuda.is_available() is False); nothing measured. "
              "Use --simulate for a dry run of the same code on the CPU.")
        return 2 if args.strict else 0

    import kvwire
    from kvwire import layouts
    from kvwire.cache.cuda import HostRegistration, StagingRing
    from kvwire.cache.device_load import load_to_device
    from kvwire.tools.synth import synth_cache

    env = Env(args)
    dev = env.device
    rows, checks = [], {}

    def row(name, seconds, nbytes, note=""):
        med = statistics.median(seconds)
        rows.append({"row": name, "median_s": med, "min_s": min(seconds), "bytes": nbytes,
                     "gbps": nbytes / med / 1e9, "note": note, "samples_s": seconds})

    def check(name, ok):
        checks[name] = bool(ok)
        if not ok:
            print(f"FAIL: {name}", file=sys.stderr)

    def section(name, fn):
        """Run one part; an exception fails a check of its name and the run goes on."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported and counted as a failed check
            traceback.print_exc()
            checks[f"{name} (raised {type(exc).__name__})"] = False

    cache = synth_cache(args.layers, args.heads, args.head_dim, args.tokens, chunk_tokens=args.chunk_tokens)
    data = kvwire.encode(cache)
    nbytes = cache.nbytes
    name = "simulated" if env.simulated else torch.cuda.get_device_name(dev)
    print(f"cache: {cache}, container {len(data) / 2**20:.1f} MiB, device {dev} ({name})")

    def expected(i, c):
        return torch.from_numpy(np.ascontiguousarray(cache.layers[i][c]).view(np.int16))

    def all_layers_equal(loaded):
        return all(same_bits(loaded.layers[i][c], expected(i, c)) for i in range(args.layers) for c in "kv")

    # -- baseline: one pinned copy_ -------------------------------------------------------------
    def baseline():
        host = env.pinned(nbytes)
        host.fill_(0x5A)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        row("baseline pinned copy_", timed(env, lambda: dst.copy_(host, non_blocking=True), args.repeat), nbytes)
        pageable = torch.empty(nbytes, dtype=torch.uint8)
        row("pageable copy_", timed(env, lambda: dst.copy_(pageable), args.repeat), nbytes)

    # -- load -----------------------------------------------------------------------------------
    ring = StagingRing(env.stream(), 1, args.ring_slots)

    def load(verify=True, registered=False, source=data):
        with kvwire.open(source) as r:
            return load_to_device(r, dev, verify=verify, ring=ring, registered=registered)

    def loads():
        row("kvwire load", timed(env, load, args.repeat), nbytes, f"ring of {args.ring_slots} pinned slots")
        row("kvwire load, no checksums", timed(env, lambda: load(False), args.repeat), nbytes)
        check("load bf16", all_layers_equal(load()))
        for dtype in ("f16", "f8_e4m3fn", "f32"):
            small = synth_cache(2, args.heads, args.head_dim, 300, dtype=dtype, chunk_tokens=64, seed=3)
            with kvwire.open(kvwire.encode(small)) as r:
                got = load_to_device(r, dev, ring=ring)
            check(f"load {dtype}", all(np.array_equal(
                int_view(got.layers[i][c]).cpu().numpy().view(np.uint8),
                np.ascontiguousarray(small.layers[i][c]).view(np.uint8)) for i in range(2) for c in "kv"))

    def registered():
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "c.kvw"
            kvwire.save(path, cache)
            with kvwire.open(path) as r:
                reg = None if env.simulated else HostRegistration(r._buf)
                try:
                    def load_reg():
                        return load_to_device(r, dev, ring=ring, registered=True)

                    note = "simulated: no registration" if reg is None else f"cudaHostRegister flags {reg.flags}"
                    row("kvwire load, registered mmap", timed(env, load_reg, args.repeat), nbytes, note)
                    check("load registered", all_layers_equal(load_reg()))
                finally:
                    if reg is not None:
                        reg.close()

    # -- lossy containers: compressed bytes over the link, dequantized on the device --------
    def lossy():
        from kvwire.codecs import quant, torch_dequant

        for codec in ("fp8-e4m3", "int8", "int4-g32", "kivi2"):
            blob = kvwire.encode(cache, codec=codec)
            host = kvwire.load(blob)  # the numpy decoder: the reference bytes

            def run(on_device, blob=blob):
                with kvwire.open(blob) as r:
                    return load_to_device(r, dev, ring=ring, device_dequant=on_device)

            row(f"load {codec}, device dequant", timed(env, lambda: run(True), args.repeat), nbytes,
                f"stored {len(blob) / nbytes:.2f} of the decoded bytes")
            row(f"load {codec}, host dequant + copy", timed(env, lambda: run(False), args.repeat), nbytes)
            got = run(True)
            check(f"load {codec} device dequant", all(np.array_equal(
                int_view(got.layers[i][c]).cpu().numpy().view(np.uint8),
                np.ascontiguousarray(host.layers[i][c]).view(np.uint8)) for i in range(args.layers) for c in "kv"))
        # every fp8 code with scales giving subnormal and overflowing results: no FTZ, no FMA
        from kvwire import CodecSpec

        spec = CodecSpec("fp8", fp8_format="f8_e4m3fn", scale_granularity="token")
        lay = quant.layout(spec, "bf16", 1, 256, 0, 3, 0, 3)
        scales = np.array([2.0 ** -133, 1.0, 2.0 ** 120], "<f4")
        body = scales.tobytes() + np.tile(np.arange(256, dtype=np.uint8), 3).tobytes()
        want = quant.decode(spec, body, lay, "bf16").view(np.uint16)
        dst = torch.empty((1, 3, 256), dtype=torch.bfloat16, device=dev)
        torch_dequant.dequant(spec, torch.frombuffer(bytearray(body), dtype=torch.uint8).to(dev), lay, "bf16", dst)
        check("dequant fp8 extremes (subnormal, overflow, NaN)",
              np.array_equal(int_view(dst).cpu().numpy().view(np.uint16), want))

    # -- engine buffers: vLLM HND, as vLLM registers them -------------------------------------------
    bs = args.block_size
    nblocks = -(-args.tokens // bs)
    total_blocks = nblocks * 2
    gen = torch.Generator(device="cpu").manual_seed(0)
    rng = np.random.default_rng(1)
    ids = rng.permutation(total_blocks)[:nblocks]
    ids2 = rng.permutation(total_blocks)[:nblocks]
    state = {}

    def engine():
        raw = [torch.randint(0, 256, (2, total_blocks, args.heads, bs, args.head_dim * 2), dtype=torch.uint8,
                             generator=gen).to(dev).view(torch.bfloat16) for _ in range(args.layers)]
        views = [t.permute(0, 1, 3, 2, 4) for t in raw]
        src = layouts.bind("vllm.v0_9_1_to_0_22.flash_hnd", views, engine="gpu_check")
        state["src"], state["views"] = src, views
        state["want"] = layouts.gather(src, ids, args.tokens)

    def scatter():
        src = state["src"]
        engine_data = layouts.encode_from_engine(src, ids, args.tokens, chunk_tokens=args.chunk_tokens)
        dst = layouts.bind("vllm.v0_9_1_to_0_22.flash_hnd", [torch.zeros_like(t) for t in state["views"]])  # keeps HND strides
        mirror = StagingRing(env.stream(), 1, args.ring_slots, device_mirror=True)

        def run():
            with kvwire.open(engine_data) as r:
                dst.scatter(r, ids2, ring=mirror).synchronize()

        row("scatter -> vllm 0.9-0.22 flash HND", timed(env, run, args.repeat), nbytes, "shuffled block ids")
        got = layouts.gather(dst, ids2, args.tokens)
        check("scatter bf16", all(same_bits(state["want"][i][c], got[i][c]) for i in range(args.layers) for c in "kv"))

    # -- offload ring: save from the GPU ----------------------------------------------------------
    def offload_once(ahead):
        ring_o = layouts.OffloadRing(state["src"], nblocks, stream=env.stream() if env.simulated else None)
        t = time.perf_counter()
        planned = handed = 0
        while handed < nblocks:  # the engine: plan `ahead` pages ahead of what it allocates
            if planned < nblocks and planned - handed < max(ahead, 1):
                n = min(max(ahead, 1), nblocks - planned)
                ring_o.plan(ids[planned : planned + n])
                planned += n
            else:
                ring_o.allocate(1)
                handed += 1
        env.sync()
        return ring_o, time.perf_counter() - t

    def offload():
        ring_o = None
        for ahead in (0, args.ahead):
            secs = []
            for _ in range(max(2, args.repeat // 2)):
                ring_o, sec = offload_once(ahead)
                secs.append(sec)
            st = ring_o.stats
            row(f"offload D2H, plan {ahead} ahead", secs, nbytes,
                f"allocate() waited {st['alloc_wait_s'] * 1e3:.2f} ms in {st['alloc_waits']} of {nblocks} calls")
        t = time.perf_counter()
        blob = b"".join(ring_o.iter_buffers(range(0, nblocks), args.tokens))
        row("encode from the ring", [time.perf_counter() - t], nbytes, "chunk = page: zero-copy bodies")
        want = state["want"]
        with kvwire.open(blob) as r:
            check("offload ring bf16", all(np.array_equal(
                r.layer(i)[c].view(np.uint16), int_view(want[i][c]).contiguous().cpu().numpy().view(np.uint16))
                for i in range(args.layers) for c in "kv"))

    def vllm_connector():
        from kvwire.integrations.vllm_pipeline import LayerPipeline
        from kvwire.integrations.vllm_plan import ModelKey, chunk_cache, place_parts, slots
        from kvwire.layouts import PagedLayer, gather_slots
        from kvwire.store import KVStore, MemoryStore

        arch = kvwire.Architecture.uniform(args.layers, args.heads, args.head_dim)
        C = args.chunk_tokens
        T = args.tokens // C * C
        with tempfile.TemporaryDirectory() as tmp:
            key = ModelKey.of(arch, "bf16", tmp, chunk_tokens=C, fingerprint="11" * 32)
        prompt = rng.integers(0, 50000, T).tolist()
        nb = -(-T // bs)
        blocks_a, blocks_b = rng.permutation(2 * nb)[:nb].tolist(), rng.permutation(2 * nb)[:nb].tolist()
        for physical in ("LBHNC", "LBNHC"):
            def view():
                shape = (2 * nb, args.heads, bs, 2 * args.head_dim) if physical == "LBHNC" else \
                        (2 * nb, bs, args.heads, 2 * args.head_dim)
                t = torch.randint(0, 256, shape + (2,), dtype=torch.uint8, generator=gen).to(dev)
                t = t.view(torch.bfloat16).squeeze(-1)
                return t if physical == "LBHNC" else t.permute(0, 2, 1, 3)
            src = [view() for _ in range(args.layers)]
            ids = slots(blocks_a, bs, 0, T)
            kv = KVStore(MemoryStore())
            layers = [gather_slots(x, ids, args.head_dim) for x in src]
            kv.put_cache(chunk_cache(key, layers, 0, T), prompt)
            dst = [torch.zeros_like(x) for x in src]
            out = slots(blocks_b, bs, 0, T - 1)
            paged = [PagedLayer(x, args.head_dim) for x in dst]

            def run():
                pipe = LayerPipeline(kv, key.space, [("r", prompt, T // C)], args.layers, depth=2)
                plans: dict = {}
                for i in range(args.layers):
                    place_parts(paged[i], pipe.wait(i)[0], blocks_b, bs, 0, T - 1, plans)
                    pipe.done(i)
                env.sync()
                return pipe.close()

            row(f"vllm connector load -> {physical} view", timed(env, run, args.repeat), nbytes,
                "MemoryStore, layer by layer, shuffled blocks")
            served = run()
            ok = served == [T]
            for i in range(args.layers):
                want = gather_slots(src[i], ids[:T - 1], args.head_dim)
                got = gather_slots(dst[i], out, args.head_dim)
                ok = ok and all(same_bits(got[c], want[c]) for c in "kv")
            check(f"vllm connector {physical} bf16", ok)

    for part, fn in (("baseline", baseline), ("load", loads), ("load registered", registered), ("load lossy", lossy),
                     ("engine buffers", engine), ("scatter", scatter), ("offload", offload),
                     ("vllm connector", vllm_connector)):
        if part in ("scatter", "offload") and "src" not in state:
            continue
        section(part, fn)
    env.close()

    base = rows[0]["gbps"] if rows else float("nan")
    print()
    print("| row | GB/s | vs baseline | median ms | note |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['row']} | {r['gbps']:.2f} | {r['gbps'] / base:.2f} | {r['median_s'] * 1e3:.1f} | {r['note']} |")
    print()
    print("bit-exact: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in checks.items()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    info = {"torch": torch.__version__, "python": platform.python_version(), "device": name}
    out.write_text(json.dumps({"config": vars(args), "machine": info, "rows": rows, "checks": checks}, indent=1))
    print(f"results: {out}")
    return 0 if checks and all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
