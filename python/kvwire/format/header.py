"""The header: what a cache is, without its tensor bytes (spec sections 5-7).

``Header`` and its parts are plain frozen dataclasses so that schedulers, tests and other
languages' JSON twins deal in values, not FlatBuffers accessors. ``build_header`` turns
one into FlatBuffer bytes with the generated builders; ``parse_header`` goes the other
way through the verifying reader of ``flatbuf.py`` and then ``check_header`` applies the
semantic rules. The writer runs ``check_header`` too, so it cannot emit what a reader
would reject.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field, fields, replace

import flatbuffers

from . import limits as L
from . import registry as R
from .errors import FeatureError, LimitError, SchemaError, VersionError
from .fbs import Architecture as fbArch
from .fbs import EngineLayout as fbEngine
from .fbs import Header as fbHeader
from .fbs import KeyValue as fbKV
from .fbs import LayerMapEntry as fbMap
from .fbs import LayerSpec as fbLayer
from .fbs import ModelIdentity as fbModel
from .fbs import Producer as fbProducer
from .fbs import RopeParams as fbRope
from .fbs import TokenRange as fbRange
from .codec_specs import build_codec_specs, check_codec_specs, read_codec_specs
from .flatbuf import Buffer, Table
from .sparse import SparseInfo, build_sparse, check_sparse, read_sparse
from . import crossmodel as XM
from .crossmodel import PrefixChain, StateTensor
from ..version import __version__

HEADER_IDENTIFIER = b"KVWH"

_S = {c: struct.Struct("<" + c) for c in "BHIiQd?"}
_SLOT = {
    "B": "PrependUint8Slot",
    "H": "PrependUint16Slot",
    "I": "PrependUint32Slot",
    "i": "PrependInt32Slot",
    "Q": "PrependUint64Slot",
    "d": "PrependFloat64Slot",
    "?": "PrependBoolSlot",
}


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
# which equal the schema's (tests/test_schemas.py checks against the generated accessors).
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
    def uniform(cls, num_layers: int, num_kv_heads: int, head_dim: int, head_dim_v: int | None = None, **kw):
        """A model whose every layer is full attention with the same shape."""
        spec = LayerSpec("full_attention", num_kv_heads, head_dim, head_dim if head_dim_v is None else head_dim_v)
        return cls((spec,) * num_layers, **kw)


@dataclass(frozen=True)
class ModelIdentity:
    model_type: str = ""
    model_id: str = ""
    revision: str = ""
    config_fingerprint: bytes = b""
    tokenizer_fingerprint: bytes = b""
    weights_fingerprint: bytes = b""
    compat_fingerprint: bytes = b""
    framework: str = ""  # library that computed the KV, e.g. "transformers" (spec/crossmodel.md)
    framework_version: str = ""
    layer_weights_fingerprints: bytes = b""  # 32 bytes per layer (KVW-ID-7)
    fingerprint_scheme: int = 0  # 0: opaque (v1.0), 1: spec/crossmodel.md


@dataclass(frozen=True)
class Producer:
    library: str = "kvwire"
    version: str = __version__


@dataclass(frozen=True)
class TokenRange:
    start: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.count


@dataclass(frozen=True)
class LayerMapEntry:
    receiver_layer: int
    transmitted_layer: int
    op: str = "copy"


MAX_LAYOUT_DIMS = 64  # EngineLayout.stride_order entries (spec section 17)
_AXES = re.compile(r"^[A-Z][A-Z0-9]*(\*[A-Z][A-Z0-9]*)*(,[A-Z][A-Z0-9]*(\*[A-Z][A-Z0-9]*)*)*$")


@dataclass(frozen=True)
class EngineLayout:
    """Which engine buffer layout a cache was gathered from (spec 5.9): diagnostics only.

    ``axes`` names the engine tensor's dimensions in its shape order, comma-separated,
    with merged axes joined by ``*`` (``"KV,B,N,H,C"``, ``"KV,L,T,H*C"``); ``stride_order``
    lists the dimensions from outermost to innermost in memory (empty: shape order).
    Readers never change decoding because of it (KVW-HDR-18).
    """

    name: str = ""
    axes: str = ""
    stride_order: tuple[int, ...] = ()
    block_size: int = 0
    engine: str = ""


@dataclass(frozen=True)
class Header:
    """Everything about a cache except its tensor bytes (spec section 5)."""

    arch: Architecture
    token_count: int = 0
    dtype: str = "bf16"
    first_position: int = 0
    layer_tokens: tuple[TokenRange, ...] | None = None
    chunk_tokens: int = 256
    alignment: int = 64
    model: ModelIdentity = field(default_factory=ModelIdentity)
    producer: Producer = field(default_factory=Producer)
    layer_map: tuple[LayerMapEntry, ...] = ()
    metadata: dict = field(default_factory=dict)
    checksum_algorithm: str = "xxh3_64"
    required_features: int = 0
    optional_features: int = 0
    format_major: int = R.FORMAT_MAJOR
    format_minor: int = R.FORMAT_MINOR
    engine_layout: EngineLayout | None = None
    sparse: SparseInfo | None = None  # per-(layer, kv head) token subsets (spec/sparse.md)
    codec_specs: tuple = ()  # CodecSpec pipelines that chunk records name (spec/codecs.md)
    prefix: PrefixChain | None = None  # prefix hash chain (spec/crossmodel.md)

    def __post_init__(self):
        if self.layer_tokens is None:
            object.__setattr__(self, "layer_tokens", default_layer_tokens(self.arch, self.token_count))

    @property
    def num_layers(self) -> int:
        return self.arch.num_layers

    @property
    def itemsize(self) -> int:
        return R.DTYPES[self.dtype][1]

    def replace(self, **changes) -> "Header":
        if "token_count" in changes and "layer_tokens" not in changes:
            changes["layer_tokens"] = None
        return replace(self, **changes)


def default_layer_tokens(arch: Architecture, token_count: int) -> tuple[TokenRange, ...]:
    """Every stored layer holds all tokens; shared layers hold none (KVW-HDR-13)."""
    full, none = TokenRange(0, token_count), TokenRange(0, 0)
    return tuple(none if s.kind == "shared" else full for s in arch.layers)


# ---------------------------------------------------------------------------------------
# Semantic rules
# ---------------------------------------------------------------------------------------

_METADATA_KEY = re.compile(r"^[a-z0-9_\-]+(\.[A-Za-z0-9_\-]+)+$")


def _fail(code: str, rule: str, msg: str, exc=SchemaError):
    raise exc(code, msg, rule=rule)


def check_header(h: Header) -> None:
    """Apply the header's semantic rules; raise the first violation found.

    Runs on every open and every probe, so messages are only formatted on failure and
    per-layer rules run once per distinct LayerSpec.
    """
    if h.format_major != R.FORMAT_MAJOR:
        _fail("UNSUPPORTED_VERSION", "KVW-PRE-2", f"format major {h.format_major}, reader implements "
              f"{R.FORMAT_MAJOR}", VersionError)
    unknown = h.required_features & ~R.KNOWN_REQUIRED_FEATURES
    if unknown:
        _fail("UNSUPPORTED_FEATURE", "KVW-EVOL-3", f"required feature bits {unknown:#x} unknown", FeatureError)
    if h.dtype not in R.DTYPES:
        _fail("ENUM_OUT_OF_RANGE", "KVW-HDR-10", f"dtype {h.dtype!r}")
    if h.checksum_algorithm not in R.CHECKSUM_ALGORITHMS:
        _fail("ENUM_OUT_OF_RANGE", "KVW-HDR-10", f"checksum algorithm {h.checksum_algorithm!r}")
    a = h.alignment
    if not (L.MIN_ALIGNMENT <= a <= L.MAX_ALIGNMENT and a & (a - 1) == 0):
        _fail("BAD_ALIGNMENT", "KVW-CONV-2", f"alignment {a} is not a power of two in "
              f"[{L.MIN_ALIGNMENT}, {L.MAX_ALIGNMENT}]")
    if not 1 <= h.chunk_tokens <= L.MAX_CHUNK_TOKENS:
        _fail("BAD_CHUNK_TOKENS", "KVW-HDR-11", f"chunk_tokens {h.chunk_tokens} outside [1, {L.MAX_CHUNK_TOKENS}]")
    if h.token_count > L.MAX_TOKENS or h.first_position + h.token_count >= 1 << 63:
        _fail("LIMIT_EXCEEDED", "KVW-LIM-3", f"token_count {h.token_count} from position {h.first_position} "
              "exceeds the limits", LimitError)
    _check_arch(h.arch, h.itemsize, h.chunk_tokens, h.required_features)
    _check_layer_tokens(h)
    check_sparse(h)
    XM.check_state_layers(h)
    _check_layer_map(h)
    XM.check_prefix(h)
    XM.check_fingerprints(h)
    _check_metadata(h.metadata)
    check_codec_specs(h)


def _check_spec(s: LayerSpec, i: int, itemsize: int, chunk_tokens: int, features: int = 0) -> None:
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


def _check_arch(arch: Architecture, itemsize: int, chunk_tokens: int, features: int = 0) -> None:
    n = arch.num_layers
    if not 1 <= n <= L.MAX_LAYERS:
        _fail("LIMIT_EXCEEDED" if n else "ARCH_INVALID", "KVW-ARCH-1", f"num_layers {n} outside [1, {L.MAX_LAYERS}]",
              LimitError if n else SchemaError)
    checked = set()  # by identity: decoded layers share their LayerSpec objects
    for i, s in enumerate(arch.layers):
        if id(s) not in checked:
            checked.add(id(s))
            _check_spec(s, i, itemsize, chunk_tokens, features)
        if s.kind == "shared":
            src = s.source_layer
            if not (0 <= src < i and arch.layers[src].kind != "shared"):
                _fail("ARCH_INVALID", "KVW-ARCH-4", f"shared layer {i} has source_layer {src}: must be an "
                      "earlier, non-shared layer")


def _check_layer_tokens(h: Header) -> None:
    if len(h.layer_tokens) != h.num_layers:
        _fail("TOKEN_RANGE_INVALID", "KVW-HDR-13", f"{len(h.layer_tokens)} layer token ranges for "
              f"{h.num_layers} layers")
    for i, (spec, r) in enumerate(zip(h.arch.layers, h.layer_tokens)):
        if r.start + r.count > h.token_count:
            _fail("TOKEN_RANGE_INVALID", "KVW-HDR-13", f"layer {i} tokens [{r.start}, {r.stop}) exceed "
                  f"token_count {h.token_count}")
        if r.count and spec.kind == "shared":
            _fail("TOKEN_RANGE_INVALID", "KVW-HDR-13", f"shared layer {i} declares tokens")


def _check_layer_map(h: Header) -> None:
    seen = set()
    for e in h.layer_map:
        if e.op not in R.MAP_OPS:
            _fail("ENUM_OUT_OF_RANGE", "KVW-HDR-10", f"layer map op {e.op!r}")
        if e.receiver_layer >= L.MAX_LAYERS or e.receiver_layer in seen:
            _fail("LAYER_MAP_INVALID", "KVW-MAP-1", f"receiver layer {e.receiver_layer} out of range or mapped twice")
        seen.add(e.receiver_layer)
        if e.op in ("copy", "alias"):
            if not 0 <= e.transmitted_layer < h.num_layers:
                _fail("LAYER_MAP_INVALID", "KVW-MAP-1", f"{e.op} from transmitted layer {e.transmitted_layer} "
                      f"outside [0, {h.num_layers})")
        elif e.transmitted_layer != -1:
            _fail("LAYER_MAP_INVALID", "KVW-MAP-1", f"{e.op} entry must have transmitted_layer -1")
    XM.check_layer_map_order(h.layer_map)


def _check_metadata(md: dict) -> None:
    if len(md) > L.MAX_METADATA_ENTRIES:
        _fail("LIMIT_EXCEEDED", "KVW-LIM-1", "too many metadata entries", LimitError)
    for k, v in md.items():
        if not (isinstance(k, str) and len(k) <= 256 and _METADATA_KEY.fullmatch(k)):
            _fail("METADATA_KEY_INVALID", "KVW-META-1", f"metadata key {k!r} is not 'namespace.name'")
        if not (isinstance(v, (bytes, bytearray)) and len(v) <= L.MAX_BYTES_LENGTH):
            _fail("METADATA_VALUE_INVALID", "KVW-META-1", f"metadata value of {k!r} must be bytes of at most "
                  f"{L.MAX_BYTES_LENGTH}")


# ---------------------------------------------------------------------------------------
# FlatBuffer encoding
# ---------------------------------------------------------------------------------------

def _add_scalars(b: flatbuffers.Builder, obj, spec) -> None:
    for attr, fid, code, enum in spec:
        value = getattr(obj, attr)
        default = type(obj).__dataclass_fields__[attr].default
        if value == default:
            continue
        getattr(b, _SLOT[code])(fid, enum[value] if enum else value, None)


def _vec(b: flatbuffers.Builder, elem: str, values) -> int:
    """A vector of one scalar type, written through the builder's numpy fast path."""
    import numpy as np

    return b.CreateNumpyVector(np.asarray(values, dtype="<" + elem))


