"""Test helpers: small caches, and a forge that crafts containers with exactly one defect.

A forged container must pass every check except the one under test, so the forge
rebuilds containers from parts with the production builders of ``kvwire.format.container``
(``build_preamble``, ``build_frame``, ``build_end_frame``, ``build_index``,
``build_trailer``) and recomputes every checksum the defect would otherwise break:
the preamble self-check and header checksum, each frame's self-check, the end frame's
records digest, and the index checksum in the trailer.

Three layers of tools:

* ``Parts`` / ``split`` / ``assemble``: decompose a valid container into header bytes,
  chunk records and bodies, then rebuild it, applying an ``edit`` to the records (after
  the layout fields are recomputed) and optionally diverging frame and index records.
* byte patchers (``patch_preamble``, ``patch_trailer``, ``patch_end_frame``,
  ``set_byte``...) that rewrite one field of a finished container and fix its checks.
* ``fb_header``: a raw Header FlatBuffer from numeric codes via the generated builders
  in ``kvwire.format.fbs``, bypassing ``check_header``; ``wrap_header`` puts any header bytes
  in front of an empty (zero-chunk) stream with a correct preamble.
"""

from __future__ import annotations

import struct
from contextlib import contextmanager
from dataclasses import dataclass

import flatbuffers
import numpy as np
import pytest

import kvwire
from kvwire.format import registry as R
from kvwire.format.container import (
    FRAME_SIZE,
    PREAMBLE_SIZE,
    RECORD_DTYPE,
    RECORD_SIZE,
    TRAILER_SIZE,
    build_end_frame,
    build_frame,
    build_index,
    build_preamble,
    build_trailer,
    check32,
    header_bytes,
    next_frame_offset,
    parse_preamble,
    xxh3,
)
from kvwire.format.fbs import Architecture as fbArch
from kvwire.format.fbs import ChunkIndex as fbIndex
from kvwire.format.fbs import Header as fbHeader
from kvwire.format.fbs import KeyValue as fbKV
from kvwire.format.fbs import LayerMapEntry as fbMap
from kvwire.format.fbs import LayerSpec as fbLayer
from kvwire.format.fbs import ModelIdentity as fbModel
from kvwire.format.fbs import Producer as fbProducer
from kvwire.format.fbs import RopeParams as fbRope
from kvwire.format.fbs import TokenRange as fbRange
from kvwire.format.flatbuf import Buffer

PREAMBLE = struct.Struct("<8sHHIQII")
PREAMBLE_FIELDS = ("magic", "major", "minor", "header_length", "header_checksum", "reserved", "check")
TRAILER = struct.Struct("<QIIQ8s")
TRAILER_FIELDS = ("index_offset", "index_length", "reserved", "index_checksum", "magic")
END = struct.Struct("<QQ40s")


# ---------------------------------------------------------------------------------------
# Small caches
# ---------------------------------------------------------------------------------------

def random_tensor(rng: np.random.Generator, shape, dtype: str, *, compressible: bool = False) -> np.ndarray:
    """Arbitrary bit patterns of ``dtype`` (NaN payloads included for float dtypes)."""
    np_dtype = R.DTYPES[dtype][2]
    nbytes = int(np.prod(shape)) * np_dtype.itemsize
    if compressible:
        raw = (rng.integers(0, 3, nbytes) * 0x11).astype(np.uint8)
    else:
        raw = rng.integers(0, 256, nbytes, dtype=np.uint8)
    return raw.view(np_dtype).reshape(shape)


def random_cache(h, seed: int, *, compressible: bool = False) -> kvwire.KVCache:
    """A cache of header ``h`` over arbitrary bit patterns, state tensors included (the
    conformance generators and the tests draw them the same way, so vectors reproduce);
    ``compressible`` applies to the K/V/LATENT tensors only."""
    rng = np.random.default_rng(seed)
    layers = []
    for s, r in zip(h.arch.layers, h.layer_tokens):
        if s.kind == "state":
            layers.append({"state": {t.name: random_tensor(rng, t.shape, t.dtype) for t in s.state_tensors}
                           if h.token_count else {}})
        else:
            layers.append({c: random_tensor(rng, s.shape(c, r.count), h.dtype, compressible=compressible)
                           for c in s.components})
    return kvwire.KVCache(h, layers)


