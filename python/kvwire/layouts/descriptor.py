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

Two optional fields describe engines whose K and V halves lie differently:
``component_order`` gives, per component, a memory order of the dimensions that differs
from ``stride_order`` (vLLM's CPU kernels keep each block's K transposed, [C, N], and its
V as [N, C]); ``engine_view`` names the shape in which the engine hands the tensor over
when it is not ``dims`` (``"B,H,N,2*C"``: vLLM's [num_blocks, H, block_size, 2*head_size]
view, whose memory ``dims`` reinterpret). Which of these a vLLM backend uses is its
business, never a guess from the shape (spec/layouts.md 3.4, KVW-BIND-4).

Scope: ``layer`` layouts have one tensor (or one K/V pair) per layer; ``model`` layouts
have one tensor with an ``L`` axis. Addressing follows from the axes: ``block`` when the
layout is paged (B and N), ``slot`` when tokens have flat slots (T).

vLLM names say which releases they describe (``vllm.v0_9_1_to_0_22.flash_hnd``; the six
``KVCacheLayout`` views of 0.29 on are ``vllm.v0_29.X`` and friends); the names of earlier
kvwire releases are kept in ``DEPRECATED`` and bind the same layout with a warning.

This module is pure Python (no torch), so other tools can list and print layouts.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from types import FrameType

AXES = ("KV", "L", "B", "N", "T", "H", "C")
PACKINGS = ("split", "fused", "separate", "shared")
SCOPES = ("layer", "model")


@dataclass(frozen=True)
class LayoutDescriptor:
    """One engine layout: which axes each tensor dimension holds, their order in memory,
    how K and V are packed and whether one tensor holds a layer or the whole model
    (spec/layouts.md); ``get_layout(name)`` returns the registered ones."""

    name: str
    dims: tuple[tuple[str, ...], ...]  # per tensor dimension, in shape order: the axes it holds, outer first
    stride_order: tuple[int, ...]  # dimensions from outermost to innermost in memory
    packing: str
    scope: str
    description: str = ""
    # (component, memory order of the dims for that component) where it is not stride_order
    component_order: tuple[tuple[str, tuple[int, ...]], ...] = ()
    engine_view: str = ""  # the shape the engine hands over when it is not dims ("B,H,N,2*C")

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
        for comp, order in self.component_order:
            kv = [i for i, d in enumerate(self.dims) if d == ("KV",)]
            if self.packing != "split" or comp not in ("k", "v") or not kv or \
                    sorted(order) != list(range(len(self.dims))):
                raise ValueError(f"{self.name}: component_order {comp!r} {order} needs split packing (a KV "
                                 "dimension), a component 'k' or 'v' and a permutation of the dimensions")
            if order[: order.index(kv[0]) + 1] != self.stride_order[: self.stride_order.index(kv[0]) + 1]:
                raise ValueError(f"{self.name}: component_order {comp!r} may reorder only the dimensions "
                                 "inside one component (those after KV in memory)")
        if self.engine_view:
            view = self.engine_view.split(",")
            letters = {a for d in self.dims for a in d if a != "KV"}
            if any(v.removeprefix("2*") not in letters for v in view) or \
                    sum(v.startswith("2*") for v in view) != (1 if "KV" in flat else 0):
                raise ValueError(f"{self.name}: engine_view {self.engine_view!r}: the dims' axes, one of them "
                                 "doubled (2*X) for K and V")

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

    def order_of(self, component: str) -> tuple[int, ...]:
        """The memory order of the dimensions for one component (``stride_order`` unless
        ``component_order`` says otherwise)."""
        return dict(self.component_order).get(component, self.stride_order)

    @property
    def physical_axes(self) -> str:
        """Dimensions in memory order, outermost first (``"KV,B,H,N,C"`` for vLLM HND)."""
        return ",".join("*".join(self.dims[i]) for i in self.stride_order)

    def __str__(self) -> str:
        order = "" if self.stride_order == tuple(range(len(self.dims))) else f", memory {self.physical_axes}"
        for comp, o in self.component_order:
            order += f", {comp.upper()} memory {','.join('*'.join(self.dims[i]) for i in o)}"
        return f"{self.name} [{self.axes}]{order} ({self.packing}, per {self.scope})"


