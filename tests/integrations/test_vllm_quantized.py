"""vLLM turboquant slots carried as they are (kvwire.integrations.vllm_quantized, revision
1.3, spec/codecs.md section 9). The slots come from a numpy transcription of vLLM 0.32's
store kernel (``triton_turboquant_store.py``: norm, unit row, ``@ H``, bucketize against the
centroid midpoints, LSB-first packing; values min-max with round-half-up), since the Triton
kernel itself needs a GPU; the keys and values kvwire decodes are checked against vLLM's
dequantization formula (``triton_turboquant_decode.py``) in float64."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvwire
from kvwire.codecs import turboquant as TQ
from kvwire.format.header import Architecture, Header, LayerSpec
from kvwire.integrations import vllm_quantized as VT

FORMATS = sorted(VT.FORMATS)


def _hadamard(d: int) -> np.ndarray:
    h = np.array([[1.0]])
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(d)).astype(np.float32)


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """vLLM's packing: element d at bits [d*b, d*b + b) of each row's little-endian bit string."""
    bit = (q[..., :, None].astype(np.uint32) >> np.arange(bits)) & 1
    return np.packbits(bit.reshape(*q.shape[:-1], -1), axis=-1, bitorder="little")


def vllm_store(k: np.ndarray, v: np.ndarray, cache_dtype: str) -> np.ndarray:
    """Slots [T, H, slot] of fp32 k, v [T, H, D] as vLLM's store writes them."""
    T, H, D = k.shape
    lay = VT.slot_layout(cache_dtype, D)
    c = TQ.vllm_table(lay.k_bits, D)
    mids = (c[:-1] + c[1:]) / np.float32(2)
    norm = np.linalg.norm(k, axis=-1, keepdims=True).astype(np.float32)
    y = (k / (norm + np.float32(1e-8))) @ _hadamard(D)
    idx = (y[..., None] >= mids).sum(-1)
    vmin, vmax = v.min(-1, keepdims=True), v.max(-1, keepdims=True)
    scale = np.maximum((vmax - vmin) / np.float32(2 ** lay.v_bits - 1), np.float32(1e-8))
    q = np.clip(np.floor((v - vmin) / scale + np.float32(0.5)), 0, 2 ** lay.v_bits - 1).astype(np.uint8)
    f16 = lambda a: a.astype("<f2").view(np.uint8)
    out = np.zeros((T, H, lay.size), np.uint8)
    out[..., : lay.k_codes] = _pack(idx, lay.k_bits)
    out[..., lay.k_codes : lay.v_at] = f16(norm)
    out[..., lay.v_at : lay.v_at + lay.v_codes] = _pack(q, lay.v_bits)
    out[..., lay.v_at + lay.v_codes : lay.v_at + lay.v_codes + 2] = f16(scale)
    out[..., lay.v_at + lay.v_codes + 2 : lay.v_at + lay.v_codes + 4] = f16(vmin)
    return out


def vllm_dequant(slots: np.ndarray, cache_dtype: str, D: int):
    """vLLM's dequantization of slots, in float64: K = (norm * c / ||c||) @ H, V = q * s + min."""
    lay = VT.slot_layout(cache_dtype, D)
    unpack = lambda b, n: np.unpackbits(b, axis=-1, bitorder="little").reshape(*b.shape[:-1], D, n) @ (
        1 << np.arange(n))
    c = TQ.vllm_table(lay.k_bits, D).astype(np.float64)[unpack(slots[..., : lay.k_codes], lay.k_bits)]
    f16 = lambda a: a.copy().view("<f2")[..., 0].astype(np.float64)[..., None]
    k = f16(slots[..., lay.k_codes : lay.v_at]) * c / np.sqrt((c * c).sum(-1, keepdims=True) + 1e-16)
    k = k @ _hadamard(D).astype(np.float64)
    v0 = lay.v_at + lay.v_codes
    v = unpack(slots[..., lay.v_at : v0], lay.v_bits) * f16(slots[..., v0 : v0 + 2]) + f16(slots[..., v0 + 2 : v0 + 4])
    return k, v


def _header(dim: int, heads: int, tokens: int, layers: int = 2, chunk: int = 32) -> Header:
    return Header(Architecture((LayerSpec("full_attention", heads, dim, dim),) * layers), token_count=tokens,
                  dtype="bf16", chunk_tokens=chunk)


