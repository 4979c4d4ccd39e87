"""The neutral JSON model of the conformance kit (conformance/PROTOCOL.md, "Neutral JSON").

Implementations in any language exchange headers and tensors with the runner through
this model: the JSON twin of a gold vector, the ``decoded.json`` a ``decode`` command
writes, and the ``spec.json`` an ``encode`` command reads. Nothing here depends on
FlatBuffers: a header is a plain JSON object of resolved values (defaults applied,
per-layer specs expanded, registry names instead of codes).

Tensor bytes are *canonical*: for every (layer, component) the layer stores, the
little-endian row-major ``[heads, layer tokens, head_dim]`` tensor (all its chunks
concatenated in token order). A twin lists their SHA-256 digests.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import fields

from ..format import registry as R
from ..format.header import (
    Architecture, Header, LayerMapEntry, LayerSpec, ModelIdentity, Producer, RopeParams, TokenRange,
)

TWIN_FORMAT = "kvwire-twin"
DECODED_FORMAT = "kvwire-decoded"
ENCODE_SPEC_FORMAT = "kvwire-encode-spec"
MODEL_JSON_VERSION = 1

# Fields a decode output MUST report (PROTOCOL.md); the others are compared when present.
CORE_HEADER_FIELDS = ("format_major", "format_minor", "required_features", "optional_features", "dtype",
                      "alignment", "chunk_tokens", "first_position", "token_count", "checksum_algorithm",
                      "layer_tokens", "arch")
CORE_LAYER_FIELDS = ("kind", "num_kv_heads", "head_dim_k", "head_dim_v", "window", "source_layer")
# Fields a reader must ignore for a shared layer (KVW-ARCH-7): never compared.
SHARED_IGNORED = ("window", "uses_rope", "rope", "kv_lora_rank", "qk_rope_head_dim")

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


def _same_float(a, b) -> bool:
    try:
        x, y = float_from_json(a), float_from_json(b)
    except (KeyError, TypeError, ValueError):
        return False
    return (math.isnan(x) and math.isnan(y)) or (x == y and math.copysign(1, x) == math.copysign(1, y))


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
    if getattr(h, "sparse", None) is not None:  # spec/sparse.md: reported when present
        sp = h.sparse
        out["sparse"] = {"method": sp.method, "next_position": sp.next_position,
                         "retained_counts": list(sp.retained_counts), "sink_tokens": sp.sink_tokens,
                         "window_tokens": sp.window_tokens}
    if getattr(h, "prefix", None) is not None:  # spec/crossmodel.md: reported when present
        out["prefix"] = {"scheme": h.prefix.scheme, "root": h.prefix.root.hex(), "hashes": h.prefix.hashes.hex()}
    engine = getattr(h, "engine_layout", None)  # informational table (spec 5.9), reported when present
    if engine is not None:
        out["engine_layout"] = {f.name: (list(v) if isinstance(v, tuple) else v)
                                for f in fields(engine) for v in (getattr(engine, f.name),)}
    return out


def rope_from_json(d) -> RopeParams | None:
    if d is None:
        return None
    kw = {}
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
                          *(bytes.fromhex(m.get(b, "")) for b in _BLOBS), framework=m.get("framework", ""),
                          framework_version=m.get("framework_version", ""),
                          layer_weights_fingerprints=bytes.fromhex(m.get("layer_weights_fingerprints", "")),
                          fingerprint_scheme=m.get("fingerprint_scheme", 0))
    if producer is None:
        p = d.get("producer", {})
        producer = Producer(p.get("library", ""), p.get("version", ""))
    ranges = d.get("layer_tokens")
    extra = {}
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
    if d.get("engine_layout") is not None:  # only with a codec that knows the table
        from ..format import header as H

        extra["engine_layout"] = H.EngineLayout(**{k: tuple(v) if isinstance(v, list) else v
                                                   for k, v in d["engine_layout"].items()})
    return Header(
        arch=arch,
        token_count=d.get("token_count", 0),
        dtype=d.get("dtype", "bf16"),
        first_position=d.get("first_position", 0),
        layer_tokens=tuple(TokenRange(r["start"], r["count"]) for r in ranges) if ranges is not None else None,
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


# ---------------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------------

def _eq(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, float) or isinstance(b, float) or isinstance(a, str) and a in ("NaN", "Infinity", "-Infinity"):
        return _same_float(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_eq(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_eq(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _short(v, n: int = 80) -> str:
    s = repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."


def compare_header(expected: dict, actual, *, ignore=("producer",), require_all: bool = False) -> tuple[list, list]:
    """(errors, notes) comparing a reported header with the expected one.

    A field present in ``actual`` must equal the expected value. A missing core field is
    an error; a missing optional field is a note (or an error with ``require_all``).
    """
    errors: list[str] = []
    notes: list[str] = []
    if not isinstance(actual, dict):
        return [f"header is {type(actual).__name__}, not an object"], notes

    def missing(path: str, core: bool) -> None:
        (errors if core or require_all else notes).append(f"{path}: not reported")

    for key, want in expected.items():
        if key in ignore:
            continue
        core = key in CORE_HEADER_FIELDS
        if key not in actual:
            missing(key, core)
            continue
        got = actual[key]
        if key == "arch":
            _compare_arch(want, got, errors, notes, require_all)
        elif not _eq(want, got):
            errors.append(f"{key}: expected {_short(want)}, got {_short(got)}")
    return errors, notes


def _compare_arch(want: dict, got, errors: list, notes: list, require_all: bool) -> None:
    if not isinstance(got, dict):
        errors.append("arch: not an object")
        return
    for key in ("schema_version", "keys_post_rope", "rope"):
        if key not in got:
            (errors if require_all else notes).append(f"arch.{key}: not reported")
        elif not _eq(want[key], got[key]):
            errors.append(f"arch.{key}: expected {_short(want[key])}, got {_short(got[key])}")
    layers = got.get("layers")
    if not isinstance(layers, list) or len(layers) != len(want["layers"]):
        errors.append(f"arch.layers: expected {len(want['layers'])} layers, got "
                      f"{len(layers) if isinstance(layers, list) else _short(layers)}")
        return
    for i, (w, g) in enumerate(zip(want["layers"], layers)):
        if not isinstance(g, dict):
            errors.append(f"arch.layers[{i}]: not an object")
            continue
        for key, value in w.items():
            if w["kind"] == "shared" and key in SHARED_IGNORED:
                continue
            if key not in g:
                (errors if key in CORE_LAYER_FIELDS or require_all else notes).append(
                    f"arch.layers[{i}].{key}: not reported")
            elif not _eq(value, g[key]):
                errors.append(f"arch.layers[{i}].{key}: expected {_short(value)}, got {_short(g[key])}")


# ---------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------

def stored_components(header_json: dict):
    """(layer, component, shape) of every tensor a decoder reports, in canonical order."""
    for i, (spec, r) in enumerate(zip(header_json["arch"]["layers"], header_json["layer_tokens"])):
        if spec["kind"] == "state":  # one tensor per state tensor, if the cache has tokens (spec/crossmodel.md)
            for t in spec["state_tensors"] if r["count"] else ():
                yield i, f"state.{t['name']}", list(t["shape"])
            continue
        for comp in R.KIND_COMPONENTS[spec["kind"]]:
            heads, dim = {
                "k": (spec["num_kv_heads"], spec["head_dim_k"]),
                "v": (spec["num_kv_heads"], spec["head_dim_v"]),
                "latent": (1, spec["head_dim_k"]),
            }[comp]
            yield i, comp, [heads, r["count"], dim]


def tensor_file_name(layer: int, component: str) -> str:
    return f"layer{layer}_{component}.bin"


def sha256(data) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_bytes(array) -> bytes:
    """Canonical bytes of a host array [heads, tokens, head_dim] (C order, little-endian host)."""
    from ..cache.tensors import as_numpy

    import numpy as np

    return np.ascontiguousarray(as_numpy(array)).tobytes()


def cache_tensors(cache):
    """(layer, component, array) of every canonical tensor of a cache. A sparse cache
    (spec/sparse.md) has, per (layer, component), its heads' rows concatenated in head order
    ([retained tokens of all heads, dim]) and POSITIONS as int64 little-endian."""
    if getattr(cache, "is_sparse", False):
        yield from cache.canonical_tensors()
        return
    for i, layer in enumerate(cache.layers):
        for comp in cache.header.arch.layers[i].components:
            if comp == "state":  # "state.<name>" per state tensor, in declaration order (spec/crossmodel.md)
                for t in cache.header.arch.layers[i].state_tensors:
                    if t.name in layer["state"]:
                        yield i, f"state.{t.name}", layer["state"][t.name]
                continue
            yield i, comp, layer[comp]


def tensor_digests(cache) -> list[dict]:
    """The twin's ``tensors`` list for a ``KVCache`` (or ``SparseKVCache``)."""
    out = []
    for i, comp, x in cache_tensors(cache):
        data = canonical_bytes(x)
        out.append({"layer": i, "component": comp, "shape": list(x.shape), "nbytes": len(data),
                    "sha256": sha256(data)})
    return out


