"""Real Redis servers for the tests: one plain server or a three-master cluster on free
loopback ports, started from the ``redis-server`` binary and stopped however a test ends.

Why not mocks: the Redis backend's promises (whole-object puts, one round trip per batch,
a dead or silent server is a ``StoreError`` within the timeout, a cluster keeps serving
with one master down) are promises about a real server's behaviour, so they are tested
against one. Every process started here is registered and killed at interpreter exit
(``atexit``), by fixture finalizers, and on Linux by the kernel when the test process dies
(``PR_SET_PDEATHSIG``, for servers started from the main thread: the signal follows the
thread that started the process), so a failing or interrupted run leaves no server behind.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # redisfakes imports this module
    from redisfakes import Certs

INSTALL_HINT = "redis-server is not installed: apt-get install redis-server (make test installs it)"
START_TIMEOUT = 10.0
SLOTS = 16384
BUS_OFFSET = 10000  # a cluster node's bus port is its port + 10000

_live: set = set()  # every RedisServer whose process may be running
_live_lock = threading.Lock()


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port(*, cluster: bool = False) -> int:
    """A port that was free a moment ago (bind to port 0); callers retry a start that
    loses the race to another process. A cluster node also needs its bus port, port + 10000,
    so its port is at most 55535 and both are checked (below the usual ephemeral range)."""
    if not cluster:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 30000)
        if _bindable(port) and _bindable(port + BUS_OFFSET):
            return port
    raise RuntimeError("no free port pair (port, port + 10000) for a cluster node in 20000..40000")


def redis_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        pytest.fail(INSTALL_HINT)
    return path


def redis_module():
    """redis-py, for raw clients that set up and inspect a server; a missing one fails."""
    try:
        import redis
    except ImportError:
        pytest.fail("redis-py is not installed: pip install -e '.[redis]' (make test installs it)")
    return redis


def ping(port: int, timeout: float = 0.5, tls: Certs | None = None) -> bool:
    """Whether a server answers PING with PONG or NOAUTH (not -LOADING while it replays its AOF);
    over TLS with ``tls``'s CA and client certificate (redisfakes.Certs)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as raw:
            s = tls.client_context().wrap_socket(raw, server_hostname="127.0.0.1") if tls else raw
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))  # NOAUTH: up, with requirepass
    except OSError:
        return False


try:  # resolved once here: the child runs only the foreign call between fork and exec
    _prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
