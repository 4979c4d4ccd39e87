"""Reads on Redis as transactions of bounded replies (spec/store.md KVW-STORE-22, 23;
``kvwire.store.redis_reads``), against real redis-server processes: any range of any
object reads back as the Python slice whatever the slice and trip sizes, no reply is
larger than a slice, no round trip asks for more than a trip's bytes, and an object
replaced or deleted between a read's two trips is read whole from one object, never a mix.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.store import StoreError, open_store, resolve_range
from kvwire.store.redis_reads import SLICE_BYTES, TRIP_BYTES, first_read, trips

TIMEOUT = 2.0
BACKENDS = ["server", "cluster"]
MiB = 1 << 20


@pytest.fixture(params=BACKENDS)
def store(request):
    url = request.getfixturevalue("redis_url" if request.param == "server" else "redis_cluster_url")
    s = open_store(url, timeout=TIMEOUT)
    yield s
    s.close()


def record(store):
    """The command batches ``store`` sends from now on, one list per round trip."""
    sent: list = []
    run = store.run

    def spy(commands, keys):
        sent.append([list(c) for c in commands])
        return run(commands, keys)

    store.run = spy
    return sent


def asked(batch) -> int:
    """Reply bytes a batch's GETRANGEs ask for at most (open ends: their first slice)."""
    return sum(c[3] - c[2] + 1 for c in batch if c[0] == "GETRANGE" and c[2] >= 0 and c[3] >= 0)


RANGES = st.one_of(st.none(), st.tuples(st.integers(0, 300), st.integers(0, 300)),
                   st.tuples(st.integers(0, 300), st.none()), st.tuples(st.integers(-300, -1), st.none()))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=40, deadline=None)
@given(value=st.binary(max_size=257), ranges=st.lists(RANGES, min_size=1, max_size=6),
       slice_bytes=st.integers(1, 64), trip_bytes=st.integers(1, 400))
def test_store22_sliced_reads_are_the_python_slice(redis_server, redis_cluster, backend, value, ranges, slice_bytes,
                                                    trip_bytes):
    """KVW-STORE-3/22/23 as a property: with any slice and trip size, every range of any
    value (whole, open, suffix, past the end, empty) reads as the Python slice, a batch's
    misses are None, and no GETRANGE asks for more than a slice."""
    url = redis_server.url if backend == "server" else redis_cluster.url
    key = f"slices/{uuid.uuid4().hex}"
    with open_store(url, timeout=TIMEOUT) as store:
        store.slice_bytes, store.trip_bytes = slice_bytes, trip_bytes
        assert store.put(key, value)
        sent = record(store)
        got = store.get_ranges([(k, r) for r in ranges for k in (key, key + "-missing")])
        want = []
        for r in ranges:
            a, b = resolve_range(r, len(value))
            want += [value[a:b], None]
        assert [None if g is None else bytes(g) for g in got] == want
        assert all(c[3] - c[2] < slice_bytes for batch in sent for c in batch
                   if c[0] == "GETRANGE" and c[2] >= 0 and c[3] >= 0)
        store.delete(key)


def test_store22_large_objects_read_in_slices_and_bounded_trips(store):
    """A whole 5 MiB object: two round trips (its length with the first slice, then the
    slices), no reply over 1 MiB; 40 ranges of 1 MiB: three trips of at most 16 MiB."""
    value = np.random.default_rng(1).bytes(5 * MiB + 123)
    store.put("big/a", value)
    sent = record(store)
    before = store.stats.round_trips
    assert bytes(store.get("big/a")) == value
    assert store.stats.round_trips - before >= 2 and len(sent) == 2
    assert [c[0] for c in sent[0]] == ["MULTI", "EXISTS", "STRLEN", "GETRANGE", "EXEC"]
    assert max(c[3] - c[2] + 1 for b in sent for c in b if c[0] == "GETRANGE") == SLICE_BYTES
    sent.clear()
    ranges = [("big/a", (i * MiB, MiB)) for i in range(5)] * 8
    got = store.get_ranges(ranges)
    assert [bytes(g) for g in got] == [value[i * MiB:(i + 1) * MiB] for i in range(5)] * 8
    assert len(sent) == 3 and all(asked(b) <= TRIP_BYTES for b in sent)
    sent.clear()
    assert bytes(store.get("big/a", (100, 3 * MiB))) == value[100:100 + 3 * MiB]  # known length: one trip
    assert len(sent) == 1 and sum(c[0] == "GETRANGE" for c in sent[0]) == 3
    assert bytes(store.get("big/a", (-2 * MiB - 5, None))) == value[-2 * MiB - 5:]
    assert bytes(store.get("big/a", (7, None))) == value[7:]


@pytest.mark.parametrize("change", ["longer", "same length", "deleted"])
def test_store22_object_changed_between_trips_is_never_mixed(store, change):
    """An object replaced between a read's first trip (its length) and the second (its
    slices) reads as the new object whole, from one transaction; deleted, as a miss."""
    old = np.random.default_rng(2).bytes(3 * MiB)
    new = {"longer": np.random.default_rng(3).bytes(4 * MiB + 1),
           "same length": np.random.default_rng(4).bytes(3 * MiB), "deleted": None}[change]
    store.put("chg/a", old)
    run, calls = store.run, []

    def between(commands, keys):
        calls.append(commands)
        if len(calls) == 2:  # after the first trip, before the second: another writer
            store.run = run
            store.delete("chg/a")
            if new is not None:
                store.put("chg/a", new)
            store.run = between
        return run(commands, keys)

    store.run = between
    got = store.get("chg/a")
    assert (None if got is None else bytes(got)) == new


def test_store22_error_reply_inside_a_transaction_is_a_store_error(redis_url):
    """A key that holds another Redis type answers GETRANGE with WRONGTYPE inside EXEC's
    reply: a StoreError naming the key, never a value."""
    with open_store(redis_url, timeout=TIMEOUT) as store:
        store.node.execute([["RPUSH", "typ/list", "x"]])
        for r in (None, (0, 4), (-3, None)):
            with pytest.raises(StoreError, match="typ/list"):
                store.get("typ/list", r)


def test_trips_bound_known_bytes_and_keep_order():
    """``trips``: consecutive groups of at most the trip's known bytes, at least one read
    each (a read larger than a trip goes alone), in the request's order."""
    reads = [first_read(i, f"k{i}", (0, n), 4) for i, n in enumerate([3, 3, 9, 1, 0, 2])]
    groups = trips(reads, 6)
    assert [[r.position for r in g] for g in groups] == [[0, 1], [2], [3, 4, 5]]
    assert [r.cmds[2:-1] for r in reads[2:3]] == [[["GETRANGE", "k2", 0, 3], ["GETRANGE", "k2", 4, 7],
                                                   ["GETRANGE", "k2", 8, 8]]]
    assert first_read(0, "k", (5, 0)).cmds == [["EXISTS", "k"]]
