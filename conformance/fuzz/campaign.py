#!/usr/bin/env python3
"""Fuzz campaigns over the reference readers, and regression vectors from their findings.

    python conformance/fuzz/campaign.py --seconds 600            # make fuzz
    python conformance/fuzz/campaign.py --seconds 60 --hypothesis-seconds 0 --json stats.json
    python conformance/fuzz/campaign.py promote FINDING --name short-name

``run`` (the default) seeds the corpus (conformance/fuzz/corpus/, not committed) with
every gold vector, runs the atheris target (fuzz_reader.py) for ``--seconds`` —
restarting libFuzzer after each finding, so one crash does not end the campaign — then
the hypothesis state machine for ``--hypothesis-seconds``. Findings (crashes: any
exception other than FormatError, reader disagreements, the memory oracle's
over-allocations (``harness.OverAllocation``: a peak allocation above 64 bytes per input
byte + 6 per decoded byte + 16 MiB); timeouts; out-of-memory) are
copied to conformance/fuzz/findings/ with a reproduction report. Without atheris the
whole budget goes to the state machine.

``promote`` turns a finding, once the bug is fixed, into a regression vector: the input
goes to conformance/vectors/<version>/regressions/, the append-only regressions manifest
gets an entry with the outcome the fixed reference codec gives (rejected: any registry
code passes; accepted: a JSON twin), and the line to pin it in
tests/conformance/test_conformance.py is printed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
VECTORS = ROOT / "conformance" / "vectors"
sys.path.insert(0, str(HERE))

_STAT = re.compile(r"^stat::(\w+):\s+(\d+)", re.M)
_DONE = re.compile(r"Done (\d+) runs in (\d+) second")


def seed_corpus(corpus: Path) -> int:
    corpus.mkdir(parents=True, exist_ok=True)
    n = 0
    for p in sorted(VECTORS.glob("*/*/*.kvw")) + sorted(VECTORS.glob("*/regressions/*.kvw")):
        dst = corpus / ("seed-" + hashlib.sha1(p.read_bytes()).hexdigest())
        if not dst.exists():
            shutil.copyfile(p, dst)
            n += 1
    return n


def reproduce(data: bytes) -> str:
    """A one-line signature and traceback of what ``harness.check`` does with ``data``."""
    import harness

    try:
        outcome = harness.check(data)
    except Exception as exc:  # noqa: BLE001 - this is the finding
        tb = traceback.extract_tb(exc.__traceback__)
        where = f"{Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else "?"
        return f"{type(exc).__name__} at {where}: {exc}\n" + traceback.format_exc()
    return f"no longer reproduces in-process (outcome {outcome})"


def run_atheris(seconds: float, corpus: Path, findings: Path, *, max_len: int = 70000, rss_mb: int = 2048,
                timeout_s: int = 10, log=print) -> dict:
    stats = {"executions": 0, "seconds": 0.0, "new_units": 0, "peak_rss_mb": 0, "runs": 0, "findings": []}
    artifacts = findings / "artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + seconds
    seen = set()
    while stats["runs"] < 50:
        left = int(deadline - time.monotonic())
        if left < 3:
            break
        before = set(artifacts.iterdir())
        t0 = time.monotonic()
        cmd = [sys.executable, str(HERE / "fuzz_reader.py"), str(corpus), f"-max_total_time={left}",
               f"-timeout={timeout_s}", f"-rss_limit_mb={rss_mb}", f"-max_len={max_len}", "-print_final_stats=1",
               f"-artifact_prefix={artifacts}/", "-close_fd_mask=1"]
        p = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=left + 120)
        stats["runs"] += 1
        stats["seconds"] += time.monotonic() - t0
        found = dict(_STAT.findall(p.stderr))
        done = _DONE.findall(p.stderr)
        stats["executions"] += int(found.get("number_of_executed_units", done[-1][0] if done else 0))
        stats["new_units"] += int(found.get("new_units_added", 0))
        stats["peak_rss_mb"] = max(stats["peak_rss_mb"], int(found.get("peak_rss_mb", 0)))
        new = sorted(set(artifacts.iterdir()) - before)
        for art in new:
            data = art.read_bytes()
            kind = art.name.split("-", 1)[0]
            report = reproduce(data) if kind == "crash" else f"{kind} (libFuzzer)"
            sig = kind + ":" + report.split("\n", 1)[0]
            if sig in seen:
                art.unlink()
                continue
            seen.add(sig)
            dst = findings / art.name
            shutil.move(str(art), dst)
            (findings / (art.name + ".txt")).write_text(report + "\n\n--- libFuzzer log tail ---\n"
                                                        + p.stderr[-4000:])
            stats["findings"].append({"kind": kind, "file": str(dst), "signature": sig.split("\n")[0]})
            log(f"FINDING {kind}: {sig.splitlines()[0]} -> {dst}")
        if p.returncode == 0 or not new:
            if p.returncode not in (0, None) and not new:
                log(f"libFuzzer exited {p.returncode} without an artifact:\n{p.stderr[-2000:]}")
                stats["errors"] = stats.get("errors", 0) + 1
            break
    stats["exec_per_sec"] = round(stats["executions"] / stats["seconds"], 1) if stats["seconds"] else 0.0
    return stats


def run_hypothesis(seconds: float, findings: Path, *, log=print) -> dict:
    """Run the state machine in batches until ``seconds`` are spent."""
    import harness
    from hypothesis import HealthCheck, settings
    from hypothesis.stateful import run_state_machine_as_test
    from statemachine import ContainerMutations

    stats = {"examples": 0, "steps_per_example": 20, "seconds": 0.0, "findings": []}
    t0 = time.monotonic()
    batch = 0
    while time.monotonic() - t0 < seconds:
        batch += 1
        cfg = settings(max_examples=50, stateful_step_count=20, deadline=None, database=None, derandomize=False,
                       suppress_health_check=list(HealthCheck), print_blob=True)
        try:
            run_state_machine_as_test(ContainerMutations, settings=cfg)
        except Exception as exc:  # noqa: BLE001 - a falsifying example
            findings.mkdir(parents=True, exist_ok=True)
            path = findings / f"hypothesis-{int(time.time())}-{batch}.txt"
            path.write_text(traceback.format_exc())
            stats["findings"].append({"kind": "hypothesis", "file": str(path),
                                      "signature": f"{type(exc).__name__}: {str(exc)[:200]}"})
            log(f"FINDING hypothesis: {type(exc).__name__}: {exc} -> {path}")
            break
        stats["examples"] += 50
    stats["seconds"] = round(time.monotonic() - t0, 1)
    stats["memory_oracle"] = dict(harness.MEMORY)  # inputs checked, largest peak and its input's size
    return stats


# ---------------------------------------------------------------------------------------
# Promotion of a finding to a regression vector
# ---------------------------------------------------------------------------------------

def promote(finding: Path, name: str, *, version_dir: Path) -> dict:
    import harness

    import kvwire
    from kvwire.conformance import neutral as N
    from kvwire.format.errors import FormatError

    data = finding.read_bytes()
    harness.check(data)  # the bug must be fixed first: this raises while it still reproduces
    reg_dir = version_dir / "regressions"
    manifest_path = reg_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    full = f"regressions/{name}"
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]*", name) or any(e["name"] == full for e in manifest["vectors"]):
        raise ValueError(f"bad or existing name {name!r}")
    sha = hashlib.sha256(data).hexdigest()
    entry = {"name": full, "file": f"{name}.kvw", "sha256": sha, "size": len(data),
             "found_by": finding.name, "description": "fuzzing finding (conformance/fuzz)"}
    try:
        with kvwire.open(data) as r:
            r.validate()
            cache = r.load()
            twin = N.make_twin(cache, form=r.form, chunk_count=r.chunk_count)
        text = json.dumps(twin, indent=1) + "\n"
        (reg_dir / f"{name}.json").write_text(text)
        entry.update(kind="valid", twin=f"{name}.json", twin_sha256=hashlib.sha256(text.encode()).hexdigest())
    except FormatError as exc:
        entry.update(kind="invalid", expected_code=exc.code, rule=exc.rule, rules=[exc.rule],
                     code_policy="any", description=entry["description"] + f"; the reference reports {exc.code}")
    (reg_dir / f"{name}.kvw").write_bytes(data)
    manifest["vectors"].append(entry)
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    pin = f"{version_dir.name}/{full}"  # the key tests/conformance/test_conformance.py pins: <version>/<name>
    print(f"added {full}; pin it in tests/conformance/test_conformance.py REGRESSIONS_PINNED:\n    {pin!r}: {sha!r},")
    return entry


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["promote"]:
        ap = argparse.ArgumentParser(prog="campaign.py promote")
        ap.add_argument("finding", type=Path)
        ap.add_argument("--name", required=True)
        ap.add_argument("--version", default="1.0")
        a = ap.parse_args(argv[1:])
        promote(a.finding, a.name, version_dir=VECTORS / a.version)
        return 0
    ap = argparse.ArgumentParser(description="fuzz the reference readers (atheris + hypothesis)")
    ap.add_argument("--seconds", type=float, default=600, help="atheris time budget")
    ap.add_argument("--hypothesis-seconds", type=float, default=None,
                    help="state machine time budget (default: 1/5 of --seconds; all of it without atheris)")
    ap.add_argument("--corpus", type=Path, default=HERE / "corpus")
    ap.add_argument("--findings", type=Path, default=HERE / "findings")
    ap.add_argument("--json", type=Path, help="write the campaign figures here")
    a = ap.parse_args(argv)
    try:
        import atheris  # noqa: F401 (only checks that it imports)

        have_atheris = True
    except ImportError:
        have_atheris = False
    hyp = a.hypothesis_seconds if a.hypothesis_seconds is not None else a.seconds / 5
    out = {"atheris": None, "hypothesis": None}
    if have_atheris and a.seconds > 0:
        seeded = seed_corpus(a.corpus)
        print(f"atheris: {a.seconds:g} s, corpus {a.corpus} ({seeded} new seeds)", flush=True)
        out["atheris"] = run_atheris(a.seconds, a.corpus, a.findings)
        s = out["atheris"]
        print(f"atheris: {s['executions']} executions in {s['seconds']:.0f} s ({s['exec_per_sec']} exec/s), "
              f"{s['new_units']} new corpus units, peak RSS {s['peak_rss_mb']} MB, {len(s['findings'])} findings",
              flush=True)
    elif not have_atheris:
        print("atheris is not installed: the state machine gets the whole budget", flush=True)
        hyp = a.seconds + (a.hypothesis_seconds or 0)
    if hyp > 0:
        out["hypothesis"] = run_hypothesis(hyp, a.findings)
        s = out["hypothesis"]
        m = s["memory_oracle"]
        print(f"hypothesis: {s['examples']} examples x up to {s['steps_per_example']} steps in {s['seconds']} s, "
              f"{len(s['findings'])} findings; memory oracle: {m['inputs']} inputs, largest peak "
              f"{m['max_peak'] / 2**20:.1f} MiB (input of {m['largest_input']} bytes)", flush=True)
    findings = sum(len(v["findings"]) for v in out.values() if v)
    out["findings"] = findings
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
