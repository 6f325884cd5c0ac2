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
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Mapping, Sequence
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


def enabled(config: RoundConfig) -> bool:
    return config.repair != "off" or config.finetune_epochs > 0 or config.select_validation is not None


def load_local_data(config: RoundConfig, model: StoredModel, probe: np.ndarray) -> LocalData:
    """Read the files the steps after fusion need, before the round asks anyone for anything
    (a bad file then costs nobody budget). Errors name the round key."""
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
        source = path.name
    validation = vsource = None
    if config.select_validation is not None:
        try:
            validation = load_validation_file(config.select_validation)
        except InvalidArgument as e:
            raise InvalidArgument("round.select.validation", e.rule) from None
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
) -> AfterFusion:
    """Steps 1–3 of the module docstring on the round's fusion ``fused`` of ``own`` and the
    aligned ``contributions`` (peer → arrays, in contribution order) at ``config.alpha``."""
    import torch

    from peer.ldp.repair import fine_tune, repair_fused

    started = time.monotonic()
    out = AfterFusion()
    rep: dict[str, Any] = {}
    x_repair = None
    if config.repair != "off":
        x_np = data.records[0] if config.repair == "own" else data.probe
        x_repair = input_tensor(arch, x_np)
        rep["repair"] = {"data": config.repair, "examples": len(x_np)}
    points = ()
    if x_repair is not None:
        points = stat_points_of(arch, tuple(x_repair.shape[1:]))

    def candidate(kept: Sequence[str], alpha: float) -> tuple[dict[str, np.ndarray], list[float]]:
        weights = fusion_weights(alpha, len(kept))
        ends = [own, *(contributions[n] for n in kept)]
        arrays = average_arrays(ends, weights)
        if x_repair is None or not points or not kept:
            return arrays, weights
        with torch.no_grad():
            repaired = repair_fused(
                model_from_arrays(arch, arrays),
                [model_from_arrays(arch, e) for e in ends],
                weights,
                points,
                x_repair,
            )
        return _arrays(repaired), weights

    def score(arrays) -> tuple[float, float]:
        """(accuracy, mean log-loss) on the public validation set."""
        x, y = data.validation
        with torch.no_grad():
            p = predict_proba(arch, model_from_arrays(arch, arrays), x)
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
        )
        out.stages["repaired"] = repaired
    elif chosen is not None:
        out.stages["selected"] = chosen
    if config.finetune_epochs > 0:
        start_stage = next((s for s in ("repaired", "selected") if s in out.stages), "fused")
        start = out.stages.get(start_stage, fused)
        x, y = data.records
        tuned = fine_tune(
            model_from_arrays(arch, start),
            input_tensor(arch, x),
            y,
            seed=seed,
            epochs=config.finetune_epochs,
            batch_size=config.finetune_batch_size,
            learning_rate=config.finetune_learning_rate,
        )
        out.stages["finetuned"] = _arrays(tuned)
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
    """Public-validation (accuracy, log-loss) of the site's own model and of every stage, in
    stage order."""
    order = ["fused", *(s for s in ("selected", "repaired", "finetuned") if s in stages)]
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