def small_cache(layers: int = 2, heads: int = 2, head_dim: int = 8, tokens: int = 40, *, dtype: str = "f16",
                chunk_tokens: int = 16, seed: int = 0, compressible: bool = True, head_dim_v: int | None = None,
                **header_fields) -> kvwire.KVCache:
    """A tiny cache of full-attention layers; ``compressible`` makes zstd bodies actually compress."""
    rng = np.random.default_rng(seed)
    dv = head_dim if head_dim_v is None else head_dim_v
    keys = [random_tensor(rng, (heads, tokens, head_dim), dtype, compressible=compressible) for _ in range(layers)]
    values = [random_tensor(rng, (heads, tokens, dv), dtype, compressible=compressible) for _ in range(layers)]
    return kvwire.KVCache.from_tensors(keys, values, chunk_tokens=chunk_tokens, **header_fields)


def cache_bytes_equal(a: kvwire.KVCache, b: kvwire.KVCache) -> bool:
    """Header equal and every tensor equal bit for bit (compared as uint8)."""
    from kvwire.cache.kvcache import layer_tensors
    from kvwire.cache.tensors import as_numpy

    if a.header != b.header or len(a.layers) != len(b.layers):
        return False
    for la, lb in zip(a.layers, b.layers):
        la, lb = dict(layer_tensors(la)), dict(layer_tensors(lb))  # state tensors by name (spec/crossmodel.md)
        if set(la) != set(lb):
            return False
        for comp in la:
            x, y = as_numpy(la[comp]), as_numpy(lb[comp])
            if x.shape != y.shape or x.dtype != y.dtype:
                return False
            if not np.array_equal(np.ascontiguousarray(x).view(np.uint8), np.ascontiguousarray(y).view(np.uint8)):
                return False
    return True


# ---------------------------------------------------------------------------------------
# Running the reader
# ---------------------------------------------------------------------------------------

def read_all(data, *, verify: bool = True, validate: bool = True) -> kvwire.KVCache:
    """Open, validate (every byte) and load: the whole reader surface in one call."""
    with kvwire.open(data) as r:
        if validate:
            r.validate()
        return r.load(verify=verify)


@contextmanager
def raises_code(cls, code: str, rule: str | None = None):
    """pytest.raises that also pins the error's ``code`` and (when given) ``rule``."""
    with pytest.raises(cls) as info:
        yield info
    err = info.value
    assert err.code == code, f"expected {code}, got {err.code}: {err}"
    if rule is not None:
        assert err.rule == rule, f"expected rule {rule}, got {err.rule}: {err}"


def expect(data, cls, code: str, rule: str | None = None, *, stage: str | None = None):
    """``read_all(data)`` must raise ``cls`` with ``code``/``rule``.

    ``stage`` ("open", "validate" or "load") additionally pins where it fires; the
    stages before it must succeed.
    """
    with raises_code(cls, code, rule) as info:
        if stage is None:
            read_all(data)
        else:
            r = kvwire.open(data) if stage != "open" else None
            if stage == "open":
                kvwire.open(data)
            elif stage == "validate":
                r.validate()
            elif stage == "load":
                r.load()
            else:  # pragma: no cover
                raise AssertionError(stage)
    return info.value


# ---------------------------------------------------------------------------------------
# Decompose / reassemble
# ---------------------------------------------------------------------------------------

@dataclass
class Parts:
    header: bytes
    records: np.ndarray
    bodies: list
    alignment: int
    form: str

    def copy(self) -> Parts:
        return Parts(self.header, self.records.copy(), list(self.bodies), self.alignment, self.form)


def split(data) -> Parts:
    """Parts of a valid container (records in container order)."""
    data = bytes(data)
    _, hlen, hsum = parse_preamble(data)
    hb = header_bytes(data, hlen, hsum)
    with kvwire.open(data) as r:
        recs = np.array(r.records, dtype=RECORD_DTYPE).copy()
        form, alignment = r.form, r.header.alignment
    bodies = [data[int(o) : int(o) + int(n)] for o, n in zip(recs["offset"], recs["stored_length"])]
    return Parts(hb, recs, bodies, alignment, form)


