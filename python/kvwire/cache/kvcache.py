"""``KVCache``: a whole cache in the canonical tensor layout, the unit users encode and load.

Each stored layer maps component name ("k", "v" or "latent") to one tensor of shape
[heads, tokens, head_dim] (the canonical body layout, KVW-CHUNK-4), where tokens is the
layer's own token count (a sliding-window layer may hold fewer than a full one).
A state layer (SSM / linear attention, spec/crossmodel.md) maps "state" to
``{name: tensor}``, each tensor in the shape and dtype its ``StateTensor`` declares.
Tensors may be numpy arrays or torch tensors; the header says what they mean. An fp8 cache
with per-layer scales (``Header.kv_scales``, spec section 5.10) holds the stored fp8
elements; ``dequantize`` gives the values they stand for (KVW-SCALE-6).

Two caches compare with ``==`` by content, bit for bit (``equal``); ``to_dict``/``from_dict``
use the flat ``{"layers.<i>.<component>": tensor}`` naming of safetensors files.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..format import registry as R
from ..format.chunks import PlannedChunk, chunk_plan
from ..format.header import Architecture, Header, LayerSpec, ModelIdentity, TokenRange
from ..format.kv_scales import KVScale, check_float_dtype, dequantize_array, scales_of, writer_header
from .args import check_device, resolve_dtype
from .tensors import as_numpy, as_uint, dtype_name, is_torch, torch_dtype

FLOAT_DTYPES = ("bf16", "f16", "f32", "f8_e4m3fn", "f8_e5m2", "f8_e4m3fnuz")
_DICT_NAME = re.compile(r"layers\.(0|[1-9][0-9]*)\.(k|v)")


class KVCache:
    """A dense KV cache: a ``Header`` and, per layer, its components' tensors in the
    canonical tensor layout [heads, tokens, head_dim] (numpy arrays or torch tensors).

    Build one from per-layer tensors with ``KVCache.from_tensors(keys, values)``; write it
    with ``kvwire.save`` / ``kvwire.encode`` and get it back with ``kvwire.load``.
    """

    __slots__ = ("header", "layers")

    def __init__(self, header: Header, layers: Sequence[Mapping[str, Any]]):
        if not isinstance(header, Header):
            raise TypeError(f"header must be a kvwire.Header, not {type(header).__name__} (KVCache.from_tensors "
                            "builds one from per-layer K and V tensors)")
        if isinstance(layers, (str, bytes, Mapping)) or not isinstance(layers, Sequence):
            raise TypeError(f"layers must be a sequence of {{component: tensor}} mappings, one per layer, not "
                            f"{type(layers).__name__}")
        bad = next((i for i, layer in enumerate(layers) if not isinstance(layer, Mapping)), None)
        if bad is not None:
            raise TypeError(f"layer {bad} must be a {{component: tensor}} mapping, not {type(layers[bad]).__name__}")
        if len(layers) != header.num_layers:
            raise ValueError(f"{len(layers)} layers given, header describes {header.num_layers}")
        for i, (spec, r, layer) in enumerate(zip(header.arch.layers, header.layer_tokens, layers)):
            if set(layer) != set(spec.components):
                raise ValueError(f"layer {i} ({spec.kind}) needs components {spec.components}, got {tuple(layer)}")
            if spec.kind == "state":  # {"state": {name: tensor}}, each in its declared shape and dtype
                check_state_tensors(spec, i, layer["state"], header.token_count)
                continue
            for comp, x in layer.items():
                want = spec.shape(comp, r.count)
                if tuple(x.shape) != want:
                    raise ValueError(f"layer {i} {comp}: shape {tuple(x.shape)}, header implies {want}")
                if dtype_name(x) != header.dtype:
                    raise ValueError(f"layer {i} {comp}: dtype {dtype_name(x)}, header says {header.dtype}")
        self.header = header
        self.layers = [dict(layer) for layer in layers]

    @classmethod
    def from_tensors(
        cls,
        keys: Sequence,
        values: Sequence,
        *,
        model: ModelIdentity | None = None,
        first_position: int = 0,
        metadata: Mapping[str, bytes] | None = None,
        **header_fields: Any,
    ) -> KVCache:
        """A cache of full-attention layers from per-layer K and V tensors [heads, tokens, head_dim].

        Layers may differ in head count, head dims and token count (a layer with fewer
        tokens holds the most recent ones, as a sliding-window layer does).
        """
        if any(isinstance(x, (str, bytes, Mapping)) or not isinstance(x, Sequence) for x in (keys, values)):
            raise TypeError("keys and values must be sequences (one tensor per layer) of numpy arrays or torch "
                            "tensors [heads, tokens, head_dim]")
        if len(keys) != len(values) or not keys:
            raise ValueError("need the same, non-zero number of key and value tensors")
        bad = next((i for i, x in enumerate((*keys, *values)) if not hasattr(x, "shape") or not hasattr(x, "ndim")), None)
        if bad is not None:
            x = (*keys, *values)[bad]
            raise TypeError(f"{'keys' if bad < len(keys) else 'values'}[{bad % len(keys)}] is a {type(x).__name__}, "
                            "not a numpy array or torch tensor [heads, tokens, head_dim]")
        specs, ranges = [], []
        token_count = max(int(k.shape[1]) for k in keys)
        for i, (k, v) in enumerate(zip(keys, values)):
            if k.ndim != 3 or v.ndim != 3 or k.shape[:2] != v.shape[:2]:
                raise ValueError(f"layer {i}: keys {tuple(k.shape)} and values {tuple(v.shape)} must be "
                                 "[heads, tokens, head_dim] with equal heads and tokens")
            specs.append(LayerSpec("full_attention", int(k.shape[0]), int(k.shape[2]), int(v.shape[2])))
            ranges.append(TokenRange(token_count - int(k.shape[1]), int(k.shape[1])))
        header = Header(
            arch=Architecture(tuple(specs)),
            token_count=token_count,
            dtype=dtype_name(keys[0]),
            first_position=first_position,
            layer_tokens=tuple(ranges),
            model=model or ModelIdentity(),
            metadata=dict(metadata or {}),
            **header_fields,
        )
        return cls(header, [{"k": k, "v": v} for k, v in zip(keys, values)])

    @property
    def num_layers(self) -> int:
        return self.header.num_layers

    @property
    def keys(self) -> LayerTensors:
        """The K tensor of every layer, a sequence: ``cache.keys[i]`` (``cache.keys(i)``, the
        older call form, still works); None for a layer without K (MLA, state, shared)."""
        return LayerTensors(self, "k")

    @property
    def values(self) -> LayerTensors:
        """The V tensor of every layer, as ``keys``."""
        return LayerTensors(self, "v")

    def state(self, layer: int) -> dict:
        """{name: tensor} of a state layer (spec/crossmodel.md); empty for other layers."""
        return self.layers[layer].get("state", {})

    @property
    def kv_scales(self) -> tuple[KVScale, ...] | None:
        """Per-layer scales of an fp8 cache (``Header.kv_scales``, spec 5.10); None when unscaled."""
        return self.header.kv_scales

    def layer_scales(self, layer: int) -> KVScale:
        """(``k_scale``, ``v_scale``) of a layer's own tensors; 1.0 and 1.0 without ``kv_scales``."""
        return scales_of(self.header, layer)

    def dequantize_layer(self, layer: int, *, dtype: str = "f32") -> dict:
        """{component: numpy array} of one layer's values (KVW-SCALE-6): the stored elements times
        the layer's scales in binary32 (K and LATENT by ``k_scale``, V by ``v_scale``), rounded to
        ``dtype`` ("f32", "bf16" or "f16"; "float32", torch/numpy dtypes too). A state layer's
        tensors are returned unscaled."""
        dtype = resolve_dtype(dtype)
        check_float_dtype(dtype)
        s = self.layer_scales(layer)
        return {c: ({n: as_numpy(t) for n, t in x.items()} if c == "state" else
                    dequantize_array(as_numpy(x), s.v_scale if c == "v" else s.k_scale, dtype))
                for c, x in self.layers[layer].items()}

    def dequantize(self, dtype: str = "f32") -> KVCache:
        """The same cache as values of ``dtype`` ("f32", "bf16" or "f16") without scales: what an
        engine that does not attend in this fp8 format loads (KVW-SCALE-7, crossmodel.md KVW-XM-10).
        Every K/V/LATENT tensor is ``dequantize_layer``'s; the header loses ``kv_scales`` (its bit
        and ``format_minor`` follow, KVW-EVOL-12)."""
        dtype = resolve_dtype(dtype)
        check_float_dtype(dtype)
        header = writer_header(replace(self.header, dtype=dtype, kv_scales=None))
        return KVCache(header, [self.dequantize_layer(i, dtype=dtype) for i in range(self.num_layers)])

    def astype(self, dtype: Any) -> KVCache:
        """The cache with every K/V/LATENT tensor cast to ``dtype`` (a name such as "float32"
        or "bf16", a numpy or torch dtype; floating-point types only): numpy's / torch's own
        cast, rounding to nearest-even, so bf16 -> f32 -> bf16 gives back the same bits.
        State tensors keep their declared dtypes; an fp8 cache with per-layer scales is
        refused (its elements mean element * scale: ``dequantize`` is the cast for it).
        ``self`` when the dtype is already ``dtype``."""
        name = resolve_dtype(dtype)
        if name not in FLOAT_DTYPES:
            raise ValueError(f"astype casts to a floating-point dtype ({', '.join(FLOAT_DTYPES)}), not {name}")
        if name == self.header.dtype:
            return self
        if self.header.kv_scales is not None:
            raise ValueError("this fp8 cache has per-layer scales (Header.kv_scales): cache.dequantize(dtype) gives "
                             "the values they stand for; a plain cast would drop the scales")

        def cast(x):
            return x.to(torch_dtype(name)) if is_torch(x) else as_numpy(x).astype(R.DTYPES[name][2])

        return KVCache(replace(self.header, dtype=name),
                       [{c: (x if c == "state" else cast(x)) for c, x in layer.items()} for layer in self.layers])

    @property
    def backend(self) -> str:
        """"torch" when any tensor is a torch tensor, else "numpy"."""
        return "torch" if any(is_torch(x) for layer in self.layers for _, x in layer_tensors(layer)) else "numpy"

    def to(self, device: Any) -> KVCache:
        """The cache with every tensor on ``device`` ("cpu", "cuda", "cuda:1", a torch.device),
        as ``torch.Tensor.to`` (a tensor already there is not copied). A numpy cache lives on
        the CPU: ``"cpu"`` returns it, any other device is a ValueError (load it with
        ``kvwire.load(path, device=...)`` for torch tensors). Dtypes: ``astype``."""
        try:
            resolve_dtype(device)
        except (TypeError, ValueError):
            pass
        else:
            raise TypeError(f"to() takes a device; for a dtype ({device!r}) use cache.astype(...)")
        if self.backend == "numpy":
            if str(device).split(":")[0] != "cpu":
                raise ValueError(f"a numpy-backed cache lives on the CPU: to('cpu') only, not {device!r}; for "
                                 f"torch tensors on {device!r} use kvwire.load(source, device={str(device)!r})")
            return self
        check_device(device)

        def move(x):
            if not is_torch(x):  # a numpy array in a torch cache: a torch tensor over the same memory first
                import torch

                a = as_numpy(x)
                x = torch.from_numpy(as_uint(a.copy() if not a.flags.c_contiguous else a)).view(torch_dtype(dtype_name(a)))
            return x.to(device)

        return KVCache(self.header, [{c: ({n: move(t) for n, t in x.items()} if c == "state" else move(x))
                                      for c, x in layer.items()} for layer in self.layers])

    def to_dict(self) -> dict:
        """``{"layers.<i>.<component>": tensor}`` of every tensor (state tensors:
        ``"layers.<i>.state.<name>"``), each [heads, tokens, head_dim], no copies: the flat
        form safetensors files hold (``safetensors.numpy.save_file(cache.to_dict(), path)``).
        The header is not in it: ``from_dict`` rebuilds a full-attention one."""
        return {f"layers.{i}.{name}": x for i, layer in enumerate(self.layers) for name, x in layer_tensors(layer)}

    @classmethod
    def from_dict(cls, tensors: Mapping, **from_tensors_args: Any) -> KVCache:
        """A full-attention cache from ``{"layers.<i>.k": K, "layers.<i>.v": V}`` (i = 0 ... n-1,
        each [heads, tokens, head_dim]), the naming ``to_dict`` writes; keyword arguments as for
        ``from_tensors`` (``model``, ``first_position``, ``metadata``, header fields). Any other
        name is a ValueError naming it (MLA and state layers need ``KVCache(header, layers)``)."""
        if not isinstance(tensors, Mapping):
            raise TypeError(f"from_dict needs a mapping {{'layers.<i>.k'|'layers.<i>.v': tensor}}, not "
                            f"{type(tensors).__name__}")
        found, bad = {}, []
        for name, x in tensors.items():
            m = _DICT_NAME.fullmatch(name) if isinstance(name, str) else None
            if m:
                found[int(m[1]), m[2]] = x
            else:
                bad.append(name)
        n = 1 + max((i for i, _ in found), default=-1)
        missing = [f"layers.{i}.{c}" for i in range(n) for c in "kv" if (i, c) not in found]
        if bad or missing or not n:
            raise ValueError("from_dict needs 'layers.<i>.k' and 'layers.<i>.v' for i = 0 ... n-1 "
                             f"(n >= 1, full-attention layers){'; unexpected: ' + ', '.join(map(repr, bad)) if bad else ''}"
                             f"{'; missing: ' + ', '.join(missing[:8]) if missing else ''}")
        return cls.from_tensors([found[i, "k"] for i in range(n)], [found[i, "v"] for i in range(n)],
                                **from_tensors_args)

    @property
    def nbytes(self) -> int:
        return sum(as_numpy(x).nbytes for layer in self.layers for _, x in layer_tensors(layer))

    def chunk_arrays(self) -> Iterator[tuple[PlannedChunk, Any]]:
        """(PlannedChunk, array) of every chunk in canonical order (``chunk_plan``): the
        token slice [heads, tokens, dim] of a component, or a whole state tensor. A torch
        tensor is brought to the host once, not once per chunk."""
        h = self.header
        key: tuple[int, str] | None = None
        host: Any = None
        for c in chunk_plan(h):
            if c.component == "state":
                yield c, self.layers[c.layer]["state"][h.arch.layers[c.layer].state_tensors[c.head].name]
                continue
            if (c.layer, c.component) != key:
                key, host = (c.layer, c.component), as_numpy(self.layers[c.layer][c.component])
            local = c.token_start - h.layer_tokens[c.layer].start
            yield c, host[:, local : local + c.token_count, :]

    def with_header(self, **changes: Any) -> KVCache:
        """Same tensors, header fields replaced (e.g. ``chunk_tokens``, ``model``)."""
        return KVCache(replace(self.header, **changes), self.layers)

    def equal(self, other: KVCache) -> bool:
        """Bit-exact equality of header and every tensor (NaNs compare by bits, so NaN payloads
        must match too, and -0.0 != 0.0), whatever the backend or device of each side. How a
        cache was encoded is not part of it: the codec pipelines a loaded header names
        (``codec_specs``) and the feature bits and ``format_minor`` a writer derives are left out,
        so ``load(encode(c, codec="byteplane")) == c``; a lossy codec changes the bits."""
        if not isinstance(other, KVCache):
            raise TypeError(f"equal() compares two KVCache objects, not {type(other).__name__}")
        if content_header(self.header) != content_header(other.header):
            return False
        for a, b in zip(self.layers, other.layers):
            ta, tb = dict(layer_tensors(a)), dict(layer_tensors(b))
            if a.keys() != b.keys() or ta.keys() != tb.keys():
                return False
            for comp in ta:
                x, y = as_numpy(ta[comp]), as_numpy(tb[comp])
                if x.shape != y.shape or x.tobytes() != y.tobytes():
                    return False
        return True

    def __eq__(self, other) -> bool:
        """``equal``: the same header and the same bits in every tensor (never an elementwise
        array, never identity)."""
        return self.equal(other) if isinstance(other, KVCache) else NotImplemented

    # mutable tensors: equal by content, so not hashable
    __hash__ = None  # type: ignore[assignment]  # None marks it unhashable, as in typeshed

    def __repr__(self) -> str:
        h = self.header
        return (f"KVCache({h.num_layers} layers, {h.token_count} tokens, {h.dtype}, {self.backend}, "
                f"{self.nbytes / 2**20:.1f} MiB)")


