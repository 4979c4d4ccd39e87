"""Hugging Face transformers (5.x) <-> kvwire.

``from_hf`` turns a ``DynamicCache`` into a ``KVCache`` (one per sequence: padding is
removed with the attention mask, so a batch of requests becomes independent caches that
can be stored, shipped and recombined with other requests); ``to_hf`` rebuilds the exact
``DynamicCache`` transformers would hold after prefilling those tokens, for one cache or a
left-padded batch of them. ``arch_from_config`` reads the cache geometry (layer kinds,
windows, shared layers, MLA latent, RoPE) from a config alone, so a scheduler can describe
a model without loading it; it and the other model-side names (``rope_from_config``,
``layer_types``, ``identity``, ``light_identity``, ``local_model``) live in
``adapters.hf_model`` and are re-exported here, the documented public path.

What transformers keeps per layer (5.24): full layers all tokens, sliding/chunked layers
the last ``window - 1`` tokens, KV-sharing consumers (gemma3n) nothing (``DummyLayer``).
DeepSeek MLA layers keep the normalized latent in the K slot ``[B, 1, S, kv_lora_rank]``
and the post-RoPE rotary key in the V slot ``[B, 1, S, qk_rope_head_dim]``; kvwire stores
them as one ``latent`` component (latent, then rotary key: KVW-ARCH-11) and records the
producing library in ``ModelIdentity.framework``/``framework_version`` because earlier
transformers versions cached the expanded per-head K/V in the same slots.

transformers and torch are imported only when a function here is called.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from ..cache.kvcache import KVCache
from ..cache.tensors import as_numpy, dtype_name, is_torch, torch_dtype
from ..format.header import Architecture, Header, LayerSpec, ModelIdentity, TokenRange

# the model-side names, re-exported: kvwire.adapters.hf.arch_from_config etc. are documented paths
from .hf_model import (
    UnsupportedModelError,
    arch_from_config,
    identity,
    layer_types,
    light_identity,
    local_model,
    rope_from_config,
)

# ---------------------------------------------------------------------------------------
# DynamicCache -> KVCache
# ---------------------------------------------------------------------------------------

def _ints(x) -> np.ndarray:
    """An integer mask or position tensor as numpy (they are not kvwire dtypes)."""
    return x.detach().cpu().numpy() if is_torch(x) else np.asarray(x)


def _real_span(mask_row, S: int, b: int) -> tuple[int, int]:
    """(first slot, count) of a sequence's real tokens; padding must be on one side only."""
    m = _ints(mask_row).astype(bool)
    if m.shape != (S,):
        raise ValueError(f"attention_mask row {b} has shape {m.shape}, the cache holds {S} slots")
    idx = np.flatnonzero(m)
    if idx.size == 0:
        return 0, 0
    a, n = int(idx[0]), int(idx.size)
    if idx[-1] != a + n - 1:
        raise ValueError(f"attention_mask row {b} has holes: only left or right padding can be removed")
    return a, n


def _first_position(position_ids, b: int, a: int, n: int) -> int:
    if position_ids is None or n == 0:
        return 0
    p = _ints(position_ids)
    if p.ndim != 2:
        raise ValueError(f"position_ids must be [batch, slots] or [1, slots], got shape {p.shape}")
    p = p[b if p.shape[0] > 1 else 0, a:a + n].astype(np.int64)
    if p.shape != (n,) or np.any(np.diff(p) != 1) or p[0] < 0:
        raise ValueError(f"position_ids of sequence {b} are not consecutive non-negative positions over its tokens")
    return int(p[0])


def _cache_layers(cache, arch: Architecture) -> list:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"expected a transformers Cache with .layers, got {type(cache).__name__}")
    if len(layers) != arch.num_layers:
        raise ValueError(f"cache has {len(layers)} layers, the model's config describes {arch.num_layers}")
    return layers


def _seq_len(layers) -> tuple[int, int]:
    """(batch size, slots S of the cumulative sequence) of a filled cache."""
    batch, S = None, 0
    for layer in layers:
        if getattr(layer, "keys", None) is None or not layer.keys.numel():
            continue
        batch = int(layer.keys.shape[0])
        S = max(S, int(layer.get_seq_length()))
    if batch is None:
        raise ValueError("the cache holds no tokens")
    return batch, S


def _check_slots(i: int, spec: LayerSpec, k, v) -> None:
    if spec.kind == "mla_latent":
        want_k, want_v = (1, spec.kv_lora_rank), (1, spec.qk_rope_head_dim)
    else:
        want_k, want_v = (spec.num_kv_heads, spec.head_dim_k), (spec.num_kv_heads, spec.head_dim_v)
    got_k, got_v = (int(k.shape[1]), int(k.shape[3])), (int(v.shape[1]), int(v.shape[3]))
    if (got_k, got_v) != (want_k, want_v):
        hint = (" (this transformers version caches MLA expanded per head; kvwire maps the latent cache of "
                "transformers >= 5.24)" if spec.kind == "mla_latent" else "")
        raise UnsupportedModelError(f"layer {i} ({spec.kind}): cache slots hold [heads, dim] K {got_k} V {got_v}, "
                                    f"the config implies K {want_k} V {want_v}{hint}")


