"""vLLM 0.32's quantized KV caches carried as they are: the engine's codes and scales become
kvwire chunk bodies and come back byte for byte, a byte permutation, never a re-quantization.

TurboQuant (``kv_cache_dtype`` ``turboquant_*_nc``; format revision 1.3, spec/codecs.md
section 9) holds one uint8 slot per token and KV head, K and V together
(``model_executor/layers/quantization/turboquant/config.py``,
``v1/attention/ops/triton_turboquant_store.py``)::

    slot = [ K codes: D*kb/8 | K norm: f16 | V codes: D*vb/8 | V scale: f16 | V min: f16 | pad to even ]

codes packed LSB first, f16 little-endian, the pad byte unwritten. kvwire stores the same
numbers per component: the K chunk body is ``int_affine`` with the ``turboquant`` codebook
(norms [H, T] f16, then the codes row by row), the V chunk body plain asymmetric
``int_affine`` (scales [H, T], minima [H, T], codes). Every kvwire reader decodes such a
container to the keys and values vLLM's attention computes from the slots (in fp32), and
``container_to_slots`` rebuilds the slots a receiving turboquant engine loads directly.

The per-token-head caches (``int8_per_token_head``, ``fp8_per_token_head``; the Triton
backend) hold codes [D] and one f32 scale per token and head, value = code x scale: format
1.0 holds them as they are (``int_affine`` 8-bit symmetric with an f32 scale per row, or
``fp8`` with token-granular scales); see ``per_token_head_to_container``.

Refused by name: ``turboquant_k8v4`` (unscaled fp8 keys whose format depends on the GPU that
wrote them: e4m3fn, or e4b15 below compute capability 8.9), ``int4_per_token_head`` (its zero
point hides in the scale's low mantissa bits), and the ROCm gfx950 structure-of-arrays page
layout. These backends need a CUDA GPU (Triton kernels), so the connector does not bind such
caches; this module converts the engine's tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..cache.encoder import Encoder
from ..cache.files import open as open_reader
from ..codecs import PRESETS
from ..codecs.presets import resolve
from ..format.codec_specs import CodecSpec

# kv_cache_dtype -> kvwire preset (key bits, value bits)
FORMATS = {"turboquant_4bit_nc": "vllm-turboquant-4bit-nc", "turboquant_k3v4_nc": "vllm-turboquant-k3v4-nc",
           "turboquant_3bit_nc": "vllm-turboquant-3bit-nc"}
REFUSED = {"turboquant_k8v4": "unscaled fp8 keys whose format depends on the writing GPU (e4m3fn or e4b15)"}


@dataclass(frozen=True)
class SlotLayout:
    """Byte offsets of one vLLM turboquant slot for ``head_dim`` (config.py's sizes)."""

    cache_dtype: str
    head_dim: int
    k_bits: int
    v_bits: int

    @property
    def k_codes(self) -> int:
        return self.head_dim * self.k_bits // 8

    @property
    def v_codes(self) -> int:
        return self.head_dim * self.v_bits // 8

    @property
    def v_at(self) -> int:  # V's codes follow K's codes and norm
        return self.k_codes + 2

    @property
    def size(self) -> int:
        """``slot_size_aligned``: the slot padded to an even number of bytes."""
        n = self.v_at + self.v_codes + 4
        return n + n % 2


def slot_layout(cache_dtype: str, head_dim: int) -> SlotLayout:
    """The slot of ``cache_dtype`` (a vLLM ``kv_cache_dtype``) at ``head_dim``; ValueError
    naming the supported ones otherwise."""
    if cache_dtype in REFUSED:
        raise ValueError(f"kv_cache_dtype {cache_dtype!r} is not carried: {REFUSED[cache_dtype]}")
    if cache_dtype not in FORMATS:
        raise ValueError(f"kv_cache_dtype {cache_dtype!r}: carried turboquant formats are {sorted(FORMATS)}")
    if head_dim < 8 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim {head_dim}: vLLM's turboquant needs a power of two >= 8")
    preset = PRESETS[FORMATS[cache_dtype]]
    k, v = resolve(preset, "k"), resolve(preset, "v")
    assert isinstance(k, CodecSpec) and isinstance(v, CodecSpec)  # the turboquant presets are codec specs
    return SlotLayout(cache_dtype, head_dim, k.bits, v.bits)


def _slots(slots, lay: SlotLayout) -> np.ndarray:
    a = np.asarray(slots)
    if a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] != lay.size:
        raise ValueError(f"slots must be uint8 [tokens, heads, {lay.size}] ({lay.cache_dtype}, head_dim "
                         f"{lay.head_dim}); got {a.dtype} {a.shape}")
    return a


