"""The model store: a directory of models, each as safetensors weights plus a JSON manifest.

Layout of a store directory::

    NAME.safetensors   # the weights, keyed like the torch state dict ("0.weight", ...)
    NAME.json          # {"format": 1, "name": NAME, "architecture": {...},
                       #  "metadata": {...}}   # e.g. the DP-SGD training record, accuracy

Nothing here is pickled: safetensors holds only raw tensors, the manifest is JSON. Writes are
atomic (temporary file, fsync, rename), so a crash never leaves a half-written model behind.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save

from peer.base.errors import InvalidArgument, NotFound
from peer.nn.architectures import model_from_arrays, validate_architecture

FORMAT = 1
NAME_RULE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


@dataclass(frozen=True)
class StoredModel:
    name: str
    architecture: Mapping[str, Any]
    arrays: Mapping[str, np.ndarray]
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def module(self):
        """The torch module (validates every array against the architecture)."""
        return model_from_arrays(self.architecture, self.arrays)


def check_name(name: str, field_name: str = "name") -> str:
    if not isinstance(name, str) or not NAME_RULE.match(name):
        raise InvalidArgument(field_name, f"must be 1-128 characters of letters, digits, '_', '.', '-' starting with a letter or digit, got {name!r}")
    return name


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_model(directory: str | os.PathLike, name: str, architecture: Mapping[str, Any],
               arrays: Mapping[str, np.ndarray], metadata: Mapping[str, Any] | None = None) -> Path:
    """Write a model (weights first, manifest last: a model exists once its manifest does)."""
    check_name(name)
    arch = validate_architecture(architecture)
    model_from_arrays(arch, arrays)  # names, shapes, finiteness
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {k: np.ascontiguousarray(np.asarray(v, dtype=np.float32)) for k, v in arrays.items()}
    _atomic_write(d / f"{name}.safetensors", save(tensors))
    manifest = {"format": FORMAT, "name": name, "architecture": arch, "metadata": dict(metadata or {})}
    _atomic_write(d / f"{name}.json", json.dumps(manifest, indent=2, sort_keys=True, allow_nan=False).encode())
    return d / f"{name}.json"


def load_model(directory: str | os.PathLike, name: str) -> StoredModel:
    check_name(name)
    d = Path(directory)
    mpath, wpath = d / f"{name}.json", d / f"{name}.safetensors"
    if not mpath.is_file() or not wpath.is_file():
        raise NotFound(f"model {name!r} is not in the store {str(d)!r}")
    try:
        manifest = json.loads(mpath.read_text())
    except ValueError as e:
        raise InvalidArgument(f"{mpath.name}", f"is not valid JSON: {e}") from None
    if manifest.get("format") != FORMAT or manifest.get("name") != name:
        raise InvalidArgument(f"{mpath.name}", f"must have format {FORMAT} and name {name!r}")
    if "imported" in manifest:
        # a site's own network (peer.nn.imported): its structure replaces the architecture
        raise InvalidArgument(f"{mpath.name}", "describes an imported model; read it with peer.nn.imported.load_imported")
    try:
        arrays = load_file(str(wpath))
    except (SafetensorError, OSError) as e:
        raise InvalidArgument(f"{wpath.name}", f"is not a readable safetensors file: {e}") from None
    arch = validate_architecture(manifest.get("architecture"))
    model_from_arrays(arch, arrays)
    return StoredModel(name, arch, arrays, manifest.get("metadata", {}))


def list_models(directory: str | os.PathLike) -> list[str]:
    """Names of the complete models in a store directory, sorted."""
    d = Path(directory)
    if not d.is_dir():
        raise NotFound(f"model store {str(d)!r} does not exist")
    return sorted(p.stem for p in d.glob("*.json") if (d / f"{p.stem}.safetensors").is_file() and NAME_RULE.match(p.stem))
