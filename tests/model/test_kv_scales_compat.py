"""Revision 1.1 fp8 scales where they meet compatibility (spec/crossmodel.md KVW-XM-10,
kvwire-v1.md KVW-SCALE-7) and the package surface.

The verdict with the receiver's own scales (``LocalModel(kv_scales=...)``): equal scales
exact, other scales a "rescale layers" conversion naming the layers (also through a layer
map), and every refusal naming its fix, which, once followed, gives a usable verdict. The
requantization itself (``kvwire.model.rescale``) is checked bit for bit against a reference
that rounds with ml_dtypes' table of every fp8 value (a hypothesis property over dtypes,
scales from subnormal to huge and all 256 elements), and a rescaled cache is exact for the
receiver whose scales it took. ``kvwire.KVScale`` is public, the conformance ``info`` says
1.1.
"""

from __future__ import annotations

import dataclasses
import json

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import forge
import kvwire
from kvwire import LayerMapEntry as E
from kvwire import LayerSpec, LocalModel, check_compatible
from kvwire.conformance import impl
from kvwire.format import registry as R
from kvwire.format.kv_scales import KV_SCALES_BIT, KVScale
from kvwire.model.identity import make_identity
from kvwire.model.rescale import FP8_MAX, check_scales, rescale_cache, rescale_fp8

FP8 = ("f8_e4m3fn", "f8_e5m2", "f8_e4m3fnuz")
FULL = LayerSpec("full_attention", 2, 8, 8)
MLA = LayerSpec("mla_latent", 1, 12, 0, kv_lora_rank=8, qk_rope_head_dim=4)
SCALES = ((0.0234375, 0.01171875), (0.10000000149011612, 0.5), (3.5, 0.0078125), (1.0, 2.0))
F32_TINY = float(np.finfo(np.float32).smallest_subnormal)
F32_MAX = float(np.finfo(np.float32).max)


def header(scales=SCALES, *, dtype="f8_e4m3fn", layers=(FULL,) * 4, tokens=6, **kw) -> kvwire.Header:
    arch = kvwire.Architecture(tuple(layers), rope=kvwire.RopeParams())
    model = kw.pop("model", None) or make_identity(arch, "bf16", tokenizer=b"t" * 32, weights=b"w" * 32)
    return kvwire.Header(arch, token_count=tokens, dtype=dtype, chunk_tokens=4, model=model, kv_scales=scales, **kw)


def receiver(h: kvwire.Header, scales=None, **kw) -> LocalModel:
    return LocalModel(**{"arch": h.arch, "dtype": h.dtype, "identity": h.model, "kv_scales": scales, **kw})


def random_cache(h: kvwire.Header, seed: int = 0) -> kvwire.KVCache:
    rng = np.random.default_rng(seed)
    return kvwire.KVCache(h, [{c: forge.random_tensor(rng, s.shape(c, r.count), h.dtype) for c in s.components}
                              for s, r in zip(h.arch.layers, h.layer_tokens)])


def bits(x) -> np.ndarray:
    return np.asarray(x).view(np.uint8)


# ---------------------------------------------------------------------------------------
# The verdict (KVW-XM-10)
# ---------------------------------------------------------------------------------------

def test_xm10_equal_scales_are_exact_decided_from_the_header_bytes():
    """KVW-XM-10: the receiver's scales equal the container's (bit for bit) -> exact, from the
    probed header of an encoded cache; an unscaled fp8 cache and a receiver that states no
    scales, or all 1.0, are exact as before."""
    h = header()
    wire = kvwire.probe(kvwire.encode(random_cache(h)))
    assert wire.kv_scales == tuple(KVScale(*e) for e in SCALES)
    assert check_compatible(wire, receiver(h, SCALES)) == kvwire.Verdict("exact")
    plain = header(None)
    assert check_compatible(plain, receiver(plain)) == kvwire.Verdict("exact")
    assert check_compatible(plain, receiver(plain, [(1.0, 1.0)] * 4)) == kvwire.Verdict("exact")


