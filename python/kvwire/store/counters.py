"""``Counters``: the one type behind every set of event counters of the store and its
users (``StoreStats`` of a backend, ``KVStore.counts``, the vLLM connector's counts).

Why one type: counters were kept as a dataclass in one place and as free-form dicts in
two others, so a misspelt name silently started a new counter, and updates from the
layer-wise loader's thread raced the engine thread's. Here the names are the dataclass's
fields, fixed when the class is written (``add`` of an unknown name is an error), every
update holds the object's lock (a ``+=`` is a read and a write), and what users see is
``as_dict()``: the fields in their declared order, plain ints, as JSON.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields
from typing import ClassVar


@dataclass
class Counters:
    """Base of a set of named integer counters: subclass it as a ``@dataclass`` whose
    fields (``name: int = 0``) are the counters."""

    _names: ClassVar[tuple[str, ...]] = ()  # the fields' names, worked out once per class (``add`` runs on every store call)
    _name_set: ClassVar[frozenset[str]] = frozenset()

    def __post_init__(self) -> None:
        self._lock = threading.Lock()  # not a field: not shown, not compared
        cls = type(self)
        if "_names" not in cls.__dict__:
            cls._names = tuple(f.name for f in fields(cls))
            cls._name_set = frozenset(cls._names)

    def names(self) -> tuple[str, ...]:
        """The counters' names, in declared order."""
        return self._names

    def add(self, name: str | None = None, n: int = 1, /, **deltas: int) -> None:
        """Add ``n`` to counter ``name`` and each ``deltas`` value to its counter, under the
        lock (safe from any thread); an unknown name is a ValueError naming the valid ones."""
        if name is not None:
            deltas[name] = deltas.get(name, 0) + n
        if not self._name_set.issuperset(deltas):
            bad = sorted(set(deltas) - self._name_set)
            raise ValueError(f"{type(self).__name__} has no counter {', '.join(map(repr, bad))}; its counters are "
                             f"{', '.join(self._names)}")
        with self._lock:
            for k, v in deltas.items():
                setattr(self, k, getattr(self, k) + v)

    def __getitem__(self, name: str) -> int:
        """``counts["hits"]``: reading a counter by name, as from the dict it replaced."""
        if name not in self._name_set:
            raise KeyError(name)
        return int(getattr(self, name))

    def as_dict(self) -> dict[str, int]:
        """{name: value} in declared order: what a stats call or file shows."""
        with self._lock:
            return {k: getattr(self, k) for k in self._names}

    def snapshot(self) -> Counters:
        """A copy of the counters now (its own lock): to report, or to diff against later."""
        return type(self)(**self.as_dict())

    def merge(self, other: Counters) -> None:
        """Add every counter of ``other`` (the same type, or one whose names are a subset)."""
        self.add(**other.as_dict())


@dataclass
class KVStoreCounts(Counters):
    """``KVStore``'s chunk counters (``KVStore.stats()`` shows them first, in this order)."""

    hits: int = 0  # chunks served
    misses: int = 0  # chunks asked for and not served
    queries: int = 0  # hit queries (``leading_hits``)
    objects_written: int = 0
    objects_skipped: int = 0  # chunks whose object existed (or another writer published first)
    checksum_failures: int = 0  # objects deleted because a body failed its checksum
    corrupt: int = 0  # objects deleted because they do not parse
    incompatible: int = 0  # objects deleted because they are not the ones their keys promise
    bytes_read: int = 0  # object bytes read (headers, tags, bodies)
    bytes_written: int = 0
    auth_failures: int = 0  # tags that did not verify (KVW-AUTH-7)
    auth_healed: int = 0  # untagged or badly tagged objects a writer replaced (KVW-AUTH-8)


__all__ = ["Counters", "KVStoreCounts"]
