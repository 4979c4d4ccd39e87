"""RoPE re-positioning (spec/crossmodel.md, "RoPE re-positioning", KVW-ROPE-*).

The reference for every rope type is transformers itself: keys it caches at positions
p, re-positioned by kvwire to q, against the keys it caches when the same tokens are
encoded at q.

Tolerance (``ATOL``): transformers computes each angle as float32(position * inv_freq),
then cos/sin in float32. For positions below 256 and inv_freq <= 1 the angle is off by at
most 256 * 2**-24 ~ 1.5e-5 rad in each of the two encodes, so a key pair of norm |k| can
differ by ~3e-5 * |k| from the exact rotation; the tiny models' keys have |k| < 6. 2e-4
covers that with margin, while not re-positioning is off by > 0.1 and applying yarn's
attention factor a second time by ~0.14 * |k| (both asserted below).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import kvwire
from kvwire import rope as kr
from kvwire.adapters import hf, zoo
from kvwire.format.header import Architecture, LayerSpec, RopeParams
from kvwire.model.rope import RepositionError, reposition

pytestmark = pytest.mark.usefixtures("one_torch_thread")


ATOL = 2e-4
T = 10
OLD, NEW = 5, 200

HF_ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
}
_MODELS: dict = {}


def _model(model_type: str, rope_parameters: dict):
    key = (model_type, tuple(sorted(rope_parameters.items())))
    if key not in _MODELS:
        if model_type in zoo.TINY_CONFIGS:
            _MODELS[key] = zoo.build(model_type, rope_parameters=rope_parameters)
        else:  # gpt_neox: partial rotary with any rope type (llama rotates all dims, phi3 allows longrope only)
            cfg = AutoConfig.for_model(model_type, vocab_size=128, hidden_size=64, intermediate_size=128,
                                       num_attention_heads=4, num_hidden_layers=2, max_position_embeddings=256,
                                       rope_parameters=rope_parameters)
            torch.manual_seed(0)
            _MODELS[key] = AutoModelForCausalLM.from_config(cfg).eval()
    return _MODELS[key]


def _keys_at(model, start: int, layer: int = 0):
    ids = torch.arange(3, 3 + T)[None] * 7 % 120 + 3
    with torch.no_grad():
        out = model(ids, position_ids=torch.arange(start, start + T)[None], use_cache=True)
    return out.past_key_values.layers[layer].keys[0]


@pytest.mark.parametrize("rope_type", sorted(HF_ROPES))
def test_inv_freq_matches_transformers(rope_type):
    """KVW-ROPE-3: the frequency formulas are transformers' (computed in float64 here, float32 there)."""
    for prf in (1.0, 0.5):
        cfg = AutoConfig.for_model("gpt_neox", hidden_size=64, num_attention_heads=4,
                                   rope_parameters={**HF_ROPES[rope_type], "partial_rotary_factor": prf})
        want, attention = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu") if rope_type != "default" else (None, 1.0)
        params = hf.rope_from_config(cfg)
        rdim = kr.rotary_dim(params, 16)
        assert rdim == int(16 * prf)
        got = kr.inv_freq(params, rdim)
        if want is None:
            want = 1.0 / 10000.0 ** (np.arange(0, rdim, 2) / rdim)
        np.testing.assert_allclose(got, np.asarray(want, dtype=np.float64), rtol=2e-7)
        assert params.attention_factor == pytest.approx(float(attention))


@pytest.mark.parametrize("rope_type", sorted(HF_ROPES))
def test_reposition_matches_fresh_encode(rope_type):
    """KVW-ROPE-4: keys cached at OLD, rotated by NEW - OLD, are the keys transformers caches at NEW."""
    model = _model("llama", HF_ROPES[rope_type])
    params = hf.rope_from_config(model.config)
    k_old, k_new = _keys_at(model, OLD), _keys_at(model, NEW)
    got = reposition(k_old.numpy(), OLD, NEW, params)
    assert got.dtype == np.float32 and got.shape == tuple(k_old.shape)
    np.testing.assert_allclose(got, k_new.numpy(), atol=ATOL, rtol=0)
    assert np.abs(k_old.numpy() - k_new.numpy()).max() > 0.1  # the test is not vacuous
    # per-token position arrays, and the torch path, give the same keys
    per_token = reposition(k_old.numpy(), np.arange(OLD, OLD + T), np.arange(NEW, NEW + T), params)
    np.testing.assert_array_equal(per_token, got)
    got_t = reposition(k_old, OLD, NEW, params)
    assert isinstance(got_t, torch.Tensor) and got_t.dtype == torch.float32
    np.testing.assert_allclose(got_t.numpy(), got, atol=1e-6, rtol=0)


