"""Redis stores over TLS (spec/store.md section 8.1, KVW-STORE-36, 37, 41) against real
``redis-server`` processes serving TLS only (``--port 0 --tls-port``), with a CA, a server
and a client certificate made by the ``openssl`` CLI in the test's own directory: a round
trip on one server and on a three-master cluster, and every way the handshake must fail
(an untrusted CA, a wrong name, a missing client certificate, the wrong side of TLS) as a
``StoreError`` within the timeout, never a plaintext fallback."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
from test_store import check_kvstore_round_trip

from kvwire.store import StoreError, open_store
from kvwire.store.cluster import RedisClusterStore
from kvwire.store.redis import RedisStore
from redisfakes import make_certs
from redisfix import RedisCluster, RedisServer

TIMEOUT = 2.0


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory, certs):
    """A TLS-only server that does not ask for client certificates."""
    with RedisServer(tmp_path_factory.mktemp("redis-tls"), tls=certs) as server:
        yield server


@pytest.fixture(scope="module")
def mtls_server(tmp_path_factory, certs):
    """A TLS-only server that requires a client certificate signed by the CA."""
    with RedisServer(tmp_path_factory.mktemp("redis-mtls"), tls=certs, client_certs=True) as server:
        yield server


def tls_url(server, **params) -> str:
    query = "&".join(f"{k}={v}" for k, v in params.items())
    return f"rediss://127.0.0.1:{server.port}/0" + (f"?{query}" if query else "")


def test_store36_round_trip_over_tls(tls_server, certs):
    """KVW-STORE-36: rediss:// with ca= stores and loads objects and whole caches on a
    server that speaks TLS only (it has no plaintext port, so nothing can go around TLS);
    the batches' pipelined path and the hit-query script run over TLS too."""
    with open_store(tls_url(tls_server, ca=certs.ca), timeout=TIMEOUT) as s:
        assert type(s) is RedisStore and s.url == tls_url(tls_server, ca=certs.ca)
        big = np.random.default_rng(0).integers(0, 255, 3 << 20, dtype=np.uint8)
        assert s.put_many([("t/1", b"one"), ("t/2", [memoryview(big[:100]), memoryview(big[100:])])]) == [True] * 2
        assert s.get("t/1") == b"one" and s.get("t/2") == big.tobytes() and s.get("t/2", (5, 10)) == big[5:15].tobytes()
        assert s.leading(["t/1", "t/2", "t/3"]) == 2 and s.list("t/") == ["t/1", "t/2"]
    url = f"rediss://127.0.0.1:{tls_server.port}/1?ca={certs.ca}&server_name=localhost"  # database 1: empty
    with open_store(url, timeout=TIMEOUT) as s:
        check_kvstore_round_trip(s)  # KVStore's chunk caches, bit for bit
    with tls_server.client() as admin:  # the objects are on the server, unchanged
        assert admin.get("t/1") == b"one"


def test_store37_untrusted_ca_is_refused(tls_server, certs):
    """KVW-STORE-37: a server whose certificate does not chain to ca= is refused: a
    StoreError naming the certificate check, and nothing is written."""
    with open_store(tls_url(tls_server, ca=certs.other_ca), timeout=TIMEOUT) as s:
        with pytest.raises(StoreError, match=r"TLS.*certificate.*refused.*no plaintext"):
            s.put("untrusted/1", b"x")
    with open_store(tls_url(tls_server), timeout=TIMEOUT) as s:  # the system trust store does not know the CA
        with pytest.raises(StoreError, match="certificate"):
            s.get("untrusted/1")
    with tls_server.client() as admin:
        assert admin.exists("untrusted/1") == 0


def test_store37_wrong_server_name_is_refused(tls_server, certs):
    """KVW-STORE-37: the certificate is for 127.0.0.1 and localhost; server_name=other is a
    name mismatch, refused, even for a name that another certificate of the same CA holds."""
    with open_store(tls_url(tls_server, ca=certs.ca, server_name="db.example.org"), timeout=TIMEOUT) as s:
        with pytest.raises(StoreError, match=r"certificate.*(mismatch|not valid)"):
            s.get("a")
    with open_store(tls_url(tls_server, ca=certs.ca, server_name="kvwire-client"), timeout=TIMEOUT) as s:
        with pytest.raises(StoreError, match="certificate"):  # the client's name, signed by the same CA
            s.get("a")


