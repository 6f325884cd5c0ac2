"""``privfusion probe make``: a site's probe set and merge-validation set, from PUBLIC records.

    privfusion probe make --site DIR --data PUBLIC_FILE [--model NAME | --pool NAME]
                          [--label COL] [--rows N] [--seed S] [--force]

Both files are made from a file the site declares public, prepared by the same preprocessing
as the model (``--model``) or pool (``--pool``) they serve:

- the **probe set** (``probe`` of site.toml, default ``DIR/probe.safetensors``, tensor ``x``):
  ``--rows`` records drawn at random (public ``--seed``). Fusion sends it to every peer asked
  for features, and the activations peers release are computed on it. ``--model`` is a model of
  the store or one of the site's imported networks (``DIR/own_models``, with the preprocessing
  ``model import --data`` stored). The file records the input it was prepared for (the model's
  feature columns in order, or its image channels and size: ``peer.nn.probes``), and a round
  refuses it for a model that reads another input;
- with ``--label``, the **validation set** of a pool (``--pool``, default the site's only one) (``validation`` of
  ``[site.pools.NAME]``, default ``DIR/validation.npz``, arrays ``x`` and ``y``): every record
  of the file. RS/LC merges choose their weights by accuracy on it, so what it holds shapes
  what the site releases without being charged to any budget.

Whatever goes into them becomes public: never give protected records here.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from peer.base.errors import InvalidArgument


def make(args: argparse.Namespace) -> int:
    import io

    import numpy as np

    from peer.cli.model import emit, site_paths
    from peer.cli.model_import import is_imported, load_own, own_names
    from peer.dp.pools import pool_preprocessing
    from peer.nn.probes import model_input, probe_bytes
    from peer.nn.store import _atomic_write, list_models, load_model

    paths = site_paths(args.site)
    if args.pool is not None and args.label is None:
        raise InvalidArgument("--label", "is required with --pool: a pool's validation set needs labels")
    if args.rows is not None and args.rows < 1:
        raise InvalidArgument("--rows", f"must be >= 1, got {args.rows}")
    want_probe = args.model is not None or args.pool is None
    jobs = []  # (what, preprocessing, served, path)
    signature = None  # the input the probe set is prepared for (peer.nn.probes)

    def model_named(n: str):
        # a model of the store, else one of the site's imported networks (DIR/own_models)
        if (paths.models / f"{n}.json").is_file() or not is_imported(args.site, n):
            return load_model(paths.models, n)
        return load_own(args.site, n)

    if want_probe:
        name = args.model
        if name is None:
            stored = list_models(paths.models) if paths.models.is_dir() else []
            names = [n for n in stored if load_model(paths.models, n).preprocessing is not None]
            names += [n for n in own_names(args.site) if n not in stored and load_own(args.site, n).preprocessing]
            if len(names) != 1:
                raise InvalidArgument(
                    "--model",
                    f"name the model the probe set serves (models with a preprocessing in "
                    f"{str(paths.models)!r} and {str(Path(args.site) / 'own_models')!r}: {names})",
                )
            name = names[0]
        model = model_named(name)
        imported = not hasattr(model, "architecture")
        signature = model_input(model) if model.preprocessing is not None else None
        jobs.append(
            (
                "probe",
                _prepared_by(model.preprocessing, f"{'imported network' if imported else 'model'} {name}", imported),
                f"model {name}",
                Path(args.probe_out) if args.probe_out else paths.probe,
            )
        )
    if args.label is not None:
        pool_name, directory = paths.pool(args.pool)
        if not directory.is_dir() or not list_models(directory):
            raise InvalidArgument(
                "--pool",
                f"the site has no trained pool in {str(directory)!r} (privfusion pool train --site "
                f"{args.site} --data ...); the validation set is prepared as its models' inputs",
            )
        jobs.append(
            (
                "validation",
                _prepared_by(pool_preprocessing(directory), f"pool {pool_name}"),
                f"pool {pool_name}",
                Path(args.validation_out) if args.validation_out else paths.validation_file(pool_name),
            )
        )
        for _, prep, served, _ in jobs:
            if args.label != prep.label:
                raise InvalidArgument(
                    "--label", f"is {args.label!r} but {served} was trained with label {prep.label!r}"
                )
    for what, _, _, p in jobs:
        if p.exists() and not args.force:
            raise InvalidArgument(f"--{what}-out", f"{str(p)!r} exists; give --force to replace it")

    out: dict = {"data": Path(args.data).name}
    lines = [f"PUBLIC: what goes into these files becomes public. {args.data} must hold no protected record."]
    for what, prep, served, p in jobs:
        table = prep.read(args.data, labelled=what == "validation")
        x, y = prep.transform(table)
        p.parent.mkdir(parents=True, exist_ok=True)
        if what == "probe":
            rows = min(len(x), args.rows or 256)
            chosen = np.sort(np.random.default_rng(args.seed).choice(len(x), size=rows, replace=False))
            _atomic_write(p, probe_bytes(x[chosen], signature, name))
            lines.append(
                f"probe set: {rows} of the {len(table)} records, prepared as {served} prepares its inputs "
                f"({prep.width} entries), written to {p}: fusion sends it to every peer asked for features"
            )
            lines.append(
                f"bound to the input {served} reads ({prep.describe_inputs()}): a model that reads another "
                "input is refused it"
            )
            if prep.fitted_on.get("split") != "public":
                lines.append(
                    f"note: {served}'s preprocessing was fitted on its training records; a peer who knows "
                    f"{Path(args.data).name} can recover those statistics (means, standard deviations, "
                    "categories) from the prepared rows. Train with --public FILE to keep them in."
                )
        else:
            rows = len(y)
            buffer = io.BytesIO()
            np.savez(buffer, x=x.astype(np.float32), y=y)
            _atomic_write(p, buffer.getvalue())
            lines.append(
                f"validation set: all {rows} labelled records, prepared as {served} prepares its inputs, written "
                f"to {p}: merges choose their weights by accuracy on it"
            )
        out[what] = {"path": str(p), "rows": rows, "served": served, "input_width": prep.width}
        if what == "probe":
            out[what]["input"] = signature
    emit(out, args.json, lines)
    return 0


def _prepared_by(prep, served: str, imported: bool = False):
    if prep is None:
        raise InvalidArgument(
            "--data",
            f"{served} was imported without a preprocessing, so how records become its inputs is not known here: "
            "import it again with --data FILE --label COL (the site's records; fitted on their training split) or "
            "--preprocessing JSON"
            if imported
            else f"{served} was not trained on a table of records (it has no preprocessing); "
            "its files cannot be made from one",
        )
    return prep


def register(subparsers) -> None:
    p = subparsers.add_parser("probe", help="make a site's probe set (and merge-validation set) from PUBLIC records")
    sub = p.add_subparsers(dest="probe_command", metavar="ACTION")
    sub.required = True
    m = sub.add_parser(
        "make",
        help="write probe.safetensors (and validation.npz with --label) from a public file",
        description="Make the probe set fusion sends to peers and, with --label, a pool's merge-validation "
        "set, from a file the site declares PUBLIC, prepared with the preprocessing of the model "
        "or pool they serve. Everything written becomes public.",
    )
    m.add_argument(
        "--site", required=True, metavar="DIR", help="the site's directory (its site.toml says where the files go)"
    )
    m.add_argument(
        "--data",
        required=True,
        metavar="PUBLIC_FILE",
        help="public records (.csv, .tsv, .parquet, .npz) with the model's feature columns",
    )
    m.add_argument(
        "--model",
        metavar="NAME",
        help="the model the probe set serves (default: the store's only model with a preprocessing)",
    )
    m.add_argument(
        "--pool",
        metavar="NAME",
        help="the pool the validation set serves (default: the site's only pool); alone, only the validation set is written",
    )
    m.add_argument(
        "--label", metavar="COL", help="the label column: also write the pool's validation set (x, y) of every record"
    )
    m.add_argument("--rows", type=int, help="rows of the probe set (default: all, at most 256)")
    m.add_argument("--seed", type=int, default=0, help="public seed of the probe rows' draw (default 0)")
    m.add_argument(
        "--probe-out",
        metavar="PATH",
        help="where the probe set goes (default: site.toml's probe, else DIR/probe.safetensors)",
    )
    m.add_argument(
        "--validation-out",
        metavar="PATH",
        help="where the validation set goes (default: the pool's validation file, else DIR/validation.npz)",
    )
    m.add_argument("--force", action="store_true", help="replace existing files")
    m.add_argument("--json", action="store_true", help="print the summary as JSON")
    m.set_defaults(func=make)
