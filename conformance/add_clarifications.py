"""Conformance vectors of the 1.4 text clarifications (spec/kvwire-v1.md Appendix D, "1.4,
clarifications"), appended to the major-1 folder with ``generate.py --add clarifications_1_4``.

Where the text contradicted itself, the decision is what the reference reader and libkvwire
already did; each vector pins one decision so that a reader written from the text alone
cannot take the other reading:

* ``valid/clar-turboquant-4bit-only`` (codecs.md KVW-ROT-1, KVW-TQ-1): a container whose
  only revision-1.3 spec is the 4-bit turboquant key spec sets bit 4 (no hadamard, no
  gaussian, no 3-bit codes in it);
* ``valid/clar-unreferenced-state-spec-without-bit`` (KVW-HDR-22, KVW-ARCH-10): a layer spec
  of kind ``state`` that no layer refers to, without required bit 2, is accepted;
* ``invalid/clar-tq1-before-kv-scales`` (codecs.md KVW-CSPEC-13, section 14.1 step 3): bit 5
  without bit 4 and bit 3 without ``kv_scales``: TQ-1 (codec specs) is reported before
  SCALE-1 (kv scales);
* ``invalid/clar-lossy-spec-on-f8-e4m3fn`` (codecs.md KVW-CSPEC-6, store.md KVW-STORE-18):
  ``kivi2`` on an fp8 cache, what the frozen store key row ``f8_e4m3fn`` / ``kivi2`` would
  need; readers refuse it, so no object exists under that key.
"""

from __future__ import annotations

import forge
import kvwire
from add_codecs import PRODUCER, _cache, expected
from kvwire import CodecSpec
from kvwire.codecs import PRESETS
from kvwire.format import registry as R
from kvwire.format.header import Architecture, Header, LayerSpec

SPECS_BIT, SCALES_BIT, ROT_BIT, TQ_BIT = (R.REQUIRED_FEATURES[n] for n in
                                          ("codec_specs", "kv_scales", "rotation", "turboquant"))


