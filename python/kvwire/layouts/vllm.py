"""vLLM 0.29 on: the layout of what vLLM hands a connector, derived so that no user names it.

From 0.29 on (checked through 0.32) vLLM allocates the layers of a KV cache group in one
int8 buffer, in the memory order of a ``KVCacheLayout`` (a permutation of the logical
``[L, B, H, N, C]``), and registers per layer a view with the logical shape
``[num_blocks, num_kv_heads, block_size, C]`` (``create_kv_cache_views`` in
``vllm/v1/kv_cache_interface.py``). The shape is the same for all six layouts; only the
strides differ, and for the block-outermost ones (B before L) a layer's view is a strided
slice of the shared buffer. Where K and V lie inside it is the attention backend's
choice (backends.py): C = K's head_size then V's for FlashAttention, Triton, FlashInfer,
Flex (``vllm.v0_29.X``), per block and head K then V of all the block's tokens for the
CPU backend (``vllm.v0_29.cpu.vec``, K transposed by its kernels); MLA: H = 1, C = the
latent. ``attn_backend=`` says which; without it the content-dim packing is assumed.

``vllm_layout_of`` reads the layout off the views' strides (and, with two layers or more,
off where the layers lie in the shared buffer), checks the sizes the caller knows from the
model, and refuses what it cannot decide (LayoutMismatchError naming what to pass), never
guessing (KVW-BIND-2). ``bind_vllm`` binds the result with those sizes as hints.
``vllm_cross_layer_view`` rebuilds the ``[L, B, H, N, C]`` tensor of all layers from the
per-layer views, which 0.29 to 0.32 hand to connectors instead of a cross-layer tensor
(their ``KVConnectorBase_V1`` has no ``register_cross_layers_kv_cache`` any more).
Plain torch tensors are enough: nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping

from .backends import cpu_layout_name, vllm_kv_packing
from .binding import EngineBuffers, LayoutMismatchError, follows
from .descriptor import KV_CACHE_LAYOUTS, LayoutDescriptor, get_layout, layer_view_order

__all__ = ["ALIASES", "bind_vllm", "kv_cache_layout_name", "vllm_cross_layer_view", "vllm_kv_packing",
           "vllm_layout_of"]

ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}  # vllm/config/cache.py _LAYOUT_COMPAT_ALIASES


def kv_cache_layout_name(value) -> str | None:
    """The ``KVCacheLayout`` name of ``value``: a name (``"BLHNC"``, legacy ``"NHD"``/``"HND"``),
    a ``KVCacheLayout`` member (anything with ``.name``), or None."""
    if value is None:
        return None
    name = getattr(value, "name", value)
    if not isinstance(name, str):
        raise TypeError(f"kv_cache_layout is a KVCacheLayout or its name, not {type(value).__name__}")
    name = ALIASES.get(name, name)
    if name not in KV_CACHE_LAYOUTS:
        raise ValueError(f"unknown kv_cache_layout {value!r}; valid: {', '.join(KV_CACHE_LAYOUTS)} "
                         f"(or {', '.join(ALIASES)})")
    return name


def _tensors(kv_caches) -> list:
    import torch

    if isinstance(kv_caches, torch.Tensor):
        return [kv_caches]
    if isinstance(kv_caches, Mapping):
        kv_caches = list(kv_caches.values())  # vLLM's dict: layer name -> view, in layer order
    ts = list(kv_caches)
    if not ts or not all(isinstance(t, torch.Tensor) for t in ts):
        raise TypeError("kv_caches: vLLM's dict of layer name -> tensor, a list of tensors, or one [L, B, H, N, C] "
                        "tensor")
    return ts


def vllm_cross_layer_view(kv_caches):
    """The ``[L, B, H, N, C]`` tensor over all layers, in their order, when the per-layer
    views are evenly spaced slices of one allocation (as vLLM 0.29 on allocates one KV
    cache group); a view of the engine memory, never a copy. LayoutMismatchError when the
    layers do not lie so (separate tensors, shared or overlaid layers, several groups)."""
    ts = _tensors(kv_caches)
    t0 = ts[0]
    if len(ts) == 1:
        return t0.unsqueeze(0)
    for i, t in enumerate(ts[1:], 1):
        if (t.shape, t.stride(), t.dtype, t.device) != (t0.shape, t0.stride(), t0.dtype, t0.device) or \
                t.untyped_storage().data_ptr() != t0.untyped_storage().data_ptr():
            raise LayoutMismatchError(f"layer {i} is not a view of layer 0's allocation with the same shape and "
                                      "strides: bind the layers one by one")
    delta = ts[1].storage_offset() - t0.storage_offset()
    if delta <= 0 or any(b.storage_offset() - a.storage_offset() != delta for a, b in zip(ts, ts[1:])):
        raise LayoutMismatchError("the layers do not lie at one constant, increasing distance in their allocation "
                                  "(shared or overlaid layers, or several KV cache groups): bind them one by one")
    return t0.as_strided((len(ts), *t0.shape), (delta, *t0.stride()), t0.storage_offset())


def _check_views(ts, heads: int, block_size: int, channels: int, num_layers: int | None) -> None:
    """Per-layer views: each vLLM's [num_blocks, heads, block_size, channels], all alike."""
    expect = (heads, block_size, channels)
    for i, t in enumerate(ts):
        if t.ndim != 4 or tuple(t.shape[1:]) != expect or t.shape != ts[0].shape:
            old = " (an older release's shape: bind it by name, spec/layouts.md 3.1)" if t.ndim != 4 else ""
            raise LayoutMismatchError(
                f"layer {i}: shape {tuple(t.shape)} is not vLLM's [num_blocks, {heads} heads, {block_size} "
                f"tokens, {channels} channels] view{old}")
    if num_layers is not None and num_layers != len(ts):
        raise LayoutMismatchError(f"{len(ts)} layers given, the caller said num_layers={num_layers}")


