"""Tiny, offline, deterministic transformers models: one per supported ``model_type``.

Tests, conformance vectors and demos need real caches from real architectures without
network access or large downloads. Each config here builds in well under a second
(< 0.5M parameters) and reproduces the cache shape quirks of its family (GQA, MQA,
sliding windows, MLA latent, shared layers). Weights are float32 so that round trips
can be compared bit for bit, and are a pure function of ``seed``.

transformers (and torch) are imported lazily: importing this module costs nothing.
"""

from __future__ import annotations

_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               max_position_embeddings=256, num_hidden_layers=2)
_TOKENS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)

TINY_CONFIGS: dict[str, dict] = {
    "gpt2": dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=256, **_TOKENS),
    "llama": dict(_COMMON, num_key_value_heads=2, head_dim=16, **_TOKENS),
    "qwen2": dict(_COMMON, num_key_value_heads=2, **_TOKENS),
    "qwen3": dict(_COMMON, num_key_value_heads=2, head_dim=32, **_TOKENS),
    "mistral": dict(_COMMON, num_key_value_heads=2, sliding_window=8, **_TOKENS),
    "gemma2": dict(_COMMON, num_key_value_heads=2, head_dim=16, sliding_window=8, **_TOKENS),
    "gemma3_text": dict(_COMMON, num_hidden_layers=6, num_key_value_heads=2, head_dim=16,
                        sliding_window=8, **_TOKENS),
    "falcon": dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                   multi_query=True, new_decoder_architecture=False, **_TOKENS),
    "gpt_bigcode": dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                        multi_query=True, **_TOKENS),
    "deepseek_v3": dict(_COMMON, num_hidden_layers=2, num_key_value_heads=4, kv_lora_rank=16,
                        q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                        first_k_dense_replace=1, moe_intermediate_size=32, **_TOKENS),
    "phi3": dict(_COMMON, num_key_value_heads=2, **_TOKENS),
    "gpt_oss": dict(_COMMON, intermediate_size=64, num_key_value_heads=2, head_dim=16,
                    sliding_window=8, num_local_experts=4, num_experts_per_tok=2, **_TOKENS),
    "olmo2": dict(_COMMON, num_key_value_heads=2, **_TOKENS),
    "gemma3n_text": dict(_COMMON, num_hidden_layers=10, num_key_value_heads=2, head_dim=16,
                         sliding_window=8, num_kv_shared_layers=5, hidden_size_per_layer_input=8,
                         vocab_size_per_layer_input=128, laurel_rank=8, **_TOKENS),
}
"""``model_type`` -> keyword arguments for ``AutoConfig.for_model``."""


def config(model_type: str, **overrides):
    """The tiny ``PretrainedConfig`` for ``model_type`` (``overrides`` win over the table)."""
    from transformers import AutoConfig

    if model_type not in TINY_CONFIGS:
        raise KeyError(f"no tiny config for model_type {model_type!r}; known: {sorted(TINY_CONFIGS)}")
    kw = dict(TINY_CONFIGS[model_type])
    kw.update(overrides)
    cfg = AutoConfig.for_model(model_type, **kw)
    # eager attention is the one implementation every family supports (gpt_oss sinks,
    # gemma2 soft-capping); the same path for all keeps comparisons like for like
    cfg._attn_implementation = "eager"
    return cfg


def build(model_type: str, seed: int = 0, **overrides):
    """A tiny float32 causal LM in eval mode; same ``seed`` -> same weights, bit for bit."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = config(model_type, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model.eval()


def tokenizer(vocab_size: int = 128):
    """A word-level fast tokenizer for the zoo's models, built offline: ``"t<id>"`` words, ids
    0-2 are ``<pad>``/``<s>``/``</s>`` as in ``_TOKENS``. The compatibility check refuses a
    cache without a tokenizer fingerprint (KVW-XM-3), so tests, the conformance suite and the
    demo need a real tokenizer on both sides; this is the one they share."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