def make_twin(cache, **info) -> dict:
    """The JSON twin of a decoded cache; ``info``: form, chunk_count (or segments)."""
    return {
        "format": TWIN_FORMAT,
        "version": MODEL_JSON_VERSION,
        **info,
        "header": header_to_json(cache.header),
        "tensors": tensor_digests(cache),
    }


def compare_tensors(expected: list, actual: list) -> list[str]:
    """Errors comparing reported tensors ({layer, component, shape, sha256}) with the twin's."""
    errors = []
    want = {(t["layer"], t["component"]): t for t in expected}
    got: dict = {}
    for t in actual:
        key = (t.get("layer"), t.get("component"))
        if key in got:
            errors.append(f"tensor layer {key[0]} {key[1]}: reported twice")
        got[key] = t
    for key in sorted(set(got) - set(want), key=str):
        errors.append(f"tensor layer {key[0]} {key[1]}: not stored by this container")
    for key, t in want.items():
        g = got.get(key)
        name = f"tensor layer {key[0]} {key[1]}"
        if g is None:
            errors.append(f"{name}: missing")
            continue
        if list(g.get("shape", [])) != list(t["shape"]):
            errors.append(f"{name}: shape {g.get('shape')}, expected {t['shape']}")
        elif g.get("sha256") != t["sha256"]:
            errors.append(f"{name}: bytes differ (sha256 {str(g.get('sha256'))[:16]}..., expected "
                          f"{t['sha256'][:16]}...; {g.get('nbytes')} bytes, expected {t['nbytes']})")
    return errors
