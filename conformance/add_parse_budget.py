"""Conformance vectors for the parse budget (KVW-LIM-7) and the table count (KVW-HDR-8),
appended to format 1.0 with ``generate.py --add parse_budget``.

Every invalid vector here is a header FlatBuffer DAG: many references point at one
shared object (a metadata value, a RoPE factor vector, a layer spec, a state tensor
vector), so every count is within its limit yet a reader that decodes each reference
separately materialises the object once per reference. ``dag_header(kind, shared=False)``
builds the same header with a separate copy per reference: that twin is accepted (the
tests check it), so each vector breaks the budget and nothing else.

The builders are also what tests/format/test_verifier.py uses to reproduce the attack at full
size (a 1.1 MB header that cost 4 GiB before the budget).
"""

from __future__ import annotations

import flatbuffers
import numpy as np

import forge
from kvwire.format import registry as R
from kvwire.format.fbs import Architecture as fbArch
from kvwire.format.fbs import Header as fbHeader
from kvwire.format.fbs import KeyValue as fbKV
from kvwire.format.fbs import LayerSpec as fbLayer
from kvwire.format.fbs import RopeParams as fbRope
from kvwire.format.fbs import StateTensor as fbState

STATE_BIT = R.REQUIRED_FEATURES["state_layers"]
KINDS = ("metadata", "rope_factors", "layer_spec", "state_tensors")


def _vector_of(b, offs) -> int:
    b.StartVector(4, len(offs), 4)
    for off in reversed(offs):
        b.PrependUOffsetTRelative(off)
    return b.EndVector()


def _state_tensors(b, count: int, dims: int) -> int:
    tabs = []
    for j in range(count):
        name = b.CreateString(f"s{j}")
        shape = b.CreateNumpyVector(np.full(dims, 2, "<u4"))
        fbState.Start(b)
        fbState.AddName(b, name)
        fbState.AddShape(b, shape)
        tabs.append(fbState.End(b))
    return _vector_of(b, tabs)


def _spec(b, *, kind: str = "full_attention", rope=None, state=None) -> int:
    fbLayer.Start(b)
    if kind == "state":
        fbLayer.AddKind(b, R.LAYER_KINDS["state"])
        fbLayer.AddUsesRope(b, False)
        fbLayer.AddStateTensors(b, state)
    else:
        fbLayer.AddNumKvHeads(b, 1)
        fbLayer.AddHeadDimK(b, 8)
        fbLayer.AddHeadDimV(b, 8)
        if rope is not None:
            fbLayer.AddRope(b, rope)
    return fbLayer.End(b)


