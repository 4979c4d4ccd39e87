"""``RedisClusterStore`` ("redis-cluster://HOST:PORT,HOST:PORT,..."): the store spread over
the masters of a Redis Cluster.

Why its own routing instead of redis-py's ``RedisCluster``: a batch (a prompt's 512 chunk
keys, a put of its new chunks) must be split by node and sent to every node at once (one
round trip per node, in parallel), and a node that is down must cost its own keys only.
Keys (spec/store.md, KVW-STORE-13) carry no hash tag, so chunks of one prompt spread over
all masters and load in parallel; each key's slot is CRC16 as Redis defines it.

Degraded mode (KVW-STORE-25): when a node does not answer, its keys are misses for reads
(counted in ``stats.unavailable``) and ``StoreError`` for writes, while the other nodes
keep serving; the node is retried after ``retry_after`` seconds, so a dead node costs one
timeout, not one per call. ``MOVED`` replies (slots moved) refresh the slot map and retry
once; ``ASK`` replies (a slot being migrated) are followed with ``ASKING``.
"""

from __future__ import annotations

import threading
import time
from binascii import crc_hqx
from collections.abc import Iterable, Sequence
from typing import Any

from .base import Store, StoreError, check_keys
from .redis import DEFAULT_TIMEOUT, MISSING, Node, RedisStore, check_timeout, import_redis, parse_host
from .redis_url import RedisURL, TLSOptions, parse_redis_url

SLOTS = 16384
# Position of the first of ARGV (this node's keys, in the request's order) that is missing.
# The keys are passed as arguments, not KEYS: a node's keys lie in many slots, which Redis
# (>= 7.0) lets a script flagged allow-cross-slot-keys read as long as they are local.
NODE_LEADING_SCRIPT = b"#!lua flags=allow-cross-slot-keys,no-writes\n" \
                      b"for i, k in ipairs(ARGV) do if redis.call('EXISTS', k) == 0 then return i - 1 end end " \
                      b"return #ARGV"


