"""Hugging Face transformers (5.x) <-> kvwire.

``from_hf`` turns a ``DynamicCache`` into a ``KVCache`` (one per sequence: padding is
removed with the attention mask, so a batch of requests becomes independent caches that
can be stored, shipped and recombined with other requests); ``to_hf`` rebuilds the exact
``DynamicCache`` transformers would hold after prefilling those tokens, for one cache or a
left-padded batch of them. ``arch_from_config`` reads the cache geometry (layer kinds,
windows, shared layers, MLA latent, RoPE) from a config alone, so a scheduler can describe
a model without loading it.

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

from dataclasses import replace
from typing import Sequence

import numpy as np

from ..cache.kvcache import KVCache
from ..format.header import Architecture, Header, LayerSpec, ModelIdentity, RopeParams, TokenRange
from ..cache.tensors import as_numpy, dtype_name, is_torch, torch_dtype

FRAMEWORK = "transformers"

# HF layer_types this adapter maps, and their kvwire layer kind
_KINDS = {"full_attention": "full_attention", "sliding_attention": "sliding_attention",
          "chunked_attention": "chunked_attention"}
# model types whose rotary pairs are (2j, 2j+1) (GPT-J style) in the cached keys
_INTERLEAVED = frozenset({"gptj", "codegen", "cohere", "cohere2", "llama4", "llama4_text"})
# model types without rotary embeddings (absolute or learned positions)
_NO_ROPE = frozenset({"gpt2", "gpt_bigcode", "opt", "bloom", "mpt"})
_MLA = frozenset({"deepseek_v2", "deepseek_v3"})
_ROPE_TYPES = frozenset({"default", "linear", "dynamic", "yarn", "longrope", "llama3"})


class UnsupportedModelError(ValueError):
    """The model's cache has a structure kvwire cannot describe (the message names it)."""


def _text_config(model_or_config):
    cfg = getattr(model_or_config, "config", model_or_config)
    get = getattr(cfg, "get_text_config", None)
    return get(decoder=True) if get is not None else cfg


def _framework_version() -> str:
    import transformers

    return transformers.__version__


# ---------------------------------------------------------------------------------------
# Architecture and RoPE from a config
# ---------------------------------------------------------------------------------------

def layer_types(config) -> list[str]:
    """transformers' per-layer cache type, "dummy" for KV-sharing consumers (as ``DynamicCache`` builds them)."""
    cfg = _text_config(config)
    n = cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None)
    if types is None:
        if getattr(cfg, "sliding_window", None) is not None:
            types = ["sliding_attention"] * n
        elif getattr(cfg, "attention_chunk_size", None) is not None:
            types = ["chunked_attention"] * n
        else:
            types = ["full_attention"] * n
    types = list(types)
    if len(types) != n:
        raise UnsupportedModelError(f"config.layer_types has {len(types)} entries for {n} layers")
    modes = getattr(cfg, "kv_sharing_modes", None) or [None] * n
    return ["dummy" if mode == "reuse" else t for t, mode in zip(types, modes)]


def _source_layers(cfg, types: list[str]) -> dict[int, int]:
    """KV-sharing consumer -> the layer whose cache it reads (gemma3n: the last stored layer of its type)."""
    raw = list(getattr(cfg, "layer_types", None) or [])
    modes = list(getattr(cfg, "kv_sharing_modes", None) or [])
    out = {}
    for i, t in enumerate(types):
        if t != "dummy":
            continue
        producers = [j for j in range(i) if modes[j] == "store" and raw[j] == raw[i]]
        if not producers:
            raise UnsupportedModelError(f"layer {i} reuses another layer's cache but no earlier layer of type "
                                        f"{raw[i] if raw else '?'} stores one")
        out[i] = producers[-1]
    return out


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _num_kv_heads(cfg) -> int:
    if cfg.model_type == "falcon":  # modeling_falcon: MQA unless the new decoder architecture is used
        if getattr(cfg, "multi_query", False) and not getattr(cfg, "new_decoder_architecture", False):
            return 1
        return getattr(cfg, "num_kv_heads", None) or cfg.num_attention_heads
    if cfg.model_type == "gpt_bigcode":
        return 1 if cfg.multi_query else cfg.num_attention_heads
    return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads


