"""The architecture schema: per-layer cache geometry (spec section 6).

``Architecture``, ``LayerSpec`` and ``RopeParams`` describe the producing model's layers:
their kinds and components (6.3), dimensions (6.2) and RoPE parameters (6.4). This
module holds those dataclasses, their semantic rules (KVW-ARCH-*) and their FlatBuffer
tables, written with the generated builders and read through the verifying reader.

It is separate from ``header`` because the schema stands on its own: the model layer
(identity, compatibility, RoPE re-rotation), the engine layouts and the adapters deal in
architectures without a header. ``header`` orchestrates: it calls
``check_architecture``, ``build_architecture`` and ``read_architecture`` for its
``arch`` field, and re-exports the dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

import flatbuffers

from . import crossmodel as XM
from . import limits as L
from . import registry as R
from .crossmodel import StateTensor
from .errors import FormatError, LimitError, SchemaError
from .fbfields import SCALAR, add_scalars, offset_vector, read_numbers, read_scalars, scalar_vector
from .fbs import Architecture as fbArch
from .fbs import LayerSpec as fbLayer
from .fbs import RopeParams as fbRope
from .flatbuf import Table


@dataclass(frozen=True)
class RopeParams:
    """Rotary embedding parameters, enough to re-rotate cached keys (spec 6.4)."""

    rope_type: str = "default"
    theta: float = 10000.0
    rotary_dim: int = 0
    interleaved: bool = False
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    mrope_section: tuple[int, ...] = ()
    seq_len_at_encode: int = 0
    truncate: bool = True  # yarn: correction range rounded to whole dimensions


# (attribute, field id, struct code, enum registry or None); defaults are the dataclass's,
# which equal the schema's (tests/format/test_schemas.py checks against the generated accessors).
_ROPE_SCALARS = [
    ("rope_type", 0, "B", R.ROPE_TYPES), ("theta", 1, "d", None), ("rotary_dim", 2, "I", None),
    ("interleaved", 3, "?", None), ("factor", 4, "d", None), ("original_max_position_embeddings", 5, "I", None),
    ("low_freq_factor", 6, "d", None), ("high_freq_factor", 7, "d", None), ("beta_fast", 8, "d", None),
    ("beta_slow", 9, "d", None), ("attention_factor", 10, "d", None), ("mscale", 11, "d", None),
    ("mscale_all_dim", 12, "d", None), ("seq_len_at_encode", 16, "Q", None), ("truncate", 17, "?", None),
]


@dataclass(frozen=True)
class LayerSpec:
    """Cache geometry of one layer (spec 6.2). Dimensions are per component."""

    kind: str = "full_attention"
    num_kv_heads: int = 0
    head_dim_k: int = 0
    head_dim_v: int = 0
    window: int = 0
    source_layer: int = -1
    uses_rope: bool = True
    rope: RopeParams | None = None
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    state_tensors: tuple[StateTensor, ...] = ()  # kind "state" only (spec/crossmodel.md)

    @property
    def components(self) -> tuple[str, ...]:
        return R.KIND_COMPONENTS[self.kind]

    def shape(self, component: str, tokens: int) -> tuple[int, int, int]:
        """Canonical body shape [heads, tokens, head_dim] of one component (KVW-CHUNK-4)."""
        if component == "k":
            return (self.num_kv_heads, tokens, self.head_dim_k)
        if component == "v":
            return (self.num_kv_heads, tokens, self.head_dim_v)
        return (1, tokens, self.head_dim_k)


_LAYER_SCALARS = [
    ("kind", 0, "B", R.LAYER_KINDS), ("num_kv_heads", 1, "I", None), ("head_dim_k", 2, "I", None),
    ("head_dim_v", 3, "I", None), ("window", 4, "I", None), ("source_layer", 5, "i", None),
    ("uses_rope", 6, "?", None), ("kv_lora_rank", 8, "I", None), ("qk_rope_head_dim", 9, "I", None),
]


@dataclass(frozen=True)
class Architecture:
    """Per-layer cache geometry of the producing model; ``layers[i]`` is layer i's spec."""

    layers: tuple[LayerSpec, ...]
    rope: RopeParams | None = None
    keys_post_rope: bool = True
    schema_version: int = 1

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @classmethod
    def uniform(cls, num_layers: int, num_kv_heads: int, head_dim: int, head_dim_v: int | None = None, **kw: Any) -> Architecture:
        """A model whose every layer is full attention with the same shape."""
        spec = LayerSpec("full_attention", num_kv_heads, head_dim, head_dim if head_dim_v is None else head_dim_v)
        return cls((spec,) * num_layers, **kw)


# ---------------------------------------------------------------------------------------
# Semantic rules
# ---------------------------------------------------------------------------------------

