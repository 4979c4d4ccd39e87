"""Where vLLM's attention backends keep K and V in their KV cache views (0.29-0.32).

From 0.29 on every backend hands connectors the same per-layer view shape,
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (``create_kv_cache_views``), but
what its last two dimensions hold is the backend's business: most split each token row's
content dim (K = C[:head_size], V = C[head_size:]), the CPU backend splits the block's rows
(its kernels then keep K transposed), and the ROCm / b12x / FlashInfer-NVFP4 backends
publish K and V as separate head slots. Nothing in the tensor says which, so a binder must
be told the backend (spec/layouts.md 3.4, KVW-BIND-4); this module is the table it reads,
with the file and line of vLLM 0.32 that each entry rests on. Pure Python: no torch, no vLLM.
"""

from __future__ import annotations

__all__ = ["CPU_HEADER_LAYOUTS", "CPU_ISAS", "KV_PACKINGS", "VLLM_BACKENDS", "cpu_header_layout", "cpu_layout_name",
           "vllm_kv_packing"]

# channels: K = C[:head_size], V = C[head_size:] of each token row;  tokens: per block and head, K of all the
# block's tokens then V of all (CPU_ATTN);  heads: K and V are separate head slots of the view (dim 1);
# latent: one MLA latent, nothing to split;  quantised: K and V packed into one quantised slot per head.
KV_PACKINGS = ("channels", "tokens", "heads", "latent", "quantised")

_B = "vllm/v1/attention/backends/"
# get_name() -> (packing, evidence in vLLM 0.32)
VLLM_BACKENDS: dict[str, tuple[str, str]] = {
    "FLASH_ATTN": ("channels", _B + "flash_attn.py:1252 kv_cache.transpose(1, 2).split(self.head_size, dim=-1); "
                               "ROCm's AITER backend answers the same name (rocm_aiter_fa.py:794) and, with "
                               "VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT, publishes head slots (customize_spec "
                               ":809-836, :1511-1517)"),
    "FLASH_ATTN_DIFFKV": ("channels", _B + "flash_attn_diffkv.py:193 (head_size_v may differ from head_size)"),
    "TRITON_ATTN": ("channels", _B + "triton_attn.py:625-627, :796; per-token-head quantisation adds inline "
                                "scales to the content (customize_spec :284-295, :712)"),
    "TRITON_ATTN_DIFFKV": ("channels", _B + "triton_attn_diffkv.py:189-194"),
    "FLEX_ATTENTION": ("channels", _B + "flex_attention.py:1233, :1346-1348"),
    "FLASHINFER": ("channels", _B + "flashinfer.py:2168, :2661 (\"other dtypes pack K/V in the content dim\", "
                               ":2154); NVFP4 caches: K heads then V heads, :2159, :2650-2658"),
    "HPC_ATTN": ("channels", _B + "hpc_attn.py:443"),
    "ROCM_AITER_UNIFIED_ATTN": ("channels", _B + "rocm_aiter_unified_attn.py:193 (customize_spec keeps the "
                                            "content-dim packing, :112-121)"),
    "CPU_ATTN": ("tokens", _B + "cpu_attn.py:414-416 kv_cache.view((num_blocks, num_kv_heads, block_size * 2, "
                            "-1)).chunk(2, dim=2); the kernels' interior by ISA: CPU_ISAS"),
    "ROCM_ATTN": ("heads", _B + "rocm_attn.py:215-229 customize_spec num_head_slots=2, :407-410 "
                           "PagedAttention.split_kv_cache (v1/attention/ops/paged_attn.py:17-29, K x-packed)"),
    "ROCM_SEGMENTED_ATTN": ("heads", _B + "rocm_segmented_attn.py:67 (RocmAttentionBackend.customize_spec), "
                                     ":241-252 kv_cache[:, 0] / kv_cache[:, 1]"),
    "B12X": ("heads", _B + "b12x.py:151-165 customize_spec num_head_slots=2, :886 kv_cache.unbind(1)"),
    "TURBOQUANT": ("quantised", _B + "turboquant_attn.py:141-153 \"packs K+V into one slot per head\""),
    "ULTRAQUANT": ("quantised", _B + "ultraquant_attn.py:77-81"),
    **{name: ("latent", _B + "mla/ (one latent per token: kv_lora_rank + qk_rope_head_dim)") for name in (
        "FLASHMLA", "FLASHMLA_SPARSE", "FLASH_ATTN_MLA", "FLASH_ATTN_MLA_SPARSE", "FLASHINFER_MLA",
        "FLASHINFER_MLA_SPARSE", "FLASHINFER_MLA_SPARSE_SM90", "FLASHINFER_MLA_SPARSE_SM120", "CUTLASS_MLA",
        "TRITON_MLA", "ROCM_AITER_MLA", "ROCM_AITER_MLA_SPARSE", "AITER_TRITON_MLA", "CPU_MLA", "AMX_MLA",
        "TOKENSPEED_MLA", "XPU_MLA_SPARSE")},
}

