"""Hugging Face transformers adapter (kvwire.adapters.hf) against transformers 5.24 itself.

Every model type of the zoo round-trips bit for bit: DynamicCache -> from_hf -> encode ->
decode -> to_hf gives the same tensors, and continuing generation from the rebuilt cache
gives the same logits (torch.equal) as continuing from the original.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig

import kvwire
from kvwire.adapters import hf, zoo
from kvwire.format.header import LayerSpec

pytestmark = pytest.mark.usefixtures("one_torch_thread")


PREFILL = 12  # longer than the sliding windows (8): sliding layers keep only window - 1 = 7
_MODELS: dict = {}


def model(model_type: str):
    if model_type not in _MODELS:
        _MODELS[model_type] = zoo.build(model_type)
    return _MODELS[model_type]


def _ids(n: int, seed: int, batch: int = 1):
    return torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def _prefill(m, ids, **kw):
    with torch.no_grad():
        return m(ids, use_cache=True, **kw).past_key_values


def _logits(m, ids, cache, **kw):
    with torch.no_grad():
        return m(ids, cache=cache, use_cache=True, **kw).logits


def _assert_same_cache(a, b):
    assert len(a.layers) == len(b.layers)
    for i, (x, y) in enumerate(zip(a.layers, b.layers)):
        assert type(x) is type(y), i
        if x.keys is None:
            assert y.keys is None, i
            continue
        assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values), i
        assert x.get_seq_length() == y.get_seq_length(), i


@pytest.mark.slow
def test_kvwire_imports_transformers_only_when_an_adapter_function_runs():
    import subprocess
    import sys

    code = ("import sys, kvwire, kvwire.model.rope, kvwire.adapters.hf, kvwire.adapters.zoo; "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.slow
def test_zoo_is_deterministic_and_offline():
    assert len(zoo.TINY_CONFIGS) == 14
    a, b, c = zoo.build("llama", seed=3), zoo.build("llama", seed=3), zoo.build("llama", seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    assert next(a.parameters()).dtype == torch.float32 and not a.training
    with pytest.raises(KeyError, match="no tiny config"):
        zoo.build("not_a_model")


@pytest.mark.parametrize("model_type", sorted(zoo.TINY_CONFIGS))
def test_round_trip_is_bit_exact(model_type):
    """from_hf -> encode -> decode -> to_hf: identical tensors and identical next-token logits."""
    m = model(model_type)
    cache = _prefill(m, _ids(PREFILL, 0))
    kv = hf.from_hf(cache, m)
    assert kv.header.arch == hf.arch_from_config(m.config)
    assert kv.header.model.framework == "transformers" and kv.header.model.framework_version == "5.24.0"
    assert kv.header.model.model_type == m.config.model_type
    for spec, r in zip(kv.header.arch.layers, kv.header.layer_tokens):
        want = {"shared": (0, 0), "sliding_attention": (PREFILL - 7, 7)}.get(spec.kind, (0, PREFILL))
        assert (r.start, r.count) == want
    codec = "zstd" if model_type < "h" else "raw"
    back = kvwire.load(kvwire.encode(kv, codec=codec))
    assert back.header == kv.header
    rebuilt = hf.to_hf(back, m)
    _assert_same_cache(cache, rebuilt)
    nxt = _ids(2, 1)
    assert torch.equal(_logits(m, nxt, rebuilt), _logits(m, nxt, cache))


def test_arch_from_config_describes_each_family():
    a = hf.arch_from_config(zoo.config("mistral"))
    assert [s.kind for s in a.layers] == ["sliding_attention"] * 2 and a.layers[0].window == 8
    a = hf.arch_from_config(zoo.config("gemma3_text"))
    assert [s.kind for s in a.layers] == ["sliding_attention"] * 5 + ["full_attention"]
    assert a.rope is None  # one RoPE per layer type: local theta 1e4, global 1e6
    assert {s.rope.theta for s in a.layers} == {10000.0, 1000000.0}
    assert a.layers[5].rope.theta == 1000000.0
    assert hf.arch_from_config(zoo.config("falcon")).layers[0].num_kv_heads == 1
    assert hf.arch_from_config(zoo.config("gpt_bigcode")).layers[0].num_kv_heads == 1
    gpt2 = hf.arch_from_config(zoo.config("gpt2"))
    assert gpt2.rope is None and not any(s.uses_rope for s in gpt2.layers)
    q3 = hf.arch_from_config(zoo.config("qwen3")).layers[0]
    assert (q3.num_kv_heads, q3.head_dim_k, q3.head_dim_v) == (2, 32, 32)
    ds = hf.arch_from_config(zoo.config("deepseek_v3"))
    assert ds.layers[0] == LayerSpec("mla_latent", 1, 16 + 8, 0, kv_lora_rank=16, qk_rope_head_dim=8)
    assert ds.rope.rotary_dim == 0 and not ds.rope.interleaved  # transformers de-interleaves before rotating
    g3n = hf.arch_from_config(zoo.config("gemma3n_text"))
    kinds = [s.kind for s in g3n.layers]
    assert kinds[:5] == ["sliding_attention"] * 4 + ["full_attention"] and kinds[5:] == ["shared"] * 5
    # each consumer reads the last stored layer of its own attention type
    assert [s.source_layer for s in g3n.layers[5:]] == [3, 3, 3, 3, 4]


def test_yarn_without_truncation_is_described():
    """KVW-ROPE-7: gpt-oss's untruncated YaRN is yarn with truncate false (RopeParams field 17)."""
    arch = hf.arch_from_config(zoo.config("gpt_oss"))
    assert arch.rope.rope_type == "yarn" and arch.rope.truncate is False and arch.rope.factor == 32.0
    assert arch.rope.original_max_position_embeddings == 4096 and arch.rope.theta == 150000.0
    truncated = zoo.config("gpt_oss", rope_parameters={**zoo.config("gpt_oss").rope_parameters, "truncate": True})
    assert hf.rope_from_config(truncated).truncate is True
    assert hf.rope_from_config(zoo.config("llama")).truncate is True  # the default for every other type


