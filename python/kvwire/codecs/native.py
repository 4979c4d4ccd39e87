"""Native decoding of chunk bodies (and lossy encoding) through libkvwire (c/), on by default.

Why: the numpy codecs are the reference, but they decode at about 0.2-1.0 GB/s on one
core; libkvwire's codecs (the same spec, held to the same conformance kit, byte-identical
outputs) run at 1.2-3.6 GB/s, and ctypes releases the GIL for each call, so threads
decode distinct chunks in parallel. A wheel built with a C compiler carries the library
beside this module (setup.py); a checkout uses ``build/c/libkvwire.so`` (``make c``).

- unset (or ``KVWIRE_NATIVE=1``): that library when it is there, else numpy;
- ``KVWIRE_NATIVE=0``: numpy only;
- ``KVWIRE_NATIVE=/path/to/libkvwire.so``: that library;
- ``enable(path=None)`` / ``disable()`` at run time; ``available()`` says whether it is on,
  ``status()`` which path is active and why (``kvwire --version`` prints it).

A library that is there but cannot be loaded (another platform's, a stale build, a missing
libzstd) is one ``RuntimeWarning`` at import and the numpy path, never an exception: the
package works without it. A header is handed to C once (its reference encoding, parsed and
checked by ``kvw_header_new``) and the handle cached per Header object; an error of
libkvwire becomes the ``FormatError`` subclass of the same registry code and rule as the
numpy path's.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from ..format import errors as E
from ..format.container import RECORD_STRUCT
from .native_lib import ENV, KvwError, default_path, load_library, missing_reason

if TYPE_CHECKING:
    from ..format.header import Header

CODECS = {"raw": 0, "zstd": 1, "byteplane_zstd": 2, "fp8": 3, "int_affine": 4}
_RECORD = RECORD_STRUCT  # a ChunkRecord (spec 8.1, 56 bytes), as the container module defines it
_ERR_INVALID_ARGUMENT = 1000

# Registry code -> the class the numpy path raises it with (FormatError otherwise).
_CLASSES = {
    "DECODE_FAILED": E.CodecError, "DECODED_SIZE_MISMATCH": E.CodecError, "ZSTD_CHECKSUM_MISSING": E.CodecError, "UNKNOWN_CODEC": E.CodecError,
    "RAW_LENGTH_MISMATCH": E.CodecError, "POSITIONS_ENCODING": E.CodecError, "CODEC_SPEC_MISMATCH": E.CodecError,
    "CODEC_SPEC_INVALID": E.SchemaError, "LENGTH_MISMATCH": E.LayoutError, "RESERVED_NONZERO": E.LayoutError,
    "LAYER_OUT_OF_RANGE": E.LayoutError, "SPARSE_INVALID": E.SchemaError, "DECODED_SIZE_LIMIT": E.LimitError,
    "LIMIT_EXCEEDED": E.LimitError,
}


class NativeError(E.Error, RuntimeError):
    """libkvwire failed for a reason that is not about the input (memory, API misuse)."""

    code = "NATIVE_FAILURE"


_lock = threading.Lock()
_state = SimpleNamespace(lib=None, path=None, why="not loaded")  # the library while enabled (one per process), its path, why not
_handles: dict[int, tuple[weakref.ref[Any], int | None]] = {}  # id(header) -> (weakref to it, handle or None when C cannot take it)


def enable(path: str | os.PathLike[str] | None = None) -> None:
    """Decode through libkvwire from now on (``path``: the .so; default ``default_path()``).
    Raises OSError when it cannot be loaded (native stays as it was)."""
    p = Path(path) if path is not None else default_path()
    if p is None:
        raise OSError(missing_reason())
    lib = load_library(p)
    with _lock:
        _drop_handles()
        _state.lib, _state.path, _state.why = lib, p, None


def disable(why: str = "disabled at run time (native.disable())") -> None:
    """Back to the numpy reference codecs. Like ``enable``, it frees the cached C headers:
    call neither while another thread is decoding."""
    with _lock:
        _drop_handles()
        _state.lib, _state.path, _state.why = None, None, why


def available() -> bool:
    """True when native decoding is enabled (and the library loaded)."""
    return _state.lib is not None


def library() -> Path | None:
    """The path of the library in use, None on the numpy path (``enable(library())``
    restores a state saved this way)."""
    path: Path | None = _state.path
    return path


def cdll() -> ctypes.CDLL | None:
    """The loaded library while native is enabled, else None: for the adapters that wrap
    more of its functions (``native_slots``)."""
    lib: ctypes.CDLL | None = _state.lib
    return lib


def status() -> str:
    """One line: which codecs are active and, for numpy, why (``kvwire --version``)."""
    if _state.lib is not None:
        return f"native (libkvwire {_state.lib.kvw_version().decode()}, {_state.path}); {ENV}=0 for numpy"
    return f"numpy ({_state.why})"


def _drop_handles() -> None:
    for _ref, h in list(_handles.values()):
        if h and _state.lib is not None:
            _state.lib.kvw_header_delete(h)
    _handles.clear()


def _fail(lib: ctypes.CDLL, e: KvwError, code: int) -> NoReturn:
    name = lib.kvw_code_name(code).decode()
    msg = e.message.decode(errors="replace")
    if code >= _ERR_INVALID_ARGUMENT:
        if code == _ERR_INVALID_ARGUMENT:
            raise ValueError(f"libkvwire: {msg}")
        raise NativeError(f"libkvwire {name}: {msg}")
    rule = e.rule.decode() if e.rule else None
    raise _CLASSES.get(name, E.FormatError)(name, f"{msg} (libkvwire)", rule=rule or None)


def _handle(header: Header) -> int | None:
    """libkvwire's parsed copy of ``header`` (cached per object), or None when C does not
    take it (the caller then uses numpy)."""
    key = id(header)
    got = _handles.get(key)
    if got is not None and got[0]() is header:
        return got[1]
    lib = _state.lib
    from ..format.header import build_header
    try:
        fb = build_header(header)
    except Exception:  # noqa: BLE001  (a header the writer would not emit: stay on numpy)
        fb = None
    h = None
    if fb is not None:
        out, e = ctypes.c_void_p(), KvwError()
        if lib.kvw_header_new(fb, len(fb), ctypes.byref(out), ctypes.byref(e)) == 0:
            h = out.value

    def _gone(_ref: weakref.ref[Any], key: int = key, h: int | None = h, lib: ctypes.CDLL = lib) -> None:
        cur = _handles.get(key)
        if cur is not None and cur[0] is _ref:
            del _handles[key]
            if h and _state.lib is lib:
                lib.kvw_header_delete(h)

    with _lock:
        cur = _handles.get(key)
        if _state.lib is not lib or (cur is not None and cur[0]() is header):  # switched, or another thread won
            if h:
                lib.kvw_header_delete(h)
            return cur[1] if _state.lib is lib and cur is not None else None
        _handles[key] = (weakref.ref(header, _gone), h)
    return h


def record(header: Header, codec: str, spec_index: int, stored_length: int, raw_length: int,
           shape: tuple[int, ...], layer: int,
           token_start: int, head: int = 0) -> bytes:
    """The 56-byte wire record the C decoder needs for a chunk (offset and checksum 0);
    ``shape`` is the chunk's [heads, tokens, dim]."""
    heads, tokens, dim = shape
    comp = 0  # K; V when the dim says so (the lossy geometry reads the component's head dim)
    spec = header.arch.layers[layer] if 0 <= layer < header.arch.num_layers else None
    if spec is not None and spec.kind == "mla_latent":
        comp = 2
    elif spec is not None and dim != spec.head_dim_k and dim == spec.head_dim_v:
        comp = 1
    return _RECORD.pack(0, stored_length, raw_length, 0, token_start, tokens, layer, comp, CODECS[codec], 0,
                        head, heads, spec_index, 0)


