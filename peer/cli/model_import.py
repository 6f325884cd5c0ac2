"""``privfusion model import`` (and ``model export`` of what it stored): a site's own PyTorch
network in and out of its store.

    privfusion model import --site DIR --name NAME --factory MODULE:FUNCTION --weights FILE
                            [--input-shape 1 8 8] [--data RECORDS [--label COL] [--features ..] | --preprocessing JSON]
                            [--json]
    privfusion model export --site DIR --model NAME --format pt|safetensors --out FILE

The store is ``DIR/own_models``: kept apart from ``DIR/models``, the directory of built-in
architectures. A daemon serving DIR/site.toml lists these networks in GetPeerInfo (their traced
structure and its digest, no code) and serves DP pools trained from them (``privfusion pool
train --from-model NAME``); a round's fused model of one is written back here under the site's
key names. The factory is the site's code and runs at this site only: ``MODULE`` is importable
from DIR or the current path, or is a ``FILE.py`` (stored as an absolute path, so that the
daemon, started from elsewhere, runs the same file). Import refuses a model whose permutation
structure cannot be derived or proven, naming the node or group at fault, and a model whose
state dict names one tensor under two keys (``self.shortcut = self.skip``, tied weights),
naming the keys.

With ``--data`` the preprocessing that turns the site's records into the network's inputs is
stored with the model, so that ``evaluate``, ``probe make`` and pools prepare records exactly as
the network takes them (and a probe set is bound to that input: ``peer.nn.probes``):

- a table (``peer.nn.tables``): what ``model train`` stores — the feature columns in input
  order, standardisation and one-hot categories fitted on the site's training split only (the
  same stratified split, public ``--split-seed``) or on ``--public`` records, the class list;
  the network's accuracy on the training and held-out parts goes into its metadata;
- image records (a folder by class or a manifest, ``peer.nn.images``) with ``--input-shape C H
  W``: resize to H×W, C channels, per-channel statistics of every record of ``--data``.

``--preprocessing JSON`` stores a given one instead (e.g. the ``FILE.preprocessing.json`` that
``model export`` writes beside the weights). A network whose input width is not the prepared
width, or whose outputs are not one per class, is refused before anything is stored.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from peer.base.errors import InvalidArgument

OWN_MODELS = "own_models"


def _store(site: str) -> Path:
    return Path(site) / OWN_MODELS


def _input_shape(args, module) -> list[int]:
    if args.input_shape:
        return list(args.input_shape)
    from torch import nn

    for m in module.modules():
        if isinstance(m, nn.Linear):
            return [m.in_features]
        if isinstance(m, (nn.Conv1d, nn.Conv2d)):
            break
    raise InvalidArgument(
        "input_shape", "is needed for this model (one example's shape without the batch axis, e.g. --input-shape 1 8 8)"
    )


class _Shape:
    """What ``peer.nn.imported.input_batch`` reads of a structure: its input shape."""

    def __init__(self, shape):
        self.input_shape = tuple(shape)


def import_command(args: argparse.Namespace) -> int:
    from peer.nn.architectures import torch_threads
    from peer.nn.imported import (
        build_module,
        import_model,
        load_factory,
        load_site_state,
        read_weights,
        resolve_factory,
    )

    with torch_threads(1):
        module = build_module(load_factory(args.factory, [args.site]), args.factory)
        load_site_state(module, read_weights(args.weights))
        shape = _input_shape(args, module)
        args.held_out = None
        prep = _preprocessing(args, shape)
        metadata = {"source": Path(args.weights).name}
        if prep is not None:
            _check_outputs(module, shape, prep, "--data" if args.data else "--preprocessing")
        if args.held_out is not None:
            from peer.nn.imported import module_accuracy

            held = args.held_out
            metadata["data"] = held.description
            metadata["accuracy"] = {
                "training": module_accuracy(module, _Shape(shape), held.x_train, held.y_train),
                "validation": module_accuracy(module, _Shape(shape), held.x_val, held.y_val),
            }
        model = import_model(
            _store(args.site),
            args.name,
            module,
            shape,
            factory=resolve_factory(args.factory),
            metadata=metadata,
            preprocessing=prep,
        )
    s = model.structure
    out = {
        "name": model.name,
        "store": str(_store(args.site)),
        "input_shape": list(s.input_shape),
        "groups": [{"name": g.name, "size": g.size, "axes": len(g.axes)} for g in s.groups],
        "parameters": len(s.parameters),
        "self_check": "passed",
    }
    if prep is not None:
        out["preprocessing"] = {"inputs": prep.describe_inputs(), "fitted_on": dict(prep.fitted_on)}
    if "accuracy" in model.metadata:
        out["accuracy"] = dict(model.metadata["accuracy"])
    if args.json:
        json.dump(out, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        if prep is not None:
            print(f"preprocessing stored with it: {prep.describe_inputs()} ({_fitted(prep)})")
        if "accuracy" in model.metadata:
            acc = model.metadata["accuracy"]
            print(
                f"accuracy: training {acc['training']:.4f}, validation {acc['validation']:.4f} (held out, never fitted on)"
            )
        print(
            f"imported {model.name}: {len(s.groups)} permutation groups "
            f"({', '.join(f'{g.name}[{g.size}]' for g in s.groups)}), self-check passed"
        )
    return 0


def _fitted(prep) -> str:
    f = prep.fitted_on
    if f.get("split") == "public":
        return f"fitted on public records {f.get('file')}"
    return f"fitted on {f.get('rows')} {f.get('split', 'training')} records of {f.get('file')}" if f else "given"


def _preprocessing(args, shape: list[int]):
    """The preprocessing stored with the import: given (``--preprocessing``), or fitted on the
    images of ``--data`` to the network's input shape C H W; None without either."""
    from peer.nn.store import read_preprocessing_file

    if args.preprocessing and args.data:
        raise InvalidArgument("--data", "give --data (images to fit a preprocessing on) or --preprocessing, not both")
    if args.preprocessing:
        return read_preprocessing_file(args.preprocessing, "--preprocessing")
    if not args.data:
        if args.label:
            raise InvalidArgument("--label", "goes with --data")
        return None
    from peer.nn.images import FOLDER_LABEL, ImagePreprocessing, is_image_source, read_images

    if not is_image_source(args.data):
        return _table_preprocessing(args, shape)
    table_only = [
        f"--{k.replace('_', '-')}" for k in ("features", "impute", "allow_unseen", "public") if getattr(args, k)
    ]
    table_only += ["--categorical"] if args.categorical else []
    if table_only:
        raise InvalidArgument(table_only[0], f"applies to a table; {args.data} holds images")
    if len(shape) != 3 or shape[0] not in (1, 3):
        raise InvalidArgument(
            "--input-shape", f"is {shape}; images need C H W with C = 1 or 3 (e.g. --input-shape 1 28 28)"
        )
    label = args.label if args.label else (FOLDER_LABEL if Path(args.data).is_dir() else None)
    if label is None:
        raise InvalidArgument("--label", f"is required: the label column of the manifest {args.data}")
    images = read_images(args.data, label=label)
    return ImagePreprocessing.fit(images, channels=shape[0], size=(shape[1], shape[2]))


