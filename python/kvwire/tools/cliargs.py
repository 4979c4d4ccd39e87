"""argparse types shared by every ``kvwire`` subcommand: a count given on the command line
is checked when it is parsed, so a negative or non-numeric value is one usage line (exit
status 2), never a traceback or a silent nonsense run."""

from __future__ import annotations

import argparse
import math


def _number(text: str, kind):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None


def count(text: str) -> int:
    """An integer >= 0."""
    n = _number(text, int)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n} is negative; give an integer >= 0")
    return n


def positive(text: str) -> int:
    """An integer >= 1."""
    n = _number(text, int)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is not allowed; give an integer >= 1")
    return n


def positive_float(text: str) -> float:
    """A finite number > 0 (a rate, a timeout)."""
    x = _number(text, float)
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"{text} is not allowed; give a finite number > 0")
    return x


def nonnegative_float(text: str) -> float:
    """A finite number >= 0 (a latency)."""
    x = _number(text, float)
    if not (math.isfinite(x) and x >= 0):
        raise argparse.ArgumentTypeError(f"{text} is not allowed; give a finite number >= 0")
    return x
