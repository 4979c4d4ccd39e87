"""Round trips: decode equals input bit for bit over the whole space of valid caches.

Layer kinds (full, sliding, chunked, MLA latent, shared), per-layer token ranges, all
dtypes (random bit patterns, so NaN payloads and negative zeros included), chunk sizes,
alignments, codecs and forms; plus zero-copy views, atomic save, probe, the torch
backend and the incremental ``Encoder``.
"""

import os

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import forge
import kvwire
import kvwire.cache.encoder
import kvwire.cache.files
import kvwire.tools.synth
from kvwire.cache.tensors import as_numpy
from kvwire.format import limits as L
from kvwire.format import registry as R
from kvwire.format.container import FRAME_SIZE, PREAMBLE_SIZE, parse_preamble
from kvwire.format.header import build_header, parse_header

torch = pytest.importorskip("torch")  # a declared test dependency (pyproject [test])

DTYPES = sorted(R.DTYPES)
FORMS = ("file", "stream")


# ---------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------

@st.composite
def headers(draw, max_layers: int = 4, max_tokens: int = 40):
    dtype = draw(st.sampled_from(DTYPES))
    token_count = draw(st.one_of(st.sampled_from([0, 1]), st.integers(0, max_tokens)))
    specs, ranges = [], []
    for _i in range(draw(st.integers(1, max_layers))):
        sources = [j for j, s in enumerate(specs) if s.kind != "shared"]
        kinds = ["full_attention", "sliding_attention", "chunked_attention", "mla_latent"] + (["shared"] if sources else [])
        kind = draw(st.sampled_from(kinds))
        if kind == "shared":
            specs.append(kvwire.LayerSpec("shared", source_layer=draw(st.sampled_from(sources))))
            ranges.append(kvwire.TokenRange(draw(st.integers(0, token_count)), 0))
            continue
        if kind == "mla_latent":
            rank, rope = draw(st.integers(1, 8)), draw(st.integers(0, 4))
            specs.append(kvwire.LayerSpec("mla_latent", 1, rank + rope, 0, kv_lora_rank=rank, qk_rope_head_dim=rope))
        else:
            window = draw(st.integers(1, 64)) if kind != "full_attention" else 0
            specs.append(kvwire.LayerSpec(kind, draw(st.integers(1, 3)), draw(st.integers(1, 9)),
                                          draw(st.integers(1, 9)), window=window))
        start = draw(st.integers(0, token_count))
        ranges.append(kvwire.TokenRange(start, draw(st.integers(0, token_count - start))))
    return kvwire.Header(
        arch=kvwire.Architecture(tuple(specs)),
        token_count=token_count,
        dtype=dtype,
        first_position=draw(st.integers(0, 1 << 40)),
        layer_tokens=tuple(ranges),
        chunk_tokens=draw(st.sampled_from([1, 3, 8, 16, 256])),
        alignment=draw(st.sampled_from([64, 128, 4096])),
    )


def cache_for(header: kvwire.Header, seed: int, compressible: bool) -> kvwire.KVCache:
    rng = np.random.default_rng(seed)
    layers = []
    for spec, r in zip(header.arch.layers, header.layer_tokens):
        layers.append({c: forge.random_tensor(rng, spec.shape(c, r.count), header.dtype, compressible=compressible)
                       for c in spec.components})
    return kvwire.KVCache(header, layers)


@st.composite
def caches(draw, **kw):
    return cache_for(draw(headers(**kw)), draw(st.integers(0, 2**32 - 1)), draw(st.booleans()))


def check_roundtrip(cache: kvwire.KVCache, codec: str) -> dict:
    """Encode in both forms, decode, and check everything a decode promises."""
    out = {}
    for form in FORMS:
        data = kvwire.encode(cache, form=form, codec=codec)
        with kvwire.open(data) as r:
            assert r.form == form
            r.validate()
            a = cache.header.alignment
            assert (r.records["offset"] % a == 0).all(), "every body offset is a multiple of the alignment"
            loaded = r.load()
        assert forge.cache_bytes_equal(loaded, cache)
        assert loaded.equal(cache)
        out[form] = data
    # the stream form is the file form without its index and trailer
    assert out["file"].startswith(out["stream"])
    return out


