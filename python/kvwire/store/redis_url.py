"""Redis store URLs (spec/store.md section 8.1, KVW-STORE-36..39): parsing, the query
parameters, TLS options and the redacted form every message prints.

Why a module of its own: a URL is where a store's secrets and its security choices live.
A parameter that is silently dropped (``?ssl=true`` once made a plaintext connection) or a
password that reaches an error message, a log line or a statistics file is a security bug,
so the parsing is strict (every parameter known, checked and typed, anything else refused
naming the valid ones) and every message is built from ``redact_url``. It needs no Redis
client: only the standard library's ``ssl`` to load certificates when the store opens.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from urllib.parse import unquote

from .base import StoreError

DEFAULT_PORT = 6379
SCHEMES = ("redis", "rediss", "redis-cluster", "rediss-cluster")
COMMON = ("timeout", "connect_timeout")
CLUSTER = ("retry_after",)
TLS = ("ca", "cert", "key", "server_name")
NUMERIC = COMMON + CLUSTER


def redact_url(url: str) -> str:
    """``url`` with everything between ``://`` and its last ``@`` replaced by ``user:***``
    (or ``***`` when there is no ``:``), KVW-STORE-39. Conservative: a stray ``@`` later in
    the URL hides more, never less."""
    if not isinstance(url, str):
        return repr(type(url))
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    userinfo, _, tail = rest.rpartition("@")
    user = userinfo.split(":", 1)[0] if ":" in userinfo else None
    shown = "***" if user is None else f"{user}:***"
    return f"{scheme}://{shown}@{tail}"


@dataclass(frozen=True)
class TLSOptions:
    """The TLS parameters of a ``rediss://`` URL (KVW-STORE-36). Verification of the
    server's certificate and name is always on (KVW-STORE-37): no field turns it off."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None

    def context(self, url: str = "") -> ssl.SSLContext:
        """The client context: TLS 1.2+, CERT_REQUIRED, hostname checked; CA and client
        certificate loaded now, so a bad file is a StoreError when the store opens (its
        message starts with ``url``, redacted)."""
        where = f"{redact_url(url)}: " if url else ""
        try:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca)
        except (OSError, ssl.SSLError) as exc:
            raise StoreError(f"{where}TLS option ca={self.ca}: cannot load the certificate authorities: "
                             f"{exc}") from None
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.verify_mode, ctx.check_hostname = ssl.CERT_REQUIRED, True
        if self.cert is not None:
            try:  # the password callback refuses encrypted keys instead of prompting on a terminal
                ctx.load_cert_chain(self.cert, self.key, password=refuse_key_password)
            except (OSError, ssl.SSLError, ValueError) as exc:
                raise StoreError(f"{where}TLS options cert={self.cert} key={self.key or '(in cert)'}: cannot load the "
                                 f"client certificate and its unencrypted key: {exc}") from None
        return ctx

    def query(self) -> str:
        return "&".join(f"{k}={getattr(self, k)}" for k in TLS if getattr(self, k) is not None)


def refuse_key_password():
    raise ValueError("the private key is encrypted; give an unencrypted key file")


@dataclass(frozen=True)
class RedisURL:
    """A parsed Redis store URL. ``url`` is the redacted canonical form (KVW-STORE-39)."""

    scheme: str
    hosts: list
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    options: dict = field(default_factory=dict)  # timeout, connect_timeout, retry_after
    tls: TLSOptions | None = None

    @property
    def cluster(self) -> bool:
        return self.scheme.endswith("-cluster")

    @property
    def url(self) -> str:
        auth = "" if self.password is None else f"{self.username or ''}:***@"
        hosts = ",".join(f"{h}:{p}" for h, p in self.hosts)
        path = "" if self.cluster else f"/{self.db}"
        query = self.tls.query() if self.tls is not None else ""
        return f"{self.scheme}://{auth}{hosts}{path}{'?' + query if query else ''}"

    def __repr__(self) -> str:
        return f"RedisURL({self.url!r})"


def valid_parameters(scheme: str) -> tuple:
    return COMMON + (CLUSTER if scheme.endswith("-cluster") else ()) + (TLS if scheme.startswith("rediss") else ())


def parse_host(part: str, url: str) -> tuple[str, int]:
    """(host, port) of ``host[:port]``; ``url`` (redacted here) names the URL in errors."""
    host, _, port = part.rpartition(":") if ":" in part else (part, "", str(DEFAULT_PORT))
    try:
        port_n = int(port)
    except ValueError:
        raise StoreError(f"store URL {redact_url(url)!r}: bad port {port!r}") from None
    if not host or not 0 < port_n < 65536:
        raise StoreError(f"store URL {redact_url(url)!r}: need host:port, got {part!r}")
    return host, port_n