def _build_rope(b, rope: RopeParams) -> int:
    vecs = {fid: _vec(b, code, getattr(rope, attr)) for attr, fid, code in
            (("short_factor", 13, "f8"), ("long_factor", 14, "f8"), ("mrope_section", 15, "u4"))
            if getattr(rope, attr)}
    fbRope.Start(b)
    _add_scalars(b, rope, _ROPE_SCALARS)
    for fid, off in vecs.items():
        b.PrependUOffsetTRelativeSlot(fid, off, 0)
    return fbRope.End(b)


def _build_arch(b, arch: Architecture) -> int:
    distinct: dict[LayerSpec, int] = {}
    index = [distinct.setdefault(s, len(distinct)) for s in arch.layers]
    rope_cache: dict[RopeParams, int] = {}

    def rope_off(r):
        if r not in rope_cache:
            rope_cache[r] = _build_rope(b, r)
        return rope_cache[r]

    spec_offs = []
    for s in distinct:
        r = rope_off(s.rope) if s.rope is not None else None
        state = XM.build_state_tensors(b, s.state_tensors) if s.state_tensors else None
        fbLayer.Start(b)
        _add_scalars(b, s, _LAYER_SCALARS)
        if r is not None:
            fbLayer.AddRope(b, r)
        if state is not None:
            fbLayer.AddStateTensors(b, state)
        spec_offs.append(fbLayer.End(b))
    fbArch.StartLayerSpecsVector(b, len(spec_offs))
    for off in reversed(spec_offs):
        b.PrependUOffsetTRelative(off)
    specs_vec = b.EndVector()
    index_vec = _vec(b, "u2", index)
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
    return fbArch.End(b)