def _backend_layout(ts, model: bool, attn_backend: str, mla: bool, want, cpu_isa, sizes) -> LayoutDescriptor | None:
    """The layout ``attn_backend``'s packing decides (CPU_ATTN), None where the strides
    decide among the content-dim or latent layouts, LayoutMismatchError where none fits."""
    packing = vllm_kv_packing(attn_backend)
    if cpu_isa is not None and packing != "tokens":
        raise ValueError(f"cpu_isa= is for attn_backend='CPU_ATTN' (its kernels' ISA), not {attn_backend!r}")
    if (packing == "latent") != mla:
        held = "one MLA latent per token" if packing == "latent" else "K and V"
        raise LayoutMismatchError(f"attention backend {attn_backend} keeps {held}, the caller said mla={mla}")
    if packing in ("channels", "latent"):
        return None
    if packing != "tokens":
        raise LayoutMismatchError(f"attention backend {attn_backend} keeps K and V as {packing} (spec/layouts.md 3.4)"
                                  ": no registered layout describes its view")
    if model:
        raise LayoutMismatchError("CPU_ATTN: bind the per-layer views (no [L, B, H, N, C] CPU layout is registered)")
    if want is not None and want != "LBHNC":
        raise LayoutMismatchError(f"CPU_ATTN supports KVCacheLayout LBHNC only (cpu_attn.py:73-75), kv_cache_layout "
                                  f"says {want}")
    _check_views(ts, *sizes)
    name = cpu_layout_name(cpu_isa, str(ts[0].dtype).removeprefix("torch."))
    for i, t in enumerate(ts):  # the kernels' view(num_blocks, H, 2 * block_size, head_size) needs dense heads
        dense = {3: 1, 2: t.shape[3], 1: t.shape[2] * t.shape[3]}
        if not follows(t, layer_view_order("LBHNC")) or any(t.shape[d] > 1 and t.stride(d) != s
                                                             for d, s in dense.items()):
            raise LayoutMismatchError(f"layer {i}: strides {tuple(t.stride())} are not the CPU backend's LBHNC view "
                                      "(dense heads of [block_size, 2 * head_size])")
    return get_layout(name)


