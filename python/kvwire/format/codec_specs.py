"""Codec specifications (spec/codecs.md): the ``CodecSpec`` table of ``Header.codec_specs``.

A chunk record of a container with the ``codec_specs`` feature names its codec spec in
``reserved0`` (``codec_spec``): 0 for a plain ``raw``/``zstd`` body, ``i >= 1`` for
``Header.codec_specs[i - 1]``. This module holds the value type, its FlatBuffers build and
read, the header-level rules (KVW-CSPEC-*) and the record-level ones, so ``header.py``
and ``chunks.py`` only call in. It must not import ``header.py`` at import time (header
imports it).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, NoReturn

import flatbuffers
import numpy as np

from . import registry as R
from .errors import CodecError, FeatureError, LimitError, SchemaError
from .fbfields import offset_vector
from .flatbuf import Table

FEATURE_BIT = R.REQUIRED_FEATURES["codec_specs"]
ROTATION_BIT = R.REQUIRED_FEATURES["rotation"]  # revision 1.2: fields 11-13 and 3-bit codes (KVW-ROT-1)
TURBOQUANT_BIT = R.REQUIRED_FEATURES["turboquant"]  # revision 1.3: rotation 2, codebook 2 (KVW-TQ-1)
MAX_CODEC_SPECS = 4096  # KVW-CSPEC-2: codec_spec is a u16 index, 0 meaning "no spec"
MAX_GROUP_SIZE = 1 << 16  # KVW-INT-2
LOSSY = ("fp8", "int_affine")
SPEC_CODECS = ("byteplane_zstd", *LOSSY)
LOSSLESS_STAGES = ("raw", "zstd", "byteplane_zstd")
FP8_FORMATS = ("f8_e4m3fn", "f8_e5m2", "f8_e4m3fnuz")
SCALE_DTYPES = ("f16", "bf16", "f32")
FLOAT_DTYPES = ("bf16", "f16", "f32")  # header dtypes a lossy codec may decode to (KVW-CSPEC-6)
LOSSY_COMPONENTS = ("k", "v", "latent")  # KVW-CSPEC-9
INT_BITS = (2, 4, 8)
ROTATION_INT_BITS = (2, 3, 4, 8)  # with the rotation bit (KVW-ROT-2)
CODEBOOK_BITS = (2, 3, 4)  # the Gaussian codebook's tables (KVW-ROT-4)
TURBOQUANT_BITS = (3, 4)  # vLLM's TurboQuant tables (KVW-TQ-4)


@dataclass(frozen=True)
class CodecSpec:
    """One codec pipeline: a codec with its parameters, then an optional lossless stage.

    Defaults are the schema's. Fields a codec does not use must keep their defaults
    (KVW-CSPEC-5), so equal pipelines have equal encodings.
    """

    codec: str = "raw"
    lossless: str = "raw"
    fp8_format: str = "f8_e4m3fn"
    scale_granularity: str = "tensor"
    bits: int = 8
    group_size: int = 32
    group_axis: str = "tokens"
    symmetric: bool = False
    scale_dtype: str = "f32"
    sink_tokens: int = 0
    residual_tokens: int = 0
    rotation: str = "none"  # revision 1.2 (spec/codecs.md section 8)
    rotation_seed: int = 0
    codebook: str = "uniform"

    @property
    def lossy(self) -> bool:
        return self.codec in LOSSY

    @property
    def needs_turboquant_bit(self) -> bool:
        """The spec uses revision 1.3 (the unsigned rotation or the TurboQuant codebook): required
        feature bit 5 (KVW-TQ-1)."""
        return self.rotation == "sylvester" or self.codebook == "turboquant"

    @property
    def needs_rotation_bit(self) -> bool:
        """The spec uses revision 1.2 (a rotation, the Gaussian codebook or 3-bit codes):
        its container sets required feature bit 4 (KVW-ROT-1)."""
        return self.rotation != "none" or self.codebook != "uniform" or (self.codec == "int_affine" and self.bits == 3)


_DEFAULT = CodecSpec()
_U8 = struct.Struct("<B")
# (attribute, field id, struct, enum name -> code) in schema order
_ENUMS = {
    "codec": R.CODECS, "lossless": R.CODECS,
    "fp8_format": {k: v[0] for k, v in R.DTYPE_CODES.items()}, "scale_dtype": {k: v[0] for k, v in R.DTYPE_CODES.items()},
    "scale_granularity": R.SCALE_GRANULARITIES, "group_axis": R.GROUP_AXES,
    "rotation": R.ROTATIONS, "codebook": R.CODEBOOKS,
}
_FIELDS = [("codec", 0, "B"), ("lossless", 1, "B"), ("fp8_format", 2, "B"), ("scale_granularity", 3, "B"),
           ("bits", 4, "B"), ("group_size", 5, "I"), ("group_axis", 6, "B"), ("symmetric", 7, "?"),
           ("scale_dtype", 8, "B"), ("sink_tokens", 9, "I"), ("residual_tokens", 10, "I"),
           ("rotation", 11, "B"), ("rotation_seed", 12, "Q"), ("codebook", 13, "B")]
N_FIELDS_1_0 = 11  # fields 11-13 are revision 1.2's, read only with ROTATION_BIT (KVW-ROT-1)
_SLOTS = {"B": "PrependUint8Slot", "I": "PrependUint32Slot", "Q": "PrependUint64Slot", "?": "PrependBoolSlot"}
_STRUCTS = {"B": struct.Struct("<B"), "I": struct.Struct("<I"), "Q": struct.Struct("<Q")}
# which fields each codec uses (KVW-CSPEC-5); the others must hold their defaults
_USED = {
    "byteplane_zstd": (),
    "fp8": ("lossless", "fp8_format", "scale_granularity", "sink_tokens", "residual_tokens"),
    "int_affine": ("lossless", "bits", "group_size", "group_axis", "symmetric", "scale_dtype", "sink_tokens",
                   "residual_tokens", "rotation", "rotation_seed", "codebook"),
}


def _code(attr: str, value: Any) -> int:
    enum = _ENUMS.get(attr)
    if enum is None:
        return int(value)
    try:
        code: int = enum[value]
        return code
    except KeyError:
        raise ValueError(f"CodecSpec.{attr} {value!r}: not a registry name") from None


# ---------------------------------------------------------------------------------------
# FlatBuffers
# ---------------------------------------------------------------------------------------

def build_codec_specs(b: flatbuffers.Builder, specs: Sequence[CodecSpec]) -> int | None:
    """Offset of the ``Header.codec_specs`` vector (None when there are none); call before
    ``Header.Start``."""
    if not specs:
        return None
    offs = []
    for s in specs:
        used = _FIELDS if s.needs_rotation_bit or s.rotation_seed else _FIELDS[:N_FIELDS_1_0]
        b.StartObject(len(used))  # a 1.0 spec keeps its 1.0 bytes
        for attr, fid, code in used:
            value = getattr(s, attr)
            if value != getattr(_DEFAULT, attr):
                getattr(b, _SLOTS[code])(fid, _code(attr, value), None)
        offs.append(b.EndObject())
    return offset_vector(b, offs)


def _name(enum: Mapping[str, int], code: int, attr: str, required_features: int = 0) -> str:
    for name, c in enum.items():
        if c == code and gate_open(attr, name, required_features):
            return name
    raise SchemaError("ENUM_OUT_OF_RANGE", f"codec spec {attr} code {code} is not in the registry", rule="KVW-HDR-10")


def read_codec_specs(t: Table, required_features: int = 0) -> tuple[CodecSpec, ...]:
    """``Header.codec_specs`` (field 18) from the verified root table ``t``. The field is part
    of the 1.0 schema: it is read and verified whether or not the feature bit is set, and
    ``check_codec_specs`` rejects specs without the bit (KVW-CSPEC-10, KVW-EVOL-10). Fields
    11-13 are read only with the rotation bit: without it they are unknown fields that keep
    their defaults, as for a 1.0 reader (KVW-ROT-1)."""
    out = []
    read = _FIELDS if required_features & R.KNOWN_REQUIRED_FEATURES & ROTATION_BIT else _FIELDS[:N_FIELDS_1_0]
    for st in t.tables(18, MAX_CODEC_SPECS):
        kw: dict[str, Any] = {}
        for attr, fid, code in read:
            default = getattr(_DEFAULT, attr)
            if code == "?":
                kw[attr] = st.boolean(fid, default)
            elif attr in _ENUMS:
                kw[attr] = _name(_ENUMS[attr], st.scalar(fid, _U8, _ENUMS[attr][default]), attr, required_features)
            else:
                kw[attr] = st.scalar(fid, _STRUCTS[code], default)
        out.append(CodecSpec(**kw))
    return tuple(out)


# ---------------------------------------------------------------------------------------
# Header rules
# ---------------------------------------------------------------------------------------

def gate_open(attr: str, name: str, required_features: int) -> bool:
    """Is registry name ``name`` of field ``attr`` in range under ``required_features``
    (a code a feature registers is in range only with its bit, KVW-EVOL-9)?"""
    feature = R.FEATURE_GATED.get(attr, {}).get(name) if attr in REVISION_1_2_FIELDS else None
    return feature is None or bool(required_features & R.KNOWN_REQUIRED_FEATURES & R.REQUIRED_FEATURES[feature])


def _invalid(i: int, rule: str, msg: str) -> NoReturn:
    raise SchemaError("CODEC_SPEC_INVALID", f"codec_specs[{i}]: {msg}", rule=rule)


def check_codec_spec(s: CodecSpec, i: int, dtype: str, rotation_bit: bool = False,
                     turboquant_bit: bool = False) -> None:
    """Rules of one spec, in the order of spec/codecs.md section 1.1 (KVW-CSPEC-3..6, KVW-FP8-1,
    KVW-INT-1..2), then revisions 1.2's and 1.3's (KVW-ROT-2, KVW-TQ-2). KVW-CSPEC-8 (sparse containers count sink
    and residual tokens per head) rejects nothing: ``codecs.lossy_range`` applies it."""
    for attr, enum in _ENUMS.items():
        if getattr(s, attr) not in enum:
            raise SchemaError("ENUM_OUT_OF_RANGE", f"codec_specs[{i}].{attr} {getattr(s, attr)!r}",
                              rule="KVW-HDR-10")
        if rotation_bit and not gate_open(attr, getattr(s, attr), TURBOQUANT_BIT if turboquant_bit else 0):
            raise SchemaError("ENUM_OUT_OF_RANGE", f"codec_specs[{i}].{attr} {getattr(s, attr)!r} is registered by "
                              "required feature bit 5 (turboquant), which the container does not set", rule="KVW-TQ-1")
    if s.codec not in SPEC_CODECS:
        _invalid(i, "KVW-CSPEC-3", f"codec {s.codec!r}: a codec spec names byteplane_zstd, fp8 or int_affine "
                 "(raw and zstd records use codec_spec 0)")
    if s.lossless not in LOSSLESS_STAGES:
        _invalid(i, "KVW-CSPEC-4", f"lossless stage {s.lossless!r}: must be raw, zstd or byteplane_zstd")
    for f in fields(CodecSpec):
        if f.name != "codec" and f.name not in _USED[s.codec] and getattr(s, f.name) != f.default:
            _invalid(i, "KVW-CSPEC-5", f"{s.codec} does not use {f.name}; it must keep its default {f.default!r}")
    if s.lossy and dtype not in FLOAT_DTYPES:
        _invalid(i, "KVW-CSPEC-6", f"lossy codec {s.codec} on header dtype {dtype}: needs bf16, f16 or f32")
    if s.codec == "fp8" and s.fp8_format not in FP8_FORMATS:
        _invalid(i, "KVW-FP8-1", f"fp8_format {s.fp8_format!r}: must be f8_e4m3fn, f8_e5m2 or f8_e4m3fnuz")
    if s.codec == "int_affine":
        if s.bits not in (ROTATION_INT_BITS if rotation_bit else INT_BITS) or s.scale_dtype not in SCALE_DTYPES:
            _invalid(i, "KVW-INT-1", f"bits {s.bits} / scale_dtype {s.scale_dtype!r}: bits must be 2, 4 or 8 (3 with "
                     "required feature bit 4, rotation), scale_dtype f16, bf16 or f32")
        if not 1 <= s.group_size <= MAX_GROUP_SIZE:
            _invalid(i, "KVW-INT-2", f"group_size {s.group_size}: must be in [1, {MAX_GROUP_SIZE}]")
    check_rotation_fields(s, i, rotation_bit)


def check_rotation_fields(s: CodecSpec, i: int, rotation_bit: bool) -> None:
    """KVW-ROT-2 (and KVW-ROT-1's writer side: fields 11-13 only with the bit; a reader never
    sees them without it, since it does not read them)."""
    if not rotation_bit:
        if s.rotation != "none" or s.rotation_seed or s.codebook != "uniform":
            _invalid(i, "KVW-ROT-1", "rotation, rotation_seed and codebook need required feature bit 4 (rotation): "
                     "without it readers ignore them")
        return
    if s.rotation == "none" and s.rotation_seed:
        _invalid(i, "KVW-ROT-2", f"rotation_seed {s.rotation_seed} without a rotation: must be 0")
    if s.codebook == "gaussian" and (not s.symmetric or s.bits not in CODEBOOK_BITS):
        _invalid(i, "KVW-ROT-2", f"the gaussian codebook needs symmetric = true and bits 2, 3 or 4 (has symmetric "
                 f"{s.symmetric}, bits {s.bits})")
    if s.rotation == "sylvester" and s.rotation_seed:
        _invalid(i, "KVW-TQ-2", f"rotation_seed {s.rotation_seed} with the unsigned rotation: must be 0")
    if s.codebook == "turboquant" and (not s.symmetric or s.group_axis != "channels" or s.bits not in TURBOQUANT_BITS):
        _invalid(i, "KVW-TQ-2", f"the turboquant codebook needs symmetric = true, group_axis channels and bits 3 or 4 "
                 f"(has symmetric {s.symmetric}, group_axis {s.group_axis}, bits {s.bits})")


def check_codec_specs(h: Any) -> None:
    """Header rules of ``codec_specs`` (KVW-CSPEC-10, KVW-CSPEC-2..6); called by ``check_header``."""
    specs = h.codec_specs
    if not specs:
        if h.required_features & FEATURE_BIT:  # bit 0 alone: the unassigned bit of 1.0 draft rev. 1
            raise FeatureError("UNSUPPORTED_FEATURE", "the codec_specs bit is set but Header.codec_specs is "
                               "absent or empty (KVW-CSPEC-10): treated as an unknown bit", rule="KVW-EVOL-3")
        if h.required_features & ROTATION_BIT:
            _invalid(0, "KVW-ROT-1", "required feature bit 4 (rotation) is set but the header has no codec specs")
        if h.required_features & TURBOQUANT_BIT:
            _invalid(0, "KVW-TQ-1", "required feature bit 5 (turboquant) is set but the header has no codec specs")
        return
    if not h.required_features & FEATURE_BIT:
        _invalid(0, "KVW-CSPEC-10", "codec_specs present without the codec_specs required feature bit")
    if len(specs) > MAX_CODEC_SPECS:
        raise LimitError("LIMIT_EXCEEDED", f"{len(specs)} codec specs, limit {MAX_CODEC_SPECS}", rule="KVW-CSPEC-2")
    rot = bool(h.required_features & ROTATION_BIT)
    tq = bool(h.required_features & TURBOQUANT_BIT)
    for i, s in enumerate(specs):
        check_codec_spec(s, i, h.dtype, rot, tq)
    if rot and not any(s.needs_rotation_bit for s in specs):
        _invalid(0, "KVW-ROT-1", "required feature bit 4 (rotation) is set but no codec spec uses a rotation, the "
                 "gaussian codebook or 3-bit codes")
    if tq and not (rot and any(s.needs_turboquant_bit for s in specs)):
        _invalid(0, "KVW-TQ-1", "required feature bit 5 (turboquant) is set without bit 4 (rotation) or without a "
                 "codec spec that uses the sylvester rotation or the turboquant codebook")


# ---------------------------------------------------------------------------------------
# Record rules
# ---------------------------------------------------------------------------------------

def check_spec_refs(h: Any, rec: np.ndarray) -> None:
    """Record rules (KVW-CSPEC-9): ``codec_spec`` (``reserved0``) in range, and the
    record's codec equal to its spec's (raw or zstd for codec_spec 0)."""
    if not len(rec):
        return
    specs = h.codec_specs
    idx = rec["reserved0"].astype(np.int64)
    codec = rec["codec"].astype(np.int64)
    comp = rec["component"].astype(np.int64)
    # want[i]: the codec codec_spec i requires (-1: raw or zstd); lossy[i]: spec i is lossy
    want = np.array([-1] + [R.CODECS[s.codec] for s in specs], np.int64)
    lossy = np.array([False] + [s.lossy for s in specs])
    out = idx > len(specs)
    plain = codec <= R.CODECS["zstd"]
    safe = np.where(out, 0, idx)
    bad = out | np.where(safe == 0, ~plain, codec != want[safe])
    lossy_ok = np.isin(comp, [R.COMPONENTS[c] for c in LOSSY_COMPONENTS])
    bad |= lossy[safe] & ~lossy_ok
    if bad.any():
        i = int(np.argmax(bad))
        j = int(idx[i])
        if j > len(specs):
            what = f"codec_spec {j} but the header has {len(specs)} codec specs"
        elif lossy[safe[i]] and not lossy_ok[i]:
            what = f"lossy codec spec {j} on component {R.COMPONENT_BY_CODE.get(int(comp[i]), comp[i])}"
        else:
            what = f"codec {R.CODEC_BY_CODE.get(int(codec[i]), codec[i])} with codec_spec {j} " + (
                "(a codec_spec 0 record is raw or zstd)" if j == 0 else f"(spec codec {specs[j - 1].codec})")
        raise CodecError("CODEC_SPEC_MISMATCH", f"chunk record {i}: {what}", rule="KVW-CSPEC-9")


# ---------------------------------------------------------------------------------------
# JSON (conformance neutral model)
# ---------------------------------------------------------------------------------------

def spec_to_json(s: CodecSpec) -> dict[str, Any]:
    """Every field; revision 1.2's only where they differ from their defaults (spec/codecs.md
    section 8.1), so that 1.0 vectors keep their JSON."""
    return {f.name: getattr(s, f.name) for f in fields(CodecSpec)
            if f.name not in REVISION_1_2_FIELDS or getattr(s, f.name) != f.default}


REVISION_1_2_FIELDS = ("rotation", "rotation_seed", "codebook")


def features_of(specs: Sequence[CodecSpec]) -> int:
    """The required feature bits a list of specs needs: codec_specs, rotation when one spec
    uses revision 1.2, turboquant (with rotation) when one uses 1.3 (KVW-CSPEC-10, KVW-ROT-1,
    KVW-TQ-1)."""
    if not specs:
        return 0
    return (FEATURE_BIT | (ROTATION_BIT if any(s.needs_rotation_bit for s in specs) else 0)
            | (TURBOQUANT_BIT if any(s.needs_turboquant_bit for s in specs) else 0))


def spec_from_json(d: Mapping[str, Any]) -> CodecSpec:
    return CodecSpec(**{f.name: d[f.name] for f in fields(CodecSpec) if f.name in d})
