"""``KVCache``: a whole cache in the standard layout, the unit users encode and load.

Each stored layer maps component name ("k", "v" or "latent") to one tensor of shape
[heads, tokens, head_dim] (the canonical body layout, KVW-CHUNK-4), where tokens is the
layer's own token count (a sliding-window layer may hold fewer than a full one).
A state layer (SSM / linear attention, spec/crossmodel.md) maps "state" to
``{name: tensor}``, each tensor in the shape and dtype its ``StateTensor`` declares.
Tensors may be numpy arrays or torch tensors; the header says what they mean. An fp8 cache
with per-layer scales (``Header.kv_scales``, spec section 5.10) holds the stored fp8
elements; ``dequantize`` gives the values they stand for (KVW-SCALE-6).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

from ..format.chunks import chunk_plan
from ..format.header import Architecture, Header, LayerSpec, ModelIdentity, TokenRange
from ..format.kv_scales import KVScale, check_float_dtype, dequantize_array, scales_of, writer_header
from .tensors import as_numpy, dtype_name, is_torch


class KVCache:
    __slots__ = ("header", "layers")

    def __init__(self, header: Header, layers: Sequence[Mapping[str, object]]):
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
        **header_fields,
    ) -> "KVCache":
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

    def keys(self, layer: int):
        return self.layers[layer].get("k")

    def values(self, layer: int):
        return self.layers[layer].get("v")

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
        ``dtype`` ("f32", "bf16" or "f16"). A state layer's tensors are returned unscaled."""
        check_float_dtype(dtype)
        s = self.layer_scales(layer)
        return {c: ({n: as_numpy(t) for n, t in x.items()} if c == "state" else
                    dequantize_array(as_numpy(x), s.v_scale if c == "v" else s.k_scale, dtype))
                for c, x in self.layers[layer].items()}

    def dequantize(self, dtype: str = "f32") -> "KVCache":
        """The same cache as values of ``dtype`` ("f32", "bf16" or "f16") without scales: what an
        engine that does not attend in this fp8 format loads (KVW-SCALE-7, crossmodel.md KVW-XM-10).
        Every K/V/LATENT tensor is ``dequantize_layer``'s; the header loses ``kv_scales`` (its bit
        and ``format_minor`` follow, KVW-EVOL-12)."""
        check_float_dtype(dtype)
        header = writer_header(replace(self.header, dtype=dtype, kv_scales=None))
        return KVCache(header, [self.dequantize_layer(i, dtype=dtype) for i in range(self.num_layers)])

    @property
    def nbytes(self) -> int:
        return sum(as_numpy(x).nbytes for layer in self.layers for _, x in layer_tensors(layer))

    def chunk_arrays(self):
        """(PlannedChunk, array) of every chunk in canonical order (``chunk_plan``): the
        token slice [heads, tokens, dim] of a component, or a whole state tensor. A torch
        tensor is brought to the host once, not once per chunk."""
        h, key, host = self.header, None, None
        for c in chunk_plan(h):
            if c.component == "state":
                yield c, self.layers[c.layer]["state"][h.arch.layers[c.layer].state_tensors[c.head].name]
                continue
            if (c.layer, c.component) != key:
                key, host = (c.layer, c.component), as_numpy(self.layers[c.layer][c.component])
            local = c.token_start - h.layer_tokens[c.layer].start
            yield c, host[:, local : local + c.token_count, :]

    def with_header(self, **changes) -> "KVCache":
        """Same tensors, header fields replaced (e.g. ``chunk_tokens``, ``model``)."""
        return KVCache(replace(self.header, **changes), self.layers)

    def equal(self, other: "KVCache") -> bool:
        """Bit-exact equality of header and every tensor (NaNs compare by bits)."""
        if self.header != other.header:
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

    def __repr__(self) -> str:
        h = self.header
        backend = "torch" if any(is_torch(x) for layer in self.layers for _, x in layer_tensors(layer)) else "numpy"
        return (f"KVCache({h.num_layers} layers, {h.token_count} tokens, {h.dtype}, {backend}, "
                f"{self.nbytes / 2**20:.1f} MiB)")


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