def test_store37_client_certificate_required(mtls_server, certs):
    """KVW-STORE-36/37: a server run with tls-auth-clients yes refuses a client without a
    certificate (a StoreError, not a hang); with cert= and key= it serves."""
    start = time.monotonic()
    with open_store(tls_url(mtls_server, ca=certs.ca), timeout=TIMEOUT) as s:
        with pytest.raises(StoreError, match="client certificate.*give cert= and key="):
            s.put("m/1", b"x")
    assert time.monotonic() - start < TIMEOUT + 30  # timed out, did not hang (generous: a loaded CI machine)
    url = tls_url(mtls_server, ca=certs.ca, cert=certs.client_cert, key=certs.client_key)
    with open_store(url, timeout=TIMEOUT) as s:
        assert s.put("m/1", b"x") and s.get("m/1") == b"x"


def test_store37_plaintext_client_on_a_tls_port_fails_fast(tls_server):
    """KVW-STORE-37/40: redis:// to a TLS-only port: the server drops the connection; a
    StoreError that names rediss://, within the timeout."""
    start = time.monotonic()
    with open_store(f"redis://127.0.0.1:{tls_server.port}/0", timeout=TIMEOUT) as s:
        with pytest.raises(StoreError, match="rediss://"):
            s.get("a")
    assert time.monotonic() - start < TIMEOUT + 30  # timed out, did not hang (generous: a loaded CI machine)


def test_store37_tls_client_on_a_plaintext_port_fails(redis_url, redis_server, certs):
    """KVW-STORE-37: rediss:// to a plaintext server: the handshake gets no answer (Redis
    waits for the rest of a command); a StoreError within the timeout that says so, and
    never a retry in plaintext (the object is not written)."""
    start = time.monotonic()
    with open_store(f"rediss://127.0.0.1:{redis_server.port}/0?ca={certs.ca}", timeout=TIMEOUT) as s:
        with pytest.raises(StoreError, match="TLS handshake: is this a plaintext port"):
            s.put("plain/1", b"x")
    assert time.monotonic() - start < TIMEOUT + 30  # timed out, did not hang (generous: a loaded CI machine)
    with redis_server.client() as admin:
        assert admin.exists("plain/1") == 0


def test_store36_bad_certificate_files_fail_when_opened(tmp_path, certs):
    """KVW-STORE-36: a CA or client certificate that cannot be loaded is a StoreError when
    the store is opened, naming the parameter; key= without cert= is refused."""
    missing = tmp_path / "none.pem"
    with pytest.raises(StoreError, match="ca="):
        open_store(f"rediss://127.0.0.1:1/0?ca={missing}")
    with pytest.raises(StoreError, match="cert="):
        open_store(f"rediss://127.0.0.1:1/0?ca={certs.ca}&cert={certs.ca}")  # a certificate with no key
    with pytest.raises(StoreError, match="key= needs cert="):
        open_store(f"rediss://127.0.0.1:1/0?key={certs.client_key}")


def test_store41_cluster_over_tls(tmp_path, certs):
    """KVW-STORE-41: rediss-cluster:// reaches every master over TLS (tls-cluster yes; the
    servers have no plaintext port), one round trip per master per batch; an untrusted CA
    leaves no master reachable."""
    with RedisCluster(tmp_path / "cluster", tls=certs) as cluster:
        with open_store(cluster.url, timeout=TIMEOUT) as s:
            assert type(s) is RedisClusterStore and len(s.nodes()) == 3
            assert s.url.startswith("rediss-cluster://") and f"ca={certs.ca}" in s.url
            keys = [f"kvw1/tls/{i}" for i in range(60)]
            before = s.stats.round_trips
            assert all(s.put_many([(k, k.encode()) for k in keys]))
            assert s.stats.round_trips - before == 3
            assert s.leading(keys) == 60 and s.get_many(keys[:3]) == [k.encode() for k in keys[:3]]
            assert s.list("kvw1/tls/") == sorted(keys)
        with pytest.raises(StoreError, match="certificate"):
            open_store(cluster.url.replace(certs.ca, certs.other_ca), timeout=TIMEOUT)


def test_tls_port_is_tls_only(tls_server):
    """The fixture's premise: the TLS server has no plaintext listener on its port (a raw
    PING gets no PONG)."""
    with socket.create_connection(("127.0.0.1", tls_server.port), timeout=TIMEOUT) as raw:
        raw.sendall(b"PING\r\n")
        try:
            answer = raw.recv(64)
        except OSError:
            answer = b""
    assert not answer.startswith(b"+PONG")