def test_mla_latent_is_latent_then_rotary_key():
    """KVW-ARCH-11: transformers' K slot (normalized latent) first, then its V slot (post-RoPE rotary key)."""
    m = model("deepseek_v3")
    cache = _prefill(m, _ids(5, 2))
    kv = hf.from_hf(cache, m)
    lat = kv.layers[1]["latent"]
    assert tuple(lat.shape) == (1, 5, 24)
    assert torch.equal(lat[..., :16], cache.layers[1].keys[0]) and torch.equal(lat[..., 16:], cache.layers[1].values[0])


def _left_padded(m, lengths, seed):
    S = max(lengths)
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros((len(lengths), S), dtype=torch.long)
    mask = torch.zeros_like(ids)
    seqs = []
    for b, n in enumerate(lengths):
        seqs.append(torch.randint(3, 128, (n,), generator=g))
        ids[b, S - n:], mask[b, S - n:] = seqs[-1], 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return seqs, ids, mask, pos


@pytest.mark.parametrize("model_type", ["gemma2", "deepseek_v3", "gemma3n_text"])
def test_batch_with_left_padding(model_type):
    """A padded batch becomes one KVCache per sequence, equal to that sequence prefilled alone;
    to_hf(list) rebuilds the padded batch and generation continues with identical logits."""
    m = model(model_type)
    seqs, ids, mask, pos = _left_padded(m, [12, 5], seed=3)
    cache = _prefill(m, ids, attention_mask=mask, position_ids=pos)
    kvs = hf.from_hf_batch(cache, m, mask, position_ids=pos)
    assert [kv.header.token_count for kv in kvs] == [12, 5]
    for kv, seq in zip(kvs, seqs):
        alone = hf.from_hf(_prefill(m, seq[None]), m)
        assert kv.header == alone.header
        for a, b in zip(kv.layers, alone.layers):
            for comp in a:  # batched matmuls may round differently from single-row ones
                np.testing.assert_allclose(a[comp].numpy(), b[comp].numpy(), atol=1e-5, rtol=0)
    back = [kvwire.load(kvwire.encode(kv)) for kv in kvs]
    assert torch.equal(hf.padding_mask(back), mask)
    rebuilt = hf.to_hf(back, m)
    for x, y in zip(cache.layers, rebuilt.layers):  # real slots equal; padding slots are zero
        if x.keys is None:
            continue
        held = x.keys.shape[2]
        real = mask[:, -held:].bool()
        for b in range(2):
            assert torch.equal(x.keys[b][:, real[b]], y.keys[b][:, real[b]])
            assert torch.equal(x.values[b][:, real[b]], y.values[b][:, real[b]])
            assert not y.keys[b][:, ~real[b]].any()
    nxt = _ids(1, 4, batch=2)
    kw = dict(attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], -1),
              position_ids=torch.tensor([[12], [5]]))
    assert torch.equal(_logits(m, nxt, rebuilt, **kw), _logits(m, nxt, cache, **kw))


