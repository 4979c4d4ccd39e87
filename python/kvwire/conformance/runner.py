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

Nothing here keeps global state; one ``Runner`` holds one run's configuration.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..format.errors import FormatError
from ..cache.reader import open as kv_open
from . import neutral as N

LEVELS = ("reader", "writer", "roundtrip")
PASS, WARN, FAIL, ERROR, SKIP = "pass", "warn", "fail", "error", "skip"
_RANK = {PASS: 0, SKIP: 1, WARN: 2, FAIL: 3, ERROR: 4}
_RULE = re.compile(r"KVW-[A-Z]+-[0-9]+")
REFERENCE = "reference"


# ---------------------------------------------------------------------------------------
# Vectors
# ---------------------------------------------------------------------------------------

@dataclass
class Vector:
    version: str
    name: str
    path: Path
    entry: dict
    twin: dict | None = None
    regression: bool = False
    integrity: list = field(default_factory=list)  # problems with the committed files

    @property
    def id(self) -> str:
        return f"{self.version}/{self.name}"

    @property
    def kind(self) -> str:
        return self.entry["kind"]

    def allowed_codes(self) -> set | None:
        """Codes that count as the right rejection; None means any registry code."""
        if self.entry.get("code_policy") == "any":
            return None
        return {self.entry["expected_code"], *self.entry.get("also_allowed", {})}


@dataclass
class VectorSet:
    version: str
    root: Path
    manifest: dict
    vectors: list

    @property
    def error_codes(self) -> set:
        return set(self.manifest.get("error_codes", ()))


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _load_entries(root: Path, version: str, manifest_path: Path, regression: bool) -> list:
    with open(manifest_path) as f:
        manifest = json.load(f)
    out = []
    for e in manifest.get("vectors", []):
        base = manifest_path.parent
        v = Vector(version, e["name"], base / e["file"], e, regression=regression)
        if not v.path.is_file():
            v.integrity.append(f"missing file {e['file']}")
        elif _sha256_file(v.path) != e["sha256"]:
            v.integrity.append(f"{e['file']}: sha256 differs from the manifest (file modified?)")
        if e.get("twin"):
            tp = base / e["twin"]
            if not tp.is_file():
                v.integrity.append(f"missing twin {e['twin']}")
            else:
                if _sha256_file(tp) != e["twin_sha256"]:
                    v.integrity.append(f"{e['twin']}: sha256 differs from the manifest")
                with open(tp) as f:
                    v.twin = json.load(f)
        out.append(v)
    return out


def load_vector_set(version_dir: Path) -> VectorSet:
    version_dir = Path(version_dir)
    with open(version_dir / "manifest.json") as f:
        manifest = json.load(f)
    version = manifest.get("format_version", version_dir.name)
    vectors = _load_entries(version_dir, version, version_dir / "manifest.json", False)
    reg = manifest.get("regressions")
    if reg and (version_dir / reg).is_file():
        vectors += _load_entries(version_dir, version, version_dir / reg, True)
    return VectorSet(version, version_dir, manifest, vectors)


def _version_key(name: str):
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"[.]", name))


def load_vector_sets(path) -> list[VectorSet]:
    """One version folder (holding manifest.json) or a folder of version folders."""
    path = Path(path)
    if (path / "manifest.json").is_file():
        return [load_vector_set(path)]
    dirs = sorted((d for d in path.iterdir() if (d / "manifest.json").is_file()), key=lambda d: _version_key(d.name))
    if not dirs:
        raise FileNotFoundError(f"{path}: no manifest.json here or in a version folder below")
    return [load_vector_set(d) for d in dirs]


def find_vectors_root(start=None) -> Path | None:
    """conformance/vectors of the source tree: above ``start`` (default: the working
    directory), else above this package (an editable install in a checkout)."""
    for base in (Path(start or os.getcwd()).resolve(), Path(__file__).resolve()):
        for d in (base, *base.parents):
            cand = d / "conformance" / "vectors"
            if cand.is_dir():
                return cand
    return None


# ---------------------------------------------------------------------------------------
# Implementations
# ---------------------------------------------------------------------------------------

@dataclass
class Call:
    """Outcome of one protocol command."""

    status: str  # "ok" | "rejected" | "unsupported" | "error" | "timeout"
    code: str | None = None
    rule: str | None = None
    detail: str = ""
    seconds: float = 0.0
    result: dict | None = None  # decode: {"header", "tensors", "form", "chunk_count"}

    def describe(self) -> str:
        if self.status == "rejected":
            return f"rejected with {self.code}" + (f" [{self.rule}]" if self.rule else "")
        if self.status == "ok":
            return "accepted"
        return f"{self.status}: {self.detail}" if self.detail else self.status