class LayerTensors(Sequence):
    """One component ("k" or "v") of every layer of a cache, by layer: ``cache.keys[i]``, ``len``,
    iteration; calling it, ``cache.keys(i)``, is the same as indexing. Tensors, not copies."""

    __slots__ = ("_cache", "_component")

    def __init__(self, cache: KVCache, component: str):
        self._cache, self._component = cache, component

    def __len__(self) -> int:
        return len(self._cache.layers)

    def __getitem__(self, layer):
        if isinstance(layer, slice):
            return [self[i] for i in range(*layer.indices(len(self)))]
        return self._cache.layers[layer].get(self._component)  # list indexing: -1 is the last layer

    def __call__(self, layer: int):
        return self[layer]

    def __repr__(self) -> str:
        shapes = [tuple(x.shape) if x is not None else None for x in self]
        return f"<{self._component} of {len(self)} layers: {shapes[:4]}{' ...' if len(shapes) > 4 else ''}>"


def content_header(h: Header) -> Header:
    """``h`` without what encoding adds: codec pipelines, derived feature bits, format_minor."""
    return replace(h, codec_specs=(), required_features=0, format_minor=0)


def layer_tensors(layer: dict):
    """(name, tensor) of every tensor of a KVCache layer, state tensors included ("state.<name>")."""
    for comp, x in layer.items():
        if comp == "state":
            for name, t in x.items():
                yield f"state.{name}", t
        else:
            yield comp, x


def check_state_tensors(spec, layer: int, tensors, token_count: int) -> None:
    """A state layer holds exactly the declared tensors (none for a cache of 0 tokens), each
    in the shape and dtype its ``StateTensor`` declares (spec/crossmodel.md, KVW-STATE-*)."""
    names = {t.name for t in spec.state_tensors} if token_count else set()
    if not isinstance(tensors, dict) or set(tensors) != names:
        got = sorted(tensors) if isinstance(tensors, dict) else type(tensors).__name__
        raise ValueError(f"layer {layer} (state) needs {{name: tensor}} for {sorted(names)}, "
                         f"got {got}")
    for t in spec.state_tensors:
        if t.name not in tensors:
            continue
        x = tensors[t.name]
        if tuple(x.shape) != t.shape or dtype_name(x) != t.dtype:
            raise ValueError(f"layer {layer} state {t.name!r}: {tuple(x.shape)} {dtype_name(x)}, header declares "
                             f"{t.shape} {t.dtype}")
