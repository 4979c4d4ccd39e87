"""Redis URLs and failures (spec/store.md section 8.1): URL parameters checked and unknown
ones refused (KVW-STORE-38), the password in no message, log record, repr, info or CLI
output (KVW-STORE-39), and every failure a ``StoreError`` that names the kind
(KVW-STORE-40), against real servers (a wrong password, a missing one, a database that
does not exist) and fake ones on loopback ports (junk bytes, a closed or reset connection,
replies of the wrong type), for one server, a cluster and the ``kvwire store`` CLI."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
import traceback
from urllib.parse import quote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.store import StoreError, open_store
from kvwire.store.redis_url import parse_redis_url, redact_url
from kvwire.tools.cli import main
from redisfakes import FakeServer
from redisfix import RedisServer, SilentServer, free_port

TIMEOUT = 1.0
PASSWORD = "pw-Zq81@x/K"  # with characters that must be percent-encoded in a URL
QUOTED = "pw-Zq81%40x%2FK"
SECRETS = (PASSWORD, QUOTED, "Zq81")


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    """A server with a password (requirepass)."""
    with RedisServer(tmp_path_factory.mktemp("redis-auth"), extra=("--requirepass", PASSWORD)) as server:
        yield server


def exception_text(exc: BaseException) -> str:
    """Everything a caller could print of an exception: str, repr and the whole traceback
    with its chained causes."""
    return "\n".join([str(exc), repr(exc), *traceback.format_exception(exc)])


def assert_no_secret(*texts) -> None:
    for text in texts:
        for secret in SECRETS:
            assert secret not in str(text), f"the password leaks: {text!r}"


# -- KVW-STORE-38: URL parameters -----------------------------------------------------------
def test_store38_ssl_on_redis_is_refused_naming_rediss():
    """KVW-STORE-38: ?ssl=true (and tls, and the TLS options) on a plaintext scheme once
    made a plaintext connection; now a StoreError that points at the TLS scheme."""
    for url, scheme in [("redis://127.0.0.1:6379/0?ssl=true", "rediss://"), ("redis://h/0?tls=1", "rediss://"),
                        ("redis://h/0?ca=/x.pem", "rediss://"),
                        ("redis-cluster://h:7000?ssl=true", "rediss-cluster://")]:
        with pytest.raises(StoreError, match=f"for TLS use {scheme}"):
            open_store(url)


def test_store38_unknown_parameters_are_refused_naming_the_valid_ones():
    """KVW-STORE-38: a parameter is never dropped: unknown, repeated, empty or ill-typed
    ones are StoreErrors naming what the scheme takes; so are unknown keyword options and
    a keyword that contradicts the URL."""
    cases = {
        "redis://h/0?foo=1": "unknown parameter 'foo'; redis:// takes timeout, connect_timeout$",
        "redis://h/0?retry_after=1": "redis:// takes timeout, connect_timeout$",
        "redis-cluster://h:1?db=2": "redis-cluster:// takes timeout, connect_timeout, retry_after$",
        "rediss://h/0?verify=none": "rediss:// takes timeout, connect_timeout, ca, cert, key, server_name$",
        "redis://h/0?timeout=1&timeout=2": "given twice",
        "redis://h/0?timeout=": "has no value",
        "redis://h/0?timeout=-1": "not a positive number",
        "redis://h/0?timeout=inf": "not a positive number",
        "redis://h/0?connect_timeout=x": "not a positive number",
        "redis://h/0#frag": "no #fragment",
        "redis://a,b/0": "several nodes",
        "redis://user@h/0": "needs a password",
        "redis://u:@h/0": "password is empty",
    }
    for url, message in cases.items():
        with pytest.raises(StoreError, match=message):
            open_store(url)
    with pytest.raises(StoreError, match="unknown option 'ssl'"):
        open_store("redis://h/0", ssl=True)
    with pytest.raises(StoreError, match="given in the URL"):
        open_store("redis://h/0?timeout=3", timeout=2)
    s = open_store("redis://h/0?timeout=3&connect_timeout=0.5", timeout=3.0)  # the same value twice is fine
    assert s.timeout == 3.0 and s.url == "redis://h:6379/0"


def test_store38_timeout_in_the_url_applies():
    """KVW-STORE-25/38: ?timeout= is the call timeout: a silent server fails within it."""
    with SilentServer() as silent:
        s = open_store(f"redis://127.0.0.1:{silent.port}/0?timeout=0.3")
        start = time.monotonic()
        with pytest.raises(StoreError, match="no answer within the timeout"):
            s.get("a")
        assert time.monotonic() - start < 30  # timed out, did not hang (generous: a loaded CI machine)


# -- KVW-STORE-39: redaction ------------------------------------------------------------------
def test_store39_redact_url():
    """KVW-STORE-39: everything between :// and the last @ is hidden, the user name kept."""
    assert redact_url("redis://u:secret@h:1/0") == "redis://u:***@h:1/0"
    assert redact_url("redis://:secret@h") == "redis://:***@h"
    assert redact_url("redis://secret@h") == "redis://***@h"
    assert redact_url("redis://u:se@c/ret@h/0") == "redis://u:***@h/0"
    assert redact_url("file:///tmp/x") == "file:///tmp/x" and redact_url("memory://") == "memory://"


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1, max_size=40).filter(lambda t: "***" not in t), st.sampled_from(["", "u", "kv-user"]),
       st.sampled_from(["redis", "rediss", "redis-cluster", "rediss-cluster"]))
