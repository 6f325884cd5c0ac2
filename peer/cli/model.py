"""``privfusion model``: a site's own models.

    privfusion model train --site DIR --data FILE --label COL (--preset mlp|cnn | --arch JSON)
                           --name NAME [--features A B ..] [--categorical C ..] [--impute]
                           [--epochs N] [--seed S] [--validation-fraction F] [--json]

``model train`` trains a plain (non-private) classifier on the site's own records (CSV,
Parquet or .npz: ``peer.nn.tables``): the records are split into a training part and a
held-out validation part (stratified, public ``--split-seed``), the preprocessing is fitted
on the training part only (or on public records, ``--public FILE``: then the probe set made
with it reveals nothing of the training records), and the model goes into the site's model store (``models`` of
``DIR/site.toml``, else ``DIR/models``) together with that preprocessing.

This module also holds what the record-reading commands share (``pool train --data``,
``probe make``): where a site keeps its files, the record options.

    privfusion model adopt --site DIR --from rounds/models/NAME|RELEASE --name NAME [--preprocessing-from NAME]
    privfusion model export --site DIR --model NAME --format safetensors|pt --out FILE

``model adopt`` puts a round's fused model or a merged/fused release into the site's store with
its provenance beside it; ``model export`` writes a plain state_dict for use outside
(``peer.cli.site.adopt_model`` and ``export_model`` say exactly what they write).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from peer.base.errors import FailedPrecondition, InvalidArgument

# --------------------------------------------------------------------------------------------
# Shared by the commands that read a site's records


@dataclass(frozen=True)
class SitePaths:
    """Where a site keeps its files: from ``DIR/site.toml`` when there is one (the daemon's own
    reading of it), else the conventional layout ``DIR/models``, ``DIR/pool``,
    ``DIR/probe.safetensors``, ``DIR/validation.npz``."""

    root: Path
    models: Path
    probe: Path
    pools: Mapping[str, Path] = field(default_factory=dict)
    validation: Mapping[str, Path] = field(default_factory=dict)
    configured: bool = False

    def pool(self, name: str | None) -> tuple[str, Path]:
        """(name, directory) of a pool: the named one (``DIR/NAME`` without a site.toml), the
        only one, or ``DIR/pool``."""
        if name is not None:
            if self.configured and self.pools:
                if name not in self.pools:
                    raise InvalidArgument(
                        "--pool", f"site.toml has no [site.pools.{name}]; it has {sorted(self.pools)}"
                    )
                return name, self.pools[name]
            return name, self.root / name
        if len(self.pools) == 1:
            return next(iter(self.pools.items()))
        if len(self.pools) > 1:
            raise InvalidArgument("--pool", f"the site has several pools {sorted(self.pools)}; name one")
        return "pool", self.root / "pool"

    def validation_file(self, pool_name: str) -> Path:
        return self.validation.get(pool_name, self.root / "validation.npz")


def site_paths(directory: str | Path) -> SitePaths:
    root = Path(directory)
    config = root / "site.toml"
    if not config.is_file():
        if root.exists() and not root.is_dir():
            raise InvalidArgument("--site", f"{str(root)!r} is not a directory")
        return SitePaths(root, root / "models", root / "probe.safetensors")
    from peer.net.site import SiteConfig

    c = SiteConfig.load(config)
    return SitePaths(
        root, c.models, c.probe or root / "probe.safetensors", dict(c.pools), dict(c.pool_validation), True
    )


def add_record_options(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    p.add_argument(
        "--data",
        required=required,
        metavar="FILE",
        help="the site's records: .csv, .tsv, .parquet or .npz (arrays x and the label); or images: a folder "
        "by class DIR/<class>/*.png|jpg|jpeg|dcm, or a manifest (CSV/Parquet with a 'path' column)",
    )
    p.add_argument(
        "--label",
        metavar="COL",
        help="the label column (for .npz: the label array, usually y; for an image folder: none, the class "
        "folder is the label)",
    )
    p.add_argument(
        "--image-size",
        type=int,
        nargs=2,
        metavar=("H", "W"),
        help="images: resize every image to H x W (default: the images' own size, which they must share)",
    )
    p.add_argument(
        "--channels",
        type=int,
        choices=(1, 3),
        help="images: convert every image to 1 (grayscale) or 3 (RGB) channels (default: their own, which they must share)",
    )
    p.add_argument(
        "--features", nargs="+", metavar="COL", help="feature columns, in order (default: every column but the label)"
    )
    p.add_argument(
        "--categorical",
        nargs="+",
        default=[],
        metavar="COL",
        help="columns to one-hot even though they hold numbers (codes); a column with no numbers is categorical anyway",
    )
    p.add_argument(
        "--impute",
        action="store_true",
        help="fill missing cells (training mean / most frequent category, recorded in the preprocessing) instead of refusing them",
    )
    p.add_argument(
        "--allow-unseen",
        action="store_true",
        help="later records may hold categories the training split never saw: they become all-zero one-hot (default: refused)",
    )
    p.add_argument(
        "--preprocessing",
        metavar="JSON",
        help="use this preprocessing (a JSON file of one, or a model manifest NAME.json holding one) instead of fitting one, "
        "e.g. one fitted on public data that several sites share",
    )
    p.add_argument(
        "--public",
        metavar="FILE",
        help="fit the preprocessing on these PUBLIC records (same columns) instead of the training split "
        "(required for a DP pool; the statistics then reveal nothing of the protected records)",
    )
    p.add_argument(
        "--validation-fraction",
        type=float,
        default=0.2,
        help="share of the records held out to report accuracy (default 0.2); never trained on",
    )
    p.add_argument("--split-seed", type=int, default=0, help="public seed of the train/validation split (default 0)")


def read_preprocessing(path: str | Path):
    """``--preprocessing``: a preprocessing JSON file, or a model manifest holding one
    (``peer.nn.store.read_preprocessing_file``)."""
    from peer.nn.store import read_preprocessing_file

    return read_preprocessing_file(path, "--preprocessing")


def records_from_args(args: argparse.Namespace):
    """The records of ``--data``, split and prepared: a table (``peer.nn.tables.prepare_records``)
    or images, a folder by class or a manifest (``peer.nn.images.prepare_image_records``)."""
    from peer.nn.images import is_image_source, prepare_image_records

    if args.preprocessing and args.public:
        raise InvalidArgument("--public", "give --preprocessing or --public (a file to fit one on), not both")
    given = read_preprocessing(args.preprocessing) if args.preprocessing else None
    if is_image_source(args.data):
        table_only = [f"--{k.replace('_', '-')}" for k in ("features", "impute", "allow_unseen") if getattr(args, k)]
        table_only += ["--categorical"] if args.categorical else []
        if table_only:
            raise InvalidArgument(table_only[0], f"applies to a table; {args.data} holds images")
        return prepare_image_records(
            args.data,
            label=args.label,
            channels=args.channels,
            size=None if args.image_size is None else tuple(args.image_size),
            validation_fraction=args.validation_fraction,
            split_seed=args.split_seed,
            preprocessing=given,
            public=args.public,
        )
    from peer.cli.model_import import table_records

    if args.label is None:
        raise InvalidArgument("--label", f"is required: the label column of {args.data}")
    for flag, value in (("--image-size", args.image_size), ("--channels", args.channels)):
        if value is not None:
            raise InvalidArgument(flag, f"applies to images; {args.data} is a table")
    return table_records(args, given)


def architecture_arg(text: str | None, preset: str | None, preprocessing, hidden) -> dict:
    """``--arch`` (JSON text or a .json file) or ``--preset``, sized by the preprocessing."""
    from peer.nn.tables import architecture_for

    if text is None:
        return architecture_for(preset or "mlp", preprocessing, hidden=hidden)
    source = text
    if not text.lstrip().startswith("{"):
        try:
            source = Path(text).read_text(encoding="utf-8")
        except OSError as e:
            raise InvalidArgument("--arch", f"is neither JSON nor a readable file: {e.strerror}") from None
    try:
        spec = json.loads(source)
    except ValueError as e:
        raise InvalidArgument("--arch", f"is not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise InvalidArgument("--arch", "must be a JSON object")
    return architecture_for(spec, preprocessing)


def emit(out: dict, as_json: bool, lines: list[str]) -> None:
    if as_json:
        json.dump(out, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        for line in lines:
            print(line)


# --------------------------------------------------------------------------------------------
# model train


def train(args: argparse.Namespace) -> int:
    from peer.nn.architectures import torch_threads

    with torch_threads(1):
        return _train(args)


def _train(args: argparse.Namespace) -> int:
    from peer.base.progress import progress_bar
    from peer.nn.architectures import accuracy, state_arrays, train_classifier
    from peer.nn.store import check_name, save_model

    check_name(args.name, "--name")
    if args.epochs < 1:
        raise InvalidArgument("--epochs", f"must be >= 1, got {args.epochs}")
    paths = site_paths(args.site)
    if (paths.models / f"{args.name}.json").exists() and not args.force:
        raise InvalidArgument(
            "--name", f"model {args.name!r} is already in {str(paths.models)!r}; give another name or --force"
        )
    records = records_from_args(args)
    prep = records.preprocessing
    arch = architecture_arg(args.arch, args.preset, prep, args.hidden)
    with progress_bar(args.epochs, f"training {args.name}", "epochs", quiet=args.json) as step:
        model = train_classifier(
            arch,
            records.x_train,
            records.y_train,
            seed=args.seed,
            epochs=args.epochs,
            batch_size=args.batch_size,
            learning_rate=args.learning_rate,
            progress=step,
        )
    train_acc = accuracy(arch, model, records.x_train, records.y_train)
    val_acc = accuracy(arch, model, records.x_val, records.y_val)
    metadata = {
        "trained_on": len(records.y_train),
        "seed": args.seed,
        "data": records.description,
        "accuracy": {"training": train_acc, "validation": val_acc},
        "plain_training": {
            "private": False,
            "epochs": args.epochs,
            "batch_size": args.batch_size,
            "learning_rate": args.learning_rate,
            "optimizer": "adam",
        },
    }
    path = save_model(paths.models, args.name, arch, state_arrays(model), metadata, prep)
    out = {
        "model": args.name,
        "path": str(path),
        "architecture": arch,
        "input_width": prep.width,
        "classes": list(prep.classes),
        "data": records.description,
        "training_accuracy": train_acc,
        "validation_accuracy": val_acc,
    }
    emit(
        out,
        args.json,
        [
            (
                f"model {args.name}: {records.description['training_rows']} training records, "
                f"{records.description['validation_rows']} held out (of {records.description['rows']} in {records.description['file']})"
            ),
            (
                f"inputs: {prep.describe_inputs()} ({prep.width} entries); {prep.num_classes} classes"
                if prep.input_shape is not None and not prep.columns
                else f"inputs: {prep.width} entries from {len(prep.columns)} columns ({len(prep.categorical)} categorical, one-hot); "
                f"classes {list(prep.classes)}"
            ),
            f"accuracy: training {train_acc:.4f}, validation {val_acc:.4f}",
            f"saved to {path} with its preprocessing ({records.description['preprocessing']})",
        ],
    )
    return 0


def register(subparsers) -> None:
    m = subparsers.add_parser(
        "model",
        help="a site's own models: train one on the site's records",
        description="A site's own models, kept in its model store (models/).",
    )
    sub = m.add_subparsers(dest="model_command", metavar="ACTION")
    sub.required = True

    t = sub.add_parser(
        "train",
        help="train a (non-private) model on the site's own records into its model store",
        description="Train a plain classifier on the site's own records. The records are split into "
        "training and held-out validation parts; the preprocessing (standardisation, one-hot "
        "categories, label classes, fill values) is fitted on the training part only (or on "
        "public records: --public) and stored with the model.",
    )
    t.add_argument(
        "--site",
        required=True,
        metavar="DIR",
        help="the site's directory (its site.toml says where the model store is; default DIR/models)",
    )
    add_record_options(t)
    arch = t.add_mutually_exclusive_group()
    arch.add_argument(
        "--preset", choices=("mlp", "cnn"), help="a built-in architecture sized by the records (default mlp)"
    )
    arch.add_argument(
        "--arch",
        metavar="JSON",
        help="architecture JSON or a .json file (peer.nn.architectures); input and output sizes may be left out",
    )
    t.add_argument(
        "--hidden",
        type=int,
        nargs="+",
        default=[64],
        metavar="WIDTH",
        help="hidden layer widths of a preset (default 64)",
    )
    t.add_argument("--name", required=True, help="the model's name in the store")
    t.add_argument("--epochs", type=int, default=60, help="training epochs (default 60)")
    t.add_argument("--batch-size", type=int, default=64)
    t.add_argument("--learning-rate", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    t.add_argument("--seed", type=int, default=0, help="seed of the initialisation and batch order (default 0)")
    t.add_argument("--force", action="store_true", help="replace a model of the same name")
    t.add_argument("--json", action="store_true", help="print the summary as JSON")
    t.set_defaults(func=train)
    register_adopt_export(sub)
    from peer.cli.model_import import register_import

    register_import(sub)


# --------------------------------------------------------------------------------------------
# adopt and export (the work is in peer.cli.site)


def _round_report_file(source: str) -> dict | None:
    """The round report ``source`` names (``rounds/round-ID.json``), or None when it names a model."""
    p = Path(source)
    if not (p.name.startswith("round-") and p.suffix == ".json" and p.is_file()):
        return None
    try:
        report = json.loads(p.read_text(encoding="utf-8"))
    except ValueError as e:
        raise InvalidArgument("--from", f"{source} is not a round report (not JSON: {e})") from None
    if not isinstance(report, dict) or "round_id" not in report or "status" not in report:
        raise InvalidArgument("--from", f"{source} is not a round report (no round_id/status)")
    return report


def _stage_scores(report: dict) -> tuple[dict, dict, str | None]:
    """(stage → accuracy, stage → log-loss, what they were measured on) from a round report's
    steps after fusion (``coordinator_free.after_fusion``); empty when nothing was scored."""
    af = report.get("after_fusion") or {}
    acc = af.get("selection_accuracy") or af.get("validation_accuracy") or {}
    loss = af.get("selection_log_loss") or af.get("validation_log_loss") or {}
    data = (af.get("selection") or {}).get("data") or ("public validation" if acc else None)
    return acc, loss, data


def _scores_text(acc: dict, loss: dict) -> str:
    return ", ".join(f"{k} {v:.3f}" + (f" (log-loss {loss[k]:.3f})" if k in loss else "") for k, v in acc.items())


def _stage_of(report: dict, stem: str) -> str | None:
    """The stage (fused, repaired, ...) of the round's model file ``stem``."""
    if report.get("fused_model") == stem:
        return "fused"
    return next((k[: -len("_model")] for k, v in report.items() if k.endswith("_model") and v == stem), None)