def _build_strings(b, obj, names) -> dict[str, int]:
    out = {}
    for name in names:
        value = getattr(obj, name)
        if value:
            out[name] = b.CreateString(value) if isinstance(value, str) else b.CreateByteVector(bytes(value))
    return out


def check_writable(h: Header) -> None:
    """Rules only writers are bound by: what readers tolerate but no writer may emit."""
    check_header(h)
    if h.optional_features & ~R.KNOWN_OPTIONAL_FEATURES:
        raise ValueError(f"optional feature bits {h.optional_features:#x} are not assigned (KVW-REG-1)")
    if h.arch.schema_version != 1:
        raise ValueError("Architecture.schema_version must be 1 in format v1.0 (KVW-ARCH-9)")
    reserved = [k for k in h.metadata if k.split(".", 1)[0] == "kvwire"]
    if reserved:
        raise ValueError(f"metadata keys {reserved} use the reserved 'kvwire' namespace (KVW-META-3)")
    if h.format_minor != R.FORMAT_MINOR:
        raise ValueError(f"this writer writes format {R.FORMAT_MAJOR}.{R.FORMAT_MINOR}")
    # what the reader's FlatBuffers checks refuse (KVW-HDR-7, KVW-LIM-1), refused before it is written
    m, p = h.model, h.producer
    for s in (p.library, p.version, m.model_type, m.model_id, m.revision):
        if "\0" in s or len(s.encode("utf-8")) > L.MAX_STRING_LENGTH:
            raise ValueError(f"string {s[:40]!r}...: no NUL, at most {L.MAX_STRING_LENGTH} UTF-8 bytes (KVW-HDR-7)")
    if h.engine_layout is not None:
        check_engine_layout(h.engine_layout)
    blobs = (m.config_fingerprint, m.tokenizer_fingerprint, m.weights_fingerprint, m.compat_fingerprint)
    ropes = [r for r in (h.arch.rope, *(s.rope for s in h.arch.layers)) if r is not None]
    if any(len(b) > L.MAX_BYTES_LENGTH for b in blobs) or any(
            len(v) > L.MAX_ROPE_FACTORS for r in ropes for v in (r.short_factor, r.long_factor, r.mrope_section)):
        raise ValueError("a fingerprint or RoPE factor list exceeds its limit (KVW-LIM-1)")
    XM.check_writable(h)


