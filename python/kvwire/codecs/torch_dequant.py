"""Lossy decoding (``fp8``, ``int_affine``; spec/codecs.md) as torch kernels, so a body
copied compressed to a GPU is dequantized where its output lives.

Same arithmetic as ``quant.decode``: fp32, separate mul and add (no FMA), one
round-to-nearest-even to the header dtype, canonical NaN (KVW-LOSSY-4), infinity on
overflow. Parameter and padding checks (KVW-FP8-3, KVW-INT-3, KVW-INT-4) run on the host
on the small params section (``check``), before anything is written: that costs a few
bytes of host reads instead of one device sync per chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..format import registry as R
from ..format.codec_specs import CodecSpec
from ..format.errors import CodecError
from . import quant
from .quant import Layout

# torch is imported on first use and passed in: its tensors are typed Any here

_TORCH_DT = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}
_INT_DT = {2: "int16", 4: "int32"}


def _params_np(b: np.ndarray, at: int, lay: Layout, sd: str) -> tuple[np.ndarray, int]:
    n = lay.param_count
    raw = b[at: at + n * lay.param_size]
    if sd == "f32":
        p = raw.view("<f4").astype(np.float32)
    elif sd == "f16":
        p = raw.view("<f2").astype(np.float32)
    else:
        p = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    return p, at + n * lay.param_size


def check(spec: CodecSpec, body: Any, lay: Layout) -> None:
    """Raise the numpy decoder's CodecError for a bad length, parameter or padding."""
    b = np.frombuffer(body, np.uint8)
    if len(b) != lay.length:
        raise CodecError("DECODE_FAILED", f"{spec.codec} body of {len(b)} bytes, its geometry needs {lay.length}",
                         rule="KVW-LOSSY-2")
    if not lay.M:
        return
    at = lay.fp_bytes
    checks: list[tuple[str, str, str, Callable[[np.ndarray], np.ndarray]]] = [("f32", "KVW-FP8-3", "finite and > 0", lambda p: ~np.isfinite(p) | ~(p > 0))] if spec.codec == "fp8" \
        else [(spec.scale_dtype, "KVW-INT-3", "finite with the sign bit clear",
               lambda p: ~np.isfinite(p) | np.signbit(p))] + \
        ([(spec.scale_dtype, "KVW-INT-3", "finite", lambda p: ~np.isfinite(p))] if lay.zeros else [])
    for sd, rule, what, test in checks:
        p, at = _params_np(b, at, lay, sd)
        bad = test(p)
        if bad.any():
            i = int(np.argmax(bad))
            raise CodecError("DECODE_FAILED", f"parameter {i} ({float(p[i])!r}) is not {what}", rule=rule)
    used = lay.heads * lay.M * lay.dim * lay.bits % 8
    if used and int(b[-1]) >> used:
        raise CodecError("DECODE_FAILED", "padding bits after the last code are not zero", rule="KVW-INT-4")


def _params_t(torch: Any, b: Any, at: int, lay: Layout, sd: str) -> tuple[Any, int]:
    n = lay.param_count
    raw = b[at: at + n * lay.param_size].clone()
    p = raw.view(getattr(torch, _TORCH_DT[sd])).to(torch.float32)
    return p.reshape(lay.groups), at + n * lay.param_size


def _store(torch: Any, v: Any, dst: Any, dtype: str) -> None:
    """fp32 ``v`` -> header dtype (RNE) into ``dst``, NaN canonical."""
    out = v.to(getattr(torch, _TORCH_DT[dtype]))
    iv = out.view(getattr(torch, _INT_DT[R.DTYPES[dtype][1]]))
    nan = torch.isnan(v)
    bits = quant.CANONICAL_NAN[dtype]
    iv.masked_fill_(nan, bits)  # all canonical NaNs have the sign bit clear: fit the signed view
    dst.copy_(out)


def _expand(p: Any, spec: CodecSpec, M: int, D: int) -> Any:
    """Scales shaped [H, groups, ...] broadcast to [H, M, D]."""
    G = spec.group_size
    if spec.group_axis == "tokens":
        return p.repeat_interleave(G, dim=1)[:, :M, :]
    return p.repeat_interleave(G, dim=2)[:, :, :D]


def dequant(spec: CodecSpec, body: Any, lay: Layout, dtype: str, dst: Any, checked: bool = False) -> Any:
    """Decode the lossy body ``body`` (uint8 tensor, any device) into ``dst`` ([H, T, D]
    tensor of the header dtype, or an integer view of its width, on the same device)."""
    import torch

    if not checked:
        check(spec, body.cpu().numpy(), lay)
    H, T, D, P, Q, M = lay.heads, lay.tokens, lay.dim, lay.P, lay.Q, lay.M
    tdt = getattr(torch, _TORCH_DT[dtype])
    d = dst.view(tdt) if dst.dtype != tdt else dst
    n_sink = H * P * D * lay.itemsize
    if P:
        d[:, :P].copy_(body[:n_sink].clone().view(tdt).reshape(H, P, D))
    if Q:
        d[:, T - Q:].copy_(body[n_sink: lay.fp_bytes].clone().view(tdt).reshape(H, Q, D))
    if not M:
        return dst
    at = lay.fp_bytes
    if spec.codec == "fp8":
        s, at = _params_t(torch, body, at, lay, "f32")
        table = torch.from_numpy(quant.fp8_table(spec.fp8_format)[0]).to(body.device)
        codes = body[at:].reshape(H, M, D).long()
        s = s.reshape({"tensor": (1, 1, 1), "head": (H, 1, 1), "token": (H, M, 1)}[spec.scale_granularity])
        v = torch.mul(table[codes], s)
        _store(torch, v, d[:, P: P + M], dtype)
        return dst
    s, at = _params_t(torch, body, at, lay, spec.scale_dtype)
    z = _params_t(torch, body, at, lay, spec.scale_dtype)[0] if lay.zeros else None
    at += lay.param_count * lay.param_size if lay.zeros else 0
    bits, n = spec.bits, H * M * D
    packed = body[at:].to(torch.int32)
    per = 8 // bits
    shifts = torch.arange(per, device=body.device, dtype=torch.int32) * bits
    q = ((packed[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)[:n].to(torch.float32)
    if spec.symmetric:
        q = q - float(1 << (bits - 1))
    q = q.reshape(H, M, D)
    v = torch.mul(q, _expand(s, spec, M, D))
    if z is not None:
        v = torch.add(v, _expand(z, spec, M, D))
    _store(torch, v, d[:, P: P + M], dtype)
    return dst