class RedisClusterStore(RedisStore):
    """A store on a Redis Cluster, found from one or more seed nodes; with ``tls`` (a
    ``TLSOptions``) every master is reached over TLS with the same options
    (``rediss-cluster://``, KVW-STORE-41). ``url`` is redacted (KVW-STORE-39)."""

    def __init__(self, seeds: Iterable[tuple[str, int]], *, timeout: float = DEFAULT_TIMEOUT,
                 connect_timeout: float | None = None, username: str | None = None, password: str | None = None,
                 retry_after: float = 1.0, tls: TLSOptions | None = None):
        Store.__init__(self)
        seeds = [(str(h), int(p)) for h, p in seeds]
        if not seeds:
            raise ValueError("a Redis Cluster store needs at least one seed node host:port")
        self.timeout, self.retry_after = check_timeout(timeout), check_timeout(retry_after)
        if connect_timeout is not None:
            check_timeout(connect_timeout)
        self.url = RedisURL("rediss-cluster" if tls else "redis-cluster", seeds, 0, username, password, tls=tls).url
        self._opts: dict[str, Any] = dict(timeout=timeout, connect_timeout=connect_timeout, username=username, password=password,
                          ssl_context=tls.context(self.url) if tls else None,
                          server_name=tls.server_name if tls else None)
        import_redis()
        self._seeds = [f"{h}:{p}" for h, p in seeds]
        self._nodes: dict[str, Node] = {}
        self._down: dict[str, float] = {}
        self._slots: list[str | None] = [None] * SLOTS
        self._lock = threading.Lock()
        self.refresh()

    # -- topology ------------------------------------------------------------------------
    def node_at(self, addr: str) -> Node:
        with self._lock:
            node = self._nodes.get(addr)
            if node is None:
                host, port = parse_host(addr, self.url)
                node = self._nodes[addr] = Node(host, port, 0, **self._opts)
            return node

    def refresh(self) -> None:
        """Read the slot map (CLUSTER SLOTS) from the first node that answers."""
        errors = []
        for addr in dict.fromkeys([*(a for a in self._slots if a), *self._seeds]):
            if self.is_down(addr):
                continue
            try:
                reply = self.node_at(addr).execute([["CLUSTER", "SLOTS"]])[0]
            except StoreError as exc:
                self.mark_down(addr)
                errors.append(str(exc))
                continue
            self.count(round_trips=1)
            if isinstance(reply, Exception):
                raise StoreError(f"{self.url}: {addr} is not a cluster node: {reply}")
            self._slots = self.slot_map(reply, addr)
            return
        raise StoreError(f"{self.url}: no seed node answered CLUSTER SLOTS: {'; '.join(errors) or 'all marked down'}")

    def slot_map(self, reply: Any, addr: str) -> list:
        """The owner ("host:port") of each slot from a CLUSTER SLOTS reply; a reply that is
        not one is a StoreError (KVW-STORE-40), never a wrong map."""
        slots: list[str | None] = [None] * SLOTS
        try:
            for start, stop, master, *_ in reply:
                host = master[0].decode("ascii") if isinstance(master[0], bytes) else str(master[0])
                start, stop, port = int(start), int(stop), int(master[1])
                if not 0 <= start <= stop < SLOTS or not 0 < port < 65536:
                    raise ValueError(f"slots {start}..{stop} on port {port}")
                slots[start:stop + 1] = [f"{host or addr.rpartition(':')[0]}:{port}"] * (stop - start + 1)
        except (TypeError, ValueError, IndexError, UnicodeDecodeError) as exc:
            raise StoreError(f"{self.url}: {addr} answered CLUSTER SLOTS with something else ({exc}): is it a "
                             "Redis Cluster node?") from None
        return slots

    def is_down(self, addr: str) -> bool:
        until = self._down.get(addr)
        return until is not None and time.monotonic() < until

    def mark_down(self, addr: str) -> None:
        self._down[addr] = time.monotonic() + self.retry_after

    def nodes(self) -> list[Node]:
        return [self.node_at(a) for a in dict.fromkeys(a for a in self._slots if a)]

    @staticmethod
    def slot(key: str) -> int:
        """The key's hash slot: CRC16 (XMODEM) mod 16384. Store keys have no "{" (KVW-STORE-2),
        so there is never a hash tag and the whole key is hashed."""
        return crc_hqx(key.encode("ascii"), 0) & (SLOTS - 1)

    # -- one round trip per node ---------------------------------------------------------
    def run(self, commands: Sequence[list], keys: Sequence[str]) -> list:
        replies = self.dispatch(commands, keys)
        moved = [i for i, r in enumerate(replies) if isinstance(r, Exception) and str(r).startswith("MOVED")]
        if moved:
            self.refresh()
            again = self.dispatch([commands[i] for i in moved], [keys[i] for i in moved])
            for i, r in zip(moved, again):
                replies[i] = r
        for i, r in enumerate(replies):
            if isinstance(r, Exception) and str(r).startswith("ASK "):
                target = str(r).split()[2]
                try:
                    replies[i] = self.node_at(target).execute([["ASKING"], commands[i]])[1]
                    self.count(round_trips=1)
                except StoreError:
                    replies[i] = MISSING
        return replies

    def dispatch(self, commands: Sequence[list], keys: Sequence[str]) -> list:
        groups: dict[str | None, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(self._slots[self.slot(key)], []).append(i)
        replies: list = [MISSING] * len(commands)
        jobs = list(groups.items())
        results = self.fan_out([(addr, [commands[i] for i in idx]) for addr, idx in jobs])
        for (_addr, idx), got in zip(jobs, results):
            if got is None:
                self.count(unavailable=len({keys[i] for i in idx}))  # keys, not commands (a range sends four)
                continue
            self.count(round_trips=1)
            for i, r in zip(idx, got):
                replies[i] = r
        return replies

    def fan_out(self, batches: Sequence[tuple[str | None, list]]) -> list:
        """Send every node its batch, then read every node's replies: the nodes work at
        once, in one round trip. A node that is down (or fails) answers None."""
        started = []
        for addr, cmds in batches:
            conn = None
            if addr is not None and not self.is_down(addr):
                try:
                    conn = self.node_at(addr).begin(cmds)
                except StoreError:
                    self.mark_down(addr)
            started.append(conn)
        out = []
        for (addr, cmds), conn in zip(batches, started):
            got = None
            if conn is not None and addr is not None:
                try:
                    got = self.node_at(addr).finish(conn, len(cmds))
                except StoreError:
                    self.mark_down(addr)
            out.append(got)
        return out

    def leading(self, keys: Sequence[str]) -> int:
        """Leading keys that exist: every node runs one script over its own keys, in
        parallel (one round trip per node), and answers the position of its first miss;
        the hits end at the earliest one. Keys on a down node are misses."""
        keys = check_keys(keys)
        self.count(exists_calls=1)
        if not keys:
            return 0
        groups: dict[str | None, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(self._slots[self.slot(key)], []).append(i)
        jobs = list(groups.items())
        results = [None if got is None else got[0] for got in self.fan_out(
            [(addr, [["EVAL", NODE_LEADING_SCRIPT, 0, *(keys[i] for i in idx)]]) for addr, idx in jobs])]
        first_miss = len(keys)
        for (addr, idx), got in zip(jobs, results):
            if got is None:
                self.count(unavailable=len(idx))
                first_miss = min(first_miss, idx[0])
                continue
            self.count(round_trips=1)
            if isinstance(got, Exception):  # slots moved under us: the per-key path follows MOVED
                return Store.leading(self, keys)
            if not isinstance(got, int) or not 0 <= got <= len(idx):
                raise StoreError(f"{self.url}: {addr} answered the hit query with {got!r} for {len(idx)} keys: "
                                 "is it a Redis server?")
            if int(got) < len(idx):
                first_miss = min(first_miss, idx[int(got)])
        return first_miss

    def list(self, prefix: str = "") -> list[str]:
        keys: set[str] = set()
        for addr in dict.fromkeys(a for a in self._slots if a):
            if self.is_down(addr):
                self.count(unavailable=1)
                continue
            try:
                keys.update(RedisStore.scan(self, self.node_at(addr), prefix))
            except StoreError:
                self.mark_down(addr)
                self.count(unavailable=1)
        return sorted(keys)



def open_cluster(url: str, **options) -> RedisClusterStore:
    """``redis-cluster://[user:password@]host:port[,host:port...]`` or ``rediss-cluster://``
    with the query parameters and keyword options of KVW-STORE-38 (timeout,
    connect_timeout, retry_after; on ``rediss-cluster://`` ca, cert, key, server_name)."""
    parsed = parse_redis_url(url, options)
    if not parsed.cluster:
        raise StoreError(f"{parsed.url}: not a cluster URL; open it with open_store")
    return RedisClusterStore(parsed.hosts, username=parsed.username, password=parsed.password, tls=parsed.tls,
                             **parsed.options)


__all__ = ["RedisClusterStore", "SLOTS", "open_cluster"]