def _uses_rope(cfg) -> bool:
    if cfg.model_type in _NO_ROPE:
        return False
    if cfg.model_type == "falcon":
        return not getattr(cfg, "alibi", False)
    return getattr(cfg, "rope_parameters", None) is not None


def rope_from_config(config, layer_type: str | None = None) -> RopeParams | None:
    """RoPE parameters as transformers applies them (``rope_parameters``, per layer type where
    the config has one dict per type); None when they cannot be described exactly."""
    cfg = _text_config(config)
    rp = getattr(cfg, "rope_parameters", None)
    if rp is None:
        return None
    if layer_type is not None and isinstance(rp.get(layer_type), dict):
        rp = rp[layer_type]
    elif rp and all(isinstance(v, dict) for v in rp.values()):
        rp = rp.get("full_attention") or next(iter(rp.values()))
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        return None  # a variant the RoPE type registry has no code for: unknown (KVW-ARCH-8)
    head_dim = cfg.qk_rope_head_dim if cfg.model_type in _MLA else _head_dim(cfg)
    prf = rp.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None)) or 1.0
    rdim = int(head_dim * prf)
    orig = rp.get("original_max_position_embeddings") or getattr(cfg, "original_max_position_embeddings", None)
    factor = rp.get("factor")
    if factor is None and rope_type in ("yarn", "longrope") and orig:
        factor = cfg.max_position_embeddings / orig  # transformers' own fallback
    return RopeParams(
        rope_type=rope_type,
        theta=float(rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))),
        rotary_dim=0 if rdim == head_dim else rdim,
        interleaved=cfg.model_type in _INTERLEAVED,
        factor=float(factor if factor is not None else 1.0),
        original_max_position_embeddings=int(orig or 0),
        low_freq_factor=float(rp.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rp.get("high_freq_factor", 4.0)),
        beta_fast=float(rp.get("beta_fast") or 32.0),
        beta_slow=float(rp.get("beta_slow") or 1.0),
        attention_factor=_attention_factor(rope_type, rp, factor, orig),
        mscale=float(rp.get("mscale") or 1.0),
        mscale_all_dim=float(rp.get("mscale_all_dim") or 0.0),
        short_factor=tuple(float(x) for x in rp.get("short_factor") or ()),
        long_factor=tuple(float(x) for x in rp.get("long_factor") or ()),
        mrope_section=tuple(int(x) for x in rp.get("mrope_section") or ()),
        # transformers reads the top-level rope_parameters' flag, also for per-layer-type dicts
        truncate=bool(rp.get("truncate", _top_rope(cfg).get("truncate", True))) if rope_type == "yarn" else True,
    )


def _top_rope(cfg) -> dict:
    rp = getattr(cfg, "rope_parameters", None)
    return rp if isinstance(rp, dict) else {}


def _attention_factor(rope_type, rp, factor, orig) -> float:
    """The factor transformers multiplies cos/sin by (modeling_rope_utils), as the producer applied it."""
    import math

    given = rp.get("attention_factor")
    if given is not None or rope_type not in ("yarn", "longrope"):
        return float(given if given is not None else 1.0)
    factor = float(factor or 1.0)
    if rope_type == "longrope":
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    mscale, mscale_all_dim = rp.get("mscale"), rp.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return float(get_mscale(factor))


