"""`make -C c install` gives a C programmer what they expect, and pkg-config finds it.

Why: a library people build against is consumed through its installed files, not its
source tree: the header, the static archive, the shared library under its full version with
the soname and development links, the CLI, and kvwire.pc. The test installs into a staging
directory it creates (DESTDIR), then compiles and links a small program with nothing but
`pkg-config --cflags --libs kvwire` (the .pc relocated to the staging tree with
--define-variable=prefix) and runs it over a gold vector, shared and static.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from test_c_impl import C_DIR, _make, _require_toolchain

ROOT = Path(__file__).resolve().parents[2]
VECTOR = ROOT / "conformance" / "vectors" / "1.0" / "valid" / "align-4096-file.kvw"
PREFIX = "/usr/local"

PROGRAM = r"""
#include <kvwire.h>
#include <stdio.h>
#include <string.h>

int main(int argc, char **argv) {
    kvw_reader *r;
    kvw_error err;
    if (argc != 2 || strcmp(kvw_code_name(KVW_BODY_CHECKSUM), "BODY_CHECKSUM") != 0) return 2;
    if (kvw_open_file(argv[1], NULL, &r, &err) != KVW_OK) {
        fprintf(stderr, "%s: %s\n", kvw_code_name(err.code), err.message);
        return 1;
    }
    kvw_code c = kvw_validate(r, &err);
    printf("kvwire %s layers %u validate %s\n", KVW_VERSION_STRING,
           (unsigned)kvw_reader_header(r)->arch.num_layers, kvw_code_name(c));
    kvw_close(r);
    return c != KVW_OK;
}
"""


def _pkg_config(pcdir: Path, prefix: Path, *args: str) -> list[str]:
    env = dict(os.environ, PKG_CONFIG_PATH=str(pcdir))
    env.pop("PKG_CONFIG_SYSROOT_DIR", None)
    p = subprocess.run(["pkg-config", f"--define-variable=prefix={prefix}", *args, "kvwire"],
                       capture_output=True, text=True, env=env)
    assert p.returncode == 0, f"pkg-config {' '.join(args)} kvwire: {p.stderr}"
    return p.stdout.split()


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    _require_toolchain()
    if shutil.which("pkg-config") is None:
        pytest.fail("pkg-config is missing: sudo apt-get install -y pkg-config (or `make c-deps` as root)",
                    pytrace=False)
    dest = tmp_path_factory.mktemp("kvwire-install")
    _make("install", f"PREFIX={PREFIX}", f"DESTDIR={dest}")
    return dest, dest / PREFIX.lstrip("/")


def test_install_lays_out_the_files_and_links(staged):
    _, prefix = staged
    lib = prefix / "lib"
    assert (prefix / "include" / "kvwire.h").read_bytes() == (C_DIR / "include" / "kvwire.h").read_bytes()
    assert (lib / "libkvwire.a").is_file()
    full = lib / "libkvwire.so.0.1.0"
    assert full.is_file() and not full.is_symlink()
    assert os.readlink(lib / "libkvwire.so.0") == "libkvwire.so.0.1.0"
    assert os.readlink(lib / "libkvwire.so") == "libkvwire.so.0"
    assert os.access(prefix / "bin" / "kvwire-c", os.X_OK)
    soname = subprocess.run(["readelf", "-d", str(full)], capture_output=True, text=True).stdout
    assert "[libkvwire.so.0]" in soname, soname
    pc = (lib / "pkgconfig" / "kvwire.pc").read_text()
    assert f"prefix={PREFIX}\n" in pc and "Requires.private: libzstd, libxxhash" in pc
    assert "Libs: -L${libdir} -lkvwire" in pc and "Version: 0.1.0" in pc


def test_a_program_builds_with_pkg_config_and_runs(staged, tmp_path):
    _, prefix = staged
    pcdir = prefix / "lib" / "pkgconfig"
    src = tmp_path / "prog.c"
    src.write_text(PROGRAM)
    flags = _pkg_config(pcdir, prefix, "--cflags", "--libs")
    assert f"-I{prefix}/include" in flags and "-lkvwire" in flags
    cc = os.environ.get("CC", "gcc")
    exe = tmp_path / "prog"
    p = subprocess.run([cc, "-std=c11", "-Wall", "-Werror", str(src), "-o", str(exe), *flags],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    needed = subprocess.run(["readelf", "-d", str(exe)], capture_output=True, text=True).stdout
    assert "[libkvwire.so.0]" in needed  # the soname, not the development link
    run = subprocess.run([str(exe), str(VECTOR)], capture_output=True, text=True,
                         env=dict(os.environ, LD_LIBRARY_PATH=str(prefix / "lib")))
    assert run.returncode == 0 and "validate OK" in run.stdout, run.stdout + run.stderr


def test_static_link_takes_requires_private(staged, tmp_path):
    """--static adds libzstd and libxxhash (Requires.private) and -lm: enough for the archive."""
    _, prefix = staged
    pcdir = prefix / "lib" / "pkgconfig"
    libs = _pkg_config(pcdir, prefix, "--static", "--libs")
    assert {"-lzstd", "-lxxhash", "-lm"} <= set(libs), libs
    archive = str(prefix / "lib" / "libkvwire.a")
    libs = [archive if a == "-lkvwire" else a for a in libs]
    src = tmp_path / "prog.c"
    src.write_text(PROGRAM)
    exe = tmp_path / "prog-static"
    p = subprocess.run([os.environ.get("CC", "gcc"), "-std=c11", str(src), "-o", str(exe),
                        *_pkg_config(pcdir, prefix, "--cflags"), *libs], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "libkvwire" not in subprocess.run(["readelf", "-d", str(exe)], capture_output=True, text=True).stdout
    run = subprocess.run([str(exe), str(VECTOR)], capture_output=True, text=True)
    assert run.returncode == 0 and "validate OK" in run.stdout, run.stdout + run.stderr