def check_engine_layout(e: EngineLayout) -> None:
    """Writer rules of the EngineLayout table (KVW-HDR-7, KVW-HDR-19, KVW-LIM-1)."""
    for s in (e.name, e.axes, e.engine):
        if not isinstance(s, str) or "\0" in s or len(s.encode("utf-8")) > L.MAX_STRING_LENGTH:
            raise ValueError(f"engine_layout string {str(s)[:40]!r}: no NUL, at most {L.MAX_STRING_LENGTH} UTF-8 "
                             "bytes (KVW-HDR-7)")
    if not 0 <= e.block_size < 1 << 32:
        raise ValueError(f"engine_layout.block_size {e.block_size} is not a u32")
    if e.axes and not _AXES.fullmatch(e.axes):
        raise ValueError(f"engine_layout.axes {e.axes!r}: comma-separated dimensions of '*'-joined upper-case "
                         "axis names, e.g. 'KV,B,N,H,C' (KVW-HDR-19)")
    order = tuple(e.stride_order)
    if len(order) > MAX_LAYOUT_DIMS:
        raise ValueError(f"engine_layout.stride_order has {len(order)} entries, limit {MAX_LAYOUT_DIMS} (KVW-LIM-1)")
    if order:
        ndims = len(e.axes.split(",")) if e.axes else -1
        if sorted(order) != list(range(ndims)):
            raise ValueError(f"engine_layout.stride_order {order} is not a permutation of the {max(ndims, 0)} "
                             "dimensions of axes (KVW-HDR-19)")


