"""Per-layer scales of fp8 KV caches (spec section 5.10; revision 1.1, feature ``kv_scales``).

An engine that caches K and V in fp8 (vLLM ``kv_cache_dtype="fp8"``) keeps one float
scale per layer for each of them (``k_scale``, ``v_scale``; an MLA layer scales its latent
by ``k_scale``): the real value is the fp8 value times the scale. The stored elements
alone are wrong by that factor, so ``Header.kv_scales`` (field 20, one ``KVScale`` per
layer) carries the scales, and required feature bit 3 makes a reader that does not know
them refuse the container (KVW-EVOL-3) instead of misreading it.

This module holds the value type, the FlatBuffers build and read of field 20, the header
rules (KVW-SCALE-1..5), what a writer derives from the field (bit 3 and ``format_minor``,
KVW-SCALE-1, KVW-EVOL-12) and the dequantization of KVW-SCALE-6. ``header`` imports it;
it must not import ``header``.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import flatbuffers
import numpy as np

from . import limits as L
from . import registry as R
from .errors import SchemaError
from .fbs import Header as fbHeader
from .fbs import KVScale as fbKVScale
from .flatbuf import Table

KV_SCALES_BIT = R.REQUIRED_FEATURES["kv_scales"]
FIELD_ID = 20  # Header.kv_scales
FP8_DTYPES = ("f8_e4m3fn", "f8_e5m2", "f8_e4m3fnuz")  # KVW-SCALE-4
FLOAT_DTYPES = ("f32", "bf16", "f16")  # what ``dequantize`` can return
NO_V_KINDS = ("mla_latent",)  # v_scale exactly 1.0 (KVW-SCALE-5)
UNSCALED_KINDS = ("shared", "state")  # no K/V/LATENT chunks of their own: both scales 1.0 (KVW-SCALE-5)


_F32 = struct.Struct("<f")


def to_f32(x: object) -> float:
    """``x`` rounded to the nearest binary32 (the type of the schema's ``float``), as a Python float."""
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise TypeError(f"a scale must be a real number, not {type(x).__name__}")
    try:
        f: float = _F32.unpack(_F32.pack(float(x)))[0]  # round to nearest even, as the FlatBuffers builder does
        return f
    except OverflowError:  # beyond the binary32 (or binary64) range: the infinity it rounds to (KVW-SCALE-3)
        return math.inf if x > 0 else -math.inf


@dataclass(frozen=True)
class KVScale:
    """Scales of one layer (schema struct ``KVScale``): a K (or LATENT) element's value is the
    stored fp8 value times ``k_scale``, a V element's times ``v_scale`` (KVW-SCALE-6). Both are
    binary32: given floats are rounded to the nearest one."""

    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "k_scale", to_f32(self.k_scale))
        object.__setattr__(self, "v_scale", to_f32(self.v_scale))


NEUTRAL = KVScale(1.0, 1.0)


def as_kv_scales(value: Any) -> tuple[KVScale, ...]:
    """``Header.kv_scales`` from ``KVScale`` values or ``(k_scale, v_scale)`` pairs, one per layer."""
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise TypeError(f"kv_scales must be a sequence of kvwire KVScale or (k_scale, v_scale) pairs, one per "
                        f"layer, or None; not {type(value).__name__}")
    out = []
    for i, e in enumerate(value):
        if isinstance(e, KVScale):
            out.append(e)
        elif not isinstance(e, (str, bytes, dict)) and hasattr(e, "__len__") and len(e) == 2:
            out.append(KVScale(*e))
        else:
            raise TypeError(f"kv_scales[{i}] is {e!r}: give a KVScale or a (k_scale, v_scale) pair")
    return tuple(out)


def scales_of(h: Any, layer: int) -> KVScale:
    """The scales in effect for ``layer``'s own chunks: its entry, or 1.0 and 1.0 without
    ``kv_scales``. (A shared layer's values are its source layer's, scaled by the source's entry.)"""
    s: KVScale = NEUTRAL if h.kv_scales is None else h.kv_scales[layer]
    return s


# ---------------------------------------------------------------------------------------
# Header rules
# ---------------------------------------------------------------------------------------

def _fail(rule: str, msg: str) -> NoReturn:
    raise SchemaError("KV_SCALES_INVALID", msg, rule=rule)


def check_kv_scales(h: Any) -> None:
    """KVW-SCALE-1..5 in the order of spec section 14.1 step 3: presence, dtype, count,
    values (layer by layer, k before v), then the entries of layers without V or chunks."""
    if not h.required_features & KV_SCALES_BIT:
        return  # field 20 without the bit is not part of the header (KVW-SCALE-1); parse_header never reads it
    s = h.kv_scales
    if s is None:
        _fail("KVW-SCALE-1", "required feature bit 3 (kv_scales) is set but Header.kv_scales is absent")
    if h.dtype not in FP8_DTYPES:
        _fail("KVW-SCALE-4", f"kv_scales with dtype {h.dtype}: scales describe fp8 caches "
              f"({', '.join(FP8_DTYPES)})")
    if len(s) != h.num_layers:
        _fail("KVW-SCALE-2", f"kv_scales has {len(s)} entries for {h.num_layers} layers (one per layer)")
    inf = math.inf
    for i, e in enumerate(s):
        if not (0.0 < e.k_scale < inf and 0.0 < e.v_scale < inf):  # false for NaN too
            name, v = ("k_scale", e.k_scale) if not 0.0 < e.k_scale < inf else ("v_scale", e.v_scale)
            _fail("KVW-SCALE-3", f"layer {i} {name} {v!r}: every scale is a finite binary32 above 0")
    for i, (spec, e) in enumerate(zip(h.arch.layers, s, strict=True)):
        if spec.kind in UNSCALED_KINDS and (e.k_scale, e.v_scale) != (1.0, 1.0):
            _fail("KVW-SCALE-5", f"{spec.kind} layer {i} has scales ({e.k_scale!r}, {e.v_scale!r}): a layer "
                  "without K/V/LATENT chunks of its own has 1.0 and 1.0")
        if spec.kind in NO_V_KINDS and e.v_scale != 1.0:
            _fail("KVW-SCALE-5", f"{spec.kind} layer {i} has v_scale {e.v_scale!r}: a layer without V has 1.0")


