"""The cache object and the file API a newcomer reaches for first.

``cache.keys[i]`` / ``cache.values[i]``, ``astype`` / ``to``, ``==`` by content (bits),
short reprs, ``save``/``load``/``open`` on file objects (BytesIO, files, pipes; seekable or
not), the safetensors-style ``{"layers.<i>.k": ...}`` dicts, dtype names wherever a dtype is
taken, and typed keywords for ``save``/``encode``. The container bytes are the same whichever
way they are written (KVW-FILE-6: the file form is one byte string, wherever it lands).
"""

from __future__ import annotations

import inspect
import io
import os
import threading

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import forge
import kvwire

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NP = {"bf16": np.dtype(ml_dtypes.bfloat16), "f16": np.dtype(np.float16), "f32": np.dtype(np.float32),
      "f8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn), "f8_e5m2": np.dtype(ml_dtypes.float8_e5m2)}
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}
SINT = {1: np.int8, 2: np.int16, 4: np.int32}
TORCH = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "f8_e4m3fn": torch.float8_e4m3fn,
         "f8_e5m2": torch.float8_e5m2}


def bits_cache(dtype: str, shapes, seed: int, *, nan: bool = True, backend: str = "numpy") -> kvwire.KVCache:
    """A cache of arbitrary bit patterns (NaNs with payloads, infinities, -0.0, subnormals)
    of ``dtype``; ``nan=False`` replaces NaNs with zeros."""
    rng = np.random.default_rng(seed)
    npd = NP[dtype]
    tensors = []
    for heads, tokens, dim in shapes:
        for _ in range(2):
            a = rng.integers(0, 2 ** (8 * npd.itemsize), (heads, tokens, dim), dtype=np.uint64)
            a = a.astype(UINT[npd.itemsize]).view(npd)
            if not nan:
                a = np.where(np.isnan(a.astype(np.float32)), np.zeros((), npd), a)
            tensors.append(torch.from_numpy(a.view(SINT[npd.itemsize]).copy()).view(TORCH[dtype]) if backend == "torch"
                           else a)
    return kvwire.KVCache.from_tensors(tensors[0::2], tensors[1::2], chunk_tokens=8)


shapes_st = st.lists(st.tuples(st.integers(1, 3), st.integers(0, 20), st.integers(1, 8)), min_size=1, max_size=3)


def same_bits(a: kvwire.KVCache, b: kvwire.KVCache) -> bool:
    return forge.cache_bytes_equal(a, b)


# -- keys / values ------------------------------------------------------------------------

def test_keys_and_values_index_per_layer_and_keep_the_call_form():
    c = forge.small_cache(layers=3, dtype="f16")
    assert c.keys[0] is c.layers[0]["k"] and c.values[2] is c.layers[2]["v"]
    assert c.keys(1) is c.keys[1] and c.values(1) is c.layers[1]["v"]  # the older call form still works
    assert len(c.keys) == len(c.values) == 3
    assert [x is y["k"] for x, y in zip(c.keys, c.layers)] == [True] * 3
    assert c.keys[-1] is c.layers[2]["k"]  # a sequence: list indexing
    assert [x is y for x, y in zip(c.values[1:], (c.layers[1]["v"], c.layers[2]["v"]))] == [True, True]
    with pytest.raises(IndexError):
        c.keys[3]
    assert isinstance(c.keys[0], np.ndarray)


# -- astype / to ---------------------------------------------------------------------------

@pytest.mark.parametrize("spelling", ["float32", "f32", "FP32", np.float32, np.dtype("float32"), torch.float32])
def test_astype_accepts_dtype_names_numpy_and_torch_dtypes(spelling):
    c = forge.small_cache(dtype="bf16")
    f = c.astype(spelling)
    assert f.header.dtype == "f32" and f.keys[0].dtype == np.float32
    np.testing.assert_array_equal(f.keys[1], c.keys[1].astype(np.float32))
    assert c.astype(torch.bfloat16) is c and c.astype("bfloat16") is c


@pytest.mark.parametrize("bad,cls", [("float64", ValueError), (np.float64, ValueError), (torch.int64, ValueError),
                                     (3.5, TypeError), ("fp8", ValueError)])
def test_astype_unknown_dtype_lists_the_valid_ones(bad, cls):
    with pytest.raises(cls, match="bf16, f16, f32, f8_e4m3fn.*float32"):
        forge.small_cache().astype(bad)


