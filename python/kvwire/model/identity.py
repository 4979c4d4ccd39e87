"""Model identity: fingerprints and the two-tier compatibility check (spec/crossmodel.md).

A cache is only reusable by a receiver whose model produces the same keys and values at
the layers it reuses. The *hard tier* is decided from fingerprints that any engine can
compute the same way (so every digest here is SHA-256 over bytes fixed by the spec, never
over Python object reprs); the *soft tier* lists what differs but can be converted by the
receiver (cast, rechunk, head shard, layout permutation, layer map, recomputing layers).
``check_compatible`` reads only the header: nothing here touches a chunk body.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields

import numpy as np

from ..format import registry as R
from ..format.header import Architecture, LayerSpec, ModelIdentity, RopeParams

FINGERPRINT_SCHEME = 1  # ModelIdentity.fingerprint_scheme of the computations below (KVW-ID-1)
DIGEST_SIZE = 32

# Domain-separation tags: each digest starts with its tag, so a config digest can never
# equal a tokenizer digest of other bytes (KVW-ID-2).
TAG_CONFIG = b"kvwire.config.v1\x00"
TAG_TOKENIZER = b"kvwire.tokenizer.v1\x00"
TAG_WEIGHTS = b"kvwire.weights.v1\x00"
TAG_LAYER = b"kvwire.layer-weights.v1\x00"
TAG_COMPAT = b"kvwire.compat.v1\x00"

# Top-level configuration keys that describe the run, not the model (KVW-ID-4).
VOLATILE_CONFIG_KEYS = frozenset({"transformers_version", "dtype", "torch_dtype", "use_cache"})


# ---------------------------------------------------------------------------------------
# Canonical JSON (KVW-ID-3): RFC 8785 (JCS), except that integers are written exactly
# ---------------------------------------------------------------------------------------

def _float_text(x: float) -> str:
    """ECMAScript Number::toString of a finite double, as RFC 8785 requires."""
    if x == 0:
        return "0"
    if x < 0:
        return "-" + _float_text(-x)
    mant, _, exp = repr(x).partition("e")  # repr is the shortest round-trip form
    whole, _, frac = mant.partition(".")
    digits = (whole + frac).lstrip("0")
    point = len(whole) + int(exp or 0)  # decimal point after `point` digits of whole+frac
    point -= len(whole + frac) - len((whole + frac).lstrip("0"))
    digits = digits.rstrip("0")
    k, n = len(digits), point
    if k <= n <= 21:
        return digits + "0" * (n - k)
    if 0 < n <= 21:
        return digits[:n] + "." + digits[n:]
    if -6 < n <= 0:
        return "0." + "0" * -n + digits
    e = n - 1
    sign = "+" if e >= 0 else "-"
    return (digits if k == 1 else digits[0] + "." + digits[1:]) + "e" + sign + str(abs(e))


def _emit(obj, out: list) -> None:
    if obj is None:
        out.append("null")
    elif obj is True or obj is False or isinstance(obj, np.bool_):
        out.append("true" if obj else "false")
    elif isinstance(obj, (int, np.integer)):
        out.append(str(int(obj)))
    elif isinstance(obj, (float, np.floating)):
        v = float(obj)
        if not math.isfinite(v):
            raise ValueError(f"{v} has no canonical JSON form")
        out.append(_float_text(v))
    elif isinstance(obj, str):
        out.append(json.dumps(obj, ensure_ascii=False))
    elif isinstance(obj, Mapping):
        if not all(isinstance(k, str) for k in obj):
            raise ValueError("canonical JSON object keys must be strings")
        out.append("{")
        for i, k in enumerate(sorted(obj, key=lambda s: s.encode("utf-16-be", "surrogatepass"))):
            if i:
                out.append(",")
            out.append(json.dumps(k, ensure_ascii=False))
            out.append(":")
            _emit(obj[k], out)
        out.append("}")
    elif isinstance(obj, (list, tuple)):
        out.append("[")
        for i, v in enumerate(obj):
            if i:
                out.append(",")
            _emit(v, out)
        out.append("]")
    else:
        raise ValueError(f"{type(obj).__name__} has no canonical JSON form")


def canonical_json(obj) -> bytes:
    """The spec's canonical JSON of ``obj`` (KVW-ID-3) as UTF-8 bytes."""
    out: list[str] = []
    _emit(obj, out)
    try:
        return "".join(out).encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate
        raise ValueError(f"string is not valid Unicode: {exc}") from None


