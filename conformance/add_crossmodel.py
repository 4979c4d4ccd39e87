"""Conformance vectors of spec/crossmodel.md (state layers, prefix chain, fingerprints) and
of the layer-map rules KVW-MAP-4..6, added to format 1.0 after its vectors were frozen.

``gen_crossmodel(g)`` is registered in ``generate.py``'s ``ADDITIONS`` as ``crossmodel``;
``generate.py --add crossmodel`` appends these vectors to a version folder.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import forge
import kvwire
from kvwire import LayerMapEntry as E
from kvwire import LayerSpec, PrefixChain, StateTensor
from kvwire.format import registry as R
from kvwire.format.header import Architecture, Header, Producer, TokenRange
from kvwire.format.prefix import prefix_hashes, prefix_root
from kvwire.model.identity import (
    config_fingerprint,
    hf_layer_of,
    layer_weights_fingerprints,
    make_identity,
    tokenizer_fingerprint,
    weights_fingerprint,
)

PRODUCER = Producer("kvwire-conformance-generator", "1.0")
STATE_BIT = R.REQUIRED_FEATURES["state_layers"]
FULL = LayerSpec("full_attention", 2, 8, 8)
JAMBA = LayerSpec("state", state_tensors=(StateTensor("conv", (1, 4, 3)), StateTensor("ssm", (1, 2, 4, 3), "bf16")))


def _cache(h: Header, seed: int) -> kvwire.KVCache:
    """Random tensors (arbitrary bit patterns) for every stored tensor, state tensors included."""
    return forge.random_cache(h, seed)


def _toy_identity(arch: Architecture, dtype: str) -> kvwire.ModelIdentity:
    """Scheme-1 fingerprints of a fixed toy model: the digests are pinned by the vector."""
    rng = np.random.default_rng(7000)
    weights = [("model.embed_tokens.weight", rng.standard_normal((32, 16)).astype(np.float32)),
               ("lm_head.weight", rng.standard_normal((32, 16)).astype(np.float32))]
    for i in range(arch.num_layers):
        weights.append((f"model.layers.{i}.self_attn.k_proj.weight", rng.standard_normal((16, 16)).astype(np.float32)))
    vocab = {f"t{i}": i for i in range(32)}
    return make_identity(
        arch, dtype, config=config_fingerprint({"model_type": "llama", "num_hidden_layers": arch.num_layers,
                                                "rope_theta": 10000.0, "rms_norm_eps": 1e-6}),
        tokenizer=tokenizer_fingerprint(vocab, special_tokens={"eos_token": "t1"}, extra={"merges": ["t 1"]}),
        weights=weights_fingerprint(weights),
        layer_weights=layer_weights_fingerprints(weights, hf_layer_of, arch.num_layers),
        model_type="llama", model_id="kvwire/toy", framework="transformers", framework_version="5.24.0")


def gen_crossmodel(g) -> None:
    """Valid: state layers (file and stream, zstd), a prefix chain with scheme-1 fingerprints and
    its continuation, a layer map with aliases. Invalid: each new reader check."""
    W = lambda form="file", codec="raw": {"form": form, "codec": codec}

    # --- state layers (KVW-STATE-1, 2, 7)
    h = Header(Architecture((FULL, JAMBA, FULL)), token_count=7, dtype="f16", chunk_tokens=4, producer=PRODUCER,
               required_features=STATE_BIT)
    c = _cache(h, 7001)
    g.valid("xm-state-layers", kvwire.encode(c), c, writer=W(), rules=["KVW-STATE-1", "KVW-STATE-2", "KVW-STATE-7"],
            description="a Jamba-style cache: full attention, a state layer with two state tensors (conv f32 "
                        "[1,4,3], ssm bf16 [1,2,4,3]), full attention; 7 tokens in chunks of 4, f16; each state "
                        "tensor is one chunk with token_start 0, token_count 7, head_start = tensor index")
    g.valid("xm-state-layers-stream-zstd", kvwire.encode(c, form="stream", codec="zstd"), c,
            writer=W("stream", "zstd"), rules=["KVW-STATE-7", "KVW-STATE-8"],
            description="the same cache in stream form with zstd bodies (state chunks use raw or zstd)")
    h0 = h.replace(token_count=0)
    c0 = _cache(h0, 7002)
    g.valid("xm-state-layers-no-tokens", kvwire.encode(c0), c0, writer=W(), rules=["KVW-STATE-6", "KVW-STATE-7"],
            description="a cache of 0 tokens with a state layer: no chunks at all (the initial state)")

    # --- fingerprints and prefix chain (KVW-ID-*, KVW-PREFIX-*)
    arch = Architecture((FULL,) * 2, rope=kvwire.RopeParams(theta=10000.0))
    ident = _toy_identity(arch, "bf16")
    tokens = [(i * 7919) % 32000 for i in range(11)]
    chain = prefix_hashes(tokens, 4, ident.compat_fingerprint)
    hp = Header(arch, token_count=11, dtype="bf16", chunk_tokens=4, producer=PRODUCER, model=ident,
                prefix=PrefixChain(1, prefix_root(ident.compat_fingerprint, 4), chain))
    cp = _cache(hp, 7003)
    g.valid("xm-prefix-chain", kvwire.encode(cp), cp, writer=W(), rules=[
        "KVW-PREFIX-2", "KVW-PREFIX-3", "KVW-ID-1", "KVW-ID-9", "KVW-ID-10", "KVW-HDR-20"],
        description="scheme-1 fingerprints of a toy model (framework transformers 5.24.0, per-layer weights "
                    "fingerprints) and a prefix chain over 11 token ids (i * 7919 mod 32000) in chunks of 4: "
                    "3 hashes, the last over a partial chunk of 3 ids; root = R0(compat_fingerprint, 4)")
    whole = prefix_hashes(tokens + [5, 6, 7, 8, 9], 4, ident.compat_fingerprint)
    ht = hp.replace(token_count=8, first_position=8, prefix=PrefixChain(1, whole[32:64], whole[64:]))
    ct = _cache(ht, 7004)
    g.valid("xm-prefix-continuation", kvwire.encode(ct), ct, writer=W(), rules=["KVW-PREFIX-5"],
            description="the continuation of the sequence above from position 8 (a multiple of chunk_tokens 4): "
                        "root = hash of chunk 1 of the whole sequence, hashes = its chunks 2 and 3 (the root "
                        "cannot be checked without the earlier tokens)")

    # --- layer map with aliases and a shared transmitted layer (KVW-MAP-4..6)
    arch = Architecture((FULL, FULL, LayerSpec("shared", source_layer=1)))
    hm = Header(arch, token_count=5, dtype="f16", chunk_tokens=4, producer=PRODUCER,
                layer_map=(E(0, 0, "copy"), E(1, 0, "alias"), E(2, 2, "copy"), E(3, 1, "alias"), E(4, 2, "alias"),
                           E(5, -1, "recompute"), E(6, -1, "drop")))
    cm = _cache(hm, 7005)
    g.valid("xm-layer-map-alias", kvwire.encode(cm), cm, writer=W(), rules=["KVW-MAP-4", "KVW-MAP-5", "KVW-MAP-6"],
            description="a layer map: receiver 0 copies layer 0 and receiver 1 aliases it (after its owner); "
                        "receiver 2 copies the shared layer 2 (its source, layer 1), receivers 3 and 4 alias layers "
                        "1 and 2; 5 recompute, 6 drop, 7 and above unlisted (recompute)")

    # --- invalid (zero-chunk stream containers unless said otherwise)
    I, Wr = g.invalid, forge.wrap_header

    def hdr(h: Header) -> bytes:
        return Wr(forge.header_of(h))

    base_map = Header(Architecture((FULL, FULL)), token_count=0, dtype="f16", chunk_tokens=4, producer=PRODUCER)
    I("xm-map4-alias-before-copy", hdr(base_map.replace(layer_map=(E(0, 1, "alias"), E(1, 1, "copy")))),
      rule="KVW-MAP-4", code="LAYER_MAP_INVALID",
      description="receiver 0 aliases transmitted layer 1, which receiver 1 copies (a consumer before its producer)")
    I("xm-map4-alias-before-lowest-copy", hdr(base_map.replace(
        layer_map=(E(0, 0, "copy"), E(2, 1, "alias"), E(3, 1, "copy"), E(5, 1, "copy")))),
      rule="KVW-MAP-4", code="LAYER_MAP_INVALID",
      description="transmitted layer 1's owner is receiver 3 (its lowest copy); receiver 2 aliases it earlier")

    hp0 = hp.replace(token_count=11)
    I("xm-prefix3-hashes-short", hdr(hp0.replace(prefix=PrefixChain(1, hp.prefix.root, chain[:64]))),
      rule="KVW-PREFIX-3", code="PREFIX_INVALID",
      description="11 tokens in chunks of 4 need 3 hashes (96 bytes); 64 bytes given")
    I("xm-prefix3-hashes-not-multiple", hdr(hp0.replace(prefix=PrefixChain(1, hp.prefix.root, chain + b"\0"))),
      rule="KVW-PREFIX-3", code="PREFIX_INVALID", description="97 hash bytes for 3 chunks")
    I("xm-prefix2-root-other-model", hdr(hp0.replace(prefix=PrefixChain(1, prefix_root(b"", 4), chain))),
      rule="KVW-PREFIX-2", code="PREFIX_INVALID",
      description="first_position 0 but the root is R0 of an empty compat fingerprint, not of this model's")
    I("xm-prefix2-root-short", hdr(hp0.replace(prefix=PrefixChain(1, hp.prefix.root[:16], chain))),
      rule="KVW-PREFIX-2", code="PREFIX_INVALID", description="a 16-byte root")
    I("xm-prefix5-off-grid", hdr(ht.replace(first_position=6)), rule="KVW-PREFIX-5", code="PREFIX_INVALID",
      description="a prefix chain with first_position 6, not a multiple of chunk_tokens 4")
    bad_id = dataclasses.replace(ident, compat_fingerprint=ident.compat_fingerprint[:20])
    I("xm-id10-fingerprint-length", hdr(hp0.replace(model=bad_id, prefix=None)), rule="KVW-ID-10",
      code="FINGERPRINT_INVALID", description="fingerprint_scheme 1 with a 20-byte compat_fingerprint")
    bad_id = dataclasses.replace(ident, layer_weights_fingerprints=ident.layer_weights_fingerprints[:32])
    I("xm-id10-layer-fingerprints-length", hdr(hp0.replace(model=bad_id, prefix=None)), rule="KVW-ID-10",
      code="FINGERPRINT_INVALID", description="fingerprint_scheme 1 with 32 bytes of layer fingerprints for 2 layers")

    h0s = h0.replace(token_count=0)
    I("xm-state1-kind-without-bit", hdr(h0s.replace(required_features=0)), rule="KVW-HDR-10",
      code="ENUM_OUT_OF_RANGE", rules=["KVW-STATE-1", "KVW-EVOL-9"],
      description="layer kind state (5) without required feature bit 2 (state_layers)")

    def state_spec(**kw) -> bytes:
        return hdr(h0s.replace(arch=Architecture((FULL, dataclasses.replace(JAMBA, **kw), FULL))))

    I("xm-state2-heads", state_spec(num_kv_heads=2), rule="KVW-STATE-2", code="STATE_INVALID",
      description="a state layer with num_kv_heads 2")
    I("xm-state2-no-tensors", state_spec(state_tensors=()), rule="KVW-STATE-2", code="STATE_INVALID",
      description="a state layer without state tensors")
    I("xm-state2-duplicate-name", state_spec(state_tensors=(StateTensor("s", (2,)), StateTensor("s", (3,)))),
      rule="KVW-STATE-2", code="STATE_INVALID", description="two state tensors named s")
    I("xm-state2-zero-dim", state_spec(state_tensors=(StateTensor("s", (2, 0)),)), rule="KVW-STATE-2",
      code="STATE_INVALID", description="a state tensor of shape [2, 0]")
    I("xm-state3-tensors-on-attention", hdr(h0s.replace(arch=Architecture((
        dataclasses.replace(FULL, state_tensors=JAMBA.state_tensors), JAMBA)), layer_tokens=None)), rule="KVW-STATE-3",
      code="STATE_INVALID", description="a full_attention layer declaring state tensors")
    I("xm-state4-token-range", hdr(h.replace(layer_tokens=(TokenRange(0, 7), TokenRange(3, 4), TokenRange(0, 7)))),
      rule="KVW-STATE-4", code="TOKEN_RANGE_INVALID", description="a state layer holding tokens [3, 7) of 7")
    I("xm-state5-shared-over-state", hdr(h0s.replace(arch=Architecture((JAMBA, LayerSpec("shared", source_layer=0))),
                                                        layer_tokens=None)),
      rule="KVW-STATE-5", code="STATE_INVALID", description="a shared layer whose source is a state layer")

    data = kvwire.encode(c)
    recs = forge.split(data).records
    i = int(np.flatnonzero(recs["component"] == R.COMPONENTS["state"])[1])
    assert int(recs[i]["raw_length"]) == 48
    I("xm-state7-shape-mismatch", forge.rebuild(data, edit=forge.set_records(raw_length=(i, 96))),
      rule="KVW-CHUNK-4", code="LENGTH_MISMATCH", rules=["KVW-STATE-7"],
      description="the ssm state chunk claims raw_length 96 (its shape in f32); the header declares bf16 "
                  "[1,2,4,3]: 48 bytes")
    I("xm-state7-head-start", forge.rebuild(data, edit=forge.set_records(head_start=(i, 2))), rule="KVW-CHUNK-3",
      code="HEAD_RANGE", rules=["KVW-STATE-7"], description="a state chunk with head_start 2 of 2 state tensors")
    I("xm-state7-token-range", forge.rebuild(data, edit=forge.set_records(token_start=(i, 4), token_count=(i, 3))),
      rule="KVW-CHUNK-2", code="CHUNK_BOUNDARY", rules=["KVW-STATE-7"],
      description="a state chunk covering tokens [4, 7) instead of the whole range [0, 7)")
    from kvwire.format.codec_specs import CodecSpec

    p = forge.split(data)
    p.header = forge.header_of(h.replace(required_features=STATE_BIT | R.REQUIRED_FEATURES["codec_specs"],
                                         codec_specs=(CodecSpec("byteplane_zstd"),)), check=True)
    I("xm-state8-codec-spec", forge.assemble(p, edit=forge.set_records(codec=(i, R.CODECS["byteplane_zstd"]),
                                                                       reserved0=(i, 1))),
      rule="KVW-STATE-8", code="STATE_INVALID",
      description="a state chunk stored through codec spec 1 (byteplane_zstd, valid for K/V chunks of this f16 "
                  "header): state chunks are raw or zstd with codec_spec 0")


ADDITION = {
    "make": gen_crossmodel,
    "spec": "spec/crossmodel.md (header fields 17 prefix, ModelIdentity 7-10, LayerSpec 10 state_tensors; feature "
            "bit 2 state_layers) and spec/kvwire-v1.md section 7 (KVW-MAP-4..7)",
    "rules_without_vector": {
        "KVW-ID-2..9": "Digest definitions: a container carries the digests, not the inputs. valid/xm-prefix-chain "
                       "pins scheme-1 digests of a toy model whose inputs are in conformance/add_crossmodel.py; "
                       "tests/model/test_identity.py checks every definition against an independent computation.",
        "KVW-XM-*": "The compatibility check is receiver behaviour, not a container property "
                    "(tests/model/test_crossmodel_core.py).",
        "KVW-PREFIX-6": "Covered tokens are a lookup over headers (tests/model/test_prefix.py).",
        "KVW-MAP-7": "Receiver behaviour.",
    },
}


def gen_rope_truncate(g) -> None:
    """RopeParams field 17 ``truncate`` (spec/kvwire-v1.md 6.4, crossmodel.md KVW-ROPE-3/7):
    gpt-oss-style untruncated YaRN on sliding and full layers."""
    from kvwire import RopeParams

    yarn = RopeParams("yarn", theta=150000.0, factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0,
                      beta_slow=1.0, attention_factor=1.3465735902799727, truncate=False)
    sliding = LayerSpec("sliding_attention", 2, 8, 8, window=4, rope=yarn)
    full = LayerSpec("full_attention", 2, 8, 8, rope=yarn)
    h = Header(Architecture((sliding, full), rope=yarn), token_count=6, dtype="bf16", chunk_tokens=4,
               producer=PRODUCER, layer_tokens=(TokenRange(3, 3), TokenRange(0, 6)))
    c = _cache(h, 7101)
    assert kvwire.load(kvwire.encode(c)).header.arch.rope.truncate is False
    g.valid("rope-yarn-untruncated", kvwire.encode(c), c, writer={"form": "file", "codec": "raw"},
            rules=["KVW-ROPE-3", "KVW-ROPE-7"],
            description="RopeParams.truncate = false (field 17) on the architecture and on both layer specs: "
                        "gpt-oss's YaRN, whose correction range is not rounded to whole dimensions; a reader "
                        "reports truncate false (its neutral JSON has \"truncate\": false), and a reader that "
                        "predates field 17 sees the default true")


ADDITION_ROPE_TRUNCATE = {
    "make": gen_rope_truncate,
    "spec": "spec/kvwire-v1.md section 6.4 (RopeParams field 17 truncate) and spec/crossmodel.md KVW-ROPE-3/7",
    "rules_without_vector": {},
}