# ---------------------------------------------------------------------------------------
# Property tests
# ---------------------------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(cache=caches(), codec=st.sampled_from(["raw", "zstd"]))
def test_roundtrip_any_architecture(cache, codec):
    check_roundtrip(cache, codec)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(DTYPES), codec=st.sampled_from(["raw", "zstd"]))
def test_roundtrip_from_tensors_with_uneven_layers(data, dtype, codec):
    """KVCache.from_tensors: K and V head dims differ, some layers hold fewer (the most recent) tokens."""
    n_layers = data.draw(st.integers(1, 3))
    tokens = data.draw(st.integers(0, 40))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    keys, values = [], []
    for i in range(n_layers):
        t = tokens if i == 0 else data.draw(st.integers(0, tokens))
        heads, dk, dv = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 8)), data.draw(st.integers(1, 8))
        keys.append(forge.random_tensor(rng, (heads, t, dk), dtype))
        values.append(forge.random_tensor(rng, (heads, t, dv), dtype))
    cache = kvwire.KVCache.from_tensors(keys, values, chunk_tokens=data.draw(st.sampled_from([1, 5, 16])))
    assert cache.header.layer_tokens[0] == kvwire.TokenRange(0, tokens)
    for k, r in zip(keys, cache.header.layer_tokens):
        assert r == kvwire.TokenRange(tokens - k.shape[1], k.shape[1])
    check_roundtrip(cache, codec)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [0, 1, 16, 17, 50])
def test_roundtrip_every_dtype_and_token_count(dtype, tokens):
    cache = forge.small_cache(2, 2, 4, tokens, dtype=dtype, chunk_tokens=16, compressible=False, head_dim_v=6)
    check_roundtrip(cache, "zstd")


@pytest.mark.parametrize("dtype,bits", [
    ("f32", [0x7FC00000, 0x7FC00001, 0xFFC12345, 0x7F800001, 0x7FBFFFFF, 0x80000000, 0x7F800000]),
    ("f16", [0x7E00, 0x7E01, 0xFC01, 0x7C01, 0x8000, 0x7C00]),
    ("bf16", [0x7FC0, 0x7FC1, 0xFF81, 0x7F81, 0x8000, 0x7F80]),
    ("f8_e4m3fn", [0x7F, 0xFF, 0x80]),
    ("f8_e5m2", [0x7D, 0x7E, 0x7F, 0xFD, 0x80]),
    ("f8_e4m3fnuz", [0x80, 0x00, 0x7F]),
], ids=lambda v: v if isinstance(v, str) else "")
def test_nan_payloads_and_signed_zeros_survive(dtype, bits):
    np_dtype = R.DTYPES[dtype][2]
    uint = {1: np.uint8, 2: np.uint16, 4: np.uint32}[np_dtype.itemsize]
    pattern = np.resize(np.array(bits, uint), 2 * 20 * 3).reshape(2, 20, 3)
    k = pattern.view(np_dtype)
    v = np.ascontiguousarray(pattern[:, :, ::-1]).view(np_dtype)
    cache = kvwire.KVCache.from_tensors([k], [v], chunk_tokens=8)
    for codec in ("raw", "zstd"):
        for form in FORMS:
            loaded = kvwire.load(kvwire.encode(cache, form=form, codec=codec))
            assert np.array_equal(loaded.keys(0).view(uint), pattern)
            assert np.array_equal(loaded.values(0).view(uint), pattern[:, :, ::-1])


@pytest.mark.parametrize("alignment", [64, 128, 4096])
def test_body_offsets_are_aligned(alignment):
    cache = forge.small_cache(2, 3, 5, 37, chunk_tokens=8, alignment=alignment)
    for form in FORMS:
        for codec in ("raw", "zstd"):
            data = kvwire.encode(cache, form=form, codec=codec)
            with kvwire.open(data) as r:
                offs = r.records["offset"]
                assert len(offs) == 2 * 2 * 5 and (offs % alignment == 0).all()
                # frames sit right before their bodies; the first one as early as the rule allows
                _, hlen, _ = parse_preamble(data)
                assert int(offs[0]) - FRAME_SIZE < PREAMBLE_SIZE + hlen + alignment
            assert forge.cache_bytes_equal(kvwire.load(data), cache)


