"""Layout descriptors: an engine's KV buffer described by named axes, never by a bare shape.

Axis letters (spec/layouts.md):

    KV  the K/V selector (2 = K then V; 1 = a shared MLA latent)
    L   layer                  B  block (page)        N  token within a block
    T   token slot (flat)      H  KV head             C  channel (head_dim; rank+rope for MLA)

A descriptor lists the engine tensor's dimensions in the order of its *shape* as the engine
hands it over; a dimension that merges several axes (LMCache's ``D = H*C``, vLLM's packed
``2*head_size``) lists them outermost first. ``stride_order`` says how the dimensions lie
in memory, outermost first, exactly like vLLM's ``get_kv_cache_stride_order()``: vLLM
allocates ``shape[stride_order]`` contiguously and hands connectors a permuted view.

Packing of K and V:

    split     one tensor with a KV axis of size 2
    fused     K and V share a dimension with the channels (``KV*C``: K's C values, then V's)
    separate  K and V in two tensors of the same axes (SGLang ``k_buffer`` / ``v_buffer``)
    shared    one MLA latent; a KV or H axis, if present, has size 1

Scope: ``layer`` layouts have one tensor (or one K/V pair) per layer; ``model`` layouts
have one tensor with an ``L`` axis. Addressing follows from the axes: ``block`` when the
layout is paged (B and N), ``slot`` when tokens have flat slots (T).

This module is pure Python (no torch), so other tools can list and print layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

AXES = ("KV", "L", "B", "N", "T", "H", "C")
PACKINGS = ("split", "fused", "separate", "shared")
SCOPES = ("layer", "model")


@dataclass(frozen=True)
class LayoutDescriptor:
    name: str
    dims: tuple[tuple[str, ...], ...]  # per tensor dimension, in shape order: the axes it holds, outer first
    stride_order: tuple[int, ...]  # dimensions from outermost to innermost in memory
    packing: str
    scope: str
    description: str = ""

    def __post_init__(self):
        flat = [a for d in self.dims for a in d]
        if any(a not in AXES for a in flat) or len(set(flat)) != len(flat):
            raise ValueError(f"{self.name}: axes {flat} must be distinct letters of {AXES}")
        if sorted(self.stride_order) != list(range(len(self.dims))):
            raise ValueError(f"{self.name}: stride_order {self.stride_order} is not a permutation")
        if self.packing not in PACKINGS or self.scope not in SCOPES:
            raise ValueError(f"{self.name}: packing {self.packing!r} / scope {self.scope!r}")
        paged, slotted = "B" in flat and "N" in flat, "T" in flat
        if paged == slotted or ("B" in flat) != ("N" in flat):
            raise ValueError(f"{self.name}: needs either B and N (paged) or T (token slots)")
        if "C" not in flat or ("H" not in flat and self.packing != "shared"):
            raise ValueError(f"{self.name}: needs C, and H unless the packing is shared")
        if ("L" in flat) != (self.scope == "model"):
            raise ValueError(f"{self.name}: an L axis exactly when scope is 'model'")
        if (self.packing in ("split", "fused")) != ("KV" in flat) and self.packing != "shared":
            raise ValueError(f"{self.name}: packing {self.packing} and the KV axis disagree")
        if self.packing == "fused" and not any(d[:1] == ("KV",) and d[-1:] == ("C",) for d in self.dims):
            raise ValueError(f"{self.name}: fused packing needs a KV*...*C dimension")
        if self.packing == "separate" and self.scope != "layer":
            raise ValueError(f"{self.name}: separate K/V tensors are per layer")

    @property
    def axes(self) -> str:
        """The header spelling (EngineLayout.axes): ``"KV,B,N,H,C"``, ``"KV,L,T,H*C"``."""
        return ",".join("*".join(d) for d in self.dims)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(a for d in self.dims for a in d)

    @property
    def addressing(self) -> str:
        return "block" if "B" in self.axis_names else "slot"

    @property
    def mla(self) -> bool:
        return self.packing == "shared"

    @property
    def physical_axes(self) -> str:
        """Dimensions in memory order, outermost first (``"KV,B,H,N,C"`` for vLLM HND)."""
        return ",".join("*".join(self.dims[i]) for i in self.stride_order)

    def __str__(self) -> str:
        order = "" if self.stride_order == tuple(range(len(self.dims))) else f", memory {self.physical_axes}"
        return f"{self.name} [{self.axes}]{order} ({self.packing}, per {self.scope})"


def _d(name: str, axes: str, packing: str, scope: str, order=None, description: str = "") -> LayoutDescriptor:
    dims = tuple(tuple(part.split("*")) for part in axes.split(","))
    return LayoutDescriptor(name, dims, tuple(order) if order else tuple(range(len(dims))), packing, scope,
                            description)


_HND5 = (0, 1, 3, 2, 4)

LAYOUTS: dict[str, LayoutDescriptor] = {d.name: d for d in (
    # vLLM: one tensor per attention layer (register_kv_caches), block ids from the block table.
    _d("vllm.flash_nhd", "KV,B,N,H,C", "split", "layer", None,
       "FlashAttention (2, num_blocks, block_size, H, D), stride order NHD (0,1,2,3,4)"),
    _d("vllm.flash_hnd", "KV,B,N,H,C", "split", "layer", _HND5,
       "FlashAttention (2, num_blocks, block_size, H, D), stride order HND (0,1,3,2,4)"),
    _d("vllm.blocks_first", "B,KV,N,H,C", "split", "layer", None,
       "blocks-first (num_blocks, 2, block_size, H, D), NHD (FlashInfer)"),
    _d("vllm.blocks_first_hnd", "B,KV,N,H,C", "split", "layer", _HND5,
       "blocks-first (num_blocks, 2, block_size, H, D), stride order HND (0,1,3,2,4)"),
    _d("vllm.packed", "B,H,N,KV*C", "fused", "layer", None,
       "packed (num_blocks, H, block_size, 2*head_size): K channels then V channels"),
    _d("vllm.mla", "B,N,C", "shared", "layer", None,
       "MLA (num_blocks, block_size, kv_lora_rank + qk_rope_head_dim), e.g. 576"),
    # SGLang device pools: per layer, token slots from out_cache_loc / req_to_token.
    _d("sglang.mha", "T,H,C", "separate", "layer", None,
       "MHATokenToKVPool k_buffer[l] / v_buffer[l] (size + page_size, H, D), slot 0 padding"),
    _d("sglang.mla", "T,H,C", "shared", "layer", None,
       "MLATokenToKVPool kv_buffer[l] (size + page_size, 1, kv_lora_rank + qk_rope_head_dim)"),
    # SGLang HiCache host pools (memory_pool_host.py), one tensor for all layers.
    _d("sglang.host.layer_first", "KV,L,T,H,C", "split", "model", None, "(2, L, size, H, D)"),
    _d("sglang.host.page_first", "KV,T,L,H,C", "split", "model", None, "(2, size, L, H, D)"),
    _d("sglang.host.page_first_direct", "KV,B,L,N,H,C", "split", "model", None,
       "(2, pages, L, page_size, H, D)"),
    _d("sglang.host.page_head", "KV,B,H,N,L,C", "split", "model", None, "(2, pages, H, page_size, L, D)"),
    _d("sglang.host.mla.layer_first", "L,T,H,C", "shared", "model", None, "MLA (L, size, 1, rank+rope)"),
    _d("sglang.host.mla.page_first", "T,L,H,C", "shared", "model", None, "MLA (size, L, 1, rank+rope)"),
    _d("sglang.host.mla.page_first_direct", "B,L,N,H,C", "shared", "model", None,
       "MLA (pages, L, page_size, 1, rank+rope)"),
    # LMCache memory objects (memory_management.MemoryFormat); D = H*C.
    _d("lmcache.KV_2LTD", "KV,L,T,H*C", "split", "model", None, "KV_2LTD [2, L, T, H*D]"),
    _d("lmcache.KV_T2D", "T,KV,H*C", "split", "layer", None, "KV_T2D [T, 2, H*D], one object per layer"),
    _d("lmcache.KV_2TD", "KV,T,H*C", "split", "layer", None, "KV_2TD [2, T, H*D], one object per layer"),
    _d("lmcache.KV_MLA_FMT", "KV,L,T,C", "shared", "model", None, "KV_MLA_FMT [1, L, T, rank+rope]"),
    # NVIDIA Dynamo KVBM (block_manager/layout.rs); inner = H*C.
    _d("dynamo.fully_contiguous", "B,L,KV,N,H*C", "split", "model", None,
       "FullyContiguous [blocks, layers, outer=2, page, inner]"),
    _d("dynamo.layer_separate", "B,KV,N,H*C", "split", "layer", None,
       "LayerSeparate, outer_contiguous=false: per layer [blocks, outer, page, inner]"),
    _d("dynamo.layer_separate_outer", "KV,B,N,H*C", "split", "layer", None,
       "LayerSeparate, outer_contiguous=true: per layer [outer, blocks, page, inner]"),
    # kvwire's own page-major layouts (the offload ring): a block of all layers, heads outer.
    _d("kvwire.page", "B,L,KV,H,N,C", "split", "model", None,
       "offload ring pages (pages, L, 2, H, page_tokens, C): a page-sized chunk is a view"),
    _d("kvwire.page.mla", "B,L,H,N,C", "shared", "model", None,
       "offload ring pages, MLA (pages, L, 1, page_tokens, rank+rope)"),
)}


def get_layout(name) -> LayoutDescriptor:
    """The descriptor registered under ``name`` (a descriptor is returned as is)."""
    if isinstance(name, LayoutDescriptor):
        return name
    if not isinstance(name, str):
        raise TypeError(f"a layout is a registered name or a LayoutDescriptor, not {type(name).__name__}; "
                        f"registered: {', '.join(sorted(LAYOUTS))}")
    if name not in LAYOUTS:
        raise ValueError(f"unknown layout {name!r}; registered: {', '.join(sorted(LAYOUTS))}")
    return LAYOUTS[name]


def layout_names() -> list[str]:
    return sorted(LAYOUTS)
