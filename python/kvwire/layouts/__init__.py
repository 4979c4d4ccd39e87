"""Connectors: engine KV layouts <-> kvwire's standard layout, named explicitly.

::

    from kvwire import layouts
    eb = layouts.bind("vllm.flash_hnd", kv_caches)            # checks shapes and strides
    data = layouts.encode_from_engine(eb, block_ids, num_tokens)
    with kvwire.open(data) as r:
        layouts.scatter(r, eb2, other_block_ids).synchronize()  # one copy into the engine

Layouts (``layout_names()``; spec/layouts.md): vLLM paged (flash NHD/HND, blocks-first,
packed, MLA), SGLang device pools and HiCache host layouts, LMCache memory formats,
Dynamo KVBM, and kvwire's page-major offload ring layout. torch is imported only when
buffers are bound, so ``import kvwire`` works without it.
"""

from .descriptor import AXES, LAYOUTS, LayoutDescriptor, get_layout, layout_names


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
    if name in ("OffloadRing", "RingFullError"):
        from . import offload

        return getattr(offload, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AXES", "LAYOUTS", "EngineBuffers", "LayerGeometry", "LayoutDescriptor", "LayoutMismatchError", "OffloadRing",
    "RingFullError", "ScatterHandle", "architecture_of", "bind", "encode_from_engine", "gather", "gather_cache",
    "get_layout", "header_for", "iter_buffers_from_engine", "iter_chunks", "layout_names", "save_from_engine",
    "scatter", "slots_from_blocks",
]
