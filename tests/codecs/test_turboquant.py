"""Revision 1.3: vLLM's TurboQuant key codebook and the unsigned rotation
(spec/codecs.md section 9, KVW-TQ-1..5). The tables are checked against vLLM's own
``solve_lloyd_max`` in .venv-vllm, the decoder against the literal one of the spec text
(tests/codec_reference.py) and against vLLM's dequantization formula."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import codec_reference as ref
import forge
import kvwire
from kvwire import CodecSpec
from kvwire.codecs import PRESETS, quant
from kvwire.codecs import turboquant as TQ
from kvwire.codecs.presets import resolve
from kvwire.format import registry as R
from kvwire.format.header import Architecture, Header, LayerSpec

REPO = Path(__file__).resolve().parents[2]
VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"
TQ_BIT, ROT_BIT, SPECS_BIT = (R.REQUIRED_FEATURES[n] for n in ("turboquant", "rotation", "codec_specs"))
TQ_PRESETS = ("vllm-turboquant-4bit-nc", "vllm-turboquant-k3v4-nc", "vllm-turboquant-3bit-nc")
K4 = resolve(PRESETS["vllm-turboquant-4bit-nc"], "k")


def _cache(dim=64, heads=2, tokens=70, seed=0, dtype="bf16", layers=2):
    rng = np.random.default_rng(seed)
    dt = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32}[dtype]
    ks = [rng.standard_normal((heads, tokens, dim)).astype(dt) for _ in range(layers)]
    vs = [rng.standard_normal((heads, tokens, dim)).astype(dt) for _ in range(layers)]
    return kvwire.KVCache.from_tensors(ks, vs, chunk_tokens=32)


@pytest.mark.slow
def test_tables_are_vllms_solve_lloyd_max():
    """KVW-TQ-4: vLLM 0.32's centroids for every power of two 16..1024 are L times a power of
    two, bit for bit (computed by vLLM itself, in its venv)."""
    if not VLLM_PY.exists():
        pytest.fail(f"{VLLM_PY} is missing: `make test` builds the vLLM venv (make vllm-venv)")
    code = ("import json;from vllm.model_executor.layers.quantization.turboquant.centroids import solve_lloyd_max as f;"
            "print(json.dumps({f'{d},{b}': f(d, b)[0].view(__import__('torch').int32).tolist() "
            "for d in (16, 32, 64, 128, 256, 512, 1024) for b in (3, 4)}))")
    out = subprocess.run([str(VLLM_PY), "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(got) == 14
    for key, bits in got.items():
        d, b = map(int, key.split(","))
        mine = TQ.vllm_table(b, d).view(np.int32).tolist()
        assert mine == bits, (d, b)


def test_decode_agrees_with_vllms_formula():
    """The keys every reader decodes are vLLM's: (norm * c / ||c||) @ (H / sqrt(D)) in float64
    (its kernels dequantize in fp16) matches the fp32 decode to fp32 precision."""
    c = _cache(dim=128, tokens=40)
    data = kvwire.encode(c, codec="vllm-turboquant-4bit-nc")
    r = kvwire.open(data)
    got = kvwire.load(data)
    H = np.array([[1.0]])
    while H.shape[0] < 128:
        H = np.block([[H, H], [H, -H]])
    H /= np.sqrt(128)
    t = TQ.vllm_table(4, 128).astype(np.float64)
    n = 0
    for i in range(r.chunk_count):
        info = r.info(i)
        if info.component != "k":
            continue
        body = bytes(r.stored(i, False)[1])
        Hh, M = info.shape[0], info.shape[1]
        norms = np.frombuffer(body[: 2 * Hh * M], "<f2").astype(np.float64).reshape(Hh, M, 1)
        codes = np.frombuffer(body[2 * Hh * M:], np.uint8)
        u = np.stack([codes & 15, codes >> 4], -1).reshape(Hh, M, 128)
        cvec = t[u]
        k = (norms * cvec / np.sqrt((cvec * cvec).sum(-1, keepdims=True) + 1e-16)) @ H
        mine = np.asarray(got.layers[info.layer]["k"], np.float64)[:, info.token_start : info.token_start + M]
        assert np.abs(mine - k).max() <= 2 ** -7 * np.abs(k).max()  # bf16 rounding of the fp32 result
        n += 1
    assert n == 4


@pytest.mark.parametrize("name", TQ_PRESETS)
def test_presets_round_trip_through_containers(name):
    """KVW-TQ-1: bits 0, 4 and 5, format_minor 3; both readers decode the literal decoder's bytes;
    the error is the 3- or 4-bit codebook's on Gaussian rows."""
    c = _cache()
    data = kvwire.encode(c, codec=name)
    h = kvwire.probe(data)
    assert h.required_features == SPECS_BIT | ROT_BIT | TQ_BIT and h.format_minor == 3
    assert [s.codebook for s in h.codec_specs] == ["turboquant", "uniform"]
    got = kvwire.load(data)
    parts = ref.decode_container(data)
    kb = resolve(PRESETS[name], "k").bits
    for i, layer in enumerate(got.layers):
        for comp, arr in layer.items():
            assert np.asarray(arr).tobytes() == parts[i, comp].tobytes()
        x = np.asarray(c.layers[i]["k"], np.float32)
        err = np.linalg.norm(np.asarray(layer["k"], np.float32) - x) / np.linalg.norm(x)
        assert 0.05 < err < {4: 0.11, 3: 0.2}[kb]
    dec = kvwire.StreamDecoder()
    dec.feed(data)
    assert sum(isinstance(e, kvwire.ChunkEvent) for e in dec.events()) == 2 * 2 * 3


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2 ** 32 - 1), st.sampled_from([3, 4]), st.sampled_from([1, 2, 8, 16, 64]),
       st.sampled_from(["f16", "bf16", "f32"]), st.sampled_from(["sylvester", "hadamard", "none"]))