def test_header_changes_through_iter_buffers():
    cache = forge.small_cache()
    data = kvwire.encode(cache, chunk_tokens=7, alignment=256, metadata={"app.id": b"\x00\x01"})
    h = kvwire.probe(data)
    assert (h.chunk_tokens, h.alignment, h.metadata) == (7, 256, {"app.id": b"\x00\x01"})
    loaded = kvwire.load(data)
    assert forge.cache_bytes_equal(loaded, cache.with_header(chunk_tokens=7, alignment=256,
                                                             metadata={"app.id": b"\x00\x01"}))


# ---------------------------------------------------------------------------------------
# Architectures: MLA latent, shared and sliding layers
# ---------------------------------------------------------------------------------------

def mixed_cache(dtype="bf16", seed=0):
    rank, rope = 12, 4
    specs = (
        kvwire.LayerSpec("full_attention", 2, 8, 6),
        kvwire.LayerSpec("sliding_attention", 2, 8, 8, window=16),
        kvwire.LayerSpec("mla_latent", 1, rank + rope, 0, kv_lora_rank=rank, qk_rope_head_dim=rope),
        kvwire.LayerSpec("shared", source_layer=0),
        kvwire.LayerSpec("shared", source_layer=2),
        kvwire.LayerSpec("chunked_attention", 1, 4, 4, window=32),
    )
    ranges = (kvwire.TokenRange(0, 50), kvwire.TokenRange(34, 16), kvwire.TokenRange(0, 50),
              kvwire.TokenRange(0, 0), kvwire.TokenRange(0, 0), kvwire.TokenRange(32, 18))
    header = kvwire.Header(kvwire.Architecture(specs), token_count=50, dtype=dtype, layer_tokens=ranges,
                           chunk_tokens=16)
    return cache_for(header, seed, compressible=True)


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_mla_shared_and_sliding_layers(codec):
    cache = mixed_cache()
    check_roundtrip(cache, codec)
    loaded = kvwire.load(kvwire.encode(cache, codec=codec))
    assert set(loaded.layers[2]) == {"latent"} and loaded.layers[2]["latent"].shape == (1, 50, 16)
    assert loaded.layers[3] == {} and loaded.layers[4] == {}
    assert loaded.layers[1]["k"].shape == (2, 16, 8)
    with kvwire.open(kvwire.encode(cache, codec=codec)) as r:
        assert r.num_chunks(2, "latent") == 4 and r.num_chunks(2, "k") == 0 and r.num_chunks(3, "k") == 0
        assert r.num_chunks(1, "k") == 2  # tokens [34, 50): cells [34, 48) and [48, 50)


def test_sliding_layer_chunks_follow_the_global_grid():
    cache = mixed_cache()
    with kvwire.open(kvwire.encode(cache)) as r:
        starts = {(int(rec["layer"]), int(rec["token_start"]), int(rec["token_count"]))
                  for rec in r.records if rec["component"] == 0}
    # layer 1 holds tokens [34, 50): cells [34, 48) and [48, 50) of the 16-token grid
    assert {(s, n) for layer, s, n in starts if layer == 1} == {(34, 14), (48, 2)}
    assert {(s, n) for layer, s, n in starts if layer == 5} == {(32, 16), (48, 2)}


# ---------------------------------------------------------------------------------------
# Zero copy
# ---------------------------------------------------------------------------------------

def test_raw_chunks_are_views_of_the_buffer():
    cache = forge.small_cache(compressible=False)
    data = kvwire.encode(cache, codec="raw")
    whole = np.frombuffer(data, np.uint8)
    with kvwire.open(data) as r:
        for layer in range(2):
            for comp in ("k", "v"):
                for j in range(r.num_chunks(layer, comp)):
                    x = r.chunk(layer, comp, j)
                    assert np.shares_memory(x, whole)
                    rec = r.record(layer, comp, j)
                    assert x.__array_interface__["data"][0] == whole.ctypes.data + int(rec["offset"])


