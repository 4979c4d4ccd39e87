"""Requantizing an fp8 KV cache to other per-layer scales (kvwire-v1.md KVW-SCALE-7,
crossmodel.md KVW-XM-10).

An fp8 engine keeps one ``k_scale`` and one ``v_scale`` per layer for every request, so a
cache whose container carries other scales cannot be loaded bit for bit: its elements
mean ``element x container scale`` (KVW-SCALE-6), and the engine would read them as
``element x its own scale``. The receiver either refuses it or converts it: the values,
quantized with its own scales. ``check_compatible`` lists that conversion as "rescale
layers ..."; this module performs it, and validates a receiver's scales like the header
field (KVW-SCALE-2..5).

The arithmetic (crossmodel.md KVW-XM-10): for a stored element ``x`` of a layer whose
container scale is ``s`` and whose receiver scale is ``t``, the new element is
``fp8(sat(f32(f32(d(x) x s) / t)))``: ``d(x)`` the element's value (exact in binary32),
one binary32 multiplication and one binary32 division, each rounded to nearest even with
subnormals kept, then saturated (a result beyond the dtype's largest finite value, an
infinity included, becomes that value with its sign; NaN stays NaN) and rounded once to
the fp8 dtype, to nearest even. That is how engines quantize (vLLM divides by its scale and
clamps to the fp8 range before the cast). Where ``s == t`` (bit for bit) the elements are
kept unchanged.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np

from ..cache.kvcache import KVCache
from ..cache.tensors import as_numpy
from ..format import registry as R
from ..format.errors import SchemaError
from ..format.kv_scales import (
    FP8_DTYPES,
    KV_SCALES_BIT,
    NEUTRAL,
    KVScale,
    as_kv_scales,
    check_kv_scales,
    scales_of,
    to_f32,
    writer_header,
)

FP8_MAX = {"f8_e4m3fn": 448.0, "f8_e5m2": 57344.0, "f8_e4m3fnuz": 240.0}  # largest finite values (section 20.1)


def check_scales(arch, dtype: str, kv_scales, who: str = "kv_scales") -> tuple[KVScale, ...] | None:
    """``kv_scales`` (``KVScale`` values or ``(k_scale, v_scale)`` pairs, or None) as a tuple of
    ``KVScale``, checked as a reader checks ``Header.kv_scales`` (KVW-SCALE-2..5: an fp8
    ``dtype``, one entry per layer of ``arch``, every scale finite and above 0, exactly 1.0
    where no element uses it); a violation is a ``ValueError`` naming the rule."""
    if kv_scales is None:
        return None
    scales = as_kv_scales(kv_scales)
    try:
        check_kv_scales(SimpleNamespace(required_features=KV_SCALES_BIT, kv_scales=scales, dtype=dtype,
                                        num_layers=arch.num_layers, arch=arch))
    except SchemaError as exc:
        detail = str(exc).split(": ", 1)[-1]
        raise ValueError(f"{who}: {detail} ({exc.rule})") from None
    return scales


def rescale_fp8(x, from_scale: float, to_scale: float, dtype: str) -> np.ndarray:
    """Stored fp8 elements ``x`` (a numpy array or torch tensor of ``dtype``, or its uint8
    bits) requantized from scale ``from_scale`` to ``to_scale``, as a new numpy array of
    ``dtype``: the values of KVW-SCALE-6, divided by ``to_scale`` in binary32, saturated to
    the dtype's finite range and rounded to nearest even (module docstring). Equal scales
    (after rounding to binary32) return a copy of the elements unchanged."""
    if dtype not in FP8_DTYPES:
        raise ValueError(f"rescale_fp8 dtype {dtype!r}: rescaling applies to the fp8 dtypes "
                         f"{', '.join(FP8_DTYPES)} (cast other caches instead)")
    a = as_numpy(x)
    npd = R.DTYPES[dtype][2]
    if a.dtype == np.uint8:
        a = a.view(npd)
    elif a.dtype != npd:
        raise ValueError(f"rescale_fp8: elements of dtype {a.dtype} for dtype {dtype!r}: give an array of "
                         f"{dtype} (or its uint8 bits)")
    s, t = to_f32(from_scale), to_f32(to_scale)
    for name, v in (("from_scale", s), ("to_scale", t)):
        if not 0.0 < v < float("inf"):  # false for NaN too (KVW-SCALE-3)
            raise ValueError(f"rescale_fp8 {name} {v!r}: a scale is a finite binary32 above 0")
    if s == t:
        return a.copy()
    y = a.astype(np.float32)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        np.multiply(y, np.float32(s), out=y)  # the values (KVW-SCALE-6)
        np.divide(y, np.float32(t), out=y)  # quantized with the receiver's scale
    m = np.float32(FP8_MAX[dtype])
    np.clip(y, -m, m, out=y)  # saturate; NaN stays NaN
    return y.astype(npd)


def rescale_cache(cache: KVCache, kv_scales) -> KVCache:
    """``cache`` (fp8, scaled or not) with its K/V/LATENT elements requantized to ``kv_scales``,
    one ``KVScale`` or ``(k_scale, v_scale)`` pair per layer of the cache (for an object of
    model layers [a, b): the receiver's scales of those layers), or None for 1.0 everywhere
    without the field. K and LATENT go from the cache's ``k_scale`` to the new one, V from
    ``v_scale``; a layer whose scale does not change keeps its tensors (the same objects);
    shared and state layers have none. The header takes the new scales (bit 3 and
    ``format_minor`` follow, KVW-EVOL-12). This is the "rescale layers" conversion of
    ``check_compatible`` (KVW-XM-10)."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"rescale_cache needs a kvwire.KVCache, not {type(cache).__name__}")
    h = cache.header
    if h.dtype not in FP8_DTYPES:
        raise ValueError(f"rescale_cache: a {h.dtype} cache has no fp8 scales (dtypes {', '.join(FP8_DTYPES)}); "
                         "cast it instead")
    target = check_scales(h.arch, h.dtype, kv_scales)
    layers = []
    for i, layer in enumerate(cache.layers):
        old, new = scales_of(h, i), NEUTRAL if target is None else target[i]
        out = {}
        for c, x in layer.items():
            a, b = (old.v_scale, new.v_scale) if c == "v" else (old.k_scale, new.k_scale)
            out[c] = x if c == "state" or a == b else rescale_fp8(x, a, b, h.dtype)
        layers.append(out)
    return KVCache(writer_header(replace(h, kv_scales=target)), layers)


__all__ = ["FP8_MAX", "check_scales", "rescale_cache", "rescale_fp8"]
