"""A probe set bound to the input a model reads.

A probe set is rows of a model's *prepared* inputs: entry j of a row means whatever entry j of
that model's input means (a standardised column, one category of a one-hot column, a pixel of a
channel). Rows prepared for one model are meaningless to a model that reads its columns in
another order, or another image size: its activations on them — and so matching and REPAIR,
which both run on the probe — would be computed on scrambled inputs without any error.

So both sides carry an *input signature*, a small JSON value built from public structure only:

- a table: ``{"kind": "table", "columns": [[NAME, "numeric", 1], [NAME, "categorical", K], ...],
  "width": W}`` — the feature columns in input order, each with its kind and number of entries
  (a categorical column's K one-hot entries; never its categories, which are record values),
  and ``"shape"`` when the rows are reshaped (an ``.npz`` of images);
- images: ``{"kind": "images", "channels": C, "size": [H, W], "width": C·H·W}``;
- a network stored without a preprocessing (an imported network whose inputs are prepared
  elsewhere): ``{"kind": "unprepared", "shape": [...], "width": W}``.

A model's signature is derived from what its manifest stores (its preprocessing and input
shape), so every model — trained, adopted, imported, written by an earlier version — has one.
A probe set records the signature it was prepared for in its safetensors header (metadata key
``privfusion_input``, with ``privfusion_model``: the model ``probe make`` prepared it for).

The rule (:func:`check_probe_input`): a probe set is used with a model only when their
signatures are equal; otherwise it is refused, naming both inputs (and saying when the columns
are the same set in another order). Probe rows are not re-ordered: a re-ordered row would still
carry the standardisation of the model it was prepared for. A probe set written before
signatures existed (no ``privfusion_input``) reads as before, unchecked: :func:`read_probe`
says so, and ``privfusion probe make`` remakes it bound.

Everything here is public: column names, kinds, entry counts and shapes (the probe file itself
is public); no statistic and no record value enters a signature.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from peer.base.errors import FailedPrecondition, InvalidArgument

__all__ = [
    "INPUT_KEY",
    "bound_probe",
    "check_probe_input",
    "describe_input",
    "input_signature",
    "model_input",
    "probe_bytes",
    "read_probe",
]

#: safetensors header keys of a probe file
INPUT_KEY = "privfusion_input"
MODEL_KEY = "privfusion_model"


def input_signature(preprocessing: Any, input_shape: Sequence[int] | None = None) -> dict:
    """The input signature (module docstring) of a model prepared by ``preprocessing`` (a
    ``peer.nn.tables.Preprocessing`` or ``peer.nn.images.ImagePreprocessing``), or, without
    one, of a network taking ``input_shape``."""
    from peer.nn.images import ImagePreprocessing

    if preprocessing is None:
        if input_shape is None:
            raise InvalidArgument("input_shape", "is needed for a model without a preprocessing")
        shape = [int(s) for s in input_shape]
        return {"kind": "unprepared", "shape": shape, "width": math.prod(shape)}
    if isinstance(preprocessing, ImagePreprocessing):
        return {
            "kind": "images",
            "channels": int(preprocessing.channels),
            "size": [int(s) for s in preprocessing.size],
            "width": int(preprocessing.width),
        }
    out: dict[str, Any] = {
        "kind": "table",
        "columns": [[c.name, c.kind, int(c.width)] for c in preprocessing.columns],
        "width": int(preprocessing.width),
    }
    if preprocessing.input_shape is not None:
        out["shape"] = [int(s) for s in preprocessing.input_shape]
    return out


def model_input(model: Any) -> dict:
    """The input signature of a stored model: a built-in one (``peer.nn.store.StoredModel``, its
    architecture naming an MLP/CNN or a site's traced network) or a site's own network
    (``peer.nn.imported.ImportedModel``), from its stored preprocessing and input shape."""
    structure = getattr(model, "structure", None)
    if structure is not None:
        shape = list(structure.input_shape)
    else:
        arch = model.architecture
        if arch.get("kind") == "imported":
            from peer.nn.imported import structure_of

            shape = list(structure_of(arch).input_shape)
        elif arch.get("kind") == "cnn":
            shape = list(arch["input_shape"])
        else:
            shape = [int(arch["input_dim"])]
    return input_signature(model.preprocessing, shape)


def describe_input(signature: Mapping[str, Any] | None) -> str:
    """A signature for a message: ``table columns a, b, ward (3 one-hot) (5 entries)``."""
    if signature is None:
        return "no recorded input (a probe set made before probe sets were bound to a model's input)"
    kind = signature.get("kind")
    if kind == "images":
        h, w = signature.get("size", ["?", "?"])
        return f"images of {signature.get('channels')} channel(s), {h}x{w} pixels"
    if kind == "table":
        cols = [n if k == "numeric" else f"{n} ({w} one-hot)" for n, k, w in signature.get("columns", [])]
        shape = f", reshaped to {signature['shape']}" if "shape" in signature else ""
        return f"table columns {', '.join(cols)} ({signature.get('width')} entries{shape})"
    if kind == "unprepared":
        return f"rows of {signature.get('width')} entries prepared elsewhere (input shape {signature.get('shape')})"
    return f"an unknown input {json.dumps(signature, sort_keys=True)}"


def check_probe_input(
    probe: Mapping[str, Any] | None, model: Mapping[str, Any], probe_name: str, model_name: str
) -> None:
    """Refuse (FailedPrecondition) a probe set whose recorded input is not the input the model
    reads, naming both; a probe set with no recorded input (written before) is let through."""
    if probe is None or dict(probe) == dict(model):
        return
    why = ""
    if probe.get("kind") == model.get("kind") == "table":
        ours, theirs = [c[0] for c in probe.get("columns", [])], [c[0] for c in model.get("columns", [])]
        if ours != theirs and sorted(ours) == sorted(theirs):
            why = " (the same columns in another order: its rows would be read mis-ordered)"
    raise FailedPrecondition(
        f"probe set {probe_name} was prepared for {describe_input(probe)}, but the model {model_name!r} reads "
        f"{describe_input(model)}{why}; make a probe set for it: privfusion probe make --model {model_name} "
        "--data PUBLIC_FILE"
    )


@dataclass(frozen=True)
class Probe:
    """A probe set as read: its rows ``x``, the input signature it was prepared for (None for a
    file written before signatures) and the model it was made for ("" when unrecorded)."""

    x: np.ndarray
    signature: Mapping[str, Any] | None
    model: str = ""


def probe_bytes(x: np.ndarray, signature: Mapping[str, Any], model: str) -> bytes:
    """A probe file's bytes: tensor ``x`` (float32) with its input signature in the header."""
    from safetensors.numpy import save

    return save(
        {"x": np.ascontiguousarray(x, dtype=np.float32)},
        metadata={INPUT_KEY: json.dumps(dict(signature), sort_keys=True), MODEL_KEY: model},
    )


def read_probe(path: str | os.PathLike, field_name: str = "probe") -> Probe:
    """A probe file (safetensors, tensor ``x``, finite values) and its recorded input."""
    from safetensors import SafetensorError, safe_open

    p = Path(path)
    try:
        with safe_open(str(p), framework="numpy") as f:
            if "x" not in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                raise InvalidArgument(field_name, f"{p} must hold the probe inputs as tensor 'x'")
            x = f.get_tensor("x")
            metadata = f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise InvalidArgument(field_name, f"{p} is not a readable safetensors file: {e}") from None
    if not np.all(np.isfinite(x)):
        raise InvalidArgument(field_name, f"{p} contains NaN or infinite values")
    signature = None
    if INPUT_KEY in metadata:
        try:
            signature = json.loads(metadata[INPUT_KEY])
        except ValueError:
            signature = None
        if not isinstance(signature, dict) or not isinstance(signature.get("kind"), str):
            raise InvalidArgument(f"{field_name}: {INPUT_KEY}", f"of {p} must be a JSON object with a 'kind'")
    return Probe(x, signature, metadata.get(MODEL_KEY, ""))


def bound_probe(
    path: str | os.PathLike, model_signature: Mapping[str, Any], model_name: str, field_name: str = "site.probe"
) -> np.ndarray:
    """The rows of the probe file ``path`` for the model ``model_name`` (whose input signature is
    ``model_signature``): read, then checked by :func:`check_probe_input`."""
    probe = read_probe(path, field_name)
    check_probe_input(probe.signature, model_signature, str(path), model_name)
    return probe.x
