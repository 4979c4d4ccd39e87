"""The optional native decoders (kvwire.codecs.native over libkvwire) against the numpy
reference: byte-identical output on random lossy, byteplane and zstd chunks, the same
sha256 on every valid conformance vector, the same error code on corrupted bodies, nothing
loaded unless asked for, and two decoding threads equal to one; the native lossy encoder
(``native.encode_lossy``) writes the numpy encoder's bodies and refusals byte for byte.
"""

from __future__ import annotations

import glob
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dualpath
import kvwire
from kvwire import CodecSpec
from kvwire.codecs import byteplane, native, quant
from kvwire.codecs.pipeline import decode_chunk, lossy_range
from kvwire.format import registry as R
from kvwire.format.architecture import Architecture, LayerSpec
from kvwire.format.header import Header

ROOT = Path(__file__).resolve().parents[2]
LIB = ROOT / "build" / "c" / "libkvwire.so"
VECTORS = sorted(glob.glob(str(ROOT / "conformance" / "vectors" / "1.0" / "valid" / "*.kvw")))
FAST = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                      HealthCheck.function_scoped_fixture])


def both(fn):
    """(numpy result, native result) of fn() (tests/dualpath.py)."""
    return dualpath.both(fn, LIB)


def heads_apart(h, codec, si, stored, raw, shape, t0, expected, pad=24):
    """native.decode_heads into a buffer whose heads are ``pad`` guard bytes apart (a chunk's
    token slice of a layer tensor): the same outcome as the contiguous decode (``expected``,
    as dualpath reports it), every head in its place, no guard byte written."""
    heads, run = shape[0], raw // shape[0]
    stride = run + pad
    buf = np.full(heads * stride, 0xAB, np.uint8)
    rec = native.record(h, codec, si, len(stored), raw, shape, 0, t0)
    native.enable(LIB)
    try:
        assert native.decode_heads(h, rec, stored, buf.ctypes.data, (heads - 1) * stride + run, stride)
        got = ("ok", b"".join(buf[i * stride : i * stride + run].tobytes() for i in range(heads)))
    except kvwire.FormatError as e:
        got = ("err", e.code, type(e).__name__, e.rule)
    assert got == expected
    if got[0] == "ok":
        assert all((buf[i * stride + run : (i + 1) * stride] == 0xAB).all() for i in range(heads))


def header(dtype, heads, dim_k, dim_v, tokens, specs=()):
    arch = Architecture((LayerSpec("full_attention", heads, dim_k, dim_v),))
    return Header(arch, token_count=tokens, dtype=dtype, chunk_tokens=256, codec_specs=tuple(specs),
                  required_features=R.REQUIRED_FEATURES["codec_specs"] if specs else 0)


