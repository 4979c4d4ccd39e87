"""kvwire can be vendored: copied under another package name it works unchanged, and two
copies in one process are independent yet read each other's bytes."""

import ast
import gc
import importlib
import pathlib
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import forge
import kvwire

PKG = pathlib.Path(kvwire.__file__).parent
SOURCES = sorted(PKG.rglob("*.py"))


def test_package_sources_found():
    names = {p.relative_to(PKG).as_posix() for p in SOURCES}
    assert {"__init__.py", "cache/reader.py", "cache/encoder.py", "format/header.py", "format/fbs/Header.py"} <= names


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.relative_to(PKG).as_posix())
def test_only_relative_imports_of_the_package(path):
    tree = ast.parse(path.read_text())
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bad += [a.name for a in node.names if a.name == "kvwire" or a.name.startswith("kvwire.")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and (node.module == "kvwire" or node.module.startswith("kvwire.")):
            bad.append(node.module)
    assert not bad, f"{path.name} imports {bad} absolutely"
    assert "importlib.import_module(\"kvwire" not in path.read_text()


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.relative_to(PKG).as_posix())
def test_no_global_statements(path):
    tree = ast.parse(path.read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Global)], f"{path.name} rebinds module globals"


def vendor(tmp_path, name: str) -> pathlib.Path:
    root = tmp_path / f"site_{name}"
    shutil.copytree(PKG, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    return root


@pytest.mark.slow
def test_vendored_copy_round_trips_in_a_fresh_interpreter(tmp_path):
    root = vendor(tmp_path, "acme_kvwire")
    script = textwrap.dedent("""
        import sys
        sys.path.insert(0, sys.argv[1])
        import numpy as np
        import acme_kvwire as kw
        from acme_kvwire.tools.synth import synth_cache
        from acme_kvwire.format.fbs import Header as fbHeader

        cache = synth_cache(2, 2, 16, 70, chunk_tokens=32, seed=5)
        for form in ("file", "stream"):
            for codec in ("raw", "zstd"):
                data = kw.encode(cache, form=form, codec=codec)
                with kw.open(data) as r:
                    r.validate()
                    assert r.load().equal(cache)
        path = sys.argv[2]
        kw.save(path, cache)
        assert kw.load(path).equal(cache)
        try:
            kw.load(b"\\x89KVW\\n\\x1a\\n" + bytes(40))
        except kw.FormatError as exc:
            assert exc.code == "TEXT_MODE_MANGLED", exc.code
        else:
            raise AssertionError("no error")
        assert type(kw.probe(data)).__module__ == "acme_kvwire.format.header"
        assert fbHeader.__name__ == "acme_kvwire.format.fbs.Header"
        leaked = sorted(m for m in sys.modules if m == "kvwire" or m.startswith("kvwire."))
        assert not leaked, leaked
        print("OK", len(data))
    """)
    # kvwire itself stays importable here (editable install), so an absolute `import kvwire`
    # inside the copy would succeed silently: the sys.modules check in the script catches it.
    out = subprocess.run([sys.executable, "-c", script, str(root), str(tmp_path / "v.kvw")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("OK ")


def _import_copy(tmp_path, name):
    root = vendor(tmp_path, name)
    sys.path.insert(0, str(root))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(root))


def _drop(name):
    for m in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[m]


def test_two_copies_in_one_process_are_independent_and_interoperate(tmp_path):
    a = _import_copy(tmp_path, "kvw_copy_a")
    b = _import_copy(tmp_path, "kvw_copy_b")
    try:
        assert a is not b and a.Header is not b.Header and a.Header is not kvwire.Header
        assert a.FormatError is not b.FormatError
        synth_a = importlib.import_module("kvw_copy_a.tools.synth")
        cache_a = synth_a.synth_cache(2, 2, 8, 40, chunk_tokens=16, seed=7)
        cache_k = importlib.import_module("kvwire.tools.synth").synth_cache(2, 2, 8, 40, chunk_tokens=16, seed=7)
        for codec in ("raw", "zstd"):
            data_a = a.encode(cache_a, codec=codec)
            assert data_a == kvwire.encode(cache_k, codec=codec)  # identical bytes from either copy
            loaded_b = b.load(data_a)
            for la, lb in zip(cache_a.layers, loaded_b.layers):
                for comp in la:
                    assert np.array_equal(la[comp].view(np.uint8), lb[comp].view(np.uint8))
        # each copy raises its own error classes
        with pytest.raises(b.FormatError):
            b.load(b"nope" + bytes(60))
        with pytest.raises(kvwire.FormatError):
            kvwire.load(b"nope" + bytes(60))
    finally:
        _drop("kvw_copy_a")
        _drop("kvw_copy_b")


def _module_state(pkg_name):
    """repr() of every module-level container (dict, list, set, bytearray) of a package."""
    state = {}
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == pkg_name or name.startswith(pkg_name + ".")):
            continue
        for attr, value in vars(mod).items():
            if isinstance(value, (dict, list, set, bytearray)) and not attr.startswith("__"):
                state[name, attr] = repr(value)
    return state


def _encode_and_decode(tmp_path):
    cache = forge.small_cache()
    for form in ("file", "stream"):
        for codec in ("raw", "zstd"):
            data = kvwire.encode(cache, form=form, codec=codec, metadata={"a.b": b"1"})
            with kvwire.open(data) as r:
                r.validate()
                r.load()
            kvwire.probe(data)
    kvwire.save(tmp_path / "x.kvw", cache)
    kvwire.load(tmp_path / "x.kvw", backend="torch")
    with pytest.raises(kvwire.FormatError):
        kvwire.load(forge.xor_byte(kvwire.encode(cache), 100))


def test_no_module_level_state_changes_across_calls(tmp_path):
    """Calls leave nothing behind once their objects are gone. The first round fills what is
    built once on first use (registries by code, the native decoding threads), whatever ran
    before in this process; after that, libkvwire's parsed headers (kvwire.codecs.native, on
    by default) are cached only while their Header lives, so a leaked entry fails here."""
    _encode_and_decode(tmp_path)
    gc.collect()
    before = _module_state("kvwire")
    assert before, "expected registries to be found"
    _encode_and_decode(tmp_path)
    gc.collect()
    after = _module_state("kvwire")
    assert before.keys() == after.keys()
    changed = [k for k in before if before[k] != after[k]]
    assert not changed, f"module-level state changed by encode/decode: {changed}"
