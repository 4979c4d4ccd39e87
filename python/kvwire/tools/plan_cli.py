"""``kvwire plan``: the load-or-recompute decision table of ``kvwire.plan`` (spec/policy.md)
on the command line. The cost model lives in ``codecs.policy``; this is its argparse face,
plus what a user should not have to work out by hand: codec costs from codec names
(``codec_speed``), the model geometry, context and dtype from a ``.kvw`` file's header, and
a statement of every assumption the table rests on (text or ``--json``)."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace

from ..cache.files import open as kv_open
from ..codecs.policy import (
    DEFAULT_CODECS,
    MODELS,
    SWEEP_BANDWIDTHS,
    SWEEP_CONTEXTS,
    ModelCost,
    parse_bandwidth,
    parse_codec,
    parse_model,
    plan,
)
from ..format import registry as R
from . import codec_speed
from .cliargs import count, nonnegative_float, positive, positive_float

PREFILL_HELP = """measuring --prefill-tokens-per-s (S):
  S is the receiver's prefill throughput on a SHORT prompt (position ~ 0): everything but
  attention, whose growth with position the cost model adds itself (spec/policy.md 3).
  On the receiver, with the model loaded and warmed up (one untimed run first), time the
  prefill alone (no decoding) of a prompt of 512-2048 tokens at batch 1, several times:
  S = prompt tokens / median seconds. With transformers:
      ids = torch.randint(0, model.config.vocab_size, (1, 1024), device=model.device)
      model(ids); torch.cuda.synchronize(); t = time.perf_counter()
      model(ids); torch.cuda.synchronize(); S = 1024 / (time.perf_counter() - t)
  With vLLM or another server: the time to first token of a 1024-token request minus the
  request's network round trip, on an idle server. The plan is only as good as S.

codec costs:
  --codec NAME (a codec or preset: int8, fp8-e4m3, int4-g32-zstd, ...) takes bits/elem and
  decode GB/s from benchmarks/results/codecs.json when that file is found (working directory
  or this checkout) and the cache is bf16, else measures them here on a synthetic cache of
  the model's shape (a few seconds); --measure always measures. --codec NAME:BITS[:GBPS]
  gives them yourself (a GPU decoder is far faster than this numpy reference). The output
  says which it did."""


def configure_cli(p) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = PREFILL_HELP
    p.add_argument("file", nargs="?", help="a .kvw container: its header gives the model geometry (layers, kv heads, "
                                           "head dim), dtype, chunk size and, unless --context, the context")
    p.add_argument("--bandwidth", default="32Gbps", type=_bandwidth, help="link bandwidth: '32Gbps', '4GB/s' or bits/s")
    p.add_argument("--context", type=positive, default=None, help="context tokens (default: the file's, else 131072)")
    p.add_argument("--prefill-tokens-per-s", type=positive_float, required=True,
                   help="receiver's prefill throughput on a short prompt (how to measure it: below)")
    p.add_argument("--codec", action="append",
                   help="a codec/preset name, or name:bits_per_element[:decode_GBps] (repeatable; default: " +
                        ", ".join(f"{c.name}:{c.bits_per_element}:{c.decode_gbps}" for c in DEFAULT_CODECS) + ")")
    p.add_argument("--measure", action="store_true", help="measure named codecs here even if benchmark figures exist")
    p.add_argument("--bench-results", metavar="FILE", help="a codecs.json of benchmarks/bench_codecs.py to read")
    p.add_argument("--model", default=None, type=_model,
                   help=f"one of {', '.join(sorted(MODELS))} or layers:kv_heads:head_dim:q_heads:params "
                        "(default llama-3-8b; with a file: its q_heads and params only)")
    p.add_argument("--attention-half-tokens", type=positive_float,
                   help="position at which attention costs as much as the rest of a token's prefill")
    p.add_argument("--chunk-tokens", type=positive, default=None, help="default: the file's, else 256")
    p.add_argument("--cached-tokens", type=count, default=0)
    p.add_argument("--latency-ms", type=nonnegative_float, default=0.0)
    p.add_argument("--prefer", choices=("fastest", "densest"), default="fastest")
    p.add_argument("--sweep", action="store_true", help="print the bandwidth x context matrix instead")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout: assumptions, codecs, decisions")
    p.set_defaults(func=cmd_plan)


def _bandwidth(text: str) -> float:
    try:
        return parse_bandwidth(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _model(text: str) -> tuple:
    try:
        return text, parse_model(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _from_file(path: str) -> dict:
    """Geometry, dtype, chunk size and token count of a container's header."""
    with kv_open(path) as r:
        h = r.header
    per_token = 0
    for s in h.arch.layers:
        for comp in s.components:
            if comp != "state":
                heads, _, dim = s.shape(comp, 1)
                per_token += heads * dim
    full = [s for s in h.arch.layers if s.kind == "full_attention"]
    uniform = bool(full) and len(full) == len(h.arch.layers) and len({(s.num_kv_heads, s.head_dim_k, s.head_dim_v)
                                                                      for s in full}) == 1
    first = h.arch.layers[0]
    return dict(file=path, layers=h.num_layers, kv_heads=first.num_kv_heads, head_dim=first.head_dim_k,
                uniform=uniform and first.head_dim_k == first.head_dim_v, elements_per_token=per_token,
                dtype=h.dtype, tokens=h.token_count, chunk_tokens=h.chunk_tokens,
                model_type=h.model.model_type, model_id=h.model.model_id)