def _fail(code: str, rule: str, msg: str, exc: type[FormatError] = SchemaError) -> NoReturn:
    raise exc(code, msg, rule=rule)


def check_layer_spec(s: LayerSpec, i: int, itemsize: int, chunk_tokens: int, features: int = 0) -> None:
    """Rules of one LayerSpec that do not depend on its position (``i`` names it in messages)."""
    if s.kind not in R.LAYER_KINDS or not R.enabled_codes("layer_kind", features)[R.LAYER_KINDS[s.kind]]:
        _fail("ENUM_OUT_OF_RANGE", "KVW-HDR-10", f"layer {i} kind {s.kind!r} (a kind registered by a feature "
              "needs its required bit, KVW-EVOL-9)")
    XM.check_state_spec(s, i)
    if s.kind == "state":
        return
    if s.kind == "shared":
        if s.num_kv_heads or s.head_dim_k or s.head_dim_v or s.window or s.kv_lora_rank or s.qk_rope_head_dim:
            _fail("ARCH_INVALID", "KVW-ARCH-4", f"shared layer {i} declares dimensions or a window; its source "
                  "layer defines them")
        return
    if s.source_layer != -1:
        _fail("ARCH_INVALID", "KVW-ARCH-4", f"layer {i} is not shared but has source_layer {s.source_layer}")
    if s.kind == "mla_latent":
        if not (s.num_kv_heads == 1 and s.head_dim_v == 0 and s.kv_lora_rank >= 1
                and s.head_dim_k == s.kv_lora_rank + s.qk_rope_head_dim):
            _fail("ARCH_INVALID", "KVW-ARCH-5", f"mla_latent layer {i}: need num_kv_heads 1, head_dim_v 0, "
                  "head_dim_k = kv_lora_rank + qk_rope_head_dim")
    else:
        if s.head_dim_v < 1:
            _fail("ARCH_INVALID", "KVW-ARCH-2", f"layer {i} head_dim_v is 0")
        if s.kv_lora_rank or s.qk_rope_head_dim:
            _fail("ARCH_INVALID", "KVW-ARCH-5", f"layer {i} ({s.kind}) sets MLA fields kv_lora_rank/qk_rope_head_dim")
    if not (1 <= s.num_kv_heads <= L.MAX_HEADS and 1 <= s.head_dim_k <= L.MAX_HEAD_DIM
            and s.head_dim_v <= L.MAX_HEAD_DIM):
        _fail("ARCH_INVALID", "KVW-ARCH-2", f"layer {i} heads {s.num_kv_heads} / head dims "
              f"{s.head_dim_k},{s.head_dim_v} outside limits")
    if (s.window >= 1) != (s.kind in ("sliding_attention", "chunked_attention")):
        _fail("ARCH_INVALID", "KVW-ARCH-6", f"layer {i} ({s.kind}) window {s.window}: sliding/chunked layers "
              "need one, others must not")
    for comp in s.components:
        heads, _, dim = s.shape(comp, 1)
        if heads * dim * chunk_tokens * itemsize > L.MAX_CHUNK_RAW_LENGTH:
            _fail("LIMIT_EXCEEDED", "KVW-LIM-4", f"layer {i} {comp} chunk body would exceed "
                  f"{L.MAX_CHUNK_RAW_LENGTH} bytes", LimitError)


def check_architecture(arch: Architecture, itemsize: int, chunk_tokens: int, features: int = 0) -> None:
    """The architecture's rules (KVW-ARCH-*), given the header's dtype size, chunk_tokens
    and required feature bits; raise the first violation found."""
    n = arch.num_layers
    if not 1 <= n <= L.MAX_LAYERS:
        _fail("LIMIT_EXCEEDED" if n else "ARCH_INVALID", "KVW-ARCH-1", f"num_layers {n} outside [1, {L.MAX_LAYERS}]",
              LimitError if n else SchemaError)
    checked = set()  # by identity: decoded layers share their LayerSpec objects
    for i, s in enumerate(arch.layers):
        if id(s) not in checked:
            checked.add(id(s))
            check_layer_spec(s, i, itemsize, chunk_tokens, features)
        if s.kind == "shared":
            src = s.source_layer
            if not (0 <= src < i and arch.layers[src].kind != "shared"):
                _fail("ARCH_INVALID", "KVW-ARCH-4", f"shared layer {i} has source_layer {src}: must be an "
                      "earlier, non-shared layer")


# ---------------------------------------------------------------------------------------
# FlatBuffer encoding
# ---------------------------------------------------------------------------------------

