"""Running a tiny transformers model reproducibly: shared by the cross-model suite's
producer and receiver and by ``kvwire demo``.

torch, transformers and the HF adapter are optional (the core has no torch):
``hf_modules`` imports them on first use and raises ``MissingDependency`` with an install
hint. ``quiet_torch`` pins one intra-op thread so both processes run the same kernels and
logits can match bit for bit; ``forward`` and ``greedy`` prefill and continue;
``verdict_json`` turns a compatibility verdict into JSON that crosses a process boundary.
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np

from ..format.errors import Error

# torch from its CPU index: the default torch wheel on PyPI is a multi-GB CUDA build.
INSTALL_HINT = ("pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && "
                "pip install 'transformers>=5.24,<6'")


class MissingDependency(Error, RuntimeError):
    """torch, transformers or the HF adapter is not importable."""

    code = "MISSING_DEPENDENCY"


def hf_modules():
    """(adapters.hf, adapters.zoo): the optional modules the suite needs, imported on first
    use (the core has no torch)."""
    try:
        import torch  # noqa: F401 (only checks that it imports)
        import transformers  # noqa: F401 (only checks that it imports)

        from ..adapters import hf, zoo
    except ImportError as exc:
        raise MissingDependency(f"the cross-model suite needs torch and transformers ({exc}); {INSTALL_HINT}") \
            from None
    return hf, zoo


@contextlib.contextmanager
def quiet_torch(threads: int = 1):
    """One intra-op thread (the same kernels in both processes, so logits can match bit
    for bit) and no config or deprecation chatter; thread count and verbosity are restored."""
    import torch
    from transformers import logging as hf_logging

    before, verbosity = torch.get_num_threads(), hf_logging.get_verbosity()
    torch.set_num_threads(threads)
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.set_num_threads(before)
        hf_logging.set_verbosity(verbosity)


def prompt_ids(vocab_size: int, n: int, seed: int = 0) -> list:
    """A fixed pseudo-random prompt, ids in [3, vocab) (0-2 are pad/bos/eos in the zoo)."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(3, vocab_size, n)]


def forward(model, ids, cache=None):
    """(logits of the last position as float32 numpy, cache) of one forward pass."""
    import torch

    out = model(input_ids=torch.tensor([list(ids)], dtype=torch.long), cache=cache, use_cache=True)
    return out.logits[0, -1].float().numpy().copy(), out.cache


def greedy(model, cache, first_token: int, steps: int):
    """Feed ``first_token`` and continue greedily for ``steps`` forward passes on ``cache``.

    Returns (tokens, logits [steps, vocab] float32): token i is argmax of logits row i.
    The cache is updated in place, as generation does.
    """
    tok, tokens, rows = int(first_token), [], []
    for _ in range(steps):
        row, cache = forward(model, [tok], cache)
        tok = int(np.argmax(row))
        tokens.append(tok)
        rows.append(row)
    return tokens, np.stack(rows) if rows else np.zeros((0, 0), np.float32)


def verdict_json(v) -> dict:
    """A Verdict as JSON: status, conversions and reasons as strings."""
    status = getattr(v, "status", v)
    return {"status": str(status), "ok": bool(v),
            "conversions": [str(c) for c in getattr(v, "conversions", ()) or ()],
            "reasons": [str(r) for r in getattr(v, "reasons", ()) or ()]}
