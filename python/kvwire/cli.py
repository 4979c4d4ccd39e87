"""The ``kvwire`` command: inspect, validate, synth, demo, conformance."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict

import numpy as np

from . import registry as R
from .errors import FormatError
from .reader import open as kv_open
from .synth import synth_cache
from .writer import save


def _jsonable(obj):
    if isinstance(obj, bytes):
        return obj.hex()
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def describe(reader) -> dict:
    """A JSON-able description of a container: header fields and chunk summary."""
    h = reader.header
    d = _jsonable(asdict(h))
    d["arch"]["num_layers"] = h.num_layers
    recs = reader.records
    d["container"] = {
        "form": reader.form,
        "size": reader.size,
        "chunks": reader.chunk_count,
        "stored_bytes": int(recs["stored_length"].sum()) if len(recs) else 0,
        "raw_bytes": int(recs["raw_length"].sum()) if len(recs) else 0,
        "codecs": sorted({R.CODEC_BY_CODE[int(c)] for c in recs["codec"]}) if len(recs) else [],
    }
    return d


def cmd_inspect(args) -> int:
    with kv_open(args.file) as r:
        d = describe(r)
        if args.json:
            print(json.dumps(d, indent=2))
            return 0
        h, c = r.header, d["container"]
        print(f"{args.file}: kvwire {h.format_major}.{h.format_minor} {c['form']} form, {c['size']} bytes")
        print(f"  producer   {h.producer.library} {h.producer.version}")
        print(f"  model      type={h.model.model_type!r} id={h.model.model_id!r} revision={h.model.revision!r}")
        print(f"  tokens     {h.token_count} from position {h.first_position}, chunks of {h.chunk_tokens}")
        print(f"  dtype      {h.dtype}, alignment {h.alignment}, checksum {h.checksum_algorithm}")
        print(f"  chunks     {c['chunks']} ({', '.join(c['codecs']) or '-'}), "
              f"stored {c['stored_bytes']} / raw {c['raw_bytes']} bytes")
        print(f"  layers     {h.num_layers}")
        for i, (spec, tr) in enumerate(zip(h.arch.layers, h.layer_tokens)):
            dims = ", ".join(f"{comp}{list(spec.shape(comp, tr.count))}" for comp in spec.components)
            extra = f" window={spec.window}" if spec.window else ""
            extra += f" source={spec.source_layer}" if spec.kind == "shared" else ""
            print(f"    {i:4d} {spec.kind:<18} tokens [{tr.start}, {tr.stop}) {dims}{extra}")
        for k, v in sorted(h.metadata.items()):
            print(f"  metadata   {k} = {v[:64]!r}")
    return 0


def cmd_validate(args) -> int:
    try:
        with kv_open(args.file) as r:
            r.validate()
    except FormatError as exc:
        print(exc.code, file=sys.stderr)
        print(f"{args.file}: {exc}", file=sys.stderr)
        return 1
    print(f"{args.file}: valid")
    return 0


def cmd_synth(args) -> int:
    cache = synth_cache(args.layers, args.kv_heads, args.head_dim, args.tokens, dtype=args.dtype,
                        chunk_tokens=args.chunk_tokens, seed=args.seed)
    size = save(args.output, cache, codec=args.codec)
    print(f"wrote {args.output}: {size} bytes ({cache})")
    return 0


def cmd_demo(args) -> int:
    """Synthesize a Llama-3-8B-shaped cache, save it, reopen zero-copy, verify, report."""
    cache = synth_cache(args.layers, 8, 128, args.tokens, seed=0, model_type="llama")
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
            zero_copy = np.shares_memory(k0, np.frombuffer(r._buf, np.uint8))
            t0 = time.perf_counter()
            loaded = r.load()
            t_load = time.perf_counter() - t0
        same = loaded.equal(cache)
    print(f"kvwire demo: {cache}")
    print(f"  save   {size / 2**20:8.1f} MiB in {t_save * 1e3:7.1f} ms  ({size / t_save / 1e9:5.2f} GB/s, atomic)")
    print(f"  open   zero-copy in {t_open * 1e3:7.3f} ms  (chunk view shares the mapping: {zero_copy})")
    print(f"  load   checksums verified in {t_load * 1e3:7.1f} ms  ({raw / t_load / 1e9:5.2f} GB/s)")
    print(f"  round trip bit-exact: {same}")
    return 0 if same and zero_copy else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kvwire", description="kvwire KV-cache container tool")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("inspect", help="print a container's header and chunk summary")
    s.add_argument("file")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_inspect)
    s = sub.add_parser("validate", help="check every byte; exit 1 with the error code on stderr if invalid")
    s.add_argument("file")
    s.set_defaults(func=cmd_validate)
    s = sub.add_parser("synth", help="write a seeded synthetic cache")
    s.add_argument("-o", "--output", required=True)
    s.add_argument("--layers", type=int, default=4)
    s.add_argument("--kv-heads", type=int, default=8)
    s.add_argument("--head-dim", type=int, default=128)
    s.add_argument("--tokens", type=int, default=512)
    s.add_argument("--dtype", default="bf16", choices=sorted(R.DTYPES))
    s.add_argument("--chunk-tokens", type=int, default=256)
    s.add_argument("--codec", default="raw", choices=sorted(R.CODECS))
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=cmd_synth)
    s = sub.add_parser("demo", help="synthesize, save, reopen zero-copy, verify")
    s.add_argument("--layers", type=int, default=32)
    s.add_argument("--tokens", type=int, default=2048)
    s.set_defaults(func=cmd_demo)
    s = sub.add_parser("conformance", help="conformance kit: run the gold vectors against an implementation")
    from .conformance.cli import configure as configure_conformance

    configure_conformance(s)
    args = p.parse_args(argv)
    try:
        return args.func(args)
    except FormatError as exc:
        print(exc.code, file=sys.stderr)
        print(str(exc), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
