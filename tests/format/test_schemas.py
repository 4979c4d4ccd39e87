"""The schemas, the generated code and the hand-written codec agree.

* ``python/kvwire/format/fbs`` is exactly what ``tools/gen_schemas.py`` makes from ``schemas/``.
* A header written by ``build_header`` and read back through the *generated* accessors
  (which know the .fbs defaults) says the same as ``parse_header`` (which uses the
  dataclass defaults and its own verifying reader), field by field, including the fields
  the writer omitted because they hold their default value.
"""

import pathlib
import shutil
import subprocess
import sys

import flatbuffers
import numpy as np
import pytest

import forge
import kvwire
from kvwire.format import registry as R
from kvwire.format.architecture import _LAYER_SCALARS, _ROPE_SCALARS
from kvwire.format.fbs import Architecture as fbArch
from kvwire.format.fbs import Header as fbHeader
from kvwire.format.fbs import LayerSpec as fbLayer
from kvwire.format.fbs import RopeParams as fbRope
from kvwire.format.header import (
    Architecture,
    Header,
    LayerMapEntry,
    LayerSpec,
    ModelIdentity,
    Producer,
    RopeParams,
    TokenRange,
    build_header,
    default_layer_tokens,
    parse_header,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
FBS = ROOT / "python" / "kvwire" / "format" / "fbs"


# ---------------------------------------------------------------------------------------
# Generated code is up to date
# ---------------------------------------------------------------------------------------

@pytest.mark.flatc
def test_generated_code_matches_the_schemas(tmp_path):
    flatc = shutil.which("flatc")
    if flatc is None:
        pytest.fail("flatc not on PATH (make test installs it; or apt-get install flatbuffers-compiler): "
                    "cannot regenerate python/kvwire/format/fbs")
    version = subprocess.run([flatc, "--version"], capture_output=True, text=True).stdout.strip()
    out = tmp_path / "fbs"
    subprocess.run([sys.executable, str(ROOT / "tools" / "gen_schemas.py"), str(out)], check=True, timeout=120)
    generated = {p.name: p.read_bytes() for p in out.glob("*.py")}
    committed = {p.name: p.read_bytes() for p in FBS.glob("*.py")}
    assert sorted(generated) == sorted(committed), f"file sets differ ({version})"
    stale = [name for name in generated if generated[name] != committed[name]]
    assert not stale, f"python/kvwire/format/fbs is stale for {stale}: run `make schemas` ({version})"


@pytest.mark.parametrize("name", ["--help", "not-generated"])
def test_generator_never_replaces_a_folder_it_did_not_write(tmp_path, name):
    """``gen_schemas.py`` removes its output folder before writing: a folder it did not write
    (a mistyped argument, a flag taken as a path) is refused and left as it was."""
    out = tmp_path / name
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_schemas.py"), str(out)], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode != 0 and "not replacing it" in proc.stderr
    assert (out / "keep.txt").read_text() == "mine"
    helped = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_schemas.py"), "--help"], capture_output=True,
                            text=True, timeout=60, cwd=tmp_path)
    assert helped.returncode == 0 and "usage" in helped.stdout and not (tmp_path / "--help" / "Header.py").exists()


def test_schema_enums_match_the_registries():
    """Every enum of kvwire.format.fbs, value by value, against the registry tables."""
    from kvwire.format.fbs import ChecksumAlgorithm, Codec, Component, DType, LayerKind, MapOp, RopeType

    pairs = [(DType.DType, {n: c for n, (c, _, _) in R.DTYPES.items()}), (Codec.Codec, R.CODECS),
             (Component.Component, R.COMPONENTS), (LayerKind.LayerKind, R.LAYER_KINDS),
             (ChecksumAlgorithm.ChecksumAlgorithm, R.CHECKSUM_ALGORITHMS), (RopeType.RopeType, R.ROPE_TYPES),
             (MapOp.MapOp, R.MAP_OPS)]
    for enum_cls, registry in pairs:
        members = {k: v for k, v in vars(enum_cls).items() if not k.startswith("_")}
        assert {k.lower(): v for k, v in members.items()} == registry, enum_cls.__name__