def test_right_padding_and_position_ids():
    m = model("llama")
    ids = _ids(9, 5)
    mask = torch.tensor([[1] * 6 + [0] * 3])
    cache = _prefill(m, ids, attention_mask=mask)
    kv = hf.from_hf(cache, m, attention_mask=mask, position_ids=torch.arange(40, 49)[None])
    assert kv.header.token_count == 6 and kv.header.first_position == 40
    assert torch.equal(kv.layers[0]["k"], cache.layers[0].keys[0, :, :6])


@settings(max_examples=12, deadline=None)
@given(model_type=st.sampled_from(["llama", "mistral", "gemma2", "deepseek_v3", "gpt2"]),
       lengths=st.lists(st.integers(1, 11), min_size=1, max_size=3), seed=st.integers(0, 1000))
def test_round_trip_property(model_type, lengths, seed):
    """Any prompt lengths (shorter or longer than the window, 1 token, ragged batches) round-trip."""
    m = model(model_type)
    _, ids, mask, pos = _left_padded(m, lengths, seed)
    cache = _prefill(m, ids, attention_mask=mask, position_ids=pos)
    kvs = [kvwire.load(kvwire.encode(kv)) for kv in hf.from_hf_batch(cache, m, mask, position_ids=pos)]
    rebuilt = hf.to_hf(kvs, m)
    for x, y in zip(cache.layers, rebuilt.layers):
        real = mask[:, -x.keys.shape[2]:].bool()
        assert x.keys.shape == y.keys.shape and x.get_seq_length() == y.get_seq_length()
        for b in range(len(lengths)):
            assert torch.equal(x.keys[b][:, real[b]], y.keys[b][:, real[b]])
            assert torch.equal(x.values[b][:, real[b]], y.values[b][:, real[b]])


# --- errors -------------------------------------------------------------------------------

def test_unsupported_layer_kind_is_named():
    cfg = AutoConfig.for_model("qwen3_next", vocab_size=128, hidden_size=64, intermediate_size=128,
                               num_attention_heads=4, num_hidden_layers=4, num_key_value_heads=2,
                               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                               linear_value_head_dim=16, num_experts=4)
    with pytest.raises(hf.UnsupportedModelError, match="'linear_attention'"):
        hf.arch_from_config(cfg)


def test_expanded_mla_cache_is_refused():
    """A DeepSeek cache in the per-head K/V form of older transformers is not misread as a latent."""
    from transformers import DynamicCache

    m = model("deepseek_v3")
    old = DynamicCache()
    for i in range(2):
        old.update(torch.zeros(1, 4, 3, 24), torch.zeros(1, 4, 3, 16), i)
    with pytest.raises(hf.UnsupportedModelError, match="expanded per head"):
        hf.from_hf(old, m)


