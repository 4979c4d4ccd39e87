"""Where libkvwire is and whether it can be used: the loading half of ``codecs.native``.

Why a module of its own: finding and checking the library (a wheel's, beside the package;
a checkout's ``build/c``; a path from ``KVWIRE_NATIVE``) is the part that must never take
the package down. Everything here fails with an ``OSError`` that names the path and the
reason, which ``native`` turns into one warning and the numpy path. A library is used only
when its ``kvw_version()`` is this package's version and its ``kvw_error`` has the size
mirrored here: a stale build or another release's library is refused, not half-used.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from ..version import __version__

ENV = "KVWIRE_NATIVE"
PACKAGED = Path(__file__).resolve().with_name("libkvwire.so")  # a wheel's (setup.py puts it there)
_ROOT = Path(__file__).resolve().parents[3]  # the checkout, when this module is in one
CHECKOUT = _ROOT / "build" / "c" / "libkvwire.so"  # make c


class KvwError(ctypes.Structure):
    """kvwire.h's kvw_error (its size checked against kvw_error_size at load)."""

    _fields_ = [("code", ctypes.c_int), ("rule", ctypes.c_char_p), ("needed", ctypes.c_uint64),
                ("message", ctypes.c_char * 240)]


def in_checkout() -> bool:
    """True when this package is a checkout's python/ (c/ beside it), not an install."""
    return (_ROOT / "c" / "include" / "kvwire.h").is_file()


def default_path() -> Path | None:
    """The library ``enable()`` loads by default: the wheel's (beside this module), else a
    checkout's ``build/c/libkvwire.so``; None when neither is there."""
    if PACKAGED.is_file():
        return PACKAGED
    if CHECKOUT.is_file() and in_checkout():
        return CHECKOUT
    return None


def missing_reason() -> str:
    """Why ``default_path()`` is None, with what to do about it."""
    if in_checkout():
        return "no libkvwire built in this checkout (make c)"
    return ("no libkvwire in this install: its wheel was built without a C compiler (install gcc, make, "
            "libzstd-dev and libxxhash-dev, then build and install it again)")


def load_library(path: Path) -> ctypes.CDLL:
    """``path`` loaded, its version and ABI checked and its functions typed; OSError (with
    the path and the reason) when it is missing, not loadable or not this version's."""
    if not path.is_file():
        raise OSError(f"{path} not found")
    try:
        return _typed(ctypes.CDLL(str(path)), path)
    except AttributeError as e:  # a library without a function this package needs: another version's
        raise OSError(f"{path}: not this version's libkvwire ({e})") from None


def _typed(lib: ctypes.CDLL, path: Path) -> ctypes.CDLL:
    lib.kvw_version.restype = ctypes.c_char_p
    lib.kvw_version.argtypes = []
    version = lib.kvw_version().decode(errors="replace")
    if version != __version__:
        raise OSError(f"{path}: libkvwire {version}, this package is kvwire {__version__}")
    lib.kvw_error_size.restype = ctypes.c_size_t
    lib.kvw_error_size.argtypes = []
    if lib.kvw_error_size() != ctypes.sizeof(KvwError):
        raise OSError(f"{path}: kvw_error is {lib.kvw_error_size()} bytes, expected {ctypes.sizeof(KvwError)}")
    lib.kvw_header_new.restype = ctypes.c_int
    lib.kvw_header_new.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p),
                                   ctypes.POINTER(KvwError)]
    lib.kvw_header_delete.restype = None
    lib.kvw_header_delete.argtypes = [ctypes.c_void_p]
    lib.kvw_decode_ctx_new.restype = ctypes.c_int
    lib.kvw_decode_ctx_new.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    lib.kvw_decode_ctx_free.restype = None
    lib.kvw_decode_ctx_free.argtypes = [ctypes.c_void_p]
    lib.kvw_decode_wire.restype = ctypes.c_int
    lib.kvw_decode_wire.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t,
                                    ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(KvwError)]
    lib.kvw_decode_wire_heads.restype = ctypes.c_int
    lib.kvw_decode_wire_heads.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p,
                                          ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                                          ctypes.POINTER(KvwError)]
    lib.kvw_lossy_encode_wire.restype = ctypes.c_int
    lib.kvw_lossy_encode_wire.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t,
                                          ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t),
                                          ctypes.POINTER(KvwError)]
    lib.kvw_xxh3_runs.restype = ctypes.c_uint64
    lib.kvw_xxh3_runs.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t]
    lib.kvw_copy_checked.restype = ctypes.c_int
    lib.kvw_copy_checked.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int, ctypes.c_void_p,
                                     ctypes.c_size_t, ctypes.c_size_t, ctypes.POINTER(KvwError)]
    for fn in (lib.kvw_scatter_slots, lib.kvw_gather_slots):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, *[ctypes.c_size_t] * 5, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                       ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(KvwError)]
    lib.kvw_code_name.restype = ctypes.c_char_p
    lib.kvw_code_name.argtypes = [ctypes.c_int]
    return lib
