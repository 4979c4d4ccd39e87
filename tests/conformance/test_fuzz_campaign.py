"""The bounded fuzz campaign that runs with every `make test` (60 s by default).

The atheris target (conformance/fuzz/fuzz_reader.py) runs against a corpus seeded from
the gold vectors; any finding (an exception other than FormatError, a disagreement of
the two readers, a timeout, running out of memory) fails the test and is kept with a
reproduction report. KVWIRE_FUZZ_SECONDS sets the budget (0 skips); `make fuzz` runs
the long campaign. Without atheris the hypothesis state machine gets the budget.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECONDS = float(os.environ.get("KVWIRE_FUZZ_SECONDS", "60"))


@pytest.mark.slow
@pytest.mark.skipif(SECONDS <= 0, reason="KVWIRE_FUZZ_SECONDS=0")
def test_bounded_fuzz_campaign(tmp_path):
    stats_path = tmp_path / "stats.json"
    findings = tmp_path / "findings"
    p = subprocess.run([sys.executable, str(ROOT / "conformance" / "fuzz" / "campaign.py"), "--seconds", str(SECONDS),
                        "--hypothesis-seconds", "0", "--corpus", str(tmp_path / "corpus"), "--findings",
                        str(findings), "--json", str(stats_path)],
                       capture_output=True, text=True, timeout=SECONDS + 300)
    print(p.stdout, p.stderr[-3000:])
    stats = json.loads(stats_path.read_text())
    reports = "\n\n".join(f.read_text()[:3000] for f in sorted(findings.glob("*.txt")))
    assert stats["findings"] == 0, f"fuzzing findings (kept in {findings}):\n{reports}"
    assert p.returncode == 0
    ran = stats["atheris"] or stats["hypothesis"]
    assert (ran.get("executions") or ran.get("examples")) > 0
