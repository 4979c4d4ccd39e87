"""Codec costs for ``kvwire plan`` from codec names: the load-or-recompute plan needs each
codec's container bits per element and the receiver's decode speed, and a user knows the
codec's name, not those two numbers. They come from the codec benchmark's figures
(``benchmarks/results/codecs.json``, written by ``benchmarks/bench_codecs.py``) when that
file is there and the cache is bf16 (the benchmark's dtype), else from a quick measurement
here: encode a seeded synthetic cache of the model's shape and time ``Reader.load``.
Either way the source is reported, since numbers from this machine's numpy decoder are not
a GPU receiver's; with libkvwire's codecs on (the default when the library is there) the
benchmark's native column is read, since the rotated presets decode 10-20x faster there than in numpy.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from ..cache.encoder import encode_bytes
from ..cache.files import open as kv_open
from ..codecs import PRESETS, native
from ..codecs.policy import CodecCost
from ..format import registry as R
from .synth import synth_cache

BENCH_RELATIVE = Path("benchmarks") / "results" / "codecs.json"
MEASURE_LAYERS, MEASURE_TOKENS, MEASURE_REPEAT = 4, 1024, 3


@dataclass(frozen=True)
class SourcedCost:
    """A codec's cost and where its two numbers came from (one line for the user)."""

    cost: CodecCost
    source: str


def known_codec_names() -> list:
    return sorted(set(R.CODECS) | set(PRESETS))


def find_bench_results(explicit: str | None = None) -> Path | None:
    """``explicit`` if given (it must exist), else ``benchmarks/results/codecs.json`` in the
    working directory or in the checkout this package runs from; None when there is none."""
    if explicit is not None:
        path = Path(explicit)
        if not path.is_file():
            raise FileNotFoundError(2, "No such file (a codecs.json of benchmarks/bench_codecs.py)", str(path))
        return path
    for root in (Path.cwd(), Path(__file__).resolve().parents[3]):
        if (root / BENCH_RELATIVE).is_file():
            return root / BENCH_RELATIVE
    return None


def read_bench(path: Path, native_on: bool = False) -> dict:
    """codec name -> CodecCost from a bench_codecs.py result (bf16 caches: 16 bits / ratio).
    ``native_on``: the receiver decodes through libkvwire (``KVWIRE_NATIVE``), so its load
    speed is the row's ``native_load_gbs``; a row measured without libkvwire is left out
    (then measured here) rather than priced at the numpy reference's speed."""
    with open(path) as f:
        data = json.load(f)
    key = "native_load_gbs" if native_on else "load_gbs"
    try:
        rows = data["codecs"]
        out = {}
        for row in rows:
            if key not in row:
                continue
            name, ratio, load = row["codec"], float(row["ratio"]), float(row[key])
            if ratio > 0 and load > 0:
                out[name] = CodecCost(name, 16.0 / ratio, math.inf if name == "raw" else load,
                                      float(row.get("max_abs_err", 1.0)) == 0.0)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: not a benchmarks/bench_codecs.py result ({exc!r})") from None
    return out


def measure(name: str, kv_heads: int, head_dim: int, dtype: str, chunk_tokens: int,
            layers: int = MEASURE_LAYERS, tokens: int = MEASURE_TOKENS, repeat: int = MEASURE_REPEAT) -> CodecCost:
    """Bits per element and ``Reader.load(threads=1)`` GB/s (decoded bytes; median of ``repeat``) of
    ``name`` on a seeded synthetic cache of ``layers`` x ``kv_heads`` x ``tokens`` x
    ``head_dim`` (few layers: both numbers are per element, the layer count does not change them)."""
    cache = synth_cache(layers, kv_heads, head_dim, tokens, dtype=dtype, chunk_tokens=chunk_tokens)
    blob = encode_bytes(cache, codec=name)
    elements = 2 * layers * kv_heads * head_dim * tokens
    times = []
    with kv_open(blob) as r:  # warm-up: first-call costs (imports, allocator) are not the codec's
        r.load(threads=1)
    for _ in range(repeat):  # one thread, as bench_codecs.py measures (native on: otherwise one per CPU)
        t0 = time.perf_counter()
        with kv_open(blob) as r:
            r.load(threads=1)
        times.append(time.perf_counter() - t0)
    seconds = sorted(times)[len(times) // 2]
    nbytes = elements * R.dtype_info(dtype)[1]
    lossless = name in ("raw", "zstd", "byteplane", "lz4") or name.startswith("zstd")
    return CodecCost(name, len(blob) * 8.0 / elements, math.inf if name == "raw" else nbytes / seconds / 1e9,
                     lossless)


def resolve(names, *, kv_heads: int, head_dim: int, dtype: str, chunk_tokens: int,
            bench: str | None = None, force_measure: bool = False) -> list:
    """A ``SourcedCost`` per codec name: from the benchmark figures when present and the
    dtype is bf16, else measured here (a name the benchmark lacks is measured too)."""
    unknown = [n for n in names if n not in R.CODECS and n not in PRESETS]
    if unknown:
        raise ValueError(f"unknown codec {unknown[0]!r}: give a codec or preset name ({', '.join(known_codec_names())}) "
                         "or name:bits_per_element[:decode_GBps]")
    table, path, on = {}, None, native.available()
    decoder = "libkvwire codecs (native on)" if on else "numpy reference codecs"
    if not force_measure and dtype == "bf16":
        path = find_bench_results(bench)
        table = read_bench(path, on) if path is not None else {}
    out = []
    for name in names:
        if name in table:
            out.append(SourcedCost(table[name], f"read from {path} (bench_codecs.py, bf16 synthetic cache, "
                                                f"load through the {decoder})"))
        else:
            out.append(SourcedCost(measure(name, kv_heads, head_dim, dtype, chunk_tokens),
                                   f"measured now through the {decoder}: {MEASURE_LAYERS} layers x {kv_heads} kv "
                                   f"heads x {MEASURE_TOKENS} tokens x {head_dim} {dtype} synthetic cache, "
                                   f"Reader.load on one thread, median of {MEASURE_REPEAT}"))
    return out
