"""API misuse: every public entry point rejects a bad argument at the entry point with a
``ValueError`` or ``TypeError`` whose message names the valid choices, never a bare
IndexError/KeyError/AttributeError from inside, and never a silent other meaning
(``chunk(-1)`` used to return the last layer; ``load(backend="jax")`` torch tensors).
"""

import numpy as np
import pytest

import forge
import kvwire

CACHE = forge.small_cache()
DATA = kvwire.encode(CACHE)


def reader():
    return kvwire.open(DATA)


CASES = {
    # negative / out-of-range layer and chunk indices (they used to wrap around)
    "chunk(-1)": (lambda: reader().chunk(-1), ValueError, r"layer -1 outside \[0, 2\).*negative"),
    "layer(-1)": (lambda: reader().layer(-1), ValueError, r"layer -1 outside \[0, 2\)"),
    "record(-1)": (lambda: reader().record(-1, "k"), ValueError, r"layer -1 outside \[0, 2\)"),
    "record index -1": (lambda: reader().record(0, "k", -1), ValueError, r"chunk index .* -1 outside \[0, 3\)"),
    "chunk index 99": (lambda: reader().chunk(0, "k", 99), ValueError, r"99 outside \[0, 3\)"),
    "layer(99)": (lambda: reader().layer(99), ValueError, r"layer 99 outside \[0, 2\)"),
    "num_chunks(9)": (lambda: reader().num_chunks(9, "k"), ValueError, r"layer 9 outside \[0, 2\)"),
    "info(-1)": (lambda: reader().info(-1), ValueError, r"record -1 outside \[0, 12\)"),
    "decode(10**6)": (lambda: reader().decode(10**6), ValueError, r"record 1000000 outside \[0, 12\)"),
    "chunk('0')": (lambda: reader().chunk("0"), TypeError, r"layer must be an integer in \[0, 2\)"),
    "load_mapped(-1)": (lambda: reader().load_mapped(-1), ValueError, "non-negative integer"),
    # unknown names
    "component q": (lambda: reader().chunk(0, "q", 0), ValueError, "component must be one of 'k', 'v'"),
    "load backend jax": (lambda: kvwire.load(DATA, backend="jax"), ValueError, "'numpy', 'torch'"),
    "Reader.load backend": (lambda: reader().load(backend="jax"), ValueError, "'numpy', 'torch'"),
    "chunk backend": (lambda: reader().chunk(0, backend="jax"), ValueError, "'numpy', 'torch'"),
    "layer backend": (lambda: reader().layer(0, backend="jax"), ValueError, "'numpy', 'torch'"),
    "iter_chunks backend": (lambda: next(reader().iter_chunks(backend="jax")), ValueError, "'numpy', 'torch'"),
    "unknown layout": (lambda: kvwire.layouts.get_layout("nope"), ValueError, "registered: dynamo"),
    "layout of wrong type": (lambda: kvwire.layouts.get_layout(3), TypeError, "registered: dynamo"),
    "bind unknown layout": (lambda: kvwire.layouts.bind("nope", []), ValueError, "registered: dynamo"),
    "encode form": (lambda: kvwire.encode(CACHE, form="zip"), ValueError, "'file', 'stream'"),
    "encode unknown option": (lambda: kvwire.encode(CACHE, bogus=1), TypeError, "first_position"),
    "open mmap": (lambda: kvwire.open(DATA, mmap="no"), ValueError, "None, True, False"),
    # wrong types and out-of-range values
    "check_compatible(garbage)": (lambda: kvwire.check_compatible("garbage", None), TypeError,
                                  "header must be a kvwire.Header"),
    "check_compatible(local garbage)": (lambda: kvwire.check_compatible(CACHE.header, "x"), TypeError,
                                        "local must be a kvwire.LocalModel"),
    "check_compatible(dtype)": (lambda: kvwire.check_compatible(
        CACHE.header, kvwire.LocalModel(CACHE.header.arch, "f64")), ValueError, "bf16"),
    "encode(first_position=-1)": (lambda: kvwire.encode(CACHE, first_position=-1), ValueError,
                                  "first_position must be a non-negative integer"),
    "encode(token_count='x')": (lambda: kvwire.encode(CACHE, first_position="x"), TypeError,
                                "non-negative integer"),
    "Encoder(str)": (lambda: kvwire.Encoder("x"), TypeError, "kvwire.Header"),
    "encode(dict)": (lambda: kvwire.encode({"k": 1}), TypeError, "KVCache.from_tensors"),
    "iter_buffers(dict)": (lambda: next(kvwire.iter_buffers({"k": 1})), TypeError, "KVCache.from_tensors"),
    "save(path, dict)": (lambda: kvwire.save("/nonexistent/x.kvw", {"k": np.zeros(3)}), TypeError,
                         "KVCache.from_tensors"),
    "open(123)": (lambda: kvwire.open(123), TypeError, "a path .* or a bytes-like object"),
    "open(None)": (lambda: kvwire.open(None), TypeError, "a path .* or a bytes-like object"),
    "load(5)": (lambda: kvwire.load(5), TypeError, "a path .* or a bytes-like object"),
    "Reader(5)": (lambda: kvwire.Reader(5), TypeError, "bytes-like"),
    "probe(None)": (lambda: kvwire.probe(None), TypeError, "bytes-like"),
    "max_decoded_bytes=-1": (lambda: kvwire.open(DATA, max_decoded_bytes=-1), ValueError, "non-negative integer"),
    "max_decoded_bytes='x'": (lambda: kvwire.open(DATA, max_decoded_bytes="x"), TypeError, "non-negative integer"),
    "KVCache(str, [])": (lambda: kvwire.KVCache("x", []), TypeError, "header must be a kvwire.Header"),
    "KVCache(header, dict)": (lambda: kvwire.KVCache(CACHE.header, {"k": 1}), TypeError,
                              "sequence of {component: tensor} mappings"),
    "KVCache(header, [list])": (lambda: kvwire.KVCache(CACHE.header, [[1], [2]]), TypeError,
                                "layer 0 must be a {component: tensor} mapping"),
    "from_tensors(dict)": (lambda: kvwire.KVCache.from_tensors({"k": 1}, {"v": 1}), TypeError,
                           "sequences .* numpy arrays or torch tensors"),
    "from_tensors([list])": (lambda: kvwire.KVCache.from_tensors([[1, 2]], [np.zeros((1, 1, 1))]), TypeError,
                             r"keys\[0\] is a list, not a numpy array"),
    "covered_tokens(str)": (lambda: kvwire.covered_tokens("x", [1, 2]), TypeError, "header must be a kvwire.Header"),
    "load(device='nope')": (lambda: kvwire.load(DATA, device="nope"), ValueError, "'cpu', 'cuda', 'cuda:N'"),
    "layer(device='nope')": (lambda: reader().layer(0, backend="torch", device="gpu9"), ValueError,
                             "'cpu', 'cuda', 'cuda:N'"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_misuse_is_a_clear_error_naming_the_choices(name):
    call, error, message = CASES[name]
    with pytest.raises(error, match=message) as info:
        call()
    assert type(info.value) in (ValueError, TypeError), f"{type(info.value).__name__} is not a plain misuse error"


def test_valid_calls_still_work():
    """The checks accept what was always valid: numpy integers, the last layer by its index."""
    with reader() as r:
        last = np.int64(CACHE.num_layers - 1)
        assert np.array_equal(r.chunk(last, "v", np.int32(2)).view(np.uint8),
                              CACHE.values(1)[:, 32:40].view(np.uint8))
        assert r.num_chunks(1, "k") == 3 and r.layer(int(last))["k"].shape == CACHE.keys(1).shape
    assert forge.cache_bytes_equal(kvwire.load(DATA, backend="numpy"), CACHE)