def arch_from_config(config) -> Architecture:
    """kvwire ``Architecture`` of the cache transformers keeps for this config (or model)."""
    cfg = _text_config(config)
    types = layer_types(cfg)
    sources = _source_layers(cfg, types)
    raw_types = list(getattr(cfg, "layer_types", None) or types)
    uses_rope = _uses_rope(cfg)
    rp = getattr(cfg, "rope_parameters", None) or {}
    per_type_rope = uses_rope and bool(rp) and all(isinstance(v, dict) for v in rp.values())
    model_rope = rope_from_config(cfg) if uses_rope and not per_type_rope else None
    specs = []
    for i, t in enumerate(types):
        if t == "dummy":
            specs.append(LayerSpec("shared", source_layer=sources[i]))
            continue
        if t not in _KINDS:
            raise UnsupportedModelError(
                f"layer {i} of {cfg.model_type!r} has cache layer type {t!r}; kvwire's transformers adapter "
                f"supports {sorted(_KINDS)} and KV-sharing layers")
        rope = rope_from_config(cfg, raw_types[i]) if per_type_rope else None
        window = 0
        if t == "sliding_attention":
            window = int(cfg.sliding_window)
        elif t == "chunked_attention":
            window = int(cfg.attention_chunk_size)
        nope = getattr(cfg, "no_rope_layers", None)  # llama4: 0 marks a layer without positional encoding
        layer_rope = uses_rope and (not nope or bool(nope[i]))
        if cfg.model_type in _MLA:
            if t != "full_attention":
                raise UnsupportedModelError(f"layer {i}: {t!r} MLA layers are not supported")
            rank, rot = int(cfg.kv_lora_rank), int(cfg.qk_rope_head_dim)
            specs.append(LayerSpec("mla_latent", 1, rank + rot, 0, uses_rope=layer_rope, rope=rope,
                                   kv_lora_rank=rank, qk_rope_head_dim=rot))
            continue
        d = _head_dim(cfg)
        specs.append(LayerSpec(_KINDS[t], _num_kv_heads(cfg), d, d, window=window, uses_rope=layer_rope,
                               rope=rope if layer_rope else None))
    return Architecture(tuple(specs), rope=model_rope)


# ---------------------------------------------------------------------------------------
# Identity
# ---------------------------------------------------------------------------------------

def _dtype_of(model) -> str:
    return dtype_name(next(model.parameters()).detach()[:0])


def _config_dict(cfg) -> dict:
    """The config as its config.json holds it (JSON object keys are strings: id2label's ints are not)."""
    import json

    return json.loads(cfg.to_json_string(use_diff=False))


def _tokenizer_fingerprint(tokenizer) -> bytes:
    import json

    from ..model.identity import tokenizer_fingerprint

    special = {k: (v if isinstance(v, (str, list)) else str(v))
               for k, v in (getattr(tokenizer, "special_tokens_map", None) or {}).items()}
    extra = {}
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        extra["tokenizer_json"] = json.loads(backend.to_str())
    return tokenizer_fingerprint(tokenizer.get_vocab(), special_tokens=special, extra=extra)


def light_identity(model) -> ModelIdentity:
    """Names only (model type, id, producing library): what ``from_hf`` records by default."""
    cfg = _text_config(model)
    return ModelIdentity(model_type=cfg.model_type, model_id=getattr(cfg, "name_or_path", "") or "",
                         framework=FRAMEWORK, framework_version=_framework_version())


def identity(model, tokenizer=None) -> ModelIdentity:
    """Full ``ModelIdentity`` of a loaded model: config, weights, per-layer and compat fingerprints.

    Hashes every weight once (cost proportional to the model size); compute it once per
    model and pass it to ``from_hf(..., identity=...)``. Without a tokenizer the tokenizer
    fingerprint is empty, and the compat fingerprint covers the model alone.
    """
    from ..model.identity import config_fingerprint, hf_layer_of, layer_weights_fingerprints, make_identity
    from ..model.identity import weights_fingerprint

    cfg = _text_config(model)
    arch = arch_from_config(cfg)
    named = list(model.state_dict().items())
    light = light_identity(model)
    return make_identity(
        arch, _dtype_of(model),
        tokenizer=_tokenizer_fingerprint(tokenizer) if tokenizer is not None else b"",
        weights=weights_fingerprint(named),
        config=config_fingerprint(_config_dict(getattr(model, "config", cfg))),
        layer_weights=layer_weights_fingerprints(named, hf_layer_of, arch.num_layers),
        model_type=light.model_type, model_id=light.model_id,
        framework=light.framework, framework_version=light.framework_version)


def local_model(model, tokenizer=None, **kw):
    """The receiver description ``check_compatible`` needs, for a loaded transformers model."""
    from ..model.compat import LocalModel

    return LocalModel(arch=arch_from_config(model), dtype=_dtype_of(model), identity=identity(model, tokenizer), **kw)


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
    tensors, ranges, dtype = [], [], None
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
        out.layers[i].update(K, V)
        if hasattr(out.layers[i], "cumulative_length"):
            out.layers[i].cumulative_length = S  # tokens seen, not tokens kept: drives the sliding mask
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