def table_records(args: argparse.Namespace, preprocessing=None):
    """The table ``--data`` prepared from the table flags (``--label``, ``--features``,
    ``--categorical``, ``--impute``, ``--allow-unseen``, ``--validation-fraction``,
    ``--split-seed``, ``--public``) by ``peer.nn.tables.prepare_records``, with ``preprocessing``
    (a stored one) when given: the one reading of those flags, for ``model train`` and
    ``model import``."""
    from peer.nn.tables import prepare_records

    if args.label is None:
        raise InvalidArgument("--label", f"is required: the label column of {args.data}")
    return prepare_records(
        args.data,
        label=args.label,
        features=args.features,
        categorical=args.categorical,
        missing="impute" if args.impute else "refuse",
        unseen="zeros" if args.allow_unseen else "refuse",
        validation_fraction=args.validation_fraction,
        split_seed=args.split_seed,
        preprocessing=preprocessing,
        public=args.public,
    )


def _table_preprocessing(args, shape: list[int]):
    """The preprocessing ``model train`` would store for the table ``--data``: its feature
    columns in order (``--features``, default every column but the label), standardisation and
    one-hot categories fitted on the site's TRAINING split (the same stratified split, public
    ``--split-seed``, holding out ``--validation-fraction``) or on ``--public`` records. The
    held-out part is kept on ``args`` to report the network's accuracy on it."""
    from types import SimpleNamespace

    from peer.nn.imported import records_fit_network

    records = table_records(args)
    records_fit_network(SimpleNamespace(input_shape=tuple(shape)), records.preprocessing, args.data, args.name)
    args.held_out = records
    return records.preprocessing


def _check_outputs(module, shape: list[int], prep, where: str) -> None:
    """The network gives one output per class of the preprocessing's label."""
    import torch

    was = module.training
    module.eval()
    try:
        with torch.no_grad():
            out = module(torch.zeros((1, *shape)))
    finally:
        module.train(was)
    if out.dim() != 2 or out.shape[1] != prep.num_classes:
        raise InvalidArgument(
            where,
            f"the label {prep.label!r} has {prep.num_classes} classes but the network gives outputs of shape "
            f"{list(out.shape)} per batch of one (it must give one output per class)",
        )


