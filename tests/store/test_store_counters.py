"""The counters users see stay what they are: ``KVStore.stats()`` keys (in order),
``StoreStats`` fields, and the keys of the vLLM connector's stats files
(``<stats_path>.scheduler.json``, ``.worker.json``: its counters, ``store`` and
``store_url``). Dashboards and scripts read these names, so a rename is a break."""

from __future__ import annotations

import json
import threading

import pytest
from test_kvstore import make_cache, token_ids

from kvwire.integrations.vllm_stats import ConnectorCounts, connector_stats
from kvwire.store import KeySpace, KVStore, MemoryStore, StoreStats
from kvwire.store.counters import KVStoreCounts

KVSTORE_KEYS = [
    "hits", "misses", "queries", "objects_written", "objects_skipped", "checksum_failures", "corrupt",
    "incompatible", "bytes_read", "bytes_written", "auth_failures", "auth_healed", "hit_rate",
    "last_get_seconds", "last_get_bytes", "last_get_tensor_bytes", "last_get_gbps",
    "last_put_seconds", "last_put_bytes", "last_put_tensor_bytes", "last_put_gbps",
    "bytes_in", "bytes_out", "evictions",
]
STORE_STATS_KEYS = [
    "gets", "hits", "misses", "bytes_in", "puts", "written", "skipped", "bytes_out", "exists_calls", "deletes",
    "evictions", "round_trips", "unavailable",
]
CONNECTOR_KEYS = [
    "lookups", "lookup_errors", "matched_tokens", "loaded_tokens", "load_failed_tokens", "saved_chunks",
    "save_errors", "skipped_chunks", "rescaled_loads", "unbindable",
]


def test_kvstore_stats_keys_are_pinned():
    kv = KVStore(MemoryStore())
    assert list(kv.stats()) == KVSTORE_KEYS
    cache, tokens = make_cache(8), token_ids(8)
    kv.put_cache(cache, tokens)
    kv.get_cache(tokens, KeySpace.of(cache.header))
    s = kv.stats()
    assert list(s) == KVSTORE_KEYS and all(type(v) in (int, float) for v in s.values())
    assert (s["hits"], s["objects_written"]) == (2, 2)


def test_store_stats_fields_are_pinned():
    st = StoreStats()
    assert list(st.as_dict()) == STORE_STATS_KEYS and set(st.as_dict().values()) == {0}
    store = MemoryStore()
    store.put("a", b"x")
    store.get("a")
    assert store.stats.as_dict()["puts"] == store.stats.puts == 1 and store.stats.gets == 1


def test_connector_stats_file_keys_are_pinned():
    """The connector's stats file: its counters in order, then ``store`` (the KVStore's
    stats) and ``store_url``; all JSON. Built by the function the connector calls, so no
    engine is needed."""
    counts = ConnectorCounts()
    counts.add("lookups")
    counts.add("matched_tokens", 32)
    doc = json.loads(json.dumps(connector_stats(counts, KVStore(MemoryStore()), "file:///x")))
    assert list(doc) == CONNECTOR_KEYS + ["store", "store_url"]
    assert list(doc["store"]) == KVSTORE_KEYS and (doc["lookups"], doc["matched_tokens"]) == (1, 32)


def test_counters_refuse_unknown_names_and_count_from_threads():
    """A misspelt counter is an error naming the real ones, not a new key; updates from
    several threads (a layer-wise load runs on one) all land."""
    c = KVStoreCounts()
    with pytest.raises(ValueError, match="no counter 'hitz'; its counters are hits, misses"):
        c.add("hitz")
    with pytest.raises(KeyError):
        c["hitz"]

    def bump():
        for _ in range(20_000):
            c.add("bytes_read", 3)
            c.add(hits=1, misses=2)

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (c["bytes_read"], c.hits, c.misses) == (240_000, 80_000, 160_000)
    snap = c.snapshot()
    c.merge(snap)
    assert c.hits == 2 * snap.hits and snap.hits == 80_000 and snap == KVStoreCounts(**snap.as_dict())