def _buffer(out: Any, raw_length: int) -> tuple[int, int] | None:
    """(address, writable length) of a contiguous writable ``out``, or None."""
    try:
        mv = memoryview(out)
    except TypeError:
        return None
    if mv.readonly or not mv.c_contiguous or mv.nbytes < raw_length:
        return None
    arr = np.frombuffer(mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv, np.uint8)
    return arr.ctypes.data, arr.nbytes


def _lib_and_handle(header: Header) -> tuple[ctypes.CDLL, int | None]:
    """The library and its parsed copy of ``header``; the handle is None when native is off
    or C does not take the header."""
    lib = _state.lib
    return lib, (_handle(header) if lib is not None else None)


def _source(stored: Any) -> tuple[np.ndarray[Any, Any], int]:
    """A stored body as a uint8 array C can read (one byte for an empty body: a valid
    address) and its length."""
    mv = memoryview(stored).cast("B")
    return (np.frombuffer(mv, np.uint8) if mv.nbytes else np.zeros(1, np.uint8)), mv.nbytes


def decode_wire(header: Header, rec: bytes, stored: Any, out: Any = None) -> Any:
    """Decode one stored body (``rec``: its 56-byte wire record) into ``out`` (a contiguous
    writable buffer of at least raw_length bytes) or a fresh uint8 array. Returns what it
    filled, or None when native decoding is off or C does not take this header."""
    lib, h = _lib_and_handle(header)
    if not h:
        return None
    raw_length = _RECORD.unpack(rec)[2]
    src, n = _source(stored)
    if out is None:
        out = np.empty(raw_length, np.uint8)
    dst = _buffer(out, raw_length)
    if dst is None:
        raise ValueError("out must be a contiguous writable buffer of raw_length bytes")
    e = KvwError()
    code = lib.kvw_decode_wire(_context(lib), h, rec, src.ctypes.data, n, dst[0], dst[1], ctypes.byref(e))
    if code:
        _fail(lib, e, code)
    return out