def test_astype_refuses_integer_targets_and_scaled_fp8():
    with pytest.raises(ValueError, match="floating-point dtype"):
        forge.small_cache().astype("int8")
    k = [np.zeros((1, 4, 2), ml_dtypes.float8_e4m3fn)]
    scaled = kvwire.KVCache.from_tensors(k, k, kv_scales=((0.5, 2.0),))
    with pytest.raises(ValueError, match="dequantize"):
        scaled.astype("f32")
    assert scaled.dequantize("float32").header.dtype == "f32"  # KVW-SCALE-7: dtype names accepted there too


@SETTINGS
@given(shapes_st, st.sampled_from(["bf16", "f16", "f8_e4m3fn", "f8_e5m2"]), st.sampled_from(["numpy", "torch"]),
       st.integers(0, 2**32))
def test_astype_through_f32_and_back_is_lossless_property(shapes, dtype, backend, seed):
    """Every non-NaN value of a narrower float is exact in f32: there and back gives the same bits."""
    c = bits_cache(dtype, shapes, seed, nan=False, backend=backend)
    wide = c.astype("float32")
    assert wide.header.dtype == "f32" and wide.backend == backend
    assert same_bits(wide.astype(dtype), c)
    assert wide.astype(dtype) == c


def test_to_moves_torch_caches_and_keeps_numpy_on_the_cpu():
    t = bits_cache("bf16", [(2, 5, 4)], 1, backend="torch")
    assert t.to("cpu") == t
    meta = t.to("meta")  # a real device of CPU-only torch
    assert meta.keys[0].device.type == "meta" and meta.values[0].device.type == "meta"
    n = forge.small_cache()
    assert n.to("cpu") is n and n.to(torch.device("cpu")) is n and n.to("cpu:0") is n
    with pytest.raises(ValueError, match="numpy-backed cache lives on the CPU.*device='cuda'"):
        n.to("cuda")
    with pytest.raises(TypeError, match="astype"):
        t.to(torch.float32)
    with pytest.raises(ValueError, match="'cpu', 'cuda', 'cuda:N'"):
        t.to("tpu:9")


# -- equality and repr -----------------------------------------------------------------------

@SETTINGS
@given(shapes_st, st.sampled_from(["bf16", "f16", "f32"]), st.integers(0, 2**32))
def test_eq_is_bitwise_content_nan_payloads_included_property(shapes, dtype, seed):
    c = bits_cache(dtype, shapes, seed)
    twin = kvwire.load(kvwire.encode(c))
    assert twin == c and not (twin != c) and c.equal(twin)  # NaN payloads compare by bits
    assert bits_cache(dtype, shapes, seed, backend="torch") == c  # the backend does not matter
    k = next((x for x in c.keys if x.size), None)
    if k is not None:
        flipped = [x.copy() for x in c.keys]
        i = next(j for j, x in enumerate(c.keys) if x.size)
        flipped[i].reshape(-1).view(UINT[k.itemsize])[0] ^= 1  # one bit of one element
        assert kvwire.KVCache.from_tensors(flipped, list(c.values), chunk_tokens=8) != c


def test_eq_distinguishes_nan_payloads_signed_zeros_and_headers():
    z = np.zeros((1, 1, 2), np.float32)
    nz = np.array([[[-0.0, 0.0]]], np.float32)
    nan1 = np.array([[[np.nan, 0]]], np.float32)
    nan2 = nan1.copy()
    nan2.view(np.uint32)[0, 0, 0] |= 1  # another payload
    mk = kvwire.KVCache.from_tensors
    assert mk([z], [z]) != mk([nz], [z])
    assert mk([nan1], [z]) == mk([nan1.copy()], [z]) and mk([nan1], [z]) != mk([nan2], [z])
    assert mk([z], [z]) != mk([z], [z], first_position=1)
    assert (mk([z], [z]) == "x") is False and mk([z], [z]) != 0
    with pytest.raises(TypeError, match="unhashable"):
        hash(mk([z], [z]))


def test_eq_leaves_out_how_a_cache_was_encoded_but_not_lossy_changes():
    rng = np.random.default_rng(0)
    k = [rng.standard_normal((2, 300, 64)).astype(ml_dtypes.bfloat16) for _ in range(4)]
    c = kvwire.KVCache.from_tensors(k[:2], k[2:])
    for codec in ("zstd", "byteplane"):
        back = kvwire.load(kvwire.encode(c, codec=codec))
        assert back.header.codec_specs or codec == "zstd"
        assert back == c  # the loaded header names the codec pipelines; the cache is the same
    assert kvwire.load(kvwire.encode(c, codec="int8")) != c  # lossy: other bits


