"""Regression vectors from fuzzing: each keeps the reader contract and its recorded
outcome; a finding is promoted into the append-only regressions manifest and then run
by the conformance runner like every gold vector."""

import json
import shutil
import sys
from pathlib import Path

import pytest

from kvwire.conformance.drivers import CommandImpl, default_impl_argv
from kvwire.conformance.runner import Runner
from kvwire.conformance.vectors import load_vector_set

ROOT = Path(__file__).resolve().parents[2]
FUZZ = ROOT / "conformance" / "fuzz"
sys.path.insert(0, str(FUZZ))

import campaign
import harness


def regression_vectors():
    out = []
    for d in sorted((ROOT / "conformance" / "vectors").iterdir()):
        m = d / "regressions" / "manifest.json"
        if m.is_file():
            out += [(m.parent, e) for e in json.loads(m.read_text())["vectors"]]
    return out


def test_regression_vectors_keep_the_contract_and_their_outcome():
    for folder, entry in regression_vectors():
        outcome = harness.check((folder / entry["file"]).read_bytes())
        assert outcome == ("ok" if entry["kind"] == "valid" else entry["expected_code"]), entry["name"]


@pytest.mark.slow
def test_promote_a_finding_and_run_it(tmp_path):
    version = tmp_path / "1.0"
    shutil.copytree(ROOT / "conformance" / "vectors" / "1.0", version)
    finding = tmp_path / "crash-0123"
    finding.write_bytes((version / "invalid" / "chunk2-straddles.kvw").read_bytes())
    entry = campaign.promote(finding, "chunk-boundary-example", version_dir=version)
    assert entry["kind"] == "invalid" and entry["expected_code"] == "CHUNK_BOUNDARY" and entry["code_policy"] == "any"
    valid = tmp_path / "crash-4567"
    valid.write_bytes((version / "valid" / "single-token.kvw").read_bytes())
    assert campaign.promote(valid, "accepted-example", version_dir=version)["kind"] == "valid"
    with pytest.raises(ValueError):
        campaign.promote(valid, "accepted-example", version_dir=version)
    vs = load_vector_set(version)
    regs = [v.name for v in vs.vectors if v.regression]
    assert regs[-2:] == ["regressions/chunk-boundary-example", "regressions/accepted-example"]  # appended last
    before = json.loads((ROOT / "conformance/vectors/1.0/regressions/manifest.json").read_text())["vectors"]
    assert regs[:-2] == [e["name"] for e in before]  # the committed ones stay, in order
    run = Runner([CommandImpl(default_impl_argv())], [vs], select=["*/regressions/*"], levels=("reader",)).run()
    assert run.ok and len(run.cases) == len(regs)
