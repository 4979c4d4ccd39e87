"""What a Hugging Face transformers (5.x) model is, as kvwire describes it.

``arch_from_config`` reads the cache geometry transformers keeps (layer kinds, windows,
shared layers, MLA latent, RoPE) from a config alone, so a scheduler can describe a
model without loading it; ``rope_from_config`` and ``layer_types`` are its parts.
``identity``, ``light_identity`` and ``local_model`` describe a loaded model for
``ModelIdentity`` and ``check_compatible``. The cache conversion itself (``from_hf``,
``to_hf``) is in ``adapters.hf``, which re-exports these names: ``kvwire.adapters.hf``
stays the one public path.

transformers and torch are imported only when a function here is called.
"""

from __future__ import annotations

from ..cache.tensors import dtype_name
from ..format.errors import Error
from ..format.header import Architecture, LayerSpec, ModelIdentity, RopeParams

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


class UnsupportedModelError(Error, ValueError):
    """The model's cache has a structure kvwire cannot describe (the message names it)."""

    code = "UNSUPPORTED_MODEL"


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
    fingerprint is empty, and the compat fingerprint covers the model alone: a receiver
    identified without one too (``local_model(model)``) accepts the cache, one identified with
    a tokenizer refuses it unless it passes ``allow_missing={"tokenizer"}`` (KVW-XM-3).
    """
    from ..model.identity import (
        config_fingerprint,
        hf_layer_of,
        layer_weights_fingerprints,
        make_identity,
        weights_fingerprint,
    )

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
    """The receiver description ``check_compatible`` needs, for a loaded transformers model;
    ``kw`` are ``LocalModel``'s (``accept_casts``, ``allow_missing``, ...)."""
    from ..model.compat import LocalModel

    return LocalModel(arch=arch_from_config(model), dtype=_dtype_of(model), identity=identity(model, tokenizer), **kw)



__all__ = ["FRAMEWORK", "UnsupportedModelError", "arch_from_config", "identity", "layer_types", "light_identity",
           "local_model", "rope_from_config"]