def test_raw_chunks_are_views_of_the_mapped_file(tmp_path):
    """KVW-CODEC-1: a raw body is used in place (zero copy)."""
    cache = forge.small_cache(compressible=False)
    path = tmp_path / "c.kvw"
    kvwire.save(path, cache)
    with kvwire.open(path) as r:
        mapped = np.frombuffer(r._buf, np.uint8)  # the mmap the reader holds
        x = r.chunk(1, "v", 2)
        assert np.shares_memory(x, mapped)
        t = r.chunk(0, "k", 1, backend="torch")
        lo = mapped.ctypes.data
        assert lo <= t.data_ptr() < lo + mapped.nbytes
        assert t.data_ptr() == lo + int(r.record(0, "k", 1)["offset"])
        assert np.array_equal(as_numpy(t).view(np.uint8), cache.keys(0)[:, 16:32].view(np.uint8))
        del x, t, mapped


def test_torch_chunk_view_points_into_the_buffer():
    cache = forge.small_cache(dtype="bf16", compressible=False)
    data = bytearray(kvwire.encode(cache, codec="raw"))
    lo = np.frombuffer(data, np.uint8).ctypes.data
    with kvwire.open(data) as r:
        t = r.chunk(1, "k", 0, backend="torch")
        assert t.dtype == torch.bfloat16 and tuple(t.shape) == (2, 16, 8)
        assert lo <= t.data_ptr() < lo + len(data)
        assert t.data_ptr() + t.numel() * t.element_size() <= lo + len(data)


def test_zstd_chunks_are_decoded_copies():
    cache = forge.small_cache()
    data = kvwire.encode(cache, codec="zstd")
    with kvwire.open(data) as r:
        assert r.record(0, "k", 0)["codec"] == R.CODECS["zstd"]
        x = r.chunk(0, "k", 0)
        assert not np.shares_memory(x, np.frombuffer(data, np.uint8))
        assert np.array_equal(x.view(np.uint8), cache.keys(0)[:, :16].view(np.uint8))


def test_iter_buffers_emits_raw_bodies_without_copying():
    cache = forge.small_cache(compressible=False)
    arrays = [x for layer in cache.layers for x in layer.values()]
    shared = 0
    for buf in kvwire.iter_buffers(cache, codec="raw"):
        view = np.frombuffer(memoryview(buf).cast("B"), np.uint8)
        shared += any(np.shares_memory(view, a) for a in arrays)
    assert shared == 2 * 2 * 3 * 2  # one buffer per head of every chunk


def test_loaded_tensors_own_their_memory():
    cache = forge.small_cache(compressible=False)
    data = bytearray(kvwire.encode(cache))
    loaded = kvwire.load(data)
    data[:] = bytes(len(data))
    assert forge.cache_bytes_equal(loaded, cache)


# ---------------------------------------------------------------------------------------
# save: atomic replace
# ---------------------------------------------------------------------------------------

def test_save_writes_a_valid_file(tmp_path):
    cache = forge.small_cache()
    path = tmp_path / "c.kvw"
    size = kvwire.save(path, cache, codec="zstd", fsync=True)
    assert size == os.path.getsize(path)
    assert forge.cache_bytes_equal(kvwire.load(path), cache)
    assert os.listdir(tmp_path) == ["c.kvw"]
    assert path.read_bytes() == kvwire.encode(cache, codec="zstd")


def test_save_is_atomic_when_the_write_fails(tmp_path, monkeypatch):
    # KVW-FILE-6: temp file + rename; the old file survives a failed write
    old, new = forge.small_cache(seed=1), forge.small_cache(seed=2, tokens=70)
    path = tmp_path / "c.kvw"
    kvwire.save(path, old)
    before = path.read_bytes()
    real = kvwire.cache.files.write_all

    def failing_write_all(fd, buffers):
        it = iter(buffers)
        real(fd, [next(it) for _ in range(5)])  # part of the new container reaches the temp file
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kvwire.cache.files, "write_all", failing_write_all)
    with pytest.raises(OSError):
        kvwire.save(path, new)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["c.kvw"], "temporary file left behind"
    assert forge.cache_bytes_equal(kvwire.load(path), old)


