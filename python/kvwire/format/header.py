"""The header: what a cache is, without its tensor bytes (spec sections 5-7).

``Header`` and its parts are plain frozen dataclasses so that schedulers, tests and other
languages' JSON twins deal in values, not FlatBuffers accessors. ``build_header`` turns
one into FlatBuffer bytes with the generated builders; ``parse_header`` goes the other
way through the verifying reader of ``flatbuf.py`` and then ``check_header`` applies the
semantic rules. The writer runs ``check_header`` too, so it cannot emit what a reader
would reject.

This module holds the header table (5.4-5.8), its header-wide rules and the building and
parsing that orchestrate the parts with tables of their own: ``architecture`` (6),
``engine_layout`` (5.9), ``kv_scales`` (5.10, revision 1.1), ``codec_specs``, ``sparse``
and ``crossmodel`` (companion specs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from typing import Any, NoReturn

import flatbuffers

from ..version import __version__
from . import crossmodel as XM
from . import kv_scales as KS
from . import limits as L
from . import registry as R

# "X as X": re-exported, so that every part of a Header can be imported from this module
from .architecture import Architecture as Architecture
from .architecture import LayerSpec as LayerSpec
from .architecture import RopeParams as RopeParams
from .architecture import build_architecture, check_architecture, read_architecture
from .codec_specs import build_codec_specs, check_codec_specs, read_codec_specs
from .crossmodel import PrefixChain
from .engine_layout import MAX_LAYOUT_DIMS as MAX_LAYOUT_DIMS
from .engine_layout import EngineLayout as EngineLayout
from .engine_layout import build_engine_layout, check_engine_layout, read_engine_layout
from .errors import FeatureError, FormatError, LimitError, SchemaError, VersionError
from .fbfields import SCALAR, enum_name, offset_vector, read_structs
from .fbs import Header as fbHeader
from .fbs import KeyValue as fbKV
from .fbs import LayerMapEntry as fbMap
from .fbs import ModelIdentity as fbModel
from .fbs import Producer as fbProducer
from .fbs import TokenRange as fbRange
from .flatbuf import Buffer
from .kv_scales import KVScale as KVScale
from .layer_range import layer_slice
from .sparse import SparseInfo, build_sparse, check_sparse, read_sparse

HEADER_IDENTIFIER = b"KVWH"


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


@dataclass(frozen=True)
class Header:
    """Everything about a cache except its tensor bytes (spec section 5)."""

    arch: Architecture
    token_count: int = 0
    dtype: str = "bf16"
    first_position: int = 0
    # None (the default) is replaced by default_layer_tokens(arch, token_count) on construction
    layer_tokens: tuple[TokenRange, ...] = None  # type: ignore[assignment]
    chunk_tokens: int = 256
    alignment: int = 64
    model: ModelIdentity = field(default_factory=ModelIdentity)
    producer: Producer = field(default_factory=Producer)
    layer_map: tuple[LayerMapEntry, ...] = ()
    metadata: dict[str, bytes] = field(default_factory=dict)
    checksum_algorithm: str = "xxh3_64"
    required_features: int = 0
    optional_features: int = 0
    format_major: int = R.FORMAT_MAJOR
    format_minor: int = R.FORMAT_MINOR
    engine_layout: EngineLayout | None = None
    sparse: SparseInfo | None = None  # per-(layer, kv head) token subsets (spec/sparse.md)
    codec_specs: tuple[Any, ...] = ()  # CodecSpec pipelines that chunk records name (spec/codecs.md)
    prefix: PrefixChain | None = None  # prefix hash chain (spec/crossmodel.md)
    kv_scales: tuple[KVScale, ...] | None = None  # 1.1: per-layer fp8 scales; (k, v) pairs accepted (5.10)

    def __post_init__(self) -> None:
        if self.layer_tokens is None:
            object.__setattr__(self, "layer_tokens", default_layer_tokens(self.arch, self.token_count))
        if self.kv_scales is not None:
            object.__setattr__(self, "kv_scales", KS.as_kv_scales(self.kv_scales))

    @property
    def num_layers(self) -> int:
        return self.arch.num_layers

    @property
    def itemsize(self) -> int:
        return R.DTYPES[self.dtype][1]

    def replace(self, **changes: Any) -> Header:
        if "token_count" in changes and "layer_tokens" not in changes:
            changes["layer_tokens"] = None
        return replace(self, **changes)

    def layer_slice(self, start: int, stop: int) -> Header:
        """The header of layers ``[start, stop)`` alone, every per-layer value (specs, token
        ranges, ``kv_scales``, per-layer fingerprints) sliced; no layer map (``layer_range``)."""
        sliced: Header = layer_slice(self, start, stop)
        return sliced


def default_layer_tokens(arch: Architecture, token_count: int) -> tuple[TokenRange, ...]:
    """Every stored layer holds all tokens; shared layers hold none (KVW-HDR-13)."""
    full, none = TokenRange(0, token_count), TokenRange(0, 0)
    return tuple(none if s.kind == "shared" else full for s in arch.layers)


# ---------------------------------------------------------------------------------------
# Semantic rules
# ---------------------------------------------------------------------------------------

_METADATA_KEY = re.compile(r"^[a-z0-9_\-]+(\.[A-Za-z0-9_\-]+)+$")


def _fail(code: str, rule: str, msg: str, exc: type[FormatError] = SchemaError) -> NoReturn:
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
    check_architecture(h.arch, h.itemsize, h.chunk_tokens, h.required_features)
    _check_layer_tokens(h)
    check_sparse(h)
    XM.check_state_layers(h)
    _check_layer_map(h)
    XM.check_prefix(h)
    XM.check_fingerprints(h)
    _check_metadata(h.metadata)
    check_codec_specs(h)
    KS.check_kv_scales(h)


def _check_layer_tokens(h: Header) -> None:
    if len(h.layer_tokens) != h.num_layers:
        _fail("TOKEN_RANGE_INVALID", "KVW-HDR-13", f"{len(h.layer_tokens)} layer token ranges for "
              f"{h.num_layers} layers")
    for i, (spec, r) in enumerate(zip(h.arch.layers, h.layer_tokens, strict=True)):  # lengths checked above
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


def _check_metadata(md: dict[str, bytes]) -> None:
    if len(md) > L.MAX_METADATA_ENTRIES:
        _fail("LIMIT_EXCEEDED", "KVW-LIM-1", "too many metadata entries", LimitError)
    for k, v in md.items():
        if not (isinstance(k, str) and len(k) <= 256 and _METADATA_KEY.fullmatch(k)):
            _fail("METADATA_KEY_INVALID", "KVW-META-1", f"metadata key {k!r} is not 'namespace.name'")
        if not (isinstance(v, (bytes, bytearray)) and len(v) <= L.MAX_BYTES_LENGTH):
            _fail("METADATA_VALUE_INVALID", "KVW-META-1", f"metadata value of {k!r} must be bytes of at most "
                  f"{L.MAX_BYTES_LENGTH}")


# KVW-META-3: the keys of the reserved namespace that the specifications define (store.md KVW-IDENT-5)
REQUEST_IDENTITY_KEY = "kvwire.request_identity"  # store.md KVW-IDENT-5
DEFINED_METADATA = frozenset({REQUEST_IDENTITY_KEY})


def check_writable(h: Header) -> None:
    """Rules only writers are bound by: what readers tolerate but no writer may emit."""
    check_header(h)
    if h.optional_features & ~R.KNOWN_OPTIONAL_FEATURES:
        raise ValueError(f"optional feature bits {h.optional_features:#x} are not assigned (KVW-REG-1)")
    if h.arch.schema_version != 1:
        raise ValueError("Architecture.schema_version must be 1 in format v1.0 (KVW-ARCH-9)")
    reserved = [k for k in h.metadata if k.split(".", 1)[0] == "kvwire" and k not in DEFINED_METADATA]
    if reserved:
        raise ValueError(f"metadata keys {reserved} use the reserved 'kvwire' namespace (KVW-META-3; defined: "
                         f"{', '.join(sorted(DEFINED_METADATA))})")
    KS.check_writable(h)  # kv_scales only with its bit (KVW-SCALE-1); format_minor (KVW-EVOL-12)
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


# ---------------------------------------------------------------------------------------
# FlatBuffer encoding
# ---------------------------------------------------------------------------------------

def _build_strings(b: flatbuffers.Builder, obj: Any, names: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for name in names:
        value = getattr(obj, name)
        if value:
            out[name] = b.CreateString(value) if isinstance(value, str) else b.CreateByteVector(bytes(value))
    return out


def build_header(h: Header) -> bytes:
    """Serialize a header to FlatBuffer bytes (file identifier "KVWH")."""
    check_writable(h)
    b = flatbuffers.Builder(1024)
    arch = build_architecture(b, h.arch)
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
        metadata = offset_vector(b, kvs)
    engine = build_engine_layout(b, h.engine_layout) if h.engine_layout is not None else None
    sparse = build_sparse(b, h.sparse) if h.sparse is not None else None
    codec_specs = build_codec_specs(b, h.codec_specs)
    prefix = XM.build_prefix(b, h.prefix) if h.prefix is not None else None
    kv_scales = KS.build_kv_scales(b, h.kv_scales)

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
    if kv_scales is not None:
        fbHeader.AddKvScales(b, kv_scales)
    b.Finish(fbHeader.End(b), file_identifier=HEADER_IDENTIFIER)
    return bytes(b.Output())


# ---------------------------------------------------------------------------------------
# FlatBuffer decoding (through the verifying reader)
# ---------------------------------------------------------------------------------------

def parse_header(data: bytes) -> Header:
    """Verify and decode header bytes; raises a FormatError subclass on any defect."""
    buf = Buffer(bytes(data), HEADER_IDENTIFIER, "KVW-HDR-1")
    t = buf.root()
    arch = read_architecture(t.table(6, required=True))
    producer_t, model_t = t.table(4), t.table(5)
    producer = Producer(
        *(producer_t.string(i, L.MAX_STRING_LENGTH) or "" for i in (0, 1))) if producer_t else Producer("", "")
    model = ModelIdentity()
    if model_t is not None:
        names = [f.name for f in fields(ModelIdentity)]
        # Fields 0 to 9 in id order, then 10 (14.1 step 2): explicit, not left to argument evaluation.
        values: tuple[Any, ...] = tuple(
            (model_t.string(i, L.MAX_STRING_LENGTH) or "") if i in (0, 1, 2, 7, 8)
            else (model_t.blob(i, L.MAX_BYTES_LENGTH) or b"") for i in range(len(names) - 1))
        model = ModelIdentity(**dict(zip(names[:-1], values, strict=True)),
                              fingerprint_scheme=model_t.scalar(10, SCALAR["H"], 0))
    layer_map = tuple(
        LayerMapEntry(r, tl, enum_name(R.MAP_OP_BY_CODE, op, "layer map op"))
        for r, tl, op in read_structs(t, 7, "IiB3x", L.MAX_LAYERS))
    token_count = t.scalar(12, SCALAR["I"], 0)
    ranges = read_structs(t, 13, "II", L.MAX_LAYERS)
    metadata: dict[str, bytes] = {}
    for kv in t.tables(15, L.MAX_METADATA_ENTRIES):
        key = kv.string(0, 256, required=True)
        if key in metadata:
            raise SchemaError("METADATA_KEY_DUPLICATE", f"metadata key {key!r} appears twice", rule="KVW-META-2")
        metadata[key] = kv.blob(1, L.MAX_BYTES_LENGTH) or b""
    h = Header(
        arch=arch,
        token_count=token_count,
        dtype=enum_name(R.DTYPE_BY_CODE, t.scalar(8, SCALAR["B"], 0), "dtype"),
        first_position=t.scalar(11, SCALAR["Q"], 0),
        layer_tokens=tuple(TokenRange(s, c) for s, c in ranges) if ranges else default_layer_tokens(arch, token_count),
        chunk_tokens=t.scalar(10, SCALAR["I"], 256),
        alignment=t.scalar(9, SCALAR["I"], 64),
        model=model,
        producer=producer,
        layer_map=layer_map,
        metadata=metadata,
        checksum_algorithm=enum_name(R.CHECKSUM_BY_CODE, t.scalar(14, SCALAR["B"], 0), "checksum algorithm"),
        required_features=t.scalar(2, SCALAR["Q"], 0),
        optional_features=t.scalar(3, SCALAR["Q"], 0),
        format_major=t.scalar(0, SCALAR["H"], 0),
        format_minor=t.scalar(1, SCALAR["H"], 0),
        engine_layout=read_engine_layout(t.table(16)),
        sparse=read_sparse(t.table(19)),
        codec_specs=read_codec_specs(t, t.scalar(2, SCALAR["Q"], 0)),
        prefix=XM.read_prefix(t.table(17)),
        kv_scales=KS.read_kv_scales(t, t.scalar(2, SCALAR["Q"], 0)),
    )
    check_header(h)
    return h