def slots_to_bodies(slots, lay: SlotLayout) -> tuple[bytes, bytes]:
    """(K body, V body) of one chunk from its slots [tokens, heads, slot bytes] (token-major,
    as one block of vLLM's cache after its ``transpose(1, 2)``)."""
    a = _slots(slots, lay).transpose(1, 0, 2)  # [H, T, slot]
    kc, vc, v0 = lay.k_codes, lay.v_codes, lay.v_at
    k = b"".join(np.ascontiguousarray(a[..., f]).tobytes() for f in (slice(kc, kc + 2), slice(0, kc)))
    v = b"".join(np.ascontiguousarray(a[..., f]).tobytes() for f in (
        slice(v0 + vc, v0 + vc + 2), slice(v0 + vc + 2, v0 + vc + 4), slice(v0, v0 + vc)))
    return k, v


def bodies_to_slots(k_body, v_body, lay: SlotLayout, heads: int, tokens: int) -> np.ndarray:
    """The slots [tokens, heads, slot bytes] of one chunk's K and V bodies (pad bytes 0)."""
    kc, vc, v0 = lay.k_codes, lay.v_codes, lay.v_at
    out = np.zeros((heads, tokens, lay.size), np.uint8)
    k = np.frombuffer(k_body, np.uint8)
    v = np.frombuffer(v_body, np.uint8)
    n = heads * tokens
    if k.size != n * (kc + 2) or v.size != n * (vc + 4):
        raise ValueError(f"bodies of {k.size} and {v.size} bytes are not {heads} x {tokens} {lay.cache_dtype} rows")
    out[..., kc : kc + 2] = k[: 2 * n].reshape(heads, tokens, 2)
    out[..., :kc] = k[2 * n :].reshape(heads, tokens, kc)
    out[..., v0 + vc : v0 + vc + 2] = v[: 2 * n].reshape(heads, tokens, 2)
    out[..., v0 + vc + 2 : v0 + vc + 4] = v[2 * n : 4 * n].reshape(heads, tokens, 2)
    out[..., v0 : v0 + vc] = v[4 * n :].reshape(heads, tokens, vc)
    return out.transpose(1, 0, 2)