def test_save_is_atomic_when_encoding_fails(tmp_path):
    old = forge.small_cache(seed=1)
    path = tmp_path / "c.kvw"
    kvwire.save(path, old)
    with pytest.raises(kvwire.SchemaError):
        kvwire.save(path, old, metadata={"not a key": b""})
    with pytest.raises(ValueError):
        kvwire.save(path, old, codec="lz4")
    assert os.listdir(tmp_path) == ["c.kvw"]
    assert forge.cache_bytes_equal(kvwire.load(path), old)


def test_save_into_a_new_file(tmp_path):
    cache = forge.small_cache()
    kvwire.save(str(tmp_path / "new.kvw"), cache)
    assert forge.cache_bytes_equal(kvwire.load(str(tmp_path / "new.kvw")), cache)


# ---------------------------------------------------------------------------------------
# probe
# ---------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_probe_on_every_prefix(form):
    cache = forge.small_cache(metadata={"app.note": b"x" * 100})
    data = kvwire.encode(cache, form=form)
    _, hlen, _ = parse_preamble(data)
    header_end = PREAMBLE_SIZE + hlen
    for n in range(len(data) + 1):
        prefix = data[:n]
        if n < header_end:
            with pytest.raises(kvwire.TruncatedError) as info:
                kvwire.probe(prefix)
            assert info.value.needed == (PREAMBLE_SIZE if n < PREAMBLE_SIZE else header_end)
            assert info.value.code == "TRUNCATED"
        else:
            assert kvwire.probe(prefix) == cache.header


def test_probe_accepts_memoryview_and_bytearray():
    cache = forge.small_cache()
    data = kvwire.encode(cache)
    assert kvwire.probe(memoryview(data)) == cache.header
    _, hlen, _ = parse_preamble(data)
    assert kvwire.probe(bytearray(data[: PREAMBLE_SIZE + hlen])) == cache.header


# ---------------------------------------------------------------------------------------
# torch backend and torch inputs
# ---------------------------------------------------------------------------------------

TORCH_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "i8": torch.int8,
                "u8": torch.uint8, "f8_e4m3fn": torch.float8_e4m3fn, "f8_e5m2": torch.float8_e5m2,
                "f8_e4m3fnuz": torch.float8_e4m3fnuz}


def torch_bytes(t) -> np.ndarray:
    return as_numpy(t).reshape(-1).view(np.uint8)


@pytest.mark.parametrize("dtype", sorted(TORCH_DTYPES))
def test_torch_tensors_as_encoder_input(dtype):
    g = torch.Generator().manual_seed(0)
    raw = lambda *shape: torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    itemsize = R.DTYPES[dtype][1]
    keys = [raw(2, 20, 8 * itemsize).view(TORCH_DTYPES[dtype]), raw(1, 11, 4 * itemsize).view(TORCH_DTYPES[dtype])]
    values = [raw(2, 20, 6 * itemsize).view(TORCH_DTYPES[dtype]), raw(1, 11, 2 * itemsize).view(TORCH_DTYPES[dtype])]
    cache = kvwire.KVCache.from_tensors(keys, values, chunk_tokens=8)
    assert cache.header.dtype == dtype
    for codec in ("raw", "zstd"):
        data = kvwire.encode(cache, codec=codec)
        loaded = kvwire.load(data, backend="torch")
        for i in range(2):
            for comp, src in (("k", keys[i]), ("v", values[i])):
                t = loaded.layers[i][comp]
                assert isinstance(t, torch.Tensor) and t.dtype == TORCH_DTYPES[dtype]
                assert tuple(t.shape) == tuple(src.shape)
                assert np.array_equal(torch_bytes(t), torch_bytes(src))
        as_np = kvwire.load(data)
        assert as_np.keys(0).dtype == R.DTYPES[dtype][2]
        assert np.array_equal(as_np.keys(0).reshape(-1).view(np.uint8), torch_bytes(keys[0]))


def test_torch_load_of_mixed_architecture():
    cache = mixed_cache(dtype="f16")
    loaded = kvwire.load(kvwire.encode(cache, codec="zstd"), backend="torch")
    assert loaded.layers[3] == {}
    assert loaded.layers[2]["latent"].dtype == torch.float16
    assert loaded.equal(cache)