def test_yarn_attention_factor_not_applied_twice():
    """KVW-ROPE-4: the stored key already carries yarn's attention factor once; rotation keeps it once."""
    model = _model("llama", HF_ROPES["yarn"])
    params = hf.rope_from_config(model.config)
    assert params.attention_factor == pytest.approx(0.1 * np.log(4.0) + 1.0)
    k_old, k_new = _keys_at(model, OLD).numpy(), _keys_at(model, NEW).numpy()
    got = reposition(k_old, OLD, NEW, params)
    np.testing.assert_allclose(got, k_new, atol=ATOL, rtol=0)
    twice = got * params.attention_factor
    assert np.abs(twice - k_new).max() > 10 * ATOL


def test_untruncated_yarn_matches_gpt_oss():
    """KVW-ROPE-3, KVW-ROPE-7: yarn with truncate false (gpt-oss) keeps the fractional correction
    range: the frequencies are transformers', they differ from truncated yarn's, and gpt-oss keys
    re-positioned by kvwire are the keys transformers caches at the new positions."""
    model = zoo.build("gpt_oss")
    params = hf.rope_from_config(model.config)
    assert params.rope_type == "yarn" and params.truncate is False
    want, attention = ROPE_INIT_FUNCTIONS["yarn"](model.config, "cpu")
    got = kr.inv_freq(params, kr.rotary_dim(params, 16))
    np.testing.assert_allclose(got, np.asarray(want, dtype=np.float64), rtol=2e-7)
    assert params.attention_factor == pytest.approx(float(attention))
    truncated = kr.inv_freq(dataclasses.replace(params, truncate=True), 16)
    assert np.abs(truncated / got - 1).max() > 0.1  # the flag matters for these parameters
    assert model.config.layer_types[1] == "full_attention"  # every position kept
    k_old, k_new = _keys_at(model, OLD, layer=1).numpy(), _keys_at(model, NEW, layer=1).numpy()
    np.testing.assert_allclose(reposition(k_old, OLD, NEW, params), k_new, atol=ATOL, rtol=0)
    wrong = reposition(k_old, OLD, NEW, dataclasses.replace(params, truncate=True))
    assert np.abs(wrong - k_new).max() > 10 * ATOL


@pytest.mark.parametrize("rope_type", ["yarn", "llama3", "default"])
def test_partial_rotary(rope_type):
    """KVW-ROPE-1: only the first rotary_dim dimensions move; the rest are copied bit for bit."""
    model = _model("gpt_neox", {**HF_ROPES[rope_type], "partial_rotary_factor": 0.5})
    params = hf.rope_from_config(model.config)
    assert params.rotary_dim == 8
    k_old, k_new = _keys_at(model, OLD).numpy(), _keys_at(model, NEW).numpy()
    got = reposition(k_old, OLD, NEW, params)
    np.testing.assert_allclose(got, k_new, atol=ATOL, rtol=0)
    np.testing.assert_array_equal(got[..., 8:], k_old[..., 8:])


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "deepseek_v3", "qwen3"])
def test_shift_whole_cache_matches_fresh_prefill(model_type):
    """KVW-ROPE-6: every layer's keys (MLA: the rotary tail of the latent) move with that layer's RoPE.

    Layers above the first see hidden states that differ from a fresh prefill only by
    rounding (RoPE attention depends on relative positions), hence the same tolerance.
    """
    model = zoo.build(model_type)
    ids = torch.arange(6)[None] * 11 % 120 + 3
    with torch.no_grad():
        c0 = model(ids, use_cache=True).past_key_values
        c1 = model(ids, position_ids=torch.arange(100, 106)[None], use_cache=True).past_key_values
    k0 = hf.from_hf(c0, model)
    k1 = hf.from_hf(c1, model, position_ids=torch.arange(100, 106)[None])
    moved = kr.shift(k0, 100)
    assert moved.header == k1.header and moved.header.first_position == 100
    for i, (a, b, orig) in enumerate(zip(moved.layers, k1.layers, k0.layers)):
        for comp in a:
            np.testing.assert_allclose(a[comp].numpy(), b[comp].numpy(), atol=ATOL, rtol=0, err_msg=f"layer {i}")
        if "v" in a:
            assert a["v"] is orig["v"]  # values do not depend on positions: shared, not copied
    if model_type == "deepseek_v3":  # the compressed part of the latent is position-free and untouched
        rank = k0.header.arch.layers[0].kv_lora_rank
        assert torch.equal(moved.layers[0]["latent"][..., :rank], k0.layers[0]["latent"][..., :rank])
    back = kr.shift(moved, 0)
    for a, b in zip(back.layers, k0.layers):
        for comp in a:
            np.testing.assert_allclose(a[comp].numpy(), b[comp].numpy(), atol=1e-5, rtol=0)