def test_store39_any_password_round_trips_and_never_shows(password, user, scheme):
    """KVW-STORE-38/39 property: any password, percent-encoded in the URL, is parsed back
    exactly, and the store's url, the parsed URL's repr and redact_url are exactly the URL
    with ``:***`` in its place."""
    url = f"{scheme}://{quote(user, safe='')}:{quote(password, safe='')}@127.0.0.1:6390"
    url += "?timeout=1" if scheme.endswith("cluster") else "/3?timeout=1"
    parsed = parse_redis_url(url, {})
    assert parsed.password == password and parsed.username == (user or None)
    expected = f"{scheme}://{user}:***@127.0.0.1:6390" + ("" if scheme.endswith("cluster") else "/3")
    # what is shown is exactly this, whatever the password: it cannot hold any part of it
    assert parsed.url == expected and repr(parsed) == f"RedisURL({expected!r})"
    assert redact_url(url) == expected + "?timeout=1"


URL_TEXT = st.text(alphabet=st.sampled_from(list("ab1:@/?#&=,.%_-[] \u00e9")), max_size=30)


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(["redis", "rediss", "redis-cluster", "rediss-cluster"]), URL_TEXT, URL_TEXT, URL_TEXT,
       st.booleans())
def test_store38_any_url_parses_or_is_a_store_error(scheme, before, after, rest, with_secret):
    """KVW-STORE-38/39/40: whatever follows the scheme, parsing answers a URL or a
    StoreError, never another exception; a password (``SeCrEt``, percent-encoded or not,
    among arbitrary URL characters) is in neither the message nor the url."""
    url = f"{scheme}://{before}:SeCrEt{after}@{rest}" if with_secret else f"{scheme}://{before}{after}{rest}"
    try:
        shown = parse_redis_url(url, {}).url
    except StoreError as exc:
        shown = str(exc)
    assert "SeCrEt" not in shown


def test_store39_the_password_is_in_no_output(auth_server, caplog, capsys):
    """KVW-STORE-39/40: failing and succeeding paths (connection refused, a wrong password, a
    missing one, a bad database, a server answering junk, a cluster, success): no exception
    text, traceback, log record, repr, url or info holds the password, and each failure is a
    StoreError naming its kind."""
    caplog.set_level(logging.DEBUG)
    port, dead = auth_server.port, free_port()
    with FakeServer("junk") as junk:
        failing = {
            f"redis://u:{QUOTED}@127.0.0.1:{dead}/0": "cannot connect",
            f"redis://:{QUOTED}x@127.0.0.1:{port}/0": "authentication failed.*wrong user name or password",
            f"redis://127.0.0.1:{port}/0": "authentication failed.*requires a password",
            f"redis://:{QUOTED}@127.0.0.1:{port}/99": "no such database",
            f"redis://default:{QUOTED}@127.0.0.1:{junk.port}/0": "not Redis protocol",
            f"redis-cluster://:{QUOTED}@127.0.0.1:{junk.port},127.0.0.1:{dead}": "no seed node.*not Redis protocol",
            f"rediss://:{QUOTED}@127.0.0.1:{port}/0?ca=/nonexistent.pem": "cannot load the certificate",
            f"s3://:{QUOTED}@bucket": "not supported",
            f"redis://:{QUOTED}@127.0.0.1:notaport/0": "bad port",
        }
        for url, kind in failing.items():
            with pytest.raises(StoreError, match=kind) as info:
                with open_store(url, timeout=TIMEOUT) as s:
                    assert_no_secret(repr(s), str(s), s.url)
                    s.put("k", b"v")
            assert_no_secret(exception_text(info.value))
            assert main(["store", "stats", "--url", url]) == 2
    with open_store(f"redis://default:{QUOTED}@127.0.0.1:{port}/0", timeout=TIMEOUT) as s:
        assert s.put("k", b"v") in (True, False) and s.get("k") == b"v"
        assert s.url == f"redis://default:***@127.0.0.1:{port}/0"
        assert_no_secret(repr(s), str(s), s.url, s.info())
    assert main(["store", "stats", "--url", f"redis://:{QUOTED}@127.0.0.1:{port}/0"]) == 0
    out = capsys.readouterr()
    assert_no_secret(out.out, out.err, *(r.getMessage() for r in caplog.records), *(r.args for r in caplog.records))
    assert "Traceback" not in out.err and out.err.count("error:") == len(failing)


