"""Build step that puts the conformance kit into the wheel.

The gold vectors and the protocol description live in the repository's ``conformance/``
folder, which the generators, fuzz tools and tests use where it is; the package itself lives
under ``python/``. So that ``kvwire conformance run`` works from an installed wheel with no
checkout around, ``build_py`` copies ``conformance/vectors/**`` and ``conformance/PROTOCOL.md``
into ``kvwire/conformance/data/`` of the build tree (``kvwire.conformance.vectors`` looks
there after a checkout). One copy stays in the repository; the build refuses to make a wheel
without the kit. Editable installs skip the copy: they find the checkout's folder directly.
Everything else about the project is declared in pyproject.toml.
"""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
# (source in the repository, destination under the package's data folder)
KIT = (("conformance/vectors", "vectors"), ("conformance/PROTOCOL.md", "PROTOCOL.md"))
DATA = os.path.join("kvwire", "conformance", "data")


class build_py_with_conformance_kit(build_py):
    """``build_py`` plus the conformance kit as package data of ``kvwire.conformance``."""

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
        if getattr(self, "editable_mode", False):
            return
        for src, dst in self._kit_files():
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copyfile(src, dst)

    def get_outputs(self, include_bytecode=1):
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs
        return outputs + [dst for _, dst in self._kit_files()]


setup(cmdclass={"build_py": build_py_with_conformance_kit})