def _adopt(args: argparse.Namespace) -> int:
    """``model adopt``: ``--from rounds/round-ID.json`` follows the round's recommendation (the
    best-scoring stage, never below the own model: ``coordinator_free.after_fusion.recommend``)
    and prints the scores it rests on; ``--from rounds/models/NAME`` adopts that stage, with a
    warning (both scores) when it scored below the own model on the round's selection data."""
    from peer.cli.evaluate import release_pair
    from peer.cli.site import adopt_model

    source = getattr(args, "from")
    report = _round_report_file(source)
    notes: dict = {}
    if report is not None:
        if report.get("status") != "fused":
            raise FailedPrecondition(f"--from: round {report['round_id']} was not fused ({report.get('status')})")
        af = report.get("after_fusion") or {}
        stage = af.get("adopt") or "own"
        reason = af.get("adopt_reason") or (
            "the own model: the round ran no local steps after fusion, so nothing scored its fused "
            "model against the own model (adopt the fused model explicitly with --from rounds/models/NAME)"
        )
        acc, loss, data = _stage_scores(report)
        notes = {"recommended": stage, "reason": reason, "scores": acc, "scored_on": data}
        if not args.json:
            print(f"round {report['round_id'][:12]} recommends {stage}: {reason}")
        if stage == "own":
            notes["adopted"] = False
            if args.json:
                print(json.dumps({"model": None, **notes}, indent=2, sort_keys=True, default=str))
            else:
                print(f"nothing adopted: the site's own model {report.get('model')!r} stays what it uses")
            return 0
        store = Path(report.get("fused_store") or Path(source).parent / "models")
        source = str(store / report[f"{stage}_model"])
    path, adopted = adopt_model(args.site, source, args.name, preprocessing_from=args.preprocessing_from)
    if adopted["kind"] == "round" and report is None:
        report = json.loads(Path(adopted["report"]).read_text(encoding="utf-8"))
        stage = _stage_of(report, release_pair(source)[1])
        acc, loss, data = _stage_scores(report)
        if stage in acc and "own" in acc:
            below = (acc[stage], -loss.get(stage, 0.0)) < (acc["own"], -loss.get("own", 0.0))
            if below:
                notes["warning"] = (
                    f"{stage} scored {acc[stage]:.3f} on the {data} against the own model's {acc['own']:.3f}: "
                    f"adopting it makes the site worse there (the round recommended {report['after_fusion'].get('adopt')})"
                )
                print(f"warning: {notes['warning']}", file=sys.stderr)
        if acc:
            notes["scores"], notes["scored_on"] = acc, data
    if args.json:
        print(
            json.dumps(
                {"model": args.name, "manifest": str(path), **adopted, **notes}, indent=2, sort_keys=True, default=str
            )
        )
        return 0
    where = (
        f"round {adopted['round_id'][:12]} of {adopted['site']} (contributors {', '.join(adopted['contributors'])})"
        if adopted["kind"] == "round"
        else f"{adopted['release_kind']} release of {adopted['signer']} (ledger entry {adopted['ledger_entry_id']}, "
        f"{adopted['level']} level, ε={adopted['epsilon']:g}, δ={adopted['delta']:g} per {adopted['unit']}; signature verified)"
    )
    print(f"adopted {args.name!r} into {path.parent}: from {where}")
    if notes.get("scores"):
        print(f"scores on the {notes['scored_on']}: {_scores_text(notes['scores'], _stage_scores(report)[1])}")
    print(
        f"preprocessing: {adopted['preprocessing_from']}; provenance: {path.parent / (args.name + '.provenance.json')}"
    )
    print(f'restart the daemon to offer it; a round with [round] model = "{args.name}" starts from it')
    return 0