def test_chunk_record_struct_matches_record_dtype():
    from kvwire.format.container import RECORD_DTYPE
    from kvwire.format.fbs import ChunkRecord

    rec = np.zeros(1, RECORD_DTYPE)
    values = dict(offset=1 << 40, stored_length=2, raw_length=3, checksum=(1 << 64) - 1, token_start=5,
                  token_count=6, layer=7, component=2, codec=1, flags=0x1234, head_start=9, head_count=10,
                  reserved0=11, reserved1=12)
    for k, v in values.items():
        rec[k] = v
    b = flatbuffers.Builder(0)
    ChunkRecord.CreateChunkRecord(b, *values.values())
    raw = bytes(b.Bytes[b.Head() :])
    assert raw == rec.tobytes()
    assert ChunkRecord.ChunkRecord.SizeOf() == RECORD_DTYPE.itemsize
    cr = ChunkRecord.ChunkRecord()
    cr.Init(bytearray(raw), 0)
    for k, v in values.items():
        assert getattr(cr, _snake_to_camel(k))() == v, k


# ---------------------------------------------------------------------------------------
# Generated accessors vs parse_header
# ---------------------------------------------------------------------------------------

def _name(s) -> str:
    return "" if s is None else s.decode("utf-8")


def _blob(t, name) -> bytes:
    if getattr(t, name + "IsNone")():
        return b""
    return bytes(getattr(t, name + "AsNumpy")().tobytes())


def _snake_to_camel(name: str) -> str:
    return "".join(p.capitalize() for p in name.split("_"))


def rope_from_fb(r) -> RopeParams | None:
    if r is None:
        return None
    kw = {}
    for attr, _, _, enum in _ROPE_SCALARS:
        v = getattr(r, _snake_to_camel(attr))()
        kw[attr] = {c: n for n, c in enum.items()}[v] if enum else v
    for attr in ("short_factor", "long_factor", "mrope_section"):
        cam = _snake_to_camel(attr)
        kw[attr] = tuple(getattr(r, cam)(j) for j in range(getattr(r, cam + "Length")()))
    return RopeParams(**kw)


def header_from_generated(data: bytes) -> Header:
    """A Header read entirely through the flatc-generated accessors (schema defaults)."""
    assert fbHeader.Header.HeaderBufferHasIdentifier(data, 0)
    h = fbHeader.Header.GetRootAs(data, 0)
    a = h.Arch()
    specs = []
    for j in range(a.LayerSpecsLength()):
        s = a.LayerSpecs(j)
        kw = {}
        for attr, _, _, enum in _LAYER_SCALARS:
            v = getattr(s, _snake_to_camel(attr))()
            kw[attr] = {c: n for n, c in enum.items()}[v] if enum else v
        kw["rope"] = rope_from_fb(s.Rope())
        specs.append(LayerSpec(**kw))
    assert a.NumLayers() == a.LayerSpecIndexLength()
    arch = Architecture(tuple(specs[a.LayerSpecIndex(i)] for i in range(a.LayerSpecIndexLength())),
                        rope=rope_from_fb(a.Rope()), keys_post_rope=a.KeysPostRope(),
                        schema_version=a.SchemaVersion())
    p, m = h.Producer(), h.Model()
    producer = Producer(_name(p.Library()), _name(p.Version())) if p else Producer("", "")
    model = ModelIdentity(_name(m.ModelType()), _name(m.ModelId()), _name(m.Revision()),
                          _blob(m, "ConfigFingerprint"), _blob(m, "TokenizerFingerprint"),
                          _blob(m, "WeightsFingerprint"), _blob(m, "CompatFingerprint")) if m else ModelIdentity()
    ranges = tuple(TokenRange(h.LayerTokens(i).Start(), h.LayerTokens(i).Count()) for i in range(h.LayerTokensLength()))
    return Header(
        arch=arch,
        token_count=h.TokenCount(),
        dtype=R.DTYPE_BY_CODE[h.Dtype()],
        first_position=h.FirstPosition(),
        layer_tokens=ranges or None,
        chunk_tokens=h.ChunkTokens(),
        alignment=h.Alignment(),
        model=model,
        producer=producer,
        layer_map=tuple(LayerMapEntry(h.LayerMap(i).ReceiverLayer(), h.LayerMap(i).TransmittedLayer(),
                                      R.MAP_OP_BY_CODE[h.LayerMap(i).Op()]) for i in range(h.LayerMapLength())),
        metadata={_name(h.CustomMetadata(i).Key()): _blob(h.CustomMetadata(i), "Value")
                  for i in range(h.CustomMetadataLength())},
        checksum_algorithm=R.CHECKSUM_BY_CODE[h.ChecksumAlgorithm()],
        required_features=h.RequiredFeatures(),
        optional_features=h.OptionalFeatures(),
        format_major=h.FormatMajor(),
        format_minor=h.FormatMinor(),
    )


