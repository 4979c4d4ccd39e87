"""Fingerprints (spec/crossmodel.md section 3, KVW-ID-*) and the ModelIdentity header fields."""

from __future__ import annotations

import hashlib
import json
import math
import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import forge
import kvwire
from kvwire.format.errors import SchemaError
from kvwire.format.header import parse_header
from kvwire.model import identity as I

ARCH = kvwire.Architecture.uniform(3, 2, 8)


def sha(*parts: bytes) -> bytes:
    return hashlib.sha256(b"".join(parts)).digest()


# ---------------------------------------------------------------------------------------
# Canonical JSON (KVW-ID-3)
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, text", [
    (1.0, "1"), (100.0, "100"), (2.5, "2.5"), (-1.25, "-1.25"), (0.1, "0.1"), (-0.0, "0"), (1e-6, "0.000001"),
    (1e-7, "1e-7"), (1.5e-7, "1.5e-7"), (1e21, "1e+21"), (1e20, "100000000000000000000"), (123e-20, "1.23e-18"),
    (5e-324, "5e-324"), (1.7976931348623157e308, "1.7976931348623157e+308"), (333333333.3333333, "333333333.3333333"),
    (4.5e15, "4500000000000000"), (10000.0, "10000"),
])
def test_id3_floats_follow_ecmascript(value, text):
    """KVW-ID-3: floating-point numbers as RFC 8785 / ECMAScript Number::toString."""
    assert I.canonical_json(value) == text.encode()


def test_id3_integers_exact_and_objects_sorted_by_utf16():
    """KVW-ID-3: integers exact (beyond 2^53), keys sorted by UTF-16 code units, no whitespace."""
    assert I.canonical_json(2**64 - 1) == b"18446744073709551615"
    assert I.canonical_json(-(2**63)) == b"-9223372036854775808"
    assert I.canonical_json(10**30) == b"1" + b"0" * 30  # exact, where the float 1e30 is "1e+30"
    assert I.canonical_json(1e30) == b"1e+30"
    # U+1F600 is D83D DE00 in UTF-16, so it sorts before U+FF61 (code-point order would put it after)
    doc = {"\uff61": 1, "\U0001F600": 2, "b": [True, None, "x\n\"\\\u0001\u007f"], "a": {"z": 0, "y": 1.5}}
    assert I.canonical_json(doc) == (
        '{"a":{"y":1.5,"z":0},"b":[true,null,"x\\n\\"\\\\\\u0001\u007f"],"\U0001F600":2,"\uff61":1}').encode()
    assert I.canonical_json({"k": "é"}) == b'{"k":"\xc3\xa9"}'  # raw UTF-8, no \u escape


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, b"x", {1: 2}, "\ud800", {"k": object()}])
def test_id3_values_without_canonical_form(bad):
    """KVW-ID-3: NaN, infinities, bytes, non-string keys, lone surrogates."""
    with pytest.raises(ValueError):
        I.canonical_json(bad)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(exclude_categories=("Cs",))),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(json_values)
def test_id3_canonical_json_is_json_and_a_fixed_point(value):
    """KVW-ID-3: the output parses as JSON, and re-canonicalizing the parse gives the same bytes."""
    text = I.canonical_json(value)
    assert I.canonical_json(json.loads(text)) == text


@settings(max_examples=300, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=False))
def test_id3_floats_round_trip(x):
    """KVW-ID-3: the float text is a shortest round-trip form."""
    assert float(I.canonical_json(x)) == x


# ---------------------------------------------------------------------------------------
# Config, tokenizer, weights (KVW-ID-2, 4, 5, 6)
# ---------------------------------------------------------------------------------------

def test_id4_config_fingerprint():
    """KVW-ID-2, KVW-ID-4: tagged SHA-256 of the canonical JSON without run-specific top-level keys."""
    cfg = {"hidden_size": 64, "rope_theta": 10000.0, "_name_or_path": "/tmp/x", "transformers_version": "5.24.0",
           "torch_dtype": "bfloat16", "dtype": "bfloat16", "use_cache": True, "sub": {"_keep": 1}}
    assert I.config_fingerprint(cfg) == sha(b"kvwire.config.v1\0", b'{"hidden_size":64,"rope_theta":10000,'
                                                                   b'"sub":{"_keep":1}}')
    assert I.config_fingerprint(dict(reversed(list(cfg.items())))) == I.config_fingerprint(cfg)
    assert I.config_fingerprint({**cfg, "hidden_size": 65}) != I.config_fingerprint(cfg)


