"""The implementations a run drives: a command line through the subprocess protocol
(conformance/PROTOCOL.md), or the reference codec in-process.

``CommandImpl`` runs one process per command, or a pool of ``serve`` processes
(``ServeSession``), and turns exit status and stdout into a ``Call``; ``ReferenceImpl``
answers the same calls from the reference codec and is the oracle of the writer and
round-trip levels. Both offer ``validate``, ``decode``, ``reassemble`` and ``encode``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..cache.files import open as kv_open
from ..format.errors import FormatError
from .digests import sha256, tensor_digests
from .neutral import header_to_json
from .results import REFERENCE

_RULE = re.compile(r"KVW-[A-Z]+-[0-9]+")


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
                        "nbytes": len(data), "sha256": sha256(data)})
    return {"header": doc.get("header"), "tensors": tensors, "form": doc.get("form"),
            "chunk_count": doc.get("chunk_count")}


# A serve process's first answer waits this much longer than --timeout: starting an
# interpreter and importing an implementation can take seconds on a loaded machine, and a
# hang must be the command's, never the start-up's.
STARTUP_GRACE = 60.0


class ServeSession:
    """One ``CMD serve`` process answering JSON-line requests (PROTOCOL.md, "serve")."""

    def __init__(self, argv: list, startup_grace: float = STARTUP_GRACE):
        self.startup_grace = startup_grace  # the first answer also waits for the process to start
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
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None and stdout is not None  # opened with stdin=PIPE, stdout=PIPE
        try:
            stdin.write(line)
            stdin.flush()
        except OSError:
            return None
        deadline = time.monotonic() + timeout + (self.startup_grace if self.next_id == 1 else 0.0)
        fd = stdout.fileno()
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
                if f is not None:  # the pipes it was opened with
                    f.close()
            except OSError:
                pass


class CommandImpl:
    """An implementation reached through the subprocess protocol (conformance/PROTOCOL.md).

    One process per command, or, when the implementation's ``info`` lists ``serve`` (and
    ``use_serve`` is true), a pool of long-lived ``serve`` processes: same answers, no
    start-up cost per command. A serve process that hangs or dies is killed and replaced.
    """

    def __init__(self, argv: str | Sequence[str], *, timeout: float = 60.0, label: str | None = None,
                 use_serve: bool = True):
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
        """Ask ``info`` for the name and the supported commands (optional for impls). The
        first process of an implementation: its answer gets the start-up grace too."""
        call = self._run(["info"], expect_code=False, serve=False, timeout=self.timeout + STARTUP_GRACE)
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
                result = {"header": header_to_json(cache.header), "tensors": tensor_digests(cache),
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
        result = {"header": header_to_json(cache.header), "tensors": tensor_digests(cache), "form": "segments"}
        return Call("ok", seconds=time.perf_counter() - t0, result=result)

    def encode(self, spec: Path, out: Path, work: Path) -> Call:
        from ..cache.encoder import encode_bytes
        from .impl import read_encode_spec

        t0 = time.perf_counter()
        cache, form, codec = read_encode_spec(str(spec))
        Path(out).write_bytes(encode_bytes(cache, form=form, codec=codec))
        return Call("ok", seconds=time.perf_counter() - t0)


def default_impl_argv() -> list:
    """The reference implementation of the protocol, run as a subprocess."""
    pkg = __package__.rsplit(".", 1)[0]  # kvwire, or the name it is vendored under
    return [sys.executable, "-m", pkg, "conformance", "impl"]
