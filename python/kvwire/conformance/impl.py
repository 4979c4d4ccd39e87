"""The reference implementation of the conformance subprocess protocol (PROTOCOL.md).

``kvwire conformance impl decode IN.kvw OUT_DIR | encode SPEC.json OUT.kvw |
validate IN.kvw | info`` drives the reference codec exactly as the runner drives any
other implementation; it is the runner's default ``--impl``. Exit status: 0 success,
1 the input was rejected (first line of stdout: the error code, then the rule id),
2 usage error / command not supported. Any other failure (a traceback) is a bug the
runner reports as an error.
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING

import numpy as np

from ..cache.encoder import encode_bytes
from ..cache.files import open as kv_open
from ..cache.kvcache import KVCache
from ..format import registry as R
from ..format.errors import FormatError
from ..format.header import Producer
from ..version import __version__
from . import digests as D
from . import neutral as N

if TYPE_CHECKING:
    from ..cache.sparse import SparseKVCache

PROTOCOL_VERSION = 1
COMMANDS = ("decode", "encode", "validate", "reassemble", "serve")
EXIT_OK, EXIT_REJECTED, EXIT_USAGE = 0, 1, 2


def _reject(exc: FormatError, out) -> int:
    print(f"{exc.code} {exc.rule or ''}".rstrip(), file=out)
    print(str(exc), file=out)
    return EXIT_REJECTED


def write_decoded(reader, out_dir: str) -> dict:
    """Fully validate, decode and write ``decoded.json`` plus one raw file per tensor."""
    reader.validate()
    return write_cache(reader.load(), out_dir, form=reader.form, chunk_count=reader.chunk_count)


def write_cache(cache, out_dir: str, **info) -> dict:
    """``decoded.json`` (with ``info``: form, chunk_count / segments) plus one raw file per tensor."""
    os.makedirs(out_dir, exist_ok=True)
    tensors = []
    for i, comp, x in D.cache_tensors(cache):
        name = D.tensor_file_name(i, comp)
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(D.canonical_bytes(x))
        tensors.append({"layer": i, "component": comp, "shape": list(x.shape), "file": name})
    doc = {"format": N.DECODED_FORMAT, "version": N.MODEL_JSON_VERSION, **info,
           "header": N.header_to_json(cache.header), "tensors": tensors}
    with open(os.path.join(out_dir, "decoded.json"), "w") as f:
        json.dump(doc, f, indent=1)
    return doc


def reassemble_file(path: str):
    """(cache, number of segments) of a byte stream of concatenated segments (KVW-STREAM-3..6)."""
    from ..stream import Reassembler, read_segments

    ra = Reassembler()
    segments = 0
    with open(path, "rb") as f:
        for seg in read_segments(f):
            ra.add(seg)
            segments += 1
    return ra.cache(), segments  # no segment at all: TRUNCATED (KVW-STREAM-10)


def cmd_reassemble(path: str, out_dir: str, out=sys.stdout) -> int:
    try:
        cache, segments = reassemble_file(path)
    except FormatError as exc:
        return _reject(exc, out)
    write_cache(cache, out_dir, form="segments", segments=segments)
    print(f"REASSEMBLED {segments}", file=out)
    return EXIT_OK


def cmd_decode(path: str, out_dir: str, out=sys.stdout) -> int:
    try:
        with kv_open(path) as r:
            write_decoded(r, out_dir)
    except FormatError as exc:
        return _reject(exc, out)
    print("DECODED", file=out)
    return EXIT_OK


def cmd_validate(path: str, out=sys.stdout) -> int:
    try:
        with kv_open(path) as r:
            r.validate()
    except FormatError as exc:
        return _reject(exc, out)
    print("VALID", file=out)
    return EXIT_OK


def read_encode_spec(spec_path: str) -> tuple[KVCache | SparseKVCache, str, str]:
    """(cache, form, codec) described by an encode ``spec.json`` and its tensor files."""
    with open(spec_path) as f:
        spec = json.load(f)
    if spec.get("format") != N.ENCODE_SPEC_FORMAT:
        raise ValueError(f"{spec_path}: not a {N.ENCODE_SPEC_FORMAT} document")
    header = N.header_from_json(spec["header"], producer=Producer())
    base = os.path.dirname(os.path.abspath(spec_path))
    np_dtype = R.DTYPES[header.dtype][2]
    given = {(t["layer"], t["component"]): t for t in spec["tensors"]}
    if header.sparse is not None:  # canonical per-(layer, component) tensors, split by head (spec/sparse.md)
        from ..cache.sparse import SparseKVCache

        arrays = {k: np.fromfile(os.path.join(base, t["file"]), dtype=np.int64 if k[1] == "positions" else np_dtype)
                  .reshape(t["shape"]) for k, t in given.items()}
        return SparseKVCache.from_canonical(header, arrays), spec.get("form", "file"), spec.get("codec", "raw")
    layers = []
    for i, layer_spec in enumerate(header.arch.layers):
        layer = {}
        if layer_spec.kind == "state":  # {"state": {name: array}} in each tensor's dtype (spec/crossmodel.md)
            layer["state"] = {st.name: np.fromfile(os.path.join(base, given[i, f"state.{st.name}"]["file"]),
                                                   dtype=R.DTYPES[st.dtype][2]).reshape(st.shape)
                              for st in layer_spec.state_tensors if header.token_count}
            layers.append(layer)
            continue
        for comp in layer_spec.components:
            t = given[i, comp]
            data = np.fromfile(os.path.join(base, t["file"]), dtype=np.uint8)
            layer[comp] = data.view(np_dtype).reshape(t["shape"])
        layers.append(layer)
    return KVCache(header, layers), spec.get("form", "file"), spec.get("codec", "raw")


def cmd_encode(spec_path: str, out_path: str, out=sys.stdout) -> int:
    cache, form, codec = read_encode_spec(spec_path)
    data = encode_bytes(cache, form=form, codec=codec)
    tmp = out_path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, out_path)
    print(f"ENCODED {len(data)}", file=out)
    return EXIT_OK


def info() -> dict:
    """The ``info`` answer (PROTOCOL.md 1.2); ``format_versions`` (not a protocol field, which the
    runner ignores) lists every format revision this implementation reads and writes: 1.0 and 1.1."""
    return {"name": "kvwire-reference", "version": __version__, "protocol": PROTOCOL_VERSION,
            "commands": list(COMMANDS),
            "format_versions": [f"{R.FORMAT_MAJOR}.{m}" for m in range(R.FORMAT_MINOR_IMPLEMENTED + 1)]}


USAGE = ("usage: impl decode IN.kvw OUT_DIR | encode SPEC.json OUT.kvw | validate IN.kvw | "
         "reassemble IN.kvws OUT_DIR | info | serve")


def serve(inp=None, out=None) -> int:
    """Answer one JSON request per input line: {"id", "args"} -> {"id", "exit", "stdout", "stderr"}.

    Each request behaves exactly like a separate ``impl ARGS...`` process; a command that
    raises anything but a ``FormatError`` is answered like a process that died with a
    traceback (exit 1, nothing on stdout), so the runner classifies it the same way.
    """
    import contextlib
    import io
    import traceback

    inp = sys.stdin if inp is None else inp
    out = sys.stdout if out is None else out
    stray = contextlib.redirect_stdout(sys.stderr)  # stray prints must not corrupt the answers
    for line in inp:
        if not line.strip():
            continue
        req = json.loads(line)
        buf = io.StringIO()
        err = ""
        try:
            args = [str(a) for a in req["args"]]
            with stray:
                code = EXIT_USAGE if args[:1] in (["serve"], ["info"]) else main(args, out=buf)
        except Exception:  # noqa: BLE001 - reported, not hidden: the runner counts it as an error
            code, buf, err = 1, io.StringIO(), traceback.format_exc()
        out.write(json.dumps({"id": req.get("id"), "exit": code, "stdout": buf.getvalue(), "stderr": err}) + "\n")
        out.flush()
    return EXIT_OK


def main(argv=None, out=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    out = sys.stdout if out is None else out
    cmd, args = (argv[0], argv[1:]) if argv else ("", [])
    if cmd == "decode" and len(args) == 2:
        return cmd_decode(args[0], args[1], out)
    if cmd == "encode" and len(args) == 2:
        return cmd_encode(args[0], args[1], out)
    if cmd == "reassemble" and len(args) == 2:
        return cmd_reassemble(args[0], args[1], out)
    if cmd == "validate" and len(args) == 1:
        return cmd_validate(args[0], out)
    if cmd == "serve" and not args:
        return serve()
    if cmd == "info" and not args:
        print(json.dumps(info()), file=out)
        return EXIT_OK
    print(USAGE, file=sys.stderr)
    return EXIT_USAGE