def assert_same_header(a: Header, b: Header):
    """Field by field, so a failure names the field."""
    for f in Header.__dataclass_fields__:
        if f == "arch":
            for g in Architecture.__dataclass_fields__:
                if g == "layers":
                    assert len(a.arch.layers) == len(b.arch.layers)
                    for i, (x, y) in enumerate(zip(a.arch.layers, b.arch.layers)):
                        for s in LayerSpec.__dataclass_fields__:
                            assert getattr(x, s) == getattr(y, s), f"arch.layers[{i}].{s}"
                else:
                    assert getattr(a.arch, g) == getattr(b.arch, g), f"arch.{g}"
        else:
            assert getattr(a, f) == getattr(b, f), f
    assert a == b


DEFAULTS = Header(Architecture.uniform(1, 1, 8))  # every optional field left at its default
RICH = Header(
    arch=Architecture(
        (LayerSpec("full_attention", 8, 128, 96, uses_rope=False,
                   rope=RopeParams("yarn", 1e6, 64, True, 4.0, 8192, 2.0, 8.0, 16.0, 2.0, 0.9, 1.1, 0.5,
                                   (1.0, 1.5), (2.0,), (16, 24, 24), 4096)),
         LayerSpec("sliding_attention", 8, 128, 128, window=4096),
         LayerSpec("mla_latent", 1, 576, 0, kv_lora_rank=512, qk_rope_head_dim=64),
         LayerSpec("shared", source_layer=1),
         LayerSpec("chunked_attention", 2, 64, 64, window=8192)),
        rope=RopeParams("llama3", 5e5, factor=8.0, original_max_position_embeddings=8192),
        keys_post_rope=False, schema_version=3),
    token_count=1000, dtype="f8_e4m3fnuz", first_position=123456789012,
    layer_tokens=(TokenRange(0, 1000), TokenRange(900, 100), TokenRange(0, 1000), TokenRange(17, 0),
                  TokenRange(992, 8)),
    chunk_tokens=100, alignment=4096,
    model=ModelIdentity("llama", "meta/llama-3", "abc123", b"\x01", b"\x02\x03", b"", b"\xff" * 32),
    producer=Producer("acme", "9.9"),
    layer_map=(LayerMapEntry(0, 0), LayerMapEntry(1, 4, "alias"), LayerMapEntry(7, -1, "drop")),
    metadata={"app.request": b"\x00id", "vllm.block_size": b"16"},
    optional_features=0x5, format_minor=2,
)


@pytest.mark.parametrize("h", [DEFAULTS, RICH], ids=["defaults", "rich"])
def test_generated_accessors_agree_with_parse_header(h):
    # RICH holds values a reader must accept but this writer refuses to emit (a newer
    # minor version, optional feature bits, schema_version 3), so the writer's own
    # checks are bypassed; parse_header still applies every reader check.
    data = forge.header_of(h)
    ours = parse_header(data)
    assert_same_header(ours, h)
    assert_same_header(header_from_generated(data), ours)


