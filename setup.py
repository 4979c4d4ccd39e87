"""Build steps that setuptools cannot declare: the conformance kit and libkvwire in the wheel.

The conformance kit. The gold vectors and the protocol description live in the repository's
``conformance/`` folder, which the generators, fuzz tools and tests use where it is; the
package itself lives under ``python/``. So that ``kvwire conformance run`` works from an
installed wheel with no checkout around, ``build_py`` copies ``conformance/vectors/**`` and
``conformance/PROTOCOL.md`` into ``kvwire/conformance/data/`` of the build tree
(``kvwire.conformance.vectors`` looks there after a checkout). One copy stays in the
repository; the build refuses to make a wheel without the kit. Editable installs skip the
copy: they find the checkout's folder directly.

libkvwire. The native codecs (``kvwire.codecs.native``) are what make loads and lossy saves
fast, so the wheel carries the library: ``build_py`` runs the C library's own Makefile
(``make -C c lib``: one owner of its sources and flags, the per-file -O3 of the kernels
included) into the build folder and puts ``libkvwire.so`` beside ``native.py``. It is a
plain shared library loaded with ctypes, not a CPython extension, so the wheel is tagged
``py3-none-<platform>``: one wheel per platform serves every Python. It links libzstd and
libxxhash from the system; ``make wheel`` (auditwheel repair) copies them into the wheel
the way manylinux wheels do, so the wheel installs on Linux machines with neither.
Editable installs build it into the checkout's ``build/c`` (what ``make c`` builds), where
``native.py`` finds it.

Why setuptools and a Makefile rather than scikit-build-core or meson-python: the library
already has a hand-written Makefile that its C users, tests, fuzzers and ``make install``
share, and nothing in it is Python-specific; a second build description (CMake, meson)
would be a second owner of the same flags. setuptools only needs to call it and tag the
wheel.

Where the build cannot compile (no ``make``, no C compiler, no zstd.h / xxhash.h), it
says so in one line and makes the pure-Python wheel, which works (numpy codecs).
``KVWIRE_BUILD_NATIVE=0`` makes the pure wheel on purpose; ``KVWIRE_BUILD_NATIVE=1`` fails
instead of falling back (release builds, cibuildwheel). A compiler that is there but fails
is an error, never a silent fallback. Everything else is declared in pyproject.toml.
"""

import os
import shlex
import shutil
import subprocess
import sys

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
# (source in the repository, destination under the package's data folder)
KIT = (("conformance/vectors", "vectors"), ("conformance/PROTOCOL.md", "PROTOCOL.md"))
DATA = os.path.join("kvwire", "conformance", "data")
LIB = os.path.join("kvwire", "codecs", "libkvwire.so")  # native.py's PACKAGED
C_DIR = os.path.join(HERE, "c")
APT = "apt-get install gcc make libzstd-dev libxxhash-dev"
_toolchain = {}


def native_missing():
    """None when libkvwire can be built here, else why not (one line); KVWIRE_BUILD_NATIVE=1
    turns a missing tool into an error, =0 skips the library."""
    if "why" in _toolchain:
        return _toolchain["why"]
    want = os.environ.get("KVWIRE_BUILD_NATIVE", "").strip().lower()
    if want not in ("", "0", "1"):
        raise SystemExit(f"setup.py: KVWIRE_BUILD_NATIVE={want!r}: use 1 (the library or fail), 0 (pure-Python "
                         "wheel) or leave it unset (the library when a C toolchain is there)")
    why = None
    cc = shlex.split(os.environ.get("CC", "") or "gcc")[:1] or ["gcc"]
    if want == "0":
        why = "KVWIRE_BUILD_NATIVE=0"
    elif not sys.platform.startswith("linux"):
        why = f"libkvwire's build (c/Makefile) is for Linux, this is {sys.platform}"
    elif not os.path.isfile(os.path.join(C_DIR, "Makefile")):
        why = "c/ (libkvwire's sources) is not in this source tree"
    elif shutil.which("make") is None:
        why = "make not found"
    elif shutil.which(cc[0]) is None:
        why = f"no C compiler ({cc[0]} not found)"
    else:
        probe = subprocess.run(["make", "-s", "-C", C_DIR, "deps"], capture_output=True, text=True, check=False)
        if probe.returncode:
            why = "zstd.h or xxhash.h not found"
    if why is not None and want == "1":
        raise SystemExit(f"setup.py: KVWIRE_BUILD_NATIVE=1 but libkvwire cannot be built: {why} ({APT})")
    _toolchain["why"] = why
    return why