def decode_heads(header: Header, rec: bytes, stored: Any, dst: int, span: int, head_stride: int) -> bool:
    """Decode one stored body with its heads ``head_stride`` bytes apart from address
    ``dst`` (a chunk straight into its token slice of a [heads, layer tokens, dim] tensor;
    ``span``: the bytes from ``dst`` the caller guarantees, at least (heads - 1) *
    head_stride + raw_length / heads). The GIL is released for the call. Returns False
    (nothing written) when native decoding is off or C does not take this header."""
    lib, h = _lib_and_handle(header)
    if not h:
        return False
    src, n = _source(stored)
    e = KvwError()
    code = lib.kvw_decode_wire_heads(_context(lib), h, rec, src.ctypes.data, n, dst, span, head_stride,
                                     ctypes.byref(e))
    if code:
        _fail(lib, e, code)
    return True


def copy_runs(src: int, n: int, dst: int, run: int, stride: int, checksum: int | None = None) -> None:
    """``n`` bytes at address ``src`` as ``n // run`` runs of ``run`` bytes to ``dst + r *
    stride`` (a chunk's heads into a token slice of a layer tensor), hashed as they are
    copied when ``checksum`` is given (ChecksumError KVW-CSUM-1 on a mismatch; the
    destination then holds unverified bytes). The GIL is released for the copy. The caller
    keeps both buffers alive and guarantees the ranges. Needs native decoding enabled."""
    lib = _state.lib
    if lib is None:
        raise RuntimeError(f"native decoding is not enabled ({status()})")
    e = KvwError()
    code = lib.kvw_copy_checked(src, n, checksum or 0, checksum is not None, dst, run, stride, ctypes.byref(e))
    if code:
        if lib.kvw_code_name(code) == b"BODY_CHECKSUM":
            raise E.ChecksumError("BODY_CHECKSUM", e.message.decode(errors="replace"), rule="KVW-CSUM-1")
        _fail(lib, e, code)


def hash_runs(x: np.ndarray[Any, Any]) -> int | None:
    """XXH3-64 of the bytes of ``x`` [heads, tokens, dim] in C order, hashed in place (one
    run per head; libkvwire's AVX2 XXH3, the GIL released), or None when native is off or a
    head of ``x`` is not one contiguous run."""
    lib = _state.lib
    if lib is None or x.ndim != 3:
        return None
    s0, s1, s2 = x.strides
    w = x.dtype.itemsize
    if s2 != w or s1 != x.shape[2] * w or s0 < 0 or not x.size:
        return None
    return int(lib.kvw_xxh3_runs(x.ctypes.data, x.shape[0], x.shape[1] * x.shape[2] * w, s0))


def takes(header: Header) -> bool:
    """True when native decoding is on and libkvwire takes ``header`` (its parsed copy is
    then cached): the callers' test before planning a native path."""
    return _state.lib is not None and bool(_handle(header))


_ERR_UNSUPPORTED = 1003  # KVW_ERR_UNSUPPORTED


