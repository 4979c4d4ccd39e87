#!/usr/bin/env python3
"""Time to first token: recomputing the prefill vs loading the prompt's KV cache with kvwire.

    .venv/bin/python benchmarks/bench_ttft.py                    # llama-style 8 x 512, 4096-token prompt
    .venv/bin/python benchmarks/bench_ttft.py --tokens 1024 --repeat 2   # quick

A small llama-style model is built offline from a config (random weights; the timing
does not depend on them) with transformers (the `hf` extra). For a prompt of T tokens:

* recompute: ``model(prompt, logits_to_keep=1)`` - the prefill - then the first token;
* kvwire file: ``kvwire.load`` of the cache of ``prompt[:-1]`` (written once with
  ``kvwire.save``), the tensors put into a ``DynamicCache`` without copies, then one
  forward step of ``prompt[-1]`` gives the first token; page cache warm, and cold
  (``posix_fadvise(DONTNEED)`` before each load);
* kvwire loopback: the same cache streamed by a forked process with ``stream.LayerWriter``
  over 127.0.0.1 TCP and received with ``stream.LayerReader``, then the same forward step.

Every path must produce the same first token as the recompute (checked). The HF
conversion here is the minimum the benchmark needs, not an adapter. Writes
benchmarks/results/ttft.md and ttft.json. Exits with status 2 and a message when
transformers is not installed.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python"))

import kvwire
from kvwire import stream

BRIEF = (1.5, 8.0)


def need_transformers():
    try:
        import torch  # noqa: F401 (only checks that it imports)
        import transformers  # noqa: F401 (only checks that it imports)
    except ImportError as exc:
        print(f"bench_ttft: needs torch and transformers (pip install torch==2.13.0 --index-url "
              f"https://download.pytorch.org/whl/cpu && pip install -e '.[hf]'): {exc}", file=sys.stderr)
        sys.exit(2)


def build_model(args):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "llama", hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        vocab_size=args.vocab, max_position_embeddings=max(8192, 2 * args.tokens), tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval(), cfg


# ---------------------------------------------------------------------------------------
# The minimal HF <-> kvwire conversion this benchmark needs
# ---------------------------------------------------------------------------------------

def to_kvwire(past, cfg, first_position=0) -> kvwire.KVCache:
    """DynamicCache layers [1, H, T, D] -> kvwire [H, T, D] (views)."""
    keys = [layer.keys[0] for layer in past.layers]
    values = [layer.values[0] for layer in past.layers]
    return kvwire.KVCache.from_tensors(keys, values, first_position=first_position,
                                       model=kvwire.ModelIdentity(model_type=cfg.model_type, model_id="bench/random"))


def to_dynamic_cache(layers, cfg):
    """kvwire per-layer {"k", "v"} [H, T, D] -> DynamicCache [1, H, T, D], without copying."""
    from transformers import DynamicCache

    cache = DynamicCache(config=cfg)
    for layer, kv in zip(cache.layers, layers):
        k, v = kv["k"].unsqueeze(0), kv["v"].unsqueeze(0)
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
    return cache


def first_token(model, ids, past=None):
    import torch

    with torch.inference_mode():
        out = model(ids, cache=past, use_cache=True, logits_to_keep=1)  # `cache`: transformers 5 name
    return int(out.logits[0, -1].argmax()), out.cache


# ---------------------------------------------------------------------------------------

def timed(fn, repeat, warmup=1):
    samples, out = [], None
    for i in range(repeat + warmup):
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        if i >= warmup:
            samples.append(dt)
    return statistics.median(samples), samples, out


def drop_file_cache(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="prompt length")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--results", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    need_transformers()
    import torch

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    try:
        model, cfg = build_model(args)
    except Exception as exc:  # no network: the config must build offline
        print(f"bench_ttft: cannot build the model offline: {exc}", file=sys.stderr)
        sys.exit(2)
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, args.vocab, (1, args.tokens), generator=g)

    # reference: recompute the whole prefill
    t_re, s_re, (tok_ref, _) = timed(lambda: first_token(model, prompt), args.repeat)
    print(f"recompute prefill + first token: {t_re * 1e3:.0f} ms (token {tok_ref})", flush=True)

    # the cache of prompt[:-1], written once
    _, past = first_token(model, prompt[:, :-1])
    kv = to_kvwire(past, cfg)
    tmp = tempfile.mkdtemp(prefix="kvwire-ttft-", dir=str(HERE / "out") if (HERE / "out").is_dir() else None)
    path = os.path.join(tmp, "prompt.kvw")
    size = kvwire.save(path, kv)
    del past
    last = prompt[:, -1:]

    def from_file():
        loaded = kvwire.load(path, backend="torch")
        tok, _ = first_token(model, last, to_dynamic_cache(loaded.layers, cfg))
        return tok

    def from_file_cold():
        drop_file_cache(path)
        return from_file()

    t_file, s_file, tok_file = timed(from_file, args.repeat + 2)
    print(f"kvwire file (warm) + first token: {t_file * 1e3:.1f} ms", flush=True)
    # cold: the drop is timed too, but it is a few ms against the read from disk
    t_cold, s_cold, tok_cold = timed(from_file_cold, args.repeat + 2)
    print(f"kvwire file (cold) + first token: {t_cold * 1e3:.1f} ms", flush=True)

    # loopback: a forked process streams the cache layer by layer
    ctx = mp.get_context("fork")

    # a receive buffer kept across requests, as a server would (and out of the forked
    # senders, so that writing into it does not copy shared pages)
    region = mmap.mmap(-1, size)
    region.madvise(mmap.MADV_DONTFORK)
    held = np.frombuffer(region, np.uint8)
    held[:] = 0

    def loopback(buffer=None):
        srv = socket.create_server(("127.0.0.1", 0))
        port = srv.getsockname()[1]

        def child():
            src = kvwire.load(path)  # the sender's copy, loaded before the clock starts
            s = socket.create_connection(("127.0.0.1", port))
            assert s.recv(1) == b"g"
            with s, stream.LayerWriter(s, src.header) as w:
                for i, layer in enumerate(src.layers):
                    w.write_layer(i, layer["k"], layer["v"])

        p = ctx.Process(target=child, daemon=True)
        p.start()
        conn, _ = srv.accept()
        srv.close()
        try:
            conn.sendall(b"g")
            t0 = time.perf_counter()
            r = stream.LayerReader(conn, backend="torch", buffer=buffer)
            tok, _ = first_token(model, last, to_dynamic_cache(r.cache().layers, cfg))
            dt = time.perf_counter() - t0
        finally:
            conn.close()
            p.join(60)
        return dt, tok, r.stats

    lb = [loopback() for _ in range(args.repeat + 3)][1:]
    t_lb = statistics.median(x[0] for x in lb)
    tok_lb = lb[-1][1]
    print(f"kvwire loopback TCP + first token: {t_lb * 1e3:.1f} ms ({lb[-1][2]})", flush=True)
    lbh = [loopback(held) for _ in range(args.repeat + 3)][1:]
    t_lbh = statistics.median(x[0] for x in lbh)
    print(f"kvwire loopback TCP, held buffer + first token: {t_lbh * 1e3:.1f} ms ({lbh[-1][2]})", flush=True)
    decode_only, _, _ = timed(lambda: first_token(model, last, to_dynamic_cache(kv.layers, cfg)), args.repeat + 2)

    for name, tok in (("file", tok_file), ("file cold", tok_cold), ("loopback", tok_lb), ("held", lbh[-1][1])):
        if tok != tok_ref:
            raise AssertionError(f"{name}: first token {tok} != recompute's {tok_ref}")
    load_after = os.getloadavg()
    rows = [
        ("recompute: prefill of the prompt + first token", t_re, None),
        ("kvwire file, page cache warm: load + 1-token forward", t_file, t_re / t_file),
        ("kvwire file, cold (fadvise DONTNEED): load + 1-token forward", t_cold, t_re / t_cold),
        ("kvwire loopback TCP (stream.Writer -> Reader, fresh receive buffer): transfer + 1-token forward", t_lb,
         t_re / t_lb),
        ("kvwire loopback TCP, receive buffer held across requests: transfer + 1-token forward", t_lbh,
         t_re / t_lbh),
        ("(part of the above) 1-token forward with the cache already in memory", decode_only, None),
    ]
    kv_bytes = kv.nbytes
    info = {
        "model": f"llama-style, {args.layers} layers, hidden {args.hidden}, {args.heads} heads, {args.kv_heads} KV heads, "
                 f"head_dim {args.hidden // args.heads}, intermediate {args.intermediate}, vocab {args.vocab}, "
                 f"{params / 1e6:.1f} M parameters, float32, random weights, sdpa attention",
        "prompt_tokens": args.tokens, "kv_bytes": kv_bytes, "file_bytes": size, "repeat": args.repeat,
        "torch_threads": args.threads, "cpus": os.cpu_count(), "loadavg_before": load_before,
        "loadavg_after": load_after, "torch": torch.__version__, "python": platform.python_version(),
        "platform": platform.platform(),
    }
    import transformers

    info["transformers"] = transformers.__version__
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ttft.json").write_text(json.dumps({"info": info, "rows": [
        {"name": n, "median_s": t, "speedup": s} for n, t, s in rows], "samples": {
        "recompute": s_re, "file": s_file, "file_cold": s_cold, "loopback": [x[0] for x in lb],
        "loopback_held": [x[0] for x in lbh]}}, indent=1))
    lines = [
        "# kvwire time-to-first-token benchmark (CPU)",
        "",
        f"Model: {info['model']}. Prompt: {args.tokens} random tokens; the cache of the first "
        f"{args.tokens - 1} is {kv_bytes / 2**20:.1f} MiB (file {size} B). torch {torch.__version__} "
        f"({args.threads} threads), transformers {transformers.__version__}. Median of {args.repeat} "
        f"(recompute) / {args.repeat + 2} (loads) runs after a warm-up; every path yields the recompute's "
        f"first token.",
        f"Machine: {os.cpu_count()} CPUs, {platform.platform()}; load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after.",
        "",
        "| path | TTFT ms (median) | speedup vs recompute | brief 1.5-8x |",
        "|---|---:|---:|---|",
    ]
    for n, t, s in rows:
        lines.append(f"| {n} | {t * 1e3:.1f} | " + (f"{s:.1f}x" if s else "-") + " | "
                     + ("-" if s is None else ("met" if s >= BRIEF[0] else "NOT met")) + " |")
    text = "\n".join(lines) + "\n"
    (out / "ttft.md").write_text(text)
    print()
    print(text)
    for f in os.listdir(tmp):
        os.unlink(os.path.join(tmp, f))
    os.rmdir(tmp)


if __name__ == "__main__":
    main()