def preprocessing_sidecar(out: str | Path) -> Path:
    """Where ``model export --out FILE`` writes the model's preprocessing: ``FILE.preprocessing.json``."""
    out = Path(out)
    return out.with_name(out.name + ".preprocessing.json")


def _export(args: argparse.Namespace) -> int:
    """The weights (``peer.cli.site.export_model``, or an imported network's under its own key
    names), and beside them, when the model holds one, its preprocessing as JSON
    (``FILE.preprocessing.json``: what ``model import --preprocessing`` and ``model train
    --preprocessing`` read), so that the network prepares the same raw records the same way
    wherever it goes. Written after the weights, atomically; refused when it exists."""
    from peer.base.errors import FailedPrecondition
    from peer.cli.evaluate import site_models_dir
    from peer.cli.model_import import export_imported, is_imported, load_own
    from peer.cli.site import export_model
    from peer.nn.store import _atomic_write, load_model

    imported = is_imported(args.site, args.model)
    if imported:
        prep = load_own(args.site, args.model).preprocessing
    else:
        prep = load_model(site_models_dir(args.site), args.model).preprocessing
    sidecar = preprocessing_sidecar(args.out)
    if prep is not None and sidecar.exists():
        raise FailedPrecondition(
            f"--out: {sidecar} (the preprocessing beside the weights) exists; export never overwrites"
        )
    if imported:  # a site's own network: its own key names
        out = export_imported(args.site, args.model, args.format, args.out)
        what = "a state_dict under the site's own key names"
    else:
        out = export_model(args.site, args.model, args.format, args.out)
        what = "a plain state_dict of float32 tensors"
    if prep is None:
        print(f"{args.model!r} -> {out} ({args.format}: {what}; the model holds no preprocessing)")
        return 0
    _atomic_write(sidecar, (json.dumps(prep.to_dict(), indent=2, sort_keys=True, allow_nan=False) + "\n").encode())
    print(f"{args.model!r} -> {out} ({args.format}: {what})")
    print(
        f"preprocessing -> {sidecar} ({prep.describe_inputs()}; model import/train --preprocessing read it). It holds "
        "statistics of the site's training records, not differentially private: it goes only where they may go"
    )
    return 0


