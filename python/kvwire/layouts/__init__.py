"""Connectors: engine KV layouts <-> kvwire's standard layout, named explicitly.

::

    from kvwire import layouts
    eb = layouts.bind_vllm(kv_caches, num_kv_heads=8, head_dim=128, block_size=16,  # vLLM 0.29+: derived
                           attn_backend="FLASH_ATTN")  # where the backend keeps K and V (KVW-BIND-4)
    eb = layouts.bind("sglang.mha", pool)                      # others: named; checks shapes and strides
    data = layouts.encode_from_engine(eb, block_ids, num_tokens)
    with kvwire.open(data) as r:
        layouts.scatter(r, eb2, other_block_ids).synchronize()  # one copy into the engine

Layouts (``layout_names()``; spec/layouts.md): vLLM's standardised ``KVCacheLayout`` views
of 0.29 on (``vllm.v0_29.*``, derived from the tensors and the attention backend by
``vllm_layout_of``; ``vllm_kv_packing`` says how a backend packs K and V) and the layouts
of earlier releases under names that give their releases (``vllm.v0_9_1_to_0_22.flash_hnd``;
the old names are deprecated aliases, ``DEPRECATED``), SGLang device pools and HiCache host
layouts, LMCache memory formats, Dynamo KVBM, and kvwire's page-major offload ring layout.
Where a tensor's shape and memory order fit several layouts, binding needs the sizes that
tell them apart (``block_size``, ``num_heads``, ``num_layers``; KVW-BIND-1). torch is
imported only when buffers are bound, so ``import kvwire`` works without it.
"""

from .descriptor import AXES, DEPRECATED, KV_CACHE_LAYOUTS, LAYOUTS, LayoutDescriptor, get_layout, layout_names


def __getattr__(name):  # torch-dependent parts, imported on first use
    if name in ("EngineBuffers", "LayerGeometry", "LayoutMismatchError", "bind"):
        from . import binding

        return getattr(binding, name)
    if name == "ScatterHandle":
        from . import scattering

        return scattering.ScatterHandle
    if name == "slots_from_blocks":
        from . import ids

        return ids.slots_from_blocks
    if name in ("architecture_of", "header_for", "iter_chunks", "iter_buffers_from_engine", "encode_from_engine",
                "save_from_engine", "gather", "gather_cache", "scatter"):
        from . import engine

        return getattr(engine, name)
    if name in ("bind_vllm", "kv_cache_layout_name", "vllm_cross_layer_view", "vllm_layout_of"):
        from . import vllm

        return getattr(vllm, name)
    if name in ("CPU_ISAS", "KV_PACKINGS", "VLLM_BACKENDS", "vllm_kv_packing"):
        from . import backends

        return getattr(backends, name)
    if name == "needed_hints":
        from . import ambiguity

        return ambiguity.needed_hints
    if name in ("OffloadRing", "RingFullError"):
        from . import offload

        return getattr(offload, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AXES", "DEPRECATED", "KV_CACHE_LAYOUTS", "LAYOUTS", "EngineBuffers", "LayerGeometry", "LayoutDescriptor",
    "LayoutMismatchError", "OffloadRing",
    "RingFullError", "ScatterHandle", "architecture_of", "bind", "encode_from_engine", "gather", "gather_cache",
    "get_layout", "header_for", "iter_buffers_from_engine", "iter_chunks", "layout_names", "save_from_engine",
    "scatter", "slots_from_blocks", "bind_vllm", "kv_cache_layout_name", "needed_hints", "vllm_cross_layer_view",
    "vllm_layout_of", "CPU_ISAS", "KV_PACKINGS", "VLLM_BACKENDS", "vllm_kv_packing",
]
