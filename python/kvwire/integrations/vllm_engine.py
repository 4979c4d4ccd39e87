"""What the vLLM connector reads from the running engine: how each attention backend keeps K
and V in its KV cache view, which layout the buffers are in, the fp8 format and scales.

Why apart: these are the facts that change between vLLM releases, backends and kernels, and
each is verified, never assumed: a wrong guess would store bytes that round-trip through
vLLM but are not the model's K and V for any other reader. The tests compare what the
connector stores with transformers' own K and V (tests/integrations/test_vllm_e2e.py).

- K/V packing of the per-layer [blocks, heads, block_size, 2 * head_dim] view (0.29-0.32):
  "channels" (K = C[:head_dim], V = C[head_dim:] of each token row: flash_attn.py,
  triton_attn.py, flashinfer.py, flex_attention.py); the CPU backend's vec/vec16 kernels
  keep per block and head K transposed, then V ("cpu_vec", measured through its
  ``cpu_attn_reshape_and_cache`` op; vllm_plan.cpu_vec_views); its amx kernels (bfloat16 on
  CPUs with AMX) keep K and V in AMX tiles of pairs ("cpu_amx", measured the same way;
  vllm_plan.cpu_amx_views, spec/layouts.md KVW-BIND-5). Other CPU kernels (NEON, ...) and
  other backends are refused until verified.
- fp8: vLLM's "fp8" is the platform's fp8 dtype (e4m3fn, e4m3fnuz on ROCm); the scales are
  the attention layers' ``_k_scale_float`` / ``_v_scale_float``.
"""

from __future__ import annotations

import json
import logging
import os

from ..format.header import EngineLayout
from ..layouts import vllm_layout_of
from .vllm_plan import layer_scales

log = logging.getLogger("kvwire.vllm")

KV_PACKING = {"FLASH_ATTN": "channels", "TRITON_ATTN": "channels", "FLASHINFER": "channels",
              "FLEX_ATTENTION": "channels", "CPU_ATTN": None}
# measured through cpu_attn_reshape_and_cache
CPU_ISA_PACKING = {"vec": "cpu_vec", "vec16": "cpu_vec", "amx": "cpu_amx"}
# kernels whose layout kvwire.layouts cannot describe (tiles, not a strided view): the header's name, empty axes
CPU_ISA_HEADER_LAYOUT = {"amx": "vllm.v0_32.cpu.amx"}  # spec/layouts.md KVW-BIND-5


def platform_fp8() -> str:
    """The fp8 format vLLM means by kv_cache_dtype "fp8" on this platform (e4m3fnuz on ROCm)."""
    import torch
    from vllm.platforms import current_platform

    try:
        fnuz = current_platform.fp8_dtype() == torch.float8_e4m3fnuz
    except Exception:  # noqa: BLE001 - a platform without fp8 support: "fp8" is refused by vLLM itself
        fnuz = False
    return "f8_e4m3fnuz" if fnuz else "f8_e4m3fn"


def model_config_json(model_dir: str) -> dict:
    """The model's config.json as written (its canonical JSON is the config fingerprint)."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def attention_layer(vllm_config, name: str):
    try:
        return vllm_config.compilation_config.static_forward_context[name]
    except (AttributeError, KeyError):
        return None


def backend_name(vllm_config, name: str):
    try:
        return attention_layer(vllm_config, name).get_attn_backend().get_name()
    except AttributeError:
        return None


def cpu_isa(vllm_config, name: str, spec, block_size: int) -> str:
    """The kernels vLLM's CPU backend uses for layer ``name`` (its ``.isa``)."""
    isa = getattr(attention_layer(vllm_config, name), "isa", None)
    if isa is None:  # set on the layers when the CPU metadata builder is made: the same function of the config
        from vllm.v1.attention.backends import cpu_attn

        isa = cpu_attn._get_attn_isa(vllm_config.model_config.dtype, block_size, spec.head_dim_k,
                                     vllm_config.cache_config.cache_dtype)
    return isa


def kv_packing(vllm_config, name: str, spec, block_size: int) -> str:
    """How layer ``name``'s attention backend keeps K and V in its view (``spec``: its
    kvwire LayerSpec); a ValueError naming what is known for anything else."""
    if spec.kind == "mla_latent":
        return "channels"  # one latent: nothing to split
    backend = backend_name(vllm_config, name)
    if backend not in KV_PACKING:
        raise ValueError(f"{name}: attention backend {backend!r}; the kvwire connector knows how "
                         f"{', '.join(sorted(KV_PACKING))} keep K and V in their KV cache view, not this one")
    if backend != "CPU_ATTN":
        return KV_PACKING[backend]
    isa = cpu_isa(vllm_config, name, spec, block_size)
    if isa not in CPU_ISA_PACKING:
        raise ValueError(f"{name}: vLLM's CPU attention uses its {isa!r} kernels here, whose KV cache layout the "
                         f"kvwire connector has not verified (it knows {', '.join(sorted(CPU_ISA_PACKING))})")
    return CPU_ISA_PACKING[isa]


def engine_layout_of(vllm_config, names: list, views: list, arch, block_size: int):
    """The ``EngineLayout`` recorded in every chunk's header (informational): the
    KVCacheLayout the views are in, read from their strides (spec/layouts.md KVW-BIND-2); the
    CPU backend's amx tiles by name only (``CPU_ISA_HEADER_LAYOUT``, KVW-BIND-5). None for a
    model whose layers differ in shape (each would need its own binding)."""
    if len(set(arch.layers)) != 1:
        return None
    import vllm

    spec = arch.layers[0]
    try:
        resolved = vllm_config.cache_config.get_resolved_kv_cache_layout()
    except (AttributeError, ValueError):
        resolved = None
    mla = spec.kind == "mla_latent"
    backend = backend_name(vllm_config, names[0])
    isa = cpu_isa(vllm_config, names[0], spec, block_size) if backend == "CPU_ATTN" else None
    if isa in CPU_ISA_HEADER_LAYOUT and not mla:
        log.info("kvwire connector: vLLM KV caches in the %s kernels' tiles (%s)", isa, CPU_ISA_HEADER_LAYOUT[isa])
        return EngineLayout(CPU_ISA_HEADER_LAYOUT[isa], "", (), block_size, f"vllm/{vllm.__version__}")
    desc = vllm_layout_of(views, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim_k, block_size=block_size,
                          mla=mla, kv_cache_layout=resolved, attn_backend=None if mla else backend, cpu_isa=isa)
    order = desc.stride_order if desc.stride_order != tuple(range(len(desc.dims))) else ()
    log.info("kvwire connector: vLLM KV caches in layout %s", desc)
    return EngineLayout(desc.name, desc.axes, order, block_size, f"vllm/{vllm.__version__}")


def layer_scales_of(vllm_config, names: list, arch) -> tuple:
    """Per layer (k_scale, v_scale) of an fp8 cache, from the attention layers."""
    out = []
    for name, spec in zip(names, arch.layers):
        layer = attention_layer(vllm_config, name)
        out.append(layer_scales(getattr(layer, "_k_scale_float", 1.0), getattr(layer, "_v_scale_float", 1.0),
                                spec.kind == "mla_latent"))
    return tuple(out)


__all__ = ["CPU_ISA_HEADER_LAYOUT", "CPU_ISA_PACKING", "KV_PACKING", "backend_name", "cpu_isa", "engine_layout_of",
           "kv_packing", "layer_scales_of", "model_config_json", "platform_fp8"]