def _build_rope(b: flatbuffers.Builder, rope: RopeParams) -> int:
    vecs = {fid: scalar_vector(b, code, getattr(rope, attr)) for attr, fid, code in
            (("short_factor", 13, "f8"), ("long_factor", 14, "f8"), ("mrope_section", 15, "u4"))
            if getattr(rope, attr)}
    fbRope.Start(b)
    add_scalars(b, rope, _ROPE_SCALARS)
    for fid, off in vecs.items():
        b.PrependUOffsetTRelativeSlot(fid, off, 0)
    end: int = fbRope.End(b)
    return end


def build_architecture(b: flatbuffers.Builder, arch: Architecture) -> int:
    """Write the Architecture table: each distinct LayerSpec and RopeParams once, layers
    mapped onto them by layer_spec_index (spec 6.1)."""
    distinct: dict[LayerSpec, int] = {}
    index = [distinct.setdefault(s, len(distinct)) for s in arch.layers]
    rope_cache: dict[RopeParams, int] = {}

    def rope_off(r: RopeParams) -> int:
        if r not in rope_cache:
            rope_cache[r] = _build_rope(b, r)
        return rope_cache[r]

    spec_offs = []
    for s in distinct:
        r = rope_off(s.rope) if s.rope is not None else None
        state = XM.build_state_tensors(b, s.state_tensors) if s.state_tensors else None
        fbLayer.Start(b)
        add_scalars(b, s, _LAYER_SCALARS)
        if r is not None:
            fbLayer.AddRope(b, r)
        if state is not None:
            fbLayer.AddStateTensors(b, state)
        spec_offs.append(fbLayer.End(b))
    specs_vec = offset_vector(b, spec_offs)
    index_vec = scalar_vector(b, "u2", index)
    arch_rope = rope_off(arch.rope) if arch.rope is not None else None
    fbArch.Start(b)
    if arch.schema_version != 1:
        fbArch.AddSchemaVersion(b, arch.schema_version)
    fbArch.AddNumLayers(b, arch.num_layers)
    fbArch.AddLayerSpecs(b, specs_vec)
    fbArch.AddLayerSpecIndex(b, index_vec)
    if arch_rope is not None:
        fbArch.AddRope(b, arch_rope)
    if not arch.keys_post_rope:
        fbArch.AddKeysPostRope(b, False)
    end: int = fbArch.End(b)
    return end


# ---------------------------------------------------------------------------------------
# FlatBuffer decoding (through the verifying reader)
# ---------------------------------------------------------------------------------------

def _read_rope(t: Table | None) -> RopeParams | None:
    """A RopeParams table. Writers share one table among layer specs (``build_architecture``
    does), so a table at a position already decoded is reused: its revisit is charged only
    as a table visit, not its factor vectors again (KVW-LIM-7)."""
    if t is None:
        return None
    key = ("rope", t.pos)
    done: RopeParams | None = t.buf.memo.get(key)
    if done is not None:
        return done
    kw = read_scalars(t, RopeParams, _ROPE_SCALARS)
    kw["short_factor"] = read_numbers(t, 13, "d", 8, L.MAX_ROPE_FACTORS)
    kw["long_factor"] = read_numbers(t, 14, "d", 8, L.MAX_ROPE_FACTORS)
    kw["mrope_section"] = read_numbers(t, 15, "I", 4, L.MAX_ROPE_FACTORS)
    rope = t.buf.memo[key] = RopeParams(**kw)
    return rope


def read_architecture(t: Table) -> Architecture:
    """Decode the Architecture table; layers mapped onto one LayerSpec share its object."""
    num_layers = t.scalar(1, SCALAR["I"], 0)
    if not 1 <= num_layers <= L.MAX_LAYERS:
        raise (LimitError if num_layers else SchemaError)("LIMIT_EXCEEDED" if num_layers else "ARCH_INVALID",
                                                          f"num_layers {num_layers} outside [1, {L.MAX_LAYERS}]",
                                                          rule="KVW-ARCH-1")
    specs = []
    for st in t.tables(2, L.MAX_LAYERS):
        kw = read_scalars(st, LayerSpec, _LAYER_SCALARS)
        kw["rope"] = _read_rope(st.table(7))
        kw["state_tensors"] = XM.read_state_tensors(st)
        specs.append(LayerSpec(**kw))
    index = read_numbers(t, 3, "H", 2, L.MAX_LAYERS)
    if len(index) != num_layers or any(i >= len(specs) for i in index):
        raise SchemaError("ARCH_INVALID", f"layer_spec_index ({len(index)} entries) does not map "
                          f"{num_layers} layers onto {len(specs)} layer specs", rule="KVW-ARCH-1")
    return Architecture(
        layers=tuple(specs[i] for i in index),
        rope=_read_rope(t.table(4)),
        keys_post_rope=t.boolean(5, True),
        schema_version=t.scalar(0, SCALAR["H"], 1),
    )