def from_hf(cache, model, *, attention_mask=None, position_ids=None, sequence: int | None = None,
            identity: ModelIdentity | None = None) -> KVCache:
    """One sequence of a transformers cache as a ``KVCache`` (tensors are views where possible).

    ``attention_mask`` ([B, S], 1 = real token) removes left or right padding;
    ``position_ids`` ([B, S] or [1, S]) give the model position of each slot (default: the
    first real token is at position 0, as ``generate`` numbers padded batches). A batch of
    more than one sequence needs ``sequence=b`` (or ``from_hf_batch``).
    """
    arch = arch_from_config(model)
    layers = _cache_layers(cache, arch)
    batch, S = _seq_len(layers)
    if sequence is None:
        if batch != 1:
            raise ValueError(f"the cache holds a batch of {batch}: pass sequence=b or use from_hf_batch")
        sequence = 0
    if not 0 <= sequence < batch:
        raise IndexError(f"sequence {sequence} outside batch of {batch}")
    b = sequence
    a, n = (0, S) if attention_mask is None else _real_span(attention_mask[b], S, b)
    tensors: list[dict[str, Any]] = []
    ranges: list[TokenRange] = []
    dtype: str | None = None
    for i, (spec, layer) in enumerate(zip(arch.layers, layers)):
        if spec.kind == "shared":
            if getattr(layer, "keys", None) is not None:
                raise UnsupportedModelError(f"layer {i} shares layer {spec.source_layer}'s cache but holds its own")
            tensors.append({})
            ranges.append(TokenRange(0, 0))
            continue
        k, v = layer.keys, layer.values
        if k is None or v is None:
            raise ValueError(f"layer {i} ({spec.kind}) holds no cache")
        _check_slots(i, spec, k, v)
        held = int(k.shape[2])
        lo, hi = max(a, S - held), min(a + n, S)
        count = max(0, hi - lo)
        sl = slice(lo - (S - held), lo - (S - held) + count)
        kb, vb = k[b, :, sl].detach(), v[b, :, sl].detach()
        if spec.kind == "mla_latent":
            import torch

            layer_t = {"latent": torch.cat([kb, vb], dim=-1)}
        else:
            layer_t = {"k": kb.contiguous(), "v": vb.contiguous()}
        tensors.append(layer_t)
        ranges.append(TokenRange(max(0, lo - a) if count else n, count))
        dtype = dtype or dtype_name(kb)
    assert dtype is not None  # arch_from_config gives a model a layer of its own
    header = Header(arch=arch, token_count=n, dtype=dtype, first_position=_first_position(position_ids, b, a, n),
                    layer_tokens=tuple(ranges), model=identity or light_identity(model))
    return KVCache(header, tensors)


def from_hf_batch(cache, model, attention_mask=None, *, position_ids=None,
                  identity: ModelIdentity | None = None) -> list[KVCache]:
    """Every sequence of a batched cache, padding removed: one ``KVCache`` per sequence."""
    arch = arch_from_config(model)
    batch, _ = _seq_len(_cache_layers(cache, arch))
    ident = identity or light_identity(model)
    return [from_hf(cache, model, attention_mask=attention_mask, position_ids=position_ids, sequence=b,
                    identity=ident) for b in range(batch)]


# ---------------------------------------------------------------------------------------
# KVCache -> DynamicCache
# ---------------------------------------------------------------------------------------

def _to_torch(x, device):
    import torch

    if is_torch(x):
        return x.to(device)
    a = np.ascontiguousarray(as_numpy(x))
    name = dtype_name(a)
    ints = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[a.dtype.itemsize]
    return torch.from_numpy(a.view(ints)).view(torch_dtype(name)).to(device)


def _check_receivable(h: Header, arch: Architecture, dtype: str, b: int) -> None:
    if h.num_layers != arch.num_layers:
        raise ValueError(f"cache {b} has {h.num_layers} layers, the model has {arch.num_layers}")
    for i, (got, want) in enumerate(zip(h.arch.layers, arch.layers)):
        if replace(got, rope=None) != replace(want, rope=None):
            raise ValueError(f"cache {b} layer {i}: {got.kind} {got.num_kv_heads}x{got.head_dim_k}/{got.head_dim_v} "
                             f"window {got.window} source {got.source_layer} does not match the model's "
                             f"{want.kind} {want.num_kv_heads}x{want.head_dim_k}/{want.head_dim_v} window "
                             f"{want.window} source {want.source_layer}")
    if h.dtype != dtype:
        raise ValueError(f"cache {b} is {h.dtype}, the model computes in {dtype}: cast explicitly first")
    if not h.arch.keys_post_rope:
        raise ValueError(f"cache {b} stores keys before RoPE; transformers caches them after")


