"""A site's own network in the model store: import, load and export, with the site's key names.

A site brings a ``torch.nn.Module`` factory (its own code, run only at that site) and a
state dict — a ``torch.save``'d dict of tensors, read with ``torch.load(weights_only=True)`` so
no pickled code runs, or a safetensors file. Import builds the module, loads the weights under
the site's own key names (strictly: every key the module has, nothing else), traces the
permutation structure and proves it (:mod:`peer.nn.tracing`), then stores::

    NAME.safetensors   # the state dict, keyed as the site named it, dtypes kept
    NAME.json          # {"format": 1, "name": NAME, "imported": {"factory": "MODULE:FUNCTION",
                       #   "structure": {...}}, "metadata": {...},
                       #  "preprocessing": {...}}  # only for a model trained on a site's own
                       #                       # records (peer.nn.tables.Preprocessing, JSON)

The manifest's ``imported`` entry replaces the ``architecture`` of built-in models: the
structure (names, shapes, groups) is public and travels without any site code; the factory is
only a note of which site code rebuilds the module. Export writes the weights back under the
same keys, so ``load_state_dict`` into the site's own class gives the same network.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.numpy import load_file, save
from torch import nn

from peer.base.errors import InvalidArgument, NotFound, Unsupported
from peer.nn.store import FORMAT, _atomic_write, check_name, read_pair, store_pair
from peer.nn.tables import Preprocessing
from peer.nn.tracing import PermutationStructure, check_no_aliases, import_structure

__all__ = [
    "ImportedModel",
    "build_module",
    "check_same_structure",
    "export_model",
    "first_difference",
    "import_model",
    "imported_architecture",
    "input_batch",
    "is_imported_architecture",
    "load_factory",
    "load_imported",
    "load_site_state",
    "module_accuracy",
    "module_from_arrays",
    "read_weights",
    "records_fit_network",
    "resolve_factory",
    "save_imported",
    "structure_of",
    "structure_sha256",
]

EXPORT_FORMATS = ("pt", "safetensors")


@dataclass(frozen=True)
class ImportedModel:
    """A site's own network as stored: its structure, its state (site key names) and notes."""

    name: str
    factory: str
    structure: PermutationStructure
    arrays: Mapping[str, np.ndarray]
    metadata: Mapping[str, Any] = field(default_factory=dict)
    #: how records become its inputs, for a model trained on a site's own records (a DP pool's
    #: model: ``pool train --from-model NAME --data FILE``); None for an imported network
    preprocessing: Preprocessing | None = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The state dict in the site's own key order."""
        return {k: torch.as_tensor(np.array(self.arrays[k])) for k in self.structure.parameters}

    @property
    def release_architecture(self) -> dict:
        """The public architecture a release of this network carries: its traced structure and
        digest (:func:`imported_architecture`), never its code; a built-in model's is its JSON
        description (``peer.nn.store.StoredModel.release_architecture``)."""
        return imported_architecture(self.structure)


