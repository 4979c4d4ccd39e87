"""libkvwire's source layers hold: common < format < simd < decode < encode (c/README.md).

Why: a reader (a store's GET path, a fuzz target) should not drag in the writer, and a
decoder that quietly calls an encoder helper is how a format change in one direction breaks
the other. Two checks, because either alone can be fooled: the #include lines of every file
under c/src (a folder includes its own and lower folders' headers only), and the undefined
symbols of every built object (nm): an object never references a symbol defined in a higher
folder, so the decode objects reference no encode symbol.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_c_impl import _make, _require_toolchain

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "c" / "src"
OBJ = ROOT / "build" / "c" / "obj" / "src"
LAYERS = ("common", "format", "simd", "decode", "encode")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def _layer(path: Path) -> int:
    return LAYERS.index(path.relative_to(SRC).parts[0])


def test_every_source_file_is_in_a_layer_folder():
    stray = [p.relative_to(SRC).as_posix() for p in SRC.rglob("*")
             if p.is_file() and (len(p.relative_to(SRC).parts) != 2 or p.relative_to(SRC).parts[0] not in LAYERS)]
    assert not stray, f"c/src files outside {LAYERS}: {stray}"
    for layer in LAYERS:
        assert list((SRC / layer).glob("*.c")), f"c/src/{layer} has no source"


def test_includes_only_reach_down():
    bad = []
    for f in sorted(SRC.rglob("*.[ch]")):
        for inc in INCLUDE.findall(f.read_text()):
            if inc == "kvwire.h":
                continue
            target = SRC / inc
            parts = Path(inc).parts
            if len(parts) != 2 or parts[0] not in LAYERS or not target.is_file():
                bad.append(f"{f.relative_to(SRC)}: #include \"{inc}\" is not <layer>/<file> of c/src")
            elif LAYERS.index(parts[0]) > _layer(f):
                bad.append(f"{f.relative_to(SRC)} ({LAYERS[_layer(f)]}) includes {inc} from a higher layer")
    assert not bad, "\n".join(bad)


def _symbols(obj: Path) -> tuple[set[str], set[str]]:
    out = subprocess.run(["nm", str(obj)], capture_output=True, text=True, check=True).stdout
    defined, undefined = set(), set()
    for line in out.splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[1] in "TDBRCVW":
            defined.add(fields[2])
        elif len(fields) == 2 and fields[0] == "U":
            undefined.add(fields[1])
    return defined, undefined


@pytest.fixture(scope="module")
def objects():
    _require_toolchain()
    if shutil.which("nm") is None:
        pytest.fail("nm is missing: sudo apt-get install -y binutils", pytrace=False)
    _make("lib")
    objs = {}
    for src in sorted(SRC.glob("*/*.c")):
        obj = OBJ / src.relative_to(SRC).with_suffix(".o")
        assert obj.is_file(), f"make -C c lib did not build {obj}"
        objs[src.relative_to(SRC).with_suffix(".o").as_posix()] = _symbols(obj)
    return objs


def test_objects_reference_no_higher_layer(objects):
    owner = {sym: name for name, (defined, _) in objects.items() for sym in defined}
    bad = []
    for name, (_, undefined) in objects.items():
        mine = LAYERS.index(name.split("/")[0])
        for sym in sorted(undefined):
            other = owner.get(sym)
            if other and LAYERS.index(other.split("/")[0]) > mine:
                bad.append(f"{name} references {sym} of {other}")
    assert not bad, "\n".join(bad)


def test_decode_references_no_encode_symbol(objects):
    """The rule the layers exist for, stated on its own: decode/*.o and everything below
    them link without a single encode/*.o symbol."""
    encode_syms = {s for name, (d, _) in objects.items() if name.startswith("encode/") for s in d}
    assert encode_syms, "no encode objects found"
    used = {name: u & encode_syms for name, (_, u) in objects.items() if not name.startswith("encode/")}
    assert not any(used.values()), {k: sorted(v) for k, v in used.items() if v}
