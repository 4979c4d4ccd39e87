"""Fidelity harness (kvwire.tools.fidelity): sizes, tensor errors, model-level agreement, CLI.

The full measurement on the trained model is benchmarks/bench_fidelity.py; these tests
use a tiny random model and check that every number means what it says."""

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import kvwire
from kvwire.tools import fidelity as F
from kvwire.tools.cli import main
from kvwire.tools.synth import synth_cache


def _f32_cache(keys, values):
    return kvwire.KVCache.from_tensors([np.asarray(k, np.float32) for k in keys],
                                       [np.asarray(v, np.float32) for v in values])


def test_importing_fidelity_does_not_import_torch():
    code = "import sys, kvwire, kvwire.tools.fidelity, kvwire.codecs.policy; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_tensor_errors_exact_values():
    k = np.arange(8, dtype=np.float32).reshape(1, 2, 4)
    v = np.ones((1, 2, 4), np.float32)
    ref = _f32_cache([k], [v])
    k2 = k.copy()
    k2[0, 1, 3] += 2.0
    test = _f32_cache([k2], [-v])
    ek, ev = F.tensor_errors(ref, test)
    assert (ek.layer, ek.component) == (0, "k") and ek.mse == pytest.approx(4.0 / 8) and ek.max_abs == 2.0
    assert ek.cosine == pytest.approx(np.dot(k.ravel(), k2.ravel()) / np.linalg.norm(k) / np.linalg.norm(k2))
    assert ev.mse == 4.0 and ev.max_abs == 2.0 and ev.cosine == pytest.approx(-1.0)
    assert all(e.mse == 0 and e.max_abs == 0 and e.cosine == pytest.approx(1.0) for e in F.tensor_errors(ref, ref))
    with pytest.raises(ValueError):
        F.tensor_errors(ref, _f32_cache([k, k], [v, v]))


@given(a=hnp.arrays(np.float32, (2, 3, 4), elements=st.floats(-100, 100, width=32)),
       b=hnp.arrays(np.float32, (2, 3, 4), elements=st.floats(-100, 100, width=32)))
def test_tensor_error_properties(a, b):
    ea = F.tensor_errors(_f32_cache([a], [b]), _f32_cache([b], [a]))
    eb = F.tensor_errors(_f32_cache([b], [a]), _f32_cache([a], [b]))
    for x, y in zip(ea, eb):  # symmetric, bounded, zero iff equal
        assert x.mse == pytest.approx(y.mse) and x.max_abs == y.max_abs and x.cosine == pytest.approx(y.cosine)
        assert x.mse >= 0 and -1 - 1e-9 <= x.cosine <= 1 + 1e-9
        assert (x.max_abs == 0) == np.array_equal(a, b)


def test_sizes_count_every_container_byte():
    cache = synth_cache(2, 2, 16, 96, chunk_tokens=32)
    (raw, zstd), = [F.evaluate([cache], ["raw", "zstd"])]
    for r, codec in ((raw, "raw"), (zstd, "zstd")):
        assert r.container_bytes == len(kvwire.encode(cache, codec=codec))
        assert r.elements == 2 * 2 * 2 * 96 * 16
        assert r.bits_per_element == pytest.approx(8 * r.container_bytes / r.elements)
        assert r.ratio_vs_bf16 == pytest.approx(16 / r.bits_per_element)
        assert r.max_abs == 0 and r.min_cosine == pytest.approx(1.0)
    assert raw.bits_per_element > 16  # metadata is counted against the codec
    assert zstd.ratio_vs_bf16 > raw.ratio_vs_bf16


def test_lossy_preset_errors_are_measured():
    cache = synth_cache(2, 2, 64, 64, chunk_tokens=32)
    (r,) = F.evaluate([cache], ["int4-g32"])
    assert r.ratio_vs_bf16 > 2.5 and 0 < r.max_abs and 0.9 < r.min_cosine < 1.0
    assert r.mse("k") > 0 and r.mse("v") > 0
    d = r.as_dict()
    assert d["codec"] == "int4-g32" and len(d["layers"]) == 4 and "model" not in d


def test_logit_agreement_and_prefix_match():
    p = np.log(np.array([[[0.5, 0.25, 0.25]], [[0.1, 0.8, 0.1]]]))
    q = np.log(np.array([[[0.25, 0.5, 0.25]], [[0.1, 0.8, 0.1]]]))
    kl, top1 = F.logit_agreement(p, q + 7.0)  # logits: a constant shift changes nothing
    assert kl == pytest.approx((0.5 * np.log(2) + 0.25 * np.log(0.5)) / 2) and top1 == 0.5
    assert F.logit_agreement(p, p) == (0.0, 1.0)
    assert F.common_prefix_fraction([[1, 2, 3, 4], [1, 2, 3, 4]], [[1, 2, 9, 4], [1, 2, 3, 4]]) == (0.5 + 1) / 2
    assert F.common_prefix_fraction([[5, 2]], [[6, 2]]) == 0.0


