"""The conformance runner: drives implementations through the subprocess protocol.

Three levels (conformance/README.md):

* **reader** — every gold vector: valid ones decode to their twin's header and tensor
  digests and pass ``validate``; invalid ones are rejected by ``validate`` and by
  ``decode`` with the expected error code.
* **writer** — the implementation encodes every writer case (``spec.json`` + raw
  tensors); the reference reader fully validates the output and decodes the header and
  tensors the case describes.
* **roundtrip** — the producer x consumer matrix: every writer's output read by every
  reader (the in-process reference and each ``--impl``), as Arrow's integration tests
  do. The writer level is the (impl -> reference) column of that matrix.

This module is the run itself: which cases, in which phase, on how many threads, and
the matrix. The vectors are loaded by ``vectors``, implementations are driven by
``drivers``, each case is judged by ``levels`` and the verdicts are ``results``.
Nothing here keeps global state; one ``Runner`` holds one run's configuration.
"""

from __future__ import annotations

import fnmatch
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .drivers import CommandImpl, ReferenceImpl
from .levels import check_cell, check_invalid, check_valid, encode_case, prepare_spec
from .results import ERROR, LEVELS, PASS, REFERENCE, SKIP, WARN, CaseResult, RunResult
from .vectors import VectorSet, WriterCase