def vllm_layout_of(kv_caches, *, num_kv_heads: int, head_dim: int, block_size: int, mla: bool = False,
                   kv_cache_layout=None, num_layers: int | None = None, attn_backend: str | None = None,
                   cpu_isa: str | None = None) -> LayoutDescriptor:
    """The registered layout of vLLM (0.29 on) KV caches, from their shapes and strides.

    ``kv_caches``: what ``register_kv_caches`` receives (layer name -> ``[B, H, N, C]``
    view), a list of such views, or one ``[L, B, H, N, C]`` tensor (``vllm_cross_layer_view``;
    then ``num_layers`` is required). ``num_kv_heads``, ``head_dim`` (MLA: the latent,
    rank + rope) and ``block_size`` are the model's and the cache config's; they are checked
    against the shapes. ``kv_cache_layout`` (``vllm_config.cache_config.kv_cache_layout``)
    is needed only where the strides fit several layouts (one layer, H = 1, layers in
    separate tensors); when given it must agree with them.

    ``attn_backend`` (the layers' backend, ``get_name()``: "FLASH_ATTN", "CPU_ATTN", ...)
    says where K and V lie in the view (``vllm_kv_packing``, KVW-BIND-4): CPU_ATTN gives
    ``vllm.v0_29.cpu.vec`` for the kernels of ``cpu_isa`` (the layers' ``.isa``; required),
    a content-dim backend ``vllm.v0_29.X``, an MLA backend ``vllm.v0_29.mla.X`` (with
    ``mla=True``), an unknown or unregistered one a LayoutMismatchError. With
    ``attn_backend=None`` the content-dim packing (K = C[:head_dim]) is *assumed*, as
    before: right for FlashAttention, Triton, FlashInfer and Flex, wrong for the CPU
    backend, whose view has the same shape. Returns ``vllm.v0_29.[mla.]X``,
    ``vllm.v0_29.model.[mla.]X`` or ``vllm.v0_29.cpu.vec``; LayoutMismatchError otherwise,
    never a guess.
    """
    ts = _tensors(kv_caches)
    want = kv_cache_layout_name(kv_cache_layout)
    heads, channels = (1, head_dim) if mla else (num_kv_heads, 2 * head_dim)
    model = len(ts) == 1 and ts[0] is kv_caches and ts[0].ndim == 5  # one tensor, not a list of one
    if attn_backend is not None:
        desc = _backend_layout(ts, model, attn_backend, mla, want, cpu_isa, (heads, block_size, channels, num_layers))
        if desc is not None:
            return desc
    elif cpu_isa is not None:
        raise ValueError("cpu_isa= without attn_backend='CPU_ATTN': the ISA says nothing without the backend")
    if model:
        t = ts[0]
        if num_layers is None:
            raise LayoutMismatchError("one [L, B, H, N, C] tensor: pass num_layers= (its L and B sizes cannot be "
                                      "told apart otherwise, KVW-BIND-1)")
        if (t.shape[0], *t.shape[2:]) != (num_layers, heads, block_size, channels):
            raise LayoutMismatchError(f"a tensor of shape {tuple(t.shape)} is not vLLM's [L={num_layers}, B, "
                                      f"H={heads}, N={block_size}, C={channels}] (logical order)")
        fits = [k for k, order in KV_CACHE_LAYOUTS.items() if follows(t, order)]
    else:
        _check_views(ts, heads, block_size, channels, num_layers)
        fits = [k for k in KV_CACHE_LAYOUTS if all(follows(t, layer_view_order(k)) for t in ts)]
        if len(ts) > 1 and len(fits) > 1:
            try:
                whole = vllm_cross_layer_view(ts)
            except LayoutMismatchError:
                whole = None  # separate tensors: only the per-layer order can be read
            if whole is not None:
                fits = [k for k in fits if follows(whole, KV_CACHE_LAYOUTS[k])]
    if not fits:
        raise LayoutMismatchError(f"strides {tuple(ts[0].stride())} of shape {tuple(ts[0].shape)} fit no "
                                  f"KVCacheLayout ({', '.join(KV_CACHE_LAYOUTS)}): not a vLLM 0.29+ view?")
    if want is not None:
        if want not in fits:
            raise LayoutMismatchError(f"the buffers are laid out as {' or '.join(fits)}, kv_cache_layout says {want}")
        fits = [want]
    if len(fits) > 1:
        raise LayoutMismatchError(f"the strides fit KVCacheLayout {', '.join(fits)} alike: pass kv_cache_layout= "
                                  "(vllm_config.cache_config.kv_cache_layout)")
    return get_layout(f"vllm.v0_29.{'model.' if model else ''}{'mla.' if mla else ''}{fits[0]}")


def bind_vllm(kv_caches, *, num_kv_heads: int, head_dim: int, block_size: int, mla: bool = False,
              kv_cache_layout=None, num_layers: int | None = None, kv_lora_rank: int | None = None,
              engine: str = "vllm", attn_backend: str | None = None, cpu_isa: str | None = None) -> EngineBuffers:
    """``EngineBuffers`` of vLLM (0.29 on) KV caches in the layout ``vllm_layout_of`` derives
    (``attn_backend`` / ``cpu_isa``: see there; without them the content-dim packing is
    assumed), bound with the model's sizes as hints (``kv_lora_rank``: MLA's nope/rope split)."""
    desc = vllm_layout_of(kv_caches, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, mla=mla,
                          kv_cache_layout=kv_cache_layout, num_layers=num_layers, attn_backend=attn_backend,
                          cpu_isa=cpu_isa)
    ts = _tensors(kv_caches)
    buffers = ts[0] if desc.scope == "model" else ts
    return EngineBuffers(desc, buffers, num_heads=None if mla else num_kv_heads, head_dim=head_dim,
                         block_size=block_size, num_layers=num_layers if desc.scope == "model" else len(ts),
                         kv_lora_rank=kv_lora_rank, engine=engine)
