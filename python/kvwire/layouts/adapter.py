"""Adapters: engine buffers in a named layout <-> chunks in kvwire's standard layout.

``EngineBuffers(layout, buffers)`` binds an engine's tensors to a descriptor and checks
them against it: number of dimensions, sizes of merged dimensions, and the memory order
(strides). A tensor is accepted either as the engine hands it over (vLLM's permuted view:
shape in ``dims`` order, strides following ``stride_order``) or as the raw allocation
(shape in memory order, contiguous); anything else is an error, never a guess. Every
(layer, component) then gets a *view* with axes (B, N, H, C) (paged) or (T, H, C) (token
slots); these views are all the rest of the code needs.

``gather_range`` returns a chunk [heads, tokens, head_dim]: a view when the tokens lie in
one block or a contiguous run of mergeable blocks, else one ``index_select`` into a
fresh tensor already in the standard layout (the one copy the hardware needs).
``scatter`` copies each decoded chunk (a view of the container bytes for raw bodies)
into the engine's buffers with one ``index_put_`` (or ``copy_`` for contiguous runs):
one copy from the received bytes to the destination, none in between. On a device the
bytes pass through the pinned staging ring of ``kvwire.cuda`` (host copy, DMA, device
scatter), layer by layer, with an event per layer.

All copies go through integer views of the elements' width, so they are bit-exact for
every dtype (NaN payloads, fp8) and use kernels every device implements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ..cache.cuda import StagingRing, host_chunk, int_view, stream_for
from ..format.header import EngineLayout, Header
from ..cache.tensors import dtype_name
from .descriptor import LayoutDescriptor, get_layout


class LayoutMismatchError(ValueError):
    """Engine buffers disagree with the named layout, or a container with the buffers."""


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


def _follows(t, order) -> bool:
    """Do ``t``'s strides put its dimensions in memory in ``order`` (outermost first)?"""
    dims = [d for d in order if t.shape[d] > 1]
    return all(t.stride(a) >= t.stride(b) * t.shape[b] for a, b in zip(dims, dims[1:]))


def _run_start(ids: np.ndarray) -> int | None:
    """The first id when ``ids`` is a consecutive increasing run, else None."""
    if len(ids) == 0:
        return None
    if len(ids) == 1 or (np.diff(ids) == 1).all():
        return int(ids[0])
    return None


def id_runs(ids: np.ndarray):
    """(index in ids, first id, length) of each maximal run of consecutive increasing ids."""
    if len(ids) == 0:
        return []
    cuts = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [len(ids)]))
    return [(int(a), int(ids[a]), int(b - a)) for a, b in zip(starts, ends)]


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