def test_defaults_are_really_omitted_from_the_buffer():
    """So that the previous test compares schema defaults, not written values."""
    data = build_header(DEFAULTS)
    h = fbHeader.Header.GetRootAs(data, 0)
    spec = h.Arch().LayerSpecs(0)
    absent = lambda table, fid: table._tab.Offset(4 + 2 * fid) == 0
    assert all(absent(spec, fid) for _, fid, _, _ in _LAYER_SCALARS if fid not in (1, 2, 3))
    assert absent(h.Arch(), 0) and absent(h.Arch(), 5)  # schema_version, keys_post_rope
    assert h.LayerTokensIsNone() and h.LayerMapIsNone() and h.CustomMetadataIsNone()


@pytest.mark.parametrize("cls,start,end,spec", [
    (RopeParams, fbRope.Start, fbRope.End, _ROPE_SCALARS),
    (LayerSpec, fbLayer.Start, fbLayer.End, _LAYER_SCALARS),
], ids=["RopeParams", "LayerSpec"])
def test_dataclass_defaults_equal_schema_defaults(cls, start, end, spec):
    """An empty table read through the generated accessors yields the schema defaults;
    they must equal the dataclass defaults the writer uses to omit fields."""
    b = flatbuffers.Builder(64)
    start(b)
    b.Finish(end(b))
    data = bytes(b.Output())
    t = getattr(sys.modules[start.__module__], cls.__name__).GetRootAs(data, 0)
    for attr, _, _, enum in spec:
        schema_default = getattr(t, _snake_to_camel(attr))()
        ours = cls.__dataclass_fields__[attr].default
        if enum is not None:
            ours = enum[ours]
        assert schema_default == ours, f"{cls.__name__}.{attr}: schema {schema_default!r}, dataclass {ours!r}"


def test_header_and_architecture_defaults_match_the_schema():
    b = flatbuffers.Builder(64)
    fbArch.Start(b)
    arch = fbArch.End(b)
    fbHeader.Start(b)
    fbHeader.AddArch(b, arch)
    b.Finish(fbHeader.End(b))
    h = fbHeader.Header.GetRootAs(bytes(b.Output()), 0)
    d = Header.__dataclass_fields__
    assert R.DTYPE_BY_CODE[h.Dtype()] == d["dtype"].default
    assert h.Alignment() == d["alignment"].default
    assert h.ChunkTokens() == d["chunk_tokens"].default
    assert h.TokenCount() == d["token_count"].default
    assert h.FirstPosition() == d["first_position"].default
    assert R.CHECKSUM_BY_CODE[h.ChecksumAlgorithm()] == d["checksum_algorithm"].default
    assert (h.RequiredFeatures(), h.OptionalFeatures()) == (d["required_features"].default,
                                                            d["optional_features"].default)
    a = h.Arch()
    assert a.SchemaVersion() == Architecture.__dataclass_fields__["schema_version"].default
    assert a.KeysPostRope() == Architecture.__dataclass_fields__["keys_post_rope"].default


def test_parse_header_uses_schema_defaults_for_absent_fields():
    """A header holding only what is required (arch with one layer, format 1.0): the
    verifying reader fills every absent field with the schema's default."""
    b = flatbuffers.Builder(256)
    fbLayer.Start(b)
    fbLayer.AddNumKvHeads(b, 1)
    fbLayer.AddHeadDimK(b, 4)
    fbLayer.AddHeadDimV(b, 4)
    spec = fbLayer.End(b)
    fbArch.StartLayerSpecsVector(b, 1)
    b.PrependUOffsetTRelative(spec)
    specs = b.EndVector()
    index = b.CreateNumpyVector(np.zeros(1, "<u2"))
    fbArch.Start(b)
    fbArch.AddNumLayers(b, 1)
    fbArch.AddLayerSpecs(b, specs)
    fbArch.AddLayerSpecIndex(b, index)
    arch = fbArch.End(b)
    fbHeader.Start(b)
    fbHeader.AddFormatMajor(b, 1)
    fbHeader.AddArch(b, arch)
    b.Finish(fbHeader.End(b), file_identifier=b"KVWH")
    data = bytes(b.Output())
    ours = parse_header(data)
    assert_same_header(header_from_generated(data), ours)
    assert ours.producer == Producer("", "") and ours.model == ModelIdentity()
    assert ours.layer_tokens == default_layer_tokens(ours.arch, 0)
    assert kvwire.probe(forge.wrap_header(data)) == ours
