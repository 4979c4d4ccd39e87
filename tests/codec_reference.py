"""A slow, literal decoder of spec/codecs.md, written from the text alone.

Element by element with Python integers and ``struct``: no numpy broadcasting, no
ml_dtypes, no code shared with ``kvwire.codecs.quant``/``kvwire.codecs.byteplane``. Tests and the
conformance generator compare the reference codec's bytes with it.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import zstandard

SIZES = {"bf16": 2, "f16": 2, "f32": 4}
CANON_NAN = {"bf16": b"\xc0\x7f", "f16": b"\x00\x7e", "f32": b"\x00\x00\xc0\x7f"}


def f32(x: float) -> float:
    """Round a Python float to fp32 (nearest, ties to even)."""
    return float(np.float32(x))


def fp8_value(code: int, fmt: str) -> float:
    s = -1.0 if code & 0x80 else 1.0
    if fmt == "f8_e5m2":
        e, m = (code >> 2) & 0x1F, code & 3
        if e == 31:
            return math.nan if m else s * math.inf
        return s * (m / 4) * 2.0 ** -14 if e == 0 else s * (1 + m / 4) * 2.0 ** (e - 15)
    e, m = (code >> 3) & 0xF, code & 7
    if fmt == "f8_e4m3fn":
        if e == 15 and m == 7:
            return math.nan
        return s * (m / 8) * 2.0 ** -6 if e == 0 else s * (1 + m / 8) * 2.0 ** (e - 7)
    if code == 0x80:  # e4m3fnuz
        return math.nan
    return s * (m / 8) * 2.0 ** -7 if e == 0 else s * (1 + m / 8) * 2.0 ** (e - 8)


def param(raw: bytes, dtype: str) -> float:
    if dtype == "f32":
        return struct.unpack("<f", raw)[0]
    if dtype == "f16":
        return struct.unpack("<e", raw)[0]
    return struct.unpack("<f", b"\0\0" + raw)[0]  # bf16: the upper half of an fp32


def to_dtype(x: float, dtype: str) -> bytes:
    """KVW-LOSSY-4: fp32 value -> header dtype, nearest-even, canonical NaN."""
    if math.isnan(x):
        return CANON_NAN[dtype]
    if dtype == "f32":
        return struct.pack("<f", x)
    if dtype == "f16":
        try:
            return struct.pack("<e", x)
        except OverflowError:
            return struct.pack("<e", math.copysign(math.inf, x))
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    if math.isinf(x):
        return struct.pack("<H", bits >> 16)
    low, high = bits & 0xFFFF, bits >> 16
    if low > 0x8000 or (low == 0x8000 and high & 1):
        high += 1  # carries into the exponent: the largest finite rounds up to infinity
    return struct.pack("<H", high)


def byteplane_decode(body: bytes, length: int, w: int) -> bytes:
    n, r = divmod(length, w)
    assert len(body) >= 4 * w
    lens = struct.unpack_from(f"<{w}I", body, 0)
    assert len(body) == 4 * w + sum(lens) + r
    planes, at = [], 4 * w
    for ln in lens:
        piece = body[at : at + ln]
        at += ln
        assert ln <= n
        if ln < n:
            assert zstandard.frame_content_size(piece) == n
            piece = zstandard.ZstdDecompressor().decompress(piece)
        planes.append(piece)
    out = bytearray(length)
    for e in range(n):
        for j in range(w):
            out[e * w + (w - 1 - j)] = planes[j][e]
    out[n * w:] = body[at:]
    return bytes(out)


def token_split(spec, t0, t1, lo, hi):
    """(P, Q): sink tokens of the chunk, then residual tokens not already counted as sink."""
    P = sum(1 for t in range(t0, t1) if t < lo + spec.sink_tokens)
    Q = sum(1 for t in range(t0 + P, t1) if t >= hi - spec.residual_tokens)
    return P, Q


# KVW-ROT-4's table, copied from the spec: upper half of C_b as fp32 bit patterns
LEVELS_HEX = {2: "3EE7D2C9 3FC1555D", 3: "3E7AF9F8 3F418990 3FAC0538 4009B97A",
              4: "3E0379FD 3EC6AE44 3F28215E 3F713D39 3FA0CC2F 3FCF1C25 40046AC7 402EE2BF"}


def gaussian_level(b: int, u: int) -> float:
    upper = [struct.unpack("<f", struct.pack("<I", int(x, 16)))[0] for x in LEVELS_HEX[b].split()]
    half = 1 << (b - 1)
    return upper[u - half] if u >= half else -upper[half - 1 - u]


# KVW-TQ-4's tables, copied from the spec: (bits, log2(D) odd) -> upper half of L
TQ_LEVELS_HEX = {(3, True): "3CB16317 3D88C955 3DF3243D 3E42A09F",
                 (3, False): "3CFADCFB 3DC171FC 3E2BED53 3E899F54",
                 (4, True): "3C39FBAE 3D0C8559 3D6DD0E1 3DAA99F2 3DE3682B 3E126F17 3E3B36E7 3E772CC4",
                 (4, False): "3C83828A 3D46B9FF 3DA82948 3DF1444A 3E20CD0C 3E4F16C0 3E846170 3EAEC76E"}


def turboquant_row(codes: list, s: float, b: int) -> list:
    """KVW-TQ-4 on one row: L[u], the squares added in order, 1 / sqrt, then (v * inv) * s."""
    D = len(codes)
    upper = [struct.unpack("<f", struct.pack("<I", int(x, 16)))[0]
             for x in TQ_LEVELS_HEX[b, (D.bit_length() - 1) % 2 == 1].split()]
    half = 1 << (b - 1)
    v = [upper[u - half] if u >= half else -upper[half - 1 - u] for u in codes]
    n = 0.0
    for x in v:
        n = f32(n + f32(x * x))
    inv = f32(1.0 / f32(math.sqrt(n)))
    return [f32(f32(x * inv) * s) for x in v]


def splitmix_signs(seed: int, n: int) -> list:
    """KVW-ROT-5, literally."""
    mask = (1 << 64) - 1
    state, out = seed, []
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z = z ^ (z >> 31)
        out.append(-1.0 if z >> 63 else 1.0)
    return out


def hadamard_inverse(y: list, seed: int, signed: bool = True) -> list:
    """KVW-ROT-6 on one row of fp32 values (Python floats), one fp32 rounding per operation
    (``signed=False``: every sign +1, KVW-TQ-3)."""
    D = len(y)
    B = D & -D
    k = B.bit_length() - 1
    c = 2.0 ** (-k // 2) if k % 2 == 0 else 2.0 ** (-(k - 1) // 2) * struct.unpack("<f", bytes.fromhex("f304353f"))[0]
    c = f32(c)
    y = list(y)
    for j in range(D // B):
        h = 1
        while h < B:
            for i in range(j * B, (j + 1) * B):
                if (i - j * B) & h == 0:
                    a, b = y[i], y[i + h]
                    y[i], y[i + h] = f32(a + b), f32(a - b)
            h *= 2
    sigma = splitmix_signs(seed, D) if signed else [1.0] * D
    return [f32(f32(y[d] * c) * sigma[d]) for d in range(D)]


def decode(spec, dtype: str, stored: bytes, H: int, T: int, D: int, t0: int, lo: int, hi: int) -> bytes:
    """Decoded bytes [H, T, D] of one chunk whose record names ``spec``."""
    w = SIZES.get(dtype, 1)
    if spec.codec == "byteplane_zstd":
        return byteplane_decode(stored, H * T * D * w, w)
    P, Q = token_split(spec, t0, t0 + T, lo, hi)
    M = T - P - Q
    if spec.codec == "fp8":
        nscales = {"tensor": 1, "head": H, "token": H * M}[spec.scale_granularity] if M else 0
        length = H * (P + Q) * D * w + 4 * nscales + H * M * D
    else:
        G = spec.group_size
        ng = H * -(-M // G) * D if spec.group_axis == "tokens" else H * M * -(-D // G)
        ps = {"f16": 2, "bf16": 2, "f32": 4}[spec.scale_dtype]
        nparams = ng * (1 if spec.symmetric else 2) if M else 0
        length = H * (P + Q) * D * w + nparams * ps + -(-H * M * D * spec.bits // 8)
    body = stored
    if len(stored) != length:
        assert len(stored) < length and spec.lossless != "raw"
        if spec.lossless == "zstd":
            body = zstandard.ZstdDecompressor().decompress(stored)
        else:
            body = byteplane_decode(stored, length, w)
    assert len(body) == length
    sink = body[: H * P * D * w]
    resid = body[H * P * D * w : H * (P + Q) * D * w]
    at = H * (P + Q) * D * w
    out = [[[b""] * D for _ in range(T)] for _ in range(H)]
    for h in range(H):
        for t in range(P):
            for d in range(D):
                i = ((h * P) + t) * D + d
                out[h][t][d] = sink[i * w : (i + 1) * w]
        for t in range(Q):
            for d in range(D):
                i = ((h * Q) + t) * D + d
                out[h][P + M + t][d] = resid[i * w : (i + 1) * w]
    if M and spec.codec == "fp8":
        scales = [struct.unpack_from("<f", body, at + 4 * k)[0] for k in range(nscales)]
        at += 4 * nscales
        for h in range(H):
            for m in range(M):
                for d in range(D):
                    code = body[at + (h * M + m) * D + d]
                    s = {"tensor": 0, "head": h, "token": h * M + m}[spec.scale_granularity]
                    assert math.isfinite(scales[s]) and scales[s] > 0
                    out[h][P + m][d] = to_dtype(f32(fp8_value(code, spec.fp8_format) * scales[s]), dtype)
    elif M:
        ps = {"f16": 2, "bf16": 2, "f32": 4}[spec.scale_dtype]
        scales = [param(body[at + k * ps : at + (k + 1) * ps], spec.scale_dtype) for k in range(ng)]
        at += ng * ps
        zeros = None
        if not spec.symmetric:
            zeros = [param(body[at + k * ps : at + (k + 1) * ps], spec.scale_dtype) for k in range(ng)]
            at += ng * ps
        b, G = spec.bits, spec.group_size
        codes = body[at:]
        rotation = getattr(spec, "rotation", "none")  # revision 1.2 (section 8)
        gaussian = getattr(spec, "codebook", "uniform") == "gaussian"
        turboquant = getattr(spec, "codebook", "uniform") == "turboquant"  # revision 1.3 (section 9)
        if turboquant:
            assert D & (D - 1) == 0 and G >= D, "KVW-TQ-2: DECODE_FAILED"
        for h in range(H):
            for m in range(M):
                row = []
                for d in range(D):
                    i = (h * M + m) * D + d
                    u = sum(((codes[(i * b + j) // 8] >> ((i * b + j) % 8)) & 1) << j for j in range(b))  # KVW-ROT-3
                    if spec.group_axis == "tokens":
                        g = (h * -(-M // G) + m // G) * D + d
                    else:
                        g = (h * M + m) * -(-D // G) + d // G
                    if turboquant:
                        x = u  # the code; the row is decoded whole below
                    elif gaussian:
                        x = f32(gaussian_level(b, u) * scales[g])
                    elif spec.symmetric:
                        x = f32((u - (1 << (b - 1))) * scales[g])
                    else:
                        x = f32(f32(u * scales[g]) + zeros[g])
                    row.append(x)
                if turboquant:
                    row = turboquant_row(row, scales[(h * M + m) * -(-D // G)], b)
                if rotation in ("hadamard", "sylvester"):
                    row = hadamard_inverse(row, spec.rotation_seed, signed=rotation == "hadamard")
                for d in range(D):
                    out[h][P + m][d] = to_dtype(row[d], dtype)
    return b"".join(out[h][t][d] for h in range(H) for t in range(T) for d in range(D))


def decode_container(data) -> dict:
    """{(layer, component): [H, T, D] array} of a whole container, chunk by chunk through
    ``decode`` above (raw and zstd chunks with zstandard directly): the expected values of
    the codec tests and of the codec conformance vectors."""
    import kvwire
    from kvwire.format import registry as R

    out: dict = {}
    with kvwire.open(data) as r:
        h = r.header
        for i, rec in enumerate(r.records):
            c = r.info(i)
            lt = h.layer_tokens[c.layer]
            stored = bytes(r.stored(i, True)[1])
            idx = int(rec["reserved0"])
            if idx:
                b = decode(h.codec_specs[idx - 1], h.dtype, stored, *c.shape, c.token_start, lt.start, lt.stop)
            elif c.codec == "zstd":
                b = zstandard.ZstdDecompressor().decompress(stored)
            else:
                b = stored
            arr = np.frombuffer(b, R.DTYPES[h.dtype][2]).reshape(c.shape)
            out.setdefault((c.layer, c.component), {})[c.token_start] = arr
    return {k: np.concatenate([v[t] for t in sorted(v)], axis=1) for k, v in out.items()}


def _zeros_like_sparse(h):
    """Per layer, per kv head: zero arrays of the retained counts (filled chunk by chunk)."""
    from kvwire.format import registry as R

    counts = iter(h.sparse.retained_counts)
    out = []
    for spec in h.arch.layers:
        heads = []
        for _ in range(1 if spec.kind == "mla_latent" else 0 if spec.kind == "shared" else spec.num_kv_heads):
            n = next(counts)
            head = {"positions": np.zeros(n, np.int64)}
            for c in R.KIND_COMPONENTS[spec.kind]:
                head[c] = np.zeros((n, spec.shape(c, 1)[2]), R.DTYPES[h.dtype][2])
            heads.append(head)
        out.append(heads)
    return out


def decode_sparse_container(data):
    """The expected decode of a sparse container, chunk by chunk through the literal decoder
    of tests/codec_reference.py with ``[lo, hi) = [0, count(layer, head))`` (KVW-CSPEC-8)
    and ``H = 1`` (KVW-SPARSE-15); positions through the reference reader."""
    import kvwire
    from kvwire.cache.sparse import SparseKVCache

    with kvwire.open(data) as r:
        h = r.header
        layers = _zeros_like_sparse(h)
        for i, rec in enumerate(r.records):
            c = r.info(i)
            hd = int(rec["head_start"])
            dst = layers[c.layer][hd][c.component]
            t0, n = c.token_start, c.token_count
            if c.component == "positions":
                dst[t0 : t0 + n] = r.chunk(c.layer, "positions", _chunk_index(r, i))
                continue
            assert c.shape[0] == 1  # one head per chunk (KVW-SPARSE-7)
            stored = bytes(r.stored(i, True)[1])
            idx = int(rec["reserved0"])
            if idx:
                count = int(h.sparse.retained_counts[int(r.grid.offsets[c.layer]) + hd])
                b = decode(h.codec_specs[idx - 1], h.dtype, stored, *c.shape, t0, 0, count)
            else:
                b = zstandard.ZstdDecompressor().decompress(stored) if c.codec == "zstd" else stored
            dst[t0 : t0 + n] = np.frombuffer(b, dst.dtype).reshape(n, -1)
    return SparseKVCache(h, layers)


def _chunk_index(r, i: int) -> int:
    rec = r.records[i]
    return int(np.flatnonzero(r.slot_records == i)[0]) - int(r.grid.base[int(rec["layer"]), int(rec["component"])])


