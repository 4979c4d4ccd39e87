"""Engine layouts: engine KV layouts <-> kvwire's standard layout, named explicitly.

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
``vllm_layout_of``; ``vllm_kv_packing`` says how a backend packs K and V, and
``gather_slots`` / ``scatter_slots`` copy one layer by slot ids for every packing an engine
connector copies, the CPU backend's amx tiles included) and the layouts of earlier releases
under names that give their releases (``vllm.v0_9_1_to_0_22.flash_hnd``; the old names are
deprecated aliases, ``DEPRECATED``), SGLang device pools and HiCache host layouts, LMCache
memory formats, Dynamo KVBM, and kvwire's page-major offload ring layout. Where a tensor's
shape and memory order fit several layouts, binding needs the sizes that tell them apart
(``block_size``, ``num_heads``, ``num_layers``; KVW-BIND-1).

A *connector* is an engine's plug-in (``kvwire.integrations``: the vLLM connector); it reads
the engine's objects and calls this package, which knows the layouts. torch is imported
only inside the functions that touch buffers, so ``import kvwire`` works without it.
"""

from .ambiguity import needed_hints
from .backends import (
    CPU_HEADER_LAYOUTS,
    CPU_ISAS,
    KV_PACKINGS,
    VLLM_BACKENDS,
    cpu_header_layout,
    cpu_layout_name,
    vllm_kv_packing,
)
from .binding import EngineBuffers, LayerGeometry, LayoutMismatchError, bind
from .descriptor import AXES, DEPRECATED, KV_CACHE_LAYOUTS, LAYOUTS, LayoutDescriptor, get_layout, layout_names
from .engine import (
    architecture_of,
    encode_from_engine,
    gather,
    gather_cache,
    header_for,
    iter_buffers_from_engine,
    iter_chunks,
    save_from_engine,
    scatter,
)
from .ids import slots_from_blocks
from .offload import OffloadRing, RingFullError
from .scattering import ScatterHandle
from .vllm import bind_vllm, kv_cache_layout_name, vllm_cross_layer_view, vllm_layout_of
from .vllm_slots import (
    AMX_ROWS,
    SLOT_PACKINGS,
    PagedLayer,
    SlotPlan,
    check_slot_packing,
    cpu_amx_views,
    cpu_vec_views,
    gather_slots,
    scatter_slots,
)

__all__ = [
    "AMX_ROWS", "AXES", "CPU_HEADER_LAYOUTS", "CPU_ISAS", "DEPRECATED", "KV_CACHE_LAYOUTS", "KV_PACKINGS", "LAYOUTS",
    "SLOT_PACKINGS", "VLLM_BACKENDS", "EngineBuffers", "LayerGeometry", "LayoutDescriptor", "LayoutMismatchError",
    "OffloadRing", "PagedLayer", "RingFullError", "ScatterHandle", "SlotPlan", "architecture_of", "bind", "bind_vllm", "check_slot_packing",
    "cpu_amx_views", "cpu_header_layout", "cpu_layout_name", "cpu_vec_views", "encode_from_engine", "gather",
    "gather_cache", "gather_slots", "get_layout", "header_for", "iter_buffers_from_engine", "iter_chunks",
    "kv_cache_layout_name", "layout_names", "needed_hints", "save_from_engine", "scatter", "scatter_slots",
    "slots_from_blocks", "vllm_cross_layer_view", "vllm_kv_packing", "vllm_layout_of",
]
