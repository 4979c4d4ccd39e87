"""Load or recompute: a sender-side policy (informative spec: spec/policy.md).

Per chunk of the context, load its KV with a codec whose transfer + decode time beats
recomputing the chunk (prefilling it on the receiver): the fastest such codec by default,
or the densest (``prefer="densest"``, sparing a shared link); else recompute. The
cost of recomputing a chunk grows with its position (each token attends to every earlier
one), transfer cost does not, so late chunks of a long context are the first worth
loading. Everything here is arithmetic over the inputs: no torch, no I/O.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["CodecCost", "ModelCost", "Plan", "ChunkDecision", "plan", "parse_bandwidth", "parse_codec", "parse_model",
           "sweep", "DEFAULT_CODECS", "MODELS"]


@dataclass(frozen=True)
class CodecCost:
    """What a codec costs: container bits per cache element (metadata included) and the
    receiver's decode throughput in GB/s of decoded bf16 bytes (``math.inf``: no decode
    step, e.g. ``raw`` bodies are used in place)."""

    name: str
    bits_per_element: float
    decode_gbps: float = math.inf
    lossless: bool = False


# Measured by benchmarks/bench_fidelity.py (benchmarks/results/fidelity.json, "codec_costs"):
# Bits per element of the trained fidelity model's bf16 caches with every container byte
# counted (960-token caches, 256-token chunks; benchmarks/results/fidelity.md), and the
# one-core Reader.load GB/s of the numpy reference decoder on an idle 2-core VM
# (benchmarks/results/codecs.md). Receivers with a GPU decoder are far faster: pass your own.
DEFAULT_CODECS = (
    CodecCost("raw", 16.04, math.inf, True),
    CodecCost("zstd", 10.74, 0.67, True),
    CodecCost("byteplane", 9.93, 1.31, True),
)


@dataclass(frozen=True)
class ModelCost:
    """The model shape the cost model needs.

    ``params``: parameters touched per token in prefill (non-embedding; active ones for
    MoE). ``attention_half_tokens``: the position at which one token's attention cost
    equals the rest of its prefill cost; default from FLOP counts,
    params / (2 * layers * q_heads * head_dim)."""

    layers: int
    kv_heads: int
    head_dim: int
    q_heads: int
    params: float
    dtype_bytes: int = 2
    attention_half_tokens: float | None = None

    @property
    def elements_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim

    @property
    def half_tokens(self) -> float:
        if self.attention_half_tokens is not None:
            return float(self.attention_half_tokens)
        return self.params / (2.0 * self.layers * self.q_heads * self.head_dim)


MODELS = {
    "llama-3-8b": ModelCost(32, 8, 128, 32, 6.98e9),
    "llama-3-70b": ModelCost(80, 8, 128, 64, 68.5e9),
    "qwen2.5-7b": ModelCost(28, 4, 128, 28, 6.53e9),
}


@dataclass(frozen=True)
class ChunkDecision:
    index: int
    token_start: int
    tokens: int
    action: str  # "load" or "recompute"
    codec: str | None
    recompute_s: float
    transfer_s: float  # of the chosen codec (0 when recomputed)
    decode_s: float
    stored_bytes: float

    @property
    def load_s(self) -> float:
        return self.transfer_s + self.decode_s


@dataclass
class Plan:
    """Per chunk decisions and the totals of the cost model (seconds)."""

    bandwidth_bps: float
    context_tokens: int
    chunks: list[ChunkDecision] = field(default_factory=list)
    recompute_all_s: float = 0.0
    serial_s: float = 0.0
    pipelined_s: float = 0.0

    @property
    def loaded_tokens(self) -> int:
        return sum(c.tokens for c in self.chunks if c.action == "load")

    @property
    def load_fraction(self) -> float:
        return self.loaded_tokens / self.context_tokens if self.context_tokens else 0.0

    @property
    def stored_bytes(self) -> float:
        return sum(c.stored_bytes for c in self.chunks)

    @property
    def speedup(self) -> float:
        """Recompute-everything time over this plan's pipelined time."""
        return self.recompute_all_s / self.pipelined_s if self.pipelined_s else 1.0

    def runs(self) -> list[tuple[int, int, str, str | None, float, float]]:
        """Consecutive chunks with the same decision, as (token_start, tokens, action, codec,
        recompute_s, load_s) with the times summed."""
        out: list[tuple[int, int, str, str | None, float, float]] = []
        for c in self.chunks:
            if out and out[-1][2:4] == (c.action, c.codec):
                s, n, a, k, r, ld = out[-1]
                out[-1] = (s, n + c.tokens, a, k, r + c.recompute_s, ld + c.load_s)
            else:
                out.append((c.token_start, c.tokens, c.action, c.codec, c.recompute_s, c.load_s))
        return out

    def table(self) -> str:
        lines = [f"{'tokens':>21}  {'action':<9} {'codec':<14} {'recompute ms':>13} {'load ms':>10}"]
        for s, n, a, k, r, ld in self.runs():
            lines.append(f"[{s:>9}, {s + n:>9})  {a:<9} {k or '-':<14} {r * 1e3:>13.2f} "
                         f"{ld * 1e3 if a == 'load' else float('nan'):>10.2f}")
        lines.append(f"loaded {self.load_fraction:.0%} of {self.context_tokens} tokens, "
                     f"{self.stored_bytes / 1e6:.1f} MB sent; recompute all {self.recompute_all_s * 1e3:.1f} ms, "
                     f"this plan {self.pipelined_s * 1e3:.1f} ms pipelined ({self.serial_s * 1e3:.1f} ms serial), "
                     f"{self.speedup:.2f}x")
        return "\n".join(lines)


