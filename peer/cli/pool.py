"""``privfusion pool``: train a pool of DP-SGD models, list a pool.

    privfusion pool train --site DIR --data FILE --label COL --public FILE [--pool NAME] [--model noise=2,clip=1 ...]
    privfusion pool train --site DIR --from-model NAME --data FILE --label COL --public FILE [--out POOL] ...
    privfusion pool train --dataset digits --out POOL [--model noise=2,clip=1 ...] [--json]
    privfusion pool add --site DIR --name NAME --factory MODULE:FUNCTION --weights FILE --history FILE.json
    privfusion pool list --pool POOL [--json]

On a site's own records (``--data``): the records are split into the protected training
records DP-SGD sees (the unit of privacy is one of them) and a held-out part that only reports
accuracy here. The preprocessing must not depend on the protected records (the guarantee is
for one record given the preprocessing): it is fitted on public records (``--public FILE``) or
given (``--preprocessing JSON``), and stored with every model of the pool. The dataset size n
of DP-SGD — the public constant of the update's denominator — is, under replace-one, the
number of training records (public in that neighbourhood); it is printed and recorded. The
adjacency is ``--adjacency``, else the unit of ``--site``'s ``[policy.data]`` budget (a site
made by ``privfusion site new``: add-remove), else replace-one (:func:`pool_adjacency`). Under
add-remove that number is private (neighbouring datasets differ in it), so n
is the count the operator declares (``--declared-records N``, else ``[site] declared_records``
of the site's site.toml; refused when neither is given), and no output, record or metadata
of the pool states the true count (:func:`_public_description`). With
``--from-model NAME`` the pool is of the site's own imported network (DIR/own_models/NAME),
trained as the bundled ``--from-model`` path trains it (:func:`_train_imported`) on records read,
split and prepared exactly as above; :func:`peer.nn.imported.records_fit_network` says how records become the
network's inputs. The bundled ``--dataset`` path stays for demonstrations.

Each step's privatised gradient goes to plain SGD by default; ``--optimizer momentum|adam`` (every
model) or ``optimizer=...`` in one ``--model`` (with its constants ``momentum=``, ``beta1=``,
``beta2=``, ``eps=``) feeds it to heavy-ball momentum or Adam instead: post-processing of the same
Gaussian releases, so each model's ε is unchanged; its training record names the optimiser.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from peer.base.errors import InvalidArgument

# Three models with different (C, σ), from the least private (ε ≈ 9.6 at δ = 1e-5, T = 60,
# replace-one) to the most private (ε ≈ 1.2).
DEFAULT_MODELS = ("name=dpsgd-a,noise=8,clip=2", "name=dpsgd-b,noise=20,clip=1", "name=dpsgd-c,noise=50,clip=0.5")
DEFAULT_ARCHITECTURE = '{"kind": "mlp", "hidden": []}'  # logistic regression
# the optimiser's public constants (peer.dp.accounting.Optimizer): momentum for "momentum";
# beta1, beta2, eps for "adam"
OPTIMIZER_KEYS = {"momentum": float, "beta1": float, "beta2": float, "eps": float}
SPEC_KEYS = {
    "name": str,
    "noise": float,
    "clip": float,
    "lr": float,
    "steps": int,
    "q": float,
    "optimizer": str,
    **OPTIMIZER_KEYS,
}


def parse_model_spec(spec: str, defaults: dict, index: int) -> tuple[str, dict]:
    """ "noise=2,clip=1[,lr=..][,steps=..][,q=..][,optimizer=sgd|momentum|adam][,momentum=..]
    [,beta1=..][,beta2=..][,eps=..][,name=..]" -> (name, hyperparameters)."""
    values = dict(defaults)
    name = f"dpsgd-{index}"
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, raw = part.partition("=")
        if not sep or key not in SPEC_KEYS:
            raise InvalidArgument(
                f"model[{index}]", f"entries are key=value with keys {sorted(SPEC_KEYS)}, got {part!r}"
            )
        try:
            value = SPEC_KEYS[key](raw)
        except ValueError:
            raise InvalidArgument(
                f"model[{index}].{key}", f"must be a {SPEC_KEYS[key].__name__}, got {raw!r}"
            ) from None
        if key == "name":
            name = value
        else:
            values[key] = value
    if "noise" not in values or "clip" not in values:
        raise InvalidArgument(f"model[{index}]", "needs noise=SIGMA and clip=C")
    return name, values


