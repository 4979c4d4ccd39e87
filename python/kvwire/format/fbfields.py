"""FlatBuffers field helpers shared by the header's tables (spec 5.2, 5.3).

The header (``header``), the architecture schema (``architecture``) and the engine
layout (``engine_layout``) write their scalar fields, scalar vectors and struct vectors
the same way, and read them back the same way through the verifying reader of
``flatbuf``. The helpers live here, below all three, so that none of those modules
imports another one's internals.

A *scalar spec* is a list of ``(attribute, field id, struct code, enum registry or
None)``: the dataclass attribute, its field id in the schema, its ``struct`` code
(``"B"``, ``"I"``, ``"d"``, ``"?"`` ...) and, for an enum field, the registry mapping
names to codes (``registry.LAYER_KINDS`` ...). The dataclass default of each attribute
equals the schema default, so writers omit a field that holds it and readers return it
for an absent field.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

import flatbuffers

from .errors import SchemaError
from .flatbuf import Table

# (attribute, field id, struct code, enum registry or None): see the module docstring
ScalarSpec = Sequence[tuple[str, int, str, "Mapping[str, int] | None"]]

SCALAR = {c: struct.Struct("<" + c) for c in "BHIiQd?"}  # little-endian scalar of each struct code
_SLOT = {
    "B": "PrependUint8Slot",
    "H": "PrependUint16Slot",
    "I": "PrependUint32Slot",
    "i": "PrependInt32Slot",
    "Q": "PrependUint64Slot",
    "d": "PrependFloat64Slot",
    "?": "PrependBoolSlot",
}


def offset_vector(b: flatbuffers.Builder, offsets: Sequence[int]) -> int:
    """A vector of tables already built (``offsets`` in element order)."""
    b.StartVector(4, len(offsets), 4)
    for off in reversed(offsets):
        b.PrependUOffsetTRelative(off)
    end: int = b.EndVector()
    return end


# ---------------------------------------------------------------------------------------
# FlatBuffer encoding
# ---------------------------------------------------------------------------------------

def add_scalars(b: flatbuffers.Builder, obj: Any, spec: ScalarSpec) -> None:
    """Add the scalar fields of dataclass ``obj`` named by ``spec`` to the table being
    built, omitting those equal to their default."""
    for attr, fid, code, enum in spec:
        value = getattr(obj, attr)
        default = type(obj).__dataclass_fields__[attr].default
        if value == default:
            continue
        getattr(b, _SLOT[code])(fid, enum[value] if enum else value, None)


def scalar_vector(b: flatbuffers.Builder, elem: str, values: Any) -> int:
    """A vector of one scalar type (numpy dtype code ``elem``, e.g. ``"u2"``), written
    through the builder's numpy fast path."""
    import numpy as np

    end: int = b.CreateNumpyVector(np.asarray(values, dtype="<" + elem))
    return end


# ---------------------------------------------------------------------------------------
# FlatBuffer decoding (through the verifying reader)
# ---------------------------------------------------------------------------------------

def enum_name(registry_by_code: Mapping[int, str], code: int, what: str) -> str:
    """The registered name of an enum code; an unregistered code is ENUM_OUT_OF_RANGE."""
    try:
        return registry_by_code[code]
    except KeyError:
        raise SchemaError("ENUM_OUT_OF_RANGE", f"{what} code {code} is not in the registry", rule="KVW-HDR-10") from None


_BY_CODE: dict[int, tuple[Mapping[str, int], dict[int, str]]] = {}  # id(registry) -> (registry, {code: name})


def _by_code(registry: Mapping[str, int]) -> dict[int, str]:
    entry = _BY_CODE.get(id(registry))
    if entry is None or entry[0] is not registry:
        entry = _BY_CODE[id(registry)] = (registry, {v: k for k, v in registry.items()})
    return entry[1]


def read_scalars(t: Table, cls: Any, spec: ScalarSpec) -> dict[str, Any]:
    """The scalar fields named by ``spec`` of table ``t``, as keyword arguments of ``cls``;
    an absent field reads as the dataclass default."""
    out: dict[str, Any] = {}
    fields_ = cls.__dataclass_fields__
    for attr, fid, code, enum in spec:
        default = fields_[attr].default
        if code == "?":
            out[attr] = t.boolean(fid, default)
        elif enum is None:
            out[attr] = t.scalar(fid, SCALAR[code], default)
        else:
            out[attr] = enum_name(_by_code(enum), t.scalar(fid, SCALAR[code], enum[default]), attr)
    return out


def read_numbers(t: Table, fid: int, code: str, size: int, max_count: int) -> tuple[Any, ...]:
    """A vector of one scalar type (``struct`` code ``code``, ``size`` bytes each) of at
    most ``max_count`` elements; an absent vector is ``()``."""
    v = t.vector(fid, size, size, max_count)
    if v is None:
        return ()
    start, count = v
    return struct.unpack_from(f"<{count}{code}", t.buf.data, start)


def read_structs(t: Table, fid: int, fmt: str, max_count: int) -> list[tuple[Any, ...]]:
    """A vector of structs (``struct`` format ``fmt``, 4-byte aligned) of at most
    ``max_count`` elements, each as a tuple; an absent vector is ``[]``."""
    s = struct.Struct("<" + fmt)
    v = t.vector(fid, s.size, 4, max_count)
    if v is None:
        return []
    start, count = v
    return [s.unpack_from(t.buf.data, start + i * s.size) for i in range(count)]
