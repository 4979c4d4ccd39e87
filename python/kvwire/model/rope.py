"""Re-positioning cached keys: move post-RoPE keys from one set of positions to another.

Engines cache keys *after* the rotary embedding, so a cached segment is tied to the
positions it was computed at. Rotating each key by the position difference makes it
exactly what a fresh encode at the new position would have cached, for every rope type
whose frequencies do not depend on the sequence length (spec/crossmodel.md, section
"RoPE re-positioning", rules KVW-ROPE-*). That is what CacheBlend / EPIC-style reuse of a
segment at another offset needs.

numpy is the reference path (float64 angles, float32 rotation, result cast back to the
input dtype); torch tensors are rotated with torch on their own device.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..cache.tensors import dtype_name, is_torch
from ..format.errors import Error
from ..format.header import Header, LayerSpec, RopeParams

if TYPE_CHECKING:
    from ..cache.kvcache import KVCache

# rope types whose inverse frequencies are a function of RopeParams alone (KVW-ROPE-3)
REPOSITIONABLE = ("default", "linear", "llama3", "yarn")
_LENGTH_DEPENDENT = ("dynamic", "longrope")


class RepositionError(Error, ValueError):
    """The keys cannot be moved to other positions exactly; ``reason`` says why."""

    code = "REPOSITION_FAILED"

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(reason)


def rotary_dim(rope: RopeParams, head_dim: int) -> int:
    """Number of leading dimensions of each key that RoPE rotates (KVW-ROPE-1)."""
    r = rope.rotary_dim or head_dim
    if r < 2 or r % 2 or r > head_dim:
        raise RepositionError(f"rotary_dim {r} must be even, at least 2 and at most head_dim {head_dim}")
    return r


def inv_freq(rope: RopeParams, rdim: int) -> np.ndarray:
    """Angular frequency of each rotated pair j in [0, rdim/2), float64 (KVW-ROPE-3)."""
    _check_repositionable(rope)
    theta = float(rope.theta)
    if not theta > 1.0 or not math.isfinite(theta):
        raise RepositionError(f"theta {theta} must be a finite number > 1")
    base = theta ** (-np.arange(0, rdim, 2, dtype=np.float64) / rdim)
    kind = rope.rope_type
    if kind == "default":
        return base
    factor = float(rope.factor)
    if not factor > 0.0 or not math.isfinite(factor):
        raise RepositionError(f"{kind} rope needs a finite factor > 0, got {factor}")
    if kind == "linear":
        return base / factor
    L = rope.original_max_position_embeddings
    if L <= 0:
        raise RepositionError(f"{kind} rope needs original_max_position_embeddings > 0")
    if kind == "llama3":
        return _llama3(base, factor, L, rope.low_freq_factor, rope.high_freq_factor)
    return _yarn(base, factor, L, rope.beta_fast, rope.beta_slow, theta, rdim, rope.truncate)


def _llama3(base, factor, L, low, high):
    if not high > low > 0:
        raise RepositionError(f"llama3 rope needs high_freq_factor > low_freq_factor > 0, got {high}, {low}")
    wavelen = 2 * math.pi / base
    smooth = (L / wavelen - low) / (high - low)
    out = np.where(wavelen > L / low, base / factor, base)
    medium = (wavelen >= L / high) & (wavelen <= L / low)
    return np.where(medium, (1 - smooth) * base / factor + smooth * base, out)


def _yarn(base, factor, L, beta_fast, beta_slow, theta, rdim, truncate=True):
    def dim_of(rotations):
        return rdim * math.log(L / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    if not (beta_fast > 0 and beta_slow > 0):
        raise RepositionError("yarn rope needs beta_fast > 0 and beta_slow > 0")
    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:  # whole dimensions; gpt-oss keeps the fractional range (truncate false)
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rdim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rdim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    return (base / factor) * ramp + base * (1.0 - ramp)


def _check_repositionable(rope: RopeParams) -> None:
    kind = rope.rope_type
    if kind in _LENGTH_DEPENDENT:
        raise RepositionError(
            f"rope_type {kind!r} chooses its frequencies from the sequence length at encode time, so a cached key "
            "cannot be rotated to what a fresh encode at another position and context length would produce")
    if kind not in REPOSITIONABLE:
        raise RepositionError(f"rope_type {kind!r} is not one of {REPOSITIONABLE}")
    if rope.mrope_section:
        raise RepositionError("multimodal rope (mrope_section) rotates by 3-D positions; not supported")


def _positions(p, count: int, what: str) -> np.ndarray:
    if isinstance(p, (int, np.integer)):
        return np.arange(int(p), int(p) + count, dtype=np.int64)
    arr = np.asarray(p.detach().cpu().numpy() if is_torch(p) else p)
    if arr.ndim != 1 or arr.shape[0] != count or arr.dtype.kind not in "iu":
        raise RepositionError(f"{what} must be an int or {count} integer positions, got shape {arr.shape} "
                              f"dtype {arr.dtype}")
    return arr.astype(np.int64)


def reposition(keys: Any, old_positions: Any, new_positions: Any, rope: RopeParams) -> Any:
    """Keys cached (post-RoPE) at ``old_positions``, as if encoded at ``new_positions``.

    ``keys`` is ``[..., tokens, head_dim]`` (canonical ``[H, T, D]`` or HF ``[B, H, T, D]``),
    numpy or torch; positions are an int (the first of consecutive positions) or one integer
    per token. The attention factor of yarn is not applied: a stored key already carries it
    once and a rotation leaves it there (KVW-ROPE-4). Returns a new array of the same dtype.
    """
    if not isinstance(rope, RopeParams):
        raise RepositionError("RoPE parameters unknown (KVW-ARCH-8): nothing says how the keys were rotated")
    if keys.ndim < 2:
        raise RepositionError(f"keys must be [..., tokens, head_dim], got shape {tuple(keys.shape)}")
    tokens, head_dim = int(keys.shape[-2]), int(keys.shape[-1])
    if rope.rope_type == "none":  # no rotation was applied, none to move (KVW-ROPE-4)
        _positions(new_positions, tokens, "new_positions"), _positions(old_positions, tokens, "old_positions")
        return keys.clone() if is_torch(keys) else np.array(keys, copy=True)
    r = rotary_dim(rope, head_dim)
    freqs = inv_freq(rope, r)
    delta = _positions(new_positions, tokens, "new_positions") - _positions(old_positions, tokens, "old_positions")
    angle = delta[:, None].astype(np.float64) * freqs[None, :]  # [T, r/2]
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    if is_torch(keys):
        return _rotate_torch(keys, cos, sin, r, rope.interleaved)
    dtype_name(keys)  # rejects dtypes kvwire does not carry
    x = np.asarray(keys)
    out = x.astype(np.float32, copy=True)
    _rotate(out, x.astype(np.float32), cos, sin, r, rope.interleaved)
    return out.astype(x.dtype)


def _pair_slices(r: int, interleaved: bool):
    """(first, second) element of each rotated pair along the last axis (KVW-ROPE-2)."""
    if interleaved:
        return slice(0, r, 2), slice(1, r, 2)
    return slice(0, r // 2), slice(r // 2, r)


def _rotate(out, x, cos, sin, r, interleaved):
    a, b = _pair_slices(r, interleaved)
    x1, x2 = x[..., a], x[..., b]
    out[..., a] = x1 * cos - x2 * sin
    out[..., b] = x2 * cos + x1 * sin


def _rotate_torch(keys, cos, sin, r, interleaved):
    import torch

    x = keys.to(torch.float32)
    out = x.clone()
    c = torch.from_numpy(cos).to(keys.device)
    s = torch.from_numpy(sin).to(keys.device)
    _rotate(out, x, c, s, r, interleaved)
    return out.to(keys.dtype)


def rope_for_layer(spec: LayerSpec, arch_rope: RopeParams | None) -> RopeParams | None:
    """RoPE in effect for a layer (KVW-ARCH-8): None if it uses none, else its own or the model's."""
    if not spec.uses_rope:
        return None
    rope = spec.rope or arch_rope
    if rope is None:
        raise RepositionError("the container does not describe its RoPE parameters (unknown, KVW-ARCH-8)")
    return rope


