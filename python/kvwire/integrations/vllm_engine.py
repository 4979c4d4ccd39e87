"""What the vLLM connector reads from the running engine: how each attention backend keeps K
and V in its KV cache view, which layout the buffers are in, the fp8 format and scales.

Why apart: these are the facts that change between vLLM releases, backends and kernels, and
each is verified, never assumed: a wrong guess would store bytes that round-trip through
vLLM but are not the model's K and V for any other reader. The tests compare what the
connector stores with transformers' own K and V (tests/integrations/test_vllm_e2e.py).

- K/V packing of the per-layer [blocks, heads, block_size, 2 * head_dim] view (0.29-0.32):
  the tables are kvwire.layouts' (``VLLM_BACKENDS``, ``CPU_ISAS``, ``vllm_kv_packing``;
  spec/layouts.md 3.4); this module reads the two facts they need off vLLM's objects, the
  layer's attention backend (``backend_name``) and, for CPU_ATTN, its kernels' ISA
  (``cpu_isa``), and ``layer_packing`` refuses what ``kvwire.layouts.gather_slots`` does
  not copy (packings "heads" and "quantised", unknown backends and ISAs; KVW-BIND-4).
  Its former tables (``KV_PACKING``, ``CPU_ISA_PACKING``, ``CPU_ISA_HEADER_LAYOUT``) and
  ``kv_packing`` still work for one release and warn (``DeprecationWarning``).
- fp8: vLLM's "fp8" is the platform's fp8 dtype (e4m3fn, e4m3fnuz on ROCm); the scales are
  the attention layers' ``_k_scale_float`` / ``_v_scale_float``.
"""

from __future__ import annotations

import json
import logging
import os

from ..deprecation import former_names
from ..format.header import EngineLayout
from ..layouts import (
    CPU_HEADER_LAYOUTS,
    CPU_ISAS,
    VLLM_BACKENDS,
    LayoutMismatchError,
    check_slot_packing,
    vllm_kv_packing,
    vllm_layout_of,
)
from .vllm_plan import layer_scales

log = logging.getLogger("kvwire.vllm")


def platform_fp8() -> str:
    """The fp8 format vLLM means by kv_cache_dtype "fp8" on this platform (e4m3fnuz on ROCm)."""
    import torch
    from vllm.platforms import current_platform

    try:
        fnuz = current_platform.fp8_dtype() == torch.float8_e4m3fnuz
    except Exception:
        fnuz = False
    return "f8_e4m3fnuz" if fnuz else "f8_e4m3fn"


def engine_cores() -> set[int]:
    """The cores the engine's threads may run on: the union of every thread's affinity.
    vLLM's CPU worker binds each OpenMP thread to one core, the main thread to the first, and
    a thread started from it (the connector's loader) inherits that one core only; before the
    forward pass the others are idle, and the loader's threads may use all of them."""
    if not hasattr(os, "sched_getaffinity"):
        return set(range(os.cpu_count() or 1))
    cores: set[int] = set()
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = []
    for tid in tids:
        try:
            cores |= os.sched_getaffinity(tid)
        except OSError:  # the thread ended meanwhile
            continue
    return cores or os.sched_getaffinity(0)


def compute_threads(cores: set[int] | None = None) -> int:
    """The threads the engine computes with on the CPU (torch's intra-op threads, within
    ``cores``, by default ``engine_cores()``): the loader's threads when it loads before the
    forward pass."""
    import torch

    return max(1, min(torch.get_num_threads(), len(cores if cores is not None else engine_cores())))


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


def layer_packing(vllm_config, name: str, spec, block_size: int) -> tuple[str, str | None]:
    """(packing, cpu_isa) of layer ``name`` (``spec``: its kvwire LayerSpec) in kvwire.layouts'
    terms, the arguments of ``gather_slots`` / ``scatter_slots``: how its attention backend
    keeps K and V in its view (``vllm_kv_packing``) and, for CPU_ATTN, its kernels' ISA. A
    ``LayoutMismatchError`` naming what is known for a backend, ISA or packing the copies do
    not cover (KVW-BIND-4)."""
    if spec.kind == "mla_latent":
        return "latent", None  # one latent: nothing to split
    backend = backend_name(vllm_config, name)
    try:
        cache_dtype = vllm_config.cache_config.cache_dtype
    except AttributeError:
        cache_dtype = None
    try:
        packing = vllm_kv_packing(str(backend), kv_cache_dtype=cache_dtype)
        isa = cpu_isa(vllm_config, name, spec, block_size) if packing == "tokens" else None
        model_dtype = str(getattr(getattr(vllm_config, "model_config", None), "dtype", "")).removeprefix("torch.")
        check_slot_packing(packing, isa, model_dtype)
    except LayoutMismatchError as e:
        raise LayoutMismatchError(f"{name}: {e}") from None
    return packing, isa


def engine_layout_of(vllm_config, names: list, views: list, arch, block_size: int):
    """The ``EngineLayout`` recorded in every chunk's header (informational): the
    KVCacheLayout the views are in, read from their strides (spec/layouts.md KVW-BIND-2); the
    CPU backend's amx tiles by name only (``kvwire.layouts.CPU_HEADER_LAYOUTS``, KVW-BIND-5). None for a
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
    if isa in CPU_HEADER_LAYOUTS and not mla:
        log.info("kvwire connector: vLLM KV caches in the %s kernels' tiles (%s)", isa, CPU_HEADER_LAYOUTS[isa])
        return EngineLayout(CPU_HEADER_LAYOUTS[isa], "", (), block_size, f"vllm/{vllm.__version__}")
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


__all__ = ["backend_name", "compute_threads", "engine_cores", "cpu_isa", "engine_layout_of", "layer_packing", "layer_scales_of", "model_config_json",
           "platform_fp8"]


# -- former names of what kvwire.layouts now owns: deprecated aliases, for one release ---------

def _kv_packing(vllm_config, name: str, spec, block_size: int) -> str:
    """``layer_packing`` in the former names: "channels" (MLA too), "cpu_vec", "cpu_amx"."""
    packing, isa = layer_packing(vllm_config, name, spec, block_size)
    if packing != "tokens":
        return "channels"
    return "cpu_amx" if isa == "amx" else "cpu_vec"


def _moved(name: str):
    if name == "KV_PACKING":  # backend -> former packing name (None: by the CPU kernels' ISA)
        return ({b: None if p == "tokens" else p for b, (p, _) in VLLM_BACKENDS.items() if p in ("channels", "tokens")},
                "kvwire.layouts.VLLM_BACKENDS / vllm_kv_packing")
    if name == "CPU_ISA_PACKING":
        return ({isa: "cpu_amx" if isa in CPU_HEADER_LAYOUTS else "cpu_vec" for isa, (layout, _) in CPU_ISAS.items()
                 if layout or isa in CPU_HEADER_LAYOUTS}, "kvwire.layouts.CPU_ISAS / check_slot_packing")
    if name == "CPU_ISA_HEADER_LAYOUT":
        return dict(CPU_HEADER_LAYOUTS), "kvwire.layouts.CPU_HEADER_LAYOUTS / cpu_header_layout"
    if name == "kv_packing":
        return _kv_packing, "layer_packing (kvwire.layouts' packing names, and the CPU kernels' ISA)"
    return None


__getattr__ = former_names(__name__, _moved)
