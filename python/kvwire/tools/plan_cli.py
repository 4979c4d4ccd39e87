"""``kvwire plan``: the load-or-recompute decision table of ``kvwire.plan`` (spec/policy.md)
on the command line. The cost model lives in ``codecs.policy``; this is its argparse face."""

from __future__ import annotations

from dataclasses import replace

from ..codecs.policy import DEFAULT_CODECS, MODELS, parse_codec, parse_model, plan, sweep
from .cliargs import count, nonnegative_float, positive, positive_float


def configure_cli(p) -> None:
    p.add_argument("--bandwidth", default="32Gbps", help="link bandwidth: '32Gbps', '4GB/s' or bits/s")
    p.add_argument("--context", type=positive, default=131072, help="context tokens")
    p.add_argument("--prefill-tokens-per-s", type=positive_float, required=True,
                   help="receiver's prefill throughput on a short prompt")
    p.add_argument("--codec", action="append", type=parse_codec,
                   help="name:bits_per_element[:decode_GBps] (repeatable; default: " +
                        ", ".join(f"{c.name}:{c.bits_per_element}:{c.decode_gbps}" for c in DEFAULT_CODECS) + ")")
    p.add_argument("--model", default="llama-3-8b", type=parse_model,
                   help=f"one of {', '.join(sorted(MODELS))} or layers:kv_heads:head_dim:q_heads:params")
    p.add_argument("--attention-half-tokens", type=positive_float,
                   help="position at which attention costs as much as the rest of a token's prefill")
    p.add_argument("--chunk-tokens", type=positive, default=256)
    p.add_argument("--cached-tokens", type=count, default=0)
    p.add_argument("--latency-ms", type=nonnegative_float, default=0.0)
    p.add_argument("--prefer", choices=("fastest", "densest"), default="fastest")
    p.add_argument("--sweep", action="store_true", help="print the bandwidth x context matrix instead")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args) -> int:
    model = args.model
    if args.attention_half_tokens:
        model = replace(model, attention_half_tokens=args.attention_half_tokens)
    codecs = tuple(args.codec or DEFAULT_CODECS)
    kw = dict(model=model, chunk_tokens=args.chunk_tokens, latency_s=args.latency_ms / 1e3, prefer=args.prefer)
    try:
        if args.sweep:
            print(sweep(args.prefill_tokens_per_s, codecs, **kw))
        else:
            print(plan(args.bandwidth, args.context, args.prefill_tokens_per_s, codecs,
                       cached_tokens=args.cached_tokens, **kw).table())
    except ValueError as exc:
        raise SystemExit(f"kvwire plan: {exc}") from None
    return 0
