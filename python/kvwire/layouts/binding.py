"""Binding an engine's KV buffers to a named layout descriptor, and checking them.

``EngineBuffers(layout, buffers)`` binds an engine's tensors to a descriptor and checks
them against it: number of dimensions, sizes of merged dimensions, and the memory order
(strides). A tensor is accepted either as the engine hands it over (vLLM's permuted view:
shape in ``dims`` order, strides following ``stride_order``) or as the raw allocation
(shape in memory order, contiguous); anything else is an error, never a guess. Every
(layer, component) then gets a *view* with axes (B, N, H, C) (paged) or (T, H, C) (token
slots), kept as integer views of the elements' width (``int_views``); these views are all
the rest of the code needs. Block / slot ids and container headers are checked against
the bound buffers here too (``check_ids``, ``ids_within``, ``check_header``).

Copying between the views and kvwire chunks is the job of the two mixins
``EngineBuffers`` is made of: ``GatherMixin`` (gathering.py, engine -> chunks) and
``ScatterMixin`` (scattering.py, chunks -> engine).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

import numpy as np

from ..cache.cuda import int_view
from ..cache.tensors import dtype_name
from ..format.errors import Error
from ..format.header import EngineLayout, Header
from .ambiguity import needed_hints
from .descriptor import LayoutDescriptor, get_layout
from .gathering import GatherMixin
from .scattering import ScatterMixin

__all__ = ["EngineBuffers", "LayerGeometry", "LayoutMismatchError", "bind", "follows"]


class LayoutMismatchError(Error, ValueError):
    """Engine buffers disagree with the named layout, or a container with the buffers."""

    code = "ENGINE_LAYOUT_MISMATCH"


@dataclass(frozen=True)
class LayerGeometry:
    """What one engine layer holds: an MLA latent (``mla``) or K and V of ``heads`` heads."""

    mla: bool
    heads: int
    dim_k: int
    dim_v: int  # 0 for MLA
    capacity: int  # blocks (paged layouts) or token slots

    @property
    def components(self) -> tuple[str, ...]:
        return ("latent",) if self.mla else ("k", "v")

    def describe(self) -> str:
        if self.mla:
            return f"an MLA latent of {self.dim_k} channels"
        dims = f"{self.dim_k}" if self.dim_k == self.dim_v else f"{self.dim_k}/{self.dim_v}"
        return f"{self.heads} KV heads x head_dim {dims}"


def follows(t, order) -> bool:
    """Do ``t``'s strides put its dimensions in memory in ``order`` (outermost first)?"""
    dims = [d for d in order if t.shape[d] > 1]
    return all(t.stride(a) >= t.stride(b) * t.shape[b] for a, b in zip(dims, dims[1:]))


def _tensors_of(desc: LayoutDescriptor, buffers) -> list[dict]:
    """[{part: tensor}] per layer (part "kv", or "k"/"v" for separate packing); one entry
    {"model": tensor} for model-scope layouts."""
    import torch

    if desc.scope == "model":
        if not isinstance(buffers, torch.Tensor):
            raise TypeError(f"{desc.name} is one tensor for all layers; got {type(buffers).__name__}")
        return [{"model": buffers}]
    if isinstance(buffers, torch.Tensor):
        raise TypeError(f"{desc.name} has one tensor per layer: pass a list (or vLLM's dict of layer name -> "
                        "tensor), not one stacked tensor")
    if desc.packing == "separate":
        if isinstance(buffers, Mapping):
            ks, vs = buffers.get("k"), buffers.get("v")
        else:  # an SGLang MHATokenToKVPool itself
            ks, vs = getattr(buffers, "k_buffer", None), getattr(buffers, "v_buffer", None)
        if ks is None or vs is None or len(ks) != len(vs):
            raise TypeError(f"{desc.name} keeps K and V apart: pass {{'k': [per-layer tensors], 'v': [...]}} "
                            "or an object with k_buffer and v_buffer lists of equal length")
        return [{"k": k, "v": v} for k, v in zip(ks, vs)]
    if isinstance(buffers, Mapping):
        buffers = list(buffers.values())  # vLLM's kv_caches: layer name -> tensor, in layer order
    elif hasattr(buffers, "kv_buffer"):  # an SGLang MLATokenToKVPool itself
        buffers = buffers.kv_buffer
    return [{"kv": t} for t in buffers]


