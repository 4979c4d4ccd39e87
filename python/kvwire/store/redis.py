"""``RedisStore`` ("redis://HOST:PORT/DB"): the shared store of many inference nodes.

Why Redis: it is the distributed key/value engine that runs everywhere (and on this
project's test machines as Debian's ``redis-server``), LMCache already shares KV caches
through it, and its commands map one to one onto the store protocol (spec/store.md,
KVW-STORE-21..26):

- ``put`` is ``SET key value NX``: Redis applies a command whole or not at all, so a
  reader never sees part of an object, and ``NX`` keeps the first writer's object;
- a read is ``GETRANGE`` slices of at most 1 MiB after ``EXISTS`` (which tells a missing
  key from an empty range) in one ``MULTI``/``EXEC`` transaction, a batch of reads round
  trips of at most 16 MiB of replies (``redis_reads``: Redis answers large replies several
  times slower);
- every other batch (``put_many``, ``exists_many``, ``sizes``) is one pipelined round
  trip, and the hit query ``leading`` is one script that stops at the first miss
  server-side and reads no object bytes.

The client is redis-py (the optional extra ``kvwire[redis]``, imported here only), used at
the connection level: commands are packed by this module so that a put sends the
encoder's buffers to the socket as they are (large buffers as memoryviews, never joined
into one Python bytes object), and the round trips are counted in ``stats.round_trips``.
Every call has a socket timeout; a dead, killed or silent server is a ``StoreError``
within it, never a hang. ``kvwire.store.cluster`` routes the same commands per node.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Iterable, Sequence
from typing import Any

from .base import ByteRange, PutValue, Store, StoreError, as_buffers, check_key, check_keys
from .redis_conn import describe_failure, import_redis, tls_connection_class
from .redis_reads import SLICE_BYTES, TRIP_BYTES, Read, answer, first_read, trips
from .redis_url import RedisURL, TLSOptions, parse_host, parse_redis_url

DEFAULT_TIMEOUT = 5.0
COALESCE = 64 << 10  # buffers smaller than this are joined into the command's framing
SCAN_COUNT = 1000
BATCH_KEYS = 4096  # keys per pipelined batch in listings and sizes

# How many leading KEYS exist, reading no value bytes: one native EXISTS answers a full hit;
# otherwise key by key, stopping at the first miss.
LEADING_SCRIPT = b"local n = redis.call('EXISTS', unpack(KEYS)) if n == #KEYS then return n end " \
                 b"for i, k in ipairs(KEYS) do if redis.call('EXISTS', k) == 0 then return i - 1 end end " \
                 b"return #KEYS"
# Size of KEYS[1], -1 for a miss (STRLEN alone answers 0 to both).
SIZE_SCRIPT = b"if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end return redis.call('STRLEN', KEYS[1])"


def pack(args) -> list:
    """One RESP command as a list of byte chunks: the framing and small arguments joined,
    every large buffer passed through as a memoryview (no copy)."""
    args = [a.encode() if isinstance(a, str) else b"%d" % a if isinstance(a, int) else a for a in args]
    if not any(isinstance(a, (list, memoryview)) for a in args):  # the usual case: one join
        return [b"*%d\r\n" % len(args) + b"".join([b"$%d\r\n%b\r\n" % (len(a), a) for a in args])]
    head: list[bytes | memoryview] = [b"*%d\r\n" % len(args)]
    out: list[bytes | memoryview] = []
    for arg in args:
        bufs = arg if isinstance(arg, list) else [arg]  # a value may come as several buffers
        head.append(b"$%d\r\n" % sum(memoryview(b).nbytes for b in bufs))
        for b in bufs:
            if isinstance(b, memoryview) and b.nbytes >= COALESCE:
                out.append(b"".join(head))
                out.append(b)
                head = []
            else:
                head.append(b)
        head.append(b"\r\n")
    out.append(b"".join(head))
    return out


class Node:
    """One Redis server: a connection pool and ``execute(commands)``, which sends a batch
    of commands in one write and reads their replies (one round trip). Replies that are
    Redis errors come back as exception objects in their place; any other failure (the
    connection, TLS, authentication, the database, a reply that is not Redis protocol)
    raises ``StoreError`` after dropping the connection (KVW-STORE-40)."""

    def __init__(self, host: str, port: int, db: int = 0, *, timeout: float = DEFAULT_TIMEOUT,
                 connect_timeout: float | None = None, username=None, password=None, ssl_context=None,
                 server_name=None):
        redis = import_redis()
        from redis.backoff import NoBackoff
        from redis.retry import Retry
        self.addr = f"{host}:{port}"
        self.tls, self.has_password = ssl_context is not None, password is not None
        # every redis-py failure and a socket's, then what a parser may raise on a garbled reply
        self._errors = (redis.RedisError, OSError, ValueError, TypeError, IndexError)
        self._response_error = redis.ResponseError
        extra = dict(connection_class=tls_connection_class(), ssl_context=ssl_context,
                     server_name=server_name) if ssl_context is not None else {}
        self.pool = redis.ConnectionPool(
            host=host, port=port, db=db, username=username, password=password, socket_timeout=timeout,
            socket_connect_timeout=connect_timeout if connect_timeout is not None else timeout,
            retry=Retry(NoBackoff(), 0), health_check_interval=0, **extra)

    def failure(self, exc, doing: str) -> StoreError:
        what = describe_failure(exc, tls=self.tls, password=self.has_password)
        return StoreError(f"redis {self.addr}{' (TLS)' if self.tls else ''}: {doing}{what}")

    def execute(self, commands) -> list:
        return self.finish(self.begin(commands), len(commands))

    def begin(self, commands):
        """Send a batch; the replies are read by ``finish``. Between the two, other nodes
        can be sent their batches, so a cluster's nodes work at once without threads."""
        try:
            try:
                conn = self.pool.get_connection()
            except TypeError:  # redis-py before 5.3 wants a command name
                conn = self.pool.get_connection("kvwire")
        except self._errors as exc:
            raise self.failure(exc, "") from exc
        try:
            conn.send_packed_command([c for cmd in commands for c in pack(cmd)], check_health=False)
        except BaseException as exc:
            self.drop(conn)
            if isinstance(exc, self._errors[:2]):  # the connection's, not pack's (a bug is not a store failure)
                raise self.failure(exc, "sending failed (a SET applies whole or not at all: no partial "
                                        "object is stored): ") from exc
            raise
        return conn

    def finish(self, conn, n: int) -> list:
        try:
            replies = []
            for _ in range(n):
                try:
                    replies.append(conn.read_response(disable_decoding=True))
                except self._response_error as exc:
                    replies.append(exc)
        except BaseException as exc:
            self.drop(conn)  # interrupted mid-batch: the connection's state is unknown
            if isinstance(exc, self._errors):
                raise self.failure(exc, "") from exc
            raise
        self.pool.release(conn)
        return replies

    def drop(self, conn) -> None:
        try:
            conn.disconnect()
        finally:
            self.pool.release(conn)

    def close(self) -> None:
        self.pool.disconnect()