class MeanHook:
    """A numpy 'model' whose logits depend on the cache: enough to test the metric plumbing."""

    def __init__(self):
        self.calls = 0

    def _bias(self, caches):
        return np.stack([[float(np.asarray(c.keys(0), np.float64).mean())] for c in caches])

    def logits(self, caches, tokens):
        self.calls += 1
        b = self._bias(caches)[:, :, None]
        return np.stack([np.eye(4)[t % 4] for t in tokens]) * 2 + b * np.arange(4)

    def greedy(self, caches, first, n):
        self.calls += 1
        return np.stack([(first + i + (self._bias(caches)[:, 0] > 0.5)) % 4 for i in range(n)], axis=1)


def test_model_metrics_through_a_hook():
    ref = [_f32_cache([np.zeros((1, 2, 2))], [np.zeros((1, 2, 2))])]
    same = F.model_metrics(MeanHook(), ref, ref, np.array([[0, 1, 2]]), greedy_tokens=4)
    assert (same.kl, same.top1, same.greedy_match, same.positions) == (0.0, 1.0, 1.0, 3)
    hook, cached = MeanHook(), {}
    far = [_f32_cache([np.full((1, 2, 2), 3.0)], [np.zeros((1, 2, 2))])]
    m = F.model_metrics(hook, ref, far, np.array([[0, 1, 2]]), greedy_tokens=4, ref_out=cached)
    assert m.kl > 0.1 and m.top1 == 0.0 and m.greedy_match == 0.0
    F.model_metrics(hook, ref, far, np.array([[0, 1, 2]]), greedy_tokens=4, ref_out=cached)
    assert hook.calls == 6  # reference outputs computed once


def test_kv_stats_find_outlier_key_channels():
    cache = synth_cache(1, 2, 128, 256, seed=3)  # 5% of key channels scaled by 8
    (s,) = F.kv_stats(cache)
    assert s["k_max_over_median"] > 5 and s["v_max_over_median"] < 2
    assert s["k_channel_kurtosis"] > s["v_channel_kurtosis"] + 3
    g = F.channel_stats(np.random.default_rng(0).standard_normal((2, 4000, 8)))
    assert abs(g["kurtosis"]) < 0.2


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    path = tmp_path_factory.mktemp("fid") / "model"
    model.save_pretrained(str(path))
    return model, path


def test_model_level_on_a_transformers_model(tiny_model):
    model, _ = tiny_model
    ids = np.random.default_rng(1).integers(0, 256, (2, 48))
    caches = F.prefill_hf(model, ids[:, :40])
    assert len(caches) == 2 and caches[0].header.dtype == "bf16" and caches[0].header.token_count == 40
    hook = F.HFHook(model)
    raw, fp8 = F.evaluate(caches, ["raw", "fp8-e4m3"], hook=hook, continuation=ids[:, 40:], greedy_tokens=6)
    assert (raw.model.kl, raw.model.top1, raw.model.greedy_match) == (0.0, 1.0, 1.0)
    assert raw.model.positions == 16 and raw.model.greedy_tokens == 6
    assert fp8.max_abs > 0 and fp8.model.kl > 0
    # the hook really reads the cache: garbage K/V change the next-token distribution a lot
    rng = np.random.default_rng(2)
    noise = [F.astype(kvwire.KVCache(c.header.replace(dtype="f32"),
                                     [{n: (rng.standard_normal(x.shape) * 50).astype(np.float32) for n, x in layer.items()}
                                      for layer in c.layers]), "bf16") for c in caches]
    bad = F.model_metrics(hook, caches, noise, ids[:, 40:], greedy_tokens=6)
    assert bad.kl > 100 * fp8.model.kl


def test_cli_fidelity_on_a_container(tmp_path, capsys):
    path = tmp_path / "c.kvw"
    kvwire.save(path, synth_cache(2, 2, 32, 64, chunk_tokens=32))
    out_json = tmp_path / "r.json"
    assert main(["fidelity", "--cache", str(path), "--codec", "raw", "--codec", "int8", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "| `raw` |" in out and "| `int8` |" in out and "logit KL" not in out
    rows = json.loads(out_json.read_text())
    assert [r["codec"] for r in rows] == ["raw", "int8"] and rows[0]["max_abs"] == 0 and rows[1]["max_abs"] > 0
    with pytest.raises(SystemExit):
        main(["fidelity", "--codec", "raw"])


def test_cli_fidelity_with_a_model(tiny_model, tmp_path, capsys):
    _, path = tiny_model
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(256)) * 8)
    assert main(["fidelity", "--model", str(path), "--text", str(text), "--codec", "raw", "--prompts", "2",
                 "--prompt-tokens", "32", "--continuation", "4", "--greedy", "3"]) == 0
    out = capsys.readouterr().out
    assert "logit KL" in out and "100.00%" in out


def test_shipped_model_matches_its_training_record():
    """benchmarks/fidelity/model: the weights are the ones train.py recorded (sha256)."""
    import hashlib
    from pathlib import Path

    model = Path(__file__).resolve().parents[2] / "benchmarks" / "fidelity" / "model"
    record = json.loads((model / "train_log.json").read_text())
    assert hashlib.sha256((model / "model.safetensors").read_bytes()).hexdigest() == record["sha256"]
    assert record["sha256"] in (model.parent / "README.md").read_text()
    assert record["log"][-1]["held_out_loss"] < record["log"][0]["held_out_loss"] - 2  # it did learn