def dag_header(kind: str, *, shared: bool = True, k: int = 64, size: int = 2048, features: int = 0) -> bytes:
    """Header bytes whose ``k`` references to one object of ``kind`` share it (``shared``)
    or each have their own copy. ``size``: bytes of a metadata value, entries of a RoPE
    factor vector, dimensions of a state tensor shape (layer_spec) or tensors in a
    state_tensors vector (state_tensors)."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: one of {', '.join(KINDS)}")
    b = flatbuffers.Builder(1 << 16)
    metadata = None
    specs, index = [], [0]
    if kind == "metadata":
        one = b.CreateByteVector(bytes(size)) if shared else None
        kvs = []
        for i in range(k):
            val = one if shared else b.CreateByteVector(bytes(size))
            key = b.CreateString(f"ns.k{i}")
            fbKV.Start(b)
            fbKV.AddKey(b, key)
            fbKV.AddValue(b, val)
            kvs.append(fbKV.End(b))
        metadata = _vector_of(b, kvs)
        specs = [_spec(b)]
    elif kind == "rope_factors":
        factors = np.linspace(1.0, 2.0, size).astype("<f8")
        one = b.CreateNumpyVector(factors) if shared else None
        for _ in range(k):
            short = one if shared else b.CreateNumpyVector(factors)
            long_ = one if shared else b.CreateNumpyVector(factors)
            fbRope.Start(b)
            fbRope.AddRopeType(b, R.ROPE_TYPES["longrope"])
            fbRope.AddRotaryDim(b, 2 * size)
            fbRope.AddOriginalMaxPositionEmbeddings(b, 4096)
            fbRope.AddShortFactor(b, short)
            fbRope.AddLongFactor(b, long_)
            specs.append(_spec(b, rope=fbRope.End(b)))
        index = list(range(k))
    elif kind == "layer_spec":
        features |= STATE_BIT
        spec = _spec(b, kind="state", state=_state_tensors(b, 2, size))
        specs = [spec] * k if shared else [spec]
        index = list(range(k)) if shared else [0] * k
    else:  # state_tensors: unreferenced layer specs (all but spec 0) share one vector
        features |= STATE_BIT
        one = _state_tensors(b, size, 1) if shared else None
        specs = [_spec(b, kind="state", state=one if shared else _state_tensors(b, size, 1)) for _ in range(k)]
    specs_vec = _vector_of(b, specs)
    index_vec = b.CreateNumpyVector(np.asarray(index, "<u2"))
    lib, ver = b.CreateString("kvwire-conformance-generator"), b.CreateString("1.0")
    from kvwire.format.fbs import Producer as fbProducer

    fbProducer.Start(b)
    fbProducer.AddLibrary(b, lib)
    fbProducer.AddVersion(b, ver)
    producer = fbProducer.End(b)
    fbArch.Start(b)
    fbArch.AddNumLayers(b, len(index))
    fbArch.AddLayerSpecs(b, specs_vec)
    fbArch.AddLayerSpecIndex(b, index_vec)
    arch = fbArch.End(b)
    fbHeader.Start(b)
    fbHeader.AddFormatMajor(b, 1)
    fbHeader.AddRequiredFeatures(b, features)
    fbHeader.AddProducer(b, producer)
    fbHeader.AddArch(b, arch)
    fbHeader.AddDtype(b, R.DTYPES["f16"][0])
    fbHeader.AddChunkTokens(b, 16)
    if metadata is not None:
        fbHeader.AddCustomMetadata(b, metadata)
    b.Finish(fbHeader.End(b), file_identifier=b"KVWH")
    return bytes(b.Output())


def dag_container(kind: str, **kw) -> bytes:
    """``dag_header`` in a zero-chunk stream container (checksums correct)."""
    return forge.wrap_header(dag_header(kind, **kw))


# (name, kind, keyword arguments, what is shared)
CASES = [
    ("lim7-shared-metadata-value", "metadata", dict(k=64, size=2048),
     "64 metadata entries (distinct keys) whose values are one shared 2 KiB byte vector: 128 KiB of values "
     "from a 3.5 KB header"),
    ("lim7-shared-rope-factors", "rope_factors", dict(k=64, size=256),
     "64 layer specs, each with its own longrope RopeParams table, whose short_factor and long_factor all point at "
     "one shared vector of 256 f64 (the RopeParams exemption is for a shared table, not a shared vector)"),
    ("lim7-shared-layer-spec", "layer_spec", dict(k=1024, size=8),
     "layer_specs holds 1024 references to one state LayerSpec (2 state tensors of 8 dimensions); the compact "
     "encoding, one spec and layer_spec_index all 0, is accepted"),
    ("lim7-unreferenced-specs-share-state-tensors", "state_tensors", dict(k=64, size=64),
     "64 state layer specs, 63 of them referenced by no layer, all pointing at one state_tensors vector of 64 "
     "tables: 4160 table visits in a 4 KB header (at 1008 specs: 65,520 visits, below MAX_FB_TABLES, which an "
     "unbudgeted reader accepts)"),
]


def gen_parse_budget(g) -> None:
    """KVW-LIM-7: FlatBuffer DAGs over the parse budget (FB_TOO_COMPLEX)."""
    for name, kind, kw, what in CASES:
        g.invalid(name, dag_container(kind, **kw), rule="KVW-LIM-7", code="FB_TOO_COMPLEX",
                  description=f"Header FlatBuffer DAG: {what}. Every count is within its limit; decoding each "
                              "reference separately exceeds the parse budget 8 x header length + 65,536.",
                  rules=["KVW-HDR-8"])


ADDITION = {
    "make": gen_parse_budget,
    "spec": "spec/kvwire-v1.md section 17 (KVW-LIM-7, parse budget) and section 5.3 (KVW-HDR-8)",
    "corrects_codes_without_vector": {
        "FB_TOO_COMPLEX": "The frozen manifest's codes_without_vector entry (\"unreachable within the v1 limits ... "
                          "at most about 12,300 tables\") was wrong: layer specs sharing state_tensors reach 65,000 "
                          "visits within the count limits, and shared objects multiply the bytes decoded. The "
                          "vectors of this set report FB_TOO_COMPLEX (KVW-LIM-7).",
    },
    "rules_without_vector": {
        "KVW-HDR-8": "Over 65,536 table visits fires before the parse budget only in a header of 254 KB or more "
                     "(KVW-HDR-8 rationale), too large for the vector folder; tests/format/test_verifier.py covers it "
                     "with a padded header.",
        "KVW-LIM-7 (RopeParams exemption)": "A valid vector would need hundreds of layers' RoPE factors in its JSON "
                                            "twin (over 600 KB); tests/format/test_verifier.py checks that the reference "
                                            "writer's 4096 layer specs sharing one RopeParams table are accepted.",
    },
}