def _build_engine_layout(b, e: EngineLayout) -> int:
    strings = {fid: b.CreateString(v) for fid, v in ((0, e.name), (1, e.axes), (4, e.engine)) if v}
    order = _vec(b, "u1", e.stride_order) if e.stride_order else None
    fbEngine.Start(b)
    for fid, off in strings.items():
        b.PrependUOffsetTRelativeSlot(fid, off, 0)
    if order is not None:
        fbEngine.AddStrideOrder(b, order)
    if e.block_size:
        fbEngine.AddBlockSize(b, e.block_size)
    return fbEngine.End(b)


def build_header(h: Header) -> bytes:
    """Serialize a header to FlatBuffer bytes (file identifier "KVWH")."""
    check_writable(h)
    b = flatbuffers.Builder(1024)
    arch = _build_arch(b, h.arch)
    ps = _build_strings(b, h.producer, ("library", "version"))
    fbProducer.Start(b)
    if "library" in ps:
        fbProducer.AddLibrary(b, ps["library"])
    if "version" in ps:
        fbProducer.AddVersion(b, ps["version"])
    producer = fbProducer.End(b)
    model_fields = [f.name for f in fields(ModelIdentity)][:-1]  # field i has id i; the last is a scalar
    ms = _build_strings(b, h.model, model_fields)
    fbModel.Start(b)
    for fid, name in enumerate(model_fields):
        if name in ms:
            b.PrependUOffsetTRelativeSlot(fid, ms[name], 0)
    if h.model.fingerprint_scheme:
        fbModel.AddFingerprintScheme(b, h.model.fingerprint_scheme)
    model = fbModel.End(b)

    layer_map = None
    if h.layer_map:
        fbHeader.StartLayerMapVector(b, len(h.layer_map))
        for e in reversed(h.layer_map):
            fbMap.CreateLayerMapEntry(b, e.receiver_layer, e.transmitted_layer, R.MAP_OPS[e.op])
        layer_map = b.EndVector()
    layer_tokens = None
    if h.layer_tokens != default_layer_tokens(h.arch, h.token_count):
        fbHeader.StartLayerTokensVector(b, len(h.layer_tokens))
        for r in reversed(h.layer_tokens):
            fbRange.CreateTokenRange(b, r.start, r.count)
        layer_tokens = b.EndVector()
    metadata = None
    if h.metadata:
        kvs = []
        for key in sorted(h.metadata):
            k, v = b.CreateString(key), b.CreateByteVector(bytes(h.metadata[key]))
            fbKV.Start(b)
            fbKV.AddKey(b, k)
            fbKV.AddValue(b, v)
            kvs.append(fbKV.End(b))
        fbHeader.StartCustomMetadataVector(b, len(kvs))
        for off in reversed(kvs):
            b.PrependUOffsetTRelative(off)
        metadata = b.EndVector()
    engine = _build_engine_layout(b, h.engine_layout) if h.engine_layout is not None else None
    sparse = build_sparse(b, h.sparse) if h.sparse is not None else None
    codec_specs = build_codec_specs(b, h.codec_specs)
    prefix = XM.build_prefix(b, h.prefix) if h.prefix is not None else None

    fbHeader.Start(b)
    fbHeader.AddFormatMajor(b, h.format_major)
    fbHeader.AddFormatMinor(b, h.format_minor)
    fbHeader.AddRequiredFeatures(b, h.required_features)
    fbHeader.AddOptionalFeatures(b, h.optional_features)
    fbHeader.AddProducer(b, producer)
    fbHeader.AddModel(b, model)
    fbHeader.AddArch(b, arch)
    if layer_map is not None:
        fbHeader.AddLayerMap(b, layer_map)
    fbHeader.AddDtype(b, R.DTYPES[h.dtype][0])
    fbHeader.AddAlignment(b, h.alignment)
    fbHeader.AddChunkTokens(b, h.chunk_tokens)
    fbHeader.AddFirstPosition(b, h.first_position)
    fbHeader.AddTokenCount(b, h.token_count)
    if layer_tokens is not None:
        fbHeader.AddLayerTokens(b, layer_tokens)
    fbHeader.AddChecksumAlgorithm(b, R.CHECKSUM_ALGORITHMS[h.checksum_algorithm])
    if metadata is not None:
        fbHeader.AddCustomMetadata(b, metadata)
    if engine is not None:
        fbHeader.AddEngineLayout(b, engine)
    if sparse is not None:
        fbHeader.AddSparse(b, sparse)
    if codec_specs is not None:
        fbHeader.AddCodecSpecs(b, codec_specs)
    if prefix is not None:
        fbHeader.AddPrefix(b, prefix)
    b.Finish(fbHeader.End(b), file_identifier=HEADER_IDENTIFIER)
    return bytes(b.Output())