def _needed(spec: LayerSpec, n: int, slots: int) -> int:
    """Tokens transformers holds for a layer after n tokens (sliding: the last window - 1)."""
    if spec.kind in ("sliding_attention", "chunked_attention"):
        return min(n, spec.window - 1, slots)
    return n


def to_hf(kvcache: KVCache | Sequence[KVCache], model):
    """A ``DynamicCache`` holding ``kvcache`` as transformers would after prefilling its tokens.

    A list of caches becomes one left-padded batch (padding slots are zero; use
    ``padding_mask(caches)`` as the attention mask and position ``first_position + token_count``
    per sequence for the next token). Tensors go to the model's device.
    """
    import torch
    from transformers import DynamicCache
    from transformers.cache_utils import CacheLayerMixin

    caches = [kvcache] if isinstance(kvcache, KVCache) else list(kvcache)
    if not caches:
        raise ValueError("no caches given")
    arch = arch_from_config(model)
    param = next(model.parameters())
    dtype, device = dtype_name(param.detach()[:0]), param.device
    for b, c in enumerate(caches):
        _check_receivable(c.header, arch, dtype, b)
    S = max(c.header.token_count for c in caches)
    out = DynamicCache(config=model.config)
    if len(out.layers) != arch.num_layers:
        raise UnsupportedModelError(f"DynamicCache(config) built {len(out.layers)} layers for {arch.num_layers}")
    for i, spec in enumerate(arch.layers):
        if spec.kind == "shared":
            continue  # transformers gives KV-sharing consumers a DummyLayer; they read the source layer's states
        L = _needed(spec, S, S)
        parts = []  # (batch row, K tail, V tail) of each sequence's last m tokens
        for b, c in enumerate(caches):
            n, r = c.header.token_count, c.header.layer_tokens[i]
            m = _needed(spec, n, L)
            if m == 0:
                continue
            if r.stop != n or r.count < m:
                raise ValueError(f"cache {b} layer {i} ({spec.kind}) holds tokens [{r.start}, {r.stop}) of {n}; "
                                 f"transformers needs the last {m}")
            k, v = _slots(spec, c.layers[i], device)
            parts.append((b, k[:, r.count - m:], v[:, r.count - m:]))
        if len(caches) == 1 and parts and parts[0][1].shape[1] == L:  # no padding: update() makes the one copy
            K, V = parts[0][1][None], parts[0][2][None]
        else:
            (hk, dk), (hv, dv) = _slot_shapes(spec)
            K = torch.zeros((len(caches), hk, L, dk), dtype=param.dtype, device=device)
            V = torch.zeros((len(caches), hv, L, dv), dtype=param.dtype, device=device)
            for b, k, v in parts:
                K[b, :, L - k.shape[1]:] = k
                V[b, :, L - v.shape[1]:] = v
        slot = out.layers[i]
        assert isinstance(slot, CacheLayerMixin)  # an attention layer's (shared ones were skipped)
        slot.update(K, V)
        if hasattr(slot, "cumulative_length"):
            slot.cumulative_length = S  # tokens seen, not tokens kept: drives the sliding mask
    return out


def _slot_shapes(spec: LayerSpec):
    if spec.kind == "mla_latent":
        return (1, spec.kv_lora_rank), (1, spec.qk_rope_head_dim)
    return (spec.num_kv_heads, spec.head_dim_k), (spec.num_kv_heads, spec.head_dim_v)


def _slots(spec: LayerSpec, layer: dict, device):
    if spec.kind == "mla_latent":
        lat = _to_torch(layer["latent"], device)
        return lat[..., :spec.kv_lora_rank], lat[..., spec.kv_lora_rank:]
    return _to_torch(layer["k"], device), _to_torch(layer["v"], device)


def padding_mask(caches: Sequence[KVCache], device=None):
    """The [B, S] attention mask (int64, left padding) matching ``to_hf(caches, model)``."""
    import torch

    S = max(c.header.token_count for c in caches)
    mask = torch.zeros((len(caches), S), dtype=torch.long, device=device)
    for b, c in enumerate(caches):
        if c.header.token_count:
            mask[b, S - c.header.token_count:] = 1
    return mask


__all__ = ["UnsupportedModelError", "arch_from_config", "from_hf", "from_hf_batch", "identity", "layer_types",
           "light_identity", "local_model", "padding_mask", "rope_from_config", "to_hf"]