_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_bandwidth(value: Any) -> float:
    """Bits per second from a number (bits/s) or text: '32Gbps', '100 Gbit/s', '4 GB/s'."""
    if isinstance(value, (int, float)):
        bps = float(value)
    else:
        m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]?)\s*(bps|bit/s|b/s|bits/s|B/s|Bps)?\s*",
                         str(value), re.IGNORECASE)
        if not m:
            raise ValueError(f"cannot read bandwidth {value!r} (try '32Gbps' or '4GB/s')")
        unit = m.group(3) or "bps"
        bytes_unit = unit in ("B/s", "Bps")
        bps = float(m.group(1)) * _UNITS[m.group(2).lower()] * (8 if bytes_unit else 1)
    if not bps > 0 or math.isinf(bps):
        raise ValueError(f"bandwidth must be a positive finite number, not {value!r}")
    return bps


def recompute_seconds(model: ModelCost, start: int, tokens: int, prefill_tokens_per_s: float) -> float:
    """Prefill time of tokens [start, start + tokens) given the earlier ones are cached.

    Token at position p costs (1 + p / half_tokens) / prefill_tokens_per_s, where
    prefill_tokens_per_s is the short-prompt prefill throughput; summed in closed form."""
    mean_pos = start + (tokens - 1) / 2.0
    return tokens * (1.0 + mean_pos / model.half_tokens) / prefill_tokens_per_s


def plan(bandwidth: Any, context_tokens: int, prefill_tokens_per_s: float, codecs: Sequence[CodecCost] = DEFAULT_CODECS,
         *, model: ModelCost | str = "llama-3-8b", chunk_tokens: int = 256, cached_tokens: int = 0,
         latency_s: float = 0.0, prefer: str = "fastest") -> Plan:
    """Decide, per chunk of ``chunk_tokens``, load (with which codec) or recompute.

    ``bandwidth``: the link, bits/s or text ('32Gbps'); ``codecs``: the acceptable codecs
    (fidelity is the caller's choice); ``cached_tokens``: a prefix the receiver already
    holds (neither loaded nor recomputed); ``latency_s``: a one-time cost before the first
    byte arrives (request round trip, store lookup): if the plan with it is not faster
    than recomputing everything, everything is recomputed; ``prefer``: among the codecs that beat
    recomputing, "fastest" (least transfer + decode time: lowest latency, the default) or
    "densest" (fewest bits: spares a shared link, but a slow decoder can then bound the
    time, spec/policy.md section 4)."""
    bps = parse_bandwidth(bandwidth)
    model = MODELS[model] if isinstance(model, str) else model
    if context_tokens < 0 or chunk_tokens <= 0 or prefill_tokens_per_s <= 0 or not 0 <= cached_tokens <= context_tokens:
        raise ValueError("need context_tokens >= cached_tokens >= 0, chunk_tokens > 0, prefill_tokens_per_s > 0")
    if not codecs:
        raise ValueError("need at least one codec")
    if prefer not in ("densest", "fastest"):
        raise ValueError(f"prefer must be 'densest' or 'fastest', not {prefer!r}")
    result = Plan(bps, context_tokens)
    for i, start in enumerate(range(cached_tokens, context_tokens, chunk_tokens)):
        n = min(chunk_tokens, context_tokens - start)
        rec = recompute_seconds(model, start, n, prefill_tokens_per_s)
        result.recompute_all_s += rec
        elements = n * model.elements_per_token
        best = None
        for c in codecs:
            stored = elements * c.bits_per_element / 8.0
            transfer = stored * 8.0 / bps
            decode = elements * model.dtype_bytes / (c.decode_gbps * 1e9)
            if transfer + decode < rec:
                key = (c.bits_per_element, transfer + decode) if prefer == "densest" else \
                    (transfer + decode, c.bits_per_element)
                if best is None or key < best[0]:
                    best = (key, c.name, transfer, decode, stored)
        if best is None:
            result.chunks.append(ChunkDecision(i, start, n, "recompute", None, rec, 0.0, 0.0, 0.0))
        else:
            _, name, transfer, decode, stored = best
            result.chunks.append(ChunkDecision(i, start, n, "load", name, rec, transfer, decode, stored))
    loads = any(c.action == "load" for c in result.chunks)
    result.pipelined_s = pipelined_seconds(result.chunks, latency_s if loads else 0.0)
    if loads and result.pipelined_s >= result.recompute_all_s:  # the latency ate the gain
        result.chunks = [replace(c, action="recompute", codec=None, transfer_s=0.0, decode_s=0.0, stored_bytes=0.0)
                         for c in result.chunks]
        loads = False
        result.pipelined_s = result.recompute_all_s
    result.serial_s = sum(c.load_s if c.action == "load" else c.recompute_s for c in result.chunks) + \
        (latency_s if loads else 0.0)
    return result