class Runner:
    """One run: implementations, vector sets, levels, selection and parallelism; ``run()``
    returns the ``RunResult`` (reported case by case to ``progress`` as they finish)."""

    def __init__(self, impls: Iterable[CommandImpl | ReferenceImpl], vector_sets: Iterable[VectorSet], *,
                 levels: Iterable[str] = LEVELS, select: Iterable[str] = (), jobs: int | None = None,
                 lenient_codes: bool = False, workdir: str | os.PathLike[str] | None = None,
                 progress: Callable[[CaseResult], object] | None = None):
        self.impls = list(impls)
        self.vector_sets = list(vector_sets)
        self.levels = tuple(levels)
        self.select = tuple(select)
        self.jobs = max(1, jobs or os.cpu_count() or 1)
        self.lenient_codes = lenient_codes
        self.workdir = workdir
        self.progress = progress
        self._progress_lock = threading.Lock()
        self.reference = ReferenceImpl()
        codes = set().union(*(vs.error_codes for vs in self.vector_sets)) if self.vector_sets else set()
        for impl in self.impls:
            if isinstance(impl, CommandImpl):
                impl.codes = codes

    def _selected(self, case_id: str) -> bool:
        return not self.select or any(fnmatch.fnmatchcase(case_id, p) or p in case_id for p in self.select)

    def vectors(self) -> list:
        return [v for vs in self.vector_sets for v in vs.vectors if self._selected(v.id)]

    def writer_cases(self) -> list:
        out = []
        for v in self.vectors():
            w = v.entry.get("writer_case")
            if v.kind == "valid" and w and not v.integrity:
                out.append(WriterCase(v, w.get("form", "file"), w.get("codec", "raw")))
        return out

    # -- helpers -----------------------------------------------------------------------

    def _emit(self, result: CaseResult) -> CaseResult:
        if self.progress is not None:
            with self._progress_lock:  # one line at a time from the worker threads
                self.progress(result)
        return result

    def _pool_map(self, tasks):
        if self.jobs == 1 or len(tasks) <= 1:
            return [t() for t in tasks]
        with ThreadPoolExecutor(self.jobs) as ex:
            return list(ex.map(lambda t: t(), tasks))

    # -- reader level ------------------------------------------------------------------

    def run_reader(self, impl: CommandImpl | ReferenceImpl, work: Path) -> list:
        tasks = []
        for i, v in enumerate(self.vectors()):
            d = work / "reader" / f"{i:04d}"

            def task(v=v, d=d):
                d.mkdir(parents=True, exist_ok=True)
                if v.kind == "valid":
                    return self._emit(check_valid(impl, v, d))
                return self._emit(check_invalid(impl, v, d, lenient_codes=self.lenient_codes))

            tasks.append(task)
        return tasks

    # -- the run: reader level and encodes, then the producer x consumer matrix ---------

    def run(self) -> RunResult:
        t0 = time.perf_counter()
        own_tmp = None
        if self.workdir is None:
            own_tmp = tempfile.TemporaryDirectory(prefix="kvwire-conformance-")
            work = Path(own_tmp.name)
        else:
            work = Path(self.workdir)
            work.mkdir(parents=True, exist_ok=True)
        try:
            return self._run(work, t0)
        finally:
            for impl in self.impls:
                if hasattr(impl, "close"):
                    impl.close()
            if own_tmp is not None:
                own_tmp.cleanup()

    def _run(self, work: Path, t0: float) -> RunResult:
        for impl in self.impls:
            if isinstance(impl, CommandImpl):
                impl.probe()
        seen: dict = {}
        for impl in self.impls:  # unique labels
            n = seen.get(impl.label, 0)
            seen[impl.label] = n + 1
            if n or impl.label == REFERENCE:
                impl.label = f"{impl.label}#{n + 1}"

        # phase 1: reader level, and every producer encodes every writer case
        tasks = []
        if "reader" in self.levels:
            for k, impl in enumerate(self.impls):
                tasks += self.run_reader(impl, work / f"impl{k}")
        wcases = self.writer_cases() if {"writer", "roundtrip"} & set(self.levels) else []
        specs = {case.id: prepare_spec(case, work / "cases" / f"{j:04d}") for j, case in enumerate(wcases)}
        producers = [self.reference] + self.impls
        outputs: dict = {}  # (producer label, case id) -> Path, or (status, message) when it failed

        for pi, prod in enumerate(producers):
            for j, case in enumerate(wcases):
                def encode_task(prod=prod, case=case, d=work / f"produced{pi}" / f"{j:04d}"):
                    outputs[prod.label, case.id] = encode_case(prod, specs[case.id], d)

                tasks.append(encode_task)
        cases = [r for r in self._pool_map(tasks) if r is not None]

        # phase 2: the producer x consumer matrix; (impl -> reference) is the writer level
        cells = []
        for pi, prod in enumerate(producers):
            for ci, cons in enumerate(producers):
                writer_cell = cons is self.reference and prod is not self.reference
                if writer_cell and "writer" not in self.levels:
                    continue
                if not writer_cell and "roundtrip" not in self.levels:
                    continue
                for j, case in enumerate(wcases):
                    def cell_task(prod=prod, cons=cons, case=case, d=work / f"cell{pi}-{ci}" / f"{j:04d}"):
                        res = check_cell(prod, cons, case, outputs.get((prod.label, case.id)), d,
                                         reference=self.reference)
                        if res.level == "writer" or not (prod is self.reference and cons is self.reference):
                            self._emit(res)
                        return res

                    cells.append(cell_task)
        matrix: dict = {}
        for res in self._pool_map(cells):
            m = matrix.setdefault((res.producer, res.consumer), [0, 0])
            m[0] += res.status in (PASS, WARN)
            m[1] += res.status != SKIP
            if res.level == "writer":
                cases.append(res)
            elif res.producer == REFERENCE and res.consumer == REFERENCE:
                if res.status not in (PASS, WARN):  # the kit itself is broken: charge every impl
                    for impl in self.impls:
                        assert impl.label is not None  # named by probe()
                        cases.append(CaseResult("roundtrip", impl.label, res.case, ERROR,
                                                "reference self round trip failed: " + res.message, res.details,
                                                res.seconds, REFERENCE, REFERENCE))
            else:
                for who in dict.fromkeys(x for x in (res.producer, res.consumer) if x != REFERENCE):
                    cases.append(CaseResult("roundtrip", who, res.case, res.status, res.message, res.details,
                                            res.seconds, res.producer, res.consumer))
        order = {lvl: i for i, lvl in enumerate(LEVELS)}
        cases.sort(key=lambda c: (c.impl, order[c.level], c.case))
        return RunResult(
            impls=[i.label for i in self.impls],
            descriptions={i.label: i.describe() for i in self.impls},
            vector_sets=[(vs.version, len(vs.vectors)) for vs in self.vector_sets],
            cases=cases, matrix=matrix, levels=self.levels, lenient_codes=self.lenient_codes,
            seconds=time.perf_counter() - t0)