def load_factory(
    spec: str, search_path: Sequence[str | os.PathLike] = (), field: str = "factory"
) -> Callable[[], nn.Module]:
    """``MODULE:FUNCTION`` (a dotted module importable from ``search_path`` or ``sys.path``) or
    ``path/to/file.py:FUNCTION``: the callable it names. This runs the site's code: only at the
    site that owns it. Every refusal names ``field`` (the option or config key the spec came
    from: ``factory``, ``round.iterate.train``)."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise InvalidArgument(field, f"must be MODULE:FUNCTION or FILE.py:FUNCTION, got {spec!r}")
    mod_name, fn_name = spec.split(":")
    try:
        if mod_name.endswith(".py"):
            path = Path(mod_name)
            if not path.is_file():
                raise InvalidArgument(field, f"file {mod_name!r} does not exist")
            s = importlib.util.spec_from_file_location(f"_privfusion_site_factory_{path.stem}", path)
            module = importlib.util.module_from_spec(s)
            s.loader.exec_module(module)
        else:
            added = [str(p) for p in search_path if str(p) not in sys.path]
            sys.path[:0] = added
            try:
                module = importlib.import_module(mod_name)
            finally:
                for p in added:
                    sys.path.remove(p)
    except InvalidArgument:
        raise
    except Exception as e:  # the site's code failed: say how
        raise InvalidArgument(field, f"cannot import {mod_name!r}: {type(e).__name__}: {e}") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise InvalidArgument(field, f"{mod_name!r} has no callable {fn_name!r}")
    return fn


def build_module(factory: Callable[[], nn.Module], spec: str = "factory") -> nn.Module:
    try:
        module = factory()
    except Exception as e:  # the factory is the site's code: any failure is refused with its reason
        raise InvalidArgument("factory", f"{spec} raised {type(e).__name__}: {e}") from None
    if not isinstance(module, nn.Module):
        raise InvalidArgument("factory", f"{spec} must return a torch.nn.Module, got {type(module).__name__}")
    # every build, not only import: a model stored before imports refused aliases is refused
    # wherever its factory is run again (releases, pools, rounds)
    check_no_aliases(module)
    return module


def read_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A state dict from ``.safetensors`` or a ``torch.save``'d dict of tensors (read with
    ``weights_only=True``: plain tensors only, no code)."""
    p = Path(path)
    if not p.is_file():
        raise NotFound(f"weights file {str(p)!r} does not exist")
    if p.suffix == ".safetensors":
        try:
            return {k: torch.as_tensor(v) for k, v in load_file(str(p)).items()}
        except (SafetensorError, OSError) as e:
            raise InvalidArgument("weights", f"{p.name} is not a readable safetensors file: {e}") from None
    try:
        obj = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as e:  # weights_only refuses anything but tensors and plain containers
        raise InvalidArgument(
            "weights",
            f"{p.name} is not a state dict readable with torch.load(weights_only=True): {type(e).__name__}: {e}",
        ) from None
    if isinstance(obj, Mapping) and "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
    ):
        raise InvalidArgument("weights", f"{p.name} must hold a dict of parameter name -> tensor")
    return dict(obj)


