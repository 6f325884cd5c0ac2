"""The model store: a directory of models, each as safetensors weights plus a JSON manifest.

Layout of a store directory::

    NAME.safetensors   # the weights, keyed like the torch state dict ("0.weight", ...)
    NAME.json          # {"format": 1, "name": NAME, "architecture": {...},
                       #  "metadata": {...},   # e.g. the DP-SGD training record, accuracy
                       #  "preprocessing": {...}}  # optional: how records become inputs
                       #                       # (peer.nn.tables.Preprocessing, JSON)

A model trained on a site's own records carries its preprocessing (standardisation statistics,
category lists, label classes, fill values), so that whatever uses the model later prepares
inputs exactly as in training. It is site-local: fitted on protected training records and not
covered by any DP guarantee, it is never sent to a peer.

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
from peer.nn.tables import Preprocessing, input_size

__all__ = [
    "FORMAT",
    "NAME_RULE",
    "StoredModel",
    "check_name",
    "list_models",
    "load_model",
    "load_model_pair",
    "load_store",
    "read_pair",
    "read_preprocessing_file",
    "save_model",
    "site_unusable_files",
    "store_pair",
    "unusable_files",
    "write_sidecar",
]

FORMAT = 1
NAME_RULE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


@dataclass(frozen=True)
class StoredModel:
    name: str
    architecture: Mapping[str, Any]
    arrays: Mapping[str, np.ndarray]
    metadata: Mapping[str, Any] = field(default_factory=dict)
    preprocessing: Preprocessing | None = None

    def module(self):
        """The torch module (validates every array against the architecture)."""
        return model_from_arrays(self.architecture, self.arrays)

    @property
    def release_architecture(self) -> Mapping[str, Any]:
        """The public architecture a release of this model carries: its JSON description
        (``peer.nn.imported.ImportedModel.release_architecture`` is a site's own network's), so
        that no caller outside the model store asks which kind a model is."""
        return self.architecture


def check_name(name: str, field_name: str = "name") -> str:
    if not isinstance(name, str) or not NAME_RULE.match(name):
        raise InvalidArgument(
            field_name,
            f"must be 1-128 characters of letters, digits, '_', '.', '-' starting with a letter or digit, got {name!r}",
        )
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


def _check_preprocessing(
    preprocessing: Preprocessing | Mapping[str, Any] | None, arch: Mapping[str, Any], where: str
) -> Preprocessing | None:
    if preprocessing is None:
        return None
    prep = preprocessing if isinstance(preprocessing, Preprocessing) else Preprocessing.from_dict(preprocessing, where)
    if prep.width != input_size(arch):
        raise InvalidArgument(
            where, f"prepares {prep.width} input entries but the architecture takes {input_size(arch)}"
        )
    return prep


def save_model(
    directory: str | os.PathLike,
    name: str,
    architecture: Mapping[str, Any],
    arrays: Mapping[str, np.ndarray],
    metadata: Mapping[str, Any] | None = None,
    preprocessing: Preprocessing | Mapping[str, Any] | None = None,
) -> Path:
    """Write a model (weights first, manifest last: a model exists once its manifest does),
    with the preprocessing of the records it was trained on when there is one."""
    check_name(name)
    arch = validate_architecture(architecture)
    model_from_arrays(arch, arrays)  # names, shapes, finiteness
    prep = _check_preprocessing(preprocessing, arch, "preprocessing")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {k: np.ascontiguousarray(np.asarray(v, dtype=np.float32)) for k, v in arrays.items()}
    _atomic_write(d / f"{name}.safetensors", save(tensors))
    manifest = {"format": FORMAT, "name": name, "architecture": arch, "metadata": dict(metadata or {})}
    if prep is not None:
        manifest["preprocessing"] = prep.to_dict()
    _atomic_write(d / f"{name}.json", json.dumps(manifest, indent=2, sort_keys=True, allow_nan=False).encode())
    return d / f"{name}.json"


def read_pair(mpath: Path, wpath: Path, name: str | None) -> tuple[dict, dict[str, np.ndarray]]:
    """The manifest and the tensors of one model file pair, checked for format (and, when
    ``name`` is given, that the manifest names it); every model reader goes through here."""
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except ValueError as e:
        raise InvalidArgument(f"{mpath.name}", f"is not valid JSON: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise InvalidArgument(f"{mpath.name}", f"must be a model manifest of format {FORMAT}")
    if name is not None and manifest.get("name") != name:
        raise InvalidArgument(f"{mpath.name}", f"must have format {FORMAT} and name {name!r}")
    try:
        arrays = load_file(str(wpath))
    except (SafetensorError, OSError) as e:
        raise InvalidArgument(f"{wpath.name}", f"is not a readable safetensors file: {e}") from None
    return manifest, arrays


def store_pair(directory: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """The manifest and weights paths of model ``name`` in a store (NotFound unless both exist)."""
    check_name(name)
    d = Path(directory)
    mpath, wpath = d / f"{name}.json", d / f"{name}.safetensors"
    if not mpath.is_file() or not wpath.is_file():
        raise NotFound(f"model {name!r} is not in the store {str(d)!r}")
    return mpath, wpath


def load_model(directory: str | os.PathLike, name: str) -> StoredModel:
    mpath, wpath = store_pair(directory, name)
    manifest, arrays = read_pair(mpath, wpath, name)
    if "imported" in manifest:
        # a site's own network (peer.nn.imported): its structure replaces the architecture
        raise InvalidArgument(
            f"{mpath.name}", "describes an imported model; read it with peer.nn.imported.load_imported"
        )
    arch = validate_architecture(manifest.get("architecture"))
    model_from_arrays(arch, arrays)
    prep = _check_preprocessing(manifest.get("preprocessing"), arch, f"{mpath.name}: preprocessing")
    return StoredModel(name, arch, arrays, manifest.get("metadata", {}), prep)


def list_models(directory: str | os.PathLike) -> list[str]:
    """Names of the complete models in a store directory, sorted."""
    d = Path(directory)
    if not d.is_dir():
        raise NotFound(
            f"model store {str(d)!r} does not exist (make it: `privfusion site new` creates a site's "
            "empty store; or correct the path, e.g. [site].models in site.toml)"
        )
    return sorted(
        p.stem for p in d.glob("*.json") if (d / f"{p.stem}.safetensors").is_file() and NAME_RULE.match(p.stem)
    )


#: Files beside a model that belong to it without being part of it (not "unusable"):
#: ``NAME.provenance.json`` (where an adopted model came from: ``privfusion model adopt``) and
#: ``NAME.record.json`` (a local merge's release record: ``peer.dp.pools.save_merged``).
SIDECAR_SUFFIXES: tuple[str, ...] = (".provenance.json", ".record.json")


def _sidecar_of(filename: str) -> str | None:
    for suffix in SIDECAR_SUFFIXES:
        if filename.endswith(suffix):
            return filename[: -len(suffix)]
    return None


def unusable_files(
    directory: str | os.PathLike, *, check: bool = False, empty: str | None = None
) -> list[tuple[Path, str]]:
    """Every entry of a store directory that is not part of a usable model, and why.

    A model is exactly the pair ``NAME.safetensors`` + ``NAME.json`` with a valid ``NAME``;
    anything else in the directory is reported, never skipped silently: a manifest without
    weights or weights without a manifest (a model exists once both do), a name the store
    refuses, a sub-directory, any other file (a ``.pt`` checkpoint, a CSV, a hidden temporary
    file left by a crash). Sidecars of a model that exists (:data:`SIDECAR_SUFFIXES`) are not
    reported; one whose model is missing is. With ``check`` every complete pair is loaded too
    and a pair that does not load is reported with the loader's reason (the daemon loads its
    models itself and skips this). A directory that does not exist is one entry; an empty one
    is an entry only when ``empty`` gives the reason (a pool without models is not offered).

    Returns ``(path, reason)`` pairs sorted by path. Reasons name files and rules only, never
    tensor values.
    """
    d = Path(directory)
    if not d.is_dir():
        return [(d, "does not exist" if not d.exists() else "is not a directory")]
    entries = sorted(d.iterdir())
    names = {p.name for p in entries}
    models = {
        p.name[: -len(".json")]
        for p in entries
        if p.name.endswith(".json") and _sidecar_of(p.name) is None and p.is_file()
    }
    complete = {n for n in models if f"{n}.safetensors" in names and NAME_RULE.match(n)}
    out: list[tuple[Path, str]] = []
    for p in entries:
        name = p.name
        if p.is_dir():
            out.append((p, "is a directory: a store is flat (NAME.safetensors + NAME.json side by side)"))
            continue
        owner = _sidecar_of(name)
        if owner is not None:
            if owner not in complete:
                out.append((p, f"belongs to a model {owner!r} that is not in the store"))
            continue
        if name.endswith(".safetensors"):
            stem, other = name[: -len(".safetensors")], f"{name[: -len('.safetensors')]}.json"
        elif name.endswith(".json"):
            stem, other = name[: -len(".json")], f"{name[: -len('.json')]}.safetensors"
        else:
            why = (
                "a hidden file (a temporary file a crash left behind?)" if name.startswith(".") else "not a model file"
            )
            out.append(
                (
                    p,
                    f"{why}: a model is NAME.safetensors (weights) + NAME.json (manifest); "
                    "other formats are not read (convert them, e.g. with privfusion model train)",
                )
            )
            continue
        if not NAME_RULE.match(stem):
            out.append(
                (
                    p,
                    f"{stem!r} is not a valid model name (1-128 letters, digits, '_', '.', '-', starting with a letter or digit)",
                )
            )
        elif other not in names:
            out.append((p, f"has no {other} beside it: a model is both files"))
        elif check and name.endswith(".json"):  # once per pair
            try:
                load_model(d, stem)
            except (InvalidArgument, NotFound) as e:
                out.append((p, f"does not load: {e}"))
    if empty is not None and not complete:
        out.append((d, empty))
    return out


def site_unusable_files(
    models: str | os.PathLike,
    pools: Mapping[str, str | os.PathLike] | None = None,
    probe: str | os.PathLike | None = None,
    base: str | os.PathLike | None = None,
    failed: list[tuple[Path, str]] = (),
) -> list[tuple[str, str]]:
    """What a daemon configured with this model store, these pools and this probe set will not
    serve, and why: :func:`unusable_files` of the store, the pairs that did not load
    (``failed``, from :func:`load_store`), :func:`unusable_files` of every pool (a pool directory
    that is missing or holds no model is not offered), and a configured probe file that does not
    exist yet (the daemon serves without one; rounds from the site and Fuse need it).

    Paths are relative to ``base`` (the directory of site.toml) where they lie under it, so the
    list can be shown to pinned peers without the site's absolute layout.
    """
    root = Path(base).resolve() if base is not None else None

    def shown(p: Path) -> str:
        if root is not None:
            try:
                return str(p.resolve().relative_to(root))
            except ValueError:
                pass
        return str(p)

    out = [
        (shown(p), f"model store {why}" if p == Path(models) else why)
        for p, why in sorted([*unusable_files(models), *failed])
    ]
    for name, d in (pools or {}).items():
        for p, why in unusable_files(d, empty="holds no model yet: the pool is not offered (privfusion pool train)"):
            out.append((shown(p), f"pool {name!r}: {why}"))
    if probe is not None and not Path(probe).exists():
        out.append(
            (
                shown(Path(probe)),
                "the probe set does not exist yet: the daemon serves without one "
                "(rounds from this site and Fuse need it: privfusion probe make)",
            )
        )
    return out


def write_sidecar(directory: str | os.PathLike, name: str, suffix: str, document: Mapping[str, Any]) -> Path:
    """Write a model's sidecar ``NAME + suffix`` (one of :data:`SIDECAR_SUFFIXES`) as JSON,
    atomically. Written before the model itself, a sidecar is never missing for a model."""
    check_name(name)
    if suffix not in SIDECAR_SUFFIXES:
        raise InvalidArgument("suffix", f"must be one of {list(SIDECAR_SUFFIXES)}, got {suffix!r}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}{suffix}"
    _atomic_write(path, json.dumps(document, indent=2, sort_keys=True, default=str).encode())
    return path


def load_model_pair(path: str | os.PathLike) -> StoredModel:
    """A model file pair outside a store: ``PATH.safetensors`` + ``PATH.json`` (``path`` given
    with or without either suffix) — a release written by ``privfusion weights / merge / fuse``,
    a round's fused model, or a renamed copy of one. Checked like :func:`load_model` except
    that the manifest's ``name`` may differ from the file's (renaming a pair is not an error);
    the model is returned under the file's name."""
    p = Path(path)
    for suffix in (".safetensors", ".json"):
        if p.name.endswith(suffix):
            p = p.with_name(p.name[: -len(suffix)])
    mpath, wpath = p.with_name(p.name + ".json"), p.with_name(p.name + ".safetensors")
    if not mpath.is_file() or not wpath.is_file():
        raise NotFound(f"{str(p)!r} is not a model pair ({p.name}.safetensors + {p.name}.json side by side)")
    manifest, arrays = read_pair(mpath, wpath, None)  # a renamed pair keeps its manifest's name
    arch = validate_architecture(manifest.get("architecture"))
    model_from_arrays(arch, arrays)
    prep = _check_preprocessing(manifest.get("preprocessing"), arch, f"{mpath.name}: preprocessing")
    return StoredModel(p.name, arch, arrays, manifest.get("metadata", {}), prep)