def _cost_model(args, geo) -> tuple:
    """The ModelCost and the name it goes by in the output."""
    named = args.model
    if geo is None:
        name, model = named or ("llama-3-8b", MODELS["llama-3-8b"])
    else:
        match = [n for n, m in MODELS.items() if geo["uniform"] and
                 (m.layers, m.kv_heads, m.head_dim) == (geo["layers"], geo["kv_heads"], geo["head_dim"])]
        if named is None and not match and not args.attention_half_tokens:
            raise ValueError(f"{geo['file']}: its geometry ({geo['layers']} layers x {geo['kv_heads']} kv heads x "
                             f"{geo['head_dim']}) matches none of {', '.join(sorted(MODELS))}; pass --model with its "
                             "q_heads and params (layers:kv_heads:head_dim:q_heads:params) or --attention-half-tokens")
        name, base = named or ((match[0], MODELS[match[0]]) if match else ("file geometry", MODELS["llama-3-8b"]))
        half = args.attention_half_tokens or base.half_tokens
        dtype_bytes = R.dtype_info(geo["dtype"])[1]
        if geo["uniform"]:
            model = ModelCost(geo["layers"], geo["kv_heads"], geo["head_dim"], base.q_heads, base.params,
                              dtype_bytes, half)
        else:  # any layer mix: one pseudo-layer with the file's elements per token
            model = ModelCost(1, 1, geo["elements_per_token"] / 2, base.q_heads, base.params, dtype_bytes, half)
        name = f"{geo['file']} ({geo['layers']} layers x {geo['kv_heads']} kv heads x {geo['head_dim']}" \
               f"{'' if geo['uniform'] else ', mixed layers'}; q_heads/params of {name})"
    if args.attention_half_tokens:
        model = replace(model, attention_half_tokens=args.attention_half_tokens)
    return name, model


def _codecs(args, shape, dtype, chunk_tokens) -> list:
    """A SourcedCost per --codec (the policy defaults without one); ``shape``: (kv_heads,
    head_dim) of the synthetic cache a named codec is measured on."""
    if not args.codec:
        return [codec_speed.SourcedCost(c, "kvwire.codecs.policy.DEFAULT_CODECS (spec/policy.md 6)")
                for c in DEFAULT_CODECS]
    try:
        given = {t: parse_codec(t) for t in args.codec if ":" in t}
    except ValueError as exc:
        raise ValueError(f"--codec: {exc}") from None
    out, names = [], [t for t in args.codec if ":" not in t]
    measured = iter(codec_speed.resolve(names, kv_heads=shape[0], head_dim=shape[1], dtype=dtype,
                                        chunk_tokens=chunk_tokens, bench=args.bench_results,
                                        force_measure=args.measure) if names else [])
    for t in args.codec:
        out.append(codec_speed.SourcedCost(given[t], "given on the command line") if ":" in t else next(measured))
    return out


def _gbps(x: float):
    return None if math.isinf(x) else x


