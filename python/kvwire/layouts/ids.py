"""Block and slot id arithmetic shared by gather, scatter and the offload ring.

Engines address their caches by block (paged layouts) or token slot ids; a run of
consecutive ids is one strided copy (or a view), so gathering.py, scattering.py and
offload.py all cut id lists into runs with these helpers. numpy only: no torch.
"""

from __future__ import annotations

import numpy as np

__all__ = ["id_runs", "run_start", "slots_from_blocks"]


def run_start(ids: np.ndarray) -> int | None:
    """The first id when ``ids`` is a consecutive increasing run, else None."""
    if len(ids) == 0:
        return None
    if len(ids) == 1 or (np.diff(ids) == 1).all():
        return int(ids[0])
    return None


def id_runs(ids: np.ndarray):
    """(index in ids, first id, length) of each maximal run of consecutive increasing ids."""
    if len(ids) == 0:
        return []
    cuts = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [len(ids)]))
    return [(int(a), int(ids[a]), int(b - a)) for a, b in zip(starts, ends)]


def slots_from_blocks(block_ids, block_size: int, num_tokens: int) -> np.ndarray:
    """Token slot ids of a paged allocator (slot = page * page_size + offset), e.g. SGLang
    with page_size > 1, for the first ``num_tokens`` tokens of ``block_ids``."""
    b = np.asarray(block_ids, dtype=np.int64)
    t = np.arange(num_tokens)
    if len(b) * block_size < num_tokens:
        raise ValueError(f"{len(b)} blocks of {block_size} hold fewer than {num_tokens} tokens")
    return b[t // block_size] * block_size + t % block_size