# ---------------------------------------------------------------------------------------
# FlatBuffer decoding (through the verifying reader)
# ---------------------------------------------------------------------------------------

def _enum(registry_by_code: dict, code: int, what: str) -> str:
    try:
        return registry_by_code[code]
    except KeyError:
        raise SchemaError("ENUM_OUT_OF_RANGE", f"{what} code {code} is not in the registry", rule="KVW-HDR-10") from None


_REVERSE = {id(reg): {v: k for k, v in reg.items()} for reg in (R.ROPE_TYPES, R.LAYER_KINDS)}


def _read_scalars(t: Table, cls, spec) -> dict:
    out = {}
    fields_ = cls.__dataclass_fields__
    for attr, fid, code, enum in spec:
        default = fields_[attr].default
        if code == "?":
            out[attr] = t.boolean(fid, default)
        elif enum is None:
            out[attr] = t.scalar(fid, _S[code], default)
        else:
            out[attr] = _enum(_REVERSE[id(enum)], t.scalar(fid, _S[code], enum[default]), attr)
    return out


def _read_numbers(t: Table, fid: int, code: str, size: int, max_count: int) -> tuple:
    v = t.vector(fid, size, size, max_count)
    if v is None:
        return ()
    start, count = v
    return struct.unpack_from(f"<{count}{code}", t.buf.data, start)