def test_id5_tokenizer_fingerprint():
    """KVW-ID-5: vocabulary, special tokens and extra (merges) all count."""
    vocab = {"a": 0, "b": 1, "ab": 2}
    fp = I.tokenizer_fingerprint(vocab, special_tokens={"eos_token": "b"}, extra={"merges": ["a b"]})
    assert fp == sha(b"kvwire.tokenizer.v1\0",
                     b'{"extra":{"merges":["a b"]},"special_tokens":{"eos_token":"b"},"vocab":{"a":0,"ab":2,"b":1}}')
    assert I.tokenizer_fingerprint(vocab) == sha(b"kvwire.tokenizer.v1\0",
                                                 b'{"extra":{},"special_tokens":{},"vocab":{"a":0,"ab":2,"b":1}}')
    assert I.tokenizer_fingerprint(vocab, special_tokens={"eos_token": "b"}, extra={"merges": ["b a"]}) != fp


def record(name: str, dtype: str, shape, raw: bytes) -> bytes:
    """A tensor record of KVW-ID-6, built independently of the implementation."""
    n = name.encode()
    return (struct.pack("<I", len(n)) + n + struct.pack("<B", len(dtype)) + dtype.encode()
            + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in shape)
            + struct.pack("<Q", len(raw)) + raw)


def test_id6_weights_fingerprint_matches_the_record_definition():
    """KVW-ID-6: u64 count, then records sorted by UTF-8 name bytes."""
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([1, 0, 1], dtype=np.bool_)
    s = np.float16(3.5).reshape(())  # 0-d
    want = sha(b"kvwire.weights.v1\0", struct.pack("<Q", 3), record("Z.b", "bool", (3,), b.tobytes()),
               record("a.w", "f32", (2, 3), a.tobytes()), record("s", "f16", (), s.tobytes()))
    assert I.weights_fingerprint([("a.w", a), ("s", s), ("Z.b", b)]) == want
    assert I.weights_fingerprint(iter([("Z.b", b), ("s", s), ("a.w", a)])) == want
    assert I.weights_fingerprint([("a.w", a.astype(">f4")), ("s", s), ("Z.b", b)]) == want  # bytes are little-endian
    assert I.weights_fingerprint([("a.w", np.asfortranarray(a)), ("s", s), ("Z.b", b)]) == want  # C order
    assert I.weights_fingerprint([("a.w", a.reshape(3, 2)), ("s", s), ("Z.b", b)]) != want  # shape counts


