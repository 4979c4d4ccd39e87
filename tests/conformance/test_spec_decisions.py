"""The decisions of the 1.4 text clarifications (spec/kvwire-v1.md Appendix D, "1.4,
clarifications") hold in the reference codec, and the spec's tables agree with the code.

Each test names the rule it pins. The conformance vectors of the ``clarifications_1_4`` set
pin the same decisions for every implementation; these tests pin the reference's side and
the two tables (preset names, store key rows) that are normative text.
"""

from __future__ import annotations

import re
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import pytest

import forge
import kvwire
from kvwire import CodecSpec
from kvwire.codecs.presets import PRESETS
from kvwire.format import registry as R
from kvwire.format.header import Architecture, Header, LayerSpec
from kvwire.store.keys import KeySpace

ROOT = Path(__file__).resolve().parents[2]
SPECS_BIT, SCALES_BIT, ROT_BIT, TQ_BIT = (R.REQUIRED_FEATURES[n] for n in
                                          ("codec_specs", "kv_scales", "rotation", "turboquant"))


def _section(doc: str, start: str, end: str) -> str:
    text = (ROOT / "spec" / doc).read_text()
    return text[text.index(start):text.index(end, text.index(start))]


# ---------------------------------------------------------------------------------------
# KVW-CSPEC-12: the preset names table is the reference's PRESETS
# ---------------------------------------------------------------------------------------

def _parse_spec_cell(cell: str):
    cell = cell.strip()
    if cell.startswith("none"):
        return "raw"
    words = cell.strip("`").split()
    kw = {}
    types = {f.name: f.type for f in fields(CodecSpec)}
    for w in words[1:]:
        name, value = w.split("=")
        t = types[name]
        kw[name] = (value == "true") if t == "bool" else int(value, 0) if t == "int" else value
    return CodecSpec(words[0], **kw)


def test_cspec12_preset_table_is_the_reference_presets():
    table = _section("codecs.md", '<a id="kvw-cspec-12"></a>', "### 6.1")
    rows = re.findall(r"^\| `([a-z0-9-]+)` \| ([a-z, ]+) \| (.+?) \|$", table, re.M)
    assert rows
    got: dict = {}
    for name, comps, cell in rows:
        for comp in comps.split(", "):
            assert (name, comp) not in got, (name, comp)
            got[(name, comp)] = _parse_spec_cell(cell)
    want = {}
    for name, p in PRESETS.items():
        for comp in ("k", "v", "latent"):
            want[(name, comp)] = p if isinstance(p, CodecSpec) else p.get(comp, "raw")
    assert got == want


def test_cspec12_lossy_names_only_for_float_dtypes():
    """KVW-CSPEC-12 / KVW-CSPEC-6: a lossy preset on an fp8 cache is refused by the writer."""
    cache = forge.small_cache(1, 2, 8, 8, dtype="f8_e4m3fn", chunk_tokens=4)
    with pytest.raises((ValueError, kvwire.FormatError), match="CSPEC-6|bf16, f16 or f32"):
        kvwire.encode(cache, codec="kivi2")
    assert kvwire.encode(forge.small_cache(1, 2, 8, 8, dtype="f16", chunk_tokens=4), codec="kivi2")


# ---------------------------------------------------------------------------------------
# KVW-STORE-18: every key row of store.md section 6, derived
# ---------------------------------------------------------------------------------------

def test_store18_every_key_row_of_the_spec():
    table = _section("store.md", '<a id="kvw-store-18"></a>', "## 7. Reading")
    rows = re.findall(r"^\| `(\w+)`, (\d+), `\[(\d+), (\d+)\)`, `tp(\d+)of(\d+)`, `?([a-z0-9-]+)`?(?: \(see below\))? "
                      r"\| ([0-9 …]+) \| (.+) \|$", table, re.M)
    assert len(rows) == 4, rows
    fp = bytes(range(32))
    for dtype, c, a, b, rank, size, fidelity, tokens, keys in rows:
        tokens = list(range(256)) if "…" in tokens else [int(t) for t in tokens.split()]
        want = re.findall(r"`(kvw1/[^`]+)`", keys)
        space = KeySpace(fp, dtype, int(c), (int(a), int(b)), int(rank), int(size), fidelity)
        assert space.keys(tokens) == want, (dtype, fidelity)
    assert any(r[0] == "f16" and r[6] == "kivi2" for r in rows)  # the row a kivi2 object can have


# ---------------------------------------------------------------------------------------
# KVW-ROT-1 / KVW-TQ-1: the 4-bit turboquant preset alone needs bit 4
# ---------------------------------------------------------------------------------------

def test_rot1_tq1_turboquant_4bit_alone_sets_bit_4():
    h = Header(Architecture((LayerSpec("full_attention", 2, 64, 64),)), token_count=8, dtype="bf16", chunk_tokens=8)
    cache = _normal_cache(h)
    data = kvwire.encode(cache, codec="vllm-turboquant-4bit-nc")
    hp = kvwire.probe(data)
    assert hp.required_features == SPECS_BIT | ROT_BIT | TQ_BIT and hp.format_minor == 3
    assert all(s.needs_rotation_bit == (s.rotation != "none" or s.codebook != "uniform") for s in hp.codec_specs)
    forge.read_all(data)
    # without bit 4 the same header is TQ-1's (fields 11-13 are then not read at all)
    hb = forge.header_of(replace(hp, required_features=SPECS_BIT | TQ_BIT))
    with forge.raises_code(kvwire.SchemaError, "CODEC_SPEC_INVALID", "KVW-TQ-1"):
        kvwire.probe(forge.wrap_header(hb, minor=3))