def test_xm10_scale7_other_scales_are_one_rescale_conversion_naming_the_layers():
    """KVW-XM-10, KVW-SCALE-7: layers whose k or v scale differs are listed in one "rescale
    layers" conversion (runs of layers as a..b); a receiver that accepts no requantization
    gets a "scales:" reason naming accept_rescale."""
    h = header()
    mine = list(SCALES)
    mine[1] = (0.10000000149011612, 0.75)  # v only
    mine[2] = (3.0, 0.0078125)  # k only
    v = check_compatible(h, receiver(h, mine))
    assert v == kvwire.Verdict("convertible", ("rescale layers 1..2",))
    mine[0] = (0.5, 0.01171875)
    assert check_compatible(h, receiver(h, mine)).conversions == ("rescale layers 0..2",)
    mine[0], mine[3] = SCALES[0], (1.0, 2.5)
    assert check_compatible(h, receiver(h, mine)).conversions == ("rescale layers 1..3",)
    refused = check_compatible(h, receiver(h, mine, accept_rescale=False))
    assert refused.status == "incompatible" and len(refused.reasons) == 1
    assert refused.reasons[0].startswith("scales: layers 1..3 ") and "accept_rescale=True" in refused.reasons[0]


def test_xm10_a_binary32_step_is_a_difference():
    """KVW-XM-10: scales are compared bit for bit: one binary32 ulp is another scale."""
    h = header()
    up = float(np.nextafter(np.float32(SCALES[2][0]), np.float32(np.inf)))
    mine = SCALES[:2] + ((up, SCALES[2][1]),) + SCALES[3:]
    assert check_compatible(h, receiver(h, mine)).conversions == ("rescale layers 2",)


def test_xm10_unscaled_cache_and_scaled_receiver_rescale_from_one():
    """KVW-XM-10: an fp8 cache without kv_scales has scales 1.0 (KVW-SCALE-1 reads it as
    unscaled), so a receiver with other scales rescales the layers whose scales are not 1.0."""
    h = header(None)
    v = check_compatible(h, receiver(h, [(1.0, 1.0), (0.5, 1.0), (1.0, 1.0), (1.0, 1.0)]))
    assert v == kvwire.Verdict("convertible", ("rescale layers 1",))


def test_xm10_scaled_cache_for_a_receiver_stating_no_scales_names_both_fixes():
    """KVW-XM-10: LocalModel(kv_scales=None) states no scales; a scaled cache is then refused
    (such a receiver may load the elements with scales of its own) with a reason naming
    both ways past it, and each way, taken, gives a usable verdict."""
    h = header()
    v = check_compatible(h, receiver(h))
    assert v.status == "incompatible" and len(v.reasons) == 1
    why = v.reasons[0]
    assert why.startswith("scales: ") and "kv_scales=" in why and "dequantize" in why
    assert "accept_casts=frozenset({'f8_e4m3fn'})" in why
    ones = check_compatible(h, receiver(h, [(1.0, 1.0)] * 4))  # an engine that keeps none
    assert ones == kvwire.Verdict("convertible", ("rescale layers 0..3",))
    cast = check_compatible(h, receiver(h, dtype="bf16", accept_casts=frozenset({"f8_e4m3fn"})))
    assert cast.status == "convertible" and len(cast.conversions) == 1
    assert cast.conversions[0].startswith("cast f8_e4m3fn->bf16") and "dequantize" in cast.conversions[0]


def test_xm10_xm7_dtype_mismatch_names_the_cast_to_accept():
    """KVW-XM-7, KVW-XM-10: another dtype without an accepted cast is a "dtype:" reason that
    says what to pass; for a scaled cache it says the cast is of the values. Passing it
    makes the verdict convertible; the receiver's own scales play no part in it."""
    h = header()
    mine = receiver(h, dtype="f8_e5m2", kv_scales=[(2.0, 2.0)] * 4)
    v = check_compatible(h, mine)
    assert v.status == "incompatible" and [r.split(":")[0] for r in v.reasons] == ["dtype"]
    assert "accept_casts=frozenset({'f8_e4m3fn'})" in v.reasons[0] and "dequantize" in v.reasons[0]
    ok = check_compatible(h, dataclasses.replace(mine, accept_casts=frozenset({"f8_e4m3fn"})))
    assert ok.status == "convertible" and [c.split(" ")[0] for c in ok.conversions] == ["cast"]
    plain = header(None, dtype="f16")
    v = check_compatible(plain, receiver(plain, dtype="bf16"))
    assert v.reasons == (("dtype: cache is f16, receiver uses bf16 and accepts no cast from it: pass "
                          "accept_casts=frozenset({'f16'}) to cast"),)