def check_timeout(timeout) -> float:
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be a positive, finite number of seconds, not {timeout!r}")
    return float(timeout)


def check_prefix(prefix: str) -> str:
    if not isinstance(prefix, str) or any(not (c.isascii() and (c.isalnum() or c in "._-/")) for c in prefix):
        raise ValueError(f"a list prefix is made of key characters [A-Za-z0-9._-/], not {prefix!r}")
    return prefix


class RedisStore(Store):
    """A store on one Redis server (``redis://[user:password@]host:port/db``, or
    ``rediss://`` with ``tls``, a ``TLSOptions``). ``url`` is the redacted URL
    (KVW-STORE-39): what messages, logs and statistics print."""

    slice_bytes = SLICE_BYTES  # the reads' shape (KVW-STORE-22, 23); an instance may set its own
    trip_bytes = TRIP_BYTES

    def __init__(self, host: str = "127.0.0.1", port: int = 6379, db: int = 0, *, timeout: float = DEFAULT_TIMEOUT,
                 connect_timeout: float | None = None, username: str | None = None, password: str | None = None,
                 tls: TLSOptions | None = None):
        super().__init__()
        self.timeout = check_timeout(timeout)
        if connect_timeout is not None:
            check_timeout(connect_timeout)
        self.url = RedisURL("rediss" if tls else "redis", [(host, port)], db, username, password, tls=tls).url
        self.node = Node(host, port, db, timeout=timeout, connect_timeout=connect_timeout, username=username,
                         password=password, ssl_context=tls.context(self.url) if tls else None,
                         server_name=tls.server_name if tls else None)

    # -- routing: one server answers everything (the cluster overrides these two) ---------
    def run(self, commands: Sequence[list], keys: Sequence[str]) -> list:
        """Replies of ``commands`` (one per key of ``keys``), one round trip per node."""
        replies = self.node.execute(commands)
        self.count(round_trips=1)
        return replies

    def nodes(self) -> list[Node]:
        return [self.node]

    def raise_error(self, reply: Any, key: str, kinds: type | tuple[type, ...] | None = None) -> Any:
        """``reply``, unless it is an error reply or (with ``kinds``) not of the type the
        command answers: a StoreError, never a value passed on (KVW-STORE-40)."""
        if isinstance(reply, Exception):
            raise StoreError(f"{self.url}: redis refused the command for {key!r}: {reply}")
        if kinds is not None and not isinstance(reply, kinds):
            raise StoreError(f"{self.url}: the reply for {key!r} is of type {type(reply).__name__}, not what the "
                             "command answers: is this a Redis server?")
        return reply

    # -- reads ---------------------------------------------------------------------------
    def get(self, key: str, byte_range: ByteRange = None) -> bytes | None:
        return self.get_many([key], byte_range)[0]

    def get_many(self, keys: Sequence[str], byte_range: ByteRange = None) -> list:
        return self.get_ranges([(k, byte_range) for k in keys])

    def get_ranges(self, requests: Sequence[tuple[str, ByteRange]]) -> list:
        """Each read a transaction of ``GETRANGE`` slices, the batch in round trips of at
        most ``trip_bytes`` of replies; a read of unknown end a second trip when the object
        is longer than one slice (``redis_reads``: why, and the figures)."""
        requests = list(requests)
        keys = check_keys(k for k, _ in requests)
        out: list = [None] * len(keys)
        pending = [first_read(i, k, r, self.slice_bytes) for i, (k, (_, r)) in enumerate(zip(keys, requests))]
        while pending:
            again = []
            for group in trips(pending, self.trip_bytes):
                sent = [c for read in group for c in read.cmds]
                replies = self.run(sent, [read.key for read in group for _ in read.cmds])
                end = 0
                for read in group:
                    end += len(read.cmds)
                    value = self.transaction_answer(read, replies[end - len(read.cmds):end])
                    if isinstance(value, Read):
                        again.append(value)
                    else:
                        out[read.position] = value
            pending = again
        got = [v for v in out if v is not None]
        self.count(gets=len(keys), hits=len(got), misses=len(keys) - len(got), bytes_in=sum(map(len, got)))
        return out

    def transaction_answer(self, read: Read, replies: list) -> bytes | Read | None:
        """``answer`` of ``read`` from the replies of its commands: None where a cluster
        master did not answer (a miss, KVW-STORE-25); a Redis error reply (the transaction's
        own or one command's in it) or a reply of the wrong shape is a ``StoreError``."""
        if any(r is MISSING for r in replies):
            return None
        for r in replies:
            self.raise_error(r, read.key)
        reply = replies[-1]
        for r in reply if isinstance(reply, list) else []:
            self.raise_error(r, read.key)
        try:
            return answer(read, reply, self.slice_bytes)
        except TypeError:
            raise StoreError(f"{self.url}: the reply for {read.key!r} is not a transaction's: is this a Redis "
                             "server?") from None

    def exists(self, key: str) -> bool:
        return self.exists_many([key])[0]

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        keys = check_keys(keys)
        self.count(exists_calls=1)
        if not keys:
            return []
        replies = self.run([["EXISTS", k] for k in keys], keys)
        return [reply is not MISSING and bool(self.raise_error(reply, k, int)) for k, reply in zip(keys, replies)]

    def leading(self, keys: Sequence[str]) -> int:
        """One server-side script over the keys in order: stops at the first miss and reads
        no value bytes (KVW-STORE-5, KVW-STORE-23)."""
        keys = check_keys(keys)
        self.count(exists_calls=1)
        if not keys:
            return 0
        reply = self.node.execute([["EVAL", LEADING_SCRIPT, len(keys), *keys]])[0]
        self.count(round_trips=1)
        n = self.raise_error(reply, keys[0], int)
        if not 0 <= n <= len(keys):
            raise StoreError(f"{self.url}: the hit query answered {n} for {len(keys)} keys: is this a Redis server?")
        return n

    def sizes(self, keys: Sequence[str]) -> list:
        keys = check_keys(keys)
        out = []
        for i in range(0, len(keys), BATCH_KEYS):
            part = keys[i:i + BATCH_KEYS]
            replies = self.run([["EVAL", SIZE_SCRIPT, 1, k] for k in part], part)
            for k, r in zip(part, replies):
                n = -1 if r is MISSING else int(self.raise_error(r, k, int))
                out.append(None if n < 0 else n)
        return out

    def list(self, prefix: str = "") -> list[str]:
        return sorted(set(self.scan(self.node, prefix)))

    def scan(self, node: Node, prefix: str) -> builtins.list[str]:
        """The keys of one node starting with ``prefix`` (SCAN MATCH; never KEYS, which
        blocks the server)."""
        pattern = check_prefix(prefix).encode() + b"*"
        keys, cursor = [], b"0"
        while True:
            reply = node.execute([["SCAN", cursor, "MATCH", pattern, "COUNT", SCAN_COUNT]])[0]
            self.count(round_trips=1)
            reply = self.raise_error(reply, prefix, list)
            if len(reply) != 2 or not isinstance(reply[0], bytes) or not isinstance(reply[1], list) or not all(
                    isinstance(k, bytes) for k in reply[1]):
                raise StoreError(f"{self.url}: the reply to SCAN is not Redis's answer: is this a Redis server?")
            cursor, batch = reply
            keys += [k.decode("ascii", "replace") for k in batch]
            if cursor in (b"0", 0):
                return keys

    # -- writes --------------------------------------------------------------------------
    def put(self, key: str, value: PutValue) -> bool:
        return self.put_many([(key, value)])[0]

    def put_many(self, items: Iterable[tuple[str, PutValue]]) -> builtins.list[bool]:
        """All objects in one pipelined round trip per node; each is ``SET key value NX``."""
        items = [(check_key(k), as_buffers(v)) for k, v in items]
        if not items:
            return []
        keys = [k for k, _ in items]
        replies = self.run([["SET", k, bufs, "NX"] for k, bufs in items], keys)
        out, written, size = [], 0, 0
        for (key, bufs), reply in zip(items, replies):
            if reply is MISSING:
                raise StoreError(f"{self.url}: the node holding {key!r} is down; the object was not stored")
            ok = self.raise_error(reply, key, (bytes, type(None))) is not None
            out.append(ok)
            if ok:
                written += 1
                size += sum(b.nbytes for b in bufs)
        self.count(puts=len(items), written=written, skipped=len(items) - written, bytes_out=size)
        return out

    def delete(self, key: str) -> bool:
        key = check_key(key)
        reply = self.run([["DEL", key]], [key])[0]
        gone = reply is not MISSING and bool(self.raise_error(reply, key, int))
        self.count(deletes=int(gone))
        return gone

    # -- the server's own view -----------------------------------------------------------
    def server_info(self) -> dict:
        """Summed INFO counters of every node (memory, evictions, keyspace hits)."""
        total = dict(used_memory=0, maxmemory=0, evicted_keys=0, keyspace_hits=0, keyspace_misses=0, nodes=0)
        policy = set()
        for node in self.nodes():
            try:
                reply = node.execute([["INFO", "memory"], ["INFO", "stats"]])
            except StoreError:
                continue
            self.count(round_trips=1)
            fields = {}
            for part in reply:
                if not isinstance(part, bytes):
                    continue
                for line in part.decode("ascii", "replace").splitlines():
                    if ":" in line and not line.startswith("#"):
                        k, v = line.split(":", 1)
                        fields[k] = v.strip()
            total["nodes"] += 1
            for k in ("used_memory", "maxmemory", "evicted_keys", "keyspace_hits", "keyspace_misses"):
                value = fields.get(k, "0")
                total[k] += int(value) if value.isdigit() else 0
            policy.add(fields.get("maxmemory_policy", "?"))
        return {**total, "maxmemory_policy": ",".join(sorted(policy))}

    def info(self) -> dict:
        keys = self.list()
        sizes = self.sizes(keys)
        return {"url": self.url, "backend": type(self).__name__, "objects": sum(s is not None for s in sizes),
                "bytes": sum(s or 0 for s in sizes), **self.server_info()}

    def close(self) -> None:
        for node in self.nodes():
            node.close()


class Missing:
    """The reply in place of a command whose node is down in a degraded cluster."""

    def __repr__(self) -> str:
        return "MISSING"


MISSING = Missing()


def open_redis(url: str, **options) -> RedisStore:
    """``redis://[user:password@]host[:port][/db]`` or ``rediss://...`` with the query
    parameters and keyword options of KVW-STORE-38 (timeout, connect_timeout; on
    ``rediss://`` ca, cert, key, server_name). Anything else is a StoreError."""
    parsed = parse_redis_url(url, options)
    if parsed.cluster:
        raise StoreError(f"{parsed.url}: a cluster URL; open it with open_store")
    (host, port), = parsed.hosts
    return RedisStore(host, port, parsed.db, username=parsed.username, password=parsed.password, tls=parsed.tls,
                      **parsed.options)


__all__ = ["DEFAULT_TIMEOUT", "MISSING", "Node", "RedisStore", "check_timeout", "import_redis", "open_redis", "pack",
           "parse_host"]
