"""Conformance vectors of sparse caches (spec/sparse.md, feature bit ``sparse``).

``gen_sparse(g)`` is registered in ``generate.py`` as ``ADDITIONS["sparse"]``; the lead
appends it to a version folder with ``generate.py --add sparse``. Valid vectors cover
StreamingLLM, per-head (DMS-style) subsets with an empty head, MLA and shared layers,
zstd POSITIONS bodies and chunks out of canonical order; each invalid vector breaks one
KVW-SPARSE rule, forged with tests/forge.py from a valid sparse container.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

import forge
import kvwire
from kvwire.cache.sparse import SparseKVCache, encode_positions
from kvwire.format import registry as R
from kvwire.format.header import Architecture, Header, LayerSpec, Producer, TokenRange
from kvwire.format.sparse import SPARSE_BIT

PRODUCER = Producer("kvwire-conformance-generator", "1.0")
POS = R.COMPONENTS["positions"]


def _dense(layers, heads, tokens, seed, dtype="f16", chunk_tokens=4, first_position=0):
    return forge.small_cache(layers=layers, heads=heads, tokens=tokens, seed=seed, dtype=dtype,
                             chunk_tokens=chunk_tokens, first_position=first_position, compressible=True,
                             producer=PRODUCER)


def _positions_index(data, layer=0, head=0, cell=0, C=4) -> int:
    with kvwire.open(data) as r:
        rec = r.records
        hit = np.flatnonzero((rec["component"] == POS) & (rec["layer"] == layer) & (rec["head_start"] == head)
                             & (rec["token_start"] == cell * C))
    return int(hit[0])


def _with_positions_body(data, body: bytes, **where) -> bytes:
    p = forge.split(data)
    i = _positions_index(data, **where)
    p.bodies[i] = body
    p.records[i]["raw_length"] = len(body)
    return forge.assemble(p)


def _with_header(data, h: Header) -> bytes:
    p = forge.split(data)
    p.header = forge.header_of(h)
    return forge.assemble(p)


def gen_sparse(g) -> None:
    """Sparse caches (spec/sparse.md): header table SparseInfo (field 19), component
    POSITIONS (4), one head per chunk on per-(layer, head) grids."""
    W = lambda form="file", codec="raw": {"form": form, "codec": codec}

    # --- valid ---------------------------------------------------------------------------
    streaming = SparseKVCache.streaming(_dense(2, 2, 20, 5100), 2, 5)
    base = kvwire.encode(streaming, form="file")
    g.valid("sparse-streaming-llm", base, streaming, writer=W(),
            rules=["KVW-SPARSE-1", "KVW-SPARSE-4", "KVW-SPARSE-6", "KVW-SPARSE-7", "KVW-SPARSE-10",
                   "KVW-SPARSE-13", "KVW-SPARSE-14"],
            description="StreamingLLM: 2 layers x 2 kv heads, f16, 20 prompt tokens, every head keeps the 2 sink "
                        "tokens and the last 5 (positions 0,1,15..19), next_position 20; chunks of 4; file form")

    rng = np.random.default_rng(5101)
    dense = _dense(2, 3, 18, 5102, first_position=1000)
    masks = [rng.random((3, 18)) < 0.4 for _ in range(2)]
    masks[1][2] = False  # a head that retains nothing has no chunks
    dms = SparseKVCache.from_mask(dense, masks, method="dms", next_position=1021)
    g.valid("sparse-per-head-subsets-zstd", kvwire.encode(dms, form="stream", codec="zstd"), dms,
            writer=W("stream", "zstd"),
            rules=["KVW-SPARSE-3", "KVW-SPARSE-5", "KVW-SPARSE-7", "KVW-SPARSE-8", "KVW-SPARSE-11"],
            description="DMS-style per-(layer, head) subsets of different sizes (retained counts "
                        f"{list(dms.header.sparse.retained_counts)}; layer 1 head 2 keeps none), first_position "
                        "1000, next_position 1021 (3 tokens after the last cached one), zstd, stream form")

    rng = np.random.default_rng(5103)
    arch = Architecture((LayerSpec("mla_latent", 1, 12, 0, kv_lora_rank=8, qk_rope_head_dim=4),
                         LayerSpec("shared", source_layer=0), LayerSpec("full_attention", 2, 4, 6)))
    h = Header(arch=arch, token_count=11, dtype="bf16", chunk_tokens=4, producer=PRODUCER)
    mixed_dense = kvwire.KVCache(h, [{"latent": forge.random_tensor(rng, (1, 11, 12), "bf16")}, {},
                                     {"k": forge.random_tensor(rng, (2, 11, 4), "bf16"),
                                      "v": forge.random_tensor(rng, (2, 11, 6), "bf16")}])
    mixed = SparseKVCache.from_mask(mixed_dense, [rng.random((1, 11)) < 0.6, None, rng.random((2, 11)) < 0.6],
                                    method="snapkv")
    g.valid("sparse-mla-and-shared-layers", kvwire.encode(mixed), mixed, writer=W(),
            rules=["KVW-SPARSE-2", "KVW-SPARSE-3", "KVW-SPARSE-6"],
            description="An mla_latent layer (one head: LATENT + POSITIONS), a shared layer (no entries in "
                        "retained_counts, no chunks) and a full-attention layer with 2 heads; bf16")

    long = SparseKVCache.streaming(_dense(1, 1, 300, 5104, chunk_tokens=128), 4, 250)
    g.valid("sparse-positions-zstd", kvwire.encode(long, codec="zstd"), long, writer=W(codec="zstd"),
            rules=["KVW-SPARSE-9", "KVW-SPARSE-10"],
            description="POSITIONS bodies compressed with zstd (a window of 250 consecutive positions is 250 zero "
                        "bytes raw); chunks of 128")

    p = forge.split(kvwire.encode(streaming, form="stream"))
    order = list(range(len(p.bodies)))[::-1]
    rev = forge.assemble(forge.Parts(p.header, p.records[order].copy(), [p.bodies[i] for i in order], p.alignment,
                                     "stream"))
    g.valid("sparse-chunks-reverse-order", rev, streaming,
            rules=["KVW-SPARSE-7", "KVW-SPARSE-11", "KVW-CHUNK-9"],
            description="sparse-streaming-llm in stream form with its chunks in reverse order: every POSITIONS "
                        "cell arrives before the cell it follows")

    # --- header rules ---------------------------------------------------------------------
    sh = streaming.header
    cases = [
        ("sparse1-table-without-bit", replace(sh, required_features=0), "KVW-SPARSE-1",
         "Header.sparse present, required feature bit 1 clear"),
        ("sparse3-retained-counts-length", sh.replace(sparse=replace(sh.sparse, retained_counts=(7, 7, 7))),
         "KVW-SPARSE-3", "retained_counts has 3 entries for 2 layers x 2 heads"),
        ("sparse4-token-count-not-largest-count", sh.replace(token_count=8), "KVW-SPARSE-4",
         "token_count 8, every head retains 7"),
        ("sparse4-layer-tokens-present", replace(sh, layer_tokens=(TokenRange(0, 7), TokenRange(1, 6))),
         "KVW-SPARSE-4", "layer_tokens present with a non-default range"),
        ("sparse5-next-position-below-token-count", replace(sh, sparse=replace(sh.sparse, next_position=6)),
         "KVW-SPARSE-5", "next_position 6 < first_position + token_count = 7"),
        ("sparse5-next-position-2-63", replace(sh, sparse=replace(sh.sparse, next_position=1 << 63)),
         "KVW-SPARSE-5", "next_position 2^63"),
    ]
    for name, hdr, rule, what in cases:
        g.invalid(name, _with_header(base, hdr), rule=rule, code="SPARSE_INVALID", description=what)
    dense_hdr = _dense(1, 1, 4, 5105).header
    g.invalid("sparse1-bit-without-table", forge.wrap_header(forge.header_of(replace(
        dense_hdr, required_features=SPARSE_BIT))), rule="KVW-SPARSE-1", code="SPARSE_INVALID",
        description="required feature bit 1 set, no Header.sparse (zero-chunk container)")

    # --- record rules ---------------------------------------------------------------------
    def rec(name, rule, code, what, rules=(), **fields):
        g.invalid(name, forge.rebuild(base, edit=forge.set_records(**fields)), rule=rule, code=code,
                  description=what, rules=rules)

    dense_data = kvwire.encode(_dense(1, 1, 4, 5106))
    g.invalid("sparse6-positions-in-dense-container",
              forge.rebuild(dense_data, edit=forge.set_records(component=(0, POS))), rule="KVW-CHUNK-1",
              code="ENUM_OUT_OF_RANGE", rules=["KVW-SPARSE-6", "KVW-EVOL-9"],
              description="component 4 (POSITIONS) in a container without feature bit sparse")
    rec("sparse6-latent-in-attention-layer", "KVW-CHUNK-1", "COMPONENT_INVALID",
        "record 0 names LATENT on a full-attention layer of a sparse container", rules=["KVW-SPARSE-6"],
        component=(0, R.COMPONENTS["latent"]))
    rec("sparse7-head-start-out-of-range", "KVW-SPARSE-7", "HEAD_RANGE", "record 0 has head_start 2 of 2 heads",
        head_start=(0, 2))
    rec("sparse7-head-count-not-one", "KVW-SPARSE-7", "HEAD_RANGE", "record 0 has head_count 2 (all heads)",
        head_count=(0, 2))
    rec("sparse7-cell-off-grid", "KVW-SPARSE-7", "CHUNK_BOUNDARY",
        "record 0 covers tokens [1, 4) of a head retaining 7 with chunks of 4", token_start=(0, 1), token_count=(0, 3))
    rec("sparse7-cell-past-retained-count", "KVW-SPARSE-7", "CHUNK_BOUNDARY",
        "record 1 covers tokens [4, 8) of a head retaining 7", token_count=(1, 4),
        raw_length=(1, 4 * 8 * 2))
    p = forge.split(base)
    short = forge.Parts(p.header, p.records[:-1].copy(), p.bodies[:-1], p.alignment, p.form)
    g.invalid("sparse7-chunk-missing", forge.assemble(short), rule="KVW-CHUNK-8", code="CHUNK_MISSING",
              rules=["KVW-SPARSE-7"], description="the last POSITIONS chunk is left out")
    rec("sparse7-chunk-duplicate", "KVW-CHUNK-8", "CHUNK_DUPLICATE",
        "record 1 (K layer 0 head 0 cell 1) claims head 1's cell 1, which another record holds",
        rules=["KVW-SPARSE-7"], head_start=(1, 1))
    rec("sparse8-kv-raw-length-all-heads", "KVW-SPARSE-8", "LENGTH_MISMATCH",
        "record 0 (K, 4 tokens, one head) declares raw_length of 2 heads", raw_length=(0, 2 * 4 * 8 * 2),
        stored_length=(0, 2 * 4 * 8 * 2))
    i = _positions_index(base)
    g.invalid("sparse8-positions-raw-length-short", _with_positions_body(base, bytes(3)), rule="KVW-SPARSE-8",
              code="LENGTH_MISMATCH", description=f"POSITIONS record {i} of 4 tokens has a 3-byte body")
    g.invalid("sparse8-positions-raw-length-long", _with_positions_body(base, bytes(37)), rule="KVW-SPARSE-8",
              code="LENGTH_MISMATCH", description=f"POSITIONS record {i} of 4 tokens has a 37-byte body (> 9 x 4)")

    from kvwire.format.codec_specs import CodecSpec

    spec_hdr = replace(sh, codec_specs=(CodecSpec("byteplane_zstd"),),
                       required_features=sh.required_features | R.REQUIRED_FEATURES["codec_specs"])
    pc = forge.split(base)
    pc.header = forge.header_of(spec_hdr)
    g.invalid("sparse9-positions-with-codec-spec", forge.assemble(pc, edit=forge.set_records(
        codec=(i, R.CODECS["byteplane_zstd"]), reserved0=(i, 1))), rule="KVW-SPARSE-9", code="POSITIONS_CODEC",
        description=f"POSITIONS record {i} uses codec byteplane_zstd through codec spec 1")

    # --- POSITIONS bodies -------------------------------------------------------------------
    for name, body, what in [
        ("sparse10-varint-not-minimal", bytes([0x80, 0x00, 0, 0, 0]), "the first varint is 80 00 (zero in 2 bytes)"),
        ("sparse10-varint-ten-bytes", bytes([0x81] * 9 + [0x01, 0, 0, 0]), "the first varint has 10 bytes"),
        ("sparse10-body-ends-inside-varint", bytes([0, 1, 2, 0x80]), "the last byte has bit 7 set"),
        ("sparse10-too-few-varints", bytes([0, 0, 0x85, 0x01]), "3 varints for 4 tokens"),
    ]:
        g.invalid(name, _with_positions_body(base, body), rule="KVW-SPARSE-10", code="POSITIONS_ENCODING",
                  description=f"layer 0 head 0 cell 0 POSITIONS body: {what}")
    nxt = sh.sparse.next_position
    g.invalid("sparse11-position-at-next-position", _with_positions_body(base, encode_positions([0, 1, 2, nxt], 0)),
              rule="KVW-SPARSE-11", code="POSITIONS_ORDER",
              description=f"the fourth position of layer 0 head 0 is next_position ({nxt})")
    with kvwire.open(base) as r:
        last = int(r.chunk(0, "positions", 0)[-1])
    g.invalid("sparse11-cells-not-increasing",
              _with_positions_body(base, encode_positions([last, last + 1, last + 2], 0), cell=1),
              rule="KVW-SPARSE-11", code="POSITIONS_ORDER",
              description=f"cell 1 of layer 0 head 0 starts at position {last}, the last position of cell 0")


ADDITION = {
    "make": gen_sparse,
    "spec": "spec/sparse.md (feature bit sparse, header field 19, table SparseInfo, component POSITIONS)",
    "rules_without_vector": {
        "KVW-SPARSE-2": "A kind that cannot be sparse (state) needs feature state_layers and a valid state layer "
                        "as well; tests/model/test_sparse.py checks the rule (SPARSE_INVALID).",
        "KVW-SPARSE-12": "Writer obligation on key rotation: tests/adapters/test_sparse_hf.py checks that a model continuing "
                         "from a loaded sparse cache matches attention over exactly the retained tokens.",
    },
}


def gen_sparse_codecs(g) -> None:
    """Codec specs in sparse containers (spec/codecs.md KVW-CSPEC-8, spec/sparse.md
    KVW-SPARSE-15): one-head chunks, sink and residual tokens counted in each head's own
    retained list. Expected values: the literal decoder of tests/codec_reference.py."""
    import codec_reference as ref
    from kvwire import CodecSpec

    rng = np.random.default_rng(5301)
    dense = _dense(2, 2, 22, 5302, dtype="bf16", chunk_tokens=8)
    masks = [rng.random((2, 22)) < 0.7 for _ in range(2)]
    sparse = SparseKVCache.from_mask(dense, masks, method="h2o")
    kivi_k = CodecSpec("int_affine", bits=2, group_size=4, group_axis="tokens", scale_dtype="f16", sink_tokens=1,
                       residual_tokens=3)
    kivi_v = CodecSpec("int_affine", bits=4, group_size=8, group_axis="channels", scale_dtype="f16",
                       residual_tokens=3, lossless="zstd")
    data = kvwire.encode(sparse, codec={"k": kivi_k, "v": kivi_v}, form="stream")
    want = ref.decode_sparse_container(data)
    assert kvwire.load(data).equal(want)
    g.valid("sparse-kivi-windows", data, want, writer={"form": "stream", "codec": "raw"},
            rules=["KVW-CSPEC-8", "KVW-SPARSE-15", "KVW-INT-1", "KVW-SPARSE-9"],
            description="an H2O-style sparse cache (2 layers x 2 kv heads, bf16, chunks of 8, retained counts "
                        f"{list(sparse.header.sparse.retained_counts)}) with KIVI-style codecs: K int_affine 2 bits "
                        "per channel over 4 tokens, V 4 bits per token over 8 channels with a zstd stage; the "
                        "first retained token of each head (sink) and its last 3 (residual) are stored exact, "
                        "counted in the head's own retained list, not in positions; POSITIONS stay raw/zstd; "
                        "expected values from the literal decoder (the writer case is raw: the encode protocol "
                        "names codecs only)")


ADDITION_CODECS = {
    "make": gen_sparse_codecs,
    "spec": "spec/codecs.md KVW-CSPEC-8 and spec/sparse.md KVW-SPARSE-15 (codec specs in sparse containers)",
    "rules_without_vector": {},
}