def _architecture(text: str, splits) -> dict:
    try:
        arch = json.loads(text)
    except ValueError as e:
        raise InvalidArgument("architecture", f"is not valid JSON: {e}") from None
    if not isinstance(arch, dict):
        raise InvalidArgument("architecture", "must be a JSON object")
    arch = dict(arch)
    if arch.get("kind") == "mlp":
        arch.setdefault("input_dim", int(splits.x_train.shape[1]))
    elif arch.get("kind") == "cnn" and splits.dataset == "digits":
        arch.setdefault("input_shape", [1, 8, 8])
    arch.setdefault("output_dim", splits.num_classes)
    return arch


def pool_adjacency(args: argparse.Namespace) -> str:
    """The pool's adjacency: ``--adjacency``, else the unit of the data budget of ``--site DIR``'s
    site.toml (``[policy.data] unit``: the only unit that site's ledger charges its merges to, so
    a pool trained in another would never be served), else replace-one."""
    if args.adjacency is not None:
        return args.adjacency
    config = Path(args.site) / "site.toml" if getattr(args, "site", None) is not None else None
    if config is not None and config.is_file() and _has_policy(config):
        from peer.budget.policy import Policy

        data = Policy.from_toml(config).data
        if data is not None:
            return data.unit.removeprefix("record:")
    return "replace-one"