def test_torch_non_contiguous_input():
    base = torch.arange(2 * 16 * 10, dtype=torch.float32).reshape(2, 10, 16)
    k = base.transpose(1, 2)  # [2, 16, 10], not contiguous
    v = torch.arange(2 * 5 * 16, dtype=torch.float32).reshape(2, 5, 16).transpose(1, 2)[:, :, 1:4]
    cache = kvwire.KVCache.from_tensors([k], [v], chunk_tokens=4)
    loaded = kvwire.load(kvwire.encode(cache), backend="torch")
    assert torch.equal(loaded.keys(0), k) and torch.equal(loaded.values(0), v)


# ---------------------------------------------------------------------------------------
# Encoder
# ---------------------------------------------------------------------------------------

def chunks_of(cache):
    from kvwire.format.chunks import planned_chunks

    h = cache.header
    for layer, comp, t0, n in planned_chunks(h):
        local = t0 - h.layer_tokens[layer].start
        yield layer, comp, t0, cache.layers[layer][comp][:, local : local + n, :]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_encoder_token_major_order(form, codec):
    cache = mixed_cache()
    pieces = sorted(chunks_of(cache), key=lambda c: (c[2], -c[0], c[1]))  # by token, layers reversed
    enc = kvwire.Encoder(cache.header, codec=codec)
    bufs = enc.begin()
    for layer, comp, t0, x in pieces:
        bufs += enc.chunk(layer, comp, t0, x)
    bufs += enc.end(form=form)
    data = b"".join(bytes(memoryview(b).cast("B")) for b in bufs)
    assert enc.position == len(data)
    assert data != kvwire.encode(cache, form=form, codec=codec)  # a different container ...
    with kvwire.open(data) as r:
        r.validate()
        assert [int(x) for x in r.records["token_start"][:3]] == [0, 0, 0]
        assert int(r.records["layer"][0]) == 2  # the last layer that starts at token 0 comes first
        loaded = r.load()
    assert forge.cache_bytes_equal(loaded, cache)  # ... with the same content


def test_encoder_accepts_torch_chunks():
    cache = forge.small_cache(dtype="bf16")
    enc = kvwire.Encoder(cache.header)
    bufs = enc.begin()
    for layer, comp, t0, x in chunks_of(cache):
        bufs += enc.chunk(layer, comp, t0, torch.from_numpy(x.view(np.int16)).view(torch.bfloat16))
    bufs += enc.end()
    assert forge.cache_bytes_equal(kvwire.load(b"".join(bytes(memoryview(b).cast("B")) for b in bufs)), cache)


def test_encoder_misuse():
    cache = forge.small_cache()
    h = cache.header
    k0 = cache.keys(0)
    with pytest.raises(ValueError):
        kvwire.Encoder(h, codec="lz4")
    enc = kvwire.Encoder(h)
    with pytest.raises(RuntimeError):
        enc.chunk(0, "k", 0, k0[:, :16])  # before begin()
    with pytest.raises(RuntimeError):
        enc.end()
    enc.begin()
    with pytest.raises(RuntimeError):
        enc.begin()
    enc.chunk(0, "k", 0, k0[:, :16])
    with pytest.raises(ValueError, match="already written"):
        enc.chunk(0, "k", 0, k0[:, :16])
    with pytest.raises(ValueError):
        enc.chunk(0, "k", 16, k0[:, 16:31])  # wrong token count for the cell
    with pytest.raises(ValueError):
        enc.chunk(0, "k", 8, k0[:, 8:24])  # not a cell of the grid
    with pytest.raises(ValueError):
        enc.chunk(0, "k", 16, k0[:1, 16:32])  # wrong head count
    with pytest.raises(ValueError):
        enc.chunk(0, "k", 16, k0[:, 16:32, :4])  # wrong head dim
    with pytest.raises(ValueError):
        enc.chunk(0, "k", 16, k0[:, 16:32].astype(np.float32))  # wrong dtype
    with pytest.raises(ValueError):
        enc.chunk(0, "k", 16, k0[0, 16:32])  # not 3-d
    with pytest.raises(ValueError):
        enc.chunk(0, "latent", 16, k0[:1, 16:32])  # component the layer does not store
    with pytest.raises(ValueError):
        enc.chunk(2, "k", 16, k0[:, 16:32])  # no layer 2
    with pytest.raises(ValueError):
        enc.chunk(-1, "k", 16, k0[:, 16:32])  # negative layers do not wrap around
    enc.chunk(1, "k", 0, cache.keys(1)[:, :16])  # the failed calls above left no trace
    with pytest.raises(ValueError, match="never written"):
        enc.end()
    with pytest.raises(ValueError):
        enc.end(form="zip")


