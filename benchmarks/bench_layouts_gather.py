#!/usr/bin/env python3
"""Per-layer gather and scatter of a vLLM paged KV cache view, by slot ids, through
``kvwire.layouts.gather_slots`` / ``scatter_slots`` (libkvwire's slot copies where native codecs
are on, numpy's strided copies and index kernels as the baselines) and through
``kvwire.layouts.EngineBuffers``, on the same tensors.

    .venv/bin/python benchmarks/bench_layouts_gather.py             # CPU, 4 MiB per layer, bf16
    .venv/bin/python benchmarks/bench_layouts_gather.py --device cuda

Why: the vLLM connector copies each layer between vLLM's ``[num_blocks, num_kv_heads,
block_size, 2 * head_dim]`` view and kvwire's standard ``[heads, tokens, head_dim]``
layout on every save and load, through ``gather_slots`` / ``scatter_slots``; on the CPU they
copy strided runs of blocks, elsewhere they index slot by slot, and the CPU default must
be the faster (and no slower than EngineBuffers' run copies). Packings: ``channels`` (FlashAttention, Triton, FlashInfer, Flex),
and the CPU backend's ``vec`` and ``amx`` kernels (packing ``tokens``). EngineBuffers has no
layout for the ``amx`` tiles (spec/layouts.md KVW-BIND-5), so those rows have n/a there.

Each figure is the best of --repeat timed runs after one warm-up (the least disturbed by
other work on a shared machine), in ms per layer;
"scattered" gathers blocks in a random order, "consecutive" a run of blocks. Writes
benchmarks/results/layouts_gather.md (the table printed) unless --no-write.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python"))  # harmless when kvwire is installed editable

import torch

import kvwire
from _common import cpu_model
from kvwire import layouts
from kvwire.codecs import native
from kvwire.layouts import gather_slots, scatter_slots, slots_from_blocks

# row -> (attention backend, its packing, CPU kernels' ISA); EngineBuffers binds all but the amx tiles
CASES = {"channels": ("FLASH_ATTN", "channels", None), "tokens, vec": ("CPU_ATTN", "tokens", "vec"),
         "tokens, amx": ("CPU_ATTN", "tokens", "amx")}


def timed(fn, repeat: int, sync) -> float:
    fn()
    sync()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return min(samples) * 1e3


def run(args) -> list[tuple]:
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    H, N, D = args.heads, args.block_size, args.head_dim
    block_bytes = H * N * 2 * D * 2  # bf16
    nblk = args.layer_mib * (1 << 20) // block_bytes
    tokens = nblk * N
    total = 2 * nblk
    gen = torch.Generator().manual_seed(0)
    src = torch.randn((total, H, N, 2 * D), generator=gen).to(torch.bfloat16).to(dev)
    dst = torch.zeros_like(src)
    rng = np.random.default_rng(0)
    rows = []
    for order in ("scattered", "consecutive"):
        blocks = rng.permutation(total)[:nblk] if order == "scattered" else np.arange(3, 3 + nblk)
        ids = slots_from_blocks(blocks, N, tokens)
        for case, (backend, packing, isa) in CASES.items():
            mine = gather_slots(src, ids, D, packing, cpu_isa=isa)
            t_g = timed(lambda: gather_slots(src, ids, D, packing, cpu_isa=isa), args.repeat, sync)
            t_s = timed(lambda: scatter_slots(dst, ids, mine, D, packing, cpu_isa=isa), args.repeat, sync)
            np_g = np_s = None  # the same strided copies by numpy (native codecs off), where libkvwire made them
            if dev.type == "cpu" and native.available():
                lib = native.library()
                native.disable()
                try:
                    theirs = gather_slots(src, ids, D, packing, cpu_isa=isa)
                    assert all(torch.equal(mine[c].view(torch.int16), theirs[c].view(torch.int16)) for c in mine)
                    np_g = timed(lambda: gather_slots(src, ids, D, packing, cpu_isa=isa), args.repeat, sync)
                    np_s = timed(lambda: scatter_slots(dst, ids, mine, D, packing, cpu_isa=isa), args.repeat, sync)
                finally:
                    native.enable(lib)
            # the baseline: index kernels per slot (what the connector ran before the strided copies)
            ix = gather_slots(src, ids, D, packing, cpu_isa=isa, indexed=True)
            assert all(torch.equal(mine[c].view(torch.int16), ix[c].view(torch.int16)) for c in ("k", "v")), case
            ix_g = timed(lambda: gather_slots(src, ids, D, packing, cpu_isa=isa, indexed=True), args.repeat, sync)
            ix_s = timed(lambda: scatter_slots(dst, ids, mine, D, packing, cpu_isa=isa, indexed=True), args.repeat,
                         sync)
            eb_g = eb_s = None
            if isa != "amx":
                kw = dict(num_kv_heads=H, head_dim=D, block_size=N, attn_backend=backend, cpu_isa=isa,
                          kv_cache_layout="LBHNC")
                eb, eb_dst = layouts.bind_vllm([src], **kw), layouts.bind_vllm([dst], **kw)
                theirs = eb.gather_layer(0, blocks, tokens)
                assert all(torch.equal(mine[c].view(torch.int16), theirs[c].contiguous().view(torch.int16))
                           for c in ("k", "v")), case
                eb_g = timed(lambda: {c: x.contiguous() for c, x in eb.gather_layer(0, blocks, tokens).items()},
                             args.repeat, sync)
                data = layouts.encode_from_engine(eb, blocks, tokens, chunk_tokens=tokens)
                with kvwire.open(data) as r:
                    eb_s = timed(lambda: eb_dst.scatter(r, blocks, verify=False).synchronize(), args.repeat, sync)
            rows.append((order, case, ix_g, np_g, t_g, eb_g, ix_s, np_s, t_s, eb_s))
    return rows


def table(args, rows) -> str:
    def f(x):
        return "n/a" if x is None else f"{x:.3f}"

    lines = [f"# Per-layer gather / scatter of a vLLM paged view by slot ids ({args.device})", "",
             f"{args.layer_mib} MiB per layer (K and V), bfloat16, {args.heads} KV heads x head_dim "
             f"{args.head_dim}, block_size {args.block_size}; best of {args.repeat} runs, ms per layer. "
             f"Machine: {cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads.", "",
             "*indexed*: gather_slots / scatter_slots with `indexed=True` (per-slot index kernels, the default on "
             "devices, and what the connector ran on the CPU before); *numpy*: the CPU default's strided copies per "
             "run of blocks made by numpy (native codecs off); *default*: the CPU default as installed (libkvwire's "
             f"`kvw_gather_slots` / `kvw_scatter_slots` where it takes the view: {native.status()}); "
             "*EngineBuffers*: `kvwire.layouts.bind_vllm`'s run copies (no amx layout).", "",
             "| blocks | packing | gather: indexed | numpy | default | EngineBuffers | scatter: indexed | numpy "
             "| default | EngineBuffers |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for order, packing, *cells in rows:
        lines.append(f"| {order} | {packing} | " + " | ".join(f(x) for x in cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layer-mib", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=32, help="a multiple of 16 (the amx tiles)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steady figures on a shared machine)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--results", default=str(HERE / "results"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    text = table(args, run(args))
    print(text)
    if not args.no_write:
        Path(args.results, "layouts_gather.md").write_text(text)


if __name__ == "__main__":
    main()