def gen_clarifications(g) -> None:
    """Appendix D, 1.4 clarifications: one vector per decision that changes what a reader does."""
    # (1) KVW-ROT-1 / KVW-TQ-1: the 4-bit turboquant preset alone
    h = Header(Architecture((LayerSpec("full_attention", 2, 64, 64),)), token_count=20, dtype="bf16",
               chunk_tokens=16, producer=PRODUCER)
    data = kvwire.encode(_cache(h, 7401), codec="vllm-turboquant-4bit-nc", form="file")
    hp = kvwire.probe(data)
    assert hp.required_features == SPECS_BIT | ROT_BIT | TQ_BIT and hp.format_minor == 3
    assert not any(s.bits == 3 or s.rotation == "hadamard" or s.codebook == "gaussian" for s in hp.codec_specs)
    exp = expected(data)
    g.valid("clar-turboquant-4bit-only", data, exp, expect_header=exp.header,
            rules=["KVW-ROT-1", "KVW-TQ-1", "KVW-TQ-4", "KVW-EVOL-12"],
            description="bf16 cache (file form) encoded with vllm-turboquant-4bit-nc alone: no hadamard rotation, no "
                        "gaussian codebook, no 3-bit codes, and still required bits 0, 4 and 5 (fields 11-13 are read "
                        "only with bit 4, and sylvester/turboquant are values other than none/uniform); minor 3")

    # (2) KVW-HDR-22 / KVW-ARCH-10: an unreferenced state spec without bit 2
    h = Header(Architecture((LayerSpec("full_attention", 2, 8, 8),)), token_count=5, dtype="f16", chunk_tokens=4,
               producer=PRODUCER)
    c = _cache(h, 7402)
    p = forge.split(kvwire.encode(c, form="file"))
    full = {"kind": 0, "num_kv_heads": 2, "head_dim_k": 8, "head_dim_v": 8}
    state = {"kind": R.LAYER_KINDS["state"], "source_layer": -1}
    p.header = forge.fb_header(layers=[full, state], layer_spec_index=[0], dtype=R.DTYPES["f16"][0], chunk_tokens=4,
                               token_count=5, producer=(PRODUCER.library, PRODUCER.version))
    data = forge.assemble(p)
    assert kvwire.probe(data).required_features == 0
    g.valid("clar-unreferenced-state-spec-without-bit", data, c,
            rules=["KVW-HDR-22", "KVW-ARCH-10", "KVW-HDR-10", "KVW-EVOL-9"],
            description="layer_specs holds a full_attention spec (layer 0's) and a spec of kind state (5) that no "
                        "layer refers to, in a container without required bit 2 (state_layers): kind 5 is in its "
                        "registry, and the feature check applies to referenced specs only, so it is accepted "
                        "(a referenced one is ENUM_OUT_OF_RANGE: invalid/xm-state1-kind-without-bit)")

    # (3) KVW-CSPEC-13 / section 14.1 step 3: the codec-spec rules (TQ-1 last of them) before the kv scales
    tq = PRESETS["vllm-turboquant-4bit-nc"]["k"]
    hh = Header(Architecture((LayerSpec("full_attention", 1, 64, 64),)), token_count=0, dtype="bf16",
                producer=PRODUCER, codec_specs=(CodecSpec("byteplane_zstd"), tq),
                required_features=SPECS_BIT | ROT_BIT | TQ_BIT, format_minor=3)
    hb = forge.header_of(hh)
    # the same header with bit 4 cleared and bit 3 set (no Header.kv_scales): TQ-1 and SCALE-1 both violated
    hb2 = _set_required(hb, SPECS_BIT | TQ_BIT | SCALES_BIT)
    g.invalid("clar-tq1-before-kv-scales", forge.wrap_header(hb2, minor=3), rule="KVW-TQ-1", code="CODEC_SPEC_INVALID",
              rules=["KVW-CSPEC-13", "KVW-ERR-4", "KVW-SCALE-1"],
              description="required bits 0, 3 and 5 without bit 4 (TQ-1) and without Header.kv_scales (SCALE-1, "
                          "KV_SCALES_INVALID): the codec-spec rules, TQ-1 last among them, come before the kv scales "
                          "(section 14.1 step 3, codecs.md KVW-CSPEC-13)")

    # (4) KVW-CSPEC-6: kivi2 on an fp8 cache (the frozen store key row f8_e4m3fn / kivi2 names no object)
    kivi = PRESETS["kivi2"]
    hh = Header(Architecture((LayerSpec("full_attention", 1, 64, 64),)), token_count=0, dtype="f8_e4m3fn",
                producer=PRODUCER, codec_specs=(kivi["k"], kivi["v"]), required_features=SPECS_BIT)
    g.invalid("clar-lossy-spec-on-f8-e4m3fn", forge.wrap_header(forge.header_of(hh)), rule="KVW-CSPEC-6",
              code="CODEC_SPEC_INVALID", rules=["KVW-CSPEC-12", "KVW-STORE-15", "KVW-STORE-18"],
              description="dtype f8_e4m3fn with the two int_affine specs of the kivi2 preset: a lossy codec needs "
                          "bf16, f16 or f32; so no container exists under the store key row f8_e4m3fn / kivi2 "
                          "(spec/store.md section 6)")


def _set_required(hb: bytes, value: int) -> bytes:
    """``hb`` with the root table's ``required_features`` (field 2, u64, present) set to ``value``."""
    t = forge.root_table(hb)
    pos = forge.field_pos(t, 2, 8)
    return forge.patch(hb, pos, "Q", value)


ADDITION = {
    "make": gen_clarifications,
    "spec": "spec/kvwire-v1.md Appendix D '1.4, clarifications' (KVW-HDR-22, section 14.1 steps 2-3), spec/codecs.md "
            "KVW-ROT-1 (clarified), KVW-CSPEC-12, KVW-CSPEC-13, spec/store.md KVW-STORE-15, KVW-STORE-18",
    "rules_without_vector": {
        "KVW-CSPEC-11": "A new id for the second KVW-CSPEC-10 (raw_length of codec-spec containers); its vectors are "
                        "those of the codecs set, whose descriptions cite the old id.",
        "KVW-CSPEC-12 (writers)": "Which pipeline a writer labels with a preset name: "
                                  "tests/conformance/test_spec_decisions.py checks the table against the reference "
                                  "presets and the store key rows.",
        "KVW-STREAM-5": "The reference changed, not the checks: the segment vectors of the base set pin them.",
    },
}