def register_adopt_export(sub) -> None:
    a = sub.add_parser(
        "adopt",
        help="make a round's fused model or a merged/fused release one of the site's models, with its provenance",
    )
    a.add_argument("--site", required=True, metavar="DIR", help="the site's directory")
    a.add_argument(
        "--from",
        required=True,
        metavar="MODEL",
        dest="from",
        help="rounds/round-ID.json (the round's recommended stage, never below the own model), rounds/models/NAME "
        "(that stage of a round; warns when it scored below the own model) or a release OUT(.safetensors + .json)",
    )
    a.add_argument("--name", required=True, help="the model's name in the site's store")
    a.add_argument(
        "--preprocessing-from",
        metavar="NAME",
        help="the site model whose preprocessing goes with it (default: the round's own model, else the site's default)",
    )
    a.add_argument("--json", action="store_true", help="print what was adopted as JSON")
    a.set_defaults(func=_adopt)
    e = sub.add_parser("export", help="write a site model's weights for use outside PrivFusion (a plain state_dict)")
    e.add_argument("--site", required=True, metavar="DIR", help="the site's directory")
    e.add_argument("--model", required=True, metavar="NAME", help="a model of the site")
    e.add_argument(
        "--format", required=True, choices=("safetensors", "pt"), help="safetensors, or pt (torch.save of tensors only)"
    )
    e.add_argument("--out", required=True, metavar="FILE", help="the file to write (never overwritten)")
    e.set_defaults(func=_export)