def _d(name: str, axes: str, packing: str, scope: str, order=None, description: str = "", **extra) -> LayoutDescriptor:
    dims = tuple(tuple(part.split("*")) for part in axes.split(","))
    return LayoutDescriptor(name, dims, tuple(order) if order else tuple(range(len(dims))), packing, scope,
                            description, **extra)


_HND5 = (0, 1, 3, 2, 4)

# vLLM >= 0.29 (RFC #42082, PR #51718): ``KVCacheLayout`` names the physical order of the
# logical [L, B, H, N, C] (``vllm/v1/kv_cache_layout.py``; value = its ``stride_order``).
KV_CACHE_LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}


def layer_view_order(kv_cache_layout: str) -> tuple[int, ...]:
    """vLLM's ``KVCacheLayout.layer_view_order``: the memory order of a per-layer [B, H, N, C] view."""
    return tuple(i - 1 for i in KV_CACHE_LAYOUTS[kv_cache_layout] if i != 0)


def _vllm_v0_29():
    """The standardised layouts of vLLM 0.29 on: per layer ``[B, H, N, C]`` views (for the
    backends that pack K and V in the content dim, C = K's head_dim then V's; MLA: H = 1,
    C = the latent) and the ``[L, B, H, N, C]`` allocation; the CPU backend's view (its
    vector kernels: per block and head, K transposed then V; spec/layouts.md 3.4)."""
    for name, order in KV_CACHE_LAYOUTS.items():
        view = layer_view_order(name)
        yield _d(f"vllm.v0_29.{name}", "B,H,N,KV*C", "fused", "layer", view,
                 f"per-layer view [num_blocks, H, block_size, 2*head_size] of KVCacheLayout.{name}")
        yield _d(f"vllm.v0_29.mla.{name}", "B,H,N,C", "shared", "layer", view,
                 f"MLA per-layer view [num_blocks, 1, block_size, rank+rope] of KVCacheLayout.{name}")
        yield _d(f"vllm.v0_29.model.{name}", "L,B,H,N,KV*C", "fused", "model", order,
                 f"the allocation of all layers [L, B, H, N, 2*head_size] of KVCacheLayout.{name}")
        yield _d(f"vllm.v0_29.model.mla.{name}", "L,B,H,N,C", "shared", "model", order,
                 f"MLA allocation of all layers [L, B, 1, N, rank+rope] of KVCacheLayout.{name}")
    yield _d("vllm.v0_29.cpu.vec", "B,H,KV,N,C", "split", "layer", None,
             "CPU_ATTN, vector kernels (ISA vec, vec16, ...): the [num_blocks, H, block_size, 2*head_size] view is "
             "per block and head K as [head_size, block_size], then V as [block_size, head_size]",
             component_order=(("k", (0, 1, 2, 4, 3)),), engine_view="B,H,N,2*C")