def make_libkvwire(build_dir):
    """``make -C c lib`` into ``build_dir``; returns the path of libkvwire.so."""
    jobs = str(max(1, min(os.cpu_count() or 1, 8)))
    subprocess.run(["make", "-s", "-C", C_DIR, f"BUILD={os.path.abspath(build_dir)}", "-j", jobs, "lib"], check=True)
    return os.path.join(build_dir, "libkvwire.so")


class build_py_with_kit_and_lib(build_py):
    """``build_py`` plus the conformance kit (package data of ``kvwire.conformance``) and
    libkvwire (``kvwire/codecs/libkvwire.so``)."""

    def _kit_files(self):
        """[(source path, path in the build tree)] of every file of the kit."""
        out = []
        for src, dst in KIT:
            src = os.path.join(HERE, src)
            if os.path.isfile(src):
                out.append((src, os.path.join(self.build_lib, DATA, dst)))
                continue
            if not os.path.isdir(src):
                raise SystemExit(f"setup.py: {src} is missing; a wheel without the conformance kit is not built "
                                 "(build from a checkout or from the sdist, which carries it: MANIFEST.in)")
            for top, dirs, files in os.walk(src):
                dirs[:] = sorted(d for d in dirs if d != "__pycache__")
                rel = os.path.relpath(top, src)
                for name in sorted(files):
                    out.append((os.path.join(top, name), os.path.normpath(os.path.join(self.build_lib, DATA, dst,
                                                                                        rel, name))))
        return out

    def run(self):
        super().run()
        why = native_missing()
        if getattr(self, "editable_mode", False):
            if why is None:  # where native.py looks in a checkout (make c builds the same)
                make_libkvwire(os.path.join(HERE, "build", "c"))
            return
        for src, dst in self._kit_files():
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copyfile(src, dst)
        if why is not None:
            print(f"kvwire: building without libkvwire ({why}): the pure-Python package, numpy codecs "
                  f"(for native speed: {APT}, then build again)", file=sys.stderr)
            return
        built = make_libkvwire(os.path.join(self.build_temp, "libkvwire"))
        shutil.copyfile(built, os.path.join(self.build_lib, LIB))

    def initialize_options(self):
        super().initialize_options()
        self.build_temp = None  # build's, where the library's objects go (build_py has none of its own)

    def finalize_options(self):
        super().finalize_options()
        self.set_undefined_options("build", ("build_temp", "build_temp"))

    def get_outputs(self, include_bytecode=1):
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs
        lib = [os.path.join(self.build_lib, LIB)] if native_missing() is None else []
        return outputs + [dst for _, dst in self._kit_files()] + lib


class NativeDistribution(Distribution):
    """With libkvwire the package is not pure: it then goes to platlib (build/lib.<plat>,
    the wheel's Root-Is-Purelib false), as a package with an extension module does."""

    def has_ext_modules(self):
        return native_missing() is None


class bdist_wheel_native(bdist_wheel):
    """A wheel with libkvwire is platform-specific but not Python-specific (ctypes, no
    CPython ABI): ``py3-none-<platform>``; without it, ``py3-none-any``."""

    def get_tag(self):
        py, abi, plat = super().get_tag()
        return (py, abi, plat) if self.root_is_pure else ("py3", "none", plat)


setup(distclass=NativeDistribution, cmdclass={"build_py": build_py_with_kit_and_lib, "bdist_wheel": bdist_wheel_native})
