"""The connection side of the Redis stores (spec/store.md section 8.1): redis-py imported
on demand, its connections wrapped in TLS, and its failures put into words.

Why apart from ``redis.py``: the store's commands and batches are one concern, and what
can go wrong between the client and a server (a refused connection, an untrusted
certificate, a wrong password, a database that does not exist, a peer that is not a Redis
server) another; KVW-STORE-40 asks that every one of them reach the caller as a
``StoreError`` that says which, so the mapping lives in one place that both backends use.
"""

from __future__ import annotations

import functools
import ssl

from .base import StoreError


def import_redis():
    try:
        import redis
    except ImportError:  # pragma: no cover - the test extra installs it
        raise StoreError("redis:// stores need redis-py: pip install 'kvwire[redis]' (redis>=5,<6 and "
                         "hiredis)") from None
    return redis


@functools.cache
def tls_connection_class():
    """redis-py's ``Connection`` whose socket is wrapped in the store's ``SSLContext``
    (KVW-STORE-36/37): one context per store (CA and client certificate loaded once),
    the server's certificate and name always verified, SNI from ``server_name``. Every
    path uses it: the pooled connections that carry the pipelined batches and, on a
    cluster, every master's pool. Built on first use: redis-py is an optional extra."""
    redis = import_redis()

    class TLSConnection(redis.connection.Connection):
        def __init__(self, *, ssl_context, server_name=None, **kwargs):
            self.ssl_context, self.server_name = ssl_context, server_name
            super().__init__(**kwargs)

        def _connect(self):
            sock = super()._connect()
            try:
                return self.ssl_context.wrap_socket(sock, server_hostname=self.server_name or self.host)
            except BaseException:
                sock.close()
                raise

    return TLSConnection


def describe_failure(exc, *, tls: bool, password: bool) -> str:
    """What went wrong, in words (KVW-STORE-40): redis-py's exception (and the OS or TLS
    error under it) mapped to the kind of failure. Never includes the password: redis-py's
    messages name host:port and the server's reply, and the URL is not in them."""
    redis = import_redis()
    chain: list[BaseException] = []
    e = exc
    while e is not None and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__
    text = str(exc)
    cert = next((c for c in chain if isinstance(c, ssl.SSLCertVerificationError)), None)
    if cert is not None:
        return f"TLS: the server's certificate was refused ({cert.verify_message or cert.reason}); no plaintext " \
               "fallback (check the ca= file and server_name=)"
    tls_err = next((c for c in chain if isinstance(c, ssl.SSLError)), None)
    if tls_err is not None:
        told = str(tls_err).upper()
        hint = " (is this a plaintext port? rediss:// needs a port with TLS)" if "WRONG_VERSION" in told else \
            " (does the server require a client certificate? give cert= and key=)" if "ALERT" in told or \
            "EOF" in told else ""
        return f"TLS handshake failed: {tls_err}{hint}"
    if isinstance(exc, redis.AuthenticationError):
        why = "wrong user name or password" if password else "the server requires a password: " \
              "redis://user:password@host or redis://:password@host"
        return f"authentication failed ({text.strip()}): {why}"
    if isinstance(exc, redis.ResponseError):
        if "DB index" in text or "invalid DB" in text:
            return f"the server has no such database ({text}); the URL's path is the database number"
        return f"the server refused the connection's setup: {text}"
    if isinstance(exc, (redis.TimeoutError, TimeoutError)):
        hint = " (no answer to the TLS handshake: is this a plaintext port? use redis://)" if tls and \
            "connecting" in text else ""
        return f"no answer within the timeout ({text}){hint}"
    if isinstance(exc, redis.InvalidResponse) or isinstance(exc, (ValueError, TypeError, IndexError)):
        return f"the reply is not Redis protocol ({text[:200]}): is this a Redis server?"
    closed = any(isinstance(c, (ConnectionResetError, BrokenPipeError)) for c in chain) or "closed" in text
    if closed:
        hint = " (a server that requires a client certificate does this: give cert= and key=)" if tls else \
            " (a TLS-only port does this to a plaintext client: use rediss://)"
        return f"the connection was closed or reset by the server ({text}){hint}"
    return f"cannot connect: {text}" if "connecting" in text else f"{type(exc).__name__}: {text}"


__all__ = ["describe_failure", "import_redis", "tls_connection_class"]
