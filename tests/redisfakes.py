"""What the Redis tests need besides real servers (tests/redisfix.py): certificates made
with the ``openssl`` CLI for TLS servers, and a fake server on a loopback port that is not
Redis at all.

Why: TLS (spec/store.md KVW-STORE-36/37) is tested against a real ``redis-server`` serving
TLS only, which needs a CA, a server certificate for 127.0.0.1 and a client certificate;
they are made in a directory the test created, never from files outside it. The failure
mapping (KVW-STORE-40) needs peers that misbehave in ways a real server does not (junk
bytes, a closed or reset connection, replies of the wrong type): a small listener thread,
loopback only, bounded in time.
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import struct
import subprocess
import threading
from dataclasses import dataclass

import pytest

from redisfix import SilentServer


@dataclass(frozen=True)
class Certs:
    """Test certificates made with the ``openssl`` CLI (``make_certs``): a CA, a server
    certificate for 127.0.0.1 and localhost signed by it, a client certificate signed by
    it, and an unrelated CA (a client that trusts only it must refuse the server)."""

    dir: str

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    ca = property(lambda self: self.path("ca.crt"))
    server_cert = property(lambda self: self.path("server.crt"))
    server_key = property(lambda self: self.path("server.key"))
    client_cert = property(lambda self: self.path("client.crt"))
    client_key = property(lambda self: self.path("client.key"))
    other_ca = property(lambda self: self.path("other-ca.crt"))

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca)
        ctx.load_cert_chain(self.client_cert, self.client_key)
        return ctx

    def redis_py(self) -> dict:
        """redis-py client options for test setup and inspection over TLS."""
        return dict(ssl=True, ssl_ca_certs=self.ca, ssl_certfile=self.client_cert, ssl_keyfile=self.client_key)


def _openssl(*args, cwd: str) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        pytest.fail("the openssl CLI is not installed: apt-get install openssl")
    done = subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if done.returncode:
        pytest.fail(f"openssl {' '.join(args[:2])} failed: {done.stderr[-2000:]}")


def make_certs(dirpath) -> Certs:
    """A CA, a server and a client certificate (P-256 keys, valid two days) in ``dirpath``
    (a directory the test created)."""
    d = os.path.abspath(os.fspath(dirpath))
    os.makedirs(d, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for ca in ("ca", "other-ca"):
        _openssl("req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.crt", "-days", "2", "-subj",
                 f"/CN=kvwire test {ca}", "-addext", "basicConstraints=critical,CA:TRUE", "-addext",
                 "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    for name, usage, san in (("server", "serverAuth,clientAuth", "IP:127.0.0.1,DNS:localhost"),  # the bus: both
                             ("client", "clientAuth", "DNS:kvwire-client")):
        with open(os.path.join(d, f"{name}.ext"), "w") as f:
            f.write(f"basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
                    f"extendedKeyUsage={usage}\nsubjectAltName={san}\nsubjectKeyIdentifier=hash\n"
                    f"authorityKeyIdentifier=keyid\n")
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=kvwire test {name}",
                 cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
    return Certs(d)


def resp_commands(buf: bytearray) -> int:
    """How many whole RESP commands lead ``buf``; they are removed from it."""
    n = 0
    while True:
        pos = 0
        try:
            end = buf.index(b"\r\n", pos)
            if buf[:1] != b"*":
                return n
            count, pos = int(buf[1:end]), end + 2
            for _ in range(count):
                end = buf.index(b"\r\n", pos)
                length = int(buf[pos + 1:end])
                pos = end + 2 + length + 2
                if pos > len(buf):
                    return n
        except ValueError:  # an incomplete command: wait for more bytes
            return n
        del buf[:pos]
        n += 1


class FakeServer(SilentServer):
    """A listener on a free loopback port that is not a Redis server, for the failure
    mapping (KVW-STORE-40). ``mode``: "junk" answers the first bytes it gets with an HTTP
    error (not RESP), "close" closes every connection at once, "reset" resets it (RST),
    "wrong" answers every command with the RESP integer 7 (valid protocol, a reply of the
    wrong type). Each connection has a daemon thread; ``close()`` ends them all."""

    def __init__(self, mode: str):
        if mode not in ("junk", "close", "reset", "wrong"):
            raise ValueError(f"mode {mode!r}: junk, close, reset or wrong")
        self.mode = mode
        super().__init__()

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def serve(self, conn) -> None:
        if self.mode == "close":
            conn.close()
        elif self.mode == "reset":
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()
        else:
            self.conns.append(conn)
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn) -> None:
        conn.settimeout(0.1)
        buf, answered = bytearray(), False
        while not self._stop:
            try:
                data = conn.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            try:
                if self.mode == "junk":
                    if not answered:
                        conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                        answered = True
                else:
                    buf += data
                    conn.sendall(b":7\r\n" * resp_commands(buf))
            except OSError:
                return

__all__ = ["Certs", "FakeServer", "make_certs", "resp_commands"]
