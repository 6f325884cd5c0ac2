"""``privfusion model import`` (and ``model export`` of what it stored): a site's own PyTorch
network in and out of its store.

    privfusion model import --site DIR --name NAME --factory MODULE:FUNCTION --weights FILE
                            [--input-shape 1 8 8] [--data IMAGES [--label COL] | --preprocessing JSON] [--json]
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

With ``--data`` (image records: a folder by class or a manifest, ``peer.nn.images``) and
``--input-shape C H W``, the preprocessing that turns those images into the network's inputs is
fitted on every record of ``--data`` — resize to H×W, C channels, per-channel statistics — and
stored with the model, so that ``evaluate``, ``probe make`` and pools prepare images exactly as
the network takes them; ``--preprocessing JSON`` stores a given one instead.
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
        prep = _preprocessing(args, shape)
        model = import_model(
            _store(args.site),
            args.name,
            module,
            shape,
            factory=resolve_factory(args.factory),
            metadata={"source": Path(args.weights).name},
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
    if args.json:
        json.dump(out, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        if prep is not None:
            print(f"preprocessing stored with it: {prep.describe_inputs()}")
        print(
            f"imported {model.name}: {len(s.groups)} permutation groups "
            f"({', '.join(f'{g.name}[{g.size}]' for g in s.groups)}), self-check passed"
        )
    return 0


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
        raise InvalidArgument(
            "--data",
            f"{args.data} is not image records (a folder by class, or a manifest with a 'path' column); a table's "
            "preprocessing is given with --preprocessing",
        )
    if len(shape) != 3 or shape[0] not in (1, 3):
        raise InvalidArgument(
            "--input-shape", f"is {shape}; images need C H W with C = 1 or 3 (e.g. --input-shape 1 28 28)"
        )
    label = args.label if args.label else (FOLDER_LABEL if Path(args.data).is_dir() else None)
    if label is None:
        raise InvalidArgument("--label", f"is required: the label column of the manifest {args.data}")
    images = read_images(args.data, label=label)
    return ImagePreprocessing.fit(images, channels=shape[0], size=(shape[1], shape[2]))


def is_imported(site: str, name: str) -> bool:
    """Whether ``name`` is one of the site's imported networks (``DIR/own_models``)."""
    return (_store(site) / f"{name}.json").is_file()


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
        metavar="IMAGES",
        help="image records (a folder by class, or a manifest): fit the preprocessing to --input-shape C H W "
        "(resize, channels, per-channel statistics of every record) and store it with the model",
    )
    i.add_argument(
        "--label", metavar="COL", help="with --data: the manifest's label column (a folder's is its class folder)"
    )
    i.add_argument(
        "--preprocessing",
        metavar="JSON",
        help="store this preprocessing with the model (a JSON file, or a model manifest holding one)",
    )
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=import_command)