class EngineBuffers:
    """An engine's KV buffers bound to a named layout.

    ``indexed_copies``: None (default) uses index kernels on devices and strided copies
    per run on the CPU; True/False forces one (tests exercise both on the CPU).

    ``num_heads`` / ``head_dim``: needed where the layout merges heads and channels
    (LMCache ``H*C``, Dynamo ``inner``) and the tensor alone cannot tell them apart;
    elsewhere, like ``block_size``, they are checked when given (a cheap guard against a
    wrong layout name when two layouts have the same shape). For token-slot layouts
    ``block_size`` is the engine's page size, recorded in the header only.
    ``kv_lora_rank`` (MLA): how the latent splits into nope and rope parts, for headers.
    ``engine``: free text recorded in the header (e.g. ``"vllm/0.9.2"``).
    """

    def __init__(self, layout, buffers, *, num_heads: int | None = None, head_dim: int | None = None,
                 block_size: int | None = None, kv_lora_rank: int | None = None, engine: str = ""):
        import torch

        self.layout = desc = get_layout(layout)
        self.engine = engine
        self.indexed_copies: bool | None = None
        self.kv_lora_rank = kv_lora_rank
        self._sizes = {"H": num_heads, "C": head_dim}
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
                                 ("head_dim", head_dim, {g.dim_k for g in geo})):
            if want is not None and have not in (want, {want}, set()):
                raise LayoutMismatchError(f"{desc.name}: the buffers give {what} {have}, the caller said {want}: "
                                          "wrong layout name?")
        self._views = [{c: int_view(x) for c, x in v.items()} for v in views]

    # -- binding ---------------------------------------------------------------------------

    def _logical(self, t, what: str):
        """``t`` as a view with the layout's axes, merged dimensions split: (tensor, names)."""
        desc = self.layout
        n = len(desc.dims)
        if t.ndim != n:
            raise LayoutMismatchError(f"{desc.name}: {what} has {t.ndim} dimensions {tuple(t.shape)}, the layout "
                                      f"has {n} [{desc.axes}]")
        order = desc.stride_order
        ident = tuple(range(n))
        if _follows(t, order):
            pass  # the engine's view: shape in dims order, memory in stride order
        elif order != ident and _follows(t, ident):  # the raw allocation, shape in memory order
            t = t.permute(*[order.index(i) for i in range(n)])
        else:
            raise LayoutMismatchError(
                f"{desc.name}: {what} of shape {tuple(t.shape)} has strides {tuple(t.stride())}, which do not put "
                f"its dimensions in memory as [{desc.physical_axes}] (neither as the engine's view [{desc.axes}] "
                "nor as the raw allocation): wrong layout name?")
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
        return tuple(known[a] for a in group)

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
            return {"k": self._order(t.select(kv, 0), rest), "v": self._order(t.select(kv, 1), rest)}
        return {"latent": self._order(t, names)}

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
        return len(self._views)

    def view(self, layer: int, component: str):
        """The (B, N, H, C) or (T, H, C) view of one layer's component (engine dtype)."""
        return self._views[layer][component].view(self.torch_dtype)

    def engine_layout(self) -> EngineLayout:
        d = self.layout
        order = d.stride_order if d.stride_order != tuple(range(len(d.dims))) else ()
        return EngineLayout(d.name, d.axes, order, self.block_size or self.page_size or 0, self.engine)

    def tokens_capacity(self, ids) -> int:
        n = len(ids)
        return n * self.block_size if self.layout.addressing == "block" else n

    def _ids(self, ids, num_tokens: int, layer_capacity: int, *, unique: bool) -> np.ndarray:
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

    # -- gather ----------------------------------------------------------------------------

    def gather_range(self, layer: int, component: str, ids: np.ndarray, t0: int, t1: int):
        """Tokens [t0, t1) of one component as [heads, tokens, head_dim] (``ids`` already
        checked, see ``gather``): a view where the layout allows, else one copy."""
        import torch

        v = self._views[layer][component]
        n = t1 - t0
        if self.layout.addressing == "block":
            N = self.block_size
            b0, b1 = t0 // N, (t1 - 1) // N + 1
            blocks, off = ids[b0:b1], t0 - b0 * N
            run = _run_start(blocks)
            if run is not None:
                src = v[run : run + len(blocks)]
                if len(blocks) == 1:
                    return src[0, off : off + n].permute(1, 0, 2).view(self.torch_dtype)
                if src.stride(0) == src.shape[1] * src.stride(1):
                    return src.flatten(0, 1)[off : off + n].permute(1, 0, 2).view(self.torch_dtype)
            H, C = v.shape[2], v.shape[3]
            out = torch.empty((H, len(blocks) * N, C), dtype=v.dtype, device=v.device)
            o4, src4 = out.view(H, len(blocks), N, C), v.permute(2, 0, 1, 3)  # (H, B, N, C)
            if self._kernels():
                torch.index_select(src4, 1, torch.as_tensor(blocks, device=v.device), out=o4)
            else:  # strided copies per run of blocks: far faster than CPU index kernels
                for j, b, k in id_runs(blocks):
                    o4[:, j : j + k].copy_(src4[:, b : b + k])
            return out[:, off : off + n].view(self.torch_dtype)
        slots = ids[t0:t1]
        run = _run_start(slots)
        if run is not None:
            return v[run : run + n].permute(1, 0, 2).view(self.torch_dtype)
        out = torch.empty((v.shape[1], n, v.shape[2]), dtype=v.dtype, device=v.device)
        src3 = v.permute(1, 0, 2)  # (H, T, C)
        if self._kernels():
            torch.index_select(src3, 1, torch.as_tensor(slots, device=v.device), out=out)
        else:
            for j, s0, k in id_runs(slots):
                out[:, j : j + k].copy_(src3[:, s0 : s0 + k])
        return out.view(self.torch_dtype)

    def _kernels(self) -> bool:
        """Index kernels (one launch per chunk) on devices; strided copies per run on the CPU."""
        return self.indexed_copies if self.indexed_copies is not None else self.device.type != "cpu"

    def check_ids(self, ids, num_tokens: int) -> np.ndarray:
        return self._ids(ids, num_tokens, min(g.capacity for g in self.geometry), unique=False)

    def gather_layer(self, layer: int, ids, num_tokens: int) -> dict:
        """{component: [heads, num_tokens, head_dim]} of one layer."""
        a = self.check_ids(ids, num_tokens)
        return {c: self.gather_range(layer, c, a, 0, num_tokens) for c in self.geometry[layer].components}

    def gather(self, ids, num_tokens: int) -> list[dict]:
        """Every layer in the standard layout (see ``gather_range`` for views vs copies)."""
        a = self.check_ids(ids, num_tokens)
        return [{c: self.gather_range(i, c, a, 0, num_tokens) for c in g.components}
                for i, g in enumerate(self.geometry)]

    # -- scatter ---------------------------------------------------------------------------

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

    def _targets(self, a: np.ndarray, num_tokens: int, device):
        """Per token of the cache: engine (block, offset) or slot, as device index tensors."""
        import torch

        t = np.arange(num_tokens)
        if self.layout.addressing == "block":
            N = self.block_size
            return (torch.as_tensor(a[t // N], device=device), torch.as_tensor(t % N, device=device))
        return (torch.as_tensor(a, device=device),)

    def _put(self, layer: int, comp: str, a: np.ndarray, idx, t0: int, src) -> None:
        """One copy of ``src`` [H, tc, C] (integer view) to tokens [t0, t0+tc) of the engine:
        ``index_put_`` on devices, strided ``copy_`` per run of blocks/slots on the CPU."""
        dst = self._views[layer][comp]
        n = src.shape[1]
        vals = src.permute(1, 0, 2)  # (tokens, H, C): a view, never materialized
        if self.layout.addressing == "block":
            N = self.block_size
            b0, b1 = t0 // N, (t0 + n - 1) // N + 1
            if self._kernels() and _run_start(a[b0:b1]) is None:
                dst.index_put_((idx[0][t0 : t0 + n], idx[1][t0 : t0 + n]), vals)
                return
            mergeable = dst.stride(0) == dst.shape[1] * dst.stride(1)
            for j, b, k in id_runs(a[b0:b1]):
                lo, hi = max(t0, (b0 + j) * N), min(t0 + n, (b0 + j + k) * N)  # tokens of this run
                off = lo - (b0 + j) * N
                if k == 1 or mergeable:
                    dst[b : b + k].flatten(0, 1)[off : off + hi - lo].copy_(vals[lo - t0 : hi - t0])
                else:
                    for q in range(k):
                        s, e = max(lo, (b0 + j + q) * N), min(hi, (b0 + j + q + 1) * N)
                        dst[b + q, s - (b0 + j + q) * N : e - (b0 + j + q) * N].copy_(vals[s - t0 : e - t0])
            return
        slots = a[t0 : t0 + n]
        if self._kernels() and _run_start(slots) is None:
            dst.index_put_((idx[0][t0 : t0 + n],), vals)
            return
        for j, s0, k in id_runs(slots):
            dst[s0 : s0 + k].copy_(vals[j : j + k])

    def scatter(self, reader, ids, *, verify: bool = True, stream=None, ring: StagingRing | None = None,
                registered: bool = False) -> "ScatterHandle":
        """Decode ``reader``'s chunks straight into these buffers at the positions of ``ids``.

        Checks the header against the buffers first (``check_header``). CPU buffers: one
        copy per chunk, done on return. Device buffers (or an explicit ``stream``): through
        a staging ring with a device mirror, asynchronously; the handle's ``wait_layer(i)``
        and ``synchronize()`` wait for the copies.
        """
        h = reader.header
        self.check_header(h)
        capacity = min([g.capacity for s, g in zip(h.arch.layers, self.geometry) if s.kind != "shared"] or [0])
        a = self._ids(ids, h.token_count, capacity, unique=True)
        stream = (ring.stream if ring is not None else None) or stream_for(self.device, stream)
        if stream is None and self.device.type != "cpu":
            raise ValueError(f"buffers on {self.device}: pass a stream for this device type")
        idx = self._targets(a, h.token_count, self.device if stream is None else stream.device)
        if stream is None:
            for layer, spec in enumerate(h.arch.layers):
                for comp in spec.components:
                    for j in range(reader.num_chunks(layer, comp)):
                        i = reader._index(layer, comp, j)
                        c, src = host_chunk(reader, i, verify)
                        self._put(layer, comp, a, idx, c.token_start, src)
            return ScatterHandle(None, [None] * h.num_layers)
        return self._scatter_async(reader, a, idx, verify, stream, ring, registered)

    def _scatter_async(self, reader, a, idx, verify, stream, ring, registered) -> "ScatterHandle":
        h = reader.header
        recs = reader.records
        biggest = int(recs["raw_length"].max()) if len(recs) else 1
        if ring is None:
            ring = StagingRing(stream, biggest, 2, device_mirror=True)
        elif not ring.device_mirror:
            raise ValueError("scatter to a device needs a staging ring with device_mirror=True")
        ring.ensure(biggest)
        stream.wait_current()  # the engine's pending work on these buffers comes first
        events = []
        for layer, spec in enumerate(h.arch.layers):
            for comp in spec.components:
                for j in range(reader.num_chunks(layer, comp)):
                    i = reader._index(layer, comp, j)
                    if registered:
                        c, src = host_chunk(reader, i, verify)
                        slot = ring.acquire(c.raw_length)
                    else:
                        c, stored = reader._stored(i, verify)
                        slot = ring.acquire(c.raw_length)
                        host = ring.host[slot][: c.raw_length]
                        reader.decode_stored(i, c, stored, out=host.numpy())
                        src = host.view(self._views[layer][comp].dtype).view(c.shape)
                    dev = ring.device[slot][: c.raw_length].view(src.dtype).view(c.shape)

                    def work(dev=dev, src=src, layer=layer, comp=comp, t0=c.token_start):
                        dev.copy_(src, non_blocking=True)
                        self._put(layer, comp, a, idx, t0, dev)

                    ring.launch(slot, work, keep=src)
            events.append(stream.record())
        return ScatterHandle(stream, events, ring)


class ScatterHandle:
    """Completion of a scatter: one event per layer (None when already done)."""

    def __init__(self, stream, events, ring=None):
        self.stream = stream
        self.events = events
        self.ring = ring

    def done(self) -> bool:
        return all(e is None or e.query() for e in self.events)

    def wait_layer(self, layer: int) -> None:
        """Block the host until ``layer`` is in place."""
        if self.events[layer] is not None:
            self.events[layer].synchronize()

    def stream_wait_layer(self, layer: int) -> None:
        """Make the caller's current device stream wait for ``layer`` (the host goes on):
        what an engine's ``wait_for_layer_load`` needs."""
        if self.events[layer] is not None:
            self.stream.wait_event(self.events[layer])

    def synchronize(self) -> None:
        for e in self.events:
            if e is not None:
                e.synchronize()
        if self.ring is not None:
            self.ring.drain()


def slots_from_blocks(block_ids, block_size: int, num_tokens: int) -> np.ndarray:
    """Token slot ids of a paged allocator (slot = page * page_size + offset), e.g. SGLang
    with page_size > 1, for the first ``num_tokens`` tokens of ``block_ids``."""
    b = np.asarray(block_ids, dtype=np.int64)
    t = np.arange(num_tokens)
    if len(b) * block_size < num_tokens:
        raise ValueError(f"{len(b)} blocks of {block_size} hold fewer than {num_tokens} tokens")
    return b[t // block_size] * block_size + t % block_size


def bind(layout, buffers, **kw) -> EngineBuffers:
    """``EngineBuffers(layout, buffers, **kw)``."""
    return EngineBuffers(layout, buffers, **kw)
