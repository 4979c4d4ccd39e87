"""The cross-model conformance suite (``kvwire conformance crossmodel``; conformance/README.md,
"Cross-model conformance suite").

One run of the whole suite (every tiny model of the zoo, one receiver process) backs the
end-to-end tests; the checks themselves are also tested on fabricated results, so that a
suite which passes everything cannot go unnoticed.
"""

import contextlib
import io
import json
import os
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from kvwire import Architecture, Header, LayerMapEntry, LayerSpec, TokenRange
from kvwire.conformance import crossmodel_checks as C
from kvwire.conformance import crossmodel_receiver as XR
from kvwire.conformance.results import FAIL, PASS
from kvwire.tools.cli import main

SLIDING = {"mistral", "gemma2", "gemma3_text", "gpt_oss", "gemma3n_text"}
SHARED = {"gemma3n_text"}


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("crossmodel")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["conformance", "crossmodel", "--junit", str(out / "x.xml"), "--markdown", str(out / "x.md"),
                   "--keep", str(out / "work")])
    return rc, buf.getvalue(), out


def _table(text: str) -> dict:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["model", "type"])
    head = lines[start].split()[2:]
    rows = {}
    for line in lines[start + 1:]:
        cells = line.split()
        if len(cells) != len(head) + 1:
            break
        rows[cells[0]] = dict(zip(head, cells[1:]))
    return rows


@pytest.mark.slow
def test_every_model_type_continues_bit_identically_in_a_fresh_process(suite):
    rc, text, _ = suite
    assert rc == 0, text
    assert "RESULT: PASS" in text
    rows = _table(text)
    from kvwire.adapters.zoo import TINY_CONFIGS

    assert set(rows) == set(TINY_CONFIGS) and len(rows) == 14
    for mt, row in rows.items():
        assert [row[c] for c in C.CORE_CHECKS] == ["pass"] * len(C.CORE_CHECKS), (mt, row)
        assert row["sliding"] == ("pass" if mt in SLIDING else "-"), (mt, row)
        assert row["alias"] == ("pass" if mt in SHARED else "-"), (mt, row)


def test_the_receiver_is_one_separate_process(suite):
    _, _, out = suite
    jobs = json.loads((out / "work" / "jobs.json").read_text())["jobs"]
    results = json.loads((out / "work" / "results.json").read_text())
    assert results["pid"] != os.getpid()  # one receiver wrote every result
    assert {j["id"] for j in jobs} == set(results["results"])
    assert sum(1 for j in jobs if j.get("steps")) == 2 * 14  # the cache and its rechunked copy
    for j in jobs:
        assert "error" not in results["results"][j["id"]], j


def test_reports_junit_and_markdown_with_reasons(suite):
    _, _, out = suite
    root = ET.parse(out / "x.xml").getroot()
    suites = root.findall("testsuite")
    assert len(suites) == 14 and {s.get("name") for s in suites} >= {"llama.crossmodel", "gemma3n_text.crossmodel"}
    cases = root.findall(".//testcase")
    assert len(cases) == 14 * 5 + len(SLIDING) + len(SHARED)
    assert not root.findall(".//failure") and not root.findall(".//error")
    md = (out / "x.md").read_text()
    assert "**Result: PASS**" in md and "| gemma3n_text |" in md
    rows = [r for r in (line.split(" | ") for line in md.splitlines()) if r[1:2] in (["other_model"], ["other_seed"])]
    assert len(rows) == 28
    for mt, check, status, msg in ((r[0][2:], r[1], r[2], r[3]) for r in rows):
        assert status == "pass" and msg.startswith("rejected: "), (mt, check, msg)
        if check == "other_seed":  # same config, other weights: the weights fingerprint says so,
            assert "weights:" in msg and "with a layer map: rejected: weights:" in msg, (mt, msg)  # map or not


# ---------------------------------------------------------------------------------------
# The checks on fabricated results: each can fail
# ---------------------------------------------------------------------------------------

