"""Shared fixtures. Helpers and the container forge live in tests/forge.py."""

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))  # `import forge` from any test module
# Tests are grouped by package (tests/format, tests/store, ...); a few share helpers by module name across
# folders (`from test_roundtrip import mixed_cache`): every folder is importable whatever pytest collects first.
for _d in sorted(os.scandir(os.path.dirname(__file__)), key=lambda e: e.name):
    if _d.is_dir() and not _d.name.startswith((".", "_")):
        sys.path.append(_d.path)

import forge
import kvwire

# Hypothesis: modest example counts and no deadline (CI machines with 2 cores vary a lot).
settings.register_profile("kvwire", max_examples=25, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "kvwire"))

FORMS = ("file", "stream")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models: with other processes busy, OpenMP worker spin-waits make a forward pass 30x slower."""
    torch = pytest.importorskip("torch")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
CODECS = ("raw", "zstd")
ROOT = Path(__file__).resolve().parent.parent
APT = "sudo apt-get install -y gcc make libzstd-dev libxxhash-dev"


@pytest.fixture(autouse=True)
def native_as_at_import():
    """Every test starts with the codecs the process chose at import (libkvwire when built,
    as for a user): a test that switches native on or off does not leak it into the next."""
    from kvwire.codecs import native

    before = native.library()
    yield
    if native.library() != before:
        native.enable(before) if before else native.disable()


@pytest.fixture(scope="module")
def lib():
    """libkvwire built (make -C c lib) once per module, for the native-codec tests; a missing
    toolchain fails with the install command. Native codecs are back as they were afterwards."""
    from kvwire.codecs import native

    if shutil.which("make") is None or shutil.which(os.environ.get("CC", "gcc")) is None:
        pytest.fail(f"building libkvwire needs a C toolchain: {APT}")
    r = subprocess.run(["make", "-C", str(ROOT / "c"), f"BUILD={ROOT / 'build' / 'c'}", "lib"],
                       capture_output=True, text=True, timeout=600, check=False)
    if r.returncode:
        pytest.fail(f"make -C c lib failed (toolchain or headers missing? {APT}):\n{r.stderr[-2000:]}")
    path = ROOT / "build" / "c" / "libkvwire.so"
    assert path.exists()
    before = native.library()
    yield path
    native.enable(before) if before else native.disable()


@pytest.fixture(scope="session")
def small():
    """2 layers x 2 heads x 8 dims x 40 tokens, f16, chunks of 16 (3 chunks per component)."""
    return forge.small_cache()


@pytest.fixture(scope="session")
def encoded(small):
    """{(form, codec): bytes} of ``small``; zstd bodies really are zstd (compressible data)."""
    return {(f, c): kvwire.encode(small, form=f, codec=c) for f in FORMS for c in CODECS}


@pytest.fixture(params=FORMS)
def form(request):
    return request.param


@pytest.fixture(params=[(f, c) for f in FORMS for c in CODECS], ids=lambda p: f"{p[0]}-{p[1]}")
def form_codec(request):
    return request.param


# -- real Redis servers (tests/redisfix.py), shared by a session; a test that kills one gets it back --

@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One plain redis-server for the session (tests that kill or reconfigure a server start their own)."""
    from redisfix import RedisServer
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A three-master Redis cluster for the session."""
    from redisfix import RedisCluster
    cluster = RedisCluster(tmp_path_factory.mktemp("redis-cluster"))
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_url(redis_server):
    """The session server's URL, emptied (FLUSHALL) before the test."""
    if not redis_server.running:
        redis_server.restart()
    c = redis_server.client()
    try:
        c.flushall()
    finally:
        c.close()
    yield redis_server.url


@pytest.fixture
def redis_cluster_url(redis_cluster):
    """The session cluster's URL, every master emptied (FLUSHALL) before the test."""
    if not all(n.running for n in redis_cluster.nodes):
        for n in redis_cluster.nodes:
            n.start()
        redis_cluster.wait_ok()
    for n in redis_cluster.nodes:
        c = n.client()
        try:
            c.flushall()
        finally:
            c.close()
    yield redis_cluster.url


# -- test tiers (tests/README.md): `make check` runs what no marker below takes; `make test` runs everything --

REDIS_FIXTURES = {"redis_server", "redis_cluster", "redis_url", "redis_cluster_url"}


def pytest_collection_modifyitems(config, items):
    """Markers by what a test needs: ``native`` (libkvwire built: tests/c and every test using ``lib``),
    ``redis`` (a real redis-server), ``vllm`` (real engines; set by the modules), ``slow`` (set where a test
    is; soaks, campaigns, wheel builds, subprocess-heavy end-to-end runs)."""
    tests = Path(__file__).resolve().parent
    for item in items:
        path = Path(str(item.fspath)).resolve()
        folder = path.parent.name if path.parent != tests else ""
        names = set(getattr(item, "fixturenames", ()))
        if folder == "c" or "lib" in names:
            item.add_marker(pytest.mark.native)
        module = getattr(item, "module", None)
        uses = {getattr(v, "__module__", None) for v in vars(module).values()} if module else set()
        if names & REDIS_FIXTURES or uses & {"redisfix", "redisfakes"}:  # starts servers or fake peers itself
            item.add_marker(pytest.mark.redis)


# Tests that must not share the machine take turns across pytest -n workers: real vLLM engines (each wants
# GiBs and both cores) and the native tests (one `make -C c` at a time into build/). A file lock under
# build/, held from an item's setup to its teardown (module fixtures that start engines included): it
# works whatever the xdist version (its xdist_group markers stopped grouping with pytest 9, whose items no
# longer take a rewritten nodeid) and between concurrent runs (make check beside make test).
EXCLUSIVE = ("native", "vllm")
LOCKS = ROOT / "build" / "test-locks"


@contextlib.contextmanager
def taking_turns(kinds):
    with contextlib.ExitStack() as stack:
        for kind in kinds:
            LOCKS.mkdir(parents=True, exist_ok=True)
            lock = stack.enter_context(open(LOCKS / f"{kind}.lock", "a"))
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with taking_turns([k for k in EXCLUSIVE if item.get_closest_marker(k)]):
        return (yield)