def is_imported(site: str, name: str) -> bool:
    """Whether ``name`` is one of the site's imported networks (``DIR/own_models``)."""
    from peer.nn.store import NAME_RULE

    return isinstance(name, str) and bool(NAME_RULE.match(name)) and (_store(site) / f"{name}.json").is_file()


def load_own(site: str, name: str):
    """The site's imported network ``name`` (``peer.nn.imported.ImportedModel``)."""
    from peer.nn.imported import load_imported

    return load_imported(_store(site), name)


def own_names(site: str) -> list[str]:
    """The names of the site's imported networks (none when DIR/own_models does not exist)."""
    from peer.nn.store import list_models

    return list_models(_store(site)) if _store(site).is_dir() else []


def own_predict_proba(site: str, own, x):
    """Class probabilities (softmax of the outputs, eval mode) of the site's imported network
    ``own`` on prepared rows ``x``: the module is rebuilt by the site's factory (importable
    from DIR or the current path) and holds the stored weights."""
    import numpy as np
    import torch

    from peer.nn.architectures import torch_threads
    from peer.nn.imported import input_batch, load_factory, module_from_arrays

    with torch_threads(1), torch.no_grad():
        module = module_from_arrays(load_factory(own.factory, [site]), own.structure, own.arrays)
        logits = module(input_batch(own.structure, x))
        if logits.dim() != 2:
            raise InvalidArgument(
                "model", f"{own.name!r} gives outputs of shape {list(logits.shape)}, not (rows, classes)"
            )
        return np.asarray(torch.softmax(logits.double(), dim=1).numpy())


def export_imported(site: str, name: str, fmt: str, out: str) -> Path:
    """An imported model's weights under the site's own key names (``model export``)."""
    from peer.nn.imported import export_model, load_imported

    return export_model(load_imported(_store(site), name), out, fmt)


def register_import(sub) -> None:
    """``model import`` under the ``model`` group of :mod:`peer.cli.model`."""
    i = sub.add_parser("import", help="trace, prove and store a site's own network under its own key names")
    i.add_argument("--site", required=True, help="site directory (models go to DIR/own_models)")
    i.add_argument("--name", required=True, help="name of the model in the store")
    i.add_argument("--factory", required=True, help="MODULE:FUNCTION or FILE.py:FUNCTION returning the torch.nn.Module")
    i.add_argument(
        "--weights", required=True, help="state dict: .safetensors, or .pt read with torch.load(weights_only=True)"
    )
    i.add_argument(
        "--input-shape",
        type=int,
        nargs="+",
        help="one example's shape without the batch axis (default: a leading Linear's in_features)",
    )
    i.add_argument(
        "--data",
        metavar="RECORDS",
        help="the site's records the network reads: a table (.csv, .tsv, .parquet, .npz; the preprocessing model "
        "train stores, fitted on its training split) or images (a folder by class, or a manifest: fitted to "
        "--input-shape C H W, resize, channels, per-channel statistics of every record); stored with the model",
    )
    i.add_argument(
        "--label",
        metavar="COL",
        help="with --data: the label column of a table or a manifest (a folder's is its class folder)",
    )
    i.add_argument(
        "--features",
        nargs="+",
        metavar="COL",
        help="table: feature columns, in input order (default: every column but the label)",
    )
    i.add_argument(
        "--categorical",
        nargs="+",
        default=[],
        metavar="COL",
        help="table: columns to one-hot even though they hold numbers",
    )
    i.add_argument(
        "--impute", action="store_true", help="table: fill missing cells (training mean / most frequent category)"
    )
    i.add_argument(
        "--allow-unseen",
        action="store_true",
        help="table: later categories the training split never saw become all-zero one-hot",
    )
    i.add_argument(
        "--public",
        metavar="FILE",
        help="table: fit the preprocessing on these PUBLIC records instead of the training split",
    )
    i.add_argument(
        "--validation-fraction",
        type=float,
        default=0.2,
        help="table: share of the records held out (never fitted on) to report accuracy (default 0.2)",
    )
    i.add_argument(
        "--split-seed", type=int, default=0, help="table: public seed of the train/validation split (default 0)"
    )
    i.add_argument(
        "--preprocessing",
        metavar="JSON",
        help="store this preprocessing with the model (a JSON file, or a model manifest holding one)",
    )
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=import_command)