def load_site_state(module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load ``state`` into ``module`` strictly, with clear errors (names, shapes, finiteness).
    A module that names one tensor under two keys is refused first
    (:func:`peer.nn.tracing.check_no_aliases`): loading would silently keep one of the two
    values given for it."""
    check_no_aliases(module)
    expected = module.state_dict()
    missing = set(expected) - set(state)
    extra = set(state) - set(expected)
    if missing or extra:
        raise InvalidArgument(
            "weights", f"do not fit the module: missing {sorted(missing)}, unexpected {sorted(extra)}"
        )
    for k, ref in expected.items():
        t = state[k]
        if tuple(t.shape) != tuple(ref.shape):
            raise InvalidArgument(f"weights[{k}]", f"has shape {tuple(t.shape)}, the module needs {tuple(ref.shape)}")
        if t.is_floating_point() and not bool(torch.all(torch.isfinite(t))):
            raise InvalidArgument(f"weights[{k}]", "contains NaN or infinite values")
    module.load_state_dict({k: state[k].to(expected[k].dtype) for k in expected})


def _c(a: Any) -> np.ndarray:
    # np.ascontiguousarray would turn a 0-d buffer (BatchNorm's num_batches_tracked) into 1-d
    return np.array(a, order="C", copy=True)


def _arrays(module: nn.Module) -> dict[str, np.ndarray]:
    return {k: _c(v.detach().cpu().numpy()) for k, v in module.state_dict().items()}


def import_model(
    directory: str | os.PathLike,
    name: str,
    module: nn.Module,
    input_shape: Sequence[int],
    *,
    factory: str,
    metadata: Mapping[str, Any] | None = None,
    preprocessing: Preprocessing | None = None,
) -> ImportedModel:
    """Prove ``module``'s permutation structure and store it with its weights under ``name``
    (and the preprocessing of its inputs, when given). The weights must already be loaded
    (:func:`load_site_state`)."""
    check_name(name)
    structure = import_structure(module, input_shape)
    arrays = _arrays(module)
    save_imported(directory, name, factory, structure, arrays, metadata, preprocessing)
    return ImportedModel(name, factory, structure, arrays, dict(metadata or {}), preprocessing)


def save_imported(
    directory: str | os.PathLike,
    name: str,
    factory: str,
    structure: PermutationStructure,
    arrays: Mapping[str, Any],
    metadata: Mapping[str, Any] | None = None,
    preprocessing: Preprocessing | None = None,
) -> Path:
    """Write an imported model (weights first, manifest last, both atomic), with the
    preprocessing of the records it was trained on when there is one (it must prepare exactly
    the network's input entries)."""
    check_name(name)
    structure.check_arrays(arrays)
    prep = _check_preprocessing(preprocessing, structure, "preprocessing")
    for k, v in arrays.items():
        a = np.asarray(v)
        if np.issubdtype(a.dtype, np.floating) and not np.all(np.isfinite(a)):
            raise InvalidArgument(f"weights[{k}]", "contains NaN or infinite values")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {k: _c(v) for k, v in arrays.items()}
    _atomic_write(d / f"{name}.safetensors", save(tensors))
    manifest = {
        "format": FORMAT,
        "name": name,
        "imported": {"factory": factory, "structure": structure.to_json()},
        "metadata": dict(metadata or {}),
    }
    if prep is not None:
        manifest["preprocessing"] = prep.to_dict()
    _atomic_write(d / f"{name}.json", json.dumps(manifest, indent=2, sort_keys=True, allow_nan=False).encode())
    return d / f"{name}.json"


def _check_preprocessing(
    preprocessing: Preprocessing | Mapping[str, Any] | None, structure: PermutationStructure, where: str
) -> Preprocessing | None:
    if preprocessing is None:
        return None
    prep = preprocessing if isinstance(preprocessing, Preprocessing) else Preprocessing.from_dict(preprocessing, where)
    size = int(np.prod(structure.input_shape))
    if prep.width != size:
        raise InvalidArgument(
            where,
            f"prepares {prep.width} input entries but the network takes {size} (input shape {list(structure.input_shape)})",
        )
    return prep


def load_imported(directory: str | os.PathLike, name: str) -> ImportedModel:
    mpath, wpath = store_pair(directory, name)
    manifest, arrays = read_pair(mpath, wpath, name)
    imported = manifest.get("imported")
    if not isinstance(imported, Mapping):
        raise Unsupported("model", f"{name!r} is a built-in architecture, not an imported model")
    structure = PermutationStructure.from_json(imported.get("structure"))
    structure.check_arrays(arrays)
    prep = _check_preprocessing(manifest.get("preprocessing"), structure, f"{mpath.name}: preprocessing")
    return ImportedModel(name, str(imported.get("factory", "")), structure, arrays, manifest.get("metadata", {}), prep)


def export_model(model: ImportedModel, out: str | os.PathLike, fmt: str) -> Path:
    """Write the weights under the site's own key names: ``pt`` (a ``torch.save``'d dict of
    tensors, loadable with ``weights_only=True``) or ``safetensors``."""
    if fmt not in EXPORT_FORMATS:
        raise InvalidArgument("format", f"must be one of {list(EXPORT_FORMATS)}, got {fmt!r}")
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        data = save({k: _c(model.arrays[k]) for k in model.structure.parameters})
    else:
        import io

        buf = io.BytesIO()
        torch.save(model.state_dict(), buf)
        data = buf.getvalue()
    _atomic_write(path, data)
    return path


# ---------------------------------------------------------------------------------------------
# The public description of an imported architecture (what the wire carries)

#: ``architecture["kind"]`` of a site's own network wherever an architecture travels or is
#: stored beside a release (PeerInfo's ModelInfo/PoolInfo ``architecture_json``, a release's
#: manifest, a DP-SGD record): the traced structure and its digest, never the site's code.
IMPORTED_KIND = "imported"


def structure_json(structure: PermutationStructure) -> str:
    """The canonical JSON text of a structure (sorted keys, no spaces, the site's parameter
    order kept: it is a list): what :func:`structure_sha256` hashes."""
    return json.dumps(structure.to_json(), sort_keys=True, separators=(",", ":"), allow_nan=False)


def structure_sha256(structure: PermutationStructure) -> str:
    """SHA-256 (hex) of :func:`structure_json`: two sites' networks are one architecture exactly
    when these agree (same key names, shapes, dtypes, groups and axes, statistic points)."""
    import hashlib

    return hashlib.sha256(structure_json(structure).encode()).hexdigest()


def imported_architecture(structure: PermutationStructure) -> dict:
    """``{"kind": "imported", "structure": {...}, "structure_sha256": HEX}``: the public
    architecture of a site's own network. Names, shapes and axes only; no code."""
    return {"kind": IMPORTED_KIND, "structure": structure.to_json(), "structure_sha256": structure_sha256(structure)}


def is_imported_architecture(architecture: Any) -> bool:
    return isinstance(architecture, Mapping) and architecture.get("kind") == IMPORTED_KIND


def structure_of(architecture: Any, field_name: str = "architecture") -> PermutationStructure:
    """The structure an imported architecture describes, checked: known keys, a structure that
    :meth:`PermutationStructure.from_json` accepts, and a digest that matches it."""
    if not is_imported_architecture(architecture):
        raise InvalidArgument(f"{field_name}.kind", f"must be {IMPORTED_KIND!r} for a site's own network")
    extra = set(architecture) - {"kind", "structure", "structure_sha256"}
    if extra:
        raise InvalidArgument(field_name, f"unknown keys {sorted(extra)} for kind {IMPORTED_KIND!r}")
    structure = PermutationStructure.from_json(architecture.get("structure"))
    digest = architecture.get("structure_sha256")
    if digest != structure_sha256(structure):
        raise InvalidArgument(
            f"{field_name}.structure_sha256",
            "does not match the structure it travels with (SHA-256 of its canonical JSON)",
        )
    return structure


def first_difference(ours: Any, theirs: Any, path: str = "structure") -> str | None:
    """Where two JSON values first differ, as ``path: ours X, theirs Y`` (None when equal):
    what a refusal names so that an operator sees *which* layer or axis disagrees."""
    if isinstance(ours, Mapping) and isinstance(theirs, Mapping):
        for k in sorted(set(ours) | set(theirs)):
            if k not in ours or k not in theirs:
                return f"{path}.{k}: {'missing here' if k not in ours else 'missing in theirs'}"
            d = first_difference(ours[k], theirs[k], f"{path}.{k}")
            if d is not None:
                return d
        return None
    if isinstance(ours, list) and isinstance(theirs, list):
        for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
            d = first_difference(a, b, f"{path}[{i}]")
            if d is not None:
                return d
        if len(ours) != len(theirs):
            return f"{path}: {len(ours)} entries here, {len(theirs)} in theirs"
        return None
    if ours != theirs:
        return f"{path}: ours {json.dumps(ours)}, theirs {json.dumps(theirs)}"
    return None


def check_same_structure(ours: PermutationStructure, theirs_architecture: Any, who: str = "the peer") -> None:
    """Refuse (FailedPrecondition) a received architecture that is not exactly ours, naming the
    first difference: a peer's network is run in *our* module (built by our factory), so its
    state dict must have our key names, shapes and permutation groups, digest for digest."""
    from peer.base.errors import FailedPrecondition

    if not is_imported_architecture(theirs_architecture):
        kind = theirs_architecture.get("kind") if isinstance(theirs_architecture, Mapping) else None
        raise FailedPrecondition(f"architecture: {who} sent a {kind!r} architecture, ours is an imported network")
    try:
        theirs = structure_of(theirs_architecture)
    except InvalidArgument as e:
        raise FailedPrecondition(f"architecture: {who}'s structure is malformed: {e}") from None
    if structure_sha256(theirs) != structure_sha256(ours):
        diff = first_difference(ours.to_json(), theirs.to_json()) or "the canonical JSON differs"
        raise FailedPrecondition(
            f"architecture: {who}'s network is not ours (structure digest {structure_sha256(theirs)[:12]} vs "
            f"{structure_sha256(ours)[:12]}); first difference at {diff}"
        )


def module_from_arrays(
    factory: Callable[[], nn.Module], structure: PermutationStructure, arrays: Mapping[str, Any] | None = None
) -> nn.Module:
    """Our own module (built by our factory) holding ``arrays`` (a state dict keyed by our names,
    checked strictly), in eval mode. With ``arrays`` None: the factory's own initialisation."""
    module = build_module(factory)
    structure.check_arrays({k: v.detach().numpy() for k, v in module.state_dict().items()}, "factory state dict")
    if arrays is not None:
        structure.check_arrays(arrays)
        load_site_state(module, {k: torch.as_tensor(np.array(arrays[k])) for k in structure.parameters})
    return module.eval()


def input_batch(structure: PermutationStructure, x: Any) -> torch.Tensor:
    """Rows of inputs (flat or already shaped) as the float32 batch the network takes."""
    t = torch.as_tensor(np.asarray(x, dtype=np.float32))
    size = int(np.prod(structure.input_shape))
    if t.dim() == 0 or t[0].numel() != size:
        raise InvalidArgument("x", f"rows must hold {size} values each (input shape {list(structure.input_shape)})")
    return t.reshape(t.shape[0], *structure.input_shape)


@torch.no_grad()
def module_accuracy(module: nn.Module, structure: PermutationStructure, x: Any, y: Any) -> float:
    """Top-1 accuracy in eval mode on (x, y)."""
    module.eval()
    logits = module(input_batch(structure, x))
    return float(np.mean(logits.argmax(dim=1).numpy() == np.asarray(y)))


def resolve_factory(spec: str, base: str | os.PathLike | None = None) -> str:
    """``FILE.py:FUNCTION`` with FILE made absolute (against ``base``, default the current
    directory), so that the daemon, started elsewhere, runs the same file; ``MODULE:FUNCTION``
    unchanged (it is imported from the site's directory or sys.path)."""
    if isinstance(spec, str) and spec.count(":") == 1:
        mod, fn = spec.split(":")
        if mod.endswith(".py"):
            p = Path(mod)
            if not p.is_absolute():
                p = Path(base or ".") / p
            return f"{p.resolve()}:{fn}"
    return spec


def records_fit_network(structure, preprocessing, source: str, name: str) -> str:
    """Check that records prepared by ``preprocessing`` are inputs of the site's own network
    (``structure.input_shape``) and say how they become them; refuse, naming the file and the
    rule, otherwise. The rule:

    - the prepared width must be the network's input size, prod(input_shape);
    - image records (an ``.npz`` whose ``x`` has shape (m, C, H, W) or (m, H, W)) go in as they
      are when the network takes that shape, flattened when it takes flat rows (its input
      shape says so), and are refused for any other shape (a reshape would scramble pixels);
    - table rows go in as they are when the network takes flat rows; into a network taking a
      shaped input (e.g. [1, 8, 8]) they are reshaped row-major in column order, because the
      network's input shape says so, and only when every entry is one numeric column: one-hot
      entries of a categorical column are no pixels, so such a table is refused."""
    shape = tuple(int(s) for s in structure.input_shape)
    size = math.prod(shape)
    where = f"{source}: features"
    if preprocessing.width != size and preprocessing.input_shape is not None and not preprocessing.columns:
        raise InvalidArgument(  # image records (peer.nn.images): their size and channels are chosen
            f"{source}: images",
            f"prepare as {list(preprocessing.input_shape)} but the network {name!r} takes {list(shape)}: give "
            "--image-size H W and --channels C to match it",
        )
    if preprocessing.width != size:
        raise InvalidArgument(
            where,
            f"the records prepare {preprocessing.width} input entries ({len(preprocessing.columns)} columns"
            f"{', one-hot categories included' if preprocessing.categorical else ''}: "
            f"{preprocessing.describe_inputs(6)}) but the network {name!r} takes input shape {list(shape)} = {size} "
            "entries; choose its input columns with --features",
        )
    if preprocessing.input_shape is not None:
        images = tuple(preprocessing.input_shape)
        if images == shape:
            return f"images of shape {list(shape)}, as they are"
        if len(shape) == 1:
            return f"images of shape {list(images)} flattened to {size} entries (the network takes flat rows)"
        raise InvalidArgument(
            f"{source}: x",
            f"holds images of shape {list(images)} but the network {name!r} takes {list(shape)}; a reshape "
            f"would scramble the pixels: store x with shape (m, {', '.join(map(str, shape))})",
        )
    if len(shape) == 1:
        return f"rows of {size} entries, as they are"
    if preprocessing.categorical:
        raise InvalidArgument(
            where,
            f"the network {name!r} takes input shape {list(shape)}, and a table becomes that shape only when "
            f"every entry is one numeric column; {list(preprocessing.categorical)} are categorical (one-hot): "
            "give image records (.npz with x of that shape) or a network that takes flat rows",
        )
    return (
        f"rows of {size} numeric columns reshaped to {list(shape)} (row-major, in column order), as the "
        "network's input shape says"
    )
