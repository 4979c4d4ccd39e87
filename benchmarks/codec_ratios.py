#!/usr/bin/env python3
"""Compression ratio of every codec preset against the cache's own dtype, at several contexts.

    .venv/bin/python benchmarks/codec_ratios.py          # ~1 min on 2 cores

Why: docs/codecs.md recommends a codec per goal, and a ratio only means something against
the dtype the cache is held in (int8 is 2x on a bf16 cache and 4x on an f32 one) and at a
given context (KIVI keeps its last 128 tokens in full precision, so it pays off only on long
caches). The caches are real: the trained fidelity model (benchmarks/fidelity/model, Llama
architecture, 4 layers, 2 KV heads, head_dim 64) prefilled with held-out text, cast to each
dtype with ``kvwire.tools.fidelity.astype``. Ratio = bytes of the whole raw container
(``kvwire.encode(cache)``) over bytes of the whole container with the codec (header, index
and codec metadata included). "grows" marks a ``CodecGrowthWarning`` (stored > raw).

Writes benchmarks/results/codec_ratios.md and codec_ratios.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python"))
sys.path.insert(0, str(HERE / "fidelity"))

import kvwire
from kvwire.codecs import CodecGrowthWarning
from kvwire.tools import fidelity as F

CODECS = ["zstd", "byteplane", "fp8-e4m3", "int8", "int8-asym", "int4-g32", "int4-g32-zstd", "kivi4", "kivi2"]
CONTEXTS = (64, 200, 512, 960)
DTYPES = ("bf16", "f16", "f32")


def measure(caches: dict) -> list:
    rows = []
    for dtype, by_ctx in caches.items():
        for ctx, cache in by_ctx.items():
            raw = len(kvwire.encode(cache))
            for codec in CODECS:
                with warnings.catch_warnings(record=True) as got:
                    warnings.simplefilter("always", CodecGrowthWarning)
                    n = len(kvwire.encode(cache, codec=codec))
                grows = any(issubclass(w.category, CodecGrowthWarning) for w in got)
                rows.append(dict(dtype=dtype, context=ctx, codec=codec, raw_bytes=raw, bytes=n,
                                 ratio=round(raw / n, 3), grows=grows))
    return rows


def table(rows: list, dtype: str) -> str:
    head = "| codec | " + " | ".join(f"{c} tokens" for c in CONTEXTS) + " |"
    out = [head, "|---|" + "---|" * len(CONTEXTS)]
    for codec in CODECS:
        cells = []
        for ctx in CONTEXTS:
            r = next(r for r in rows if r["dtype"] == dtype and r["context"] == ctx and r["codec"] == codec)
            cells.append(f"{r['ratio']:.2f}x" + (" (grows)" if r["grows"] else ""))
        out.append(f"| `{codec}` | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(HERE / "fidelity" / "model"))
    ap.add_argument("--out", default=str(HERE / "results"))
    a = ap.parse_args(argv)
    import torch
    import train

    torch.set_num_threads(1)
    t0 = time.time()
    model = F.load_hf_model(Path(a.model))
    _, held = train.corpus()
    ids = F.text_windows(held.tobytes(), 1, max(CONTEXTS), seed=0)
    base = {ctx: F.prefill_hf(model, ids[:, :ctx], dtype="f32")[0] for ctx in CONTEXTS}
    caches = {d: {ctx: F.astype(c, d) for ctx, c in base.items()} for d in DTYPES}
    rows = measure(caches)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "codec_ratios.json").write_text(json.dumps(dict(contexts=CONTEXTS, dtypes=DTYPES, rows=rows), indent=1))
    md = ["# Codec ratios against the cache's own dtype (benchmarks/codec_ratios.py)", "",
          f"{time.strftime('%Y-%m-%d')}, {platform.machine()}, {time.time() - t0:.0f} s. One real cache per context: "
          "the trained fidelity model (benchmarks/fidelity/model: Llama, 4 layers, 2 KV heads, head_dim 64) "
          "prefilled with one held-out text window, cast to each dtype. Ratio = whole raw container bytes over "
          "whole container bytes with the codec (header, index, scales included); 256-token chunks. "
          "\"(grows)\": the codec stored more than raw (CodecGrowthWarning).", ""]
    for d in DTYPES:
        md += [f"## {d} cache", "", table(rows, d), ""]
    (out / "codec_ratios.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
