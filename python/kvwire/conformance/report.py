"""Reports of a conformance run: console lines, a text summary, JUnit XML, Markdown."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from .results import ERROR, FAIL, LEVELS, PASS, REFERENCE, SKIP, WARN, CaseResult, RunResult

_TAG = {PASS: "PASS", WARN: "WARN", FAIL: "FAIL", ERROR: "ERROR", SKIP: "SKIP"}


def case_line(c: CaseResult) -> str:
    return f"{_TAG[c.status]:<5} {c.level:<9} {c.impl:<18} {c.case}  {c.message}"


def summary_text(run: RunResult) -> str:
    lines = [f"kvwire conformance: {', '.join(f'{v} ({n} vectors)' for v, n in run.vector_sets)}; "
             f"{len(run.cases)} checks in {run.seconds:.1f} s"]
    summ = run.summary()
    for impl in run.impls:
        lines.append(f"  {impl}: {run.descriptions.get(impl, '')}")
        for level in LEVELS:
            if level not in run.levels:
                continue
            c = summ.get(impl, {}).get(level, {s: 0 for s in _TAG})
            total = sum(c.values())
            passed = c[PASS] + c[WARN]
            pct = f"{100.0 * passed / (total - c[SKIP]):.1f}%" if total - c[SKIP] else "-"
            lines.append(f"    {level:<9} {run.level_verdict(impl, level):<14} {passed}/{total - c[SKIP]} passed "
                         f"({pct})" + "".join(f", {c[s]} {name}" for s, name in
                                              ((WARN, "warnings"), (FAIL, "failed"), (ERROR, "errors"),
                                               (SKIP, "skipped")) if c[s]))
    if run.matrix:
        lines.append("  producer -> consumer matrix (passed/total):")
        lines += ["    " + line for line in _matrix_rows(run)]
    lines.append("RESULT: " + ("PASS" if run.ok else "FAIL"))
    return "\n".join(lines)


def _participants(run: RunResult) -> list:
    return [REFERENCE] + list(run.impls)


def _matrix_rows(run: RunResult) -> list:
    names = _participants(run)
    width = max(len(n) for n in names) + 2
    rows = [" " * width + "".join(f"{n:>{width}}" for n in names)]
    for p in names:
        cells = []
        for c in names:
            m = run.matrix.get((p, c))
            cells.append(f"{m[0]}/{m[1]}" if m else "-")
        rows.append(f"{p:<{width}}" + "".join(f"{x:>{width}}" for x in cells))
    return rows


def junit_xml(run: RunResult) -> bytes:
    """JUnit XML: one testsuite per (implementation, level), one testcase per check."""
    root = ET.Element("testsuites", name="kvwire-conformance", time=f"{run.seconds:.3f}")
    groups: dict = {}
    for c in run.cases:
        groups.setdefault((c.impl, c.level), []).append(c)
    for (impl, level), cs in groups.items():
        suite = ET.SubElement(root, "testsuite", name=f"{impl}.{level}", tests=str(len(cs)),
                              failures=str(sum(c.status == FAIL for c in cs)),
                              errors=str(sum(c.status == ERROR for c in cs)),
                              skipped=str(sum(c.status == SKIP for c in cs)),
                              time=f"{sum(c.seconds for c in cs):.3f}")
        for c in cs:
            tc = ET.SubElement(suite, "testcase", classname=f"{impl}.{level}", name=c.case, time=f"{c.seconds:.3f}")
            text = "\n".join(c.details) if c.details else c.message
            if c.status == FAIL:
                ET.SubElement(tc, "failure", message=c.message).text = text
            elif c.status == ERROR:
                ET.SubElement(tc, "error", message=c.message).text = text
            elif c.status == SKIP:
                ET.SubElement(tc, "skipped", message=c.message)
            elif c.status == WARN:
                ET.SubElement(tc, "system-out").text = "WARNING: " + text
    ET.indent(root)
    return ET.tostring(root, encoding="utf-8", xml_declaration=True)


def md_cell(s: str) -> str:
    """``s`` as one cell of a markdown table row (pipes escaped, on one line)."""
    return s.replace("|", "\\|").replace("\n", " ")


def markdown(run: RunResult, *, max_listed: int = 200) -> str:
    out = ["# kvwire conformance report", ""]
    out.append(f"Vectors: {', '.join(f'format {v} ({n} vectors)' for v, n in run.vector_sets)}. "
               f"Checks: {len(run.cases)}. Time: {run.seconds:.1f} s. "
               f"Wrong error codes count as {'warnings' if run.lenient_codes else 'failures'}.")
    out += ["", f"**Result: {'PASS' if run.ok else 'FAIL'}**", "", "## Summary", "",
            "| Implementation | Level | Verdict | Passed | Warnings | Failed | Errors | Skipped |",
            "|---|---|---|---|---|---|---|---|"]
    summ = run.summary()
    for impl in run.impls:
        for level in LEVELS:
            if level not in run.levels:
                continue
            c = summ.get(impl, {}).get(level, {s: 0 for s in _TAG})
            total = sum(c.values()) - c[SKIP]
            out.append(f"| {md_cell(impl)} | {level} | {run.level_verdict(impl, level)} | {c[PASS] + c[WARN]}/{total} | "
                       f"{c[WARN]} | {c[FAIL]} | {c[ERROR]} | {c[SKIP]} |")
    out += ["", "Implementations:", ""]
    out += [f"- `{md_cell(impl)}`: `{md_cell(run.descriptions.get(impl, ''))}`" for impl in run.impls]
    if run.matrix:
        names = _participants(run)
        out += ["", "## Producer x consumer matrix", "",
                "Rows write (encode), columns read (decode); cells are passed/total writer cases. "
                "The column `reference` of an implementation's row is its writer level.", "",
                "| producer \\ consumer | " + " | ".join(md_cell(n) for n in names) + " |",
                "|---|" + "---|" * len(names)]
        for p in names:
            cells = []
            for c in names:
                m = run.matrix.get((p, c))
                cells.append(f"{m[0]}/{m[1]}" if m else "-")
            out.append(f"| {md_cell(p)} | " + " | ".join(cells) + " |")
    bad = [c for c in run.cases if c.status in (FAIL, ERROR, WARN)]
    if bad:
        out += ["", "## Failures, errors and warnings", "", "| Status | Implementation | Level | Check | Message |",
                "|---|---|---|---|---|"]
        for c in bad[:max_listed]:
            out.append(f"| {_TAG[c.status]} | {md_cell(c.impl)} | {c.level} | `{md_cell(c.case)}` | {md_cell(c.message)} |")
        if len(bad) > max_listed:
            out.append(f"| ... | | | | {len(bad) - max_listed} more |")
    skipped = [c for c in run.cases if c.status == SKIP]
    if skipped:
        out += ["", f"{len(skipped)} checks skipped (commands the implementation does not support, or producers "
                    "without output)."]
    return "\n".join(out) + "\n"