def _rotated_dim(spec: LayerSpec) -> int:
    """Length of the vector RoPE rotates in a layer: the key, or an MLA latent's rotary tail."""
    return spec.qk_rope_head_dim if spec.kind == "mla_latent" else spec.head_dim_k


def shift_problems(header: Header, new_first_position: int) -> list[tuple[int | None, str]]:
    """Why ``shift`` would refuse to move the cache ``header`` describes: (layer or None, reason)
    for every cause, [] when it can move. Decided from the header alone, so the compatibility
    check promises a "shift positions" conversion exactly when ``shift`` performs it (KVW-XM-9)."""
    h = header
    out: list[tuple[int | None, str]] = []
    delta = int(new_first_position) - h.first_position
    if new_first_position < 0:
        out.append((None, f"new first position {new_first_position} is negative"))
    if delta and not any(s.uses_rope for s in h.arch.layers if s.kind != "shared"):
        out.append((None, "no layer uses RoPE: the model's positions are absolute (learned or sinusoidal "
                          "embeddings) or absent, and the header cannot tell which, so the keys cannot be moved"))
    for i, s in enumerate(h.arch.layers):
        if delta and s.kind == "state":
            out.append((i, "a state layer summarizes the whole prefix at its positions and cannot move "
                           "(KVW-STATE-6)"))
    if out or not h.arch.keys_post_rope or delta == 0:
        return out
    for i, (spec, rng) in enumerate(zip(h.arch.layers, h.layer_tokens)):
        if spec.kind in ("shared", "state"):
            continue
        try:
            rope = rope_for_layer(spec, h.arch.rope)
            if rope is not None and rng.count and rope.rope_type != "none":
                inv_freq(rope, rotary_dim(rope, _rotated_dim(spec)))
        except RepositionError as exc:
            out.append((i, exc.reason))
    return out