def test_from_hf_argument_errors():
    m = model("llama")
    ids = _ids(6, 6, batch=2)
    cache = _prefill(m, ids)
    with pytest.raises(ValueError, match="batch of 2"):
        hf.from_hf(cache, m)
    with pytest.raises(IndexError):
        hf.from_hf(cache, m, sequence=2)
    with pytest.raises(ValueError, match="holes"):
        hf.from_hf(cache, m, attention_mask=torch.tensor([[1, 0, 1, 1, 1, 1]] * 2), sequence=0)
    with pytest.raises(ValueError, match="slots"):
        hf.from_hf(cache, m, attention_mask=torch.ones(2, 7), sequence=0)
    with pytest.raises(ValueError, match="consecutive"):
        hf.from_hf(cache, m, position_ids=torch.tensor([[0, 1, 2, 4, 5, 6]] * 2), sequence=1)
    with pytest.raises(ValueError, match=r"\[batch, slots\]"):
        hf.from_hf(cache, m, position_ids=torch.arange(6), sequence=0)
    with pytest.raises(ValueError, match="layers"):
        hf.from_hf(cache, model("gemma3_text"))
    with pytest.raises(TypeError, match="Cache"):
        hf.from_hf([(ids, ids)], m)


def test_to_hf_refuses_what_transformers_cannot_use():
    m = model("gemma2")
    kv = hf.from_hf(_prefill(m, _ids(PREFILL, 7)), m)
    with pytest.raises(ValueError, match="does not match the model"):
        hf.to_hf(kv, model("llama"))
    with pytest.raises(ValueError, match="cast explicitly"):
        hf.to_hf(_as_bf16(kv), m)
    short = kvwire.KVCache(kv.header.replace(layer_tokens=(kvwire.TokenRange(7, 5),) + kv.header.layer_tokens[1:]),
                           [{c: t[:, 2:] for c, t in kv.layers[0].items()}] + kv.layers[1:])
    with pytest.raises(ValueError, match="needs the last 7"):
        hf.to_hf(short, m)
    with pytest.raises(ValueError, match="no caches"):
        hf.to_hf([], m)


def _as_bf16(kv):
    return kvwire.KVCache(kv.header.replace(dtype="bf16", layer_tokens=kv.header.layer_tokens),
                          [{c: t.to(torch.bfloat16) for c, t in layer.items()} for layer in kv.layers])


# --- identity -----------------------------------------------------------------------------

def test_identity_and_compatibility():
    from kvwire.model.compat import check_compatible
    from kvwire.model.identity import FINGERPRINT_SCHEME

    m, tok = model("llama"), zoo.tokenizer()
    ident = hf.identity(m, tok)
    assert ident == hf.identity(zoo.build("llama"), zoo.tokenizer())  # deterministic, not per-object
    assert ident.fingerprint_scheme == FINGERPRINT_SCHEME and ident.framework == "transformers"
    assert len(ident.layer_weights_fingerprints) == 32 * 2 and ident.tokenizer_fingerprint
    kv = hf.from_hf(_prefill(m, _ids(4, 8)), m, identity=ident)
    header = kvwire.load(kvwire.encode(kv)).header
    local = hf.local_model(m, tok)
    assert local.arch == header.arch and local.dtype == "f32"
    assert check_compatible(header, local).status == "exact"
    assert check_compatible(header, hf.local_model(zoo.build("llama", seed=1), tok)).status == "incompatible"
    # a change to the top layer only: layer 0's cumulative fingerprint is unchanged
    tuned = zoo.build("llama")
    with torch.no_grad():
        tuned.model.layers[1].mlp.down_proj.weight.add_(1.0)
    t_ident = hf.identity(tuned, tok)
    assert t_ident.layer_weights_fingerprints[:32] == ident.layer_weights_fingerprints[:32]
    assert t_ident.layer_weights_fingerprints[32:] != ident.layer_weights_fingerprints[32:]
    assert hf.identity(m).tokenizer_fingerprint == b""
