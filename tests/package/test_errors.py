"""Every exception kvwire defines is a ``kvwire.Error`` with a stable ``code``, keeps its
builtin kind, and its code is in a registry: the spec's (section 18 and the companion
specs' tables) for container errors, docs/errors.md for the others.

The walk imports every module of the package, so a new exception class anywhere is held to
these rules the day it lands; a module that needs an engine this environment lacks (vLLM)
is read as source instead.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import inspect
import pathlib
import pkgutil
import re
import warnings

import pytest

import kvwire
from kvwire.format import errors as E

ROOT = pathlib.Path(__file__).resolve().parents[2]
CODE_RE = re.compile(r"[A-Z][A-Z0-9_]*[A-Z0-9]")
OPTIONAL = {"vllm"}  # engines imported by a module at import time, not installed everywhere

# the builtin kind each class keeps, so `except ValueError` / `except TimeoutError` still works
BUILTIN_KIND = {
    "kvwire.format.errors.Error": Exception,
    "kvwire.format.errors.FormatError": ValueError,
    "kvwire.store.base.StoreError": Exception,
    "kvwire.store.auth.TagError": ValueError,
    "kvwire.stream.transport.StreamTimeout": TimeoutError,
    "kvwire.stream.reader.SparseNotSupported": ValueError,
    "kvwire.layouts.binding.LayoutMismatchError": ValueError,
    "kvwire.layouts.offload.RingFullError": TimeoutError,
    "kvwire.model.rope.RepositionError": ValueError,
    "kvwire.codecs.scales.NotFaithful": ValueError,
    "kvwire.codecs.native.NativeError": RuntimeError,
    "kvwire.adapters.hf_model.UnsupportedModelError": ValueError,
    "kvwire.adapters.hf_sparse.SparseLoadError": ValueError,
    "kvwire.conformance.generation.MissingDependency": RuntimeError,
}


def _walk():
    """(the package's modules, by name; the source of those that need an absent engine)."""
    modules, unimported = {}, {}
    for info in pkgutil.walk_packages(kvwire.__path__, "kvwire."):
        if info.name.endswith("__main__"):
            continue  # runs the CLI
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                modules[info.name] = importlib.import_module(info.name)
        except ModuleNotFoundError as exc:
            assert exc.name and exc.name.split(".")[0] in OPTIONAL, f"{info.name}: {exc}"
            spec = importlib.util.find_spec(info.name)
            unimported[info.name] = ast.parse(open(spec.origin).read())
    return modules, unimported


MODULES, UNIMPORTED = _walk()


def _defined_exceptions() -> dict[str, type]:
    out = {}
    for mod in MODULES.values():
        for obj in vars(mod).values():
            if (inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__.startswith("kvwire.")
                    and not issubclass(obj, Warning)):  # warnings are not errors (docs/errors.md)
                out[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return out


EXCEPTIONS = _defined_exceptions()


def _own(cls) -> bool:
    """A class with a code of its own: not a container error, whose code is per instance."""
    return not issubclass(cls, E.FormatError) or cls is E.FormatError


def _docs_registry() -> dict[str, str]:
    """code -> class path, from the table of docs/errors.md."""
    rows = re.findall(r"^\| `([A-Z0-9_]+)` \| `([\w.]+)` \| `(\w+)` \|", (ROOT / "docs" / "errors.md").read_text(),
                      re.M)
    codes = [code for code, _, _ in rows]
    assert len(codes) == len(set(codes)), f"a code listed twice in docs/errors.md: {codes}"
    return {code: path for code, path, _ in rows}


def _spec_registry() -> list[str]:
    """The container error codes, from spec section 18 (where each is listed once) and the
    companion specs' tables."""
    spec = ROOT / "spec" / "kvwire-v1.md"
    text = spec.read_text()
    start = text.index("\n## 18. Error code registry")
    section = text[start:text.index("\n## 19.", start)]
    codes = re.findall(r"^\| `([A-Z_0-9]+)` \| [^|]*`[A-Za-z]*Error`", section, re.M)
    assert len(codes) == len(set(codes)), "a code listed twice in spec section 18"
    for name in ("codecs.md", "sparse.md", "crossmodel.md"):
        codes += re.findall(r"^\| `([A-Z_0-9]+)` \| [^|]*`[A-Za-z]*Error`", (spec.parent / name).read_text(), re.M)
    return codes


def test_the_walk_found_the_package():
    assert len(MODULES) > 100 and "kvwire.format.errors" in MODULES
    assert set(BUILTIN_KIND) <= set(EXCEPTIONS), sorted(set(BUILTIN_KIND) - set(EXCEPTIONS))


@pytest.mark.parametrize("name", sorted(EXCEPTIONS))
def test_every_exception_is_a_kvwire_error_with_a_code(name):
    cls = EXCEPTIONS[name]
    assert issubclass(cls, kvwire.Error), f"{name} is not a kvwire.Error"
    assert isinstance(cls.code, str) and CODE_RE.fullmatch(cls.code), f"{name}.code = {cls.code!r}"
    assert cls.__doc__ and len(cls.__doc__) > 20, f"{name} has no docstring saying when it is raised"


@pytest.mark.parametrize("name", sorted(EXCEPTIONS))
def test_every_exception_keeps_its_builtin_kind(name):
    """A new exception class gets its builtin kind pinned here (or is a FormatError)."""
    cls = EXCEPTIONS[name]
    kind = BUILTIN_KIND.get(name) or (ValueError if issubclass(cls, E.FormatError) else None)
    assert kind is not None, f"{name}: pin its builtin kind in BUILTIN_KIND"
    assert issubclass(cls, kind)


def test_a_module_that_cannot_be_imported_here_defines_no_exception():
    """integrations.vllm needs vLLM to import; read as source, none of its classes derive
    from an exception (it would escape the checks above)."""
    names = {n for n in dir(builtins) if n.endswith(("Error", "Exception"))} | {n for n in dir(E) if n.endswith("Error")}
    for mod, tree in UNIMPORTED.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                assert not bases & names, f"{mod}.{node.name} derives from {sorted(bases & names)}"


def test_codes_are_unique_and_match_the_documented_registry():
    own = {name: cls.code for name, cls in EXCEPTIONS.items() if _own(cls)}
    assert len(set(own.values())) == len(own), f"two classes share a code: {own}"
    docs = _docs_registry()
    assert {code: name for name, code in own.items()} == {code: _defined_path(path) for code, path in docs.items()}


def _defined_path(path: str) -> str:
    """The defining module path of a class named in the docs by its public path."""
    parts = path.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 2):  # an attribute (kvwire.rope) or a submodule
        obj = getattr(obj, part) if hasattr(obj, part) else importlib.import_module(".".join(parts[:i]))
    return f"{obj.__module__}.{obj.__qualname__}"


def test_container_codes_are_the_spec_registry_and_apart_from_the_others():
    spec = set(_spec_registry())  # the companion specs repeat the codes they added to section 18
    assert not set(spec) & (set(_docs_registry()) - {"FORMAT_ERROR"}), \
        "a code of docs/errors.md is also a container code of the spec"
    raised = set()
    for p in (ROOT / "python" / "kvwire").rglob("*.py"):
        raised |= set(re.findall(r"\b\w*Error\(\s*\"([A-Z][A-Z0-9_]+)\"", p.read_text()))
    assert raised and raised <= set(spec), f"container codes not in the spec's registry: {sorted(raised - set(spec))}"


def test_one_except_catches_every_kind():
    """The root catches a container error, a store failure and a stalled stream, and the
    builtin kinds still catch theirs."""
    from kvwire.store import StoreError, open_store
    from kvwire.stream import StreamTimeout

    with pytest.raises(kvwire.Error) as info:
        kvwire.load(b"not a container at all, but long enough to read a preamble")
    assert isinstance(info.value, ValueError) and info.value.code == "BAD_MAGIC"
    with pytest.raises(kvwire.Error) as info:
        open_store("redis://host:notaport")
    assert isinstance(info.value, StoreError) and info.value.code == "STORE_ERROR"
    exc = StreamTimeout("no byte for 1 s", timeout=1.0, transferred=3)
    assert isinstance(exc, TimeoutError) and isinstance(exc, kvwire.Error) and exc.code == "STREAM_TIMEOUT"
    assert not issubclass(kvwire.codecs.CodecGrowthWarning, kvwire.Error)