def test_random_bodies_decode_as_the_spec_says(seed, bits, dim, scale_dtype, rotation):
    """KVW-TQ-3, KVW-TQ-4: any codes and norms decode to the literal decoder's bytes (the
    codebook composes with either rotation or none)."""
    rng = np.random.default_rng(seed)
    spec = CodecSpec("int_affine", bits=bits, group_size=max(dim, 1 << int(rng.integers(0, 8))), group_axis="channels",
                     symmetric=True, scale_dtype=scale_dtype, rotation=rotation,
                     rotation_seed=int(rng.integers(0, 2 ** 63)) if rotation == "hadamard" else 0,
                     codebook="turboquant")
    H, T = 2, 5
    lay = quant.layout(spec, "bf16", H, dim, 0, T, 0, 10 ** 6)
    sdt = R.DTYPES[scale_dtype][2]
    scales = np.abs(rng.standard_normal(H * T) * 4).astype(sdt).astype(sdt.newbyteorder("<")).view(np.uint8)
    codes = rng.integers(0, 256, -(-H * T * dim * bits // 8), dtype=np.uint8)
    used = H * T * dim * bits
    if used % 8:
        codes[-1] &= (1 << (used % 8)) - 1
    body = scales.tobytes() + codes.tobytes()
    assert len(body) == lay.length
    got = quant.decode(spec, body, lay, "bf16")
    assert got.tobytes() == ref.decode(spec, "bf16", body, H, T, dim, 0, 0, T)


def test_writer_refuses_unfaithful_rows():
    """KVW-TQ-5: a norm beyond f16 or a nonzero row whose norm rounds to 0 is stored losslessly."""
    lay = quant.layout(K4, "f32", 1, 64, 0, 2, 0, 10 ** 6)
    for scale in (1e5, 1e-9):
        x = np.full((1, 2, 64), scale, np.float32)
        with pytest.raises(quant.NotFaithful):
            quant.encode(K4, x, lay, "f32")
    x = np.zeros((1, 2, 64), np.float32)  # zero rows: norm 0, decoded 0
    body = b"".join(p.tobytes() for p in quant.encode(K4, x, lay, "f32"))
    assert not quant.decode(K4, body, lay, "f32").any()


def _reject(spec, code, rule, bits=SPECS_BIT | ROT_BIT | TQ_BIT):
    h = Header(Architecture((LayerSpec("full_attention", 1, 64, 64),)), token_count=0, dtype="bf16",
               codec_specs=(spec,), required_features=bits, format_minor=3)
    forge.expect(forge.wrap_header(forge.header_of(h), minor=3), kvwire.FormatError, code, rule)


def test_spec_rules():
    """KVW-TQ-1 (the bit: with bit 4, with a spec that uses it; the codes only with it) and
    KVW-TQ-2 (the fields' values)."""
    _reject(K4, "CODEC_SPEC_INVALID", "KVW-TQ-1", bits=SPECS_BIT | TQ_BIT)  # without bit 4: fields 11-13 unread
    _reject(PRESETS["hadamard-lloyd4"], "CODEC_SPEC_INVALID", "KVW-TQ-1")
    _reject(K4, "ENUM_OUT_OF_RANGE", "KVW-HDR-10", bits=SPECS_BIT | ROT_BIT)  # codes 2 need bit 5 (KVW-EVOL-9)
    _reject(replace(K4, codebook="uniform"), "ENUM_OUT_OF_RANGE", "KVW-HDR-10", bits=SPECS_BIT | ROT_BIT)
    _reject(replace(K4, rotation_seed=1), "CODEC_SPEC_INVALID", "KVW-TQ-2")
    for bad in (dict(symmetric=False), dict(group_axis="tokens"), dict(bits=2), dict(bits=8)):
        _reject(replace(K4, **bad), "CODEC_SPEC_INVALID", "KVW-TQ-2")
    h = Header(Architecture((LayerSpec("full_attention", 1, 64, 64),)), token_count=0, dtype="bf16",
               codec_specs=(K4,), required_features=SPECS_BIT | ROT_BIT | TQ_BIT, format_minor=3)
    assert kvwire.probe(forge.wrap_header(forge.header_of(h, check=True), minor=3)).codec_specs == (K4,)


@pytest.mark.parametrize("dim, group", [(48, 1 << 16), (64, 32)])
def test_chunk_geometry_is_decode_failed(dim, group):
    """KVW-TQ-2 at a chunk: D not a power of two, or groups shorter than a row."""
    spec = replace(K4, group_size=group)
    lay = quant.layout(spec, "bf16", 1, dim, 0, 1, 0, 10 ** 6)
    with pytest.raises(kvwire.FormatError) as e:
        quant.decode(spec, bytes(lay.length), lay, "bf16")
    assert (e.value.code, e.value.rule) == ("DECODE_FAILED", "KVW-TQ-2")


def test_writers_set_the_bits_and_minor_and_libkvwire_decodes_them(tmp_path):
    """KVW-TQ-1, KVW-EVOL-12: written with bits 0, 4, 5 and minor 3; libkvwire (a 1.3 reader)
    validates the container and decodes every tensor to the reference's bytes (its header,
    bits and minor included), through its own header parser and decoder (kvwire-c decode)."""
    data = kvwire.encode(_cache(layers=1), codec="vllm-turboquant-3bit-nc")
    h = kvwire.probe(data)
    assert (h.required_features, h.format_minor) == (SPECS_BIT | ROT_BIT | TQ_BIT, 3)
    tool = REPO / "build" / "c" / "kvwire-c"
    assert tool.exists(), "make c builds libkvwire (make test does)"
    path, out_dir = tmp_path / "tq.kvw", tmp_path / "decoded"
    path.write_bytes(data)
    out_dir.mkdir()
    out = subprocess.run([str(tool), "validate", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out
    out = subprocess.run([str(tool), "decode", str(path), str(out_dir)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out
    doc = json.loads((out_dir / "decoded.json").read_text())
    assert (doc["header"]["required_features"], doc["header"]["format_minor"]) == (SPECS_BIT | ROT_BIT | TQ_BIT, 3)
    got = kvwire.load(data)
    assert len(doc["tensors"]) == 2
    for t in doc["tensors"]:
        want = np.asarray(got.layers[t["layer"]][t["component"]])
        assert (out_dir / t["file"]).read_bytes() == want.tobytes(), t


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