except (OSError, AttributeError):
    _prctl = None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1 with its files under ``dirpath``."""

    def __init__(self, dirpath, *, appendonly: bool = False, maxmemory=None, policy=None, cluster: bool = False,
                 extra=(), port: int | None = None, tls: Certs | None = None, client_certs: bool = False):
        """``tls``: serve TLS only (``--port 0 --tls-port``) with these certificates;
        ``client_certs``: and require a client certificate (``--tls-auth-clients yes``)."""
        self.dir = os.path.abspath(os.fspath(dirpath))
        self.tls, self.client_certs = tls, client_certs
        self.appendonly, self.maxmemory, self.policy = appendonly, maxmemory, policy
        self.cluster, self.extra = cluster, tuple(extra)
        self._port = port
        self.proc: subprocess.Popen | None = None
        self.log = os.path.join(self.dir, "redis.log")

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the server has no port before start()")
        return self._port

    @property
    def url(self) -> str:
        if self.tls is not None:
            return f"rediss://127.0.0.1:{self.port}/0?ca={self.tls.ca}"
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def argv(self) -> list:
        a = [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir, "--save", "",
             "--protected-mode", "no", "--daemonize", "no", "--logfile", self.log]
        if self.tls is not None:
            a[1:3] = ["--port", "0", "--tls-port", str(self.port)]
            a += ["--tls-cert-file", self.tls.server_cert, "--tls-key-file", self.tls.server_key,
                  "--tls-ca-cert-file", self.tls.ca, "--tls-auth-clients", "yes" if self.client_certs else "no"]
            if self.cluster:
                a += ["--tls-cluster", "yes"]
        if self.appendonly:
            a += ["--appendonly", "yes", "--appendfsync", "always"]
        if self.maxmemory is not None:
            a += ["--maxmemory", str(self.maxmemory)]
        if self.policy is not None:
            a += ["--maxmemory-policy", self.policy]
        if self.cluster:
            a += ["--cluster-enabled", "yes", "--cluster-config-file", os.path.join(self.dir, "nodes.conf"),
                  "--cluster-node-timeout", "1000", "--cluster-require-full-coverage", "no",
                  "--cluster-allow-reads-when-down", "yes"]
        return a + list(self.extra)

    def start(self) -> RedisServer:
        """Start on the given port (a restart) or on a free one, retrying another free
        port when the chosen one was taken meanwhile; wait until it answers PING."""
        if self.running:
            return self
        os.makedirs(self.dir, exist_ok=True)
        fixed = self._port is not None
        for attempt in range(8):
            if not fixed:
                self._port = free_port(cluster=self.cluster)
            offset = os.path.getsize(self.log) if os.path.exists(self.log) else 0
            self.proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.PIPE,
                                         preexec_fn=_die_with_parent if _prctl is not None and
                                         threading.current_thread() is threading.main_thread() else None)
            with _live_lock:
                _live.add(self)
            state = self._wait_ready()
            if state == "ok":
                return self
            tail = self.log_tail(offset)
            if state == "exited" and "in use" in tail and not (fixed and attempt >= 4):
                time.sleep(0.1 * (attempt + 1))  # lost the port race (or a restart's port lingers): retry
                continue
            self.kill()
            pytest.fail(f"redis-server on port {self._port} did not start ({state}); log tail:\n{tail}")
        pytest.fail(f"redis-server found no free port in 8 tries; log tail:\n{self.log_tail()}")

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                if err:
                    with open(self.log, "a") as f:
                        f.write(err)
                with _live_lock:
                    _live.discard(self)
                return "exited"
            if ping(self._port, tls=self.tls):
                return "ok"
            time.sleep(0.02)
        return f"no PONG within {START_TIMEOUT:.0f} s"

    def log_tail(self, offset: int = 0, lines: int = 30) -> str:
        try:
            with open(self.log, "rb") as f:
                f.seek(offset)
                return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _end(self, sig: int, wait: float = 10.0) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.kill(proc.pid, sig)
                if sig != signal.SIGKILL:
                    os.kill(proc.pid, signal.SIGCONT)  # a paused server handles SIGTERM only once continued
            except ProcessLookupError:
                pass
            try:
                proc.wait(wait)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if proc.stderr:
            proc.stderr.close()
        with _live_lock:
            _live.discard(self)

    def kill(self) -> None:
        """SIGKILL: the server dies at once, as in a crash (nothing is flushed beyond
        what appendfsync already wrote)."""
        self._end(signal.SIGKILL)

    def stop(self) -> None:
        """SIGTERM: an orderly shutdown."""
        self._end(signal.SIGTERM)

    def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing (a hung server)."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def restart(self) -> RedisServer:
        """Start again on the same port and directory (an AOF server replays its log)."""
        if self.running:
            self.stop()
        return self.start()

    def client(self, **kw):
        """A raw redis-py client for test setup and inspection (not the code under test)."""
        kw.setdefault("socket_timeout", 10)
        if self.tls is not None:
            kw = {**self.tls.redis_py(), **kw}
        return redis_module().Redis(host="127.0.0.1", port=self.port, **kw)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()


class RedisCluster:
    """``masters`` cluster-enabled servers, every slot assigned, each node agreeing."""

    def __init__(self, dirpath, masters: int = 3, *, tls: Certs | None = None):
        self.dir = os.path.abspath(os.fspath(dirpath))
        self.tls = tls
        self.nodes = [RedisServer(os.path.join(self.dir, f"node{i}"), cluster=True, tls=tls) for i in range(masters)]
        self.ranges: list[tuple[int, int]] = []  # [first, last] slots of each node

    @property
    def url(self) -> str:
        if self.tls is not None:
            return "rediss-cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes) + f"?ca={self.tls.ca}"
        return "redis-cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> RedisCluster:
        for n in self.nodes:
            n.start()
        m = len(self.nodes)
        self.ranges = [(i * SLOTS // m, (i + 1) * SLOTS // m - 1) for i in range(m)]
        clients = [n.client() for n in self.nodes]
        try:
            for c, (lo, hi) in zip(clients, self.ranges):
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
            for n in self.nodes[1:]:
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", n.port)
        finally:
            for c in clients:
                c.close()
        return self.wait_ok()

    def wait_ok(self, timeout: float = 20.0) -> RedisCluster:
        """Until every node reports cluster_state:ok, all slots and all nodes known."""
        want = {"cluster_state": "ok", "cluster_slots_assigned": str(SLOTS), "cluster_known_nodes": str(len(self.nodes))}
        deadline, last = time.monotonic() + timeout, {}
        while time.monotonic() < deadline:
            last = {}
            for i, n in enumerate(self.nodes):
                c = n.client(socket_timeout=2)
                try:
                    text = c.execute_command("CLUSTER", "INFO")
                    text = text.decode() if isinstance(text, bytes) else text
                    last[i] = dict(line.split(":", 1) for line in text.split() if ":" in line)
                except (redis_module().RedisError, OSError) as exc:  # still starting: keep waiting
                    last[i] = {"error": repr(exc)}
                finally:
                    c.close()
            if all(all(info.get(k) == v for k, v in want.items()) for info in last.values()):
                return self
            time.sleep(0.1)
        logs = "\n".join(f"--- node {i} (port {n.port})\n{n.log_tail()}" for i, n in enumerate(self.nodes))
        pytest.fail(f"the Redis cluster did not become ok within {timeout:.0f} s: {last}\n{logs}")

    def kill(self, i: int) -> None:
        self.nodes[i].kill()

    def stop(self) -> None:
        for n in self.nodes:
            n.kill()

    def keyslot(self, key: str) -> int:
        for n in self.nodes:
            if n.running:
                c = n.client()
                try:
                    return int(c.execute_command("CLUSTER", "KEYSLOT", key))
                finally:
                    c.close()
        raise RuntimeError("no node of the cluster is running")

    def node_for_key(self, key: str) -> int:
        """Index in ``nodes`` of the master that owns ``key``'s slot."""
        slot = self.keyslot(key)
        return next(i for i, (lo, hi) in enumerate(self.ranges) if lo <= slot <= hi)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _kill_all() -> None:
    with _live_lock:
        servers = list(_live)
    for s in servers:
        s.kill()


atexit.register(_kill_all)


class SilentServer:
    """A TCP listener that accepts connections and never answers: a hung server."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns: list = []
        self._stop = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.serve(conn)

    def serve(self, conn) -> None:
        """What happens to an accepted connection: kept open, never read from or written to
        (subclasses answer otherwise)."""
        self.conns.append(conn)

    def close(self) -> None:
        self._stop = True
        self.thread.join(2)
        for c in self.conns:
            c.close()
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["INSTALL_HINT", "RedisCluster", "RedisServer", "SilentServer", "free_port", "ping", "redis_binary",
           "redis_module"]
