"""Putting chunks into layer tensors (``Reader.layer``, ``Reader.load``), on several threads
when libkvwire is enabled.

Why a module of its own: assembling is where a load spends its time (a checksum and a
copy per raw chunk, a decode and a copy per compressed one), and the fast way differs from
the simple one. A chunk [heads, tokens, dim] goes to a token slice of a [heads, layer
tokens, dim] tensor: ``heads`` contiguous runs at a stride. numpy's strided assignment
holds the GIL, so threads over it only contend (measured 0.7x of one thread). With native
decoding on (``kvwire.codecs.native``), every step of a chunk releases the GIL: the
checksum (xxhash-python, bodies over 64 KiB), the decode with every head straight into its
token slice (``native.decode_heads``), and the checked copy of raw runs (``native.copy_runs``). Chunks are then
handed to ``threads`` workers (the caller being one) that take the next chunk from a
shared counter: per-chunk futures cost more than small chunks take (measured: a
ThreadPoolExecutor future per chunk made two threads slower than one).

Without native decoding, or for a destination whose runs are not contiguous, the numpy
path of one thread is kept: it is the reference, and the one that takes any layout.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

from ..codecs import native
from ..format import registry as R
from ..format.errors import ChecksumError
from .args import check_count
from .tensors import as_numpy, as_uint, copy_raw, is_torch

MAX_THREADS = 8


def resolve_threads(threads) -> int:
    """The number of threads a load uses: ``threads`` itself (>= 1), or for None the CPUs
    this process may run on (at most ``MAX_THREADS``) when native decoding is on, else 1."""
    if threads is None:
        if not native.available():
            return 1
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
        return max(1, min(cpus, MAX_THREADS))
    n = check_count("threads", threads)
    if n < 1:
        raise ValueError("threads must be at least 1 (None: one per CPU when native decoding is on)")
    return n


def body_checksum_error(i: int, layer: int) -> ChecksumError:
    """KVW-CSUM-1 for chunk ``i`` of ``layer``: the one message of the reader and of the
    native copy that hashes as it places."""
    return ChecksumError("BODY_CHECKSUM", f"chunk {i} (layer {layer}) body checksum mismatch", rule="KVW-CSUM-1")


def runs_contiguous(host: np.ndarray) -> bool:
    """True when every head of a token slice of ``host`` [heads, tokens, dim] is one
    contiguous run (dim and token strides dense; any head stride)."""
    s0, s1, s2 = host.strides
    w = host.dtype.itemsize
    return s2 == w and s1 == host.shape[2] * w and s0 >= 0


def fill_layer(reader, layer: int, out: dict, verify: bool, jobs: list | None) -> None:
    """Chunks of ``layer`` into the tensors of ``out`` (shapes checked by the caller). With
    ``jobs`` a list, chunks the native path takes are appended to it as work for ``run``
    instead of being copied here; everything else is done now, in chunk order."""
    h = reader.header
    spec, r = h.arch.layers[layer], h.layer_tokens[layer]
    for comp in spec.components:
        dst = out[comp]
        on_host = not is_torch(dst) or dst.device.type == "cpu"
        host_u = as_uint(as_numpy(dst)) if on_host else None
        base = int(reader.grid.base[layer, R.COMPONENTS[comp]])
        fast = jobs if jobs is not None and host_u is not None and runs_contiguous(host_u) else None  # native work
        for j in range(reader.num_chunks(layer, comp)):
            i = int(reader.slot_records[base + j])
            a = reader.info(i).token_start - r.start
            if fast is not None:
                fast.append((i, host_u, a))
            elif host_u is not None:
                _numpy_one(reader, i, host_u, a, verify)
            else:
                src = reader.decode(i, verify, "torch")
                dst[:, a : a + src.shape[1], :].copy_(src)


def _one(reader, job, verify: bool) -> None:
    """One chunk of ``fill_layer``'s jobs, every step with the GIL released."""
    i, host_u, a = job
    c = reader.info(i)
    raw = c.codec == "raw"
    c, stored = reader.stored(i, verify and not raw)  # raw bodies: hashed while copied, below
    region = host_u[:, a : a + c.token_count, :]
    run = c.token_count * host_u.shape[2] * host_u.dtype.itemsize
    addr, stride = region.ctypes.data, host_u.strides[0]
    if not c.raw_length:
        return
    if raw:
        try:
            native.copy_runs(np.frombuffer(stored, np.uint8).ctypes.data, c.raw_length, addr, run, stride,
                             checksum=c.checksum if verify else None)
        except ChecksumError:  # libkvwire does not know the chunk: the reader's words, which chunk of which layer
            raise body_checksum_error(i, c.layer) from None
        return
    h = reader.header
    spec = int(reader.records["reserved0"][i]) if h.codec_specs else 0
    rec = native.record(h, c.codec, spec, c.stored_length, c.raw_length, c.shape, c.layer, c.token_start)
    if region.flags.c_contiguous:  # one head, or the chunk spans the layer: decode in place
        native.decode_wire(h, rec, stored, region)
        return
    # each head straight into its token slice (the lossy decoders write there; zstd and
    # byteplane bodies are decoded whole in C and their heads copied out)
    if not native.decode_heads(h, rec, stored, addr, (region.shape[0] - 1) * stride + run, stride):
        _numpy_one(reader, i, host_u, a, verify)  # native switched off meanwhile: nothing was written


def run(reader, jobs: list | None, verify: bool, threads: int) -> None:
    """Do ``jobs`` on ``threads`` threads (the caller's among them). On failure, every
    worker stops at its next chunk and the error of the lowest chunk index met is raised;
    the destinations then hold partial data, as after a failing serial load."""
    if not jobs:
        return
    if threads <= 1 or len(jobs) < 2 or not native.takes(reader.header):
        if native.takes(reader.header):
            for job in jobs:
                _one(reader, job, verify)
        else:  # native switched off since planning: the numpy path
            for i, host_u, a in jobs:
                _numpy_one(reader, i, host_u, a, verify)
        return
    reader.info(0)  # the record table as Python values, built once before the workers
    lock = threading.Lock()
    state: dict[str, Any] = {"next": 0, "errors": []}

    def work():
        while True:
            with lock:
                k = state["next"]
                if k >= len(jobs) or state["errors"]:
                    return
                state["next"] = k + 1
            try:
                _one(reader, jobs[k], verify)
            except Exception as e:  # noqa: BLE001 -- re-raised by the caller below
                with lock:
                    state["errors"].append((jobs[k][0], e))
                return

    n = min(threads, len(jobs))
    futures = [native.pool(n - 1).submit(work) for _ in range(n - 1)]
    work()
    for f in futures:
        f.result()
    if state["errors"]:
        raise min(state["errors"], key=lambda x: x[0])[1]


def _numpy_one(reader, i: int, host_u, a: int, verify: bool) -> None:
    """Chunk ``i`` into ``host_u`` at token ``a`` by the numpy reference path, one thread."""
    c = reader.info(i)
    if reader.header.codec_specs and reader.records["reserved0"][i]:
        _, stored = reader.stored(i, verify)
        reader.decode_stored(i, c, stored, out=host_u[:, a : a + c.token_count, :])
    elif c.codec == "raw":
        copy_raw(reader, i, verify, host_u, a)
    else:
        src = reader.decode(i, verify, "numpy", scratch=True)
        host_u[:, a : a + src.shape[1], :] = as_uint(src)