def shift(cache: KVCache, new_first_position: int) -> KVCache:
    """The same cache moved so that its token 0 sits at ``new_first_position``.

    Every stored key (and the rotary tail of each MLA latent) is rotated by the position
    difference with its layer's RoPE parameters; values are shared, not copied. Refuses
    (``RepositionError`` naming every cause) what ``shift_problems`` lists (KVW-ROPE-6).
    """
    from ..cache.kvcache import KVCache

    h = cache.header
    problems = shift_problems(h, new_first_position)
    if problems:
        raise RepositionError("; ".join(r if i is None else f"layer {i}: {r}" for i, r in problems))
    delta = int(new_first_position) - h.first_position
    if not h.arch.keys_post_rope or delta == 0:
        return KVCache(replace(h, first_position=int(new_first_position)), cache.layers)
    layers = []
    for spec, rng, layer in zip(h.arch.layers, h.layer_tokens, cache.layers):
        rope = None if spec.kind == "shared" else rope_for_layer(spec, h.arch.rope)
        if rope is None or rng.count == 0:
            layers.append(layer)
            continue
        old = h.first_position + rng.start
        if "k" in layer:
            layers.append({**layer, "k": reposition(layer["k"], old, old + delta, rope)})
        else:  # mla_latent: [compressed kv | rotary key], only the tail moves (KVW-ARCH-11)
            lat = layer["latent"]
            tail = reposition(lat[..., spec.kv_lora_rank:], old, old + delta, rope)
            layers.append({**layer, "latent": _concat_last(lat[..., :spec.kv_lora_rank], tail)})
    return KVCache(replace(h, first_position=int(new_first_position)), layers)


def _concat_last(a, b):
    if is_torch(a):
        import torch

        return torch.cat([a, b], dim=-1)
    return np.concatenate([a, b], axis=-1)


__all__ = ["REPOSITIONABLE", "RepositionError", "inv_freq", "reposition", "rope_for_layer", "rotary_dim", "shift",
           "shift_problems"]
