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
budget spent; the peers' releases are only post-processed. The report holds settings, counts
and public-data accuracies only — no statistic of R's records.

Which model to adopt: the last stage run (fine-tuned, else repaired, else fused), unless the
public validation set (when given) scores an earlier stage — or R's own model — higher; the
report's ``adopt`` says which, and why.

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

    records = source = None
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
                x, y = prep.transform(prep.read(path))
            except InvalidArgument as e:
                raise InvalidArgument("round.records.path", f"{e.field}: {e.rule}") from None
            records = (x, y)
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
    return LocalData(records, source, np.asarray(probe), validation, vsource)


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

    def score(arrays) -> tuple[float, float]:
        """(accuracy, mean log-loss) on the public validation set."""
        x, y = data.validation
        with torch.no_grad():
            p = kind.predict_proba(kind.module(arrays), x)
        acc = float(np.mean(p.argmax(axis=1) == y))
        return acc, float(-np.mean(np.log(np.clip(p[np.arange(len(y)), y], 1e-12, None))))

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
    scored = _stage_scores(out.stages, fused, own, score) if data.validation is not None else None
    if scored is not None:
        # before / after each stage, on the PUBLIC validation set
        rep["validation_accuracy"] = {k: v[0] for k, v in scored.items()}
        rep["validation_log_loss"] = {k: v[1] for k, v in scored.items()}
    rep["adopt"], rep["adopt_reason"] = _adopt(out.stages, scored, rank)
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


def _adopt(stages, scored: dict[str, tuple[float, float]] | None, rank) -> tuple[str, str]:
    """The stage a site should adopt (see the module docstring)."""
    if scored is None:
        last = next((s for s in ("finetuned", "repaired", "selected") if s in stages), "fused")
        return last, "the last stage run (no public validation set to compare stages on)"
    best = max(rank(v) for v in scored.values())
    # the latest stage among equals: later stages use more of what the site may use
    pick = next(s for s in reversed(list(scored)) if rank(scored[s]) == best)
    return pick, "best public-validation accuracy (then log-loss): " + ", ".join(
        f"{k} {v[0]:.3f} ({v[1]:.3f})" for k, v in scored.items()
    )