def test_encoder_failed_chunk_leaves_state_usable():
    cache = forge.small_cache()
    enc = kvwire.Encoder(cache.header)
    bufs = enc.begin()
    with pytest.raises(ValueError):
        enc.chunk(1, "v", 32, cache.values(1)[:, 32:40].astype(np.float32))
    for layer, comp, t0, x in chunks_of(cache):
        bufs += enc.chunk(layer, comp, t0, x)
    bufs += enc.end(form="stream")
    with pytest.raises(RuntimeError):
        enc.chunk(0, "k", 0, cache.keys(0)[:, :16])
    assert forge.cache_bytes_equal(kvwire.load(b"".join(bytes(memoryview(b).cast("B")) for b in bufs)), cache)


def test_encoder_refuses_invalid_headers():
    h = forge.small_cache().header
    with pytest.raises(kvwire.SchemaError):
        kvwire.Encoder(h.replace(alignment=48))
    with pytest.raises(kvwire.SchemaError):
        kvwire.Encoder(h.replace(layer_tokens=(kvwire.TokenRange(0, 41), kvwire.TokenRange(0, 40))))


# ---------------------------------------------------------------------------------------
# Header round trip through FlatBuffers, every field
# ---------------------------------------------------------------------------------------

finite = st.floats(allow_nan=False, allow_infinity=True, width=64)
ropes = st.builds(
    kvwire.RopeParams,
    rope_type=st.sampled_from(sorted(R.ROPE_TYPES)), theta=finite, rotary_dim=st.integers(0, 2**32 - 1),
    interleaved=st.booleans(), factor=finite, original_max_position_embeddings=st.integers(0, 2**32 - 1),
    low_freq_factor=finite, high_freq_factor=finite, beta_fast=finite, beta_slow=finite,
    attention_factor=finite, mscale=finite, mscale_all_dim=finite,
    short_factor=st.lists(finite, max_size=4).map(tuple), long_factor=st.lists(finite, max_size=4).map(tuple),
    mrope_section=st.lists(st.integers(0, 2**32 - 1), max_size=4).map(tuple),
    seq_len_at_encode=st.integers(0, 2**64 - 1), truncate=st.booleans(),
)
text = st.text(st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)), max_size=20)
blobs = st.binary(max_size=40)


@pytest.mark.slow
@settings(max_examples=80, deadline=None)
@given(h=headers(max_layers=5), data=st.data())
def test_header_flatbuffer_roundtrip(h, data):
    specs = tuple(s if s.kind == "shared" else
                  kvwire.LayerSpec(**{**s.__dict__, "uses_rope": data.draw(st.booleans()),
                                      "rope": data.draw(st.none() | ropes)}) for s in h.arch.layers)
    arch = kvwire.Architecture(specs, rope=data.draw(st.none() | ropes), keys_post_rope=data.draw(st.booleans()))
    n = len(specs)
    h = h.replace(
        arch=arch,
        model=kvwire.ModelIdentity(data.draw(text), data.draw(text), data.draw(text), data.draw(blobs),
                                   data.draw(blobs), data.draw(blobs), data.draw(blobs)),
        producer=kvwire.Producer(data.draw(text), data.draw(text)),
        layer_map=tuple(kvwire.LayerMapEntry(r, *data.draw(st.sampled_from([(0, "copy"), (n - 1, "alias"),
                                                                              (-1, "recompute"), (-1, "drop")])))
                        for r in data.draw(st.lists(st.integers(0, 4095), unique=True, max_size=4))),
        metadata=data.draw(st.dictionaries(st.from_regex(r"[a-z0-9_\-]{1,5}(\.[A-Za-z0-9_\-]{1,5}){1,2}",
                                                         fullmatch=True), blobs, max_size=4)),
    )
    copies = {e.transmitted_layer: e.receiver_layer for e in sorted(h.layer_map, key=lambda e: -e.receiver_layer)
              if e.op == "copy"}
    assume(all(copies.get(e.transmitted_layer, -1) < e.receiver_layer for e in h.layer_map if e.op == "alias"))  # MAP-4
    assert parse_header(build_header(h)) == h
    # values only a newer writer may emit still read back (the writer's own rules bypassed)
    newer = h.replace(optional_features=data.draw(st.integers(0, 2**64 - 1)),
                      format_minor=data.draw(st.integers(0, 0xFFFF)),
                      arch=kvwire.Architecture(arch.layers, arch.rope, arch.keys_post_rope,
                                               data.draw(st.integers(1, 0xFFFF))))
    assert parse_header(forge.header_of(newer)) == newer