def encode_lossy(header: Header, rec: bytes, raw: Any, out: Any = None) -> np.ndarray[Any, Any] | None:
    """The lossy body (fp8 / int_affine, no lossless stage) of one chunk: ``raw`` its raw
    bytes, ``rec`` its 56-byte wire record (codec, codec_spec, shape; stored_length unused).
    Returns the body as uint8 (a view of ``out`` when given, a writable buffer of at least
    the body's length), None when native is off or C does not take this header; raises
    ``NotFaithful`` where KVW-LOSSY-5/6 refuse a lossy body, as ``quant.encode`` does."""
    lib = _state.lib
    if lib is None:
        return None
    h = _handle(header)
    if not h:
        return None
    src = np.frombuffer(memoryview(raw).cast("B"), np.uint8)
    n = src.nbytes
    e, written = KvwError(), ctypes.c_size_t()
    if out is None:  # one call for the body's length (geometry only), one to encode
        lib.kvw_lossy_encode_wire(h, rec, src.ctypes.data, n, None, 0, ctypes.byref(written), ctypes.byref(e))
        out = np.empty(max(int(e.needed), 1), np.uint8)
    dst = _buffer(out, 0)
    if dst is None:
        raise ValueError("out must be a contiguous writable buffer")
    code = lib.kvw_lossy_encode_wire(h, rec, src.ctypes.data, n, dst[0], dst[1], ctypes.byref(written),
                                     ctypes.byref(e))
    if code == _ERR_UNSUPPORTED:
        from .scales import NotFaithful
        raise NotFaithful(f"{e.message.decode(errors='replace')} (libkvwire)")
    if code:
        _fail(lib, e, code)
    return np.frombuffer(memoryview(out).cast("B"), np.uint8)[: written.value]


def decode_chunks(header: Header, items: Iterable[tuple[bytes, Any, Any]], threads: int = 2) -> list[Any]:
    """Decode many chunks, ``threads`` at a time (the GIL is released inside libkvwire):
    ``items`` are (record, stored, out) triples as ``decode_wire`` takes them; returns the
    filled outputs in order. Needs native decoding enabled."""
    if _state.lib is None:
        raise RuntimeError(f"native decoding is not enabled ({status()})")
    if _handle(header) is None:
        raise ValueError("libkvwire does not take this header")
    items = list(items)
    if threads <= 1 or len(items) < 2:
        return [decode_wire(header, r, s, o) for r, s, o in items]
    return list(pool(threads).map(lambda it: decode_wire(header, *it), items))


class _Context:
    """This thread's kvw_decode_ctx (a zstd context and a body buffer that libkvwire reuses
    across calls), freed with the thread's locals: the library itself keeps no state."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib, self.ptr = lib, ctypes.c_void_p()
        if lib.kvw_decode_ctx_new(ctypes.byref(self.ptr), None):
            self.ptr = ctypes.c_void_p()  # out of memory: decode without reuse (ctx NULL)

    def __del__(self) -> None:
        if self.ptr:
            self.lib.kvw_decode_ctx_free(self.ptr)


_local = threading.local()


def _context(lib: ctypes.CDLL) -> ctypes.c_void_p:
    ctx = getattr(_local, "ctx", None)
    if ctx is None or ctx.lib is not lib:
        ctx = _local.ctx = _Context(lib)
    return ctx.ptr


_pools: dict[int, ThreadPoolExecutor] = {}


def pool(threads: int) -> ThreadPoolExecutor:
    """One executor per thread count, kept (its threads keep their decode contexts warm)."""
    with _lock:
        p = _pools.get(threads)
        if p is None:
            p = _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="kvwire-native")
        return p


def _from_env() -> None:
    """The import-time choice (module docstring): never raises, warns once when a library
    that should be used cannot be."""
    import warnings

    v = os.environ.get(ENV, "").strip()
    if v == "0":
        _state.why = f"{ENV}=0"
        return
    path = None if v in ("", "1") else v
    if path is None and default_path() is None:
        _state.why = missing_reason()
        if v == "1":
            warnings.warn(f"kvwire: {ENV}=1 but {_state.why}; decoding with numpy", RuntimeWarning, stacklevel=2)
        return
    try:
        enable(path)
    except OSError as e:
        _state.why = f"libkvwire failed to load: {e}"
        warnings.warn(f"kvwire: {_state.why}; decoding with numpy ({ENV}=0 silences this)", RuntimeWarning,
                      stacklevel=2)


_from_env()