def parse_number(name: str, text, where: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise StoreError(f"{where}: {name}={text!r} is not a positive number of seconds")
    return value


def parse_query(scheme: str, query: str, where: str) -> dict:
    valid = valid_parameters(scheme)
    out: dict = {}
    for part in query.split("&") if query else ():
        if not part:
            continue
        name, _, value = (unquote(t) for t in part.partition("="))
        if name not in valid:
            if name.lower() in ("ssl", "tls", "ssl_cert_reqs", "ssl_ca_certs") or (name in TLS and scheme in SCHEMES):
                tls_scheme = scheme.replace("redis", "rediss", 1)
                raise StoreError(f"{where}: parameter {name!r} is not taken by {scheme}://; for TLS use "
                                 f"{tls_scheme}:// (its parameters: {', '.join(valid_parameters(tls_scheme))})")
            raise StoreError(f"{where}: unknown parameter {name[:40]!r}; {scheme}:// takes {', '.join(valid)}")
        if name in out:
            raise StoreError(f"{where}: parameter {name!r} is given twice")
        if not value:
            raise StoreError(f"{where}: parameter {name!r} has no value")
        out[name] = parse_number(name, value, where) if name in NUMERIC else value
    return out


def parse_redis_url(url: str, options: dict) -> RedisURL:
    """A ``redis://``, ``rediss://``, ``redis-cluster://`` or ``rediss-cluster://`` URL and
    ``open_store``'s keyword options, checked (KVW-STORE-36, KVW-STORE-38). Options of the
    URL and keywords merge; one given both ways with two values is refused."""
    where = f"store URL {redact_url(url)!r}"
    scheme, _, rest = url.partition("://")
    scheme = scheme.lower()
    if scheme not in SCHEMES:
        raise StoreError(f"{where}: not a Redis URL ({', '.join(s + '://' for s in SCHEMES)})")
    cut = min([i for i in (rest.find(c) for c in "/?#") if i >= 0], default=len(rest))
    netloc, tail = rest[:cut], rest[cut:]
    if "@" in tail:
        raise StoreError(f"{where}: an '@' after the host part: percent-encode '@', '/', '?' and '#' in the user "
                         f"name, password and parameter values (%40, %2F, %3F, %23)")
    if "#" in tail:
        raise StoreError(f"{where}: a store URL has no #fragment")
    path, _, query = tail.partition("?")
    username = password = None
    if "@" in netloc:
        auth, _, netloc = netloc.rpartition("@")
        if ":" not in auth:
            raise StoreError(f"{where}: a user name needs a password (redis://user:password@host; "
                             f"redis://:password@host for the default user)")
        user, _, pw = auth.partition(":")
        username, password = unquote(user) or None, unquote(pw)
        if not password:
            raise StoreError(f"{where}: the password is empty")
    cluster = scheme.endswith("-cluster")
    if cluster:
        if path.strip("/"):
            raise StoreError(f"{where}: a cluster has one database; give no /db path")
        hosts = [parse_host(h, url) for h in netloc.split(",") if h]
        if not hosts:
            raise StoreError(f"{where}: name at least one node ({scheme}://127.0.0.1:7000)")
        db = 0
    else:
        if "," in netloc:
            raise StoreError(f"{where}: {scheme}:// names one server; several nodes are a {scheme}-cluster:// URL")
        hosts = [parse_host(netloc or f"127.0.0.1:{DEFAULT_PORT}", url)]
        db_text = path.strip("/") or "0"
        if not db_text.isdigit() or not db_text.isascii():
            raise StoreError(f"{where}: the path is the database number ({scheme}://host:6379/0)")
        db = int(db_text)
    given = parse_query(scheme, query, where)
    valid = valid_parameters(scheme)
    for name, value in options.items():
        if name not in valid:
            raise StoreError(f"{where}: unknown option {name!r}; {scheme}:// takes {', '.join(valid)}")
        if name in given and given[name] != value:
            raise StoreError(f"{where}: option {name!r} is given in the URL ({given[name]!r}) and as a keyword "
                             f"({value!r}); give it once")
        given[name] = value
    tls = None
    if scheme.startswith("rediss"):
        tls_opts = {k: str(given.pop(k)) for k in TLS if k in given}
        if "key" in tls_opts and "cert" not in tls_opts:
            raise StoreError(f"{where}: key= needs cert= (the client certificate)")
        tls = TLSOptions(**tls_opts)
    return RedisURL(scheme, hosts, db, username, password, given, tls)


__all__ = ["COMMON", "CLUSTER", "DEFAULT_PORT", "RedisURL", "SCHEMES", "TLS", "TLSOptions", "parse_host",
           "parse_redis_url", "redact_url", "valid_parameters"]