def _tail(text: str, n: int = 600) -> str:
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]


def read_decoded(out_dir: Path) -> dict:
    """The decode output of a protocol implementation, with tensor digests computed."""
    with open(out_dir / "decoded.json") as f:
        doc = json.load(f)
    tensors = []
    for t in doc.get("tensors", []):
        p = out_dir / t["file"]
        data = p.read_bytes()
        tensors.append({"layer": t.get("layer"), "component": t.get("component"), "shape": t.get("shape"),
                        "nbytes": len(data), "sha256": N.sha256(data)})
    return {"header": doc.get("header"), "tensors": tensors, "form": doc.get("form"),
            "chunk_count": doc.get("chunk_count")}


class ServeSession:
    """One ``CMD serve`` process answering JSON-line requests (PROTOCOL.md, "serve")."""

    def __init__(self, argv: list):
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(argv + ["serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr)
        self.buf = b""
        self.next_id = 0

    def request(self, args: list, timeout: float):
        """(exit, stdout, stderr) of one command, or None when the process hangs or dies."""
        import selectors

        self.next_id += 1
        line = json.dumps({"id": self.next_id, "args": [str(a) for a in args]}).encode() + b"\n"
        try:
            self.proc.stdin.write(line)
            self.proc.stdin.flush()
        except OSError:
            return None
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self.buf:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    return None
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return None
                self.buf += chunk
        answer, self.buf = self.buf.split(b"\n", 1)
        try:
            msg = json.loads(answer)
            if msg.get("id") != self.next_id:
                return None
            return int(msg["exit"]), str(msg.get("stdout", "")), str(msg.get("stderr", ""))
        except (ValueError, KeyError, TypeError):
            return None

    def diagnostics(self) -> str:
        try:
            self.stderr.seek(0)
            return self.stderr.read()[-2000:].decode("utf-8", "replace")
        except (OSError, ValueError):
            return ""

    def close(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.stderr):
            try:
                f.close()
            except OSError:
                pass


class CommandImpl:
    """An implementation reached through the subprocess protocol (conformance/PROTOCOL.md).

    One process per command, or, when the implementation's ``info`` lists ``serve`` (and
    ``use_serve`` is true), a pool of long-lived ``serve`` processes: same answers, no
    start-up cost per command. A serve process that hangs or dies is killed and replaced.
    """

    def __init__(self, argv, *, timeout: float = 60.0, label: str | None = None, use_serve: bool = True):
        import queue

        self.argv = shlex.split(argv) if isinstance(argv, str) else list(argv)
        self.timeout = timeout
        self.label = label
        self.use_serve = use_serve
        self.commands: set | None = None  # None: unknown (no `info`), try everything
        self.info: dict = {}
        self.codes: set = set()
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._sessions: list = []

    @property
    def serving(self) -> bool:
        return self.use_serve and os.name == "posix" and self.commands is not None and "serve" in self.commands

    def describe(self) -> str:
        return shlex.join(self.argv) + (" (serve)" if self.serving else "")

    def probe(self) -> None:
        """Ask ``info`` for the name and the supported commands (optional for impls)."""
        call = self._run(["info"], expect_code=False, serve=False)
        if call.status == "ok":
            try:
                self.info = json.loads(call.detail)
                if "commands" in self.info:
                    self.commands = set(self.info["commands"])
            except (ValueError, TypeError, AttributeError):
                self.info = {}
        if self.label is None:
            self.label = str(self.info.get("name") or Path(self.argv[0]).name)

    def supports(self, command: str) -> bool:
        return self.commands is None or command in self.commands

    def close(self) -> None:
        for s in self._sessions:
            s.close()
        self._sessions.clear()

    def _exec(self, args: list, timeout: float, serve: bool):
        """(exit status or None on timeout, stdout, stderr)."""
        if serve and self.serving:
            try:
                session = self._idle.get_nowait()
            except Exception:  # queue.Empty
                session = ServeSession(self.argv)
                self._sessions.append(session)
            answer = session.request(args, timeout)
            if answer is not None:
                self._idle.put(session)
                return answer
            alive = session.proc.poll() is None
            diag = session.diagnostics()
            session.close()
            if alive:
                return None, "", diag
            return -9999, "", "the serve process died; stderr: " + diag
        try:
            p = subprocess.run(self.argv + [str(a) for a in args], capture_output=True, timeout=timeout,
                               stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return None, "", ""
        return p.returncode, p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace")

    def _run(self, args, *, expect_code: bool = True, timeout: float | None = None, serve: bool = True) -> Call:
        t0 = time.perf_counter()
        try:
            rc, out, err = self._exec(list(args), self.timeout if timeout is None else timeout, serve)
        except OSError as exc:
            return Call("error", detail=f"cannot run {self.describe()}: {exc}", seconds=time.perf_counter() - t0)
        dt = time.perf_counter() - t0
        if rc is None:
            return Call("timeout", detail=f"no answer within {self.timeout:g} s (hang?)", seconds=dt)
        if rc == 0:
            return Call("ok", detail=out.strip() if not expect_code else "", seconds=dt)
        if rc == 1 and expect_code:
            for line in out.splitlines():
                tokens = line.split()
                if tokens and tokens[0] in self.codes:
                    m = _RULE.search(line)
                    return Call("rejected", tokens[0], m.group(0) if m else None, seconds=dt)
            return Call("error", detail="exit 1 without a registry error code on stdout; stderr: "
                        + _tail(err or out), seconds=dt)
        if rc == 2 and self.commands is None:
            return Call("unsupported", detail=_tail(err), seconds=dt)
        how = "the serve process died" if rc == -9999 else (
            f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}")
        return Call("error", detail=f"{how}; stderr: {_tail(err or out)}", seconds=dt)

    def validate(self, path: Path, work: Path) -> Call:
        if not self.supports("validate"):
            return Call("unsupported", detail="validate not listed by info")
        return self._run(["validate", path])

    def decode(self, path: Path, work: Path, command: str = "decode") -> Call:
        if not self.supports(command):
            return Call("unsupported", detail=f"{command} not listed by info")
        out = work / "decoded"
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        call = self._run([command, path, out])
        if call.status == "ok":
            try:
                call.result = read_decoded(out)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                return Call("error", detail=f"unreadable decode output in {out}: {exc}", seconds=call.seconds)
        return call

    def reassemble(self, path: Path, work: Path) -> Call:
        return self.decode(path, work, "reassemble")

    def encode(self, spec: Path, out: Path, work: Path) -> Call:
        return self._run(["encode", spec, out])


class ReferenceImpl:
    """The reference codec in-process: the oracle of the writer and round-trip levels."""

    label = REFERENCE
    commands = None

    def describe(self) -> str:
        return "kvwire reference codec (in-process)"

    def supports(self, command: str) -> bool:
        return True

    def validate(self, path: Path, work: Path) -> Call:
        t0 = time.perf_counter()
        try:
            with kv_open(str(path)) as r:
                r.validate()
        except FormatError as exc:
            return Call("rejected", exc.code, exc.rule, seconds=time.perf_counter() - t0)
        return Call("ok", seconds=time.perf_counter() - t0)

    def decode(self, path: Path, work: Path) -> Call:
        t0 = time.perf_counter()
        try:
            with kv_open(str(path)) as r:
                r.validate()
                cache = r.load()
                result = {"header": N.header_to_json(cache.header), "tensors": N.tensor_digests(cache),
                          "form": r.form, "chunk_count": r.chunk_count}
        except FormatError as exc:
            return Call("rejected", exc.code, exc.rule, seconds=time.perf_counter() - t0)
        return Call("ok", seconds=time.perf_counter() - t0, result=result)

    def reassemble(self, path: Path, work: Path) -> Call:
        from .impl import reassemble_file

        t0 = time.perf_counter()
        try:
            cache, segments = reassemble_file(str(path))
        except FormatError as exc:
            return Call("rejected", exc.code, exc.rule, seconds=time.perf_counter() - t0)
        result = {"header": N.header_to_json(cache.header), "tensors": N.tensor_digests(cache), "form": "segments"}
        return Call("ok", seconds=time.perf_counter() - t0, result=result)

    def encode(self, spec: Path, out: Path, work: Path) -> Call:
        from .impl import read_encode_spec
        from ..cache.encoder import encode

        t0 = time.perf_counter()
        cache, form, codec = read_encode_spec(str(spec))
        Path(out).write_bytes(encode(cache, form=form, codec=codec))
        return Call("ok", seconds=time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------

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


def _worst(*statuses: str) -> str:
    return max(statuses, key=_RANK.__getitem__)


@dataclass
class RunResult:
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


# ---------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------

@dataclass
class WriterCase:
    vector: Vector
    form: str
    codec: str

    @property
    def id(self) -> str:
        return self.vector.id


class Runner:
    def __init__(self, impls, vector_sets, *, levels=LEVELS, select=(), jobs: int | None = None,
                 lenient_codes: bool = False, workdir=None, progress=None):
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

    def _check_valid(self, impl, v: Vector, work: Path) -> CaseResult:
        res = CaseResult("reader", impl.label, v.id, PASS)
        if v.integrity:
            return CaseResult("reader", impl.label, v.id, ERROR, "vector integrity: " + "; ".join(v.integrity))
        if v.entry.get("input") == "segments":
            dec = impl.reassemble(v.path, work)
            val = Call("ok")
        else:
            dec = impl.decode(v.path, work)
            val = impl.validate(v.path, work)
        res.seconds = dec.seconds + val.seconds
        problems, notes = [], []
        if dec.status == "unsupported" or val.status == "unsupported":
            return CaseResult("reader", impl.label, v.id, SKIP, "command not supported: " + (dec.detail or val.detail))
        if dec.status != "ok":
            res.status = ERROR if dec.status in ("error", "timeout") else FAIL
            problems.append(f"decode: {dec.describe()} (valid vector)")
        else:
            errs, notes = N.compare_header(v.twin["header"], dec.result.get("header"), ignore=())
            errs += N.compare_tensors(v.twin["tensors"], dec.result.get("tensors") or [])
            if errs:
                res.status = FAIL
                problems += ["decode: " + e for e in errs]
        if val.status != "ok":
            res.status = _worst(res.status, ERROR if val.status in ("error", "timeout") else FAIL)
            problems.append(f"validate: {val.describe()} (valid vector)")
        res.message = problems[0] if problems else "decoded header and tensors match the twin; validate accepts"
        res.details = problems + [f"note: {n}" for n in notes]
        return res

    def _judge_rejection(self, v: Vector, call: Call, what: str) -> tuple[str, str]:
        allowed = v.allowed_codes()
        if call.status == "unsupported":
            return SKIP, f"{what} not supported"
        if call.status == "ok":
            return FAIL, f"{what}: accepted an invalid vector (expected {v.entry.get('expected_code')})"
        if call.status in ("error", "timeout"):
            return ERROR, f"{what}: {call.describe()}"
        if allowed is None or call.code in allowed:
            return PASS, f"{what}: {call.describe()}"
        status = WARN if self.lenient_codes else FAIL
        return status, (f"{what}: rejected, wrong code: {call.code}, expected {v.entry['expected_code']}"
                        + (f" (or {', '.join(sorted(allowed - {v.entry['expected_code']}))})"
                           if len(allowed) > 1 else ""))

    def _check_invalid(self, impl, v: Vector, work: Path) -> CaseResult:
        if v.integrity:
            return CaseResult("reader", impl.label, v.id, ERROR, "vector integrity: " + "; ".join(v.integrity))
        if v.entry.get("input") == "segments":
            dec = impl.reassemble(v.path, work)
            s1, m1 = s2, m2 = self._judge_rejection(v, dec, "reassemble")
            val = Call("skipped")
        else:
            val = impl.validate(v.path, work)
            dec = impl.decode(v.path, work)
            s1, m1 = self._judge_rejection(v, val, "validate")
            s2, m2 = self._judge_rejection(v, dec, "decode")
        status = _worst(s1, s2)
        if {s1, s2} == {SKIP}:
            status = SKIP
        elif SKIP in (s1, s2):
            status = _worst(*(s for s in (s1, s2) if s != SKIP))
        msgs = [m for s, m in ((s1, m1), (s2, m2)) if s != PASS] or [m1]
        details = list(dict.fromkeys([m1, m2]))
        exp_rule = v.entry.get("rule")
        for c in (val, dec):
            if c.status == "rejected" and c.rule and exp_rule and c.rule != exp_rule:
                details.append(f"note: reported rule {c.rule}, vector violates {exp_rule}")
        return CaseResult("reader", impl.label, v.id, status, msgs[0], details, val.seconds + dec.seconds)

    def run_reader(self, impl, work: Path) -> list:
        tasks = []
        for i, v in enumerate(self.vectors()):
            d = work / "reader" / f"{i:04d}"

            def task(v=v, d=d):
                d.mkdir(parents=True, exist_ok=True)
                check = self._check_valid if v.kind == "valid" else self._check_invalid
                return self._emit(check(impl, v, d))

            tasks.append(task)
        return tasks

    # -- writer and round-trip levels --------------------------------------------------

    def _prepare_spec(self, case: WriterCase, d: Path) -> Path:
        """spec.json + raw tensors of a writer case, decoded from its vector by the reference."""
        d.mkdir(parents=True, exist_ok=True)
        with kv_open(str(case.vector.path)) as r:
            r.validate()
            cache = r.load()
        tensors = []
        for i, comp, x in N.cache_tensors(cache):
            name = N.tensor_file_name(i, comp)
            (d / name).write_bytes(N.canonical_bytes(x))
            tensors.append({"layer": i, "component": comp, "shape": list(x.shape), "file": name})
        spec = {"format": N.ENCODE_SPEC_FORMAT, "version": N.MODEL_JSON_VERSION, "form": case.form,
                "codec": case.codec, "header": case.vector.twin["header"], "tensors": tensors}
        path = d / "spec.json"
        path.write_text(json.dumps(spec, indent=1))
        return path

    def _check_output(self, consumer, case: WriterCase, produced: Path, work: Path) -> tuple[str, str, list]:
        dec = consumer.decode(produced, work)
        if dec.status == "unsupported":
            return SKIP, "decode not supported", []
        if dec.status != "ok":
            return (ERROR if dec.status in ("error", "timeout") else FAIL), f"decode: {dec.describe()}", []
        errs, notes = N.compare_header(case.vector.twin["header"], dec.result.get("header"))
        errs += N.compare_tensors(case.vector.twin["tensors"], dec.result.get("tensors") or [])
        if dec.result.get("form") not in (None, case.form):
            errs.append(f"form: {dec.result.get('form')}, {case.form} was requested")
        if errs:
            return FAIL, errs[0], errs + [f"note: {n}" for n in notes]
        return PASS, "decoded header and tensors match the case", [f"note: {n}" for n in notes]

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
        specs = {case.id: self._prepare_spec(case, work / "cases" / f"{j:04d}") for j, case in enumerate(wcases)}
        producers = [self.reference] + self.impls
        outputs: dict = {}  # (producer label, case id) -> Path, or (status, message) when it failed

        for pi, prod in enumerate(producers):
            for j, case in enumerate(wcases):
                def encode_task(prod=prod, case=case, d=work / f"produced{pi}" / f"{j:04d}"):
                    outputs[prod.label, case.id] = self._encode(prod, specs[case.id], d)

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
                        res = self._cell(prod, cons, case, outputs.get((prod.label, case.id)), d)
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

    def _encode(self, prod, spec: Path, d: Path):
        d.mkdir(parents=True, exist_ok=True)
        out = d / "out.kvw"
        if not prod.supports("encode"):
            return SKIP, "encode not supported"
        try:
            call = prod.encode(spec, out, d)
        except Exception as exc:  # the in-process reference writer failing: a bug of the kit
            call = Call("error", detail=f"{type(exc).__name__}: {exc}")
        if call.status == "ok":
            return out if out.is_file() else (FAIL, "encode: exit 0 but no output file")
        if call.status == "unsupported":
            return SKIP, "encode not supported"
        return (ERROR if call.status in ("error", "timeout") else FAIL), f"encode: {call.describe()}"

    def _cell(self, prod, cons, case: WriterCase, produced, d: Path) -> CaseResult:
        writer = cons is self.reference and prod is not self.reference
        level = "writer" if writer else "roundtrip"
        name = case.id if writer else f"{case.id} [{prod.label} -> {cons.label}]"
        res = CaseResult(level, prod.label if writer else cons.label, name, PASS, producer=prod.label,
                         consumer=cons.label)
        if produced is None or isinstance(produced, tuple):
            status, msg = produced or (ERROR, "no output")
            if writer:
                res.status, res.message = status, msg
            else:  # counted once, at the producer's writer level
                res.status, res.message = SKIP, f"producer {prod.label} has no output ({msg})"
            return res
        d.mkdir(parents=True, exist_ok=True)
        try:
            res.status, res.message, res.details = self._check_output(cons, case, produced, d)
        except Exception as exc:  # a consumer's decode output the kit cannot read
            res.status, res.message = ERROR, f"{type(exc).__name__}: {exc}"
        if writer and res.status == FAIL and res.message.startswith("decode: rejected"):
            res.message = "the reference reader " + res.message[len("decode: "):] + " (KVW-WRITE-1)"
        return res


def default_impl_argv() -> list:
    """The reference implementation of the protocol, run as a subprocess."""
    pkg = __package__.rsplit(".", 1)[0]  # kvwire, or the name it is vendored under
    return [sys.executable, "-m", pkg, "conformance", "impl"]
