#!/usr/bin/env python3
"""Differential campaign: libkvwire (system libzstd) and the numpy path (python-zstandard's
bundled libzstd) must decode every valid container to the same tensors (spec section 19,
"One meaning for every valid container"; KVW-CODEC-4, KVW-CODEC-5, revision 1.4).

    python conformance/fuzz/zstd_agreement.py --cases 100000          # the campaign (make zstd-agreement)
    python conformance/fuzz/zstd_agreement.py --cases 2000 --minor 0  # frames of a 1.0-1.3 writer

Why it exists: the record checksum covers a body's compressed bytes only, and two zstd
decoders read some corrupt frames differently without noticing (libzstd 1.5.4 and 1.5.7
disagree on the last literal of a corrupted Huffman stream), so the same container, every
checksum valid, decoded to different tensors with native decoding on and off. Each case
here is one chunk body, mutated (bit flips, byte changes, bytes cut out of or inserted into
the frame, truncation, extension), of a container of codec raw, zstd or byteplane_zstd (and
int_affine with a zstd stage). A body whose record checksum is recomputed is a valid
container as far as every check before decoding goes, so decoding the body alone, with the
container's header, is what a reader does with that container; ``--containers K`` also
rebuilds every K-th case as a whole container (tests/forge.py) and reads it end to end both
ways. Outcomes per case: both reject, both accept the same bytes, both accept different
bytes (the bug: must be 0), or only one accepts (counted; expected 0 with content checksums).

``--minor 0`` strips the content checksums the writer now adds and declares the container's
own minor: the frames of a 1.0-1.3 writer, for which section 19 promises less.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import zstandard

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))

import forge
import kvwire
from kvwire.codecs import decode_chunk, native
from kvwire.format import registry as R
from kvwire.format.errors import FormatError
from kvwire.format.header import Architecture, Header, LayerSpec

OUTCOMES = ("both_reject", "both_same", "both_differ", "numpy_only", "native_only")


@dataclass
class Source:
    """One container and the chunk bodies the campaign mutates."""
    name: str
    data: bytes
    header: object
    chunks: list  # (ChunkInfo, codec_spec index, stored bytes)


@dataclass
class Counts:
    cases: int = 0
    outcomes: dict = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    codes: dict = field(default_factory=dict)  # (numpy code, native code) -> count, both rejected
    containers: int = 0  # cases also read as whole containers
    examples: list = field(default_factory=list)  # first disagreements: (source, chunk, mutation)

    def as_json(self) -> dict:
        return {"cases": self.cases, "containers": self.containers, "outcomes": self.outcomes,
                "codes": {f"{a}/{b}": n for (a, b), n in sorted(self.codes.items())}, "examples": self.examples[:20]}


def _strip_checksums(stored: bytes, codec: str, width: int) -> bytes:
    """``stored`` with every zstd frame re-encoded without a content checksum (a 1.0-1.3 writer)."""
    cctx = zstandard.ZstdCompressor(level=3, write_content_size=True, write_checksum=False)
    d = zstandard.ZstdDecompressor()
    if stored[:4] == b"\x28\xb5\x2f\xfd":  # a zstd body or lossless stage
        return cctx.compress(d.decompress(stored))
    if codec != "byteplane_zstd":  # a lossy body stored without its stage
        return stored
    n_lens = 4 * width
    lens = np.frombuffer(stored[:n_lens], "<u4")
    out, at = [], n_lens
    for ln in lens:
        piece = stored[at : at + int(ln)]
        at += int(ln)
        if piece[:4] == b"\x28\xb5\x2f\xfd":
            piece = cctx.compress(d.decompress(piece))
        out.append(piece)
    new_lens = np.array([len(p) for p in out], "<u4").tobytes()
    return new_lens + b"".join(out) + stored[at:]


def _cache(h, seed: int, compressible: bool) -> kvwire.KVCache:
    """KV-like values (normal, a few outliers): exponent bytes that zstd shrinks, noisy
    mantissas that it codes as Huffman literals, the frames where decoders differed."""
    if compressible:
        return forge.random_cache(h, seed, compressible=True)
    rng = np.random.default_rng(seed)
    dt = R.DTYPES[h.dtype][2]
    layers = []
    for s, r in zip(h.arch.layers, h.layer_tokens):
        layers.append({c: (rng.standard_normal(s.shape(c, r.count)) * rng.choice([0.05, 1.0, 8.0])).astype(np.float32)
                       .astype(dt) for c in s.components})
    return kvwire.KVCache(h, layers)


def sources(minor: int | None = None) -> list[Source]:
    """The containers whose bodies are mutated: raw, zstd, byteplane_zstd (bf16, f16, f32) and
    int_affine with a zstd stage, compressible and noisy data, small and 64 KiB chunks."""
    out = []
    full = lambda h, d: LayerSpec("full_attention", h, d, d)
    for name, dtype, heads, dim, tokens, chunk, codec, compressible in (
            ("raw-f16", "f16", 2, 16, 20, 16, "raw", False),
            ("zstd-f16", "f16", 2, 64, 300, 256, "zstd", False),
            ("zstd-bf16-compressible", "bf16", 2, 32, 64, 64, "zstd", True),
            ("byteplane-bf16", "bf16", 4, 64, 128, 128, "byteplane", False),
            ("byteplane-f16", "f16", 2, 64, 96, 64, "byteplane", False),
            ("byteplane-f32", "f32", 2, 32, 64, 64, "byteplane", False),
            ("int4-zstd-stage", "bf16", 2, 64, 64, 64, "int4-g32-zstd", False)):
        h = Header(Architecture((full(heads, dim),)), token_count=tokens, dtype=dtype, chunk_tokens=chunk)
        c = _cache(h, 4100 + len(out), compressible)
        data = kvwire.encode(c, codec=codec, form="stream")
        if minor is not None:  # frames without a content checksum, under the given minor
            p = forge.split(data)
            hp = kvwire.probe(data)
            width = hp.itemsize
            with kvwire.open(data) as r:
                infos = [r.info(i) for i in range(r.chunk_count)]
            p.bodies = [b if ci.codec == "raw" else _strip_checksums(bytes(b), ci.codec, width)
                        for ci, b in zip(infos, p.bodies)]
            p.header = forge.header_of(replace(hp, format_minor=minor))
            data = forge.patch_preamble(forge.assemble(p), minor=minor)
        with kvwire.open(data) as r:
            hdr = r.header
            chunks = []
            for i in range(r.chunk_count):
                info, stored = r.stored(i)
                chunks.append((info, int(r.records["reserved0"][i]) if hdr.codec_specs else 0, bytes(stored)))
        out.append(Source(name, data, hdr, chunks))
    return out


def mutate(rng: random.Random, body: bytes) -> tuple[bytes, str]:
    """One mutation of ``body``: (mutated bytes, description)."""
    b = bytearray(body)
    n = len(b)
    kind = rng.randrange(6)
    if kind == 0 or n < 2:  # bit flip
        p = rng.randrange(n)
        b[p] ^= 1 << rng.randrange(8)
        return bytes(b), f"flip {p}"
    if kind == 1:  # byte change
        p = rng.randrange(n)
        b[p] = rng.randrange(256)
        return bytes(b), f"set {p}"
    if kind == 2:  # a few bytes cut out
        p, k = rng.randrange(n), rng.randrange(1, 5)
        del b[p : p + k]
        return bytes(b), f"cut {p}+{k}"
    if kind == 3:  # a few bytes inserted
        p, k = rng.randrange(n + 1), rng.randrange(1, 5)
        b[p:p] = bytes(rng.randrange(256) for _ in range(k))
        return bytes(b), f"insert {p}+{k}"
    if kind == 4:  # truncated or extended
        k = rng.randrange(1, 9)
        return (bytes(b[:-k]) if rng.randrange(2) and n > k else bytes(b) + bytes(rng.randrange(256) for _ in range(k)),
                f"end {k}")
    flips = rng.randrange(2, 6)  # several changes
    for _ in range(flips):
        b[rng.randrange(n)] = rng.randrange(256)
    return bytes(b), f"multi {flips}"


def _decode(src: Source, info, spec: int, stored: bytes):
    """(decoded bytes, None) or (None, error code) through whichever path is enabled."""
    try:
        got = decode_chunk(src.header, info.codec, spec, stored, info.raw_length, info.shape, info.layer,
                           info.token_start)
        return bytes(memoryview(got).cast("B")), None
    except FormatError as exc:
        return None, exc.code


def _whole(src: Source, idx: int, stored: bytes):
    """Read the container with chunk ``idx``'s body replaced, end to end: tensors or code."""
    p = forge.split(src.data)
    p.bodies[idx] = stored
    data = forge.assemble(p)
    try:
        c = forge.read_all(data)
        return b"".join(np.ascontiguousarray(t).tobytes() for layer in c.layers for t in layer.values()), None
    except FormatError as exc:
        return None, exc.code


