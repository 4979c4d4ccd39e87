"""The public API is drawn, not implied: it is what the ``__all__`` of each public namespace
lists (the package docstring and docs/api.md say so), and this test pins those lists, so a
name enters or leaves the API only by a deliberate edit here. Every public name exists and
says what it is for, and every public function and method declares its types.

Modules below the namespaces (``kvwire.cache.encoder``, ``kvwire.stream.reader``, ...) are
implementation and may move. Renamed public names keep working as deprecated aliases that
warn; the last tests hold them to that.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import warnings

import pytest

import kvwire

PKG = pathlib.Path(kvwire.__file__).parent

PUBLIC = {
    "kvwire": [
        "__version__", "Architecture", "check_compatible", "ChecksumError", "ChunkEvent", "CodecError",
        "CodecSpec", "covered_tokens", "encode", "Encoder", "EndEvent", "EngineLayout", "Error",
        "FeatureError", "FormatError", "Header", "HeaderError", "HeaderEvent", "iter_buffers", "KVCache",
        "KVScale", "LayerMapEntry", "LayerSpec", "LayoutError", "layouts", "LimitError", "load",
        "load_tensors", "LocalModel", "MagicError", "ModelIdentity", "open", "Plan", "plan",
        "prefix_hashes", "PrefixChain", "PrefixIndex", "probe", "Producer", "Reader", "rope", "RopeParams",
        "save", "save_tensors", "SchemaError", "SparseInfo", "SparseKVCache", "StateTensor", "stream",
        "StreamDecoder", "TokenRange", "TruncatedError", "Verdict", "VersionError",
    ],
    "kvwire.stream": [
        "DecodeWriter", "encode_shared", "fanout", "Layer", "LayerReader", "LayerWriter", "MemorySink",
        "Placed", "read_segments", "Reassembler", "SharedBuffers", "SparseNotSupported", "StreamTimeout",
        "TransferStats",
    ],
    "kvwire.store": [
        "Adapter", "adapter_fingerprint", "codec_fidelity", "default_store_dir", "default_store_url",
        "KeySpace", "KVStore", "LoadResult", "LocalStore", "Lookup", "MemoryStore", "MultimodalItem",
        "open_store", "PutResult", "RedisClusterStore", "RedisStore", "RequestIdentity", "resolve_range",
        "Store", "StoreError", "StoreStats",
    ],
    "kvwire.layouts": [
        "AMX_ROWS", "architecture_of", "AXES", "bind", "bind_vllm", "check_slot_packing", "cpu_amx_views",
        "cpu_header_layout", "CPU_HEADER_LAYOUTS", "CPU_ISAS", "cpu_layout_name", "cpu_vec_views",
        "DEPRECATED", "encode_from_engine", "EngineBuffers", "gather", "gather_cache", "gather_slots",
        "get_layout", "header_for", "iter_buffers_from_engine", "iter_chunks", "kv_cache_layout_name",
        "KV_CACHE_LAYOUTS", "KV_PACKINGS", "LayerGeometry", "layout_names", "LayoutDescriptor",
        "LayoutMismatchError", "LAYOUTS", "needed_hints", "OffloadRing", "PagedLayer", "RingFullError", "SlotPlan",
        "save_from_engine", "scatter", "scatter_slots", "ScatterHandle", "SLOT_PACKINGS",
        "slots_from_blocks", "VLLM_BACKENDS", "vllm_cross_layer_view", "vllm_kv_packing", "vllm_layout_of",
    ],
    "kvwire.rope": [
        "inv_freq", "reposition", "REPOSITIONABLE", "RepositionError", "rope_for_layer", "rotary_dim",
        "shift", "shift_problems",
    ],
    "kvwire.codecs": [
        "BodyEncoder", "byteplane", "check_codec_map", "CodecGrowthWarning", "CodecPlan", "decode_body",
        "decode_chunk", "DEFAULT_ZSTD_LEVEL", "lossy_range", "PRESETS", "quant", "resolve",
    ],
    "kvwire.adapters.hf": [
        "arch_from_config", "from_hf", "from_hf_batch", "identity", "layer_types", "light_identity",
        "local_model", "padding_mask", "rope_from_config", "to_hf", "UnsupportedModelError",
    ],
    "kvwire.integrations.vllm_quantized": [
        "bodies_to_slots", "container_to_per_token_head", "container_to_slots", "FORMATS", "PER_TOKEN_HEAD",
        "per_token_head_to_container", "slot_layout", "SlotLayout", "slots_to_bodies", "slots_to_container",
    ],
    "kvwire.conformance": [
        "CommandImpl", "default_impl_argv", "load_vector_sets", "ReferenceImpl", "Runner", "RunResult",
    ],
}
# Needs vLLM to import: its __all__ and classes are read from the source.
VLLM_CONNECTOR = ("kvwire.integrations.vllm", ["KVConnectorRole", "KVWireConnector", "KVWireMetadata"])

# Public signatures that still lack annotations. The list only shrinks: a new public
# function without annotations fails, and so does an entry here that has been annotated.
UNANNOTATED = {
    "kvwire.store.KVStore.get_cache": ["tokens", "identity"],
    "kvwire.store.KVStore.leading_hits": ["keys"],
    "kvwire.store.KVStore.load": ["tokens", "identity"],
    "kvwire.store.KVStore.lookup": ["tokens", "local", "identity"],
    "kvwire.store.KVStore.put_cache": ["cache", "tokens", "codec", "identity"],
    "kvwire.store.KeySpace.chunk_spaces": ["identity"],
    "kvwire.store.KeySpace.hashes": ["tokens"],
    "kvwire.store.KeySpace.keys": ["tokens", "identity"],
    "kvwire.store.KeySpace.of": ["header", "codec"],
    "kvwire.store.adapter_fingerprint": ["directory"],
    "kvwire.store.codec_fidelity": ["codec"],
    "kvwire.store.open_store": ["options"],
    "kvwire.layouts.EngineBuffers.__init__": ["layout", "buffers"],
    "kvwire.layouts.EngineBuffers.check_ids": ["ids"],
    "kvwire.layouts.EngineBuffers.ids_within": ["ids"],
    "kvwire.layouts.EngineBuffers.tokens_capacity": ["ids"],
    "kvwire.layouts.EngineBuffers.view": ["return"],
    "kvwire.layouts.OffloadRing.__init__": ["stream"],
    "kvwire.layouts.OffloadRing.header": ["fields", "return"],
    "kvwire.layouts.OffloadRing.iter_buffers": ["header_fields", "return"],
    "kvwire.layouts.OffloadRing.page": ["return"],
    "kvwire.layouts.OffloadRing.plan": ["blocks"],
    "kvwire.layouts.OffloadRing.save": ["path", "opts"],
    "kvwire.layouts.ScatterHandle.__init__": ["stream", "events", "ring"],
    "kvwire.layouts.bind": ["layout", "buffers", "kw"],
    "kvwire.layouts.bind_vllm": ["kv_caches", "kv_cache_layout"],
    "kvwire.layouts.cpu_amx_views": ["kv_layer", "return"],
    "kvwire.layouts.cpu_header_layout": ["cpu_isa"],
    "kvwire.layouts.cpu_layout_name": ["cpu_isa"],
    "kvwire.layouts.cpu_vec_views": ["kv_layer", "return"],
    "kvwire.layouts.encode_from_engine": ["ids", "opts"],
    "kvwire.layouts.gather": ["ids"],
    "kvwire.layouts.gather_cache": ["ids", "header_fields"],
    "kvwire.layouts.gather_slots": ["kv_layer", "slot_ids"],
    "kvwire.layouts.get_layout": ["name"],
    "kvwire.layouts.header_for": ["fields"],
    "kvwire.layouts.iter_buffers_from_engine": ["ids", "header_fields", "return"],
    "kvwire.layouts.iter_chunks": ["ids", "return"],
    "kvwire.layouts.kv_cache_layout_name": ["value"],
    "kvwire.layouts.save_from_engine": ["path", "ids", "opts"],
    "kvwire.layouts.scatter": ["reader", "ids", "kw", "return"],
    "kvwire.layouts.scatter_slots": ["kv_layer", "slot_ids"],
    "kvwire.layouts.slots_from_blocks": ["block_ids"],
    "kvwire.layouts.vllm_cross_layer_view": ["kv_caches", "return"],
    "kvwire.layouts.vllm_layout_of": ["kv_caches", "kv_cache_layout"],
    "kvwire.adapters.hf.arch_from_config": ["config"],
    "kvwire.adapters.hf.from_hf": ["cache", "model", "attention_mask", "position_ids"],
    "kvwire.adapters.hf.from_hf_batch": ["cache", "model", "attention_mask", "position_ids"],
    "kvwire.adapters.hf.identity": ["model", "tokenizer"],
    "kvwire.adapters.hf.layer_types": ["config"],
    "kvwire.adapters.hf.light_identity": ["model"],
    "kvwire.adapters.hf.local_model": ["model", "tokenizer", "kw", "return"],
    "kvwire.adapters.hf.padding_mask": ["device", "return"],
    "kvwire.adapters.hf.rope_from_config": ["config"],
    "kvwire.adapters.hf.to_hf": ["model", "return"],
    "kvwire.integrations.vllm_quantized.bodies_to_slots": ["k_body", "v_body"],
    "kvwire.integrations.vllm_quantized.container_to_per_token_head": ["data"],
    "kvwire.integrations.vllm_quantized.container_to_slots": ["data"],
    "kvwire.integrations.vllm_quantized.per_token_head_to_container": ["header", "layers"],
    "kvwire.integrations.vllm_quantized.slots_to_bodies": ["slots"],
    "kvwire.integrations.vllm_quantized.slots_to_container": ["header", "layers"],
}

# Public classes whose docstring is still the one a dataclass generates; only shrinks, too.
UNDOCUMENTED = {
    "kvwire.LayerMapEntry", "kvwire.ModelIdentity", "kvwire.Producer", "kvwire.TokenRange",
    "kvwire.store.LoadResult", "kvwire.store.PutResult",
}

DEPRECATED = {  # old public name -> new, each the same object, with a DeprecationWarning
    "kvwire.stream.Reader": "kvwire.stream.LayerReader",
    "kvwire.stream.Writer": "kvwire.stream.LayerWriter",
    "kvwire.stream.MemoryStore": "kvwire.stream.MemorySink",
    "kvwire.cache.encoder.encode": "kvwire.cache.encoder.encode_bytes",
}


def namespace(name: str):
    """A namespace by its public name (``kvwire.rope`` is an attribute, not a module path)."""
    parts = name.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 2):
        obj = getattr(obj, part) if hasattr(obj, part) else importlib.import_module(".".join(parts[:i]))
    return obj


def _own_doc(obj) -> str | None:
    """The docstring an object was written with: not one inherited or generated (a
    dataclass or NamedTuple without one gets its signature as ``__doc__``)."""
    doc = vars(obj).get("__doc__") if inspect.isclass(obj) else obj.__doc__
    if inspect.isclass(obj) and doc and doc.startswith(f"{obj.__name__}("):
        return None
    return doc


def _missing(func, *, is_init: bool = False, is_property: bool = False) -> list[str]:
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return []
    if is_property:
        return ["return"] if sig.return_annotation is inspect.Signature.empty else []
    out = [n for n, p in sig.parameters.items() if n not in ("self", "cls") and p.annotation is inspect.Parameter.empty]
    if not is_init and sig.return_annotation is inspect.Signature.empty:
        out.append("return")
    return out


def unannotated(ns_name: str) -> dict[str, list[str]]:
    """Public functions of a namespace, and public methods of its classes (written in kvwire),
    whose signature lacks an annotation: name -> the parameters (and "return") without."""
    ns, out = namespace(ns_name), {}
    for name in ns.__all__:
        obj = getattr(ns, name)
        if inspect.isfunction(obj):
            if miss := _missing(obj):
                out[f"{ns_name}.{name}"] = miss
        elif inspect.isclass(obj) and obj.__module__.startswith("kvwire"):
            for attr, raw in vars(obj).items():
                if attr.startswith("_") and attr != "__init__":
                    continue
                prop = isinstance(raw, property)
                func = raw.fget if prop else getattr(raw, "__func__", raw)
                if not inspect.isfunction(func) or not func.__module__.startswith("kvwire"):
                    continue  # generated (dataclass, NamedTuple) or inherited from elsewhere
                if miss := _missing(func, is_init=attr == "__init__", is_property=prop):
                    out[f"{ns_name}.{name}.{attr}"] = miss
    return out


def _vllm_source() -> ast.Module:
    return ast.parse((PKG / "integrations" / "vllm.py").read_text())


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_all_is_the_pinned_surface(name):
    """Adding or removing a public name is an edit of PUBLIC (and of the docs), never a side
    effect of an import."""
    listed = namespace(name).__all__
    assert len(listed) == len(set(listed)), f"{name}.__all__ lists a name twice"
    assert sorted(listed) == sorted(PUBLIC[name]), (
        f"{name}.__all__ changed: added {sorted(set(listed) - set(PUBLIC[name]))}, "
        f"removed {sorted(set(PUBLIC[name]) - set(listed))}")


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_every_listed_name_exists(name):
    ns = namespace(name)
    assert [n for n in ns.__all__ if not hasattr(ns, n)] == []


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_every_public_name_says_what_it_is_for(name):
    ns = namespace(name)
    undocumented = {f"{name}.{n}" for n in ns.__all__ if (inspect.isclass(obj := getattr(ns, n))
                    or inspect.isfunction(obj) or inspect.ismodule(obj)) and not (_own_doc(obj) or "").strip()}
    known = {k for k in UNDOCUMENTED if k.rpartition(".")[0] == name}
    assert sorted(undocumented - known) == [], f"{name}: no docstring on {sorted(undocumented - known)}"
    assert sorted(known - undocumented) == [], f"documented now, remove from UNDOCUMENTED: {sorted(known - undocumented)}"


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_signatures_are_annotated(name):
    found = unannotated(name)
    known = [k for k in UNANNOTATED if max((ns for ns in PUBLIC if k.startswith(ns + ".")), key=len) == name]
    new = sorted(set(found) - set(UNANNOTATED))
    assert new == [], f"public signatures without annotations: {[(k, found[k]) for k in new]}"
    done = sorted(k for k in known if k not in found)
    assert done == [], f"annotated now, remove from UNANNOTATED: {done}"


def test_the_vllm_connector_surface():
    """kvwire.integrations.vllm imports vLLM, so its surface is read from the source."""
    tree = _vllm_source()
    listed = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                  and any(getattr(t, "id", None) == "__all__" for t in n.targets))
    assert sorted(listed) == VLLM_CONNECTOR[1]
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    for name in listed:
        if name in classes:  # KVConnectorRole is vLLM's, re-exported for the config
            assert ast.get_docstring(classes[name]), f"{name} has no docstring"


def test_the_checks_can_fail():
    """The helpers see what they are meant to: a function without annotations, a generated
    docstring."""
    from dataclasses import dataclass

    def bare(x, *, y=1):
        return x

    @dataclass
    class Plain:
        a: int

    assert _missing(bare) == ["x", "y", "return"]
    assert _own_doc(Plain) is None
    assert _own_doc(kvwire.KVCache)


@pytest.mark.parametrize("old", sorted(DEPRECATED))
def test_deprecated_names_still_work_and_warn(old):
    new = DEPRECATED[old]
    module, _, attr = old.rpartition(".")
    with pytest.warns(DeprecationWarning, match=new.rsplit(".", 1)[1]):
        value = getattr(namespace(module), attr)
    assert value is namespace(new.rpartition(".")[0]).__dict__[new.rpartition(".")[2]]
    assert attr not in getattr(namespace(module), "__all__", [])


def test_deprecated_names_import_with_from():
    with pytest.warns(DeprecationWarning):
        from kvwire.stream import Reader  # noqa: F401 (importing is the check)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from kvwire.stream import LayerReader  # noqa: F401 (importing is the check)
    with pytest.raises(AttributeError, match="no attribute 'Readr'"):
        kvwire.stream.Readr  # noqa: B018 (the attribute access is what raises)


def test_one_encode():
    """``kvwire.encode`` is the one public encode: no public namespace lists another."""
    holders = [name for name in PUBLIC if "encode" in PUBLIC[name]]
    assert holders == ["kvwire"]


def test_packages_outside_the_api_say_so():
    """A subpackage of kvwire is a public namespace (PUBLIC, or the parent of one: adapters,
    integrations) or says in its docstring that it is not one, so help() and the source tell
    a reader which imports are API."""
    namespaces = set(PUBLIC) | {VLLM_CONNECTOR[0]}
    parents = {n.rsplit(".", 1)[0] for n in namespaces if n.count(".") > 1}
    for init in sorted(PKG.glob("*/__init__.py")):
        name = f"kvwire.{init.parent.name}"
        if name in namespaces or name in parents:
            continue
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "Not a public namespace" in doc, f"{name}: public (add it to PUBLIC) or say 'Not a public namespace'"
