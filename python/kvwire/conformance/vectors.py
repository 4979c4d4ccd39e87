"""Gold vectors on disk: manifests, JSON twins, integrity against the manifest digests.

``load_vector_sets`` reads ``conformance/vectors/<version>/manifest.json`` (and the
append-only regressions manifest beside it), checks every committed file against its
SHA-256 and attaches each valid vector's twin; a ``WriterCase`` is a valid vector the
manifest marks for the writer and round-trip levels. No implementation is run here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Vector:
    version: str
    name: str
    path: Path
    entry: dict
    twin: dict | None = None
    regression: bool = False
    integrity: list = field(default_factory=list)  # problems with the committed files

    @property
    def id(self) -> str:
        return f"{self.version}/{self.name}"

    @property
    def kind(self) -> str:
        return self.entry["kind"]

    def allowed_codes(self) -> set | None:
        """Codes that count as the right rejection; None means any registry code."""
        if self.entry.get("code_policy") == "any":
            return None
        return {self.entry["expected_code"], *self.entry.get("also_allowed", {})}


@dataclass
class VectorSet:
    version: str
    root: Path
    manifest: dict
    vectors: list

    @property
    def error_codes(self) -> set:
        return set(self.manifest.get("error_codes", ()))


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _load_entries(root: Path, version: str, manifest_path: Path, regression: bool) -> list:
    with open(manifest_path) as f:
        manifest = json.load(f)
    out = []
    for e in manifest.get("vectors", []):
        base = manifest_path.parent
        v = Vector(version, e["name"], base / e["file"], e, regression=regression)
        if not v.path.is_file():
            v.integrity.append(f"missing file {e['file']}")
        elif _sha256_file(v.path) != e["sha256"]:
            v.integrity.append(f"{e['file']}: sha256 differs from the manifest (file modified?)")
        if e.get("twin"):
            tp = base / e["twin"]
            if not tp.is_file():
                v.integrity.append(f"missing twin {e['twin']}")
            else:
                if _sha256_file(tp) != e["twin_sha256"]:
                    v.integrity.append(f"{e['twin']}: sha256 differs from the manifest")
                with open(tp) as f:
                    v.twin = json.load(f)
        out.append(v)
    return out


def load_vector_set(version_dir: Path) -> VectorSet:
    version_dir = Path(version_dir)
    with open(version_dir / "manifest.json") as f:
        manifest = json.load(f)
    version = manifest.get("format_version", version_dir.name)
    vectors = _load_entries(version_dir, version, version_dir / "manifest.json", False)
    reg = manifest.get("regressions")
    if reg and (version_dir / reg).is_file():
        vectors += _load_entries(version_dir, version, version_dir / reg, True)
    return VectorSet(version, version_dir, manifest, vectors)


def _version_key(name: str):
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"[.]", name))


def load_vector_sets(path: str | os.PathLike[str]) -> list[VectorSet]:
    """One version folder (holding manifest.json) or a folder of version folders."""
    path = Path(path)
    if (path / "manifest.json").is_file():
        return [load_vector_set(path)]
    dirs = sorted((d for d in path.iterdir() if (d / "manifest.json").is_file()), key=lambda d: _version_key(d.name))
    if not dirs:
        raise FileNotFoundError(f"{path}: no manifest.json here or in a version folder below")
    return [load_vector_set(d) for d in dirs]


# Where a wheel carries the kit: setup.py copies conformance/vectors and PROTOCOL.md here.
PACKAGE_DATA = Path(__file__).resolve().parent / "data"


def find_vectors_root(start=None) -> Path | None:
    """The gold vectors: conformance/vectors of a checkout above ``start`` (default: the
    working directory), else above this package (an editable install in a checkout), else
    the copy an installed wheel carries (``PACKAGE_DATA``); None when there is none."""
    for base in (Path(start or os.getcwd()).resolve(), Path(__file__).resolve()):
        for d in (base, *base.parents):
            cand = d / "conformance" / "vectors"
            if cand.is_dir():
                return cand
    shipped = PACKAGE_DATA / "vectors"
    return shipped if shipped.is_dir() else None


def find_protocol(vectors_root) -> Path | None:
    """PROTOCOL.md beside a vectors folder (a checkout's conformance/ or the wheel's copy)."""
    for d in (Path(vectors_root), *Path(vectors_root).parents[:2]):
        cand = d / "PROTOCOL.md"
        if cand.is_file():
            return cand
    return None


@dataclass
class WriterCase:
    """A valid vector the writer and round-trip levels encode, in the form and codec it names."""

    vector: Vector
    form: str
    codec: str

    @property
    def id(self) -> str:
        return self.vector.id
