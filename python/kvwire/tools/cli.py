"""The ``kvwire`` command: inspect, validate, synth, demo, conformance.

A user mistake never ends in a traceback: it gets one line on stderr and an exit status
of the documented convention (``EXIT_STATUSES``, shown by ``kvwire --help``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from ..cache.files import open as kv_open
from ..cache.files import save
from ..codecs import PRESETS
from ..format import registry as R
from ..format.errors import FormatError
from ..version import __version__
from .cliargs import count, positive
from .synth import synth_cache

EXIT_OK, EXIT_INVALID, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_PIPE = 0, 1, 2, 130, 141
EXIT_STATUSES = """exit status:
  0    success
  1    invalid input: the container breaks a rule of the spec (stderr: the error code, then the message)
  2    usage error: bad arguments, a missing or unreadable file, a directory or FIFO given as a
       file, an unwritable output (stderr: one line saying what is wrong)
  130  interrupted (Ctrl-C)
  141  the output pipe was closed by the reader (e.g. `kvwire inspect x.kvw --json | head`),
       as for a command ended by SIGPIPE"""


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (exit 2) instead of usage text and an error."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _os_message(exc: OSError) -> str:
    if exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    return str(exc)


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
        print(f"  dtype      {h.dtype}" + (" x per-layer scales (kv_scales)" if h.kv_scales is not None else "")
              + f", alignment {h.alignment}, checksum {h.checksum_algorithm}")
        for i, spec in enumerate(h.codec_specs, 1):  # spec/codecs.md: non-default parameters only
            params = ", ".join(f"{k}={v}" for k, v in asdict(spec).items() if k != "codec"
                               and v != getattr(type(spec)(), k))
            print(f"  codec {i:<4} {spec.codec}" + (f" ({params})" if params else ""))
        if h.sparse is not None:  # spec/sparse.md: tokens per (layer, kv head), layer-major
            sp = h.sparse
            print(f"  sparse     {sp.method or '-'}, next position {sp.next_position}, sinks {sp.sink_tokens}, "
                  f"window {sp.window_tokens}; retained {list(sp.retained_counts[:64])}"
                  + (" ..." if len(sp.retained_counts) > 64 else ""))
        print(f"  chunks     {c['chunks']} ({', '.join(c['codecs']) or '-'}), "
              f"stored {c['stored_bytes']} / raw {c['raw_bytes']} bytes")
        print(f"  layers     {h.num_layers}")
        for i, (spec, tr) in enumerate(zip(h.arch.layers, h.layer_tokens)):
            dims = ", ".join(f"{comp}{list(spec.shape(comp, tr.count))}" for comp in spec.components
                             if comp != "state") + ", ".join(f"{t.name}{list(t.shape)} {t.dtype}"
                                                             for t in spec.state_tensors)  # spec/crossmodel.md
            extra = f" window={spec.window}" if spec.window else ""
            extra += f" source={spec.source_layer}" if spec.kind == "shared" else ""
            if h.kv_scales is not None:  # spec 5.10: value = stored fp8 x scale (9 digits: the exact binary32)
                extra += f" k_scale={h.kv_scales[i].k_scale:.9g} v_scale={h.kv_scales[i].v_scale:.9g}"
            print(f"    {i:4d} {spec.kind:<18} tokens [{tr.start}, {tr.stop}) {dims}{extra}")
        for k, v in sorted(h.metadata.items()):
            print(f"  metadata   {k} = {v[:64]!r}")
    return 0


def _validate_one(name: str) -> dict:
    """One file's verdict: valid, or the error code (None: unreadable, a usage error)."""
    try:
        source = sys.stdin.buffer.read() if name == "-" else name
        with kv_open(source) as r:
            r.validate()
    except FormatError as exc:
        return dict(file=name, valid=False, code=exc.code, error=str(exc))
    except OSError as exc:
        return dict(file=name, valid=False, code=None, error=_os_message(exc))
    return dict(file=name, valid=True, code=None, error=None)


def cmd_validate(args) -> int:
    """Every file in turn (``-``: stdin, once); exit 0 if all are valid, 1 if any breaks a
    rule, 2 if any could not be read."""
    if args.file.count("-") > 1:
        raise ValueError("'-' (stdin) can be given once")
    results = [_validate_one(name) for name in args.file]
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for res in results:
            label = "<stdin>" if res["file"] == "-" else res["file"]
            if res["valid"]:
                print(f"{label}: valid")
            elif res["code"] is None:
                print(f"kvwire validate: error: {res['error']}", file=sys.stderr)
            else:
                print(res["code"], file=sys.stderr)
                print(f"{label}: {res['error']}", file=sys.stderr)
    if any(not r["valid"] and r["code"] is None for r in results):
        return EXIT_USAGE
    return EXIT_INVALID if any(not r["valid"] for r in results) else EXIT_OK