def test_xm10_scale8_layer_map_pairs_receiver_layers_with_transmitted_scales():
    """KVW-XM-10, KVW-SCALE-8: through a layer map receiver layer r is compared with the
    transmitted layer its entry names; a store object of model layers [2, 4) (range map)
    compares its scales with the receiver's layers 2 and 3; an alias takes its target's."""
    full = header()
    obj = full.layer_slice(2, 4).replace(layer_map=(E(2, 0, "copy"), E(3, 1, "copy")))
    assert obj.kv_scales == tuple(KVScale(*e) for e in SCALES[2:])
    me = receiver(full, SCALES)
    v = check_compatible(obj, me)
    assert v.reasons == () and v.conversions == ("layer map: copy 2, recompute 2",)
    other = SCALES[:3] + ((1.0, 4.0),)
    assert check_compatible(obj, receiver(full, other)).conversions == ("layer map: copy 2, recompute 2",
                                                                      "rescale layers 3")
    # receiver layer 1 aliases transmitted layer 0: it takes layer 0's scales, compared with its own entry 1
    two = header(SCALES[:2], layers=(FULL, FULL),
                 layer_map=(E(0, 0, "copy"), E(1, 0, "alias"), E(2, 1, "copy"), E(3, -1, "recompute")))
    v = check_compatible(two, receiver(full, [SCALES[0], SCALES[0], SCALES[1], (9.0, 9.0)]))
    assert "scales" not in " ".join(v.reasons) and not any(c.startswith("rescale") for c in v.conversions)
    v = check_compatible(two, receiver(full, SCALES))  # receiver layers 1 and 2 have other scales
    assert [c for c in v.conversions if c.startswith("rescale")] == ["rescale layers 1..2"]
    assert check_compatible(two, receiver(full, None)).reasons[-1].startswith("scales: ")


def test_xm10_local_model_scales_are_checked_like_the_header_field():
    """KVW-SCALE-2..5 on LocalModel(kv_scales=...): one per layer, finite and above 0, an fp8
    dtype, 1.0 where no element uses a scale; each refusal a ValueError naming the rule;
    pairs become binary32 KVScale values."""
    h = header()
    me = receiver(h, [(0.1, 0.2)] * 4)
    assert me.kv_scales == (KVScale(0.1, 0.2),) * 4 and me.kv_scales[0].k_scale == float(np.float32(0.1))
    for bad, rule in (([(1.0, 1.0)] * 3, "KVW-SCALE-2"), ([(1.0, 1.0)] * 5, "KVW-SCALE-2"),
                      ([(0.0, 1.0)] + [(1.0, 1.0)] * 3, "KVW-SCALE-3"),
                      ([(1.0, float("nan"))] + [(1.0, 1.0)] * 3, "KVW-SCALE-3"),
                      ([(1.0, float("inf"))] + [(1.0, 1.0)] * 3, "KVW-SCALE-3"),
                      ([(-2.0, 1.0)] + [(1.0, 1.0)] * 3, "KVW-SCALE-3"),
                      ([(1e39, 1.0)] + [(1.0, 1.0)] * 3, "KVW-SCALE-3")):  # rounds to a binary32 infinity
        with pytest.raises(ValueError, match=rule):
            receiver(h, bad)
    with pytest.raises(ValueError, match="KVW-SCALE-4"):
        receiver(h, [(1.0, 1.0)] * 4, dtype="bf16")
    mla = header([(0.5, 1.0)], layers=(MLA,))
    assert receiver(mla, [(0.5, 1.0)]).kv_scales == (KVScale(0.5, 1.0),)
    with pytest.raises(ValueError, match="KVW-SCALE-5"):
        receiver(mla, [(0.5, 0.5)])
    with pytest.raises(TypeError, match="KVScale"):
        receiver(h, [0.5, 0.5, 0.5, 0.5])
    with pytest.raises(TypeError, match="sequence"):
        receiver(h, "0.5")
    with pytest.raises(ValueError, match="KVW-SCALE-2"):
        check_scales(h.arch, h.dtype, [])


