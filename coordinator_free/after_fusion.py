"""After fusion, at the requester only: choose, repair, fine-tune. Nothing here is charged.

A round fuses θ = w_0·θ_R + Σ_j w_j·P_j(θ_j) (``coordinator_free.rounds``). Three optional local
steps follow, each configured in the round file and recorded in the round report:

1. **select** (``[round.select] validation``): candidate fusions — every non-empty subset S of
   the contributions (at most ``MAX_EXHAUSTIVE`` peers; beyond, greedy forward selection) at
   every α of ``alphas`` (weights α for R, (1 − α)/|S| for each kept peer), each repaired as in
   step 2 — are compared by accuracy on a PUBLIC labelled validation set (ties broken by its
   log-loss), and the best is kept; the candidates' validation accuracies and log-losses go
   into the report (public data, public results). The site's own model is scored too, so the
   report says when no fusion beat it. Never the test set; never the site's own training
   records (its own model has seen them, so they would always favour it).
2. **repair** (``[round.repair] data = "own" | "probe"``): REPAIR (``peer.ldp.repair``): every
   hidden unit of the fused network rescaled so that its pre-activation mean and standard
   deviation on the chosen data equal Σ_j w_j·μ_j and Σ_j w_j·σ_j — the endpoints' statistics
   combined with the fusion weights — and BatchNorm statistics reset. The endpoints are R's own
   model and each *received* contribution (a DP release: running it on R's data is
   post-processing), measured on R's own records ("own") or R's public probe set ("probe").
3. **fine-tune** (``[round.finetune] epochs > 0``, off by default): Adam on cross-entropy over
   R's own records, from the repaired (else fused) model; deterministic given the reported seed.

Privacy: R's records never leave R and nothing is released, so no ledger is touched and no
budget spent; the peers' releases are only post-processed. The report stays at R (it is written
to the round's OUT directory and copied into an adopted model's provenance, never sent); it
holds settings, counts, public-data accuracies and, when R's held-out records are the selection
data, accuracies on them (like the own model's validation accuracy its store already keeps;
not differentially private, so the report goes only where R's records may go).

Which model to adopt (:func:`recommend`): the best-scoring of R's own model and every stage run
(own_bn_reset, fused, selected, repaired, fine-tuned) on the **selection data**: the public
validation set when one is configured, else R's own held-out records — the rows its stored
model's training split held out, recovered exactly when the round's raw ``[round.records]`` file
is the file the model was trained on (same SHA-256; the split is re-drawn with the stored
public ``validation_fraction`` and ``split_seed``). Those held-out rows are then kept out of
REPAIR and fine-tuning, which read only the training rows, so no stage has seen them. Ranking:
accuracy, ties broken by log-loss; a stage must beat the own model strictly (ties go to own),
so the recommendation never scores below own on the selection data. Without selection data the
own model is recommended, and the report says why. The report's ``adopt`` names the stage,
``adopt_reason`` the scores it rests on.

Whether the peers changed anything (:func:`fused_vs_own`): the fused model's row-centred logits
are compared with the own model's on the selection data (else the public probe set). When both
make the same prediction on every row and the cosine of the two row-centred logit matrices is
at least ``SAME_AS_OWN_COSINE`` (the fused logits are, up to a per-row shift that softmax
ignores, within a relative residual of sqrt(1 − 0.999²) ≈ 4.5 % of a positive multiple of the
own model's), the report's ``fused_vs_own.same_as_own`` is true: the peers' releases carried no
usable signal at this ε.

Two kinds of model run these steps through one adapter (:class:`ModelKind`): a built-in
architecture (``peer.nn.architectures``, :class:`BuiltIn`) and a site's own imported network
(``peer.nn.imported``, :class:`OwnNetworkKind`: its own module class, its traced permutation
structure; its state keeps the site's key names). For a network with BatchNorm one more
reference is scored: **own_bn_reset**, R's own model with only its BatchNorm running statistics
re-estimated on the repair data (no fusion). Re-estimating them can lift a model by itself (an
own digits ResNet went from 0.907 to 0.987 on a 128-row probe), so "fused + REPAIR beats own"
is only a fair claim against it; the adopt choice considers it like any stage.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from coordinator_free.rounds import RoundConfig, fusion_weights
from peer.base.errors import FailedPrecondition, InvalidArgument
from peer.ldp.fusion import average_arrays
from peer.nn.architectures import build_model, input_tensor, model_from_arrays, predict_proba, state_arrays
from peer.nn.store import StoredModel

#: the cosine of row-centred logits at or above which (with identical predictions on every row)
#: the fused model counts as a positive scaling of the own model (see the module docstring)
SAME_AS_OWN_COSINE = 0.999

#: up to this many contributions every subset is a candidate (2^k − 1 of them); beyond it,
#: greedy forward selection (at most k(k+1)/2 candidates per α)
MAX_EXHAUSTIVE = 4

_POINTS: dict[str, tuple] = {}
_POINTS_LOCK = threading.Lock()


def stat_points_of(arch: Mapping[str, Any], input_shape: Sequence[int]) -> tuple:
    """The REPAIR statistic points of a built-in architecture (``peer.nn.tracing``), traced once per
    architecture and input shape in this process and remembered (they depend on neither weights
    nor data). Why remembered, and traced under a lock: torch.fx replaces ``nn.Module.__call__``
    *process-wide* while it traces, so a forward pass on another thread during a trace is caught
    by the tracer ("module is not installed as a submodule"). A process that runs several sites'
    rounds on threads (the simulator) calls this before starting them."""
    from peer.nn.tracing import derive_structure

    key = json.dumps([arch, list(input_shape)], sort_keys=True, default=str)
    with _POINTS_LOCK:
        if key not in _POINTS:
            _POINTS[key] = tuple(derive_structure(build_model(arch), tuple(input_shape)).stat_points)
        return _POINTS[key]


@dataclass(frozen=True)
class LocalData:
    """What the steps after fusion may read at the requester: its own labelled records (never
    leave it), its public probe set, and an optional public labelled validation set."""

    records: tuple[np.ndarray, np.ndarray] | None
    records_source: str | None
    probe: np.ndarray
    validation: tuple[np.ndarray, np.ndarray] | None = None
    validation_source: str | None = None
    #: R's own held-out records (the split its stored model kept out of training), when known
    heldout: tuple[np.ndarray, np.ndarray] | None = None
    heldout_source: str | None = None

    def selection(self) -> tuple[str, tuple[np.ndarray, np.ndarray], str | None] | None:
        """(kind, (x, y), source) of the data the stages are compared on: the public validation
        set, else R's own held-out records; None when neither exists."""
        if self.validation is not None:
            return "public validation", self.validation, self.validation_source
        if self.heldout is not None:
            return "own held-out records", self.heldout, self.heldout_source
        return None