def _has_policy(config: Path) -> bool:
    """Whether site.toml has a ``[policy]`` table (a site made by hand may have none: its pools
    then default to replace-one, as before budgets were read here)."""
    import tomllib

    try:
        return "policy" in tomllib.loads(config.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return True  # let the policy reader report the file's own error, with its line


def declared_records(args: argparse.Namespace) -> int | None:
    """The pool's declared n: ``--declared-records``, else (add-remove only) ``[site]
    declared_records`` of ``--site DIR``'s site.toml; None under replace-one without a flag (the
    true count is public there). Add-remove with neither is refused, naming both."""
    if args.declared_records is not None:
        if args.declared_records < 1:
            raise InvalidArgument("--declared-records", f"must be a positive integer, got {args.declared_records}")
        return args.declared_records
    if args.adjacency != "add-remove":
        return None
    if args.site is not None and (Path(args.site) / "site.toml").is_file():
        from peer.net.site import SiteConfig

        declared = SiteConfig.load(Path(args.site) / "site.toml").declared_records
        if declared is not None:
            return declared
    from peer.dp.training import ADD_REMOVE_NEEDS_DECLARED

    raise InvalidArgument("--declared-records", ADD_REMOVE_NEEDS_DECLARED)


#: The counts of a site's records description (``peer.nn.tables.prepare_records``): under
#: add-remove any two of them give the true number of training records
RECORD_COUNTS = ("rows", "training_rows", "validation_rows")


def _public_description(description: dict, adjacency: str) -> dict:
    """What a pool stores and prints about its records: the description, without its record
    counts under add-remove (they are private there)."""
    if adjacency != "add-remove":
        return dict(description)
    return {k: v for k, v in description.items() if k not in RECORD_COUNTS}


def _size_text(n: int, declared: int | None, adjacency: str) -> str:
    if declared is None:
        return f"declared dataset size n = {n} (public; the unit of privacy is one training record, {adjacency})"
    return (
        f"declared dataset size n = {declared} (public, declared; the unit of privacy is one training record, "
        f"{adjacency}: the true count is not used and not recorded)"
    )


def train(args: argparse.Namespace) -> int:
    from peer.nn.architectures import torch_threads

    args.adjacency = pool_adjacency(args)
    if args.from_model is not None:
        if args.site is None:
            raise InvalidArgument("--from-model", "needs --site DIR, whose own_models/ holds the imported network")
        if args.architecture is not None:
            raise InvalidArgument(
                "--architecture", "the network of a --from-model pool is the imported one; give one of them"
            )
    if args.data is not None:
        if args.dataset is not None:
            raise InvalidArgument("--dataset", "give a bundled dataset or the site's own records (--data), not both")
        from peer.nn.images import is_image_source

        if args.label is None and not is_image_source(args.data):  # an image folder's label is its class folder
            raise InvalidArgument("--label", "is required with --data")
        if args.from_model is None and (args.site is None) == (args.out is None):
            raise InvalidArgument(
                "--site", "give the site's directory (--site) or a pool directory (--out), one of them"
            )
        with torch_threads(1):
            return _train_records(args)
    for flag in ("label", "features", "preprocessing", "public", *(() if args.from_model else ("site",))):
        if getattr(args, flag):
            raise InvalidArgument(f"--{flag}", "belongs with the site's own records (--data)")
    if args.out is None:
        raise InvalidArgument("--out", "is required with a bundled --dataset")
    args.dataset = args.dataset or "digits"
    with torch_threads(1):
        return _train(args)


def _warm_profiles(directory) -> None:
    """Build the pool's privacy profiles (PLDs + RDP curves) now and cache them on disk beside the
    pool (``peer.dp.pools.warm_pool_profiles``): a daemon that loads the pool, and the first merge
    it answers, then read them instead of composing T steps (a T = 10,000 Poisson model takes
    ~0.3 s to build; a cached one loads in milliseconds)."""
    from peer.dp.pools import load_pool, warm_pool_profiles

    warm_pool_profiles(load_pool(directory), directory)


def _specs(args: argparse.Namespace):
    from peer.dp.accounting import TrainingRecord

    defaults = {"lr": args.learning_rate, "steps": args.steps, "q": args.sample_rate, "optimizer": args.optimizer}
    specs = [parse_model_spec(s, defaults, i) for i, s in enumerate(args.model or DEFAULT_MODELS)]
    names = [n for n, _ in specs]
    if len(set(names)) != len(names):
        raise InvalidArgument("model", f"names must be distinct, got {names}")
    trainings = [
        TrainingRecord.constant(
            args.adjacency, v["steps"], v["lr"], v["clip"], v["noise"], v["q"], optimizer=_optimizer(v, i)
        )
        for i, (_, v) in enumerate(specs)
    ]
    return names, trainings


def _optimizer(values: dict, index: int):
    """The model's optimiser (post-processing of each step's privatised gradient: its ε is the
    same whatever it is), errors naming the model's entry (``model[1].beta2``)."""
    from peer.dp.accounting import Optimizer

    name = values.get("optimizer", "sgd")
    try:
        return Optimizer(name, tuple((k, values[k]) for k in OPTIMIZER_KEYS if k in values))
    except InvalidArgument as e:
        raise InvalidArgument(f"model[{index}].{e.field.removeprefix('optimizer.')}", e.rule) from None


def _train_records(args: argparse.Namespace) -> int:
    from peer.base.rng import make_randomness
    from peer.cli.model import architecture_arg, records_from_args, site_paths
    from peer.dp.pools import save_trained
    from peer.nn.architectures import accuracy, model_from_arrays

    if args.out is None:
        pool_name, directory = site_paths(args.site).pool(args.pool)
    else:
        pool_name, directory = args.pool or "pool", args.out
    if not args.public and not args.preprocessing:
        raise InvalidArgument(
            "--public",
            "a DP pool's preprocessing must not come from its protected records (their means, "
            "category lists and classes would change with one record and travel inside every "
            "released model, outside the guarantee): give --public FILE, public records with "
            "the same columns to fit it on, or --preprocessing JSON",
        )
    names, trainings = _specs(args)
    taken = [n for n in names if (Path(directory) / f"{n}.json").exists()]
    if taken and not args.force:
        raise InvalidArgument(
            "--model", f"models {taken} are already in the pool {str(directory)!r}; give other names or --force"
        )
    own = None
    if args.from_model is not None:  # the site's own network: refused by name before reading any record
        from peer.cli.model_import import OWN_MODELS
        from peer.nn.imported import load_imported

        own = load_imported(Path(args.site) / OWN_MODELS, args.from_model)
    records = records_from_args(args)
    prep = records.preprocessing
    from peer.nn.tables import refuse_preprocessing_of

    refuse_preprocessing_of(
        prep,
        records.description["sha256"],
        records.description["file"],
        "--preprocessing",
        "fit one on public records (--public FILE)",
    )
    if own is not None:
        from peer.nn.imported import records_fit_network

        shaped = records_fit_network(own.structure, prep, args.data, args.from_model)
    else:
        arch = architecture_arg(args.architecture, None, prep, [])
    declared = declared_records(args)
    n = len(records.y_train)
    if declared is None:
        print(
            f"DP-SGD on {n} training records of {records.description['file']} "
            f"({records.description['validation_rows']} held out): {_size_text(n, None, args.adjacency)}",
            file=sys.stderr,
        )
    else:
        print(
            f"DP-SGD on the training records of {records.description['file']}: "
            f"{_size_text(n, declared, args.adjacency)}",
            file=sys.stderr,
        )
    description = _public_description(records.description, args.adjacency)
    if own is not None:
        print(f"inputs of {args.from_model}: {shaped}", file=sys.stderr)
        return _train_imported_records(
            args, own, records, names, trainings, pool_name, directory, declared, description
        )
    randomness = make_randomness(args.seed)
    models = _train_pool_with_progress(
        args, arch, records.x_train, records.y_train, trainings, randomness, declared, pool_name
    )
    summary = []
    for name, model in zip(names, models, strict=True):
        module = model_from_arrays(model.architecture, model.arrays)
        val = accuracy(model.architecture, module, records.x_val, records.y_val)
        save_trained(directory, name, model, accuracy=val, data=description, preprocessing=prep)
        summary.append(_trained_summary(name, model, val))
    out = {
        "pool": str(directory),
        "pool_name": pool_name,
        "data": description,
        "architecture": arch,
        "init_seed": args.init_seed,
        "dataset_size": models[0].dataset_size,
        "dataset_size_source": models[0].record.parameters["dataset_size_source"],
        "input_width": prep.width,
        "classes": list(prep.classes),
        **randomness.record_fields(),
        "models": summary,
    }
    _warm_profiles(directory)
    _emit(out, args.json)
    if not args.json:
        print(
            f"pool {pool_name} in {directory}: declared dataset size n = {models[0].dataset_size}; preprocessing stored with "
            f"every model. Validation accuracy is on the held-out part of the site's own records (site-local); "
            f"merges are judged on a public validation file (privfusion probe make --label {prep.label} --pool {pool_name})"
        )
    return 0


def _train_pool_with_progress(args, arch, x_train, y_train, trainings, randomness, declared, name) -> list:
    """``train_pool`` on the command's records, with a bar counting every model's DP-SGD steps
    (none with ``--json`` or off a terminal: ``peer.base.progress``)."""
    from peer.base.progress import progress_bar
    from peer.dp.training import train_pool

    with progress_bar(sum(len(t.steps) for t in trainings), f"DP-SGD pool {name}", "steps", quiet=args.json) as step:
        return train_pool(
            arch,
            x_train,
            y_train,
            trainings,
            init_seed=args.init_seed,
            randomness=randomness,
            delta=args.delta,
            dataset_size=declared,
            progress=step,
        )


def _train(args: argparse.Namespace) -> int:
    from peer.base.rng import make_randomness
    from peer.dp.pools import load_splits, save_trained
    from peer.nn.architectures import accuracy, model_from_arrays

    splits = load_splits(args.dataset, split_seed=args.split_seed, validation_fraction=args.validation_fraction)
    if args.from_model is not None:
        return _train_imported(args, splits)
    arch = _architecture(args.architecture or DEFAULT_ARCHITECTURE, splits)
    names, trainings = _specs(args)
    declared = declared_records(args)
    randomness = make_randomness(args.seed)
    models = _train_pool_with_progress(
        args, arch, splits.x_train, splits.y_train, trainings, randomness, declared, args.out
    )
    summary = []
    for name, model in zip(names, models, strict=True):
        module = model_from_arrays(model.architecture, model.arrays)
        val = accuracy(model.architecture, module, splits.x_val, splits.y_val)
        test = accuracy(model.architecture, module, splits.x_test, splits.y_test)
        save_trained(args.out, name, model, accuracy=val, data=splits.description)
        summary.append({**_trained_summary(name, model, val), "test_accuracy": test})
    out = {
        "pool": str(args.out),
        "dataset": args.dataset,
        "architecture": arch,
        "init_seed": args.init_seed,
        "dataset_size": models[0].dataset_size,
        "dataset_size_source": models[0].record.parameters["dataset_size_source"],
        **randomness.record_fields(),
        "models": summary,
    }
    _warm_profiles(args.out)
    _emit(out, args.json)
    return 0


def _train_imported(args: argparse.Namespace, splits) -> int:
    """``--from-model NAME``: a pool of the site's own network (DIR/own_models/NAME), trained by
    DP-SGD from the factory's public initialisation (``--init-seed``), never from the imported
    weights (they were trained outside any guarantee); in eval mode, BatchNorm normalising by
    statistics of the public validation split (``peer.dp.training.check_private_training`` and
    ``train_dpsgd_module`` say why)."""
    from peer.base.progress import progress_bar
    from peer.base.rng import make_randomness
    from peer.cli.model_import import OWN_MODELS
    from peer.dp.pools import save_trained
    from peer.dp.training import train_dpsgd_module
    from peer.nn.imported import (
        imported_architecture,
        load_factory,
        load_imported,
        module_accuracy,
        module_from_arrays,
    )

    own = load_imported(Path(args.site) / OWN_MODELS, args.from_model)
    factory = load_factory(own.factory, [args.site])
    arch = imported_architecture(own.structure)
    names, trainings = _specs(args)
    if len({t.adjacency for t in trainings}) > 1:
        raise InvalidArgument("trainings", "one pool has one unit of privacy")
    declared = declared_records(args)
    randomness = make_randomness(args.seed)
    models = []
    summary = []
    with progress_bar(
        sum(len(t.steps) for t in trainings), f"DP-SGD pool {args.out}", "steps", quiet=args.json
    ) as step:
        for name, training in zip(names, trainings, strict=True):
            model = train_dpsgd_module(
                factory,
                arch,
                own.structure.input_shape,
                splits.x_train,
                splits.y_train,
                training,
                init_seed=args.init_seed,
                randomness=randomness.spawn(),
                delta=args.delta,
                dataset_size=declared,
                progress=step,
                # the held-out validation split is public here (it judges merges): BatchNorm
                # normalises by its statistics, measured before every step
                public_x=splits.x_val,
            )
            models.append(model)
            module = module_from_arrays(factory, own.structure, model.arrays)
            val = module_accuracy(module, own.structure, splits.x_val, splits.y_val)
            test = module_accuracy(module, own.structure, splits.x_test, splits.y_test)
            save_trained(args.out, name, model, accuracy=val, data=splits.description, factory=own.factory)
            summary.append({**_trained_summary(name, model, val), "test_accuracy": test})
    out = {
        "pool": str(args.out),
        "dataset": args.dataset,
        "from_model": args.from_model,
        "architecture": {"kind": arch["kind"], "structure_sha256": arch["structure_sha256"]},
        "init_seed": args.init_seed,
        "dataset_size": models[0].dataset_size,
        "dataset_size_source": models[0].record.parameters["dataset_size_source"],
        **randomness.record_fields(),
        "models": summary,
    }
    _emit(out, args.json)
    return 0


def _train_imported_records(args, own, records, names, trainings, pool_name, directory, declared, description) -> int:
    """``--from-model NAME --data FILE``: the pool of the site's own network on the site's own
    records. The training and its record are those of :func:`_train_imported` (DP-SGD from the
    factory's public initialisation, eval mode, ``peer.dp.training.train_dpsgd_module``); the
    records, split and preprocessing those of :func:`_train_records`. BatchNorm normalises by
    statistics of the public records (``--public FILE``, prepared by the pool's preprocessing),
    measured before every step; with a given preprocessing and no public file they stay at
    their initial values (the record says which)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    from peer.base.progress import progress_bar
    from peer.base.rng import make_randomness
    from peer.dp.pools import save_trained
    from peer.dp.training import train_dpsgd_module
    from peer.nn.imported import imported_architecture, load_factory, module_accuracy, module_from_arrays

    factory = load_factory(own.factory, [args.site])
    structure = own.structure
    arch = imported_architecture(structure)
    prep = records.preprocessing
    public_x = None
    if args.public:
        public_x, _ = prep.transform(prep.read(args.public, labelled=False))
    elif any(isinstance(m, _BatchNorm) for m in module_from_arrays(factory, structure).modules()):
        print(
            f"{args.from_model} has BatchNorm and no public records were given (--public): its statistics stay "
            "at their initial values (mean 0, variance 1) in every step",
            file=sys.stderr,
        )
    randomness = make_randomness(args.seed)
    models = []
    with progress_bar(
        sum(len(t.steps) for t in trainings), f"DP-SGD pool {pool_name}", "steps", quiet=args.json
    ) as step:
        for training in trainings:
            models.append(
                train_dpsgd_module(
                    factory,
                    arch,
                    structure.input_shape,
                    records.x_train,
                    records.y_train,
                    training,
                    init_seed=args.init_seed,
                    randomness=randomness.spawn(),
                    delta=args.delta,
                    dataset_size=declared,
                    progress=step,
                    public_x=public_x,
                )
            )
    summary = []
    for name, model in zip(names, models, strict=True):
        module = module_from_arrays(factory, structure, model.arrays)
        val = module_accuracy(module, structure, records.x_val, records.y_val)
        save_trained(directory, name, model, accuracy=val, data=description, preprocessing=prep, factory=own.factory)
        summary.append(_trained_summary(name, model, val))
    out = {
        "pool": str(directory),
        "pool_name": pool_name,
        "data": description,
        "from_model": args.from_model,
        "architecture": {"kind": arch["kind"], "structure_sha256": arch["structure_sha256"]},
        "input_shape": list(structure.input_shape),
        "init_seed": args.init_seed,
        "dataset_size": models[0].dataset_size,
        "dataset_size_source": models[0].record.parameters["dataset_size_source"],
        "input_width": prep.width,
        "classes": list(prep.classes),
        "norm_statistics": "public records" if public_x is not None else "initial values",
        **randomness.record_fields(),
        "models": summary,
    }
    _warm_profiles(directory)
    _emit(out, args.json)
    if not args.json:
        print(
            f"pool {pool_name} of {args.from_model} in {directory}: declared dataset size n = {models[0].dataset_size}; "
            "preprocessing stored with every model. Validation accuracy is on the held-out part of the site's own "
            f"records (site-local); merges are judged on a public validation file (privfusion probe make --label "
            f"{prep.label} --pool {pool_name})"
        )
    return 0


def add(args: argparse.Namespace) -> int:
    from peer.nn.architectures import torch_threads

    with torch_threads(1):
        return _add(args)


def _add(args: argparse.Namespace) -> int:
    """``pool add``: a network trained by DP-SGD elsewhere (Opacus, or any loop that keeps the
    same history) into a pool, as an imported model with the TrainingRecord of its declared
    history (``peer.dp.history``, ``docs/pool_add.md``). Nothing is trained and nothing leaves:
    the model is charged like every pool model when a release (the model, an RS or LC merge)
    is made from the pool. Refused, by field, before anything is written: a history that cannot
    be accounted, a network whose permutation structure cannot be proven, a network holding
    buffers (state the DP-SGD history does not cover)."""
    from peer.cli.model import read_preprocessing, site_paths
    from peer.cli.model_import import _input_shape
    from peer.dp.accounting.profiles import check_accountable
    from peer.dp.accounting.release_accounting import dpsgd_record
    from peer.dp.history import read_history
    from peer.dp.training import _UPDATES
    from peer.nn.imported import (
        build_module,
        imported_architecture,
        load_factory,
        load_site_state,
        read_weights,
        resolve_factory,
        save_imported,
    )
    from peer.nn.store import check_name
    from peer.nn.tracing import import_structure

    check_name(args.name, "--name")
    try:
        raw = json.loads(Path(args.history).read_text(encoding="utf-8"))
    except OSError as e:
        raise InvalidArgument("--history", f"{args.history!r} cannot be read: {e.strerror}") from None
    except ValueError as e:
        raise InvalidArgument("--history", f"{args.history!r} is not valid JSON: {e}") from None
    try:
        declared = read_history(raw)
    except InvalidArgument as e:
        raise InvalidArgument(f"{args.history}: {e.field}", e.rule) from None
    training = declared.training
    check_accountable(training)  # a record too weak to cost is refused before anything is stored
    pool_name, directory = site_paths(args.site).pool(args.pool)
    if (Path(directory) / f"{args.name}.json").exists() and not args.force:
        raise InvalidArgument(
            "--name", f"model {args.name!r} is already in the pool {str(directory)!r}; give another name or --force"
        )
    module = build_module(load_factory(args.factory, [args.site]), args.factory)
    load_site_state(module, read_weights(args.weights))
    parameters = {k for k, _ in module.named_parameters()}
    buffers = [k for k in module.state_dict() if k not in parameters]
    if buffers:
        raise InvalidArgument(
            f"{args.weights}: {buffers[0]}",
            f"the network holds {len(buffers)} buffer(s) (e.g. BatchNorm running statistics): state computed from "
            "the training records outside the DP-SGD history, so no guarantee covers it (Opacus refuses BatchNorm "
            "for this reason; ModuleValidator.fix replaces it by GroupNorm)",
        )
    structure = import_structure(module, _input_shape(args, module))
    arch = imported_architecture(structure)
    prep = read_preprocessing(args.preprocessing) if args.preprocessing else None
    record = dpsgd_record(training, args.delta, randomness={"randomness": "none", "seed": None}, subject=args.name)
    params = record.to_dict()["parameters"]
    params.update(
        {
            "dataset_size": declared.dataset_size,
            # the history file's n is the site's declaration, published in the record: under
            # add-remove it must be a public constant (docs/pool_add.md), never a count read here
            "dataset_size_source": "declared",
            "architecture": arch,
            "update": _UPDATES[training.optimizer.name],
            "trained_elsewhere": declared.declared,
        }
    )
    record = record.with_(parameters=params)
    arrays = {k: v.detach().cpu().numpy() for k, v in module.state_dict().items()}
    metadata = {
        "training": training.to_dict(),
        "record": record.to_dict(),
        "source": Path(args.weights).name,
        "trained_elsewhere": declared.declared,
    }
    path = save_imported(directory, args.name, resolve_factory(args.factory), structure, arrays, metadata, prep)
    _warm_profiles(directory)
    out = {
        "pool": str(directory),
        "pool_name": pool_name,
        "model": args.name,
        "path": str(path),
        "dataset_size": declared.dataset_size,
        "training": training.to_dict(),
        "epsilon": {"pld": record.epsilon, "rdp": params["epsilon_rdp"]},
        "delta": record.delta,
        "unit": record.unit,
        "trained_elsewhere": declared.declared,
    }
    if args.json:
        json.dump(out, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
        return 0
    print(
        f"added {args.name} to pool {pool_name} ({directory}): {training.num_steps} DP-SGD steps in "
        f"{len(training.runs)} segment(s) as declared by {args.history}; epsilon(pld)={record.epsilon:.4g} "
        f"(rdp {params['epsilon_rdp']:.4g}) at delta={record.delta:g} per {record.unit}; declared dataset size "
        f"n = {declared.dataset_size}. Charged like every pool model when a release is made from the pool."
    )
    return 0


def list_pool(args: argparse.Namespace) -> int:
    """Each model's guarantee and validation accuracy, where its noise came from, and why a
    daemon would not serve it (``not_served``: a fixed seed outside ``--simulation``, or an
    add-remove model that states its true record count: ``peer.net.daemon.check_servable``)."""
    from peer.dp.pools import load_pool, true_count_models

    pool = load_pool(args.pool)
    stated = set(true_count_models(pool))
    rows = []
    for m in pool:
        record = m.metadata.get("record", {})
        why = []
        if record.get("randomness") == "fixed-seed":
            why.append(f"trained with a fixed seed ({record.get('seed')}): served only by a --simulation daemon")
        if m.name in stated:
            why.append("add-remove with its true record count as denominator: not served (retrain it)")
        rows.append(
            {
                "name": m.name,
                "privacy": m.privacy.to_dict(),
                "epsilon": record.get("epsilon"),
                "delta": record.get("delta"),
                "validation_accuracy": m.metadata.get("accuracy"),
                "randomness": record.get("randomness"),
                **({"not_served": why} if why else {}),
            }
        )
    _emit({"pool": str(args.pool), "models": rows}, args.json)
    return 0


def _emit(out: dict, as_json: bool) -> None:
    if as_json:
        json.dump(out, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
        return
    for row in out["models"]:
        eps = row["epsilon"]
        eps_text = (
            f"epsilon(pld)={eps['pld']:.4g} (rdp {eps['rdp']:.4g})" if isinstance(eps, dict) else f"epsilon={eps}"
        )
        acc = row.get("validation_accuracy")
        print(
            f"{row['name']}: {eps_text} delta={row['delta']:g}"
            + ("" if acc is None else f" validation accuracy={acc:.4f}")
            + "".join(f"; {why}" for why in row.get("not_served", ()))
        )


def register(subparsers) -> None:
    from peer.cli.model import add_record_options

    pool = subparsers.add_parser("pool", help="train or list a pool of DP-SGD models")
    sub = pool.add_subparsers(dest="pool_command", metavar="ACTION")
    sub.required = True

    t = sub.add_parser(
        "train",
        help="train DP-SGD models on the site's own records (or a bundled dataset) into a pool",
        description="Train a pool of DP-SGD models from one public initialisation. With --data: on the "
        "site's own records (the dataset size n is the number of training records under replace-one, "
        "the declared --declared-records under add-remove; "
        "the preprocessing is fitted on public records, --public, and stored with every "
        "model). With --dataset: on a bundled scikit-learn set (demonstrations).",
    )
    t.add_argument(
        "--site", metavar="DIR", help="the site's directory: the pool goes where its site.toml says (default DIR/pool)"
    )
    t.add_argument(
        "--pool", metavar="NAME", help="which of the site's pools ([site.pools.NAME]); default: its only one"
    )
    t.add_argument(
        "--dataset",
        default=None,
        choices=("digits", "breast_cancer"),
        help="a bundled dataset (default digits when --data is not given)",
    )
    t.add_argument("--out", help="pool directory (a model store), instead of --site")
    add_record_options(t, required=False)
    t.add_argument(
        "--architecture",
        "--arch",
        default=None,
        help="architecture JSON (peer.nn.architectures); input/output sizes are filled in from the data. Default: logistic regression",
    )
    t.add_argument(
        "--model",
        action="append",
        metavar="SPEC",
        help="one model: noise=SIGMA,clip=C[,lr=ETA][,steps=T][,q=RATE][,optimizer=sgd|momentum|adam]"
        "[,momentum=BETA][,beta1=B1][,beta2=B2][,eps=EPS][,name=NAME]; repeat for several "
        f"(default: {' '.join(DEFAULT_MODELS)})",
    )
    t.add_argument(
        "--from-model",
        metavar="NAME",
        help="train the site's own imported network DIR/own_models/NAME (with --site DIR, on its own records "
        "--data FILE or a bundled --dataset; from the factory's public initialisation, in eval mode, BatchNorm "
        "statistics measured on public records before every step)",
    )
    t.add_argument("--steps", type=int, default=60, help="default steps T per model (default 60)")
    t.add_argument("--learning-rate", type=float, default=4.0, help="default learning rate eta (default 4.0)")
    t.add_argument(
        "--sample-rate", type=float, default=1.0, help="default Poisson sample rate q; 1 = full batch (default)"
    )
    t.add_argument(
        "--optimizer",
        default="sgd",
        choices=("sgd", "momentum", "adam"),
        help="default optimiser fed each step's privatised gradient (post-processing: epsilon is the same; "
        "the record names it): sgd (default), momentum (heavy ball, momentum=0.9) or adam (beta1=0.9, "
        "beta2=0.999, eps=1e-8; give a much smaller lr than sgd's, e.g. 0.01); constants per model in --model",
    )
    t.add_argument(
        "--adjacency",
        default=None,
        choices=("replace-one", "add-remove"),
        help="the unit of privacy (default: the unit of --site's [policy.data] budget, else replace-one)",
    )
    t.add_argument(
        "--declared-records",
        type=int,
        default=None,
        metavar="N",
        help="PUBLIC record count DP-SGD divides by (required under add-remove, where the true count is private; "
        "default there: [site] declared_records of --site's site.toml; under replace-one: the number of training "
        "records)",
    )
    t.add_argument(
        "--delta", type=float, default=1e-5, help="delta at which each model's epsilon is recorded (default 1e-5)"
    )
    t.add_argument("--init-seed", type=int, default=0, help="public seed of the common initialisation (default 0)")
    t.add_argument("--seed", type=int, default=None, help="fixed noise seed (tests/simulations only; default: CSPRNG)")
    t.add_argument("--force", action="store_true", help="replace models of the same names (with --data)")
    t.add_argument("--json", action="store_true", help="print the summary as JSON")
    t.set_defaults(func=train)

    a = sub.add_parser(
        "add",
        help="add a network trained by DP-SGD elsewhere (Opacus) to a pool, with its accountant's history",
        description="Bring a network trained by DP-SGD outside PrivFusion (Opacus's PrivacyEngine, or any loop "
        "that keeps its (noise_multiplier, sample_rate, steps) history) into a pool as a model with its training "
        "record; it is charged like every pool model when released. The history file's format is in "
        "docs/pool_add.md.",
    )
    a.add_argument(
        "--site", required=True, metavar="DIR", help="the site's directory (the pool is where site.toml says)"
    )
    a.add_argument(
        "--pool", metavar="NAME", help="which of the site's pools ([site.pools.NAME]); default: its only one"
    )
    a.add_argument("--name", required=True, help="the model's name in the pool")
    a.add_argument("--factory", required=True, help="MODULE:FUNCTION or FILE.py:FUNCTION returning the torch.nn.Module")
    a.add_argument(
        "--weights", required=True, help="its state dict: .safetensors, or .pt read with torch.load(weights_only=True)"
    )
    a.add_argument(
        "--history",
        required=True,
        metavar="FILE.json",
        help="the DP-SGD history (docs/pool_add.md; Opacus's accountant.history)",
    )
    a.add_argument(
        "--input-shape",
        type=int,
        nargs="+",
        help="one example's shape without the batch axis (default: a leading Linear's in_features)",
    )
    a.add_argument(
        "--preprocessing",
        metavar="JSON",
        help="the preprocessing of its inputs (a JSON file, or a model manifest holding one)",
    )
    a.add_argument("--delta", type=float, default=1e-5, help="delta at which its epsilon is recorded (default 1e-5)")
    a.add_argument("--force", action="store_true", help="replace a model of the same name")
    a.add_argument("--json", action="store_true", help="print the summary as JSON")
    a.set_defaults(func=add)

    ls = sub.add_parser("list", help="list a pool's models and their guarantees")
    ls.add_argument("--pool", required=True)
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=list_pool)


def _trained_summary(name: str, model, validation_accuracy: float) -> dict:
    """One trained pool model in the command's JSON summary."""
    return {
        "name": name,
        "epsilon": {"pld": model.record.epsilon, "rdp": model.record.parameters["epsilon_rdp"]},
        "delta": model.record.delta,
        "training": model.training.to_dict(),
        "validation_accuracy": validation_accuracy,
    }