@pytest.mark.parametrize("cache_dtype", FORMATS)
@pytest.mark.parametrize("dim", [64, 128])
def test_slots_round_trip_byte_for_byte_and_decode_as_vllm(cache_dtype, dim):
    """The slots come back unchanged (the bodies are the slot bytes), and every kvwire reader
    decodes the keys and values vLLM's attention would compute from them."""
    rng = np.random.default_rng(dim)
    T, H = 70, 2
    layers = [vllm_store(rng.standard_normal((T, H, dim)).astype(np.float32),
                         rng.standard_normal((T, H, dim)).astype(np.float32), cache_dtype) for _ in range(2)]
    h = _header(dim, H, T)
    data = VT.slots_to_container(h, layers, cache_dtype)
    assert kvwire.probe(data).format_minor == 3
    back = VT.container_to_slots(data, cache_dtype)
    for a, b in zip(layers, back):
        assert a.tobytes() == b.tobytes()
    got = kvwire.load(data)
    for i, s in enumerate(layers):
        k, v = vllm_dequant(s, cache_dtype, dim)
        for comp, want in (("k", k), ("v", v)):
            mine = np.asarray(got.layers[i][comp], np.float64).transpose(1, 0, 2)
            assert np.abs(mine - want).max() <= 2 ** -7 * np.abs(want).max(), comp
    assert len(data) < 0.45 * 2 * 2 * T * H * dim * 2  # every container byte: under 0.45 of bf16


def test_slot_sizes_are_vllms():
    """config.py's slot_size_aligned at head_dim 128: 134, 118, 102 bytes."""
    assert [VT.slot_layout(f, 128).size for f in ("turboquant_4bit_nc", "turboquant_k3v4_nc",
                                                  "turboquant_3bit_nc")] == [134, 118, 102]
    assert VT.slot_layout("turboquant_4bit_nc", 64).size == 70


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(FORMATS), st.sampled_from([8, 16, 64]), st.integers(1, 5), st.integers(1, 9), st.integers(0, 2 ** 32))
def test_bodies_and_slots_are_one_permutation(cache_dtype, dim, heads, tokens, seed):
    lay = VT.slot_layout(cache_dtype, dim)
    s = np.random.default_rng(seed).integers(0, 256, (tokens, heads, lay.size), dtype=np.uint8)
    if lay.size % 2 == 0 and (lay.v_at + lay.v_codes + 4) % 2:
        s[..., -1] = 0  # the pad byte is not carried
    k, v = VT.slots_to_bodies(s, lay)
    assert len(k) + len(v) == tokens * heads * (lay.v_at + lay.v_codes + 4)
    assert VT.bodies_to_slots(k, v, lay, heads, tokens).tobytes() == s.tobytes()


def test_refusals_name_what_is_supported():
    with pytest.raises(ValueError, match="e4b15"):
        VT.slot_layout("turboquant_k8v4", 128)
    with pytest.raises(ValueError, match="turboquant_3bit_nc"):
        VT.slot_layout("fp8", 128)
    with pytest.raises(ValueError, match="power of two"):
        VT.slot_layout("turboquant_4bit_nc", 96)
    h = _header(64, 1, 8, layers=1)
    with pytest.raises(ValueError, match="uint8"):
        VT.slots_to_container(h, [np.zeros((8, 1, 69), np.uint8)], "turboquant_4bit_nc")
    bad = np.zeros((8, 1, 70), np.uint8)
    bad[..., 32:34] = np.array([0x00, 0xBC], np.uint8)  # K norm -1.0: readers reject it (KVW-INT-3)
    with pytest.raises(ValueError, match="DECODE_FAILED"):
        VT.slots_to_container(h, [bad], "turboquant_4bit_nc")
    plain = kvwire.encode(kvwire.KVCache.from_tensors([np.zeros((1, 8, 64), np.float32)],
                                                      [np.zeros((1, 8, 64), np.float32)], chunk_tokens=8),
                          codec="int4-g32")
    with pytest.raises(ValueError, match="not turboquant_4bit_nc"):
        VT.container_to_slots(plain, "turboquant_4bit_nc")