def assemble(p: Parts, *, form: str | None = None, fix: bool = True, edit=None, edit_frames=None,
             edit_index=None, end_count=None, end_digest=None, end_reserved: bytes = bytes(40),
             end_frame: bytes | None = None, gap_before_end: int = 0, index: bytes | None = None,
             index_tail: bytes = b"", index_pad: bytes | None = None, trailer_reserved: int = 0,
             trailing: bytes = b"", header_pad: bytes | None = None) -> bytes:
    """Rebuild a container from parts, every checksum correct unless overridden.

    ``fix`` recomputes offset, stored_length and checksum of each record from where its
    body lands; ``edit(records)`` then applies the defect under test. ``edit_frames`` /
    ``edit_index`` change only the frame copies / only the index copies. The end frame
    counts and digests the records the reader compares it with (the index in file form,
    the frames in stream form) unless ``end_count`` / ``end_digest`` are given.
    """
    form = form or p.form
    a = p.alignment
    recs = p.records.copy()
    if fix:
        pos = PREAMBLE_SIZE + len(p.header)
        for i, body in enumerate(p.bodies):
            frame_at = next_frame_offset(pos, a)
            recs[i]["offset"] = frame_at + FRAME_SIZE
            recs[i]["stored_length"] = len(body)
            recs[i]["checksum"] = xxh3(body)
            pos = frame_at + FRAME_SIZE + len(body)
    if edit is not None:
        edit(recs)
    frames, index_recs = recs.copy(), recs.copy()
    if edit_frames is not None:
        edit_frames(frames)
    if edit_index is not None:
        edit_index(index_recs)

    out = bytearray(build_preamble(p.header) + p.header)
    for i, body in enumerate(p.bodies):
        frame_at = next_frame_offset(len(out), a)
        pad = bytes(frame_at - len(out))
        if i == 0 and header_pad is not None and pad:
            pad = (header_pad * len(pad))[: len(pad)]
        out += pad + build_frame(frames[i]) + bytes(body)
    frame_at = next_frame_offset(len(out), a) + gap_before_end
    out += bytes(frame_at - len(out))
    digest_recs = index_recs if form == "file" else frames
    count = len(digest_recs) if end_count is None else end_count
    digest = xxh3(digest_recs.tobytes()) if end_digest is None else end_digest
    if end_frame is None:
        body = END.pack(count, digest, end_reserved)
        end_frame = b"KWEN" + struct.pack("<I", check32(body)) + body
    out += end_frame
    if form == "file":
        index_offset = len(out)
        idx = (build_index(index_recs) if index is None else index) + index_tail
        npad = -(index_offset + len(idx)) % 8
        pad = bytes(npad) if index_pad is None else index_pad
        trailer = build_trailer(index_offset, idx)
        if trailer_reserved:
            vals = list(TRAILER.unpack(trailer))
            vals[2] = trailer_reserved
            trailer = TRAILER.pack(*vals)
        out += idx + pad + trailer
    out += trailing
    return bytes(out)


def rebuild(data, **kw) -> bytes:
    """``assemble(split(data), **kw)``."""
    return assemble(split(data), **kw)


def set_records(**fields):
    """An ``edit`` that sets record fields: ``set_records(layer=(0, 7))`` sets record 0's layer to 7."""
    def edit(recs):
        for name, (i, value) in fields.items():
            recs[i][name] = value
    return edit


# ---------------------------------------------------------------------------------------
# Layout of a valid container and in-place patchers
# ---------------------------------------------------------------------------------------

@dataclass
class Layout:
    header_length: int
    frames: list  # frame positions
    bodies: list  # (offset, length)
    end_frame: int
    index: tuple | None  # (offset, length)
    trailer: int | None
    size: int

    def padding(self) -> list:
        """[start, stop) of every padding region (possibly empty ones dropped)."""
        regions, end = [], PREAMBLE_SIZE + self.header_length
        for f, (o, n) in zip(self.frames, self.bodies):
            regions.append((end, f))
            end = o + n
        regions.append((end, self.end_frame))
        if self.index is not None:
            regions.append((self.index[0] + self.index[1], self.trailer))
        return [(s, e) for s, e in regions if e > s]


def layout(data) -> Layout:
    data = bytes(data)
    _, hlen, _ = parse_preamble(data)
    with kvwire.open(data) as r:
        recs = r.records
        bodies = [(int(o), int(n)) for o, n in zip(recs["offset"], recs["stored_length"])]
        if r.form == "file":
            off, length = struct.unpack_from("<QI", data, len(data) - TRAILER_SIZE)
            return Layout(hlen, [o - FRAME_SIZE for o, _ in bodies], bodies, off - FRAME_SIZE, (off, length),
                          len(data) - TRAILER_SIZE, len(data))
        return Layout(hlen, [o - FRAME_SIZE for o, _ in bodies], bodies, len(data) - FRAME_SIZE, None, None,
                      len(data))


