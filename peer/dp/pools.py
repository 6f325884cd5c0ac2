"""A site's pool of DP models on disk, and the data splits pools are trained and judged on.

A pool is one model store directory (``peer.nn.store``): each model is ``NAME.safetensors`` plus
``NAME.json`` whose metadata holds (its fields are read by load_pool below)::

    {"training": TrainingRecord dict, "record": "dpsgd" ReleaseRecord dict,
     "accuracy": accuracy on the held-out validation split, "data": how the data was split,
     "prior_utility": optional public prior utility the site declares (``peer.dp.merging``)}

and, for a pool trained on a site's own records (``privfusion pool train --data``), the
manifest's "preprocessing" (``peer.nn.tables.Preprocessing``), the same for every model.

A model known only by its final (ε, δ) has a "record" and no "training"; it can be merged by
random selection only.

Data. The bundled dataset's training part is split once more: a stratified *held-out
validation* split (``validation_fraction``, default 0.2) and the rest, the *protected* training
records that DP-SGD sees and the guarantee covers. The validation split is what a *charged*
utility selection scores candidates on (``merge_pool(selection="utility")``); it is not protected
by the pool's guarantee (treat it as public, or as data the site is willing to spend no privacy
on) — but the models scored on it are, which is why such a selection is charged the composition
of every scored model, and why the default selection reads no score at all. The test split is
for reporting only.

A site's own records (``peer.nn.tables.prepare_records``) are split the same way into protected
training records and a held-out part. The held-out part only reports accuracy locally; the
validation set that judges merges is made from a file the site declares public
(``privfusion probe make --label``, written to the pool's ``validation`` file).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from peer.base.errors import FailedPrecondition, InvalidArgument
from peer.base.records import ReleaseRecord
from peer.base.rng import Randomness, make_randomness
from peer.dp.accounting import ApproxDP, TrainingRecord
from peer.dp.accounting.accountant import DEFAULT_ACCOUNTANT, Accountant
from peer.dp.merging import METHODS, MergedModel, PoolModel, check_pool, merge_lc, merge_rs
from peer.dp.training import TrainedModel
from peer.nn.architectures import accuracy, model_from_arrays
from peer.nn.data import load_dataset
from peer.nn.imported import (
    imported_architecture,
    is_imported_architecture,
    load_factory,
    load_imported,
    module_accuracy,
    module_from_arrays,
    save_imported,
    structure_of,
)
from peer.nn.store import _atomic_write, list_models, load_model, save_model
from peer.nn.tables import Preprocessing

__all__ = [
    "load_pool",
    "load_splits",
    "load_validation_file",
    "merge_pool",
    "pool_preprocessing",
    "pool_validation",
    "profile_cache_directory",
    "rs_utilities",
    "save_merged",
    "save_trained",
    "states_true_count",
    "true_count_models",
    "true_count_refusal",
    "warm_pool_profiles",
]


@dataclass(frozen=True)
class Splits:
    """Protected training records, held-out validation (public for merging), test (reporting)."""

    dataset: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    description: dict


def load_splits(
    dataset: str, *, split_seed: int = 0, validation_fraction: float = 0.2, test_fraction: float = 0.25
) -> Splits:
    """The bundled dataset split into protected training records, a held-out validation split
    (stratified, ``validation_fraction`` of the training part) and the test split."""
    from sklearn.model_selection import train_test_split

    if not 0 < validation_fraction < 1:
        raise InvalidArgument("validation_fraction", f"must be in (0, 1), got {validation_fraction!r}")
    ds = load_dataset(dataset, test_fraction=test_fraction, seed=split_seed)
    x_tr, x_val, y_tr, y_val = train_test_split(
        ds.x_train, ds.y_train, test_size=validation_fraction, stratify=ds.y_train, random_state=split_seed
    )
    description = {
        "dataset": dataset,
        "split_seed": split_seed,
        "validation_fraction": validation_fraction,
        "test_fraction": test_fraction,
    }
    return Splits(dataset, x_tr, y_tr, x_val, y_val, ds.x_test, ds.y_test, ds.num_classes, description)


def splits_from_description(description: Mapping[str, Any]) -> Splits:
    """Rebuild the splits a pool was trained with from its metadata "data" entry."""
    if not isinstance(description, Mapping) or "dataset" not in description:
        raise InvalidArgument("metadata.data", "must name the dataset and how it was split")
    try:
        return load_splits(
            description["dataset"],
            split_seed=int(description.get("split_seed", 0)),
            validation_fraction=float(description.get("validation_fraction", 0.2)),
            test_fraction=float(description.get("test_fraction", 0.25)),
        )
    except (TypeError, ValueError) as e:
        if isinstance(e, InvalidArgument):
            raise
        raise InvalidArgument("metadata.data", f"is malformed: {e}") from None


def save_trained(
    directory: str | os.PathLike,
    name: str,
    model: TrainedModel,
    *,
    accuracy: float | None = None,
    data: Mapping[str, Any] | None = None,
    preprocessing: Preprocessing | None = None,
    factory: str | None = None,
) -> Path:
    """Store one DP-SGD model with its training record and release record (and the
    preprocessing of the records it was trained on, when they were a site's own table)."""
    metadata: dict[str, Any] = {
        "training": model.training.to_dict(),
        "record": model.record.with_(subject=name).to_dict(),
    }
    if accuracy is not None:
        metadata["accuracy"] = float(accuracy)
    if data is not None:
        metadata["data"] = dict(data)
    if is_imported_architecture(model.architecture):
        # a site's own network: stored like an imported model (its structure and the factory
        # that rebuilds it here), so that the pool's models keep the site's key names
        if factory is None:
            raise InvalidArgument("factory", "a pool of a site's own network needs its factory")
        return save_imported(
            directory, name, factory, structure_of(model.architecture), model.arrays, metadata, preprocessing
        )
    return save_model(directory, name, model.architecture, model.arrays, metadata, preprocessing)


def pool_preprocessing(directory: str | os.PathLike) -> Preprocessing | None:
    """The preprocessing a pool's models were trained with (None for a bundled dataset's pool);
    refused when its models disagree, since one validation set must fit them all."""
    preps = {
        name: (load_imported if _is_imported_pair(directory, name) else load_model)(directory, name).preprocessing
        for name in list_models(directory)
    }
    if not preps:
        raise InvalidArgument("pool", f"{str(directory)!r} holds no models")
    dicts = {name: None if p is None else p.to_dict() for name, p in preps.items()}
    first = next(iter(dicts.values()))
    if any(d != first for d in dicts.values()):
        raise InvalidArgument(
            "pool", f"the models of {str(directory)!r} were trained with different preprocessing; a pool shares one"
        )
    return next(iter(preps.values()))


def _privacy_of(name: str, metadata: Mapping[str, Any]) -> tuple[TrainingRecord | ApproxDP, int | None]:
    record = None
    if "record" in metadata:
        record = ReleaseRecord.from_dict(metadata["record"])
    if "training" in metadata:
        training = TrainingRecord.from_dict(metadata["training"], f"{name}.metadata.training")
        if record is None:
            return training, None
        if (
            record.mechanism != "dpsgd"
            or TrainingRecord.from_dict(
                record.parameters.get("training", {}), f"{name}.metadata.record.parameters.training"
            )
            != training
        ):
            raise InvalidArgument(
                f"{name}.metadata.record", "must be the dpsgd record of the model's own training record"
            )
        size = record.parameters.get("dataset_size")
        return training, (int(size) if size is not None else None)
    if record is not None and record.level == "data" and record.unit.startswith("record:"):
        return ApproxDP(record.epsilon, record.delta, record.unit.split(":", 1)[1]), None
    raise InvalidArgument(
        f"{name}.metadata", "holds neither a DP-SGD training record nor a data-level (epsilon, delta) release record"
    )


def true_count_models(pool: Sequence[PoolModel]) -> list[str]:
    """The models of ``pool`` trained under add-remove with the true number of their training
    records as DP-SGD's denominator: their "dpsgd" record carries ``dataset_size`` without
    ``dataset_size_source = "declared"`` (every add-remove pool written before declared
    counts existed: ``privfusion pool train`` took len(records)). Under add-remove that count
    is private — the records of D and D + {x} state 49 and 50 — and the update itself divides
    by it, so such a model is outside the guarantee its record claims. Replace-one models
    (the count is public there) are never listed."""
    return [
        m.name for m in pool if states_true_count(m.metadata.get("record") if isinstance(m.metadata, Mapping) else None)
    ]


def states_true_count(record: Mapping[str, Any] | None) -> bool:
    """Whether a stored "dpsgd" record (its dict) is add-remove with a ``dataset_size`` that
    was not declared (:func:`true_count_models`)."""
    if not isinstance(record, Mapping) or record.get("unit") != "record:add-remove":
        return False
    params = record.get("parameters") or {}
    return isinstance(params, Mapping) and "dataset_size" in params and params.get("dataset_size_source") != "declared"


def check_declared_counts(pool: Sequence[PoolModel], pool_name: str) -> None:
    """Refuse (FailedPrecondition naming the pool, its models and what to do) a pool with a
    model of :func:`true_count_models`: nothing made from it is served or merged."""
    names = true_count_models(pool)
    if names:
        raise FailedPrecondition(true_count_refusal(pool_name, names), reason="POOL_TRUE_COUNT")


def true_count_refusal(pool_name: str, names: Sequence[str]) -> str:
    """Why a pool with models of :func:`true_count_models` is not served, and what to do (no
    count is named: it is the private value)."""
    return (
        f"pool {pool_name!r}: models {list(names)} were trained under add-remove adjacency with the true number "
        "of training records as DP-SGD's denominator, and their records state it (neighbouring datasets "
        "give different records); they are not served. Retrain them with a declared public count "
        "(privfusion pool train --adjacency add-remove --declared-records N, or [site] declared_records in "
        "site.toml), or remove them from the pool"
    )


def load_pool(directory: str | os.PathLike) -> list[PoolModel]:
    """Every model of a pool directory, in name order."""
    names = list_models(directory)
    if not names:
        raise InvalidArgument("pool", f"{str(directory)!r} holds no models")
    out = []
    for name in names:
        if _is_imported_pair(directory, name):
            # a pool of a site's own network: the public architecture is its structure; the
            # factory (site code, run only here) is kept in the metadata to rebuild the module
            imp = load_imported(directory, name)
            metadata = {
                **imp.metadata,
                IMPORTED_FACTORY: imp.factory,
                IMPORTED_SEARCH_PATH: str(Path(directory).parent),
            }
            privacy, size = _privacy_of(name, imp.metadata)
            out.append(
                PoolModel(
                    name,
                    imported_architecture(imp.structure),
                    {k: imp.arrays[k] for k in imp.structure.parameters},  # the site's key order
                    privacy,
                    size,
                    metadata,
                )
            )
            continue
        m = load_model(directory, name)
        privacy, size = _privacy_of(name, m.metadata)
        out.append(PoolModel(name, m.architecture, m.arrays, privacy, size, m.metadata))
    return out


#: PoolModel.metadata keys of a pool of a site's own network (added when loading, never stored):
#: the factory that rebuilds the module and where a ``MODULE:FUNCTION`` factory is imported from
IMPORTED_FACTORY = "imported_factory"
IMPORTED_SEARCH_PATH = "imported_search_path"


def _is_imported_pair(directory: str | os.PathLike, name: str) -> bool:
    try:
        return "imported" in json.loads((Path(directory) / f"{name}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # load_model says what is wrong with it


def pool_accuracy(pool: Sequence[PoolModel], validation: tuple[np.ndarray, np.ndarray]):
    """``arrays -> accuracy on validation`` for the pool's architecture: a built-in one, or a
    site's own network rebuilt by its factory (eval mode)."""
    arch = check_pool(pool)
    x_val, y_val = validation
    if is_imported_architecture(arch):
        structure = structure_of(arch)
        factory = load_factory(pool[0].metadata[IMPORTED_FACTORY], [pool[0].metadata.get(IMPORTED_SEARCH_PATH, ".")])
        return lambda arrays: module_accuracy(module_from_arrays(factory, structure, arrays), structure, x_val, y_val)
    return lambda arrays: accuracy(arch, model_from_arrays(arch, arrays), x_val, y_val)


def profile_cache_directory(directory: str | os.PathLike) -> Path:
    """Where the privacy profiles (PLD + RDP) of a pool's models are kept on disk: the hidden
    sibling ``.NAME.profiles`` of the pool directory ``NAME`` (beside the pool, not in it: a pool
    directory holds models only). Entries are keyed by each model's training record and checked
    when read (``peer.dp.accounting.profile_cache``); deleting the directory only costs time."""
    d = Path(directory).resolve()
    return d.parent / f".{d.name}.profiles"


def warm_pool_profiles(
    pool: Sequence[PoolModel], directory: str | os.PathLike, *, accountant: Accountant = DEFAULT_ACCOUNTANT
) -> list:
    """The privacy profiles of ``pool`` (stored at ``directory``) at ``accountant``'s settings
    under their common adjacency,
    read from the pool's profile cache or built and written there, and kept in memory: later RS
    and LC requests on the pool then pay for choosing π / λ, not for T-step PLD compositions.
    Raises InvalidArgument when the pool mixes adjacencies (each request then says why)."""
    from peer.dp.accounting.profile_cache import cached_profiles

    return cached_profiles([m.privacy for m in pool], profile_cache_directory(directory), accountant=accountant)


def pool_validation(pool: Sequence[PoolModel]) -> tuple[np.ndarray, np.ndarray]:
    """The held-out validation split the pool was trained beside (its models' metadata "data"
    entry, which must be the same for every model)."""
    described = [m.metadata.get("data") for m in pool]
    if any(d is None for d in described):
        missing = [m.name for m, d in zip(pool, described, strict=True) if d is None]
        raise InvalidArgument(
            "validation",
            f"models {missing} do not say which data they were trained on; give a validation file (x, y held out from the protected data)",
        )
    if any(dict(d) != dict(described[0]) for d in described[1:]):
        raise InvalidArgument(
            "validation", "the pool's models were trained on different data splits; give a validation file"
        )
    if "dataset" not in described[0] and "file" in described[0]:
        raise InvalidArgument(
            "validation",
            f"the pool was trained on the site's own records ({described[0]['file']}); its held-out part is "
            "not public. Make a validation file from public records with `privfusion probe make "
            "--data PUBLIC --label COL --pool NAME` and name it in [site.pools.NAME] validation",
        )
    s = splits_from_description(described[0])
    return s.x_val, s.y_val


def load_validation_file(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """A validation set from an .npz file with arrays ``x`` (inputs) and ``y`` (labels)."""
    p = Path(path)
    if not p.is_file():
        raise InvalidArgument("validation", f"{str(p)!r} is not a file")
    try:
        with np.load(p, allow_pickle=False) as data:
            x, y = np.asarray(data["x"], dtype=np.float32), np.asarray(data["y"])
    except (KeyError, ValueError, OSError) as e:
        raise InvalidArgument("validation", f"{str(p)!r} must be an .npz file with arrays 'x' and 'y': {e}") from None
    if x.ndim < 2 or y.ndim != 1 or len(x) != len(y) or len(x) == 0:
        raise InvalidArgument(
            "validation", f"needs x of shape (m, ...) and y of shape (m,) with m > 0, got {x.shape} and {y.shape}"
        )
    if not np.issubdtype(y.dtype, np.integer):
        raise InvalidArgument("validation", f"labels y must be integers, got {y.dtype}")
    return x, y.astype(np.int64)


def rs_utilities(pool: Sequence[PoolModel], validation: tuple[np.ndarray, np.ndarray]) -> list[float]:
    """Each pool model's accuracy on ``validation``: what a *charged* utility selection reads
    (``selection="utility"``). Not a public prior: the models are functions of the protected
    training records, so their scores are too, however public the validation split."""
    judge = pool_accuracy(pool, validation)
    return [judge(m.arrays) for m in pool]


def merge_pool(
    pool: Sequence[PoolModel],
    method: str,
    target_epsilon: float,
    delta: float,
    *,
    selection: str = "public-prior",
    prior: Sequence[float] | None = None,
    validation: tuple[np.ndarray, np.ndarray] | None = None,
    utilities: Sequence[float] | None = None,
    figure: str = "pld",
    accountant: Accountant = DEFAULT_ACCOUNTANT,
    randomness: Randomness | None = None,
    subject: str = "",
    counterparty: str | None = None,
) -> MergedModel:
    """Merge a loaded pool at (target_epsilon, delta) by ``method`` ("rs" or "lc").

    ``selection`` "public-prior" (default): π / λ from the models' training records and the
    public prior (``prior``, else the models' declared ``prior_utility``, else each model's own ε;
    ``peer.dp.merging.pool_prior``); no model is scored and ``validation`` is not read.
    "utility": candidates of a public subset are judged by accuracy on ``validation`` (default:
    the pool's own held-out split), charged the composition of that subset; for RS,
    ``utilities`` may give the models' accuracies already (:func:`rs_utilities`; only those of
    the scored subset are read). RS draws from ``randomness`` (a fresh CSPRNG-seeded one when
    None). Every ε is stated by ``accountant``."""
    if method not in METHODS:
        raise InvalidArgument("method", f"must be one of {METHODS}, got {method!r}")
    check_pool(pool)
    check_declared_counts(pool, subject or "pool")
    score = None
    if selection == "utility":
        x_val, y_val = pool_validation(pool) if validation is None else validation
        judge = pool_accuracy(pool, (x_val, y_val))
        score = judge
        if method == "rs" and utilities is not None:
            if len(utilities) != len(pool):
                raise InvalidArgument(
                    "utilities", f"must give one accuracy per pool model ({len(pool)}), got {len(utilities)}"
                )
            known = {id(m.arrays): float(u) for m, u in zip(pool, utilities, strict=True)}

            def score(arrays):
                return known[id(arrays)] if id(arrays) in known else judge(arrays)

    elif utilities is not None or validation is not None:
        raise InvalidArgument(
            "utilities" if utilities is not None else "validation",
            "candidates are scored only by a utility selection (selection='utility', charged as the scored models)",
        )
    if method == "rs":
        return merge_rs(
            pool,
            target_epsilon,
            delta,
            randomness=randomness or make_randomness(),
            selection=selection,
            prior=prior,
            score=score,
            figure=figure,
            accountant=accountant,
            subject=subject,
            counterparty=counterparty,
        )
    return merge_lc(
        pool,
        target_epsilon,
        delta,
        selection=selection,
        prior=prior,
        score=score,
        figure=figure,
        accountant=accountant,
        subject=subject,
        counterparty=counterparty,
    )


def save_merged(
    path: str | os.PathLike, merged: MergedModel, pool: Sequence[PoolModel] = (), charged: bool | None = None
) -> tuple[Path, Path]:
    """Write a merge as a stored model named after ``path``'s stem (PATH_DIR/STEM.safetensors and
    STEM.json, whose metadata holds the release record and the weight choice) and its release
    record alone beside it (STEM.record.json). Returns (weights path, record path).

    A merge of a pool of a site's own network is written as an imported model (its structure
    and the factory of the ``pool`` it came from, which then must be given), under the site's
    key names: ``privfusion model export`` and ``peer.nn.imported.load_imported`` read it.

    ``charged`` (when given) is written to the metadata: False for a merge made outside any
    site's ledger (``privfusion merge --pool DIR``), which no budget records."""
    p = Path(path)
    name = p.name[: -len(".safetensors")] if p.name.endswith(".safetensors") else p.name
    directory = p.parent
    metadata = {"record": merged.record.to_dict(), "choice": merged.choice.to_dict()}
    if charged is not None:
        metadata["charged"] = bool(charged)
    if is_imported_architecture(merged.architecture):
        factories = {m.metadata.get(IMPORTED_FACTORY) for m in pool} - {None}
        if len(factories) != 1:
            raise InvalidArgument(
                "pool", f"a merge of a site's own network needs the one factory of its pool, found {sorted(factories)}"
            )
        save_imported(directory, name, factories.pop(), structure_of(merged.architecture), merged.arrays, metadata)
    else:
        save_model(directory, name, merged.architecture, merged.arrays, metadata)
    record_path = directory / f"{name}.record.json"
    _atomic_write(record_path, json.dumps(merged.record.to_dict(), indent=2, sort_keys=True, allow_nan=False).encode())
    return directory / f"{name}.safetensors", record_path