def test_reprs_never_print_arrays():
    big = kvwire.KVCache.from_tensors([np.ones((8, 4096, 128), np.float16)] * 4, [np.ones((8, 4096, 128), np.float16)] * 4)
    for text in (repr(big), str(big), repr(big.keys), repr(big.values)):
        assert len(text) < 200 and "1." not in text and "array" not in text, text
    assert repr(big) == "KVCache(4 layers, 4096 tokens, f16, numpy, 64.0 MiB)"


# -- file objects ------------------------------------------------------------------------------

class OneByteAtATime(io.RawIOBase):
    """A raw, non-seekable writer that takes at most 7 bytes per write (short writes)."""

    def __init__(self):
        self.data = bytearray()

    def writable(self):
        return True

    def write(self, b):
        n = min(7, memoryview(b).nbytes)
        self.data += memoryview(b).cast("B")[:n]
        return n


class NonSeekableReader(io.RawIOBase):
    def __init__(self, data: bytes):
        self._f = io.BytesIO(data)

    def readable(self):
        return True

    def readinto(self, b):
        return self._f.readinto(b)


@SETTINGS
@given(shapes_st, st.sampled_from(["bf16", "f16", "f32"]), st.sampled_from(["raw", "zstd", "byteplane"]),
       st.integers(0, 2**32))
def test_save_and_load_through_bytesio_and_unseekable_streams_property(shapes, dtype, codec, seed):
    """KVW-FILE-6: save() to a BytesIO, to a raw stream taking short writes, and encode() give
    the same bytes; load() and open() read them back from BytesIO and unseekable streams."""
    c = bits_cache(dtype, shapes, seed)
    want = kvwire.encode(c, codec=codec)
    buf = io.BytesIO(b"prefix")
    buf.seek(0, io.SEEK_END)
    assert kvwire.save(buf, c, codec=codec) == len(want) and buf.getvalue() == b"prefix" + want
    raw = OneByteAtATime()
    assert kvwire.save(raw, c, codec=codec) == len(want) and bytes(raw.data) == want
    assert kvwire.load(io.BytesIO(want)) == c
    assert kvwire.load(io.BufferedReader(NonSeekableReader(want))) == c
    buf.seek(len(b"prefix"))  # read from the current position
    with kvwire.open(buf) as r:
        assert r.header == kvwire.load(want).header


def test_save_and_load_real_files_and_a_pipe(tmp_path):
    c = forge.small_cache(dtype="bf16")
    with open(tmp_path / "a.kvw", "wb") as f:
        size = kvwire.save(f, c, fsync=True)
    assert size == os.path.getsize(tmp_path / "a.kvw")
    assert (tmp_path / "a.kvw").read_bytes() == kvwire.encode(c)
    with open(tmp_path / "a.kvw", "rb") as f:
        assert kvwire.load(f) == c
    with open(tmp_path / "b.kvw", "wb", buffering=0) as f:  # a raw FileIO
        kvwire.save(f, c)
    assert kvwire.load(tmp_path / "b.kvw") == c
    r, w = os.pipe()
    writer = threading.Thread(target=lambda: kvwire.save(os.fdopen(w, "wb"), c))
    with os.fdopen(r, "rb") as src:
        writer.start()
        out = src.read()
    writer.join()
    assert kvwire.load(out) == c
    r, w = os.pipe()
    with os.fdopen(w, "wb") as dst, os.fdopen(r, "rb") as src:
        t = threading.Thread(target=lambda: (dst.write(kvwire.encode(c)), dst.close()))
        t.start()
        assert kvwire.load(src, backend="torch") == c  # a pipe is read to its end
        t.join()


def test_file_object_misuse_is_named(tmp_path):
    c = forge.small_cache()
    with open(tmp_path / "t.txt", "w") as f, pytest.raises(TypeError, match="binary file object.*'wb'"):
        kvwire.save(f, c)
    (tmp_path / "t.txt").write_text("hello")
    with open(tmp_path / "t.txt") as f, pytest.raises(TypeError, match="binary file object.*'rb'"):
        kvwire.load(f)
    with pytest.raises(ValueError, match="fsync=True needs a file with a descriptor"):
        kvwire.save(io.BytesIO(), c, fsync=True)
    with pytest.raises(ValueError, match="mmap=True maps a file"):
        kvwire.open(io.BytesIO(kvwire.encode(c)), mmap=True)
    with pytest.raises(TypeError, match="the file comes first"):
        kvwire.save(c, tmp_path / "x.kvw")
    with pytest.raises(TypeError, match="a path .* or a bytes-like object"):
        kvwire.open(12)
    with pytest.raises(TypeError, match="binary file object"):
        kvwire.save(12, c)


# -- typed keywords -----------------------------------------------------------