def _carry(header, layers, codec, what: str, prepare, form: str) -> bytes:
    """A container of ``header`` whose chunks are given as bodies: ``prepare(i, layer spec,
    token range, layers[i])`` checks one layer's arrays and returns ``(a, b) -> (K body, V
    body)`` for its tokens ``[a, b)`` (relative to the layer's range), chunk by chunk."""
    if len(layers) != header.num_layers:
        raise ValueError(f"{len(layers)} {what} for {header.num_layers} layers")
    enc = Encoder(header, codec=codec)
    out = enc.begin()
    C = header.chunk_tokens
    for i, (spec, r) in enumerate(zip(header.arch.layers, header.layer_tokens)):
        if spec.components != ("k", "v"):
            raise ValueError(f"layer {i} ({spec.kind}): {what} hold K and V of attention layers")
        bodies = prepare(i, spec, r, layers[i])
        t0 = r.start
        while t0 < r.stop:
            t1 = min((t0 // C + 1) * C, r.stop)
            k, v = bodies(t0 - r.start, t1 - r.start)
            out += enc.encoded_chunk(i, "k", t0, k, t1 - t0)
            out += enc.encoded_chunk(i, "v", t0, v, t1 - t0)
            t0 = t1
    out += enc.end(form=form)
    return b"".join(memoryview(b).cast("B") for b in out)


def slots_to_container(header, layers, cache_dtype: str, *, form: str = "file") -> bytes:
    """A container of ``header`` (full-attention layers, bf16/f16/f32 as the decoded dtype)
    from each layer's slots [tokens, heads, slot bytes] (``layers[i]`` covers the layer's
    token range), with the turboquant preset of ``cache_dtype``: the slot bytes become the
    chunk bodies unchanged."""
    slot_layout(cache_dtype, 8)  # names the supported formats first

    def prepare(i, spec, r, data):
        if spec.head_dim_k != spec.head_dim_v:
            raise ValueError(f"layer {i}: turboquant slots hold K and V of one head_dim")
        lay = slot_layout(cache_dtype, spec.head_dim_k)
        a = _slots(data, lay)
        if a.shape[:2] != (r.count, spec.num_kv_heads):
            raise ValueError(f"layer {i}: slots {a.shape[:2]}, the header has {r.count} tokens x "
                             f"{spec.num_kv_heads} heads")
        return lambda t0, t1: slots_to_bodies(a[t0:t1], lay)

    return _carry(header, layers, FORMATS[cache_dtype], "slot tensors", prepare, form)


def container_to_slots(data, cache_dtype: str) -> list:
    """Each layer's slots [tokens, heads, slot bytes] of a container written with the
    turboquant preset of ``cache_dtype`` (its K and V specs must be exactly that preset's,
    without a lossless stage; every chunk is verified as a reader verifies it)."""
    preset = PRESETS[FORMATS[cache_dtype]] if cache_dtype in FORMATS else slot_layout(cache_dtype, 8)
    r = open_reader(data)
    h = r.header
    r.validate()
    want = {c: resolve(preset, c) for c in ("k", "v")}
    layers = []
    for spec, tr in zip(h.arch.layers, h.layer_tokens):
        lay = slot_layout(cache_dtype, spec.head_dim_k)
        layers.append(np.zeros((tr.count, spec.num_kv_heads, lay.size), np.uint8))
    parts = {}
    for i in range(r.chunk_count):
        info = r.info(i)
        got = h.codec_specs[int(r.records["reserved0"][i]) - 1] if int(r.records["reserved0"][i]) else info.codec
        if got != want.get(info.component):
            raise ValueError(f"chunk {i} (layer {info.layer} {info.component}) is not {cache_dtype}: its codec is "
                             f"{got!r}; decode it with kvwire.load instead")
        parts[info.layer, info.component, info.token_start] = (info, bytes(r.stored(i, False)[1]))
    for (layer, comp, t0), (info, kbody) in parts.items():
        if comp != "k":
            continue
        spec = h.arch.layers[layer]
        _, vbody = parts[layer, "v", t0]
        lay = slot_layout(cache_dtype, spec.head_dim_k)
        start = h.layer_tokens[layer].start
        layers[layer][t0 - start : t0 - start + info.token_count] = bodies_to_slots(
            kbody, vbody, lay, spec.num_kv_heads, info.token_count)
    return layers


__all__ = ["FORMATS", "SlotLayout", "bodies_to_slots", "container_to_slots", "slot_layout", "slots_to_bodies",
           "slots_to_container"]


# ---------------------------------------------------------------------------------------
# Per-token-head scaled caches (kv_cache_dtype int8_per_token_head, fp8_per_token_head)
# ---------------------------------------------------------------------------------------

# vLLM's Triton backend (``v1/attention/ops/triton_reshape_and_cache_flash.py``): per token
# and head, codes [D] and one f32 scale ``max(absmax / QMAX, 1e-6)``; value = code * scale.
# kvwire holds the same numbers in format 1.0: int_affine 8 bits symmetric with an f32 scale
# per row (a code q is stored as q + 128, KVW-INT-5), or fp8 with token-granular scales.
PER_TOKEN_HEAD = {"int8_per_token_head": "vllm-int8-per-token-head", "fp8_per_token_head": "fp8-e4m3-token"}
REFUSED["int4_per_token_head"] = "its zero point hides in the low mantissa bits of the f32 scale"
# FlashInfer's fp4 pages: the page layout is read (docs/engine-caches.md 2.1), but the block
# scales' swizzle and the global scale are set by CUDA kernels no CPU run can check
REFUSED.update(dict.fromkeys(("nvfp4", "nvfp4_4over6"), "its fp8 block scales are written by FlashInfer's CUDA "
                             "kernels and its global scale comes from the checkpoint, neither checked against a GPU "
                             "run yet (docs/engine-caches.md 2.1)"))


def _pth_preset(cache_dtype: str, fp8_format: str):
    if cache_dtype in REFUSED:
        raise ValueError(f"kv_cache_dtype {cache_dtype!r} is not carried: {REFUSED[cache_dtype]}")
    if cache_dtype not in PER_TOKEN_HEAD:
        raise ValueError(f"kv_cache_dtype {cache_dtype!r}: carried per-token-head formats are {sorted(PER_TOKEN_HEAD)}")
    spec = resolve(PRESETS[PER_TOKEN_HEAD[cache_dtype]], "k")
    assert isinstance(spec, CodecSpec)  # the per-token-head presets are codec specs
    return replace(spec, fp8_format=fp8_format) if spec.codec == "fp8" else spec


def per_token_head_to_container(header, layers, cache_dtype: str, *, fp8_format: str = "f8_e4m3fn",
                                form: str = "file") -> bytes:
    """A container of ``header`` from each layer's ``(k_codes, k_scales, v_codes, v_scales)``:
    codes [tokens, heads, D] (int8, or uint8 fp8 bytes in ``fp8_format``), scales [tokens,
    heads] f32, as vLLM's per-token-head caches hold them. The codes and scales become the
    chunk bodies unchanged (int8 codes offset by 128)."""
    spec = _pth_preset(cache_dtype, fp8_format)

    def prepare(i, ls, r, data):
        planes = []
        for comp, codes, scales in (("k", *data[:2]), ("v", *data[2:])):
            codes, scales = np.asarray(codes), np.asarray(scales)
            want = (r.count, ls.num_kv_heads, ls.shape(comp, 1)[2])
            if codes.shape != want or codes.dtype.itemsize != 1 or scales.shape != want[:2]:
                raise ValueError(f"layer {i} {comp}: codes {codes.dtype} {codes.shape} and scales {scales.shape}; "
                                 f"need 1-byte codes {want} and scales {want[:2]}")
            u = codes.view(np.uint8) ^ np.uint8(0x80) if spec.codec == "int_affine" else codes.view(np.uint8)
            planes.append((np.asarray(scales, "<f4"), u))

        def bodies(a, b):
            return tuple(np.ascontiguousarray(sc[a:b].T).tobytes() + np.ascontiguousarray(
                u[a:b].transpose(1, 0, 2)).tobytes() for sc, u in planes)
        return bodies

    return _carry(header, layers, spec, "layers of codes and scales", prepare, form)


def container_to_per_token_head(data, cache_dtype: str, *, fp8_format: str = "f8_e4m3fn") -> list:
    """Each layer's ``(k_codes, k_scales, v_codes, v_scales)`` of a container written by
    ``per_token_head_to_container`` (every chunk in exactly that spec, verified as a reader
    verifies it): the engine's bytes back, int8 codes as int8."""
    spec = _pth_preset(cache_dtype, fp8_format)
    r = open_reader(data)
    h = r.header
    r.validate()
    out = []
    for ls, tr in zip(h.arch.layers, h.layer_tokens):
        dk, dv = ls.shape("k", 1)[2], ls.shape("v", 1)[2]
        H = ls.num_kv_heads
        out.append([np.zeros((tr.count, H, dk), np.uint8), np.zeros((tr.count, H), "<f4"),
                    np.zeros((tr.count, H, dv), np.uint8), np.zeros((tr.count, H), "<f4")])
    for i in range(r.chunk_count):
        info, k = r.info(i), int(r.records["reserved0"][i])
        if not k or h.codec_specs[k - 1] != spec:
            raise ValueError(f"chunk {i} (layer {info.layer} {info.component}) is not {cache_dtype}; decode it with "
                             "kvwire.load instead")
        H, M, D = info.shape
        body = np.frombuffer(bytes(r.stored(i, False)[1]), np.uint8)
        a = info.token_start - h.layer_tokens[info.layer].start
        j = 0 if info.component == "k" else 2
        out[info.layer][j + 1][a : a + M] = body[: 4 * H * M].view("<f4").reshape(H, M).T
        codes = body[4 * H * M :].reshape(H, M, D).transpose(1, 0, 2)
        out[info.layer][j][a : a + M] = codes ^ np.uint8(0x80) if spec.codec == "int_affine" else codes
    if spec.codec == "int_affine":
        for layer in out:
            layer[0], layer[2] = layer[0].view(np.int8), layer[2].view(np.int8)
    return [tuple(layer) for layer in out]


__all__ += ["PER_TOKEN_HEAD", "container_to_per_token_head", "per_token_head_to_container"]
