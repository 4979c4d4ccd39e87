"""Named codec pipelines (``codec="kivi2"``, ``"int8"`` ...) and the resolution of a codec
choice into "raw", "zstd" or a ``CodecSpec`` (spec/codecs.md)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..format import registry as R
from ..format.codec_specs import CodecSpec


def _kivi(bits: int) -> dict[str, CodecSpec]:
    """KIVI (arXiv 2402.02750): keys per channel over groups of 32 tokens, values per token
    over groups of 32 channels, min-max asymmetric, the last 128 tokens in full precision."""
    base = CodecSpec("int_affine", bits=bits, group_size=32, scale_dtype="f16", residual_tokens=128)
    return {"k": base, "v": replace(base, group_axis="channels"), "latent": replace(base, group_axis="channels")}


ROTATION_SEED = 0x4B565752  # "KVWR": the presets' sign vector (KVW-ROT-5); any seed works


def _lloyd(bits: int) -> CodecSpec:
    """Revision 1.2 (spec/codecs.md section 8): a randomized Hadamard rotation of each token's
    channels, then the Lloyd-Max levels of N(0, 1) with one f16 RMS scale per 128 channels
    (one scale per token and head at head_dim <= 128; vLLM's turboquant keys are rotated the same way)."""
    return CodecSpec("int_affine", bits=bits, group_size=128, group_axis="channels", symmetric=True,
                     scale_dtype="f16", rotation="hadamard", rotation_seed=ROTATION_SEED, codebook="gaussian")


def _kchan(bits: int, values: CodecSpec) -> dict[str, CodecSpec]:
    """Keys (and MLA latents) per channel over groups of 64 tokens, min-max, f16 scale and min
    (KIVI's keys without its residual window), values ``values``: measured on keys with
    Llama-like outlier channels (benchmarks/results/rotation.md), per-channel key groups keep
    an outlier within its own scale where a rotation spreads it over the whole row."""
    keys = CodecSpec("int_affine", bits=bits, group_size=64, scale_dtype="f16")
    return {"k": keys, "v": values, "latent": keys}


def _turboquant(k_bits: int, v_bits: int) -> dict[str, CodecSpec]:
    """vLLM 0.32's ``turboquant_*_nc`` caches (revision 1.3, spec/codecs.md section 9):
    keys rotated without signs onto vLLM's Lloyd-Max table with one f16 norm per row, values
    min-max per row with an f16 scale and minimum: the numbers such a cache holds."""
    k = CodecSpec("int_affine", bits=k_bits, group_size=1 << 16, group_axis="channels", symmetric=True,
                  scale_dtype="f16", rotation="sylvester", codebook="turboquant")
    v = CodecSpec("int_affine", bits=v_bits, group_size=1 << 16, group_axis="channels", scale_dtype="f16")
    return {"k": k, "v": v}


# Named pipelines: a CodecSpec for every component, or {component: CodecSpec}.
PRESETS = {
    "byteplane": CodecSpec("byteplane_zstd"),
    "fp8-e4m3": CodecSpec("fp8", fp8_format="f8_e4m3fn", scale_granularity="head"),
    "fp8-e4m3-token": CodecSpec("fp8", fp8_format="f8_e4m3fn", scale_granularity="token"),
    "fp8-e4m3fnuz": CodecSpec("fp8", fp8_format="f8_e4m3fnuz", scale_granularity="head"),
    "fp8-e5m2": CodecSpec("fp8", fp8_format="f8_e5m2", scale_granularity="head"),
    # per token and head; symmetric with an f16 scale: 8.125 bits per element at head_dim 128
    "int8": CodecSpec("int_affine", bits=8, group_size=128, group_axis="channels", symmetric=True, scale_dtype="f16"),
    # SGLang's int8: asymmetric, f32 scale and zero per token and head (8.5 bits at head_dim 128)
    "int8-asym": CodecSpec("int_affine", bits=8, group_size=128, group_axis="channels"),
    "int4-g32": CodecSpec("int_affine", bits=4, group_size=32, group_axis="channels", scale_dtype="f16"),
    "int4-g32-zstd": CodecSpec("int_affine", bits=4, group_size=32, group_axis="channels", scale_dtype="f16",
                               lossless="zstd"),
    "kivi2": _kivi(2),
    "kivi4": _kivi(4),
    # revision 1.2: rotated pipelines (keys with outlier channels)
    "hadamard-int4-g32": CodecSpec("int_affine", bits=4, group_size=32, group_axis="channels", scale_dtype="f16",
                                   rotation="hadamard", rotation_seed=ROTATION_SEED),
    "hadamard-lloyd4": _lloyd(4),
    "hadamard-lloyd3": _lloyd(3),
    "hadamard-lloyd2": _lloyd(2),
    # keys at 3 bits, values at 2 (KIVI: keys need more): 2.625 bits per element at head_dim 128
    "hadamard-lloyd-k3v2": {"k": _lloyd(3), "v": _lloyd(2), "latent": _lloyd(3)},
    # keys per channel (unrotated: an outlier channel keeps its own scale), values rotated
    "kchan4-vlloyd4": _kchan(4, _lloyd(4)),
    "kchan3-vlloyd2": _kchan(3, _lloyd(2)),
    # revision 1.3: vLLM's turboquant caches (kv_cache_dtype turboquant_4bit_nc, _k3v4_nc, _3bit_nc)
    "vllm-turboquant-4bit-nc": _turboquant(4, 4),
    "vllm-turboquant-k3v4-nc": _turboquant(3, 4),
    "vllm-turboquant-3bit-nc": _turboquant(3, 3),
    # vLLM's int8_per_token_head cache: symmetric int8, one f32 scale per token and head (format 1.0)
    "vllm-int8-per-token-head": CodecSpec("int_affine", bits=8, group_size=1 << 16, group_axis="channels",
                                          symmetric=True, scale_dtype="f32"),
}


def resolve(choice: Any, component: str) -> str | CodecSpec:
    """A codec choice (name, CodecSpec, preset or None) for one component: "raw", "zstd"
    or a CodecSpec."""
    if choice is None:
        return "raw"
    if isinstance(choice, CodecSpec):
        return choice
    if isinstance(choice, dict):  # a preset's {component: spec}
        return resolve(choice.get(component, "raw"), component)
    if choice in ("raw", "zstd"):
        name: str = choice
        return name
    if choice in PRESETS:
        return resolve(PRESETS[choice], component)
    if choice in R.CODECS:  # "byteplane_zstd", "fp8", "int_affine" with default parameters
        return CodecSpec(choice)
    raise ValueError(f"unknown codec {choice!r}: raw, zstd, a registry codec, a preset ({sorted(PRESETS)}), a "
                     "CodecSpec, a {(layer, component): codec} mapping or a callable")