def patch_preamble(data, *, fix_check: bool = True, fix_header_checksum: bool = False, **fields) -> bytes:
    """Rewrite preamble fields (names in PREAMBLE_FIELDS); the self-check is recomputed
    unless ``check`` is given or ``fix_check`` is false."""
    data = bytearray(data)
    vals = dict(zip(PREAMBLE_FIELDS, PREAMBLE.unpack_from(data, 0)))
    unknown = set(fields) - set(PREAMBLE_FIELDS)
    assert not unknown, unknown
    vals.update(fields)
    if fix_header_checksum:
        vals["header_checksum"] = xxh3(bytes(data[PREAMBLE_SIZE : PREAMBLE_SIZE + vals["header_length"]]))
    raw = PREAMBLE.pack(*(vals[f] for f in PREAMBLE_FIELDS))
    if fix_check and "check" not in fields:
        raw = raw[:28] + struct.pack("<I", check32(raw[:28]))
    data[:PREAMBLE_SIZE] = raw
    return bytes(data)


def patch_trailer(data, *, fix_checksum: bool = False, **fields) -> bytes:
    """Rewrite trailer fields (names in TRAILER_FIELDS); ``fix_checksum`` recomputes the
    index checksum over the (new) index range."""
    data = bytearray(data)
    at = len(data) - TRAILER_SIZE
    vals = dict(zip(TRAILER_FIELDS, TRAILER.unpack_from(data, at)))
    vals.update(fields)
    if fix_checksum:
        vals["index_checksum"] = xxh3(bytes(data[vals["index_offset"] : vals["index_offset"] + vals["index_length"]]))
    data[at:] = TRAILER.pack(*(vals[f] for f in TRAILER_FIELDS))
    return bytes(data)


def set_byte(data, pos: int, value: int) -> bytes:
    data = bytearray(data)
    data[pos] = value
    return bytes(data)


def xor_byte(data, pos: int, mask: int = 0x01) -> bytes:
    data = bytearray(data)
    data[pos] ^= mask
    return bytes(data)


def refix_frame(data, pos: int) -> bytes:
    """Recompute the self-check of the frame at ``pos`` after its 56 bytes were changed."""
    data = bytearray(data)
    data[pos + 4 : pos + 8] = struct.pack("<I", check32(bytes(data[pos + 8 : pos + FRAME_SIZE])))
    return bytes(data)


# ---------------------------------------------------------------------------------------
# Headers
# ---------------------------------------------------------------------------------------

def wrap_header(hb: bytes, *, alignment: int = 64, minor: int | None = None) -> bytes:
    """A zero-chunk stream container around arbitrary header bytes (checksums correct)."""
    out = build_preamble(hb) + hb
    if minor is not None:
        out = patch_preamble(out, minor=minor)
    frame_at = next_frame_offset(len(out), alignment)
    return out + bytes(frame_at - len(out)) + build_end_frame(0, xxh3(b""))


def header_of(h: kvwire.Header, *, check: bool = False) -> bytes:
    """FlatBuffer bytes of ``h``; with ``check=False`` the semantic checks are skipped
    (``check_header`` and the writer-only ``check_writable`` are bypassed), so headers no
    writer may emit can be built."""
    import kvwire.format.header as H

    if check:
        return H.build_header(h)
    names = [n for n in ("check_header", "check_writable") if hasattr(H, n)]
    saved = {n: getattr(H, n) for n in names}
    for n in names:
        setattr(H, n, lambda _h: None)
    try:
        return H.build_header(h)
    finally:
        for n, f in saved.items():
            setattr(H, n, f)


DEFAULT_LAYER = dict(num_kv_heads=1, head_dim_k=8, head_dim_v=8)


