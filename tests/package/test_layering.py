"""The package's layering stays true: subpackages are layers, lowest first, and every
import inside kvwire goes down (or sideways within a layer), never up, never in a circle,
never to a private name of another module.

The layers follow the spec (spec/README.md maps each document to its subpackage):

    version       the package version
    format        spec/kvwire-v1.md as code: bytes <-> structures, sans-IO
    codecs        section 13 and spec/codecs.md: chunk bodies, and spec/policy.md
    cache         KVCache, SparseKVCache, Encoder, Reader, StreamDecoder: the encode/decode API
    model         spec/crossmodel.md: identity, compatibility, prefix index, RoPE
    engine side   layouts, stream, store, adapters: engines, transports and frameworks
    tools         the CLI, demo, fidelity harness, synthetic caches and the conformance kit
    kvwire        the first screen (``__init__``) and ``python -m kvwire``

Imports inside functions count like top-level ones: a lazy import that closes a cycle is
still a cycle in the design.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import kvwire

PKG = pathlib.Path(kvwire.__file__).parent
LAYERS = [  # lowest first; names in one set share a layer
    {"version", "deprecation"},
    {"format"},
    {"codecs"},
    {"cache"},
    {"model"},
    {"layouts", "stream", "store", "adapters"},
    {"integrations"},
    {"tools", "conformance"},
    {"__init__", "__main__"},
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}
GENERATED = "format.fbs"  # flatc output (tools/gen_schemas.py), not held to the hand-written rules
ROOT_MODULES = ("__init__", "__main__")


def scan(root: pathlib.Path) -> tuple[dict, dict]:
    """({module: path}, {module: [(imported module, imported name or None, line)]}) of a
    package tree; module names are relative to the package ("format.header", "__init__")."""
    modules = {}
    for p in sorted(root.rglob("*.py")):
        if "__pycache__" in p.parts:
            continue
        parts = list(p.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts.pop()
        modules[".".join(parts)] = p
    graph = {}
    for m, p in modules.items():
        if m == GENERATED or m.startswith(GENERATED + "."):
            continue
        base = [] if m in ROOT_MODULES else m.split(".")
        if p.name != "__init__.py" and m not in ROOT_MODULES:
            base = base[:-1]  # a module's imports are relative to its package
        deps = []
        for node in ast.walk(ast.parse(p.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level == 0:
                continue  # absolute imports of the package are refused by test_vendoring
            pkg = base[: len(base) - (node.level - 1)]
            target = ".".join(pkg + ([node.module] if node.module else [])) or "__init__"
            for alias in node.names:
                sub = alias.name if target == "__init__" else f"{target}.{alias.name}"
                deps.append((sub, None, node.lineno) if sub in modules else (target, alias.name, node.lineno))
        graph[m] = deps
    return modules, graph


def layer(module: str) -> str:
    return module.split(".")[0]


def upward(graph) -> list:
    return [(m, t, line) for m, deps in graph.items() for t, _, line in deps if RANK[layer(t)] > RANK[layer(m)]]


def private(graph) -> list:
    """Imports of a private name (``_x``) or module (``_m``) defined in another module."""
    return [(m, t, name, line) for m, deps in graph.items() for t, name, line in deps
            if t != m and (name or t.rsplit(".", 1)[-1]).startswith("_") and name != "__version__"
            and (name or t) not in ROOT_MODULES]


def cycles(modules, graph) -> list:
    """Import cycles between modules. A package's ``__init__`` re-exporting its submodules
    is an edge down; a submodule importing its own package's ``__init__`` would be one up,
    and is reported as a cycle of its own."""
    found = [[m, t, m] for m, deps in graph.items() for t, _, _ in deps
             if modules[t].name == "__init__.py" and t not in ROOT_MODULES and m.startswith(t + ".")]
    edges = {m: sorted({t for t, _, _ in deps if t in graph and t != m
                        and not (modules[m].name == "__init__.py" and t.startswith(m + "."))})
             for m, deps in graph.items()}
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in edges[m]:
            if state.get(t) == "open":
                found.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m)
    return found


MODULES, GRAPH = scan(PKG)


def test_every_subpackage_has_a_layer():
    """A new subpackage gets its place in LAYERS (and in spec/README.md) before it lands."""
    assert {layer(m) for m in MODULES} <= set(RANK), sorted({layer(m) for m in MODULES} - set(RANK))


def test_no_upward_import():
    assert upward(GRAPH) == []


def test_no_private_name_across_modules():
    assert private(GRAPH) == []


def test_no_import_cycle():
    assert cycles(MODULES, GRAPH) == []


def test_only_the_entry_point_imports_the_package_root():
    """A submodule importing ``kvwire`` itself would run the whole first screen and tie
    every layer to the top one."""
    assert [(m, line) for m, deps in GRAPH.items() for t, _, line in deps
            if t == "__init__" and m not in ROOT_MODULES] == []


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_hand_written_modules_stay_small(module):
    """About 400 lines at most: a module past that holds more than one responsibility. Import
    statements are not counted: ruff's import sorting writes one name a line, which says
    nothing about what a module does."""
    text = MODULES[module].read_text()
    imports = sum(n.end_lineno - n.lineno + 1 for n in ast.walk(ast.parse(text))
                  if isinstance(n, (ast.Import, ast.ImportFrom)))
    lines = text.count("\n") - imports
    assert lines <= 420, f"{module}: {lines} lines besides its imports"


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_every_module_says_why(module):
    doc = ast.get_docstring(ast.parse(MODULES[module].read_text()))
    assert doc and len(doc) > 30, f"{module} has no docstring saying what it is for"


def test_the_checks_find_each_violation(tmp_path):
    """The checks can fail: a synthetic tree with an upward import, a private import, a
    cycle and a submodule importing its own package is caught by each."""
    files = {
        "__init__.py": "",
        "format/__init__.py": "from . import a\n",
        "format/a.py": "from ..cache import b\nfrom .c import _hidden\nfrom . import c\n",
        "format/c.py": "from .a import x\n",
        "format/d.py": "from . import a\n",
        "format/e.py": "from ..format import a\nfrom .. import format\n",
        "cache/__init__.py": "",
        "cache/b.py": "from ..format.a import y\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    modules, graph = scan(tmp_path)
    assert ("format.a", "cache.b", 1) in upward(graph)
    assert private(graph) == [("format.a", "format.c", "_hidden", 2)]
    found = cycles(modules, graph)
    assert ["format.a", "format.c", "format.a"] in found
    assert ["format.e", "format", "format.e"] in found  # `from .. import format` in format/e.py
    assert not any(c[0] == "format.d" for c in found)
    assert ("format.a", None, 1) in graph["format.d"]
