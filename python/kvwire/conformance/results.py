"""The outcome vocabulary of a conformance run: levels, statuses, case and run results.

Shared by the runner, the per-level checks, the cross-model suite and the reports, so it
sits below all of them and imports nothing of the kit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LEVELS = ("reader", "writer", "roundtrip")
PASS, WARN, FAIL, ERROR, SKIP = "pass", "warn", "fail", "error", "skip"
_RANK = {PASS: 0, SKIP: 1, WARN: 2, FAIL: 3, ERROR: 4}
REFERENCE = "reference"  # label of the in-process reference codec in the matrix


@dataclass
class CaseResult:
    level: str
    impl: str
    case: str
    status: str
    message: str = ""
    details: list = field(default_factory=list)
    seconds: float = 0.0
    producer: str | None = None  # roundtrip cells
    consumer: str | None = None


def worst(*statuses: str) -> str:
    """The most severe of ``statuses`` (pass < skip < warn < fail < error)."""
    return max(statuses, key=_RANK.__getitem__)


@dataclass
class RunResult:
    """The outcome of a conformance run: every case, the producer x consumer matrix and
    the time taken; ``summary()`` counts statuses per implementation and level."""

    impls: list  # labels of the implementations under test
    descriptions: dict  # label -> command line
    vector_sets: list  # (version, number of vectors)
    cases: list
    matrix: dict  # (producer, consumer) -> [pass, total]
    levels: tuple
    lenient_codes: bool
    seconds: float = 0.0

    def summary(self) -> dict:
        """{impl: {level: {status: count}}}."""
        out: dict = {}
        for c in self.cases:
            out.setdefault(c.impl, {}).setdefault(c.level, {s: 0 for s in _RANK})[c.status] += 1
        return out

    @property
    def ok(self) -> bool:
        return all(c.status in (PASS, WARN, SKIP) for c in self.cases)

    def level_verdict(self, impl: str, level: str) -> str:
        counts = self.summary().get(impl, {}).get(level)
        if not counts or sum(counts.values()) == counts[SKIP]:
            return "not tested"
        if counts[FAIL] or counts[ERROR]:
            return "FAIL"
        return "pass" if not counts[SKIP] else "pass (partial)"