def pipelined_seconds(chunks: Sequence[ChunkDecision], latency_s: float = 0.0) -> float:
    """Makespan with the link and the receiver's compute working concurrently.

    The link sends loaded chunks back to back in token order from t = latency_s; the receiver
    handles chunks in token order, decoding a loaded chunk once it has arrived and
    recomputing the others (decode and recompute share the compute, so they serialize)."""
    link, compute = latency_s, 0.0
    for c in chunks:
        if c.action == "load":
            link += c.transfer_s
            compute = max(compute, link) + c.decode_s
        else:
            compute += c.recompute_s
    return compute


# --- the ``kvwire plan`` command --------------------------------------------------------------

SWEEP_BANDWIDTHS = ("10Gbps", "25Gbps", "32Gbps", "64Gbps", "100Gbps", "200Gbps", "400Gbps")
SWEEP_CONTEXTS = (4096, 16384, 65536, 131072, 262144, 524288, 1048576)


def parse_codec(text: str) -> CodecCost:
    """'name:bits[:decode_gbps]', or a name of ``DEFAULT_CODECS``."""
    known = {c.name: c for c in DEFAULT_CODECS}
    parts = text.split(":")
    if len(parts) == 1 and text in known:
        return known[text]
    if not 2 <= len(parts) <= 3:
        raise ValueError(f"codec {text!r}: expected name:bits_per_element[:decode_GBps] or one of {sorted(known)}")
    return CodecCost(parts[0], float(parts[1]), float(parts[2]) if len(parts) == 3 else math.inf)


def parse_model(text: str) -> ModelCost:
    """A name of ``MODELS`` or 'layers:kv_heads:head_dim:q_heads:params' (params may be 7e9)."""
    if text in MODELS:
        return MODELS[text]
    parts = text.split(":")
    if len(parts) != 5:
        raise ValueError(f"model {text!r}: one of {sorted(MODELS)} or layers:kv_heads:head_dim:q_heads:params")
    layers, kv_heads, head_dim, q_heads = (int(x) for x in parts[:4])
    return ModelCost(layers, kv_heads, head_dim, q_heads, float(parts[4]))


def sweep(prefill_tokens_per_s: float, codecs: Sequence[CodecCost] = DEFAULT_CODECS, *,
          bandwidths: Sequence[Any] = SWEEP_BANDWIDTHS, contexts: Sequence[int] = SWEEP_CONTEXTS, **kw: Any) -> str:
    """Markdown matrix: fraction of the context loaded (and speedup) per bandwidth x context."""
    rows = ["| context | " + " | ".join(bandwidths) + " |", "|---|" + "---|" * len(bandwidths)]
    for n in contexts:
        cells = []
        for bw in bandwidths:
            p = plan(bw, n, prefill_tokens_per_s, codecs, **kw)
            cells.append("recompute" if p.loaded_tokens == 0 else
                         f"load {p.load_fraction:.0%} ({p.speedup:.1f}x)")
        rows.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(rows)
