#!/usr/bin/env python3
"""Plots of benchmarks/bench_scaling.py: time against size for open, probe and the hit query,
throughput against size for load and validate.

Apart from the benchmark so that module stays small and the figures can be redrawn from a
saved run without measuring again::

    .venv/bin/python benchmarks/scaling_plots.py [benchmarks/results/scaling.json]

Writes scaling_time.png, scaling_store.png and scaling_throughput.png next to the JSON
(matplotlib, ``bench`` extra).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _axes(ax, xlabel, ylabel):
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=.3)
    ax.legend(fontsize=8)


def plots(res, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    panels = (("tokens", "tokens", "tokens (2 layers, 256-token chunks)"),
              ("tokens_fixed_chunks", "bytes", "file bytes (64 chunks)"),
              ("layers", "layers", "layers (4K tokens)"), ("chunks", "chunks", "chunks (1-token chunks)"))
    for ax, (sweep, xkey, label) in zip(axes, panels):
        pts = res[sweep]
        for op, style in (("open_s", "o-"), ("open_floor_s", "o:"), ("probe_s", "s-")):
            ax.loglog([p[xkey] for p in pts], [p[op] * 1e3 for p in pts], style,
                      label={"open_floor_s": "os.open+fstat+mmap"}.get(op, op[:-2]))
        _axes(ax, label, "ms")
    fig.suptitle("kvwire open / probe: time against size")
    fig.tight_layout()
    fig.savefig(out / "scaling_time.png", dpi=90)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for sweep, xkey, label in (("store_keys", "keys", "keys (1 per 256 tokens)"),
                               ("store_body", "object_bytes", "object bytes (64 keys)")):
        ax = axes[0] if sweep == "store_keys" else axes[1]
        pts = res[sweep]
        ax.loglog([p[xkey] for p in pts], [p["query_s"] * 1e3 for p in pts], "o-", label="KVStore.lookup")
        ax.loglog([p[xkey] for p in pts], [p["stat_loop_s"] * 1e3 for p in pts], "o:", label="os.stat loop")
        _axes(ax, label, "ms")
    fig.suptitle("hit query on the file store: time against size")
    fig.tight_layout()
    fig.savefig(out / "scaling_store.png", dpi=90)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    pts = res["chunks"]
    for key, style, name in (("load_s", "o-", "kvwire.load"), ("validate_s", "s-", "Reader.validate"),
                             ("open_s", "^-", "kvwire.open")):
        p = [x for x in pts if key in x]
        axes[2].loglog([x["chunks"] for x in p], [x[key] / x["chunks"] * 1e6 for x in p], style, label=name)
    _axes(axes[2], "chunks (1-token chunks of 32 bytes)", "us per chunk")
    for ax, (sweep, label) in zip(axes, (("tokens", "tokens sweep"), ("layers", "layers sweep"))):
        pts = [p for p in res[sweep] if "load_s" in p]
        xs = [p["bytes"] / 2**20 for p in pts]
        for key, style, name in (("load_GBps", "o-", "kvwire.load"), ("memcpy_GBps", "o:", "memcpy (fresh memory)"),
                                 ("validate_GBps", "s-", "Reader.validate"), ("xxh3_GBps", "s:", "XXH3")):
            ax.semilogx(xs, [p[key] for p in pts], style, label=name)
        _axes(ax, f"file MiB ({label})", "GB/s")
    fig.suptitle("kvwire load / validate: throughput against size (warm page cache)")
    fig.tight_layout()
    fig.savefig(out / "scaling_throughput.png", dpi=90)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="?", default=str(Path(__file__).parent / "results" / "scaling.json"),
                    help="a bench_scaling.py results file (default: benchmarks/results/scaling.json)")
    src = Path(ap.parse_args(argv).json)
    plots(json.loads(src.read_text())["results"], src.parent)
    print(f"wrote {src.parent}/scaling_*.png")


if __name__ == "__main__":
    main()