def _sha(*parts: bytes) -> bytes:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.digest()


# ---------------------------------------------------------------------------------------
# Fingerprints (KVW-ID-*)
# ---------------------------------------------------------------------------------------

def config_fingerprint(config: Mapping) -> bytes:
    """SHA-256 of the canonical JSON of a model configuration (KVW-ID-4).

    Top-level keys starting with "_" and ``VOLATILE_CONFIG_KEYS`` are left out: they name
    the run (library version, load dtype, local path), not the model.
    """
    kept = {k: v for k, v in config.items() if not (k.startswith("_") or k in VOLATILE_CONFIG_KEYS)}
    return _sha(TAG_CONFIG, canonical_json(kept))


def tokenizer_fingerprint(vocab: Mapping[str, int], *, special_tokens: Mapping[str, object] = {},
                          extra: Mapping = {}) -> bytes:
    """SHA-256 over the vocabulary, special tokens and anything else that maps text to ids (KVW-ID-5).

    ``extra`` carries what the vocabulary alone does not fix: BPE merges, normalizer and
    pre-tokenizer settings, added-token flags.
    """
    doc = {"vocab": dict(vocab), "special_tokens": dict(special_tokens), "extra": dict(extra)}
    return _sha(TAG_TOKENIZER, canonical_json(doc))


# dtype names in weight records: the kvwire dtype registry names, plus wider types
_NP_DTYPE_NAMES = {np.dtype(np.float64): "f64", np.dtype(np.int16): "i16", np.dtype(np.int32): "i32",
                   np.dtype(np.int64): "i64", np.dtype(np.uint16): "u16", np.dtype(np.uint32): "u32",
                   np.dtype(np.uint64): "u64", np.dtype(np.bool_): "bool"}  # + the registry's, on first use
_TORCH_DTYPE_NAMES = {
    "bfloat16": "bf16", "float16": "f16", "float32": "f32", "float64": "f64", "float8_e4m3fn": "f8_e4m3fn",
    "float8_e5m2": "f8_e5m2", "float8_e4m3fnuz": "f8_e4m3fnuz", "int8": "i8", "uint8": "u8", "int16": "i16",
    "int32": "i32", "int64": "i64", "uint16": "u16", "uint32": "u32", "uint64": "u64", "bool": "bool",
}


def _tensor_record(x) -> tuple[str, tuple[int, ...], memoryview]:
    """(dtype name, shape, little-endian C-order bytes) of a numpy array or torch tensor."""
    if type(x).__module__.split(".")[0] == "torch":
        name = _TORCH_DTYPE_NAMES.get(str(x.dtype).removeprefix("torch."))
        if name is None:
            raise ValueError(f"tensor dtype {x.dtype} has no weights-fingerprint name")
        import torch

        t = x.detach().to("cpu").contiguous()
        shape = tuple(int(s) for s in t.shape)
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
        return name, shape, raw.data.cast("B")
    a = np.asarray(x)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    name = _NP_DTYPE_NAMES.get(a.dtype)
    if name is None:
        name = next((n for n, d in R.DTYPES.items() if d.numpy == a.dtype), None)
    if name is None:
        raise ValueError(f"array dtype {a.dtype} has no weights-fingerprint name")
    return name, a.shape, np.ascontiguousarray(a).reshape(-1).view(np.uint8).data


def _hash_tensors(h, named: list[tuple[str, object]]) -> None:
    """Feed tensor records, sorted by the UTF-8 bytes of their names, into ``h`` (KVW-ID-6)."""
    named = sorted(named, key=lambda nt: nt[0].encode("utf-8"))
    h.update(struct.pack("<Q", len(named)))
    prev = None
    for name, x in named:
        key = name.encode("utf-8")
        if key == prev:
            raise ValueError(f"tensor name {name!r} appears twice")
        prev = key
        dtype, shape, raw = _tensor_record(x)
        h.update(struct.pack("<I", len(key)) + key + struct.pack("<B", len(dtype)) + dtype.encode("ascii"))
        h.update(struct.pack(f"<I{len(shape)}Q", len(shape), *shape) + struct.pack("<Q", raw.nbytes))
        h.update(raw)


def weights_fingerprint(named_tensors: Iterable[tuple[str, object]]) -> bytes:
    """SHA-256 over every (name, tensor) of a model, in name order (KVW-ID-6)."""
    h = hashlib.sha256(TAG_WEIGHTS)
    _hash_tensors(h, list(named_tensors))
    return h.digest()