def values(rng, shape, dtype, special):
    x = (rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 30.0])).astype(np.float32)
    if special:
        flat = x.reshape(-1)
        idx = rng.integers(0, flat.size, max(1, flat.size // 50))
        flat[idx] = rng.choice([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e30], idx.size)
    if dtype == "bf16":
        return (x.view("<u4") >> 16).astype("<u2").view(R.DTYPES["bf16"][2])
    with np.errstate(over="ignore"):
        return x.astype({"f16": "<f2", "f32": "<f4"}[dtype])


LOSSY = st.one_of(
    st.builds(lambda f, g: CodecSpec("fp8", fp8_format=f, scale_granularity=g),
              st.sampled_from(["f8_e4m3fn", "f8_e5m2", "f8_e4m3fnuz"]), st.sampled_from(["tensor", "head", "token"])),
    st.builds(lambda b, G, a, s, sd: CodecSpec("int_affine", bits=b, group_size=G, group_axis=a, symmetric=s,
                                               scale_dtype=sd),
              st.sampled_from([2, 4, 8]), st.sampled_from([1, 3, 4, 32, 128]), st.sampled_from(["tokens", "channels"]),
              st.booleans(), st.sampled_from(["f16", "bf16", "f32"])))


@FAST
@given(spec=LOSSY, lossless=st.sampled_from(["raw", "zstd", "byteplane_zstd"]), dtype=st.sampled_from(["bf16", "f16", "f32"]),
       heads=st.integers(1, 4), dim=st.sampled_from([1, 3, 8, 64]), tokens=st.integers(1, 70),
       sink=st.integers(0, 5), resid=st.integers(0, 5), t0=st.sampled_from([0, 256]), special=st.booleans(),
       random_body=st.booleans(), v=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_lossy_identical(lib, spec, lossless, dtype, heads, dim, tokens, sink, resid, t0, special, random_body, v, seed):
    rng = np.random.default_rng(seed)
    from dataclasses import replace
    spec = replace(spec, lossless=lossless, sink_tokens=sink, residual_tokens=resid)
    dim_k, dim_v = (dim + 1, dim) if v else (dim, dim + 1)
    total = t0 + max(tokens, 1)
    h = header(dtype, heads, dim_k, dim_v, total, [spec])
    shape = (heads, tokens, dim)
    lay = quant.layout(spec, dtype, heads, dim, t0, t0 + tokens, *lossy_range(h, 0))
    if random_body:
        body = rng.integers(0, 256, lay.length, dtype=np.uint8).tobytes()
    else:
        x = values(rng, shape, dtype, special)
        try:
            body = b"".join(bytes(memoryview(p).cast("B")) for p in
                            quant.encode(spec, x, lay, dtype, keep_nonfinite=spec.codec == "fp8"))
        except quant.NotFaithful:  # the writer would store it losslessly
            body = rng.integers(0, 256, lay.length, dtype=np.uint8).tobytes()
    stored = body
    if lossless == "zstd":
        stored = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(body)
    elif lossless == "byteplane_zstd":
        stored = b"".join(bytes(memoryview(p).cast("B")) for p in
                          byteplane.encode(body, R.DTYPES[dtype][1], byteplane.plane_compressor()))
    if len(stored) > len(body):
        stored = body
    raw = heads * tokens * dim * R.DTYPES[dtype][1]
    a, b = both(lambda: decode_chunk(h, spec.codec, 1, stored, raw, shape, 0, t0))
    assert a == b
    out = np.zeros(shape, {2: "<u2", 4: "<u4"}[R.DTYPES[dtype][1]])  # decoded in place, both ways
    a2, b2 = both(lambda: decode_chunk(h, spec.codec, 1, stored, raw, shape, 0, t0, out=out))
    assert a2 == b2 == a
    heads_apart(h, spec.codec, 1, stored, raw, shape, t0, a)


@FAST
@given(dtype=st.sampled_from(["bf16", "f16", "f32"]), heads=st.integers(1, 4), dim=st.sampled_from([1, 5, 64]),
       tokens=st.integers(1, 300), special=st.booleans(), codec=st.sampled_from(["zstd", "byteplane_zstd"]),
       seed=st.integers(0, 2**32 - 1))
def test_lossless_identical(lib, dtype, heads, dim, tokens, special, codec, seed):
    rng = np.random.default_rng(seed)
    shape = (heads, tokens, dim)
    x = values(rng, shape, dtype, special)
    raw = x.view(np.uint8).reshape(-1).tobytes()
    if codec == "zstd":
        h, si = header(dtype, heads, dim, dim, tokens), 0
        stored = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(raw)
    else:
        h, si = header(dtype, heads, dim, dim, tokens, [CodecSpec("byteplane_zstd")]), 1
        stored = b"".join(bytes(memoryview(p).cast("B")) for p in
                          byteplane.encode(raw, R.DTYPES[dtype][1], byteplane.plane_compressor()))
    a, b = both(lambda: decode_chunk(h, codec, si, stored, len(raw), shape, 0, 0))
    assert a == b == ("ok", raw)
    buf = bytearray(len(raw))
    a2, b2 = both(lambda: decode_chunk(h, codec, si, stored, len(raw), shape, 0, 0, out=buf))
    assert a2 == b2 == a
    heads_apart(h, codec, si, stored, len(raw), shape, 0, a)


def test_decode_heads_refuses_a_stride_or_span_too_small(lib):
    """kvw_decode_wire_heads checks the caller's geometry before writing anything."""
    h = header("bf16", 2, 8, 8, 4)
    raw = np.arange(2 * 4 * 8, dtype="<u2").tobytes()
    stored = zstandard.ZstdCompressor(write_content_size=True).compress(raw)
    rec = native.record(h, "zstd", 0, len(stored), len(raw), (2, 4, 8), 0, 0)
    buf = np.zeros(1024, np.uint8)
    native.enable(LIB)
    for stride, span in ((63, 200), (80, 80 + 63)):  # a head is 64 bytes
        with pytest.raises(ValueError, match="kvw_decode_wire_heads"):
            native.decode_heads(h, rec, stored, buf.ctypes.data, span, stride)
    assert not buf.any()
    assert native.decode_heads(h, rec, stored, buf.ctypes.data, 80 + 64, 80)
    assert buf[:64].tobytes() == raw[:64] and buf[80:144].tobytes() == raw[64:] and not buf[64:80].any()


def _digest(path) -> str:
    c = kvwire.load(path)
    hs = hashlib.sha256()

    def walk(x):
        if isinstance(x, dict):
            for k in sorted(x, key=str):
                hs.update(str(k).encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif isinstance(x, np.ndarray):
            hs.update(str(x.dtype).encode() + str(x.shape).encode())
            hs.update(np.ascontiguousarray(x).tobytes())
        else:
            hs.update(np.asarray(x).tobytes())
    walk(c.layers)
    return hs.hexdigest()


def test_conformance_vectors_same_sha256(lib, monkeypatch):
    assert len(VECTORS) > 50
    native.disable()
    ref = [_digest(p) for p in VECTORS]
    calls = []
    for name in ("decode_wire", "decode_heads"):  # a chunk in place, or its heads into a layer's token slice
        real = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    native.enable(LIB)
    try:
        got = [_digest(p) for p in VECTORS]
    finally:
        native.disable()
    assert got == ref
    assert len(calls) > 100  # the vectors' zstd, byteplane and lossy chunks went through C


def _corrupt_cases():
    rng = np.random.default_rng(7)
    shape = (2, 40, 16)
    x = values(rng, shape, "bf16", False)
    raw = x.view(np.uint8).reshape(-1).tobytes()
    z = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(raw)
    z_short = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(raw[:-2])
    h0 = header("bf16", 2, 16, 16, 40)
    bp_spec = CodecSpec("byteplane_zstd")
    hb = header("bf16", 2, 16, 16, 40, [bp_spec])
    bp = b"".join(bytes(memoryview(p).cast("B")) for p in byteplane.encode(raw, 2, byteplane.plane_compressor()))
    int_spec = CodecSpec("int_affine", bits=4, group_size=32, lossless="zstd")
    hi = header("bf16", 2, 16, 16, 40, [int_spec])
    lay = quant.layout(int_spec, "bf16", 2, 16, 0, 40, 0, 40)
    body = b"".join(bytes(memoryview(p).cast("B")) for p in quant.encode(int_spec, x, lay, "bf16"))
    lz = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(body)
    fp_spec = CodecSpec("fp8")
    hf = header("bf16", 2, 16, 16, 40, [fp_spec])
    flay = quant.layout(fp_spec, "bf16", 2, 16, 0, 40, 0, 40)
    return [
        ("zstd garbage", h0, "zstd", 0, b"\x00" * 50),
        ("zstd size declared short", h0, "zstd", 0, z_short),
        ("zstd truncated", h0, "zstd", 0, z[:-7]),
        ("zstd flipped block", h0, "zstd", 0, z[:20] + bytes([z[20] ^ 0xFF]) + z[21:]),
        ("byteplane lengths", hb, "byteplane_zstd", 1, b"\xff\xff\x00\x00" + bp[4:]),
        ("byteplane truncated", hb, "byteplane_zstd", 1, bp[:-9]),
        ("int_affine stage truncated", hi, "int_affine", 1, lz[:-5]),
        ("int_affine stage size", hi, "int_affine", 1,
         zstandard.ZstdCompressor(level=3, write_content_size=True).compress(body[:-1])),
        ("fp8 body too long", hf, "fp8", 1, b"\x01" * (flay.length + 3)),
        ("fp8 stage-less short body", hf, "fp8", 1, b"\x01" * (flay.length - 3)),
    ], shape, len(raw)


def test_corrupted_bodies_same_code(lib):
    cases, shape, raw_length = _corrupt_cases()
    seen = set()
    for name, h, codec, si, stored in cases:
        a, b = both(lambda h=h, codec=codec, si=si, stored=stored: decode_chunk(h, codec, si, stored, raw_length,
                                                                            shape, 0, 0))
        assert a[0] == "err", name
        assert a == b, name
        seen.add(a[1])
    assert {"DECODE_FAILED", "DECODED_SIZE_MISMATCH"} <= seen


def _in_child(code: str, *args, env_native: str | None = None):
    """``code`` in a fresh interpreter on the checkout's package, KVWIRE_NATIVE set to
    ``env_native`` (None: unset); returns the finished process."""
    env = {k: v for k, v in os.environ.items() if k != "KVWIRE_NATIVE"}
    env["PYTHONPATH"] = str(ROOT / "python")
    if env_native is not None:
        env["KVWIRE_NATIVE"] = env_native
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=120, check=False)


LOADED = ("import sys, kvwire; from kvwire.codecs import native; kvwire.load(sys.argv[1]); "
          "maps = open('/proc/self/maps').read(); print(native.available(), 'libkvwire' in maps); "
          "print(native.status())")


def test_on_by_default_and_off_with_zero(lib):
    """Issue 35 item 2: libkvwire decodes unless KVWIRE_NATIVE=0 (then it is not even mapped)."""
    r = _in_child(LOADED, VECTORS[0])
    assert r.returncode == 0 and not r.stderr, r.stderr
    assert r.stdout.splitlines()[0].split() == ["True", "True"]
    assert r.stdout.splitlines()[1] == f"native (libkvwire {kvwire.__version__}, {LIB}); KVWIRE_NATIVE=0 for numpy"
    for on in ("1", str(LIB)):
        assert _in_child(LOADED, VECTORS[0], env_native=on).stdout.split()[:2] == ["True", "True"]
    r = _in_child(LOADED, VECTORS[0], env_native="0")
    assert r.returncode == 0 and not r.stderr, r.stderr
    assert r.stdout.splitlines() == ["False False", "numpy (KVWIRE_NATIVE=0)"]


def _library(tmp_path, name: str, source: str) -> Path:
    """A shared library compiled from ``source`` (the C toolchain the lib fixture checked)."""
    c, so = tmp_path / f"{name}.c", tmp_path / f"{name}.so"
    c.write_text(source)
    subprocess.run([os.environ.get("CC", "gcc"), "-shared", "-fPIC", "-o", str(so), str(c)], check=True, timeout=120)
    return so


def test_a_library_that_cannot_be_used_is_one_warning_and_numpy(lib, tmp_path):
    """Issue 35 item 2: a missing file, a file that is not a library, another version's
    libkvwire and one without this version's functions: each is one RuntimeWarning naming
    the path and the reason, the numpy path decodes, nothing raises; `kvwire --version`
    says why numpy is active."""
    junk = tmp_path / "junk.so"
    junk.write_bytes(b"\x7fELF not really" * 64)
    other = _library(tmp_path, "other", 'const char *kvw_version(void) { return "0.0.1"; }\n')
    partial = _library(tmp_path, "partial", f'const char *kvw_version(void) {{ return "{kvwire.__version__}"; }}\n')
    cases = {tmp_path / "absent.so": "not found", junk: "", other: f"libkvwire 0.0.1, this package is kvwire "
             f"{kvwire.__version__}", partial: "not this version's libkvwire"}
    for path, why in cases.items():
        r = _in_child(LOADED, VECTORS[0], env_native=str(path))
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.count("RuntimeWarning") == 1 and str(path) in r.stderr and why in r.stderr, r.stderr
        first, status = r.stdout.splitlines()
        assert first == "False False" and status.startswith(f"numpy (libkvwire failed to load: {path}"), r.stdout
        v = _in_child("from kvwire.tools.cli import main; main(['--version'])", env_native=str(path))
        assert v.returncode == 0 and "Traceback" not in v.stderr, v.stderr
        assert f"codecs: numpy (libkvwire failed to load: {path}" in v.stdout, v.stdout


def test_enable_refuses_what_import_would_warn_about(lib, tmp_path):
    """native.enable() is an explicit request: it raises OSError (native stays as it was)."""
    before = native.library()
    with pytest.raises(OSError, match="not found"):
        native.enable(tmp_path / "absent.so")
    assert native.library() == before


def test_decode_chunks_two_threads_equal_one(lib):
    rng = np.random.default_rng(3)
    spec = CodecSpec("int_affine", bits=8, group_size=32, lossless="zstd")
    heads, dim, T = 4, 64, 64
    h = header("bf16", heads, dim, dim, T * 16, [spec])
    items = []
    for c in range(16):
        x = values(rng, (heads, T, dim), "bf16", False)
        lay = quant.layout(spec, "bf16", heads, dim, c * T, (c + 1) * T, 0, T * 16)
        body = b"".join(bytes(memoryview(p).cast("B")) for p in quant.encode(spec, x, lay, "bf16"))
        stored = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(body)
        raw = heads * T * dim * 2
        rec = native.record(h, "int_affine", 1, len(stored), raw, (heads, T, dim), 0, c * T)
        items.append((rec, stored, raw))
    native.enable(LIB)
    try:
        one = native.decode_chunks(h, [(r, s, np.empty(n, np.uint8)) for r, s, n in items], threads=1)
        two = native.decode_chunks(h, [(r, s, np.empty(n, np.uint8)) for r, s, n in items], threads=2)
        ref = []
        native.disable()
        for c, (_r, s, n) in enumerate(items):
            ref.append(bytes(decode_chunk(h, "int_affine", 1, s, n, (heads, T, dim), 0, c * T)))
    finally:
        native.disable()
    assert [bytes(a) for a in one] == [bytes(b) for b in two] == ref


def _extreme_values(rng, shape, dtype, kind):
    """Chunk values for the encoder: ordinary, near a dtype's extremes (the careful path),
    zero groups, or holding NaN / infinity (both encoders refuse)."""
    x = values(rng, shape, dtype, False).astype(np.float32)
    flat = x.reshape(-1)
    big = {"bf16": 3e38, "f16": 6e4, "f32": 3e38}[dtype]
    tiny = {"bf16": 1e-38, "f16": 1e-7, "f32": 1e-44}[dtype]
    idx = rng.integers(0, flat.size, max(1, flat.size // 20))
    if kind == "extreme":
        flat[idx] = rng.choice([big, -big, tiny, -tiny, 0.0, -0.0], idx.size)
    elif kind == "zeros":
        x[:, : max(1, shape[1] // 2)] = rng.choice([0.0, -0.0])
        flat[idx] = -0.0
    elif kind == "nonfinite":
        flat[idx] = rng.choice([np.nan, np.inf, -np.inf], idx.size)
    if dtype == "bf16":
        return (x.view("<u4") >> 16).astype("<u2").view(R.DTYPES["bf16"][2])
    with np.errstate(over="ignore"):
        return x.astype({"f16": "<f2", "f32": "<f4"}[dtype])


def _encode_both(h, spec, x, lay, dtype, rec):
    """(numpy body or "refused", native body or "refused")."""
    try:
        a = b"".join(bytes(memoryview(p).cast("B")) for p in quant.encode(spec, x, lay, dtype))
    except quant.NotFaithful:
        a = "refused"
    native.enable(LIB)
    try:
        b = bytes(native.encode_lossy(h, rec, x.view(np.uint8).reshape(-1)))
    except quant.NotFaithful:
        b = "refused"
    finally:
        native.disable()
    return a, b


@FAST
@given(spec=LOSSY, dtype=st.sampled_from(["bf16", "f16", "f32"]), heads=st.integers(1, 4),
       dim=st.sampled_from([1, 3, 8, 64, 128]), tokens=st.integers(1, 70), sink=st.integers(0, 5),
       resid=st.integers(0, 5), t0=st.sampled_from([0, 256]), kind=st.sampled_from(["plain", "extreme", "zeros",
                                                                                   "nonfinite"]),
       seed=st.integers(0, 2**32 - 1))
def test_encode_lossy_identical(lib, spec, dtype, heads, dim, tokens, sink, resid, t0, kind, seed):
    """native.encode_lossy writes the numpy encoder's body byte for byte, and refuses
    (NotFaithful) the same chunks, on the fused path and the careful one."""
    from dataclasses import replace
    rng = np.random.default_rng(seed)
    spec = replace(spec, sink_tokens=sink, residual_tokens=resid)
    h = header(dtype, heads, dim, dim, t0 + tokens, [spec])
    shape = (heads, tokens, dim)
    lay = quant.layout(spec, dtype, heads, dim, t0, t0 + tokens, *lossy_range(h, 0))
    x = _extreme_values(rng, shape, dtype, kind)
    rec = native.record(h, spec.codec, 1, 0, x.nbytes, shape, 0, t0)
    a, b = _encode_both(h, spec, x, lay, dtype, rec)
    assert a == b
    if not np.isfinite(x[:, lay.P : lay.P + lay.M].astype(np.float32)).all():
        assert a == "refused"  # KVW-LOSSY-6 (NaN / inf in kept tokens are stored as they are)
    if a != "refused":  # into a caller's buffer, longer than the body
        native.enable(LIB)
        try:
            out = np.full(len(a) + 7, 0xAB, np.uint8)
            got = native.encode_lossy(h, rec, x.view(np.uint8).reshape(-1), out=out)
            assert bytes(got) == a and out[len(a):].tolist() == [0xAB] * 7
        finally:
            native.disable()


def test_encode_lossy_off_and_short_buffer(lib):
    """None when native is off; a too-short out is an argument error, not a partial body."""
    spec = CodecSpec("int_affine", bits=4, group_size=32, group_axis="tokens", symmetric=False, scale_dtype="f16")
    h = header("bf16", 2, 64, 64, 64, [spec])
    x = values(np.random.default_rng(1), (2, 64, 64), "bf16", False)
    rec = native.record(h, "int_affine", 1, 0, x.nbytes, (2, 64, 64), 0, 0)
    native.disable()
    assert native.encode_lossy(h, rec, x.view(np.uint8).reshape(-1)) is None
    native.enable(LIB)
    try:
        with pytest.raises(ValueError, match="needs"):
            native.encode_lossy(h, rec, x.view(np.uint8).reshape(-1), out=np.zeros(10, np.uint8))
    finally:
        native.disable()


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("kind", ["plain", "extreme", "zeros", "edge"])
def test_encode_lossy_channels_identical(lib, dtype, kind):
    """Groups along channels (the AVX2 kernels where G and D are multiples of 8, the
    portable loops otherwise): the numpy encoder's body or refusal byte for byte, for
    partial tail groups, G above D, G = 1, one token, signed zeros and values near the
    dtypes' ends (1e-30, 6e4: scales rounded up, NotFaithful), every bit width and scale
    dtype, symmetric or not."""
    geoms = [(8, 24, 5), (16, 40, 3), (32, 8, 1), (8, 8, 1), (24, 64, 7), (32, 128, 9), (128, 128, 2),
             (1, 8, 3), (3, 16, 4), (32, 72, 2)]
    rng = np.random.default_rng(18 + len(dtype) + len(kind))
    for G, D, M in geoms:
        for bits in (2, 4, 8):
            for sym in (False, True):
                for sd in ("bf16", "f16", "f32"):
                    spec = CodecSpec("int_affine", bits=bits, group_size=G, group_axis="channels", symmetric=sym,
                                     scale_dtype=sd)
                    h = header(dtype, 2, D, D, M, [spec])
                    lay = quant.layout(spec, dtype, 2, D, 0, M, *lossy_range(h, 0))
                    if kind == "edge":
                        x = values(rng, (2, M, D), dtype, False).astype(np.float32)
                        flat = x.reshape(-1)
                        idx = rng.integers(0, flat.size, max(1, flat.size // 8))
                        flat[idx] = rng.choice([1e-30, -1e-30, 6e4, -6e4, 0.0, -0.0, 1e-7], idx.size)
                        x = (x.view("<u4") >> 16).astype("<u2").view(R.DTYPES["bf16"][2]) if dtype == "bf16" else \
                            x.astype({"f16": "<f2", "f32": "<f4"}[dtype])
                    else:
                        x = _extreme_values(rng, (2, M, D), dtype, kind)
                    rec = native.record(h, spec.codec, 1, 0, x.nbytes, x.shape, 0, 0)
                    a, b = _encode_both(h, spec, x, lay, dtype, rec)
                    assert a == b, (G, D, M, bits, sym, sd)
