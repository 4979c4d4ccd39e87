"""The vLLM connector's counters and the document its stats files hold.

Why apart from the connector: the counters are bumped on the scheduler's and the worker's
paths, and the stats files (``<stats_path>.scheduler.json``, ``.worker.json``) are read
by people and scripts, so their names are a contract. Here they are one ``Counters``
type with fixed names (a misspelt counter is an error, not a new key) and one function
that builds the document, both importable without vLLM, so a test pins the keys without
an engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..store.counters import Counters
from ..store.kvstore import KVStore


@dataclass
class ConnectorCounts(Counters):
    """What one side of the connector did (the scheduler's or a worker's)."""

    lookups: int = 0  # prompts looked up (scheduler)
    lookup_errors: int = 0  # lookups that failed on the store and counted as misses
    matched_tokens: int = 0  # tokens the scheduler planned to load
    loaded_tokens: int = 0  # tokens a worker put in place
    load_failed_tokens: int = 0  # planned tokens a worker could not load: vLLM recomputed them
    saved_chunks: int = 0  # chunk objects written
    save_errors: int = 0  # saves that failed on the store (a later miss, never an error)
    skipped_chunks: int = 0  # chunks whose object existed
    rescaled_loads: int = 0  # fp8 loads requantized to the engine's scales (KVW-SCALE-7)
    unbindable: int = 0  # requests neither looked up nor saved: their identity cannot be bound (KVW-IDENT-1)


def connector_stats(counts: ConnectorCounts, kv: KVStore, store_url: str) -> dict[str, object]:
    """The stats document of one side: its counters, its ``KVStore``'s ``stats()`` under
    ``store``, and the store's (redacted) URL."""
    return {**counts.as_dict(), "store": kv.stats(), "store_url": store_url}


__all__ = ["ConnectorCounts", "connector_stats"]