def _read_rope(t: Table | None) -> RopeParams | None:
    if t is None:
        return None
    kw = _read_scalars(t, RopeParams, _ROPE_SCALARS)
    kw["short_factor"] = _read_numbers(t, 13, "d", 8, L.MAX_ROPE_FACTORS)
    kw["long_factor"] = _read_numbers(t, 14, "d", 8, L.MAX_ROPE_FACTORS)
    kw["mrope_section"] = _read_numbers(t, 15, "I", 4, L.MAX_ROPE_FACTORS)
    return RopeParams(**kw)


def _read_arch(t: Table) -> Architecture:
    num_layers = t.scalar(1, _S["I"], 0)
    if not 1 <= num_layers <= L.MAX_LAYERS:
        raise (LimitError if num_layers else SchemaError)("LIMIT_EXCEEDED" if num_layers else "ARCH_INVALID",
                                                          f"num_layers {num_layers} outside [1, {L.MAX_LAYERS}]",
                                                          rule="KVW-ARCH-1")
    specs = []
    for st in t.tables(2, L.MAX_LAYERS):
        kw = _read_scalars(st, LayerSpec, _LAYER_SCALARS)
        kw["rope"] = _read_rope(st.table(7))
        kw["state_tensors"] = XM.read_state_tensors(st)
        specs.append(LayerSpec(**kw))
    index = _read_numbers(t, 3, "H", 2, L.MAX_LAYERS)
    if len(index) != num_layers or any(i >= len(specs) for i in index):
        raise SchemaError("ARCH_INVALID", f"layer_spec_index ({len(index)} entries) does not map "
                          f"{num_layers} layers onto {len(specs)} layer specs", rule="KVW-ARCH-1")
    return Architecture(
        layers=tuple(specs[i] for i in index),
        rope=_read_rope(t.table(4)),
        keys_post_rope=t.boolean(5, True),
        schema_version=t.scalar(0, _S["H"], 1),
    )