def _produced(header=None, **kw):
    logits = np.arange(2 * 5, dtype=np.float32).reshape(2, 5) - 3.0
    header = header or Header(arch=Architecture.uniform(2, 2, 8), token_count=10, dtype="f32")
    fields = dict(model_type="llama", first_token=3, tokens=[4, 4], logits=logits, header=header, describe="",
                  hf_tokens=[10, 10], windows=[0, 0], expected_alias={})
    fields.update(kw)
    return C.Produced(**fields)


def _receiver(tmp_path, logits, tokens=(4, 4)):
    (tmp_path / "r.f32").write_bytes(np.asarray(logits, "<f4").tobytes())
    return {"tokens": list(tokens), "logits": "r.f32", "verdict": {"status": "exact", "ok": True,
                                                                   "conversions": [], "reasons": []}}


def test_continuation_must_match_every_logit_bit(tmp_path):
    p = _produced()
    assert C.compare_continuation(p, _receiver(tmp_path, p.logits), tmp_path)[0] == PASS
    bits = p.logits.copy().view(np.uint32)
    bits[1, 2] ^= 1  # one ulp in one logit
    status, msg = C.compare_continuation(p, _receiver(tmp_path, bits.view(np.float32)), tmp_path)
    assert status == FAIL and "1 of 10" in msg and "step 1 token 2" in msg
    base = p.logits.copy()
    base[0, 3] = 0.0
    negative = base.copy()
    negative[0, 3] = -0.0  # equal as numbers, not as bits
    assert C.compare_continuation(_produced(logits=base), _receiver(tmp_path, negative), tmp_path)[0] == FAIL
    assert C.compare_continuation(p, _receiver(tmp_path, p.logits, (4, 5)), tmp_path)[0] == FAIL
    assert C.compare_continuation(p, _receiver(tmp_path, p.logits[:1]), tmp_path)[0] == FAIL
    status, msg = C.compare_continuation(p, {"error": "ValueError: boom"}, tmp_path)
    assert status == FAIL and "boom" in msg


def _verdict(status, conversions=(), reasons=()):
    return {"verdict": {"status": status, "ok": status != "incompatible", "conversions": list(conversions),
                        "reasons": list(reasons)}}


def test_verdict_checks():
    assert C.check_verdict_exact(_verdict("exact"))[0] == PASS
    assert C.check_verdict_exact(_verdict("convertible", ["cast bf16->f32"]))[0] == FAIL
    assert C.check_verdict_exact({"error": "x"})[0] == FAIL
    assert C.check_accepted_with(_verdict("convertible", ["rechunk 3->256"]), "rechunk")[0] == PASS
    assert C.check_accepted_with(_verdict("exact"), "rechunk")[0] == FAIL  # the conversion must be listed
    assert C.check_accepted_with(_verdict("incompatible", reasons=["dtype: no"]), "cast")[0] == FAIL
    assert C.check_rejected(_verdict("incompatible", reasons=["weights: fingerprints differ"]), "weights") == \
        (PASS, "rejected: weights: fingerprints differ")
    assert C.check_rejected(_verdict("exact"))[0] == FAIL
    assert C.check_rejected(_verdict("incompatible"))[0] == FAIL  # a rejection must say why
    assert C.check_rejected(_verdict("incompatible", reasons=["config: fingerprints differ"]), "weights")[0] == FAIL


def _sliding_header(counts, window=8, kind="sliding_attention"):
    arch = Architecture((LayerSpec(kind, 2, 8, 8, window=window), LayerSpec("full_attention", 2, 8, 8)))
    return Header(arch=arch, token_count=20, dtype="f32",
                  layer_tokens=(TokenRange(20 - counts[0], counts[0]), TokenRange(0, counts[1])))


def test_sliding_check():
    ok = _produced(_sliding_header((7, 20)), hf_tokens=[7, 20], windows=[8, 0])
    assert C.check_sliding(ok) == (PASS, "sliding layers keep [7] of 20 tokens")
    assert C.check_sliding(_produced()) is None  # no sliding layer: not applicable
    everything = _produced(_sliding_header((20, 20)), hf_tokens=[7, 20], windows=[8, 0])
    assert C.check_sliding(everything)[0] == FAIL
    wrong_window = _produced(_sliding_header((7, 20), window=16), hf_tokens=[7, 20], windows=[8, 0])
    assert "window 16" in C.check_sliding(wrong_window)[1]
    as_full = _produced(_sliding_header((7, 20), kind="full_attention", window=0), hf_tokens=[7, 20], windows=[8, 0])
    assert C.check_sliding(as_full)[0] == FAIL