def layer_weights_fingerprints(named_tensors: Iterable[tuple[str, object]],
                               layer_of: Callable[[str], int | None], num_layers: int) -> bytes:
    """Cumulative per-layer weight digests, 32 bytes per layer (KVW-ID-7).

    ``layer_of(name)`` is the layer a tensor belongs to, -1 for a tensor every layer's
    input depends on (token and position embeddings), None for one no layer's cache
    depends on (final norm, LM head). Entry i chains the inputs and layers 0..i, so two
    models agree on entry i exactly when layer i's cache can be reused: a fine-tune of the
    top layers keeps the lower entries.
    """
    groups: dict[int, list] = {i: [] for i in range(-1, num_layers)}
    for name, x in named_tensors:
        layer = layer_of(name)
        if layer is None:
            continue
        if not -1 <= layer < num_layers:
            raise ValueError(f"layer_of({name!r}) = {layer} outside [-1, {num_layers})")
        groups[layer].append((name, x))
    prev = hashlib.sha256(TAG_LAYER)
    _hash_tensors(prev, groups[-1])
    chain = prev.digest()
    out = bytearray()
    for i in range(num_layers):
        h = hashlib.sha256(TAG_LAYER + chain + struct.pack("<I", i))
        _hash_tensors(h, groups[i])
        chain = h.digest()
        out += chain
    return bytes(out)


_HF_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")
_HF_INPUT = re.compile(r"(?:^|\.)(?:embed_tokens|wte|wpe|embed_positions|word_embeddings|embed_tokens_per_layer"
                       r"|per_layer_model_projection|per_layer_projection_norm)\.")


def hf_layer_of(name: str) -> int | None:
    """Layer of a Hugging Face parameter name for ``layer_weights_fingerprints`` (KVW-ID-8)."""
    m = _HF_LAYER.search(name)
    if m:
        return int(m.group(1))
    if _HF_INPUT.search(name):
        return -1
    return None


def rope_json(r: RopeParams | None):
    if r is None:
        return None
    return {f.name: list(getattr(r, f.name)) if isinstance(getattr(r, f.name), tuple) else getattr(r, f.name)
            for f in fields(RopeParams)}


def layer_spec_json(s: LayerSpec) -> dict:
    out = {}
    for f in fields(LayerSpec):
        v = getattr(s, f.name)
        if f.name == "rope":
            v = rope_json(v)
        elif f.name == "state_tensors":
            v = [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype} for t in v]
        out[f.name] = v
    return out


def arch_json(arch: Architecture) -> dict:
    """The architecture as the compat fingerprint sees it (KVW-ID-9): every layer spelled out."""
    return {"layers": [layer_spec_json(s) for s in arch.layers], "rope": rope_json(arch.rope),
            "keys_post_rope": arch.keys_post_rope}


def compat_fingerprint(arch: Architecture, dtype: str, *, tokenizer: bytes, weights: bytes,
                       config: bytes = b"") -> bytes:
    """SHA-256 of exactly what makes two models' caches interchangeable (KVW-ID-9)."""
    if dtype not in R.DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}")
    doc = {"scheme": FINGERPRINT_SCHEME, "arch": arch_json(arch), "dtype": dtype,
           "tokenizer": bytes(tokenizer).hex(), "weights": bytes(weights).hex(), "config": bytes(config).hex()}
    return _sha(TAG_COMPAT, canonical_json(doc))


def make_identity(arch: Architecture, dtype: str, *, tokenizer: bytes, weights: bytes, config: bytes = b"",
                  layer_weights: bytes = b"", **names) -> ModelIdentity:
    """A ModelIdentity with every fingerprint filled in and the compat fingerprint computed."""
    return ModelIdentity(
        config_fingerprint=config, tokenizer_fingerprint=tokenizer, weights_fingerprint=weights,
        compat_fingerprint=compat_fingerprint(arch, dtype, tokenizer=tokenizer, weights=weights, config=config),
        layer_weights_fingerprints=layer_weights, fingerprint_scheme=FINGERPRINT_SCHEME, **names)


__all__ = [
    "FINGERPRINT_SCHEME", "arch_json", "canonical_json",
    "compat_fingerprint", "config_fingerprint", "hf_layer_of", "layer_weights_fingerprints", "make_identity",
    "tokenizer_fingerprint", "weights_fingerprint",
]
