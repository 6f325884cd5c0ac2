"""``privfusion evaluate``: score a model on the site's own held-out records.

    privfusion evaluate --site DIR --model NAME --data test.csv --label outcome [--json]
    privfusion evaluate --model got/merged-b --data test.csv --label outcome --site DIR [--preprocessing-from NAME]

The model is one of the site's (``--site DIR --model NAME``: its own, an adopted fused or merged
model, or a network the site imported, ``DIR/own_models``: ``privfusion model import``, run by
the site's own factory) or a file pair ``FILE.safetensors`` + ``FILE.json``: a release that ``privfusion
weights / merge --via / fuse`` wrote, a fused model of a round (``rounds/models/NAME``) or a
local merge of the site's pool (``privfusion merge --pool``; prepared as the pool's models).

The file is prepared exactly as the model's training data was: the ``Preprocessing`` stored
with the model (``peer.nn.tables``; its column kinds, means, standard deviations, categories and
class list, all fitted on the training split) is applied to it. A release or a round model
carries no preprocessing: it then comes from ``--preprocessing-from NAME`` (a model of
``--site`` whose preprocessing the requester used for its probe set), else from the site's
default — the preprocessing every model of the site's store that has one shares — and the
output says which.

Metrics (``peer.nn.metrics.classification_metrics``; scikit-learn, on the predicted class =
argmax of the softmax; per-class scores with ``zero_division=0``): ``accuracy``; ``macro_f1``,
``macro_recall``, ``macro_precision`` (the unweighted mean over the model's classes) and
``weighted_f1``, ``weighted_recall``, ``weighted_precision`` (weighted by each class's support
in the file) — the metrics of the PrivFusion paper's Table IV; for a binary label ``auroc``
(the score is the predicted probability of class index 1, i.e. the second entry of the class
list; null when the file holds one class only); and ``confusion_matrix`` (rows: true class,
columns: predicted class, both in the order of ``classes``).

Privacy: evaluation reads the site's own records locally and releases nothing; the scores are
not differentially private (do not publish them as such).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from peer.base.errors import FailedPrecondition, InvalidArgument, NotFound
from peer.nn.metrics import classification_metrics

#: Release kinds that hold a whole model (a "features" release holds graph features only).
MODEL_RELEASE_KINDS = ("weights", "merged", "fused")


# ------------------------------------------------------------------------------ what to score


def site_models_dir(site: str | Path) -> Path:
    """The model store of a site directory (``[site].models`` of DIR/site.toml)."""
    from peer.net.site import SiteConfig

    config = Path(site) / "site.toml"
    if not config.is_file():
        raise NotFound(f"--site: {site} has no site.toml (make a site with `privfusion site new`)")
    return SiteConfig.load(config).models


def site_default_preprocessing(site: str | Path, name: str | None = None):
    """``(preprocessing, source)``: of the site's model ``name``, or else the one every model of
    the site's store with a preprocessing shares (none, or several different: an error that says
    to name one)."""
    from peer.cli.model_import import is_imported, load_own
    from peer.nn.store import list_models, load_model

    store = site_models_dir(site)
    if name is not None:
        in_store = (store / f"{name}.json").is_file() or not is_imported(str(site), name)
        p = load_model(store, name).preprocessing if in_store else load_own(str(site), name).preprocessing
        if p is None:
            raise FailedPrecondition(f"--preprocessing-from: the site's model {name!r} holds no preprocessing")
        return p, f"the site's model {name!r}"
    found: dict[str, tuple[Any, list[str]]] = {}
    for n in list_models(store):
        p = load_model(store, n).preprocessing
        if p is not None:
            key = json.dumps(p.to_dict(), sort_keys=True)
            found.setdefault(key, (p, []))[1].append(n)
    if not found:
        raise FailedPrecondition(
            f"--site: no model in {store} holds a preprocessing (train one with privfusion model train)"
        )
    if len(found) > 1:
        groups = [names for _, names in found.values()]
        raise FailedPrecondition(
            f"--preprocessing-from: the site's models were prepared differently ({groups}); name the one "
            "whose preprocessing the probe set was made with"
        )
    p, names = next(iter(found.values()))
    return p, f"the site's default (shared by its models {names})"


def release_pair(path: str | Path) -> tuple[Path, str]:
    """(directory, name) of a model file pair given as FILE, FILE.safetensors or FILE.json."""
    p = Path(path)
    for suffix in (".safetensors", ".json"):
        if p.name.endswith(suffix):
            p = p.with_name(p.name[: -len(suffix)])
    if not (p.with_name(p.name + ".json").is_file() and p.with_name(p.name + ".safetensors").is_file()):
        raise NotFound(f"--model: {path} is not a model pair ({p.name}.safetensors + {p.name}.json beside it)")
    try:
        doc = json.loads(p.with_name(p.name + ".json").read_text(encoding="utf-8"))
    except ValueError:
        doc = None  # not JSON: the store's loader says so
    if isinstance(doc, dict) and isinstance(doc.get("metadata"), dict):
        describe_file_model(doc["metadata"])  # a release that holds no model is named as such
    return p.parent, p.name


def describe_file_model(metadata: Mapping[str, Any]) -> str:
    """What a model file pair is: "release" (from a peer; its kind checked), "round" (a round's
    fused model), "merge" (a local RS/LC merge of the site's own pool, ``privfusion merge
    --pool``) or "model"."""
    release = metadata.get("release")
    if isinstance(release, Mapping):
        kind = release.get("kind")
        if kind not in MODEL_RELEASE_KINDS:
            raise InvalidArgument(
                "--model",
                f"is a {kind!r} release, which holds no model; "
                f"a model is in a {' / '.join(MODEL_RELEASE_KINDS)} release",
            )
        return "release"
    if "round" in metadata:
        return "round"
    return "merge" if isinstance(metadata.get("record"), Mapping) and "choice" in metadata else "model"


def site_pool_preprocessing(site: str | Path):
    """``(preprocessing, source)`` of the site's pool (its only one), or None: what a local merge
    of the pool was trained with."""
    from peer.dp.pools import pool_preprocessing
    from peer.net.site import SiteConfig

    config = SiteConfig.load(Path(site) / "site.toml")
    pools = [(n, d) for n, d in config.pools.items() if d.is_dir()]
    if len(pools) != 1:
        return None
    try:
        prep = pool_preprocessing(pools[0][1])
    except InvalidArgument:
        return None
    return (prep, f"the site's pool {pools[0][0]!r}") if prep is not None else None


def load_for_scoring(model: str, site: str | None, preprocessing_from: str | None):
    """``(StoredModel, Preprocessing, description)`` of what ``--model`` names."""
    from peer.cli.model_import import is_imported, load_own
    from peer.nn.store import NAME_RULE, load_model, load_model_pair

    store = site_models_dir(site) if site is not None else None
    in_store = store is not None and NAME_RULE.match(model) and (store / f"{model}.json").is_file()
    if store is not None and not in_store and is_imported(site, model):  # the site's own network (model import)
        own = load_own(site, model)
        prep, source = own.preprocessing, f"stored with the model {model!r}"
        if prep is None and preprocessing_from is None:
            raise FailedPrecondition(
                f"--model: the site's imported network {model!r} holds no preprocessing: import it with "
                "--data FILE --label COL (fitted on the site's training split) or --preprocessing JSON, or "
                "give --preprocessing-from NAME"
            )
        if preprocessing_from is not None:
            prep, source = site_default_preprocessing(site, preprocessing_from)
        return own, prep, {"model": model, "site": str(site), "kind": "imported model", "preprocessing": source}
    if in_store:
        stored = load_model(store, model)
        prep = stored.preprocessing
        source = f"stored with the model {model!r}"
        if prep is None or preprocessing_from is not None:
            prep, source = site_default_preprocessing(site, preprocessing_from)
        described = {"model": model, "site": str(site), "kind": "site model", "preprocessing": source}
        if "adopted" in stored.metadata:  # where an adopted model came from (privfusion model adopt)
            described["adopted"] = stored.metadata["adopted"]
        return stored, prep, described
    if (
        store is not None
        and NAME_RULE.match(model)
        and not Path(model + ".json").exists()
        and not Path(model).with_suffix(".json").exists()
    ):
        raise NotFound(
            f"--model: {model!r} is neither a model of the site's store {str(store)!r}, nor one of its imported "
            f"networks ({str(Path(site) / 'own_models')!r}), nor a model file pair"
        )
    directory, name = release_pair(model)
    stored = load_model_pair(directory / name)
    kind = describe_file_model(stored.metadata)
    prep = stored.preprocessing
    source = f"stored with the model {name!r}"
    if prep is None or preprocessing_from is not None:
        if site is None:
            raise InvalidArgument(
                "--site",
                f"{model} ({kind}) carries no preprocessing: give --site DIR (and "
                "--preprocessing-from NAME) to prepare the file as that site's model was",
            )
        pooled = site_pool_preprocessing(site) if kind == "merge" and preprocessing_from is None else None
        prep, source = pooled or site_default_preprocessing(site, preprocessing_from)
        source += f" (a {kind} carries none)" if preprocessing_from is None else ""
    return stored, prep, {"model": str(model), "kind": kind, "preprocessing": source}


def evaluate(model: str, data: str, label: str, site: str | None = None, preprocessing_from: str | None = None) -> dict:
    """Score ``model`` on the labelled file ``data`` (see the module docstring)."""
    from peer.nn.architectures import predict_proba
    from peer.nn.images import ImagePreprocessing, is_image_source
    from peer.nn.tables import read_table

    stored, prep, described = load_for_scoring(model, site, preprocessing_from)
    if isinstance(prep, ImagePreprocessing) != is_image_source(data):
        raise InvalidArgument(
            "--data",
            f"{data} holds {'images' if is_image_source(data) else 'a table'} but the model's preprocessing "
            f"prepares {'images' if isinstance(prep, ImagePreprocessing) else 'a table'}",
        )
    if isinstance(prep, ImagePreprocessing):  # prepared by the stored resize, channels and statistics
        if label is None:
            label = prep.label
        if label != prep.label:
            raise InvalidArgument("--label", f"is {label!r} but the model was trained with label {prep.label!r}")
        table = prep.read(data)
    else:
        if label is None:
            raise InvalidArgument("--label", f"is required: the label column of {data}")
        table = read_table(
            data,
            label=label,
            features=prep.features,
            categorical=prep.categorical,
            missing="impute" if prep.imputes else "refuse",
        )
    x, y = prep.transform(table)
    if described["kind"] == "imported model":
        from peer.cli.model_import import own_predict_proba
        from peer.nn.imported import records_fit_network

        records_fit_network(stored.structure, prep, "--data", stored.name)  # its input, or a clear refusal
        proba = own_predict_proba(str(site), stored, x)
    else:
        if prep.input_shape is not None:
            x = x.reshape((len(x), *prep.input_shape))
        proba = predict_proba(stored.architecture, stored.module(), x)
    out = classification_metrics(y, proba, prep.classes)
    out.update(described)
    out["data"] = str(data)
    out["label"] = label
    return out


def _evaluate(args) -> int:
    result = evaluate(args.model, args.data, args.label, site=args.site, preprocessing_from=args.preprocessing_from)
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
        return 0
    print(
        f"{result['kind']} {result['model']} on {result['data']} ({result['records']} records, label {result['label']!r})"
    )
    print(f"preprocessing: {result['preprocessing']}")
    for key in (
        "accuracy",
        "macro_f1",
        "weighted_f1",
        "macro_recall",
        "weighted_recall",
        "macro_precision",
        "weighted_precision",
        "auroc",
    ):
        if key in result:
            v = result[key]
            print(f"  {key:16s} {'n/a (one class in the file)' if v is None else f'{v:.4f}'}")
    print("  confusion matrix (rows: true, columns: predicted; classes " + ", ".join(map(str, result["classes"])) + ")")
    for row in result["confusion_matrix"]:
        print("    " + " ".join(f"{v:6d}" for v in row))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "evaluate", help="score a model (own, adopted, fused, merged or a release) on local held-out records"
    )
    p.add_argument("--site", metavar="DIR", help="the site directory (its models, and the preprocessing of a release)")
    p.add_argument(
        "--model",
        required=True,
        metavar="NAME|FILE",
        help="a model of --site, or a model file pair FILE(.safetensors + .json): a release or a round's fused model",
    )
    p.add_argument(
        "--data",
        required=True,
        metavar="FILE",
        help="labelled held-out records (.csv, .tsv, .parquet, .npz; or images: a folder by class, or a manifest)",
    )
    p.add_argument(
        "--label", metavar="COL", help="the label column (images: default the model's; a folder's is 'folder')"
    )
    p.add_argument(
        "--preprocessing-from",
        metavar="NAME",
        help="a model of --site whose preprocessing prepares the file (default: the model's own, else the site's)",
    )
    p.add_argument("--json", action="store_true", help="print the scores as JSON")
    p.set_defaults(func=_evaluate)
