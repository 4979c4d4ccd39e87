"""The receiver of the cross-model suite: the fresh process that takes every cache.

``worker_main`` is the process itself, run as ``python -m <this module> worker JOBS RESULTS
[MODEL_TYPE...]`` (``python -m kvwire.conformance.crossmodel_receiver`` in this checkout):
it builds its own models from the same seeds as the producer, checks compatibility from
each header, loads, converts back (``adapters.hf.to_hf``) and continues generation. Jobs
and results are JSON, logits raw little-endian float32 files; nothing is pickled.
``Receiver`` is the producer's handle on that process: started early so its
torch/transformers import overlaps the producer's work, told "go" once the jobs are
written. ``subprocess_env`` makes the package importable in it (vendored copies too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from ..model.compat import check_compatible
from .generation import MissingDependency, greedy, hf_modules, quiet_torch, verdict_json

OTHER_SEED = 1  # the receiver builds every model from seed 0 and from this one


def _receiver_model(models: dict, model_type: str, seed: int):
    """(model, LocalModel) built by the receiver itself from the seed, once per process."""
    if (model_type, seed) not in models:
        hf, zoo = hf_modules()
        model = zoo.build(model_type, seed)
        models[model_type, seed] = (model, hf.local_model(model, zoo.tokenizer(model.config.vocab_size)))
    return models[model_type, seed]


def _receive(job: dict, models: dict, root: Path) -> dict:
    """One job: verdict from the header; for ``continue`` jobs load, convert, generate."""
    from ..cache.files import open as kv_open

    hf, _ = hf_modules()
    model, local = _receiver_model(models, job["model_type"], job["seed"])
    if job.get("local"):  # what this receiver accepts beyond its own model (soft tier)
        opts = dict(job["local"])
        if "accept_casts" in opts:
            opts["accept_casts"] = frozenset(opts["accept_casts"])
        local = dataclasses.replace(local, **opts)
    out: dict = {}
    with kv_open(root / job["file"]) as r:
        out["verdict"] = verdict_json(check_compatible(r.header, local))
        if not job.get("steps"):
            return out
        if not out["verdict"]["ok"]:
            out["error"] = "the receiver refused the cache: " + "; ".join(out["verdict"]["reasons"])
            return out
        cache = r.load()
    tokens, logits = greedy(model, hf.to_hf(cache, model), job["first_token"], job["steps"])
    name = job["id"].replace("/", ".") + ".logits.f32"
    (root / name).write_bytes(logits.astype("<f4").tobytes())
    out.update(tokens=tokens, logits=name, shape=list(logits.shape))
    return out


def worker_main(argv) -> int:
    """``worker JOBS.json RESULTS.json [MODEL_TYPE...]``: run every job, one result (or error) each.

    With model types, the receiver is started before the producer has written anything: it
    imports torch and transformers and builds those models (both seeds) meanwhile, then
    waits for "go" on stdin before it reads JOBS.json. It still shares nothing with the
    producer but the files.
    """
    if len(argv) < 3 or argv[0] != "worker":
        print("usage: python -m kvwire.conformance.crossmodel_receiver worker JOBS.json RESULTS.json [MODEL_TYPE...]",
              file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    jobs_path, results_path, prebuild = Path(argv[1]), Path(argv[2]), argv[3:]
    spec = None if prebuild else json.loads(jobs_path.read_text())  # before the slow imports
    try:
        hf_modules()
    except MissingDependency as exc:
        print(exc, file=sys.stderr)
        return 3
    results: dict = {}
    models: dict = {}
    with quiet_torch():
        for mt in prebuild:
            for seed in (0, OTHER_SEED):
                with contextlib.suppress(Exception):  # a failing build fails its jobs, with the reason
                    _receiver_model(models, mt, seed)
        if prebuild and sys.stdin.readline().strip() != "go":
            return 4  # the producer gave up: nothing to receive
        spec = spec or json.loads(jobs_path.read_text())
        for job in spec["jobs"]:
            t = time.perf_counter()
            try:
                res = _receive(job, models, jobs_path.parent)
            except Exception as exc:  # a broken adapter must fail its cell, not the suite
                res = {"error": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc(limit=-4)}
            res["seconds"] = time.perf_counter() - t
            results[job["id"]] = res
    results_path.write_text(json.dumps({"results": results, "pid": os.getpid(), "seconds": time.perf_counter() - t0}))
    return 0


def _worker_argv() -> list:
    return [sys.executable, "-m", __name__]


def subprocess_env() -> dict:
    """The environment of the receiver: the package importable (vendored copies too)."""
    env = dict(os.environ)
    top = Path(__file__).resolve().parents[len(__name__.split(".")) - 1]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(top), env.get("PYTHONPATH", "")) if p)
    return env


class Receiver:
    """The receiver process. Started with ``prebuild`` model types, it imports and builds
    while the producer works (2 cores: both run at once) and reads the jobs on ``finish``."""

    def __init__(self, root: Path, prebuild=()):
        self.root = root
        self.log = open(root / "receiver.log", "w+b")
        argv = _worker_argv() + ["worker", str(root / "jobs.json"), str(root / "results.json"), *prebuild]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=subprocess_env())

    def finish(self, timeout: float, *, go: bool = True) -> tuple[dict, str]:
        """(results by job id, "" or why the receiver failed as a whole)."""
        stdin = self.proc.stdin
        assert stdin is not None  # opened with stdin=PIPE
        with contextlib.suppress(OSError):  # it may have exited already: its status says why
            if go:
                stdin.write(b"go\n")
            stdin.close()
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.close()
            return {}, f"receiver process timed out after {timeout:.0f} s"
        self.log.seek(0)
        tail = self.log.read().decode("utf-8", "replace").strip()[-800:]
        self.log.close()
        if rc != 0:
            return {}, f"receiver process exited {rc}: {tail}"
        try:
            return json.loads((self.root / "results.json").read_text())["results"], ""
        except (OSError, ValueError, KeyError) as exc:
            return {}, f"receiver process wrote no readable results: {exc}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:  # opened with stdin=PIPE
                self.proc.stdin.close()
        self.log.close()


def run_worker(root: Path, timeout: float) -> tuple[dict, str]:
    """Receive the jobs already in ``root`` in a new process."""
    return Receiver(root).finish(timeout, go=False)


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