def cmd_plan(args) -> int:
    geo = _from_file(args.file) if args.file else None
    name, model = _cost_model(args, geo)
    context = args.context or (geo["tokens"] if geo else 131072)
    chunk = args.chunk_tokens or (geo["chunk_tokens"] if geo else 256)
    dtype = geo["dtype"] if geo else "bf16"
    shape = (geo["kv_heads"], geo["head_dim"]) if geo else (model.kv_heads, model.head_dim)
    sourced = _codecs(args, shape, dtype, chunk)
    codecs = [s.cost for s in sourced]
    bps = args.bandwidth
    kw = dict(model=model, chunk_tokens=chunk, latency_s=args.latency_ms / 1e3, prefer=args.prefer)
    assumed = dict(model=name, elements_per_token=model.elements_per_token, dtype=dtype,
                   attention_half_tokens=model.half_tokens, bandwidth_bps=bps, context_tokens=context,
                   chunk_tokens=chunk, cached_tokens=args.cached_tokens, prefill_tokens_per_s=args.prefill_tokens_per_s,
                   latency_s=args.latency_ms / 1e3, prefer=args.prefer)
    codec_rows = [dict(name=s.cost.name, bits_per_element=s.cost.bits_per_element, decode_gbps=_gbps(s.cost.decode_gbps),
                       source=s.source) for s in sourced]
    if args.sweep:
        return _sweep(args, codecs, kw, assumed, codec_rows)
    if args.cached_tokens > context:
        raise ValueError(f"--cached-tokens {args.cached_tokens} exceeds the context of {context} tokens")
    p = plan(bps, context, args.prefill_tokens_per_s, codecs, cached_tokens=args.cached_tokens, **kw)
    if args.json:
        runs = [dict(token_start=s, tokens=n, action=a, codec=k, recompute_s=r, load_s=ld if a == "load" else None)
                for s, n, a, k, r, ld in p.runs()]
        print(json.dumps(dict(assumed=assumed, codecs=codec_rows, runs=runs, loaded_tokens=p.loaded_tokens,
                              load_fraction=p.load_fraction, stored_bytes=p.stored_bytes,
                              recompute_all_s=p.recompute_all_s, pipelined_s=p.pipelined_s, serial_s=p.serial_s,
                              speedup=p.speedup), indent=2))
        return 0
    _print_assumptions(assumed, codec_rows)
    print(f"{'tokens':>21}  {'action':<9} {'codec':<14} {'recompute ms':>13} {'load ms':>10}")
    for s, n, a, k, r, ld in p.runs():
        load = f"{ld * 1e3:>10.2f}" if a == "load" else f"{'-':>10}"
        print(f"[{s:>9}, {s + n:>9})  {a:<9} {k or '-':<14} {r * 1e3:>13.2f} {load}")
    print(p.table().splitlines()[-1])  # the totals line of kvwire.Plan.table
    return 0


def _print_assumptions(assumed: dict, codec_rows: list) -> None:
    a = assumed
    print(f"model      {a['model']}: {a['elements_per_token']} cache elements/token ({a['dtype']}), "
          f"attention half-cost at {a['attention_half_tokens']:.0f} tokens")
    print(f"bandwidth  {a['bandwidth_bps'] / 1e9:g} Gbit/s, latency {a['latency_s'] * 1e3:g} ms")
    print(f"context    {a['context_tokens']} tokens ({a['cached_tokens']} already cached), "
          f"chunks of {a['chunk_tokens']}")
    print(f"prefill    {a['prefill_tokens_per_s']:g} tokens/s on a short prompt; prefer {a['prefer']}")
    for c in codec_rows:
        speed = "no decode step" if c["decode_gbps"] is None else f"decode {c['decode_gbps']:.3g} GB/s"
        print(f"codec      {c['name']}: {c['bits_per_element']:.2f} bits/elem, {speed}; {c['source']}")


def _sweep(args, codecs, kw, assumed, codec_rows) -> int:
    cells = {}
    for n in SWEEP_CONTEXTS:
        for bw in SWEEP_BANDWIDTHS:
            p = plan(bw, n, args.prefill_tokens_per_s, codecs, **kw)
            cells[(n, bw)] = (p.load_fraction, p.speedup)
    if args.json:
        matrix = [dict(context_tokens=n, bandwidth=bw, load_fraction=f, speedup=s) for (n, bw), (f, s) in cells.items()]
        print(json.dumps(dict(assumed={k: v for k, v in assumed.items() if k not in ("bandwidth_bps", "context_tokens")},
                              codecs=codec_rows, sweep=matrix), indent=2))
        return 0
    rows = ["| context | " + " | ".join(SWEEP_BANDWIDTHS) + " |", "|---|" + "---|" * len(SWEEP_BANDWIDTHS)]
    for n in SWEEP_CONTEXTS:
        rows.append(f"| {n} | " + " | ".join("recompute" if cells[(n, bw)][0] == 0 else
                                               f"load {cells[(n, bw)][0]:.0%} ({cells[(n, bw)][1]:.1f}x)"
                                               for bw in SWEEP_BANDWIDTHS) + " |")
    a = assumed
    print(f"model {a['model']}, {a['elements_per_token']} elements/token ({a['dtype']}); prefill "
          f"{a['prefill_tokens_per_s']:g} tokens/s; chunks of {a['chunk_tokens']}; codecs "
          + ", ".join(f"{c['name']} ({c['source']})" for c in codec_rows))
    print("\n".join(rows))
    return 0