# ---------------------------------------------------------------------------------------
# Requantization (KVW-XM-10's arithmetic, KVW-SCALE-7)
# ---------------------------------------------------------------------------------------

def fp8_table(dtype: str) -> np.ndarray:
    """The value (binary64, exact) of each of the 256 codes of an fp8 dtype, from ml_dtypes."""
    return np.arange(256, dtype=np.uint8).view(R.DTYPES[dtype][2]).astype(np.float64)


def reference_rescale(codes: np.ndarray, s: float, t: float, dtype: str) -> list:
    """Per element, independently of the implementation: the value f32(d(x) * s) and the
    quotient f32(v / t) with numpy binary32 scalars, then saturation and the nearest fp8
    value of ml_dtypes' table, ties to the even code, the sign kept (a code, or None: NaN).
    Equal scales keep every element as it is."""
    if np.float32(s) == np.float32(t):
        return [int(c) for c in codes]
    table = fp8_table(dtype)
    top = FP8_MAX[dtype]
    with np.errstate(all="ignore"):
        q = np.array([float(np.float32(np.float32(table[c]) * np.float32(s)) / np.float32(t)) for c in codes])
    q = np.clip(q, -top, top)  # saturation; NaN stays NaN
    # candidate codes per element: finite, of the element's sign (fnuz has only +0)
    cand = np.isfinite(table)[None, :] & (np.signbit(table)[None, :] == np.signbit(q)[:, None])
    if dtype == "f8_e4m3fnuz":
        cand[:, 0] = True
    dist = np.where(cand, np.abs(table[None, :] - q[:, None]), np.inf)
    best = dist.min(axis=1, keepdims=True)
    near = (dist == best) & cand
    order = np.arange(256) % 2 * 256 + np.arange(256)  # even codes first (ties to even)
    pick = np.where(near, order[None, :], 1 << 20).argmin(axis=1)
    return [None if np.isnan(x) else int(k) for x, k in zip(q, pick)]


positive_f32 = st.floats(min_value=F32_TINY, max_value=F32_MAX, width=32, allow_subnormal=True)
ordinary_f32 = st.floats(min_value=2.0 ** -20, max_value=2.0 ** 20, width=32)


@settings(max_examples=120, deadline=None)
@given(dtype=st.sampled_from(FP8), s=st.one_of(ordinary_f32, positive_f32), t=st.one_of(ordinary_f32, positive_f32))
def test_xm10_rescale_matches_the_reference_bit_for_bit_property(dtype, s, t):
    """KVW-XM-10's arithmetic (KVW-SCALE-6 value, binary32 division, saturation, one rounding
    to nearest even) for all 256 elements of each fp8 dtype, any scales from subnormal to
    the largest binary32: the implementation equals the reference, code for code; NaN stays
    NaN, nothing is beyond the dtype's range."""
    codes = np.arange(256, dtype=np.uint8)
    got = bits(rescale_fp8(codes.view(R.DTYPES[dtype][2]), s, t, dtype))
    want = reference_rescale(codes, s, t, dtype)
    table = fp8_table(dtype)
    for c, g, w in zip(codes, got, want):
        if w is None:  # any NaN (ml_dtypes picks the dtype's canonical one)
            assert np.isnan(table[g]), (dtype, s, t, int(c), int(g))
        else:
            assert g == w, (dtype, s, t, int(c), int(g), w)
    if np.float32(s) != np.float32(t):
        assert np.all(np.abs(table[got][~np.isnan(table[got])]) <= FP8_MAX[dtype])


