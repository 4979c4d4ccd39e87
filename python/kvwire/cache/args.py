"""Argument checks shared by the public entry points.

A mistake in a call (a negative layer index, an unknown backend or component name, a
wrong type) is reported at the entry point as a ``ValueError`` or ``TypeError`` whose
message names the valid choices, instead of surfacing from deep inside as a bare
``IndexError``/``KeyError``/``AttributeError``, or worse, silently meaning something
else (``layer(-1)`` is not the last layer).
"""

from __future__ import annotations

import operator

BACKENDS = ("numpy", "torch")


def check_choice(name: str, value, choices: tuple):
    """``value`` itself when it is one of ``choices``; else a ValueError naming them."""
    if not any(value is c or (type(value) is type(c) and value == c) for c in choices):
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, not {value!r}")
    return value


def check_index(name: str, value, stop: int) -> int:
    """``value`` as an int in [0, stop): a negative index would silently wrap (-1: the last)."""
    try:
        i = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer in [0, {stop}), not {type(value).__name__}") from None
    if not 0 <= i < stop:
        raise ValueError(f"{name} {i} outside [0, {stop})" + (" (negative indices do not count from the end)"
                                                            if i < 0 else ""))
    return i


def check_count(name: str, value) -> int:
    """``value`` as a non-negative int (sizes, counts, limits)."""
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a non-negative integer, not {type(value).__name__}") from None
    if n < 0:
        raise ValueError(f"{name} must be a non-negative integer, not {n}")
    return n


def check_device(device):
    """``device`` itself when it is None or a device torch accepts ("cpu", "cuda", "cuda:1",
    a ``torch.device``); else a ValueError naming the valid forms (not torch's RuntimeError
    from deep inside an allocation)."""
    if device is None:
        return None
    try:
        import torch
    except ImportError:
        raise ValueError(f"device={device!r} needs torch (its CPU build: pip install torch==2.13.0 --index-url "
                         "https://download.pytorch.org/whl/cpu; CUDA builds: pytorch.org); without it, "
                         "leave device=None") from None
    try:
        torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device must be None, 'cpu', 'cuda', 'cuda:N' or a torch.device, not {device!r}") from None
    return device


_DTYPE_ALIASES = {
    "bfloat16": "bf16", "float16": "f16", "half": "f16", "fp16": "f16", "float32": "f32", "float": "f32",
    "fp32": "f32", "float8_e4m3fn": "f8_e4m3fn", "float8_e5m2": "f8_e5m2", "float8_e4m3fnuz": "f8_e4m3fnuz",
    "int8": "i8", "uint8": "u8",
}


def dtype_choices() -> str:
    """The dtype spellings ``resolve_dtype`` accepts, for error messages."""
    from ..format.registry import DTYPES

    return (f"{', '.join(DTYPES)} (or {', '.join(_DTYPE_ALIASES)}, the numpy / ml_dtypes dtypes or torch "
            "dtypes of these)")


def resolve_dtype(dtype, name: str = "dtype") -> str:
    """The registry name ("bf16", "f32", ...) of ``dtype``: a registry name, a common spelling
    ("float32", "bfloat16", "half"), a numpy or ml_dtypes dtype, or a torch dtype (recognised
    without importing torch). Anything else: a ValueError (TypeError for a non-dtype) naming
    the valid spellings, not a KeyError from a table."""
    from ..format.registry import DTYPES

    if type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype":  # torch.bfloat16 -> "bfloat16"
        dtype = str(dtype).removeprefix("torch.")
    if isinstance(dtype, str):
        key = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
        if key in DTYPES:
            return key
        raise ValueError(f"{name} must be one of {dtype_choices()}; not {dtype!r}")
    try:
        import numpy as np

        npd = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name} must be a dtype name or a numpy/torch dtype, one of {dtype_choices()}; "
                        f"not {type(dtype).__name__}") from None
    for key, (_, _, want) in DTYPES.items():
        if npd == want:
            return key
    raise ValueError(f"{name} must be one of {dtype_choices()}; not {npd} (kvwire stores no {npd} tensors)")


def check_keywords(call: str, unknown: dict, valid: tuple, header_changes, **fields) -> dict:
    """The Header overrides of a typed ``save``/``encode`` call (``fields`` that are not None,
    then ``header_changes``); an unknown keyword is a TypeError naming the valid ones."""
    if unknown:
        raise TypeError(f"{call}() got unknown keyword(s) {', '.join(sorted(unknown))}; valid: {', '.join(valid)} "
                        "(other Header fields: header_changes={...})")
    if header_changes is not None and not isinstance(header_changes, dict):
        raise TypeError(f"header_changes must be a dict of Header fields, not {type(header_changes).__name__}")
    return {**{k: v for k, v in fields.items() if v is not None}, **(header_changes or {})}


def check_cache(cache, call: str) -> None:
    """A TypeError unless ``cache`` is a KVCache or SparseKVCache (has a header and chunks)."""
    if not hasattr(cache, "header") or not hasattr(cache, "chunk_arrays"):
        raise TypeError(f"{call}() needs a kvwire.KVCache (or SparseKVCache), not {type(cache).__name__}; "
                        "build one from per-layer tensors with kvwire.KVCache.from_tensors(keys, values)")


def has_fileno(file) -> bool:
    """Whether a file object has an OS descriptor (BytesIO has none)."""
    try:
        file.fileno()
        return True
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return False