# -- KVW-STORE-40: every failure a StoreError ----------------------------------------------------
@pytest.mark.parametrize("mode, kind", [("junk", "not Redis protocol"), ("close", "closed or reset.*rediss://"),
                                        ("reset", "closed or reset.*rediss://"),
                                        ("wrong", "is this a Redis server")])
def test_store40_a_server_that_is_not_redis(mode, kind):
    """KVW-STORE-40: a peer answering junk, closing, resetting, or replying with the wrong
    type: every call is a StoreError naming the kind, never another exception or a value."""
    with FakeServer(mode) as fake:
        with open_store(f"redis://127.0.0.1:{fake.port}/0", timeout=TIMEOUT) as s:
            calls = [lambda: s.get("a"), lambda: s.get("a", (0, 4)), lambda: s.put("a", b"x"),
                     lambda: s.leading(["a", "b"]), lambda: s.list()]
            if mode != "wrong":  # EXISTS and STRLEN answer integers: 7 is an answer of the right type
                calls += [lambda: s.exists("a"), lambda: s.sizes(["a"]), lambda: s.delete("a")]
            for call in calls:
                start = time.monotonic()
                with pytest.raises(StoreError, match=kind):
                    call()
                assert time.monotonic() - start < TIMEOUT + 30  # timed out, did not hang (generous: a loaded CI machine)


@pytest.mark.parametrize("mode, kind", [("junk", "not Redis protocol"), ("close", "closed or reset"),
                                        ("wrong", "answered CLUSTER SLOTS with something else")])
def test_store40_a_cluster_seed_that_is_not_redis(mode, kind):
    """KVW-STORE-40: a cluster whose seed is not a Redis Cluster node: a StoreError naming
    the kind when the store opens (the slot map is never built from a wrong reply)."""
    with FakeServer(mode) as fake:
        with pytest.raises(StoreError, match=kind):
            open_store(f"redis-cluster://127.0.0.1:{fake.port}", timeout=TIMEOUT)


def test_store40_cli_prints_one_line_not_a_traceback(auth_server):
    """KVW-STORE-40: the real entry point (python -m kvwire store stats|ls) on a junk
    server and a bad database: exit 2, one error line, no traceback, no password."""
    with FakeServer("junk") as junk:
        for cmd, url in (("stats", f"redis://:{QUOTED}@127.0.0.1:{junk.port}/0"),
                         ("ls", f"redis://:{QUOTED}@127.0.0.1:{auth_server.port}/7000")):
            done = subprocess.run([sys.executable, "-m", "kvwire", "store", cmd, "--url", url],
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 2, done.stderr
            assert "Traceback" not in done.stderr and done.stderr.startswith(f"kvwire store {cmd}: error: ")
            assert_no_secret(done.stdout, done.stderr)


@pytest.mark.parametrize("options", [{"timeout": float("nan")}, {"timeout": float("inf")},
                                     {"connect_timeout": float("nan")}, {"timeout": 0}])
def test_store38_timeout_options_are_positive_and_finite(options):
    """KVW-STORE-38 (keyword options as the URL's): a timeout is a positive, finite number of
    seconds; nan or inf would make a dead server a hang (KVW-STORE-25)."""
    with pytest.raises(ValueError, match="positive, finite"):
        open_store("redis://127.0.0.1:1/0", **options)