def run(cases: int, seed: int = 0, *, minor: int | None = None, containers: int = 0,
        lib: str | None = None) -> Counts:
    """``cases`` mutated bodies decoded both ways; every ``containers``-th also as a container."""
    srcs = sources(minor)
    rng = random.Random(seed)
    plan = []
    for _ in range(cases):
        s = rng.randrange(len(srcs))
        idx = rng.randrange(len(srcs[s].chunks))
        body, what = mutate(rng, srcs[s].chunks[idx][2])
        plan.append((s, idx, body, what))
    was_on = native.available()
    results = {}
    try:
        for mode in ("numpy", "native"):
            if mode == "native":
                native.enable(lib)
            else:
                native.disable()
            got = []
            for k, (s, idx, body, _) in enumerate(plan):
                info, spec, _stored = srcs[s].chunks[idx]
                src = srcs[s]
                r = _decode(src, info, spec, body)
                w = _whole(src, idx, body) if containers and k % containers == 0 else None
                got.append((r, w))
            results[mode] = got
    finally:
        native.disable()
        if was_on:
            native.enable(lib)
    counts = Counts(cases=cases)
    for k, (s, idx, _body, what) in enumerate(plan):
        for (a, ea), (b, eb) in [(results["numpy"][k][0], results["native"][k][0])] + (
                [(results["numpy"][k][1], results["native"][k][1])] if results["numpy"][k][1] is not None else []):
            out = ("both_reject" if a is None and b is None else "numpy_only" if b is None else
                   "native_only" if a is None else "both_same" if a == b else "both_differ")
            counts.outcomes[out] += 1
            if out == "both_reject":
                counts.codes[(ea, eb)] = counts.codes.get((ea, eb), 0) + 1
            elif out != "both_same":
                counts.examples.append({"source": srcs[s].name, "chunk": idx, "mutation": what, "outcome": out,
                                        "codes": [ea, eb]})
        counts.containers += results["numpy"][k][1] is not None
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minor", type=int, default=None,
                    help="strip the content checksums and declare this minor (e.g. 0: a 1.0-1.3 writer's frames)")
    ap.add_argument("--containers", type=int, default=100, help="every K-th case also as a whole container (0: none)")
    ap.add_argument("--lib", default=None, help="libkvwire.so (default: the checkout's build/c/libkvwire.so)")
    ap.add_argument("--json", default=None, help="write the counts here")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    counts = run(a.cases, a.seed, minor=a.minor, containers=a.containers, lib=a.lib)
    res = counts.as_json() | {"seconds": round(time.perf_counter() - t0, 1), "seed": a.seed, "minor": a.minor,
                              "zstd": {"numpy": ".".join(map(str, zstandard.ZSTD_VERSION)), "native": "system libzstd"}}
    text = json.dumps(res, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text + "\n")
    bad = counts.outcomes["both_differ"]
    one = counts.outcomes["numpy_only"] + counts.outcomes["native_only"]
    print(f"RESULT: {'FAIL' if bad or one else 'PASS'}: {bad} containers decoded to different tensors; "
          f"{one} accepted by one path only", file=sys.stderr)
    return 1 if bad or one else 0  # the same verdict as tests/format/test_zstd_agreement.py


if __name__ == "__main__":
    sys.exit(main())