def required_minor(required_features: int) -> int:
    """The ``format_minor`` a writer writes: the newest revision among the features set (KVW-EVOL-12)."""
    return max((R.FEATURE_MINOR[name] for name, bit in R.REQUIRED_FEATURES.items() if required_features & bit),
               default=R.FORMAT_MINOR)


def check_writable(h: Any) -> None:
    """What a writer may not emit although readers never see it: the field without its bit
    (KVW-SCALE-1), a ``format_minor`` other than the one the features imply (KVW-EVOL-12)."""
    if h.kv_scales is not None and not h.required_features & KV_SCALES_BIT:
        raise ValueError("Header.kv_scales without required feature bit 3 (kv_scales): readers would ignore the "
                         "scales (KVW-SCALE-1); kvwire.Encoder sets the bit")
    minor = required_minor(h.required_features)
    if h.format_minor != minor:
        raise ValueError(f"this writer writes format {R.FORMAT_MAJOR}.{minor} for this header, not "
                         f"{h.format_major}.{h.format_minor} (KVW-PRE-7, KVW-EVOL-12)")


def writer_header(h: Any) -> Any:
    """``h`` as a writer writes it: bit 3 set exactly when ``kv_scales`` is given (KVW-SCALE-1)
    and, unless the caller chose a minor this writer does not write, ``format_minor`` as the
    features imply (KVW-EVOL-12). Callers never set either by hand."""
    rf = h.required_features & ~KV_SCALES_BIT | (KV_SCALES_BIT if h.kv_scales is not None else 0)
    minor = h.format_minor
    if R.FORMAT_MINOR <= minor <= R.FORMAT_MINOR_IMPLEMENTED:  # a minor this writer writes: the features decide
        minor = required_minor(rf)
    if (rf, minor) == (h.required_features, h.format_minor):
        return h
    return h.replace(required_features=rf, format_minor=minor)


# ---------------------------------------------------------------------------------------
# FlatBuffers
# ---------------------------------------------------------------------------------------

def build_kv_scales(b: flatbuffers.Builder, scales: Sequence[KVScale] | None) -> int | None:
    """Offset of the ``Header.kv_scales`` vector (None when absent); call before ``Header.Start``."""
    if scales is None:
        return None
    fbHeader.StartKvScalesVector(b, len(scales))
    for e in reversed(scales):
        fbKVScale.CreateKVScale(b, e.k_scale, e.v_scale)
    end: int = b.EndVector()
    return end


def read_kv_scales(t: Table, required_features: int) -> tuple[KVScale, ...] | None:
    """Header field 20 from the verified root table ``t``, followed and verified only when bit 3
    is set and this reader implements it (KVW-SCALE-1): otherwise field 20 is a field the
    reader does not know (KVW-EVOL-2), neither followed nor verified. Absent: None."""
    if not required_features & R.KNOWN_REQUIRED_FEATURES & KV_SCALES_BIT:
        return None
    v = t.vector(FIELD_ID, 8, 4, L.MAX_LAYERS)  # verified and charged once (KVW-HDR-3, -4, KVW-LIM-1, -7)
    if v is None:
        return None
    start, count = v
    values = struct.unpack_from(f"<{2 * count}f", t.buf.data, start)  # binary32 already: no rounding to redo
    out = []
    for j in range(count):
        e = object.__new__(KVScale)
        object.__setattr__(e, "k_scale", values[2 * j])
        object.__setattr__(e, "v_scale", values[2 * j + 1])
        out.append(e)
    return tuple(out)


# ---------------------------------------------------------------------------------------
# Dequantization (KVW-SCALE-6)
# ---------------------------------------------------------------------------------------

def check_float_dtype(dtype: str) -> None:
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dequantize to dtype {dtype!r}: choose one of {', '.join(FLOAT_DTYPES)}")


def dequantize_array(x: np.ndarray, scale: float, dtype: str = "f32") -> np.ndarray:
    """The logical values of stored elements ``x``: each converted to binary32 (exact for every
    fp8, f16 and bf16 value) and multiplied by ``scale`` in binary32, rounded to nearest even,
    subnormals kept (KVW-SCALE-6); then rounded to ``dtype`` when it is not f32."""
    check_float_dtype(dtype)
    y = np.asarray(x).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to an infinity is the defined result
        if scale != 1.0:
            np.multiply(y, np.float32(to_f32(scale)), out=y)
        return y if dtype == "f32" else y.astype(R.DTYPES[dtype][2])