def test_save_and_encode_have_explicit_keywords_with_defaults():
    for fn, extra in ((kvwire.save, "fsync"), (kvwire.encode, "form")):
        params = inspect.signature(fn).parameters
        for name in ("codec", "level", "chunk_tokens", "alignment", "first_position", "model", "metadata",
                     "header_changes", extra):
            assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, (fn, name)
            assert params[name].default is not inspect.Parameter.empty
        assert params["codec"].default == "raw"


@pytest.mark.parametrize("call", [lambda c: kvwire.encode(c, codek="int8"), lambda c: kvwire.save(io.BytesIO(), c, lvl=3),
                                  lambda c: kvwire.save(io.BytesIO(), c, form="stream")])
def test_unknown_keyword_names_the_valid_ones(call):
    with pytest.raises(TypeError, match=r"unknown keyword\(s\) .*; valid: .*codec, level, chunk_tokens"):
        call(forge.small_cache())


def test_typed_keywords_reach_the_header():
    c = forge.small_cache(tokens=40, chunk_tokens=16)
    model = kvwire.ModelIdentity(model_id="m")
    data = kvwire.encode(c, chunk_tokens=8, first_position=5, model=model, metadata={"t.a": b"1"},
                         header_changes={"producer": kvwire.Producer(library="p", version="1")})
    h = kvwire.load(data).header
    assert (h.chunk_tokens, h.first_position, h.model.model_id, h.metadata, h.producer.library) == (8, 5, "m", {"t.a": b"1"}, "p")
    buf = io.BytesIO()
    kvwire.save(buf, c, chunk_tokens=8, first_position=5, model=model, metadata={"t.a": b"1"},
                header_changes={"producer": kvwire.Producer(library="p", version="1")})
    assert buf.getvalue() == data
    assert kvwire.encode(c, chunk_tokens=None) == kvwire.encode(c)  # None: the cache's own
    with pytest.raises(TypeError, match="header_changes must be a dict"):
        kvwire.encode(c, header_changes=[("x", 1)])
    with pytest.raises(TypeError, match="unknown option"):
        kvwire.encode(c, header_changes={"nope": 1})


# -- dict of tensors ----------------------------------------------------------------------------

@SETTINGS
@given(shapes_st, st.sampled_from(["bf16", "f16", "f32"]), st.sampled_from(["numpy", "torch"]), st.integers(0, 2**32))
def test_dict_of_tensors_round_trips_property(shapes, dtype, backend, seed):
    c = bits_cache(dtype, shapes, seed, backend=backend)
    d = c.to_dict()
    assert list(d) == [f"layers.{i}.{x}" for i in range(len(shapes)) for x in "kv"]
    assert all(d[f"layers.{i}.k"] is c.keys[i] for i in range(len(shapes)))
    assert kvwire.KVCache.from_dict(d, chunk_tokens=8) == c
    buf = io.BytesIO()
    kvwire.save_tensors(d, buf)
    back = kvwire.load_tensors(io.BytesIO(buf.getvalue()))
    assert list(back) == list(d)
    assert all(np.asarray(back[n]).tobytes() == kvwire.load(buf.getvalue()).to_dict()[n].tobytes() for n in d)
    assert kvwire.KVCache.from_dict(back, chunk_tokens=8) == c


def test_dict_of_tensors_with_safetensors(tmp_path):
    from safetensors.numpy import load_file, save_file

    c = forge.small_cache(dtype="f16", layers=3)
    save_file(c.to_dict(), tmp_path / "kv.safetensors")
    kvwire.save_tensors(load_file(tmp_path / "kv.safetensors"), tmp_path / "kv.kvw")
    assert kvwire.KVCache.from_dict(kvwire.load_tensors(tmp_path / "kv.kvw"), chunk_tokens=16) == c


@pytest.mark.parametrize("names,match", [
    (["layers.0.k"], "missing: layers.0.v"),
    (["layers.0.k", "layers.0.v", "layers.2.k", "layers.2.v"], "missing: layers.1.k, layers.1.v"),
    (["layers.0.k", "layers.0.v", "model.layers.0.key"], "unexpected: 'model.layers.0.key'"),
    (["layers.00.k", "layers.0.v"], "unexpected: 'layers.00.k'"),
    ([], "layers.<i>.k"),
])
def test_from_dict_names_what_is_wrong(names, match):
    x = np.zeros((1, 2, 4), np.float16)
    with pytest.raises(ValueError, match=match):
        kvwire.KVCache.from_dict({n: x for n in names})
    with pytest.raises(TypeError, match="mapping"):
        kvwire.KVCache.from_dict([x, x])