@pytest.mark.parametrize("dtype", FP8)
def test_xm10_rescale_cases(dtype):
    """Saturation (an infinity or a product beyond the range becomes the largest finite value
    with its sign), underflow to a signed zero, an exact power-of-two step, equal scales
    keeping the bits (NaN payloads included), uint8 bits and torch tensors as input."""
    npd = R.DTYPES[dtype][2]
    top = FP8_MAX[dtype]
    assert top == float(ml_dtypes.finfo(npd).max)
    x = np.array([1.0, -1.0, top, -top, 0.5, 0.0], dtype=np.float32).astype(npd)
    big = rescale_fp8(x, 1.0, 2.0 ** -20, dtype).astype(np.float32)
    assert list(big[:4]) == [top, -top, top, -top] and big[5] == 0.0
    small = rescale_fp8(x, 2.0 ** -40, 1.0, dtype).astype(np.float32)
    assert np.all(small == 0.0)
    if dtype != "f8_e4m3fnuz":
        assert np.signbit(small[1]) and not np.signbit(small[0])
    half = rescale_fp8(x, 1.0, 2.0, dtype).astype(np.float32)
    assert half[0] == 0.5 and half[1] == -0.5 and half[4] == 0.25
    codes = np.arange(256, dtype=np.uint8)
    same = rescale_fp8(codes, 0.3, 0.3, dtype)
    assert np.array_equal(bits(same), codes) and same.dtype == npd
    assert np.array_equal(bits(rescale_fp8(codes, 0.3, 0.7, dtype)), bits(rescale_fp8(codes.view(npd), 0.3, 0.7, dtype)))
    tt = torch.from_numpy(codes.copy()).view(getattr(torch, {"f8_e4m3fn": "float8_e4m3fn", "f8_e5m2": "float8_e5m2",
                                                                "f8_e4m3fnuz": "float8_e4m3fnuz"}[dtype]))
    assert np.array_equal(bits(rescale_fp8(tt, 0.3, 0.7, dtype)), bits(rescale_fp8(codes, 0.3, 0.7, dtype)))
    if dtype == "f8_e5m2":  # a stored infinity saturates like any value beyond the range
        inf = np.array([np.inf, -np.inf], dtype=np.float32).astype(npd)
        assert list(rescale_fp8(inf, 1.0, 0.5, dtype).astype(np.float32)) == [top, -top]


def test_xm10_rescale_misuse_names_the_valid_choices():
    codes = np.zeros(4, np.uint8)
    with pytest.raises(ValueError, match="f8_e4m3fn, f8_e5m2, f8_e4m3fnuz"):
        rescale_fp8(codes, 1.0, 2.0, "bf16")
    with pytest.raises(ValueError, match="uint8 bits"):
        rescale_fp8(np.zeros(4, np.float16), 1.0, 2.0, "f8_e4m3fn")
    with pytest.raises(ValueError, match="to_scale"):
        rescale_fp8(codes, 1.0, 0.0, "f8_e4m3fn")
    with pytest.raises(ValueError, match="from_scale"):
        rescale_fp8(codes, float("nan"), 1.0, "f8_e4m3fn")
    with pytest.raises(TypeError, match="KVCache"):
        rescale_cache(codes, None)
    with pytest.raises(ValueError, match="cast it instead"):
        rescale_cache(random_cache(header(None, dtype="bf16")), None)
    with pytest.raises(ValueError, match="KVW-SCALE-2"):
        rescale_cache(random_cache(header()), [(1.0, 1.0)])


