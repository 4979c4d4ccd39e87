"""``kvwire demo``: the end-to-end story on a model built offline.

A producer prefills a prompt with a small transformers model and saves the cache; a
FRESH receiver process (``python -m <this module> receive DIR``) builds the same model
from the same seed, decides from the header alone whether it may use the cache, loads it
and continues generation. The demo prints the verdict (and the verdict a model with other
weights gets), the sizes, the time saved against recomputing the prefill and whether the
tokens are identical. Without torch/transformers it says how to install them and runs the
synthetic demo (``--synthetic``), which needs only the core.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .synth import synth_cache

# The embedded default: Llama-shaped with GQA, ~3M parameters, built from a seed in about a
# second; a prefill of 512 tokens still costs visible time on a CPU. A wide weight init
# (initializer_range) keeps the random model's greedy tokens from collapsing into one.
DEMO_MODEL = "llama"
DEMO_CONFIG = dict(vocab_size=1024, hidden_size=256, intermediate_size=704, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, initializer_range=0.3)
DEMO_LAYERS = 4
DEMO_TOKENS = 512
DEMO_NEW_TOKENS = 16
PROBE_BYTES = 64 << 10


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def synthetic(layers: int = 32, tokens: int = 2048) -> int:
    """Synthesize a Llama-3-8B-shaped cache, save it, reopen zero-copy, verify, report."""
    from ..cache.files import open as kv_open
    from ..cache.files import save
    from ..cache.kvcache import KVCache

    cache = synth_cache(layers, 8, 128, tokens, seed=0, model_type="llama")
    raw = cache.nbytes
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "demo.kvw")
        t0 = time.perf_counter()
        size = save(path, cache)
        t_save = time.perf_counter() - t0
        t0 = time.perf_counter()
        with kv_open(path) as r:
            t_open = time.perf_counter() - t0
            k0 = r.chunk(0, "k", 0)
            zero_copy = np.shares_memory(k0, np.frombuffer(r.buffer, np.uint8))
            t0 = time.perf_counter()
            loaded = r.load()
            t_load = time.perf_counter() - t0
        same = isinstance(loaded, KVCache) and loaded.equal(cache)  # a sparse cache is never equal to it
    print(f"kvwire demo: {cache}")
    print(f"  save   {size / 2**20:8.1f} MiB in {t_save * 1e3:7.1f} ms  ({size / t_save / 1e9:5.2f} GB/s, atomic)")
    print(f"  open   zero-copy in {t_open * 1e3:7.3f} ms  (chunk view shares the mapping: {zero_copy})")
    print(f"  load   checksums verified in {t_load * 1e3:7.1f} ms  ({raw / t_load / 1e9:5.2f} GB/s)")
    print(f"  round trip bit-exact: {same}")
    return 0 if same and zero_copy else 1


def _build(layers: int, seed: int):
    from ..adapters import zoo

    return zoo.build(DEMO_MODEL, seed, num_hidden_layers=layers, **DEMO_CONFIG)


def produce(workdir: Path, layers: int, tokens: int, new_tokens: int) -> dict:
    """Prefill, save, continue: what the receiver must reproduce."""
    from ..adapters import hf, zoo
    from ..cache.files import save
    from ..conformance.generation import forward, greedy, prompt_ids, quiet_torch

    with quiet_torch():
        model = _build(layers, 0)
        ids = prompt_ids(model.config.vocab_size, tokens, seed=7)
        forward(model, ids[:8])  # warm-up: first-call costs are not the prefill's
        t0 = time.perf_counter()
        row, cache = forward(model, ids)
        t_prefill = time.perf_counter() - t0
        first = int(np.argmax(row))
        kvc = hf.from_hf(cache, model, identity=hf.identity(model, zoo.tokenizer(model.config.vocab_size)))
        t0 = time.perf_counter()
        size = save(workdir / "prompt.kvw", kvc)
        t_save = time.perf_counter() - t0
        tokens_out, _ = greedy(model, cache, first, new_tokens)
    params = sum(p.numel() for p in model.parameters())
    job = {"layers": layers, "prompt": ids, "first_token": first, "tokens": [first] + tokens_out,
           "steps": new_tokens, "file": "prompt.kvw", "size": size, "raw": kvc.nbytes, "dtype": kvc.header.dtype,
           "t_prefill": t_prefill, "t_save": t_save, "params": int(params),
           "shape": f"{layers} layers, {model.config.num_attention_heads} heads / "
                    f"{model.config.num_key_value_heads} KV heads, head_dim {model.config.head_dim}"}
    (workdir / "job.json").write_text(json.dumps(job))
    return job


def receive(workdir: Path) -> dict:
    """The fresh process: probe the header, check compatibility, load, continue; and time
    the same continuation after recomputing the prefill instead."""
    from ..adapters import hf, zoo
    from ..cache.files import open as kv_open
    from ..cache.kvcache import KVCache
    from ..cache.reader import probe
    from ..conformance.generation import forward, greedy, quiet_torch, verdict_json
    from ..format.container import parse_preamble
    from ..format.errors import TruncatedError
    from ..model.compat import check_compatible

    job = json.loads((workdir / "job.json").read_text())
    path = workdir / job["file"]
    out: dict = {"pid": os.getpid()}
    with quiet_torch():
        model = _build(job["layers"], 0)
        forward(model, job["prompt"][:8])
        tokenizer = zoo.tokenizer(model.config.vocab_size)
        local = hf.local_model(model, tokenizer)
        t0 = time.perf_counter()
        with open(path, "rb") as f:
            head = f.read(PROBE_BYTES)
        try:
            header = probe(head)
        except TruncatedError as exc:  # a header larger than the first read: read what it needs
            with open(path, "rb") as f:
                head = f.read(exc.needed or os.path.getsize(path))
            header = probe(head)
        verdict = check_compatible(header, local)
        out["t_verdict"] = time.perf_counter() - t0
        out["probe_bytes"], out["header_bytes"] = len(head), parse_preamble(head)[1]
        out["verdict"] = verdict_json(verdict)
        other = hf.local_model(_build(job["layers"], 1), tokenizer)
        out["other_verdict"] = verdict_json(check_compatible(header, other))
        if not verdict:
            return out
        t0 = time.perf_counter()
        with kv_open(path) as r:
            loaded = r.load()
            assert isinstance(loaded, KVCache)  # the sender saved a dense cache
            cache = hf.to_hf(loaded, model)
        out["t_load"] = time.perf_counter() - t0
        out["tokens"] = [job["first_token"]] + greedy(model, cache, job["first_token"], job["steps"])[0]
        t0 = time.perf_counter()
        row, fresh = forward(model, job["prompt"])
        out["t_recompute"] = time.perf_counter() - t0
        out["recomputed_tokens"] = [int(np.argmax(row))] + greedy(model, fresh, int(np.argmax(row)), job["steps"])[0]
    return out


def _receiver_argv(workdir: Path) -> list:
    return [sys.executable, "-m", __name__, "receive", str(workdir)]


def _report(job: dict, got: dict) -> int:
    v = got["verdict"]
    print(f"kvwire demo: {DEMO_MODEL} built offline from seed 0 ({job['shape']}, "
          f"{job['params'] / 1e6:.1f}M parameters)")
    print(f"  producer  prefill of {len(job['prompt'])} tokens in {job['t_prefill'] * 1e3:.1f} ms; cache "
          f"{_mib(job['raw'])} {job['dtype']} saved as {_mib(job['size'])} in {job['t_save'] * 1e3:.1f} ms")
    print(f"  receiver  fresh process (pid {got['pid']}), the same model rebuilt from its seed")
    print(f"    header  {got['header_bytes']} bytes (from a read of the first {_mib(got['probe_bytes'])}), "
          f"verdict in {got['t_verdict'] * 1e3:.2f} ms without touching a tensor")
    print(f"    verdict {v['status']}" + (f" ({'; '.join(v['conversions'])})" if v["conversions"] else "")
          + (f": {'; '.join(v['reasons'])}" if v["reasons"] else ""))
    o = got["other_verdict"]
    print(f"    a model with other weights (seed 1) would get: {o['status']}"
          + (f" ({o['reasons'][0]})" if o["reasons"] else ""))
    if not v["ok"]:
        print("  the receiver refused the cache")
        return 1
    saved = got["t_recompute"] - got["t_load"]
    print(f"    load    {_mib(job['size'])} into a transformers cache in {got['t_load'] * 1e3:.1f} ms, "
          f"recomputing the prefill takes {got['t_recompute'] * 1e3:.1f} ms: {saved * 1e3:.1f} ms saved "
          f"({got['t_recompute'] / max(got['t_load'], 1e-9):.1f}x)")
    same = got["tokens"] == job["tokens"]
    print(f"  producer continues:  {job['tokens']}")
    print(f"  receiver continues:  {got['tokens']}")
    print(f"  identical tokens: {same} (and equal to recomputing the prefill: "
          f"{got['recomputed_tokens'] == got['tokens']})")
    return 0 if same and got["recomputed_tokens"] == got["tokens"] and o["status"] == "incompatible" else 1


def run(layers: int | None = None, tokens: int | None = None, new_tokens: int = DEMO_NEW_TOKENS,
        timeout: float = 600.0) -> int:
    """The end-to-end demo; falls back to the synthetic one without torch/transformers."""
    try:
        import torch  # noqa: F401 (only checks that it imports)
        import transformers  # noqa: F401 (only checks that it imports)

        from ..adapters import hf  # noqa: F401 (only checks that it imports)
    except ImportError as exc:
        print(f"kvwire demo: the end-to-end demo needs torch and transformers ({exc}).")
        from ..conformance.generation import INSTALL_HINT

        print(f"  install them with:  {INSTALL_HINT}\n  (torch's CPU build) -- running the synthetic demo instead")
        return synthetic(layers or 32, tokens or 2048)
    from ..conformance.crossmodel_receiver import subprocess_env

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        job = produce(workdir, layers or DEMO_LAYERS, tokens or DEMO_TOKENS, new_tokens)
        p = subprocess.run(_receiver_argv(workdir), capture_output=True, text=True, timeout=timeout,
                           env=subprocess_env())
        if p.returncode != 0:
            print(f"kvwire demo: the receiver process failed ({p.returncode}):\n{p.stderr[-2000:]}",
                  file=sys.stderr)
            return 1
        return _report(job, json.loads((workdir / "received.json").read_text()))


def main(argv) -> int:
    if len(argv) != 2 or argv[0] != "receive":
        print("usage: python -m kvwire.tools.demo receive DIR", file=sys.stderr)
        return 2
    workdir = Path(argv[1])
    (workdir / "received.json").write_text(json.dumps(receive(workdir)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