def _read_structs(t: Table, fid: int, fmt: str, max_count: int) -> list[tuple]:
    s = struct.Struct("<" + fmt)
    v = t.vector(fid, s.size, 4, max_count)
    if v is None:
        return []
    start, count = v
    return [s.unpack_from(t.buf.data, start + i * s.size) for i in range(count)]


def _read_engine_layout(t: Table | None) -> EngineLayout | None:
    """Verified like every table (KVW-HDR-2); its content is never judged (KVW-HDR-18)."""
    if t is None:
        return None
    return EngineLayout(
        name=t.string(0, L.MAX_STRING_LENGTH) or "",
        axes=t.string(1, L.MAX_STRING_LENGTH) or "",
        stride_order=_read_numbers(t, 2, "B", 1, MAX_LAYOUT_DIMS),
        block_size=t.scalar(3, _S["I"], 0),
        engine=t.string(4, L.MAX_STRING_LENGTH) or "",
    )


def parse_header(data: bytes) -> Header:
    """Verify and decode header bytes; raises a FormatError subclass on any defect."""
    buf = Buffer(bytes(data), HEADER_IDENTIFIER, "KVW-HDR-1")
    t = buf.root()
    arch = _read_arch(t.table(6, required=True))
    producer_t, model_t = t.table(4), t.table(5)
    producer = Producer(
        *(producer_t.string(i, L.MAX_STRING_LENGTH) or "" for i in (0, 1))) if producer_t else Producer("", "")
    model = ModelIdentity()
    if model_t is not None:
        names = [f.name for f in fields(ModelIdentity)]
        model = ModelIdentity(*(
            (model_t.string(i, L.MAX_STRING_LENGTH) or "") if i in (0, 1, 2, 7, 8)
            else (model_t.blob(i, L.MAX_BYTES_LENGTH) or b"") for i in range(len(names) - 1)),
            fingerprint_scheme=model_t.scalar(10, _S["H"], 0))
    layer_map = tuple(
        LayerMapEntry(r, tl, _enum(R.MAP_OP_BY_CODE, op, "layer map op"))
        for r, tl, op in _read_structs(t, 7, "IiB3x", L.MAX_LAYERS))
    token_count = t.scalar(12, _S["I"], 0)
    ranges = _read_structs(t, 13, "II", L.MAX_LAYERS)
    metadata = {}
    for kv in t.tables(15, L.MAX_METADATA_ENTRIES):
        key = kv.string(0, 256, required=True)
        if key in metadata:
            raise SchemaError("METADATA_KEY_DUPLICATE", f"metadata key {key!r} appears twice", rule="KVW-META-2")
        metadata[key] = kv.blob(1, L.MAX_BYTES_LENGTH) or b""
    h = Header(
        arch=arch,
        token_count=token_count,
        dtype=_enum(R.DTYPE_BY_CODE, t.scalar(8, _S["B"], 0), "dtype"),
        first_position=t.scalar(11, _S["Q"], 0),
        layer_tokens=tuple(TokenRange(s, c) for s, c in ranges) if ranges else None,
        chunk_tokens=t.scalar(10, _S["I"], 256),
        alignment=t.scalar(9, _S["I"], 64),
        model=model,
        producer=producer,
        layer_map=layer_map,
        metadata=metadata,
        checksum_algorithm=_enum(R.CHECKSUM_BY_CODE, t.scalar(14, _S["B"], 0), "checksum algorithm"),
        required_features=t.scalar(2, _S["Q"], 0),
        optional_features=t.scalar(3, _S["Q"], 0),
        format_major=t.scalar(0, _S["H"], 0),
        format_minor=t.scalar(1, _S["H"], 0),
        engine_layout=_read_engine_layout(t.table(16)),
        sparse=read_sparse(t.table(19)),
        codec_specs=read_codec_specs(t, t.scalar(2, _S["Q"], 0)),
        prefix=XM.read_prefix(t.table(17)),
    )
    check_header(h)
    return h