def load_store(directory: str | os.PathLike) -> tuple[dict[str, StoredModel], list[tuple[Path, str]]]:
    """Every model of a store that loads, by name, and ``(path, reason)`` for each complete pair
    that does not (a manifest that is not JSON, weights that do not fit the architecture, ...):
    a daemon serves the first and lists the second, instead of refusing to start over one bad
    file. A missing directory is :class:`NotFound` (the configuration is wrong, not a file)."""
    d = Path(directory)
    models, failed = {}, []
    for name in list_models(d):
        try:
            models[name] = load_model(d, name)
        except (InvalidArgument, NotFound) as e:
            failed.append((d / f"{name}.json", f"does not load, not served: {e}"))
    return models, failed


def read_preprocessing_file(path: str | os.PathLike, field_name: str = "preprocessing") -> Preprocessing:
    """A preprocessing from a JSON file: one preprocessing (a table's or an image set's), or a
    model manifest holding one (what ``--preprocessing`` accepts)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise NotFound(f"{field_name} {str(p)!r}: {e.strerror}") from None
    except ValueError as e:
        raise InvalidArgument(field_name, f"{str(p)!r} is not valid JSON: {e}") from None
    if isinstance(data, dict) and ("architecture" in data or "imported" in data):  # a model manifest
        if "preprocessing" not in data:
            raise InvalidArgument(field_name, f"the model manifest {str(p)!r} holds no preprocessing")
        data = data["preprocessing"]
    return Preprocessing.from_dict(data, f"{p.name}")