@pytest.mark.parametrize("change", [
    dict(producer=kvwire.Producer("kv\0wire", "1")),
    dict(model=kvwire.ModelIdentity(model_id="x" * 65537)),
    dict(model=kvwire.ModelIdentity(weights_fingerprint=bytes(L.MAX_BYTES_LENGTH + 1))),
], ids=["nul-in-string", "long-string", "long-fingerprint"])
def test_writer_refuses_what_the_reader_would_reject(change):
    """Whatever build_header writes, parse_header must read."""
    h = forge.small_cache().header.replace(**change)
    with pytest.raises(ValueError):
        build_header(h)
    with pytest.raises(kvwire.FormatError):
        parse_header(forge.header_of(h))


def test_writer_refuses_what_only_a_newer_writer_may_emit():
    h = forge.small_cache().header
    for change in (dict(optional_features=1), dict(format_minor=1), dict(metadata={"kvwire.x": b""}),
                   dict(arch=kvwire.Architecture(h.arch.layers, schema_version=2))):
        with pytest.raises(ValueError):
            build_header(h.replace(**change))
        assert parse_header(forge.header_of(h.replace(**change))) == h.replace(**change)


def test_distinct_layer_specs_are_stored_once():
    spec = kvwire.LayerSpec("full_attention", 8, 128, 128)
    one = build_header(kvwire.Header(kvwire.Architecture((spec,)), token_count=1))
    many = build_header(kvwire.Header(kvwire.Architecture((spec,) * 128), token_count=1))
    assert len(many) - len(one) <= 2 * 128 + 8  # only the ushort index grows
    h = parse_header(many)
    assert h.num_layers == 128 and all(s == spec for s in h.arch.layers)



def test_torch_views_never_write_into_read_only_input():
    """A torch chunk of a bytes container is a copy: torch has no read-only tensors."""
    torch = pytest.importorskip("torch")
    data = kvwire.encode(kvwire.tools.synth.synth_cache(1, 2, 8, 16, seed=3))
    before = bytes(data)
    with kvwire.open(data) as r:
        t = r.chunk(0, "k", 0, backend="torch")
        t.fill_(0)
        assert torch.count_nonzero(r.chunk(0, "k", 0, backend="torch")) > 0
    assert data == before
    writable = bytearray(data)
    with kvwire.open(writable) as r:  # a writable buffer is shared, not copied
        t = r.chunk(0, "k", 0, backend="torch")
        off = int(r.record(0, "k", 0)["offset"])
        assert t.data_ptr() == np.frombuffer(writable, np.uint8)[off:].ctypes.data


def test_torch_chunk_of_a_zstd_body_is_decoded_once():
    """A zstd chunk read as a torch tensor is decompressed straight into its own writable
    memory (torch has no read-only tensors): peak memory one raw chunk, not two."""
    import tracemalloc

    import torch

    from kvwire.tools.synth import synth_cache

    c = synth_cache(1, 8, 128, 4096, chunk_tokens=4096)
    with kvwire.open(kvwire.encode(c, codec="zstd")) as r:
        raw = r.info(0).raw_length
        assert r.info(0).codec == "zstd"
        tracemalloc.start()
        try:
            x = r.chunk(0, "k", backend="torch")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 1.3 * raw, peak / raw
    assert torch.equal(x.view(torch.int16), torch.from_numpy(c.keys(0).view(np.int16)))
    x[0, 0, 0] = 1  # writable, and its own memory