def _fb_rope(b, rope: dict) -> int:
    vecs = {}
    for name in ("short_factor", "long_factor"):
        if name in rope:
            vecs[name] = b.CreateNumpyVector(np.asarray(rope[name], "<f8"))
    if "mrope_section" in rope:
        vecs["mrope_section"] = b.CreateNumpyVector(np.asarray(rope["mrope_section"], "<u4"))
    fbRope.Start(b)
    adders = {
        "rope_type": fbRope.AddRopeType, "theta": fbRope.AddTheta, "rotary_dim": fbRope.AddRotaryDim,
        "interleaved": fbRope.AddInterleaved, "factor": fbRope.AddFactor,
        "original_max_position_embeddings": fbRope.AddOriginalMaxPositionEmbeddings,
        "low_freq_factor": fbRope.AddLowFreqFactor, "high_freq_factor": fbRope.AddHighFreqFactor,
        "beta_fast": fbRope.AddBetaFast, "beta_slow": fbRope.AddBetaSlow,
        "attention_factor": fbRope.AddAttentionFactor, "mscale": fbRope.AddMscale,
        "mscale_all_dim": fbRope.AddMscaleAllDim, "seq_len_at_encode": fbRope.AddSeqLenAtEncode,
        "short_factor": fbRope.AddShortFactor, "long_factor": fbRope.AddLongFactor,
        "mrope_section": fbRope.AddMropeSection,
    }
    for name, value in rope.items():
        adders[name](b, vecs.get(name, value))
    return fbRope.End(b)


def fb_header(*, layers=None, layer_spec_index=None, num_layers=None, arch: bool = True, arch_rope=None,
              format_major: int = 1, format_minor: int = 0, required_features: int = 0,
              optional_features: int = 0, dtype: int = 1, alignment: int = 64, chunk_tokens: int = 16,
              first_position: int = 0, token_count: int = 0, layer_tokens=None, layer_map=None,
              checksum_algorithm: int = 0, metadata=None, producer=("kvwire", "test"), model=None,
              identifier: bytes = b"KVWH", force_defaults: bool = False) -> bytes:
    """A Header FlatBuffer from raw numeric values, built with the generated builders.

    ``layers``: list of dicts of LayerSpec fields (numeric codes, ``rope`` a dict of
    RopeParams fields); ``layer_spec_index`` defaults to one spec per layer;
    ``layer_tokens``: list of (start, count); ``layer_map``: list of (receiver,
    transmitted, op code); ``metadata``: list of (key str|bytes|None, value bytes|None).
    Nothing here checks the values: that is the point.
    """
    b = flatbuffers.Builder(1024)
    if force_defaults:
        b.ForceDefaults(True)
    arch_off = None
    if arch:
        layers = [DEFAULT_LAYER] if layers is None else layers
        spec_offs = []
        for spec in layers:
            rope = _fb_rope(b, spec["rope"]) if spec.get("rope") is not None else None
            fbLayer.Start(b)
            adders = {
                "kind": fbLayer.AddKind, "num_kv_heads": fbLayer.AddNumKvHeads, "head_dim_k": fbLayer.AddHeadDimK,
                "head_dim_v": fbLayer.AddHeadDimV, "window": fbLayer.AddWindow,
                "source_layer": fbLayer.AddSourceLayer, "uses_rope": fbLayer.AddUsesRope,
                "kv_lora_rank": fbLayer.AddKvLoraRank, "qk_rope_head_dim": fbLayer.AddQkRopeHeadDim,
            }
            for name, value in spec.items():
                if name != "rope":
                    adders[name](b, value)
            if rope is not None:
                fbLayer.AddRope(b, rope)
            spec_offs.append(fbLayer.End(b))
        fbArch.StartLayerSpecsVector(b, len(spec_offs))
        for off in reversed(spec_offs):
            b.PrependUOffsetTRelative(off)
        specs_vec = b.EndVector()
        index = list(range(len(layers))) if layer_spec_index is None else layer_spec_index
        index_vec = b.CreateNumpyVector(np.asarray(index, "<u2")) if index is not False else None
        rope = _fb_rope(b, arch_rope) if arch_rope is not None else None
        fbArch.Start(b)
        fbArch.AddNumLayers(b, len(index or []) if num_layers is None else num_layers)
        fbArch.AddLayerSpecs(b, specs_vec)
        if index_vec is not None:
            fbArch.AddLayerSpecIndex(b, index_vec)
        if rope is not None:
            fbArch.AddRope(b, rope)
        arch_off = fbArch.End(b)
    prod_off = None
    if producer is not None:
        lib, ver = (b.CreateString(s) if s is not None else None for s in producer)
        fbProducer.Start(b)
        if lib is not None:
            fbProducer.AddLibrary(b, lib)
        if ver is not None:
            fbProducer.AddVersion(b, ver)
        prod_off = fbProducer.End(b)
    model_off = None
    if model is not None:  # dict fid -> str/bytes
        offs = {fid: (b.CreateString(v) if fid < 3 else b.CreateByteVector(v)) for fid, v in model.items()}
        fbModel.Start(b)
        for fid, off in offs.items():
            b.PrependUOffsetTRelativeSlot(fid, off, 0)
        model_off = fbModel.End(b)
    map_off = None
    if layer_map is not None:
        fbHeader.StartLayerMapVector(b, len(layer_map))
        for r, t, op in reversed(layer_map):
            fbMap.CreateLayerMapEntry(b, r, t, op)
        map_off = b.EndVector()
    ranges_off = None
    if layer_tokens is not None:
        fbHeader.StartLayerTokensVector(b, len(layer_tokens))
        for s, c in reversed(layer_tokens):
            fbRange.CreateTokenRange(b, s, c)
        ranges_off = b.EndVector()
    md_off = None
    if metadata is not None:
        kvs = []
        for key, value in metadata:
            k = b.CreateString(key) if key is not None else None
            v = b.CreateByteVector(value) if value is not None else None
            fbKV.Start(b)
            if k is not None:
                fbKV.AddKey(b, k)
            if v is not None:
                fbKV.AddValue(b, v)
            kvs.append(fbKV.End(b))
        fbHeader.StartCustomMetadataVector(b, len(kvs))
        for off in reversed(kvs):
            b.PrependUOffsetTRelative(off)
        md_off = b.EndVector()
    fbHeader.Start(b)
    fbHeader.AddFormatMajor(b, format_major)
    fbHeader.AddFormatMinor(b, format_minor)
    fbHeader.AddRequiredFeatures(b, required_features)
    fbHeader.AddOptionalFeatures(b, optional_features)
    if prod_off is not None:
        fbHeader.AddProducer(b, prod_off)
    if model_off is not None:
        fbHeader.AddModel(b, model_off)
    if arch_off is not None:
        fbHeader.AddArch(b, arch_off)
    if map_off is not None:
        fbHeader.AddLayerMap(b, map_off)
    fbHeader.AddDtype(b, dtype)
    fbHeader.AddAlignment(b, alignment)
    fbHeader.AddChunkTokens(b, chunk_tokens)
    fbHeader.AddFirstPosition(b, first_position)
    fbHeader.AddTokenCount(b, token_count)
    if ranges_off is not None:
        fbHeader.AddLayerTokens(b, ranges_off)
    fbHeader.AddChecksumAlgorithm(b, checksum_algorithm)
    if md_off is not None:
        fbHeader.AddCustomMetadata(b, md_off)
    b.Finish(fbHeader.End(b), file_identifier=identifier)
    return bytes(b.Output())