LAYOUTS: dict[str, LayoutDescriptor] = {d.name: d for d in (
    # vLLM: one tensor per attention layer (register_kv_caches), block ids from the block table.
    # A name says which releases it describes: vA_B_to_C_D = A.B through C.D.x (checked in the
    # released wheels, spec/layouts.md section 3.1); vA_B = from A.B on.
    _d("vllm.v0_4_3_to_0_22.flash_nhd", "KV,B,N,H,C", "split", "layer", None,
       "FlashAttention (2, num_blocks, block_size, H, D), stride order NHD (0,1,2,3,4)"),
    _d("vllm.v0_9_1_to_0_22.flash_hnd", "KV,B,N,H,C", "split", "layer", _HND5,
       "FlashAttention (2, num_blocks, block_size, H, D), stride order HND (0,1,3,2,4)"),
    _d("vllm.v0_11_1_to_0_22.cpu", "KV,B,H,N,C", "split", "layer", None,
       "CPU backend (2, num_blocks, H, block_size, D), contiguous, as its Python code indexes it (K's interior "
       "as the C++ kernels write it: not checked for these releases, spec/layouts.md 3.4)"),
    _d("vllm.v0_4_2_to_0_25.blocks_first", "B,KV,N,H,C", "split", "layer", None,
       "blocks-first (num_blocks, 2, block_size, H, D), NHD (FlashInfer; FA and Triton from 0.23 / 0.11)"),
    _d("vllm.v0_8_5_to_0_25.blocks_first_hnd", "B,KV,N,H,C", "split", "layer", _HND5,
       "blocks-first (num_blocks, 2, block_size, H, D), stride order HND (0,1,3,2,4)"),
    _d("vllm.v0_23_to_0_28.packed", "B,H,N,KV*C", "fused", "layer", None,
       "packed (num_blocks, H, block_size, 2*head_size), HND (identity): K channels then V channels"),
    _d("vllm.v0_26_to_0_28.packed_nhd", "B,H,N,KV*C", "fused", "layer", (0, 2, 1, 3),
       "packed (num_blocks, H, block_size, 2*head_size), stride order NHD (0,2,1,3)"),
    _d("vllm.v0_7_1_to_0_28.mla", "B,N,C", "shared", "layer", None,
       "MLA (num_blocks, block_size, kv_lora_rank + qk_rope_head_dim), e.g. 576"),
    *_vllm_v0_29(),
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


# Names of earlier kvwire releases -> the name of the same layout now (spec/layouts.md 3.2).
DEPRECATED: dict[str, str] = {
    "vllm.flash_nhd": "vllm.v0_4_3_to_0_22.flash_nhd",
    "vllm.flash_hnd": "vllm.v0_9_1_to_0_22.flash_hnd",
    "vllm.blocks_first": "vllm.v0_4_2_to_0_25.blocks_first",
    "vllm.blocks_first_hnd": "vllm.v0_8_5_to_0_25.blocks_first_hnd",
    "vllm.packed": "vllm.v0_23_to_0_28.packed",
    "vllm.mla": "vllm.v0_7_1_to_0_28.mla",
}


def get_layout(name) -> LayoutDescriptor:
    """The descriptor registered under ``name`` (a descriptor is returned as is).

    A deprecated name (``DEPRECATED``) warns and gives the layout it stands for under the
    old name, so what it writes in ``Header.engine_layout`` does not change (KVW-BIND-3)."""
    if isinstance(name, LayoutDescriptor):
        return name
    if not isinstance(name, str):
        raise TypeError(f"a layout is a registered name or a LayoutDescriptor, not {type(name).__name__}; "
                        f"registered: {', '.join(sorted(LAYOUTS))}")
    if name in DEPRECATED:
        new = DEPRECATED[name]
        warnings.warn(f"layout name {name!r} is deprecated: use {new!r} (the same layout; spec/layouts.md 3.2)",
                      DeprecationWarning, stacklevel=_caller_level())
        return _deprecated(name)
    if name not in LAYOUTS:
        raise ValueError(f"unknown layout {name!r}; registered: {', '.join(sorted(LAYOUTS))}")
    return LAYOUTS[name]


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside kvwire.layouts (the caller's line)."""
    here, level = os.path.dirname(__file__), 2
    f: FrameType | None = sys._getframe(2)
    while f is not None and os.path.dirname(f.f_code.co_filename) == here:
        f, level = f.f_back, level + 1
    return level


@functools.cache
def _deprecated(name: str) -> LayoutDescriptor:
    return dataclasses.replace(LAYOUTS[DEPRECATED[name]], name=name)


def layout_names() -> list[str]:
    """The registered names (deprecated ones are in ``DEPRECATED``)."""
    return sorted(LAYOUTS)


class BoundBuffers:
    """What ``EngineBuffers`` (binding.py) gives its gather and scatter mixins, declared once
    so a type checker can follow the mixins: the layout, the geometry per layer and the
    integer views of the engine's tensors."""

    layout: LayoutDescriptor
    block_size: int
    torch_dtype: Any
    device: Any
    geometry: list  # a binding.LayerGeometry per layer
    int_views: list[dict]

    if TYPE_CHECKING:
        def use_index_kernels(self) -> bool: ...