def cmd_synth(args) -> int:
    cache = synth_cache(args.layers, args.kv_heads, args.head_dim, args.tokens, dtype=args.dtype,
                        chunk_tokens=args.chunk_tokens, seed=args.seed)
    size = save(args.output, cache, codec=args.codec)
    print(f"wrote {args.output}: {size} bytes ({cache})")
    return 0


def cmd_demo(args) -> int:
    """End to end on a small transformers model (``--synthetic``: the core alone)."""
    from . import demo

    if args.synthetic:
        return demo.synthetic(args.layers or 32, args.tokens or 2048)
    return demo.run(args.layers, args.tokens, args.new_tokens)


def version_text() -> str:
    """``kvwire --version``: the package, the format versions it reads and writes, and which
    codecs decode (libkvwire or numpy, and why numpy)."""
    from ..codecs import native
    from ..store.keys import KEY_VERSION

    return (f"kvwire {__version__}\n"
            f"container format {R.FORMAT_MAJOR}.{R.FORMAT_MINOR}-{R.FORMAT_MAJOR}.{R.FORMAT_MINOR_IMPLEMENTED} "
            f"(spec/kvwire-v1.md; writes the lowest minor whose features a container uses; zstd frames "
            f"carry content checksums, 1.4)\nstore keys {KEY_VERSION} (spec/store.md)\n"
            f"codecs: {native.status()}")


def main(argv=None) -> int:
    p = _Parser(prog="kvwire", description="kvwire KV-cache container tool", epilog=EXIT_STATUSES,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=version_text())
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("inspect", help="print a container's header and chunk summary")
    s.add_argument("file")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_inspect)
    s = sub.add_parser("validate", help="check every byte of each file; exit 1 with the error code on stderr if any "
                                        "is invalid",
                       epilog=EXIT_STATUSES, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("file", nargs="+", help="container files; - reads one from stdin")
    s.add_argument("--json", action="store_true",
                   help="a JSON list on stdout, one {file, valid, code, error} per file (exit status as without)")
    s.set_defaults(func=cmd_validate)
    s = sub.add_parser("synth", help="write a seeded synthetic cache")
    s.add_argument("-o", "--output", required=True)
    s.add_argument("--layers", type=positive, default=4)
    s.add_argument("--kv-heads", type=positive, default=8)
    s.add_argument("--head-dim", type=positive, default=128)
    s.add_argument("--tokens", type=count, default=512)
    s.add_argument("--dtype", default="bf16", choices=sorted(R.DTYPES))
    s.add_argument("--chunk-tokens", type=positive, default=256)
    s.add_argument("--codec", default="raw", choices=sorted(R.CODECS) + sorted(PRESETS),
                   help="a registry codec or a preset of spec/codecs.md (kvwire.codecs.PRESETS)")
    s.add_argument("--seed", type=count, default=0)
    s.set_defaults(func=cmd_synth)
    s = sub.add_parser("demo", help="prefill with a small model, save, continue in a fresh process; "
                                    "--synthetic: synthesize, save, reopen zero-copy, verify")
    s.add_argument("--synthetic", action="store_true", help="the core-only demo on a synthetic Llama-3-8B-shaped "
                                                            "cache (the fallback without torch/transformers)")
    s.add_argument("--layers", type=positive, default=None, help="model layers (default 4; synthetic: 32)")
    s.add_argument("--tokens", type=positive, default=None, help="prompt tokens (default 512; synthetic: 2048)")
    s.add_argument("--new-tokens", type=count, default=16, help="tokens generated from the loaded cache")
    s.set_defaults(func=cmd_demo)
    s = sub.add_parser("conformance", help="conformance kit: run the gold vectors against an implementation")
    from ..conformance.cli import configure as configure_conformance

    configure_conformance(s)
    from .fidelity import configure_cli as configure_fidelity
    from .plan_cli import configure_cli as configure_plan

    configure_fidelity(sub.add_parser("fidelity", help="bits per element and model-level fidelity of codecs"))
    configure_plan(sub.add_parser("plan", help="load or recompute: per-chunk decision table (codec names, a .kvw "
                                                  "file, --json)"))
    from .store_cli import configure_cli as configure_store

    configure_store(sub.add_parser("store", help="a KV store (--url file://DIR, redis://, ...): init, stats, ls, inspect KEY, gc"))
    args = p.parse_args(argv)  # argparse ignores a failed write of --help / --version itself
    try:
        status = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return status
    except FormatError as exc:
        print(exc.code, file=sys.stderr)
        print(str(exc), file=sys.stderr)
        return EXIT_INVALID
    except BrokenPipeError:
        _drop_stdout()
        return EXIT_PIPE
    except OSError as exc:
        print(f"kvwire {args.cmd}: error: {_os_message(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, TypeError) as exc:  # API misuse reported by kvwire, naming the valid choices
        print(f"kvwire {args.cmd}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("kvwire: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _drop_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush of a closed pipe stays quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