def fb_index(records: np.ndarray | None, *, identifier: bytes = b"KVWI") -> bytes:
    """A ChunkIndex FlatBuffer; ``records=None`` omits the required vector."""
    if records is not None and identifier == b"KVWI":
        return build_index(records)
    b = flatbuffers.Builder(256)
    vec = None
    if records is not None:
        b.StartVector(RECORD_SIZE, len(records), 8)
        b.head -= records.nbytes
        b.Bytes[b.head : b.head + records.nbytes] = records.tobytes()
        vec = b.EndVector()
    fbIndex.Start(b)
    if vec is not None:
        fbIndex.AddRecords(b, vec)
    b.Finish(fbIndex.End(b), file_identifier=identifier)
    return bytes(b.Output())


def root_table(hb: bytes, identifier: bytes = b"KVWH"):
    """The verified root Table of valid FlatBuffer bytes, to locate fields for patching."""
    return Buffer(bytes(hb), identifier, "test").root()


def field_pos(table, fid: int, size: int) -> int:
    pos = table._field(fid, size)
    assert pos is not None, f"field {fid} not present"
    return pos


def vtable_entry(table, fid: int) -> int:
    """Position of the vtable slot holding field ``fid``'s offset."""
    assert fid < table.nfields
    return table.vt + 4 + 2 * fid


def patch(data: bytes, pos: int, fmt: str, value) -> bytes:
    data = bytearray(data)
    struct.pack_into("<" + fmt, data, pos, value)
    return bytes(data)