# CPU_ATTN: the kernel ISA (``layer.isa``, set by cpu_attn.py:169-176 from _get_attn_isa :520-560) decides how
# each block's K and V halves are laid out by ``cpu_attn_reshape_and_cache``. isa -> registered layout, or None
# with the reason it is not one.
CPU_ISAS: dict[str, tuple[str | None, str]] = {
    "vec": ("vllm.v0_29.cpu.vec", ("csrc/cpu/cpu_attn_vec.hpp: K [head_dim, block_size], V [block_size, head_dim]; "
                                   "run through vLLM 0.29, 0.31 and 0.32's op")),
    "vec16": ("vllm.v0_29.cpu.vec", "cpu_attn_vec16.hpp (derives from VEC); run through 0.29, 0.31 and 0.32's op"),
    "rvv": ("vllm.v0_29.cpu.vec", "cpu_attn_rvv.hpp: K transposed to [head_dim, block_size], V row-major (source)"),
    "vsx": ("vllm.v0_29.cpu.vec", "cpu_attn_vsx.hpp: k_cache_token_group_stride \"[head_dim, block_size]\" (source)"),
    "vxe": ("vllm.v0_29.cpu.vec", "cpu_attn_vxe.hpp: the same strides as vsx (source)"),
    "neon": ("vllm.v0_29.cpu.vec", ("cpu_attn_neon.hpp: like VEC for float16 / float32; bfloat16 with Arm BF16 "
                                    "support uses BFMMLA tiles (cpu_attn_neon_bfmmla.hpp), not registered")),
    "amx": (None, ("cpu_attn_amx.hpp, run through vLLM 0.32's op (bfloat16, fp8): AMX tiles of pairs, K "
                   "[block_size/16, head_dim/2, 16, 2], V [head_dim/16, block_size/2, 16, 2] (KVW-BIND-5), not a "
                   "strided view of [block_size, head_dim]; gather_slots and scatter_slots copy them")),
}
# CPU_ATTN kernels without a registered layout whose caches gather_slots / scatter_slots copy anyway (vllm_slots.py):
# the name Header.engine_layout gives them, with empty axes (the axis grammar has no tiles; KVW-BIND-5).
CPU_HEADER_LAYOUTS: dict[str, str] = {"amx": "vllm.v0_32.cpu.amx"}


def vllm_kv_packing(attn_backend: str, *, kv_cache_dtype: str | None = None, num_head_slots: int | None = None) -> str:
    """How vLLM backend ``attn_backend`` (its ``get_name()``: "FLASH_ATTN", "CPU_ATTN", ...)
    keeps K and V in the view it hands connectors: one of ``KV_PACKINGS``.

    ``kv_cache_dtype`` (``cache_config.cache_dtype``) and ``num_head_slots`` (the layer's
    ``AttentionSpec.num_head_slots``) refine it where the name alone does not decide:
    FlashInfer's NVFP4 caches, and ROCm's AITER backend, which answers "FLASH_ATTN" too,
    publish K and V as head slots. An unknown name is a ``LayoutMismatchError`` naming the
    known ones (KVW-BIND-4: the packing is never assumed)."""
    if not isinstance(attn_backend, str):
        raise TypeError(f"attn_backend is vLLM's backend name (get_name()), a str, not {type(attn_backend).__name__}")
    if attn_backend not in VLLM_BACKENDS:
        from .binding import LayoutMismatchError

        raise LayoutMismatchError(f"attention backend {attn_backend!r}: how it keeps K and V in its KV cache view is "
                                  f"not known here; known: {', '.join(sorted(VLLM_BACKENDS))} (KVW-BIND-4)")
    packing = VLLM_BACKENDS[attn_backend][0]
    if packing in ("latent", "quantised"):
        return packing
    if num_head_slots is not None or (attn_backend == "FLASHINFER" and "nvfp4" in (kv_cache_dtype or "")):
        return "heads"
    return packing


def cpu_layout_name(cpu_isa, dtype_name: str) -> str:
    """The registered layout of CPU_ATTN caches written by the ``cpu_isa`` kernels (the
    attention layers' ``.isa``) in ``dtype_name`` ("bfloat16", "float16", ...); a
    ``LayoutMismatchError`` naming the ISAs that have one otherwise."""
    from .binding import LayoutMismatchError

    known = ", ".join(k for k, (v, _) in CPU_ISAS.items() if v)
    if cpu_isa is None:
        raise LayoutMismatchError("CPU_ATTN: its kernels lay out K and V by ISA: pass cpu_isa= (the attention "
                                  f"layers' .isa, vLLM's _get_attn_isa); registered: {known} (KVW-BIND-4)")
    if cpu_isa not in CPU_ISAS:
        raise LayoutMismatchError(f"CPU_ATTN with ISA {cpu_isa!r}: not known here; known: {', '.join(CPU_ISAS)}")
    name, why = CPU_ISAS[cpu_isa]
    if name is None or (cpu_isa == "neon" and dtype_name == "bfloat16"):
        raise LayoutMismatchError(f"CPU_ATTN with ISA {cpu_isa!r} ({dtype_name}): no registered layout ({why}); "
                                  f"registered: {known}")
    return name


def cpu_header_layout(cpu_isa, dtype_name: str) -> str:
    """The engine layout name a header records for CPU_ATTN caches of the ``cpu_isa`` kernels
    in ``dtype_name``: the registered layout (``cpu_layout_name``), or, for kernels whose
    tiles no layout describes, the name in ``CPU_HEADER_LAYOUTS`` (``vllm.v0_32.cpu.amx``)."""
    if cpu_isa in CPU_HEADER_LAYOUTS:
        return CPU_HEADER_LAYOUTS[cpu_isa]
    return cpu_layout_name(cpu_isa, dtype_name)
