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
        raise ValueError(f"device={device!r} needs torch (pip install torch); without it, leave device=None") from None
    try:
        torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device must be None, 'cpu', 'cuda', 'cuda:N' or a torch.device, not {device!r}") from None
    return device