def test_encoded_chunk_misuse_is_a_clear_error():
    """Encoder.encoded_chunk: only where the codec choice is a lossy spec, one chunk of the
    grid, once, with a body of its spec's length."""
    lay = VT.slot_layout("turboquant_4bit_nc", 64)
    h = _header(64, 1, 40, layers=1)
    k, v = VT.slots_to_bodies(vllm_store(np.ones((32, 1, 64), np.float32), np.ones((32, 1, 64), np.float32),
                                         "turboquant_4bit_nc"), lay)
    enc = kvwire.Encoder(h, codec={"k": "vllm-turboquant-4bit-nc", "v": "raw"})
    enc.begin()
    with pytest.raises(ValueError, match="not a lossy codec spec"):
        enc.encoded_chunk(0, "v", 0, v, 32)
    with pytest.raises(ValueError, match="not one chunk"):
        enc.encoded_chunk(0, "k", 8, k, 32)
    with pytest.raises(ValueError, match="take"):
        enc.encoded_chunk(0, "k", 0, k[:-1], 32)
    enc.encoded_chunk(0, "k", 0, k, 32)
    with pytest.raises(ValueError, match="already written"):
        enc.encoded_chunk(0, "k", 0, k, 32)


def vllm_per_token_head(x: np.ndarray, cache_dtype: str):
    """vLLM's per-token-head store (triton_reshape_and_cache_flash.py): scale = max(absmax / QMAX,
    1e-6), codes = x * (1 / scale), int8 rounded half away from zero, fp8 by the cast."""
    import ml_dtypes

    qmax = 127.0 if cache_dtype.startswith("int8") else 448.0
    scale = np.maximum(np.abs(x).max(-1) / np.float32(qmax), np.float32(1e-6)).astype(np.float32)
    q = x * (np.float32(1) / scale)[..., None]
    if cache_dtype.startswith("int8"):
        codes = np.clip(np.where(q >= 0, np.floor(q + 0.5), np.ceil(q - 0.5)), -128, 127).astype(np.int8)
    else:
        codes = q.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return codes, scale


@pytest.mark.parametrize("cache_dtype", ["int8_per_token_head", "fp8_per_token_head"])
def test_per_token_head_round_trip_and_decode(cache_dtype):
    """The codes and scales come back unchanged; readers decode code x scale (format 1.0)."""
    import ml_dtypes

    rng = np.random.default_rng(5)
    T, H, D = 45, 2, 64
    layers = []
    for _ in range(2):
        k, v = (rng.standard_normal((T, H, D)).astype(np.float32) for _ in range(2))
        layers.append((*vllm_per_token_head(k, cache_dtype), *vllm_per_token_head(v, cache_dtype)))
    h = _header(D, H, T)
    data = VT.per_token_head_to_container(h, layers, cache_dtype)
    assert kvwire.probe(data).format_minor == 0  # nothing beyond format 1.0
    back = VT.container_to_per_token_head(data, cache_dtype)
    for a, b in zip(layers, back):
        for x, y in zip(a, b):
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes()
    got = kvwire.load(data)
    for i, (kc, ks, vc, vs) in enumerate(layers):
        for comp, codes, scale in (("k", kc, ks), ("v", vc, vs)):
            val = codes.astype(np.float64) if codes.dtype == np.int8 else \
                codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
            want = val * scale.astype(np.float64)[..., None]
            mine = np.asarray(got.layers[i][comp], np.float64).transpose(1, 0, 2)
            assert np.abs(mine - want).max() <= 2 ** -8 * np.abs(want).max()
    with pytest.raises(ValueError, match="zero point"):
        VT.per_token_head_to_container(h, layers, "int4_per_token_head")
    for nvfp4 in ("nvfp4", "nvfp4_4over6"):  # named, with the reason, by both entry points
        with pytest.raises(ValueError, match="is not carried: its fp8 block scales"):
            VT.per_token_head_to_container(h, layers, nvfp4)
        with pytest.raises(ValueError, match="is not carried: its fp8 block scales"):
            VT.slot_layout(nvfp4, 128)
    with pytest.raises(ValueError, match="need 1-byte codes"):
        VT.per_token_head_to_container(h, [(kc[:-1], ks, vc, vs)] * 2, cache_dtype)