class EngineBuffers(GatherMixin, ScatterMixin):
    """An engine's KV buffers bound to a named layout.

    ``indexed_copies``: None (default) uses index kernels on devices and strided copies
    per run on the CPU; True/False forces one (tests exercise both on the CPU).

    ``num_heads`` / ``head_dim``: needed where the layout merges heads and channels
    (LMCache ``H*C``, Dynamo ``inner``) and the tensor alone cannot tell them apart.
    ``block_size`` / ``num_heads`` / ``num_layers``: required where another registered
    layout reads a tensor of this shape and memory order with those axes exchanged (a
    contiguous 5-D vLLM tensor is NHD or a raw HND buffer; ``ambiguity.needed_hints``),
    refused with ``LayoutMismatchError`` naming them when missing (KVW-BIND-1); every hint
    given is checked against the buffers. For token-slot layouts ``block_size`` is the
    engine's page size, recorded in the header only.
    ``kv_lora_rank`` (MLA): how the latent splits into nope and rope parts, for headers.
    ``engine``: free text recorded in the header (e.g. ``"vllm/0.9.2"``).
    """

    def __init__(self, layout, buffers, *, num_heads: int | None = None, head_dim: int | None = None,
                 block_size: int | None = None, num_layers: int | None = None, kv_lora_rank: int | None = None,
                 engine: str = ""):
        import torch

        self.layout = desc = get_layout(layout)
        self.engine = engine
        self.indexed_copies: bool | None = None
        self.kv_lora_rank = kv_lora_rank
        self._sizes = {"H": num_heads, "C": head_dim}
        self._hints = {"block_size": block_size, "num_heads": num_heads, "num_layers": num_layers}
        parts = _tensors_of(desc, buffers)
        self.tensors = parts
        views: list[dict] = []
        geo: list[LayerGeometry] = []
        block_sizes, dtypes, devices = set(), set(), set()
        for i, part in enumerate(parts):
            for name, t in part.items():
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"layer {i} {name}: expected a torch tensor, got {type(t).__name__}")
                dtypes.add(dtype_name(t))
                devices.add(t.device)
            if "model" in part:
                t, names = self._logical(part["model"], "buffer")
                lpos = names.index("L")
                for layer in range(t.shape[lpos]):
                    v = self._components(t.select(lpos, layer), names[:lpos] + names[lpos + 1 :], f"layer {layer}")
                    views.append(v)
            elif "kv" in part:
                t, names = self._logical(part["kv"], f"layer {i}")
                views.append(self._components(t, names, f"layer {i}"))
            else:
                (k, kn), (v, vn) = self._logical(part["k"], f"layer {i} k"), self._logical(part["v"], f"layer {i} v")
                views.append({"k": self._order(k, kn), "v": self._order(v, vn)})
        for i, v in enumerate(views):
            g = self._geometry(i, v)
            geo.append(g)
            if desc.addressing == "block":
                block_sizes.add(next(iter(v.values())).shape[1])
        if not views:
            raise LayoutMismatchError(f"{desc.name}: no layers given")
        if len(dtypes) != 1 or len(devices) != 1:
            raise LayoutMismatchError(f"{desc.name}: all buffers need one dtype and one device; got {sorted(dtypes)} "
                                      f"on {sorted(map(str, devices))}")
        if len(block_sizes) > 1:
            raise LayoutMismatchError(f"{desc.name}: layers have different block sizes {sorted(block_sizes)}")
        self.dtype = dtypes.pop()
        self.device = devices.pop()
        self.torch_dtype = next(iter(views[0].values())).dtype
        self.block_size = block_sizes.pop() if block_sizes else 0
        self.geometry = geo
        self.page_size = block_size if desc.addressing == "slot" else None  # recorded in the header only
        for what, want, have in (("block_size", None if self.page_size else block_size, self.block_size),
                                 ("num_heads", num_heads, {g.heads for g in geo if not g.mla}),
                                 ("num_layers", num_layers, len(geo)),
                                 ("head_dim", head_dim, {g.dim_k for g in geo})):
            if want is not None and have not in (want, {want}, set()):
                raise LayoutMismatchError(f"{desc.name}: the buffers give {what} {have}, the caller said {want}: "
                                          "wrong layout name?")
        self.int_views = [{c: int_view(x) for c, x in v.items()} for v in views]

    # -- binding ---------------------------------------------------------------------------

    def _logical(self, t, what: str):
        """``t`` as a view with the layout's axes, merged dimensions split: (tensor, names)."""
        desc = self.layout
        n = len(desc.dims)
        if desc.engine_view and t.ndim == len(desc.engine_view.split(",")) != n:
            t = self._from_engine_view(t, what)
        if t.ndim != n:
            raise LayoutMismatchError(f"{desc.name}: {what} has {t.ndim} dimensions {tuple(t.shape)}, the layout "
                                      f"has {n} [{desc.axes}]")
        order = desc.stride_order
        ident = tuple(range(n))
        raw = False
        if follows(t, order):
            pass  # the engine's view: shape in dims order, memory in stride order
        elif order != ident and follows(t, ident):  # the raw allocation, shape in memory order
            t, raw = t.permute(*[order.index(i) for i in range(n)]), True
        else:
            raise LayoutMismatchError(
                f"{desc.name}: {what} of shape {tuple(t.shape)} has strides {tuple(t.stride())}, which do not put "
                f"its dimensions in memory as [{desc.physical_axes}] (neither as the engine's view [{desc.axes}] "
                "nor as the raw allocation): wrong layout name?")
        self._check_hints(raw, t if not raw else t.permute(*order), what)
        names: list[str] = []
        dim = 0
        for group in desc.dims:
            if len(group) > 1:
                t = t.unflatten(dim, self._split(group, t.shape[dim], what))
            names += group
            dim += len(group)
        if "H" not in names:  # MLA layouts without a head axis: one latent "head"
            c = names.index("C")
            t = t.unsqueeze(c)
            names.insert(c, "H")
        return t, names

    def _from_engine_view(self, t, what: str):
        """The engine's own view (``engine_view``, e.g. vLLM's [B, H, N, 2*C] CPU view) as
        the layout's dims: the same memory, read as the engine's kernels read it (the view
        must be dense from its first reinterpreted dimension on, as the engine's ``view`` needs)."""
        desc = self.layout
        view = desc.engine_view.split(",")
        sizes = {v.removeprefix("2*"): t.shape[i] // (2 if v.startswith("2*") else 1) for i, v in enumerate(view)}
        doubled = [i for i, v in enumerate(view) if v.startswith("2*")]
        if any(t.shape[i] % 2 for i in doubled):
            raise LayoutMismatchError(f"{desc.name}: {what} {tuple(t.shape)} is not [{desc.engine_view}]: "
                                      "an odd size where K and V share a dimension")
        shape = [2 if d == ("KV",) else math.prod(sizes[a] for a in d) for d in desc.dims]
        try:
            return t.view(shape)
        except RuntimeError:
            raise LayoutMismatchError(
                f"{desc.name}: {what} of shape {tuple(t.shape)} and strides {tuple(t.stride())} cannot be read as "
                f"[{desc.axes}] (the engine's [{desc.engine_view}] view with dense rows): wrong layout name?") from None

    def _check_hints(self, raw: bool, t, what: str) -> None:
        """KVW-BIND-1: refuse a tensor that other registered layouts read with exchanged
        axes unless the caller gave the sizes that tell them apart."""
        need = needed_hints(self.layout, raw)
        missing = [k for k in self._hints if k in need and self._hints[k] is None]  # block_size, num_heads, ...
        if missing:
            others = sorted({n for k in missing for n in need[k]})
            form = "raw allocation" if raw else "view"
            raise LayoutMismatchError(
                f"{self.layout.name}: {what} {tuple(t.shape)} (as the {form}) fits {', '.join(others)} too, "
                f"with its dimensions read as other axes, and its sizes cannot say which: pass "
                f"{' and '.join(k + '=' for k in missing)} (KVW-BIND-1)")

    def _split(self, group, size: int, what: str) -> tuple[int, ...]:
        known = {a: (2 if a == "KV" else self._sizes.get(a)) for a in group}
        missing = [a for a, s in known.items() if s is None]
        prod = math.prod(s for s in known.values() if s is not None)
        if len(missing) > 1 or (len(missing) == 1 and size % prod) or (not missing and prod != size):
            need = " or ".join(f"{'num_heads' if a == 'H' else 'head_dim'}=" for a in missing) or "consistent sizes"
            raise LayoutMismatchError(f"{self.layout.name}: {what} merges {'*'.join(group)} into {size} elements: "
                                      f"pass {need}")
        if missing:
            known[missing[0]] = size // prod
        return cast("tuple[int, ...]", tuple(known[a] for a in group))  # every size is known now

    def _order(self, t, names):
        target = ["B", "N", "H", "C"] if self.layout.addressing == "block" else ["T", "H", "C"]
        extra = [a for a in names if a not in target]
        if extra:
            raise LayoutMismatchError(f"{self.layout.name}: unexpected axes {extra}")
        return t.permute(*[names.index(a) for a in target])

    def _components(self, t, names, what: str) -> dict:
        desc = self.layout
        if "KV" in names:
            kv = names.index("KV")
            want = 1 if desc.packing == "shared" else 2
            if t.shape[kv] != want:
                raise LayoutMismatchError(
                    f"{desc.name}: {what} has a KV axis of size {t.shape[kv]}, the layout needs {want} "
                    f"({'an MLA latent' if want == 1 else 'K and V'})")
            rest = names[:kv] + names[kv + 1 :]
            if want == 1:
                return {"latent": self._order(t.select(kv, 0), rest)}
            return {c: self._order(self._restride(t.select(kv, i), c, kv, what), rest)
                    for i, c in enumerate(("k", "v"))}
        return {"latent": self._order(t, names)}

    def _restride(self, x, comp: str, kv: int, what: str):
        """One component (KV selected) with its own memory order (``component_order``): the
        component's dims after KV lie densely in that order instead of the tensor's."""
        desc = self.layout
        order = desc.order_of(comp)
        if order == desc.stride_order:
            return x
        if len(desc.dims) != x.ndim + 1 or any(len(d) > 1 for d in desc.dims):
            raise LayoutMismatchError(f"{desc.name}: component_order needs unmerged dims")
        inner = [d - (d > kv) for d in order[order.index(kv) + 1 :]]  # dims of x, outermost first in memory
        dense = [d - (d > kv) for d in desc.stride_order[desc.stride_order.index(kv) + 1 :]]
        stride, want = 1, {}
        for d in reversed(dense):
            want[d], stride = stride * x.stride(dense[-1]), stride * x.shape[d]
        if any(x.stride(d) != want[d] for d in dense if x.shape[d] > 1):
            raise LayoutMismatchError(f"{desc.name}: {what} {comp.upper()} is not dense inside a block")
        strides, acc = list(x.stride()), x.stride(dense[-1])
        for d in reversed(inner):
            strides[d], acc = acc, acc * x.shape[d]
        return x.as_strided(x.shape, strides, x.storage_offset())

    def _geometry(self, i: int, v: dict) -> LayerGeometry:
        desc = self.layout
        if "latent" in v:
            x = v["latent"]
            if x.shape[-2] != 1:
                raise LayoutMismatchError(f"{desc.name}: layer {i} is an MLA latent but has {x.shape[-2]} heads")
            return LayerGeometry(True, 1, int(x.shape[-1]), 0, int(x.shape[0]))
        k, val = v["k"], v["v"]
        if k.shape[:-1] != val.shape[:-1]:
            raise LayoutMismatchError(f"{desc.name}: layer {i} K {tuple(k.shape)} and V {tuple(val.shape)} differ "
                                      "in slots or heads")
        return LayerGeometry(False, int(k.shape[-2]), int(k.shape[-1]), int(val.shape[-1]), int(k.shape[0]))

    # -- description -----------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.int_views)

    def view(self, layer: int, component: str):
        """The (B, N, H, C) or (T, H, C) view of one layer's component (engine dtype)."""
        return self.int_views[layer][component].view(self.torch_dtype)

    def engine_layout(self) -> EngineLayout:
        d = self.layout
        order = d.stride_order if d.stride_order != tuple(range(len(d.dims))) else ()
        return EngineLayout(d.name, d.axes, order, self.block_size or self.page_size or 0, self.engine)

    def tokens_capacity(self, ids) -> int:
        n = len(ids)
        return n * self.block_size if self.layout.addressing == "block" else n

    # -- checks used by gather and scatter ------------------------------------------------

    def ids_within(self, ids, num_tokens: int, layer_capacity: int, *, unique: bool) -> np.ndarray:
        """The block (paged) or slot ids of ``num_tokens`` tokens as int64, checked to lie in
        [0, ``layer_capacity``) and, when ``unique``, not to repeat (default: 0, 1, ...)."""
        N = self.block_size
        need = -(-num_tokens // N) if self.layout.addressing == "block" else num_tokens
        if ids is None:
            ids = np.arange(need)
        a = np.asarray(ids.cpu() if hasattr(ids, "cpu") else ids).astype(np.int64, copy=False).reshape(-1)
        what = "block ids" if self.layout.addressing == "block" else "slot ids"
        if len(a) < need:
            raise LayoutMismatchError(f"{num_tokens} tokens need {need} {what}, got {len(a)}")
        a = a[:need]
        if len(a) and (a.min() < 0 or a.max() >= layer_capacity):
            raise LayoutMismatchError(f"{what} outside [0, {layer_capacity}) of the engine buffers")
        if unique and len(np.unique(a)) != len(a):
            raise LayoutMismatchError(f"{what} repeat: two parts of the sequence would share engine memory")
        return a

    def use_index_kernels(self) -> bool:
        """Index kernels (one launch per chunk) on devices; strided copies per run on the CPU."""
        return self.indexed_copies if self.indexed_copies is not None else self.device.type != "cpu"

    def check_ids(self, ids, num_tokens: int) -> np.ndarray:
        return self.ids_within(ids, num_tokens, min(g.capacity for g in self.geometry), unique=False)

    def check_header(self, h: Header) -> None:
        """Raise ``LayoutMismatchError`` unless the container fits these buffers exactly."""
        name = self.layout.name
        if h.num_layers != self.num_layers:
            raise LayoutMismatchError(f"container has {h.num_layers} layers, the {name} buffers {self.num_layers}")
        if h.dtype != self.dtype:
            raise LayoutMismatchError(f"container dtype {h.dtype}, the {name} buffers hold {self.dtype}: "
                                      "convert explicitly, never by reinterpreting bytes")
        for i, (spec, g) in enumerate(zip(h.arch.layers, self.geometry)):
            if spec.kind == "shared":
                continue
            mla = spec.kind == "mla_latent"
            want = LayerGeometry(mla, spec.num_kv_heads, spec.head_dim_k, spec.head_dim_v, g.capacity)
            if want != g:
                raise LayoutMismatchError(f"layer {i}: container has {want.describe()} ({spec.kind}), the {name} "
                                          f"buffers hold {g.describe()}")


def bind(layout, buffers, **kw) -> EngineBuffers:
    """``EngineBuffers(layout, buffers, **kw)``."""
    return EngineBuffers(layout, buffers, **kw)