def test_alias_check():
    full = LayerSpec("full_attention", 2, 8, 8)
    shared = Header(arch=Architecture((full, LayerSpec("shared", source_layer=0))), token_count=5, dtype="f32")
    mapped = shared.replace(layer_map=(LayerMapEntry(1, 0, "alias"),))
    assert C.check_alias(_produced(shared, expected_alias={1: 0}))[0] == PASS
    assert C.check_alias(_produced(mapped, expected_alias={1: 0}))[1] == "layer map alias and shared layers: 1<-0"
    assert C.check_alias(_produced(shared)) is None  # no KV sharing in the model: not applicable
    plain = Header(arch=Architecture((full, full)), token_count=5, dtype="f32")
    assert C.check_alias(_produced(plain, expected_alias={1: 0}))[0] == FAIL
    only_map = plain.replace(layer_map=(LayerMapEntry(1, 0, "alias"),))
    assert C.check_alias(_produced(only_map, expected_alias={1: 0}))[0] == PASS
    assert C.check_alias(_produced(only_map, expected_alias={1: 0, 0: 1}))[0] == FAIL  # a shared layer left out
    three = Architecture((full, full, LayerSpec("shared", source_layer=0)))
    wrong_source = Header(arch=three, token_count=5, dtype="f32")
    assert C.check_alias(_produced(wrong_source, expected_alias={2: 1}))[0] == FAIL
    disagree = wrong_source.replace(layer_map=(LayerMapEntry(2, 1, "alias"),))
    assert "source_layer" in C.check_alias(_produced(disagree, expected_alias={2: 1}))[1]


def test_receiver_errors_fail_their_cells_not_the_suite(tmp_path):
    p = _produced(model_type="llama")
    res = {"llama/roundtrip": {"error": "RuntimeError: adapter broke", "verdict": _verdict("exact")["verdict"]}}
    cells = C.check_cells(p, res, tmp_path)
    assert cells["roundtrip"] == (FAIL, "RuntimeError: adapter broke")
    assert cells["verdict"][0] == PASS
    for check in ("soft", "other_model", "other_seed"):  # nothing reported for these jobs
        assert cells[check][0] == FAIL and "reported nothing" in cells[check][1]


@pytest.mark.slow
def test_receiver_process_failures_are_reported(tmp_path):
    (tmp_path / "jobs.json").write_text("{not json")
    res, why = XR.run_worker(tmp_path, timeout=60)
    assert res == {} and "exited 1" in why and "JSONDecodeError" in why
    (tmp_path / "jobs.json").write_text(json.dumps({"jobs": []}))
    res, why = XR.run_worker(tmp_path, timeout=0.001)
    assert res == {} and "timed out" in why
    assert XR.worker_main(["nonsense"]) == 2


def test_unknown_model_type_is_a_usage_error(capsys):
    assert main(["conformance", "crossmodel", "--models", "llama,not_a_model"]) == 2
    assert "not_a_model" in capsys.readouterr().err


def test_other_seed_fails_when_a_layer_map_lifts_the_weights_check(tmp_path):
    """KVW-XM-6: a receiver with other weights that accepts the cache behind a layer map fails other_seed."""
    p = _produced(model_type="llama")
    refused = {"verdict": {"status": "incompatible", "ok": False, "conversions": [],
                           "reasons": ["weights: fingerprints differ"]}}
    accepted = {"verdict": {"status": "convertible", "ok": True, "conversions": ["layer map: copy 2"], "reasons": []}}
    res = {"llama/other_seed": refused, "llama/other_seed_mapped": accepted, "llama/mapped": accepted}
    cells = C.check_cells(p, res, tmp_path)
    assert cells["other_seed"][0] == FAIL and cells["other_seed"][1].startswith("with a layer map: accepted")
    res["llama/other_seed_mapped"] = refused
    assert C.check_cells(p, res, tmp_path)["other_seed"][0] == PASS