@pytest.mark.parametrize("dtype", FP8)
def test_xm10_scale7_rescaled_cache_is_exact_for_its_receiver(dtype):
    """KVW-SCALE-7: rescale_cache performs the verdict's "rescale layers": K by k_scale, V by
    v_scale, element for element as rescale_fp8; a layer whose scales stay keeps its very
    tensors; the header takes the new scales (bit 3, format 1.1 on the wire), and the
    receiver whose scales it took now gets an exact verdict. Its values stay the original
    values within half a step of the new grid."""
    h = header(dtype=dtype)
    cache = random_cache(h, 3)
    mine = [SCALES[0], (0.2, 0.5), SCALES[2], (1.0, 0.25)]
    assert check_compatible(h, receiver(h, mine)).conversions == ("rescale layers 1, 3",)
    out = rescale_cache(cache, mine)
    assert out.kv_scales == tuple(KVScale(*e) for e in mine)
    assert out.layers[0]["k"] is cache.layers[0]["k"] and out.layers[2]["v"] is cache.layers[2]["v"]
    assert out.layers[1]["v"] is cache.layers[1]["v"] and out.layers[3]["k"] is cache.layers[3]["k"]
    for i, (a, b) in enumerate(zip(SCALES, mine)):
        for c, (s, t) in (("k", (a[0], b[0])), ("v", (a[1], b[1]))):
            assert np.array_equal(bits(out.layers[i][c]), bits(rescale_fp8(cache.layers[i][c], s, t, dtype)))
    assert check_compatible(out.header, receiver(h, mine)) == kvwire.Verdict("exact")
    back = forge.read_all(kvwire.encode(out))
    assert back.header.required_features & KV_SCALES_BIT and back.header.format_minor == 1
    assert forge.cache_bytes_equal(back, out)
    # the values move by at most half a step of the new grid (relative, or the subnormal step x scale)
    rel = 2.0 ** -4 if dtype != "f8_e5m2" else 2.0 ** -3
    sub = float(ml_dtypes.finfo(R.DTYPES[dtype][2]).smallest_subnormal)
    for i, (c, t) in ((1, ("k", mine[1][0])), (3, ("v", mine[3][1]))):
        was, now = cache.dequantize_layer(i)[c].astype(np.float64), out.dequantize_layer(i)[c].astype(np.float64)
        inside = np.isfinite(was) & (np.abs(was) <= FP8_MAX[dtype] * t)
        assert inside.sum() > was.size // 2
        assert np.all(np.abs(now - was)[inside] <= (rel * np.abs(was) + t * sub / 2)[inside] * (1 + 2 ** -20))


def test_xm10_rescale_to_none_drops_the_field_and_scaled_round_trip():
    """rescale_cache(cache, None): every scale 1.0 and no kv_scales (bit 3 cleared, format
    1.0); an unscaled fp8 cache rescaled to scales gets the field (KVW-EVOL-12)."""
    h = header()
    cache = random_cache(h, 5)
    plain = rescale_cache(cache, None)
    assert plain.kv_scales is None
    data = kvwire.encode(plain)
    assert int.from_bytes(data[10:12], "little") == 0 and kvwire.probe(data).required_features == 0
    for i, (k, _v) in enumerate(SCALES):
        assert np.array_equal(bits(plain.layers[i]["k"]), bits(rescale_fp8(cache.layers[i]["k"], k, 1.0, h.dtype)))
    again = rescale_cache(plain, SCALES)
    assert kvwire.probe(kvwire.encode(again)).kv_scales == cache.kv_scales


# ---------------------------------------------------------------------------------------
# Package surface
# ---------------------------------------------------------------------------------------

def test_kvscale_is_public_and_conformance_info_reports_1_1():
    """kvwire.KVScale is the header's struct type, in __all__; the conformance
    implementation's info lists formats 1.0 to 1.3 and keeps protocol 1."""
    assert kvwire.KVScale is KVScale and "KVScale" in kvwire.__all__
    assert all(hasattr(kvwire, name) for name in kvwire.__all__)
    assert kvwire.Header(kvwire.Architecture((FULL,)), token_count=0, dtype="f8_e5m2", chunk_tokens=4,
                         kv_scales=[kvwire.KVScale(0.5, 2.0)]).kv_scales == (KVScale(0.5, 2.0),)
    info = json.loads(json.dumps(impl.info()))
    assert info["protocol"] == 1 and info["format_versions"] == ["1.0", "1.1", "1.2", "1.3", "1.4"]  # 1.2: rotation, 1.3: turboquant, 1.4: zstd checksums