# ---------------------------------------------------------------------------------------
# KVW-HDR-22: a feature-registered layer kind is judged for referenced specs only
# ---------------------------------------------------------------------------------------

def _with_state_spec(referenced: bool) -> bytes:
    cache = forge.small_cache(1, 2, 8, 5, dtype="f16", chunk_tokens=4)
    p = forge.split(kvwire.encode(cache))
    full = {"kind": 0, "num_kv_heads": 2, "head_dim_k": 8, "head_dim_v": 8}
    state = {"kind": R.LAYER_KINDS["state"], "source_layer": -1}
    p.header = forge.fb_header(layers=[full, state], layer_spec_index=[1 if referenced else 0], dtype=1,
                               chunk_tokens=4, token_count=5)
    return forge.assemble(p)


def test_hdr22_unreferenced_state_spec_without_bit_is_accepted():
    assert forge.read_all(_with_state_spec(False)).header.arch.layers[0].kind == "full_attention"


def test_hdr22_referenced_state_spec_without_bit_is_out_of_range():
    with forge.raises_code(kvwire.SchemaError, "ENUM_OUT_OF_RANGE", "KVW-HDR-10"):
        kvwire.probe(_with_state_spec(True))


# ---------------------------------------------------------------------------------------
# KVW-CSPEC-13: the codec-spec check order
# ---------------------------------------------------------------------------------------

def _spec_header(specs, rf) -> bytes:
    h = Header(Architecture((LayerSpec("full_attention", 1, 64, 64),)), token_count=0, dtype="bf16",
               codec_specs=tuple(specs), required_features=rf, format_minor=3)
    return forge.wrap_header(forge.header_of(h), minor=3)


def test_cspec13_without_specs_bit_0_then_4_then_5():
    for rf, exc, code, rule in ((SPECS_BIT | ROT_BIT | TQ_BIT, kvwire.FeatureError, "UNSUPPORTED_FEATURE", "KVW-EVOL-3"),
                                (ROT_BIT | TQ_BIT, kvwire.SchemaError, "CODEC_SPEC_INVALID", "KVW-ROT-1"),
                                (TQ_BIT, kvwire.SchemaError, "CODEC_SPEC_INVALID", "KVW-TQ-1")):
        with forge.raises_code(exc, code, rule):
            kvwire.probe(_spec_header((), rf))


def test_cspec13_spec_rules_before_rot1_and_tq1():
    """Step 3 (a spec's own rules) before step 5 (TQ-1); step 4 (ROT-1) before step 5."""
    bad_bits = CodecSpec("int_affine", bits=5)  # KVW-INT-1
    with forge.raises_code(kvwire.SchemaError, "CODEC_SPEC_INVALID", "KVW-INT-1"):
        kvwire.probe(_spec_header((bad_bits,), SPECS_BIT | TQ_BIT))
    plain = CodecSpec("int_affine", bits=4)
    with forge.raises_code(kvwire.SchemaError, "CODEC_SPEC_INVALID", "KVW-ROT-1"):
        kvwire.probe(_spec_header((plain,), SPECS_BIT | ROT_BIT | TQ_BIT))
    with forge.raises_code(kvwire.SchemaError, "CODEC_SPEC_INVALID", "KVW-CSPEC-10"):
        kvwire.probe(_spec_header((bad_bits,), TQ_BIT))  # step 2 before step 3


def test_cspec13_codec_specs_before_kv_scales():
    """Section 14.1 step 3: TQ-1, the last codec-spec rule, before SCALE-1 (vector clar-tq1-before-kv-scales)."""
    data = (ROOT / "conformance/vectors/1.0/invalid/clar-tq1-before-kv-scales.kvw").read_bytes()
    hp_bits = SPECS_BIT | TQ_BIT | SCALES_BIT  # what the vector sets: no bit 4, bit 3 without kv_scales
    with forge.raises_code(kvwire.SchemaError, "CODEC_SPEC_INVALID", "KVW-TQ-1"):
        kvwire.probe(data)
    tq = PRESETS["vllm-turboquant-4bit-nc"]["k"]
    with forge.raises_code(kvwire.SchemaError, "KV_SCALES_INVALID", "KVW-SCALE-1"):  # with TQ-1 mended
        kvwire.probe(_spec_header((tq,), hp_bits | ROT_BIT))


# ---------------------------------------------------------------------------------------
# KVW-CSPEC-11 (the former second KVW-CSPEC-10): raw_length is the decoded size
# ---------------------------------------------------------------------------------------

def _normal_cache(h: Header) -> kvwire.KVCache:
    """Finite values (random bit patterns would hold NaNs, which a writer stores losslessly)."""
    import ml_dtypes

    rng = np.random.default_rng(1)
    layers = [{c: rng.standard_normal(s.shape(c, h.token_count)).astype(ml_dtypes.bfloat16) for c in s.components}
              for s in h.arch.layers]
    return kvwire.KVCache(h, layers)


def test_cspec11_raw_length_is_the_decoded_size_of_lossy_chunks():
    h = Header(Architecture((LayerSpec("full_attention", 2, 32, 32),)), token_count=8, dtype="bf16", chunk_tokens=4)
    cache = _normal_cache(h)
    with kvwire.open(kvwire.encode(cache, codec="int4-g32")) as r:
        for i in range(r.chunk_count):
            c = r.info(i)
            assert c.codec == "int_affine" and c.raw_length == int(np.prod(c.shape)) * 2 > c.stored_length