def _rope_params():
    kinds = st.sampled_from(["default", "linear", "llama3", "yarn"])
    return st.builds(
        lambda kind, theta, factor, interleaved, half: RopeParams(
            kind, theta=theta, factor=factor, interleaved=interleaved, rotary_dim=8 if half else 0,
            original_max_position_embeddings=64),
        kinds, st.sampled_from([10000.0, 500000.0, 1e6]), st.sampled_from([1.0, 2.0, 8.0, 32.0]),
        st.booleans(), st.booleans())


@settings(max_examples=40, deadline=None)
@given(params=_rope_params(), old=st.integers(0, 4000), delta=st.integers(-2000, 2000),
       seed=st.integers(0, 2**32 - 1))
def test_reposition_properties(params, old, delta, seed):
    """KVW-ROPE-2/4: rotations compose (there and back is the identity), norms of pairs are kept,
    a zero shift and dimensions beyond rotary_dim are bit-exact."""
    x = np.random.default_rng(seed).standard_normal((2, 5, 16)).astype(np.float32)
    new = max(0, old + delta)
    y = reposition(x, old, new, params)
    z = reposition(y, new, old, params)
    np.testing.assert_allclose(z, x, atol=1e-5, rtol=0)
    r = kr.rotary_dim(params, 16)
    np.testing.assert_array_equal(y[..., r:], x[..., r:])
    a, b = kr._pair_slices(r, params.interleaved)
    np.testing.assert_allclose(y[..., a] ** 2 + y[..., b] ** 2, x[..., a] ** 2 + x[..., b] ** 2, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(reposition(x, old, old, params), x)


def test_interleaved_is_a_permutation_of_half_split():
    """KVW-ROPE-2: pair (2j, 2j+1) interleaved rotates exactly as pair (j, j + r/2) half-split."""
    x = np.random.default_rng(1).standard_normal((3, 4, 12)).astype(np.float32)
    perm = np.concatenate([np.arange(0, 12, 2), np.arange(1, 12, 2)])  # interleaved -> half-split order
    half = reposition(x[..., perm], 3, 77, RopeParams("default"))
    inter = reposition(x, 3, 77, RopeParams("default", interleaved=True))
    np.testing.assert_array_equal(inter[..., perm], half)


def test_low_precision_keys_keep_their_dtype():
    """KVW-ROPE-4: bf16/f16 keys are rotated in float32 and rounded back to their dtype."""
    x = np.random.default_rng(2).standard_normal((2, 4, 16)).astype(np.float32)
    ref = reposition(x, 0, 50, RopeParams("default"))
    for name in ("bf16", "f16"):
        dt = kvwire.format.registry.DTYPES[name][2]
        got = reposition(x.astype(dt), 0, 50, RopeParams("default"))
        assert got.dtype == dt
        np.testing.assert_array_equal(got, reposition(x.astype(dt).astype(np.float32), 0, 50,
                                                      RopeParams("default")).astype(dt))
        np.testing.assert_allclose(got.astype(np.float32), ref, atol=0.05)
    t = torch.from_numpy(x).to(torch.bfloat16)
    assert reposition(t, 0, 50, RopeParams("default")).dtype == torch.bfloat16


def test_rope_none_moves_nothing():
    """KVW-ROPE-4: rope_type none: no rotation was applied, the keys are returned unchanged."""
    x = np.random.default_rng(3).standard_normal((1, 3, 8)).astype(np.float32)
    y = reposition(x, 0, 9, RopeParams("none"))
    assert y is not x
    np.testing.assert_array_equal(y, x)


@pytest.mark.parametrize("params, words", [
    (RopeParams("dynamic", factor=2.0), "sequence length"),
    (RopeParams("longrope", short_factor=(1.0,) * 8, long_factor=(2.0,) * 8, original_max_position_embeddings=64),
     "sequence length"),
    (RopeParams("default", mrope_section=(2, 3, 3)), "mrope_section"),
    (RopeParams("default", rotary_dim=7), "even"),
    (RopeParams("default", rotary_dim=32), "at most head_dim"),
    (RopeParams("llama3", factor=8.0), "original_max_position_embeddings"),
    (RopeParams("llama3", factor=8.0, original_max_position_embeddings=64, low_freq_factor=0.0), "> 0"),
    (RopeParams("yarn", factor=0.0, original_max_position_embeddings=64), "factor"),
    (RopeParams("default", theta=1.0), "theta"),
])
def test_refusals_name_the_reason(params, words):
    """KVW-ROPE-1, KVW-ROPE-5: what cannot be re-positioned exactly is refused, with the reason."""
    x = np.zeros((1, 2, 16), np.float32)
    with pytest.raises(RepositionError, match=words):
        reposition(x, 0, 5, params)


def test_position_arguments_are_checked():
    x = np.zeros((1, 4, 16), np.float32)
    with pytest.raises(RepositionError, match="4 integer positions"):
        reposition(x, [0, 1, 2], 5, RopeParams())
    with pytest.raises(RepositionError, match="integer positions"):
        reposition(x, np.zeros(4, np.float32), 5, RopeParams())
    with pytest.raises(RepositionError, match="tokens, head_dim"):
        reposition(np.zeros(16, np.float32), 0, 5, RopeParams())


def _cache(arch: Architecture, **kw):
    k = [np.ones((1, 3, 8), np.float32) for _ in arch.layers]
    return kvwire.KVCache.from_tensors(k, k).with_header(arch=arch, **kw)


def test_shift_refusals():
    """KVW-ROPE-6: unknown RoPE, no RoPE anywhere, and negative positions are refused; keys stored
    before RoPE move by changing first_position alone."""
    spec = LayerSpec("full_attention", 1, 8, 8)
    with pytest.raises(RepositionError, match="unknown"):
        kr.shift(_cache(Architecture((spec,))), 4)
    with pytest.raises(RepositionError, match="no layer uses RoPE"):
        kr.shift(_cache(Architecture((LayerSpec("full_attention", 1, 8, 8, uses_rope=False),))), 4)
    known = _cache(Architecture((spec,), rope=RopeParams()))
    with pytest.raises(RepositionError, match="negative"):
        kr.shift(known, -1)
    pre = _cache(Architecture((spec,), rope=RopeParams(), keys_post_rope=False))
    moved = kr.shift(pre, 9)
    assert moved.header.first_position == 9 and moved.layers[0]["k"] is pre.layers[0]["k"]
    same = kr.shift(known, 0)
    assert same.layers[0]["k"] is known.layers[0]["k"]


def test_gpt2_cache_cannot_be_shifted():
    """KVW-ROPE-6: absolute position embeddings (gpt2) are indistinguishable from none in the header."""
    model = zoo.build("gpt2")
    with torch.no_grad():
        c = model(torch.arange(3, 8)[None], use_cache=True).past_key_values
    with pytest.raises(RepositionError, match="no layer uses RoPE"):
        kr.shift(hf.from_hf(c, model), 10)


def test_unknown_rope_and_state_layers_are_refused():
    """KVW-ROPE-5: no RopeParams means unknown, not defaults; KVW-ROPE-6: a state layer cannot move."""
    from types import SimpleNamespace

    from kvwire.format.header import Header

    with pytest.raises(RepositionError, match="unknown"):
        reposition(np.zeros((1, 2, 8), np.float32), 0, 3, None)
    arch = Architecture((LayerSpec("full_attention", 1, 8, 8), LayerSpec("state")), rope=RopeParams())
    cache = SimpleNamespace(header=Header(arch=arch, token_count=3, dtype="f32"), layers=[{}, {}])
    with pytest.raises(RepositionError, match="state layer"):
        kr.shift(cache, 5)


def test_truncate_field_round_trips():
    """KVW-ROPE-7 / spec 6.4 field 17: truncate false survives the header and the conformance kit's
    neutral JSON (which reports it only when false, as the 1.0 vectors predate it); the compat
    fingerprint tells the two apart."""
    from kvwire.conformance import neutral
    from kvwire.format.header import build_header, parse_header
    from kvwire.model.identity import compat_fingerprint

    yarn = RopeParams("yarn", factor=32.0, original_max_position_embeddings=4096, truncate=False)
    arch = Architecture((LayerSpec("full_attention", 1, 8, 8),), rope=yarn)
    h = kvwire.Header(arch, token_count=2, dtype="f32")
    assert parse_header(build_header(h)).arch.rope == yarn
    assert parse_header(build_header(h.replace(arch=Architecture(arch.layers, rope=RopeParams())))).arch.rope.truncate
    assert neutral.rope_to_json(yarn)["truncate"] is False and "truncate" not in neutral.rope_to_json(RopeParams())
    assert neutral.rope_from_json(neutral.rope_to_json(yarn)) == yarn
    truncated = Architecture(arch.layers, rope=dataclasses.replace(yarn, truncate=True))
    assert compat_fingerprint(arch, "f32", tokenizer=b"", weights=b"") != \
        compat_fingerprint(truncated, "f32", tokenizer=b"", weights=b"")
