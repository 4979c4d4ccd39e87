"""The neutral JSON model of the conformance kit (conformance/PROTOCOL.md, "Neutral JSON").

Implementations in any language exchange headers and tensors with the runner through
this model: the JSON twin of a gold vector, the ``decoded.json`` a ``decode`` command
writes, and the ``spec.json`` an ``encode`` command reads. Nothing here depends on
FlatBuffers: a header is a plain JSON object of resolved values (defaults applied,
per-layer specs expanded, registry names instead of codes).

This module holds the document formats and the header <-> JSON mapping; the canonical
tensor bytes and their digests are ``digests``, the comparison of a reported decode
output with a twin is ``compare``.
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from ..format import registry as R
from ..format.header import (
    Architecture,
    Header,
    LayerMapEntry,
    LayerSpec,
    ModelIdentity,
    Producer,
    RopeParams,
    TokenRange,
    default_layer_tokens,
)
from .digests import tensor_digests

TWIN_FORMAT = "kvwire-twin"
DECODED_FORMAT = "kvwire-decoded"
ENCODE_SPEC_FORMAT = "kvwire-encode-spec"
MODEL_JSON_VERSION = 1

_BLOBS = ("config_fingerprint", "tokenizer_fingerprint", "weights_fingerprint", "compat_fingerprint")
_XM_MODEL = ("framework", "framework_version", "layer_weights_fingerprints", "fingerprint_scheme")
_ROPE_VECTORS = ("short_factor", "long_factor", "mrope_section")


# ---------------------------------------------------------------------------------------
# Numbers
# ---------------------------------------------------------------------------------------

def float_to_json(x: float):
    """A binary64 as a JSON number; the three non-finite values as strings."""
    x = float(x)
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return x


def float_from_json(v) -> float:
    if isinstance(v, str):
        return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[v]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"not a number: {v!r}")
    return float(v)


# ---------------------------------------------------------------------------------------
# Header <-> JSON
# ---------------------------------------------------------------------------------------

def rope_to_json(r: RopeParams | None):
    if r is None:
        return None
    out = {}
    for f in fields(RopeParams):
        v = getattr(r, f.name)
        if f.name == "truncate" and v:  # reported only when false, as the 1.0 vectors predate it
            continue
        if f.name in ("short_factor", "long_factor"):
            out[f.name] = [float_to_json(x) for x in v]
        elif f.name == "mrope_section":
            out[f.name] = [int(x) for x in v]
        elif isinstance(v, float):
            out[f.name] = float_to_json(v)
        else:
            out[f.name] = v
    return out


def layer_to_json(s: LayerSpec) -> dict:
    return {
        "kind": s.kind, "num_kv_heads": s.num_kv_heads, "head_dim_k": s.head_dim_k, "head_dim_v": s.head_dim_v,
        "window": s.window, "source_layer": s.source_layer, "uses_rope": s.uses_rope, "rope": rope_to_json(s.rope),
        "kv_lora_rank": s.kv_lora_rank, "qk_rope_head_dim": s.qk_rope_head_dim,
        **({"state_tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype} for t in s.state_tensors]}
           if s.state_tensors else {}),  # spec/crossmodel.md: reported when present
    }


def header_to_json(h: Header) -> dict:
    """The resolved header as neutral JSON (every field present)."""
    m = h.model
    out = {
        "format_major": h.format_major,
        "format_minor": h.format_minor,
        "required_features": h.required_features,
        "optional_features": h.optional_features,
        "producer": {"library": h.producer.library, "version": h.producer.version},
        "model": {
            "model_type": m.model_type, "model_id": m.model_id, "revision": m.revision,
            **{b: bytes(getattr(m, b)).hex() for b in _BLOBS},
            **{k: (v.hex() if isinstance(v, bytes) else v) for k in _XM_MODEL  # spec/crossmodel.md, when set
               for v in (getattr(m, k),) if v},
        },
        "arch": {
            "schema_version": h.arch.schema_version,
            "keys_post_rope": h.arch.keys_post_rope,
            "rope": rope_to_json(h.arch.rope),
            "layers": [layer_to_json(s) for s in h.arch.layers],
        },
        "layer_map": [{"receiver_layer": e.receiver_layer, "transmitted_layer": e.transmitted_layer, "op": e.op}
                      for e in h.layer_map],
        "dtype": h.dtype,
        "alignment": h.alignment,
        "chunk_tokens": h.chunk_tokens,
        "first_position": h.first_position,
        "token_count": h.token_count,
        "layer_tokens": [{"start": r.start, "count": r.count} for r in h.layer_tokens],
        "checksum_algorithm": h.checksum_algorithm,
        "metadata": {k: bytes(v).hex() for k, v in sorted(h.metadata.items())},
    }
    if getattr(h, "codec_specs", ()):  # spec/codecs.md: reported when present
        from ..format.codec_specs import spec_to_json

        out["codec_specs"] = [spec_to_json(s) for s in h.codec_specs]
    sp = getattr(h, "sparse", None)
    if sp is not None:  # spec/sparse.md: reported when present
        out["sparse"] = {"method": sp.method, "next_position": sp.next_position,
                         "retained_counts": list(sp.retained_counts), "sink_tokens": sp.sink_tokens,
                         "window_tokens": sp.window_tokens}
    scales = getattr(h, "kv_scales", None)
    if scales is not None:  # spec 5.10 (revision 1.1): reported when present
        out["kv_scales"] = [{"k_scale": float_to_json(e.k_scale), "v_scale": float_to_json(e.v_scale)}
                            for e in scales]
    prefix = getattr(h, "prefix", None)
    if prefix is not None:  # spec/crossmodel.md: reported when present
        out["prefix"] = {"scheme": prefix.scheme, "root": prefix.root.hex(), "hashes": prefix.hashes.hex()}
    engine = getattr(h, "engine_layout", None)  # informational table (spec 5.9), reported when present
    if engine is not None:
        out["engine_layout"] = {f.name: (list(v) if isinstance(v, tuple) else v)
                                for f in fields(engine) for v in (getattr(engine, f.name),)}
    return out


def rope_from_json(d) -> RopeParams | None:
    if d is None:
        return None
    kw: dict[str, Any] = {}
    for f in fields(RopeParams):
        if f.name not in d:
            continue
        v = d[f.name]
        if f.name in ("short_factor", "long_factor"):
            kw[f.name] = tuple(float_from_json(x) for x in v)
        elif f.name == "mrope_section":
            kw[f.name] = tuple(int(x) for x in v)
        elif isinstance(f.default, float):
            kw[f.name] = float_from_json(v)
        else:
            kw[f.name] = v
    return RopeParams(**kw)


def layer_from_json(d: dict) -> LayerSpec:
    kw = {f.name: d[f.name] for f in fields(LayerSpec) if f.name in d and f.name not in ("rope", "state_tensors")}
    if d.get("state_tensors"):  # spec/crossmodel.md
        from ..format.crossmodel import StateTensor

        kw["state_tensors"] = tuple(StateTensor(t["name"], tuple(t["shape"]), t.get("dtype", "f32"))
                                    for t in d["state_tensors"])
    return LayerSpec(rope=rope_from_json(d.get("rope")), **kw)


def header_from_json(d: dict, *, producer: Producer | None = None) -> Header:
    """A ``Header`` from neutral JSON; absent optional sections take their defaults.

    ``producer`` replaces the JSON's producer (a writer writes its own)."""
    a = d["arch"]
    specs: dict = {}
    layers = tuple(specs.setdefault(s, s) for s in (layer_from_json(x) for x in a["layers"]))
    arch = Architecture(layers, rope=rope_from_json(a.get("rope")), keys_post_rope=a.get("keys_post_rope", True),
                        schema_version=a.get("schema_version", 1))
    m = d.get("model", {})
    model = ModelIdentity(m.get("model_type", ""), m.get("model_id", ""), m.get("revision", ""),
                          **{b: bytes.fromhex(m.get(b, "")) for b in _BLOBS}, framework=m.get("framework", ""),
                          framework_version=m.get("framework_version", ""),
                          layer_weights_fingerprints=bytes.fromhex(m.get("layer_weights_fingerprints", "")),
                          fingerprint_scheme=m.get("fingerprint_scheme", 0))
    if producer is None:
        p = d.get("producer", {})
        producer = Producer(p.get("library", ""), p.get("version", ""))
    ranges = d.get("layer_tokens")
    token_count = d.get("token_count", 0)
    extra: dict[str, Any] = {}
    if d.get("codec_specs"):  # spec/codecs.md
        from ..format.codec_specs import spec_from_json

        extra["codec_specs"] = tuple(spec_from_json(s) for s in d["codec_specs"])
    if d.get("sparse") is not None:  # spec/sparse.md
        from ..format.sparse import SparseInfo

        extra["sparse"] = SparseInfo(**{**d["sparse"], "retained_counts": tuple(d["sparse"]["retained_counts"])})
    if d.get("prefix") is not None:  # spec/crossmodel.md
        from ..format.crossmodel import PrefixChain

        p = d["prefix"]
        extra["prefix"] = PrefixChain(p.get("scheme", 1), bytes.fromhex(p.get("root", "")),
                                      bytes.fromhex(p.get("hashes", "")))
    if d.get("kv_scales") is not None:  # spec 5.10 (revision 1.1)
        extra["kv_scales"] = tuple((float_from_json(e["k_scale"]), float_from_json(e["v_scale"]))
                                   for e in d["kv_scales"])
    if d.get("engine_layout") is not None:  # only with a codec that knows the table
        from ..format import header as H

        table: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in d["engine_layout"].items()}
        extra["engine_layout"] = H.EngineLayout(**table)
    return Header(
        arch=arch,
        token_count=token_count,
        dtype=d.get("dtype", "bf16"),
        first_position=d.get("first_position", 0),
        layer_tokens=(tuple(TokenRange(r["start"], r["count"]) for r in ranges) if ranges is not None
                      else default_layer_tokens(arch, token_count)),
        chunk_tokens=d.get("chunk_tokens", 256),
        alignment=d.get("alignment", 64),
        model=model,
        producer=producer,
        layer_map=tuple(LayerMapEntry(e["receiver_layer"], e["transmitted_layer"], e.get("op", "copy"))
                        for e in d.get("layer_map", [])),
        metadata={k: bytes.fromhex(v) for k, v in d.get("metadata", {}).items()},
        checksum_algorithm=d.get("checksum_algorithm", "xxh3_64"),
        required_features=d.get("required_features", 0),
        optional_features=d.get("optional_features", 0),
        format_major=d.get("format_major", R.FORMAT_MAJOR),
        format_minor=d.get("format_minor", R.FORMAT_MINOR),
        **extra,
    )


def make_twin(cache, **info) -> dict:
    """The JSON twin of a decoded cache; ``info``: form, chunk_count (or segments)."""
    return {
        "format": TWIN_FORMAT,
        "version": MODEL_JSON_VERSION,
        **info,
        "header": header_to_json(cache.header),
        "tensors": tensor_digests(cache),
    }