@dataclass
class AfterFusion:
    """The fused model's later stages (name → arrays; absent when not run) and the report."""

    stages: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)


class ModelKind:
    """What the steps after fusion need of one kind of model: inputs shaped for it, a module
    from arrays and arrays from a module, the weighted average of aligned states, its REPAIR
    statistic points and REPAIR, class probabilities, and a check that a file's rows are its
    inputs. :class:`BuiltIn` and :class:`OwnNetworkKind` are the two kinds."""

    def inputs(self, x):
        raise NotImplementedError

    def module(self, arrays: Mapping[str, np.ndarray]):
        raise NotImplementedError

    def arrays(self, module) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def average(self, ends: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def stat_points(self, x) -> tuple:
        raise NotImplementedError

    def repair(self, fused, endpoints, weights, points, x):
        raise NotImplementedError

    def predict_proba(self, module, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def logits(self, module, x: np.ndarray) -> np.ndarray:
        """The network's outputs (before softmax) on the rows ``x``."""
        raise NotImplementedError

    def check_rows(self, x: np.ndarray, y: np.ndarray, key: str, path: Path, preprocessing=None) -> None:
        """Refuse (InvalidArgument naming ``key``) rows that are not this model's inputs."""

    def repair_notes(self, points) -> dict[str, Any]:
        """Extra facts for the report's ``repair`` entry (none for a built-in architecture)."""
        return {}


@dataclass(frozen=True)
class BuiltIn(ModelKind):
    """A built-in architecture (``peer.nn.architectures``, a JSON description)."""

    arch: Mapping[str, Any]

    def inputs(self, x):
        return input_tensor(self.arch, x)

    def module(self, arrays):
        return model_from_arrays(self.arch, arrays)

    def arrays(self, module):
        return _arrays(module)

    def average(self, ends, weights):
        return average_arrays(ends, weights)

    def stat_points(self, x):
        return stat_points_of(self.arch, tuple(x.shape[1:]))

    def repair(self, fused, endpoints, weights, points, x):
        from peer.ldp.repair import repair_fused

        return repair_fused(fused, endpoints, weights, points, x)

    def predict_proba(self, module, x):
        return predict_proba(self.arch, module, x)

    def logits(self, module, x):
        import torch

        with torch.no_grad():
            return module.eval()(input_tensor(self.arch, x)).numpy()


@dataclass(frozen=True)
class OwnNetworkKind(ModelKind):
    """A site's own network (``peer.nn.imported``): modules built by the site's own factory (its
    code, run only at the site), its traced permutation structure (statistic points: every
    Linear/Conv producing a permutation group, every BatchNorm), its state under its own key
    names. Records become its inputs by the rule of ``privfusion pool train --from-model NAME
    --data FILE`` (``peer.nn.imported.records_fit_network``)."""

    name: str
    factory: Callable[[], Any]
    structure: Any
    preprocessing: Any = None

    def inputs(self, x):
        from peer.nn.imported import input_batch

        return input_batch(self.structure, x)

    def module(self, arrays):
        from peer.nn.imported import module_from_arrays

        return module_from_arrays(self.factory, self.structure, arrays)

    def arrays(self, module):
        # each entry in its own dtype (num_batches_tracked stays an integer), the site's keys
        return {k: np.array(v.detach().cpu().numpy(), copy=True) for k, v in module.state_dict().items()}

    def average(self, ends, weights):
        from peer.ldp.pipeline import average_states

        return average_states(self.structure, ends, weights)

    def stat_points(self, x):
        return tuple(self.structure.stat_points)

    def repair(self, fused, endpoints, weights, points, x):
        from peer.ldp.pipeline import repair_states

        return repair_states(self.structure, fused, endpoints, weights, x)

    def predict_proba(self, module, x):
        import torch

        with torch.no_grad():
            return torch.softmax(module.eval()(self.inputs(x)), dim=1).numpy()

    def logits(self, module, x):
        import torch

        with torch.no_grad():
            return module.eval()(self.inputs(x)).numpy()

    def classes(self) -> int:
        """The width of the network's output (its number of classes), from the factory's own
        initialisation on one zero input."""
        import torch

        from peer.nn.imported import module_from_arrays

        with torch.no_grad():
            out = module_from_arrays(self.factory, self.structure)(torch.zeros(1, *self.structure.input_shape))
        return int(out.shape[-1])

    def check_rows(self, x, y, key, path, preprocessing=None):
        """Raw records (``preprocessing`` given): the rule of ``records_fit_network``. Prepared
        arrays: rows of the network's input shape, or flat rows of its size (reshaped row-major,
        as ``input_batch`` does), or images flattened for a network taking flat rows. Labels:
        integers in [0, classes)."""
        shape = tuple(int(s) for s in self.structure.input_shape)
        size = int(np.prod(shape))
        if preprocessing is not None:
            from peer.nn.imported import records_fit_network

            try:
                records_fit_network(self.structure, preprocessing, str(path), self.name)
            except InvalidArgument as e:
                raise InvalidArgument(key, f"{e.field}: {e.rule}") from None
        else:
            rows = tuple(int(s) for s in np.shape(x)[1:])
            fits = rows == shape or rows == (size,) or (len(shape) == 1 and int(np.prod(rows)) == size)
            if not fits:
                raise InvalidArgument(
                    key,
                    f"{str(path)!r}: x holds rows of shape {list(rows)} but the network {self.name!r} takes "
                    f"{list(shape)} ({size} entries): give rows of that shape, or flat rows of {size} entries",
                )
        classes = self.classes()
        bad = np.flatnonzero((np.asarray(y) < 0) | (np.asarray(y) >= classes))
        if len(bad):
            raise InvalidArgument(
                key,
                f"{str(path)!r}: row {int(bad[0])} has label {int(np.asarray(y)[bad[0]])}, but the network "
                f"{self.name!r} has {classes} outputs (labels 0..{classes - 1})",
            )

    def repair_notes(self, points):
        return {
            "batchnorm_reset": [p.module for p in points if p.kind == "batchnorm"],
            "renormalised": [p.module for p in points if p.kind == "affine"],
        }


def enabled(config: RoundConfig) -> bool:
    return config.repair != "off" or config.finetune_epochs > 0 or config.select_validation is not None


def load_local_data(
    config: RoundConfig, model: StoredModel, probe: np.ndarray, kind: ModelKind | None = None
) -> LocalData:
    """Read the files the steps after fusion need, before the round asks anyone for anything
    (a bad file then costs nobody budget). Errors name the round key. ``kind`` (default: the
    built-in architecture, whose rows are not checked here) checks that the rows are the
    model's inputs and, for a site's own network, that the labels are its outputs."""
    from peer.dp.pools import load_validation_file

    records = source = heldout = hsource = None
    if config.records is not None:
        path = Path(config.records)
        if config.records_prepared:
            try:
                records = load_validation_file(path)
            except InvalidArgument as e:
                raise InvalidArgument("round.records.path", e.rule) from None
        else:
            prep = model.preprocessing
            if prep is None:
                raise FailedPrecondition(
                    f"round.records: the model {model.name!r} stores no preprocessing, so the raw records "
                    f"{str(path)!r} cannot be prepared; give prepared x/y arrays with prepared = true"
                )
            try:
                table = prep.read(path)
                trained_on = _training_split(model, table)
                if trained_on is None:
                    records = prep.transform(table)
                else:
                    rest, held = trained_on
                    records = prep.transform(rest)
                    heldout = prep.transform(held)
                    hsource = f"{path.name} (the {len(held)} rows the training split of {model.name!r} held out)"
            except InvalidArgument as e:
                raise InvalidArgument("round.records.path", f"{e.field}: {e.rule}") from None
        if len(records[1]) == 0:
            raise InvalidArgument("round.records.path", f"{str(path)!r} holds no records")
        if kind is not None:
            prep = None if config.records_prepared else model.preprocessing
            kind.check_rows(records[0], records[1], "round.records.path", path, prep)
        source = path.name
    validation = vsource = None
    if config.select_validation is not None:
        try:
            validation = load_validation_file(config.select_validation)
        except InvalidArgument as e:
            raise InvalidArgument("round.select.validation", e.rule) from None
        if kind is not None:
            kind.check_rows(validation[0], validation[1], "round.select.validation", Path(config.select_validation))
        vsource = Path(config.select_validation).name
    return LocalData(records, source, np.asarray(probe), validation, vsource, heldout, hsource)


def _training_split(model: StoredModel, table):
    """(training rows, held-out rows) of ``table`` when it is the very file ``model`` was trained
    on (``privfusion model train`` stores the file's SHA-256 and the public split parameters in
    the model's ``data``): the split re-drawn exactly as training drew it. None otherwise."""
    data = (model.metadata or {}).get("data")
    if not isinstance(data, Mapping):
        return None
    if data.get("sha256") != getattr(table, "digest", None) or "validation_fraction" not in data:
        return None
    if data.get("rows") != len(table) or not hasattr(table, "split"):
        return None
    return table.split(float(data["validation_fraction"]), seed=int(data.get("split_seed", 0)))


def _arrays(module) -> dict[str, np.ndarray]:
    return state_arrays(module)


def _subsets(names: Sequence[str]):
    for k in range(1, len(names) + 1):
        yield from itertools.combinations(names, k)


def after_fusion(
    arch: Mapping[str, Any],
    own: Mapping[str, np.ndarray],
    contributions: Mapping[str, Mapping[str, np.ndarray]],
    fused: Mapping[str, np.ndarray],
    config: RoundConfig,
    data: LocalData,
    seed: int,
    kind: ModelKind | None = None,
) -> AfterFusion:
    """Steps 1–3 of the module docstring on the round's fusion ``fused`` of ``own`` and the
    aligned ``contributions`` (peer → arrays, in contribution order) at ``config.alpha``;
    ``kind`` says how to run the model (default: the built-in architecture ``arch``)."""
    import torch

    from peer.ldp.repair import fine_tune, repair

    kind = kind if kind is not None else BuiltIn(arch)
    started = time.monotonic()
    out = AfterFusion()
    rep: dict[str, Any] = {}
    x_repair = None
    if config.repair != "off":
        x_np = data.records[0] if config.repair == "own" else data.probe
        x_repair = kind.inputs(x_np)
        rep["repair"] = {"data": config.repair, "examples": len(x_np)}
    points = ()
    if x_repair is not None:
        points = kind.stat_points(x_repair)
    batchnorms = [p for p in points if p.kind == "batchnorm"]
    own_bn_reset = None
    if batchnorms:
        # the fair reference for a network with BatchNorm: our own model with only its running
        # statistics re-estimated on the same data (no fusion; see the module docstring)
        own_bn_reset = kind.arrays(repair(kind.module(own), batchnorms, {}, x_repair))
        rep["own_bn_reset"] = {
            "data": config.repair,
            "examples": int(x_repair.shape[0]),
            "batchnorm_reset": [p.module for p in batchnorms],
        }

    def candidate(kept: Sequence[str], alpha: float) -> tuple[dict[str, np.ndarray], list[float]]:
        weights = fusion_weights(alpha, len(kept))
        ends = [own, *(contributions[n] for n in kept)]
        arrays = kind.average(ends, weights)
        if x_repair is None or not points or not kept:
            return arrays, weights
        with torch.no_grad():
            repaired = kind.repair(
                kind.module(arrays),
                [kind.module(e) for e in ends],
                weights,
                points,
                x_repair,
            )
        return kind.arrays(repaired), weights

    def score_on(arrays, xy) -> tuple[float, float]:
        """(accuracy, mean log-loss) on the labelled rows ``xy``."""
        x, y = xy
        with torch.no_grad():
            p = kind.predict_proba(kind.module(arrays), x)
        acc = float(np.mean(p.argmax(axis=1) == y))
        return acc, float(-np.mean(np.log(np.clip(p[np.arange(len(y)), y], 1e-12, None))))

    def score(arrays) -> tuple[float, float]:
        """(accuracy, mean log-loss) on the public validation set."""
        return score_on(arrays, data.validation)

    def rank(scores: tuple[float, float]) -> tuple[float, float]:
        # accuracy first; with a few dozen public examples it ties often, so the log-loss
        # (continuous) breaks the ties
        return scores[0], -scores[1]

    kept, alpha = list(contributions), config.alpha
    chosen = None
    if data.validation is not None:
        alphas = list(dict.fromkeys(config.select_alphas or (config.alpha,)))
        names = list(contributions)
        tried: list[dict] = []

        def consider(sub: Sequence[str], a: float):
            arrays, _ = candidate(sub, a)
            sc = score(arrays)
            tried.append({"kept": list(sub), "alpha": a, "validation_accuracy": sc[0], "validation_log_loss": sc[1]})
            return sc, arrays

        best = None
        for a in alphas:
            if len(names) <= MAX_EXHAUSTIVE:
                for sub in _subsets(names):
                    sc, arrays = consider(sub, a)
                    if best is None or rank(sc) > rank(best[0]):
                        best = (sc, list(sub), a, arrays)
            else:
                current: list[str] = []
                current_sc = None
                while True:
                    step = None
                    for n in names:
                        if n in current:
                            continue
                        sc, arrays = consider([*current, n], a)
                        if step is None or rank(sc) > rank(step[0]):
                            step = (sc, [*current, n], arrays)
                    if step is None or (current_sc is not None and rank(step[0]) <= rank(current_sc)):
                        break
                    current_sc, current = step[0], step[1]
                    if best is None or rank(step[0]) > rank(best[0]):
                        best = (step[0], step[1], a, step[2])
        best_sc, kept, alpha, chosen = best
        rep["select"] = {
            "validation": data.validation_source,
            "validation_examples": len(data.validation[1]),
            "alphas": alphas,
            "search": "exhaustive" if len(names) <= MAX_EXHAUSTIVE else "greedy forward",
            "ranking": "validation accuracy, ties broken by validation log-loss",
            "candidates": tried,
            "kept": kept,
            "dropped": [n for n in names if n not in kept],
            "alpha": alpha,
            "weights": dict(zip(["(own)", *kept], fusion_weights(alpha, len(kept)), strict=True)),
            "validation_accuracy": best_sc[0],
            "validation_log_loss": best_sc[1],
        }
    if config.repair != "off":
        repaired = chosen if chosen is not None else candidate(kept, alpha)[0]
        rep["repair"].update(
            points=[p.module for p in points],
            units=int(sum(np.shape(own[f"{p.module}.weight"])[0] for p in points if p.kind == "affine")),
            endpoints=len(kept) + 1,
            kept=list(kept),
            alpha=alpha,
            **kind.repair_notes(points),
        )
        out.stages["repaired"] = repaired
    elif chosen is not None:
        out.stages["selected"] = chosen
    if config.finetune_epochs > 0:
        start_stage = next((s for s in ("repaired", "selected") if s in out.stages), "fused")
        start = out.stages.get(start_stage, fused)
        x, y = data.records
        tuned = fine_tune(
            kind.module(start),
            kind.inputs(x),
            y,
            seed=seed,
            epochs=config.finetune_epochs,
            batch_size=config.finetune_batch_size,
            learning_rate=config.finetune_learning_rate,
        )
        out.stages["finetuned"] = kind.arrays(tuned)
        rep["finetune"] = {
            "from": start_stage,
            "records": len(y),
            "epochs": config.finetune_epochs,
            "learning_rate": config.finetune_learning_rate,
            "batch_size": config.finetune_batch_size,
            "seed": seed,
        }
    if data.records is not None:
        rep["records"] = {"file": data.records_source, "count": len(data.records[1])}
    if own_bn_reset is not None:
        out.stages["own_bn_reset"] = own_bn_reset
    if data.heldout is not None:
        rep.setdefault("records", {})["held_out"] = {"file": data.heldout_source, "count": len(data.heldout[1])}
    selection = data.selection()
    scored = None
    if selection is not None:
        what, xy, source = selection
        scored = _stage_scores(out.stages, fused, own, lambda a: score_on(a, xy))
        rep["selection"] = {"data": what, "source": source, "examples": len(xy[1])}
        # before / after each stage, on the selection data
        rep["selection_accuracy"] = {k: v[0] for k, v in scored.items()}
        rep["selection_log_loss"] = {k: v[1] for k, v in scored.items()}
        if data.validation is not None:  # the names earlier reports used for the public set
            rep["validation_accuracy"] = rep["selection_accuracy"]
            rep["validation_log_loss"] = rep["selection_log_loss"]
    rep["adopt"], rep["adopt_reason"] = recommend(scored, selection[0] if selection else None)
    x_compare = selection[1][0] if selection is not None else data.probe
    rep["fused_vs_own"] = fused_vs_own(
        kind, own, fused, x_compare, selection[0] if selection is not None else "public probe set"
    )
    rep["wall_s"] = time.monotonic() - started
    out.report = rep
    return out


def _stage_scores(stages, fused, own, score) -> dict[str, tuple[float, float]]:
    """Public-validation (accuracy, log-loss) of the site's own model (and of it with its
    BatchNorm statistics reset, where that reference exists) and of every stage, in stage order."""
    order = [
        *(["own_bn_reset"] if "own_bn_reset" in stages else []),
        "fused",
        *(s for s in ("selected", "repaired", "finetuned") if s in stages),
    ]
    return {"own": score(own), **{s: score(stages.get(s, fused)) for s in order}}


def recommend(scored: Mapping[str, tuple[float, float]] | None, data: str | None) -> tuple[str, str]:
    """The stage a site should adopt and why (see the module docstring): of the own model and
    every stage scored (name → (accuracy, log-loss) on the selection data ``data``), the best by
    accuracy then lower log-loss; a stage must beat the own model strictly, so ties go to own
    and the pick never scores below own. Without scores: the own model."""
    if not scored:
        return "own", (
            "the own model: no public validation set and no held-out records of the own model "
            "(give [round.select] validation, or [round.records] the file the model was trained on) "
            "to show that a fused stage is better"
        )

    def rank(v: tuple[float, float]) -> tuple[float, float]:
        return v[0], -v[1]

    pick = "own"
    for name, v in scored.items():
        # among stages that beat own, the latest of equals (later stages use more of what
        # the site may use)
        if name != "own" and (rank(v) > rank(scored[pick]) or (pick != "own" and rank(v) == rank(scored[pick]))):
            pick = name
    why = "no stage beats the own model" if pick == "own" else f"{pick} beats the own model"
    return pick, f"{why} on the {data} (accuracy, then log-loss): " + ", ".join(
        f"{k} {v[0]:.3f} ({v[1]:.3f})" for k, v in scored.items()
    )


def fused_vs_own(
    kind: ModelKind, own: Mapping[str, np.ndarray], fused: Mapping[str, np.ndarray], x: np.ndarray, data: str
) -> dict[str, Any]:
    """Whether the fused model is the own model up to a positive scaling of its logits, on the
    rows ``x`` (see the module docstring). Row-centred logits A (own) and B (fused): softmax
    ignores a per-row shift, so B = c·A with c > 0 means the same class probabilities ranking.
    ``cosine`` = <A, B>/(‖A‖‖B‖), ``scale`` = <A, B>/‖A‖² (the least-squares c),
    ``same_predictions`` counts rows whose arg-max agrees; ``same_as_own`` when every row agrees
    and the cosine is at least ``SAME_AS_OWN_COSINE``."""
    n = int(np.shape(x)[0])
    if n == 0:
        return {"data": data, "examples": 0, "same_as_own": False}
    a = np.asarray(kind.logits(kind.module(own), x), dtype=np.float64)
    b = np.asarray(kind.logits(kind.module(fused), x), dtype=np.float64)
    same = int(np.sum(a.argmax(axis=1) == b.argmax(axis=1)))
    a = a - a.mean(axis=1, keepdims=True)
    b = b - b.mean(axis=1, keepdims=True)
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    inner = float(np.sum(a * b))
    cosine = inner / (na * nb) if na > 0 and nb > 0 else (1.0 if na == nb else 0.0)
    scale = inner / na**2 if na > 0 else 0.0
    return {
        "data": data,
        "examples": n,
        "same_predictions": same,
        "cosine": cosine,
        "scale": scale,
        "threshold": SAME_AS_OWN_COSINE,
        "same_as_own": bool(same == n and cosine >= SAME_AS_OWN_COSINE and scale > 0),
    }


def same_as_own_line(check: Mapping[str, Any]) -> str | None:
    """The plain sentence a report and the console print when the fused model is the own model
    (up to a positive scaling of its logits); None otherwise."""
    if not check.get("same_as_own"):
        return None
    return (
        f"fused model makes the same predictions as the own model on {check['examples']} {check['data']} rows "
        f"(its logits are {check['scale']:.3g} × the own model's, cosine {check['cosine']:.4f}): "
        "the peers' releases changed nothing usable (at this ε they carried no usable signal, or their models "
        "agree with this one)"
    )