def test_id6_weights_fingerprint_torch_equals_numpy():
    """KVW-ID-6: the digest depends on names, dtypes, shapes and bytes only, not on the array library."""
    torch = pytest.importorskip("torch")
    t = torch.randn(4, 5, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    n = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    assert I.weights_fingerprint([("w", t), ("e", torch.zeros(0))]) == \
        I.weights_fingerprint([("w", n), ("e", np.zeros(0, np.float32))])
    assert I.weights_fingerprint([("w", t.t())]) == I.weights_fingerprint([("w", np.ascontiguousarray(n.T))])


def test_id6_weights_fingerprint_rejects_duplicates_and_unknown_dtypes():
    with pytest.raises(ValueError):
        I.weights_fingerprint([("w", np.zeros(2)), ("w", np.zeros(2))])
    with pytest.raises(ValueError):
        I.weights_fingerprint([("w", np.zeros(2, np.complex64))])


# ---------------------------------------------------------------------------------------
# Per-layer fingerprints (KVW-ID-7, KVW-ID-8)
# ---------------------------------------------------------------------------------------

def toy_model(seed: int = 0, layers: int = 4) -> dict:
    rng = np.random.default_rng(seed)
    w = {"model.embed_tokens.weight": rng.standard_normal((16, 8)).astype(np.float32),
         "model.norm.weight": np.ones(8, np.float32), "lm_head.weight": rng.standard_normal((16, 8)).astype(np.float32)}
    for i in range(layers):
        w[f"model.layers.{i}.self_attn.k_proj.weight"] = rng.standard_normal((8, 8)).astype(np.float32)
        w[f"model.layers.{i}.mlp.up_proj.weight"] = rng.standard_normal((8, 8)).astype(np.float32)
    return w


def layer_fps(w: dict, layers: int = 4) -> list[bytes]:
    out = I.layer_weights_fingerprints(w.items(), I.hf_layer_of, layers)
    assert len(out) == 32 * layers
    return [out[32 * i:32 * i + 32] for i in range(layers)]


def test_id7_layer_chain_definition():
    """KVW-ID-7: c_in over the input group, c_i = SHA-256(tag || c_{i-1} || u32le(i) || records of layer i)."""
    w = toy_model()
    tag = b"kvwire.layer-weights.v1\0"
    emb = w["model.embed_tokens.weight"]
    c = sha(tag, struct.pack("<Q", 1), record("model.embed_tokens.weight", "f32", emb.shape, emb.tobytes()))
    for i in range(4):
        names = sorted(n for n in w if n.startswith(f"model.layers.{i}."))
        c = sha(tag, c, struct.pack("<I", i), struct.pack("<Q", len(names)),
                *(record(n, "f32", w[n].shape, w[n].tobytes()) for n in names))
        assert layer_fps(w)[i] == c


def test_id7_fine_tune_of_top_layers_keeps_lower_entries():
    """KVW-ID-7: changing layer 2 changes entries 2.. only; embeddings change all; the LM head none."""
    w, base = toy_model(), layer_fps(toy_model())
    top = {**w, "model.layers.2.mlp.up_proj.weight": w["model.layers.2.mlp.up_proj.weight"] + 1}
    assert [a == b for a, b in zip(layer_fps(top), base)] == [True, True, False, False]
    emb = {**w, "model.embed_tokens.weight": w["model.embed_tokens.weight"] * 2}
    assert not any(a == b for a, b in zip(layer_fps(emb), base))
    head = {**w, "lm_head.weight": w["lm_head.weight"] * 2, "model.norm.weight": w["model.norm.weight"] * 2}
    assert layer_fps(head) == base
    with pytest.raises(ValueError):
        I.layer_weights_fingerprints(w.items(), I.hf_layer_of, 3)  # model.layers.3 is outside 3 layers


@pytest.mark.parametrize("name, group", [
    ("model.layers.12.self_attn.q_proj.weight", 12), ("transformer.h.3.attn.c_attn.weight", 3),
    ("layers.0.mixer.A_log", 0), ("model.language_model.layers.7.mlp.gate.weight", 7),
    ("encoder.layer.5.output.dense.weight", 5), ("model.embed_tokens.weight", -1), ("transformer.wte.weight", -1),
    ("transformer.wpe.weight", -1), ("model.embed_tokens_per_layer.weight", -1), ("lm_head.weight", None),
    ("model.norm.weight", None), ("model.mylayers.3.x", None),
])
def test_id8_hugging_face_grouping(name, group):
    """KVW-ID-8: layer index from `layers.<i>.`-style components, embeddings to input, the rest to none."""
    assert I.hf_layer_of(name) == group


# ---------------------------------------------------------------------------------------
# Compat fingerprint (KVW-ID-9) and ModelIdentity in the header (KVW-ID-10, KVW-HDR-20)
# ---------------------------------------------------------------------------------------

def test_id9_compat_fingerprint_definition():
    """KVW-ID-9: tagged SHA-256 of the canonical JSON document, every layer and field spelled out."""
    arch = kvwire.Architecture((kvwire.LayerSpec("full_attention", 1, 4, 4),), keys_post_rope=True)
    layer = ('{"head_dim_k":4,"head_dim_v":4,"kind":"full_attention","kv_lora_rank":0,"num_kv_heads":1,'
             '"qk_rope_head_dim":0,"rope":null,"source_layer":-1,"state_tensors":[],"uses_rope":true,"window":0}')
    doc = ('{"arch":{"keys_post_rope":true,"layers":[' + layer + '],"rope":null},"config":"","dtype":"bf16",'
           '"scheme":1,"tokenizer":"0102","weights":"ff"}')
    assert I.compat_fingerprint(arch, "bf16", tokenizer=b"\1\2", weights=b"\xff") == \
        sha(b"kvwire.compat.v1\0", doc.encode())


@pytest.mark.parametrize("change", [
    dict(arch=kvwire.Architecture.uniform(3, 2, 8, keys_post_rope=False)),
    dict(arch=kvwire.Architecture.uniform(3, 2, 8, rope=kvwire.RopeParams(theta=5e5))),
    dict(arch=kvwire.Architecture.uniform(3, 1, 8)), dict(arch=kvwire.Architecture.uniform(2, 2, 8)),
    dict(dtype="f16"), dict(tokenizer=b"t" * 31 + b"u"), dict(weights=b"v" * 32), dict(config=b"c" * 32),
])
def test_id9_compat_fingerprint_covers_every_input(change):
    kw = dict(arch=ARCH, dtype="bf16", tokenizer=b"t" * 32, weights=b"w" * 32, config=b"")
    base = I.compat_fingerprint(kw.pop("arch"), kw.pop("dtype"), **kw)
    kw = {**dict(arch=ARCH, dtype="bf16", tokenizer=b"t" * 32, weights=b"w" * 32, config=b""), **change}
    assert I.compat_fingerprint(kw.pop("arch"), kw.pop("dtype"), **kw) != base


blobs = st.binary(max_size=40)


@settings(max_examples=60, deadline=None)
@given(fw=st.text(max_size=10), ver=st.text(max_size=10), layer_fps=blobs, scheme=st.sampled_from([0, 2, 65535]),
       cfg=blobs, tok=blobs)
def test_hdr20_identity_fields_round_trip(fw, ver, layer_fps, scheme, cfg, tok):
    """ModelIdentity fields 7-10 round-trip; scheme 0 and unknown schemes keep fingerprints opaque (KVW-HDR-20)."""
    fw, ver = fw.replace("\0", ""), ver.replace("\0", "")
    m = kvwire.ModelIdentity("llama", "m/x", "r", cfg, tok, b"", b"", fw, ver, layer_fps, scheme)
    h = forge.small_cache().header.replace(model=m)
    assert parse_header(kvwire.format.header.build_header(h)).model == m


def test_id10_scheme1_lengths_checked():
    """KVW-ID-10: with scheme 1 a fingerprint is 0 or 32 bytes, the layer list 0 or 32 x num_layers."""
    h = forge.small_cache(layers=2).header
    ok = I.make_identity(h.arch, "f16", tokenizer=b"t" * 32, weights=b"w" * 32, layer_weights=b"l" * 64)
    assert parse_header(kvwire.format.header.build_header(h.replace(model=ok))).model == ok
    for bad in (dict(tokenizer_fingerprint=b"t" * 31), dict(compat_fingerprint=b"c" * 33),
                dict(layer_weights_fingerprints=b"l" * 32)):
        hb = forge.header_of(h.replace(model=kvwire.ModelIdentity(fingerprint_scheme=1, **bad)))
        forge.expect(forge.wrap_header(hb), SchemaError, "FINGERPRINT_INVALID", "KVW-ID-10")
    same = kvwire.ModelIdentity(tokenizer_fingerprint=b"t" * 31, layer_weights_fingerprints=b"x" * 5)
    assert parse_header(kvwire.format.header.build_header(h.replace(model=same))).model == same  # scheme 0: opaque


def test_make_identity_and_framework_strings_checked_by_the_writer():
    h = forge.small_cache().header
    with pytest.raises(ValueError):
        kvwire.format.header.build_header(h.replace(model=kvwire.ModelIdentity(framework="a\0b")))
    m = I.make_identity(h.arch, "f16", tokenizer=b"t" * 32, weights=b"w" * 32, framework="transformers",
                        framework_version="5.24.0", model_id="x/y")
    assert m.fingerprint_scheme == 1 and m.compat_fingerprint == I.compat_fingerprint(
        h.arch, "f16", tokenizer=b"t" * 32, weights=b"w" * 32)
    assert (m.framework, m.framework_version, m.model_id) == ("transformers", "5.24.0", "x/y")
