"""After fusion, at the requester only: choose, repair, fine-tune. Nothing here is charged.

A round fuses θ = w_0·θ_R + Σ_j w_j·P_j(θ_j) (``coordinator_free.rounds``). Three optional local
steps follow, each configured in the round file and recorded in the round report:

1. **select** (``[round.select] validation``): candidate fusions — every non-empty subset S of
   the contributions (at most ``MAX_EXHAUSTIVE`` peers; beyond, greedy forward selection) at
   every α of ``alphas`` (weights α for R, (1 − α)/|S| for each kept peer), each repaired as in
   step 2 — are compared by accuracy on a PUBLIC labelled validation set, and the best is kept;
   the candidates' validation accuracies go into the report (public data, public results). The
   site's own model is scored too, so the report says when no fusion beat it. Never the test
   set; never the site's own training records (its own model has seen them, so they would
   always favour it).
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
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from coordinator_free.rounds import RoundConfig, fusion_weights
from peer.base.errors import FailedPrecondition, InvalidArgument
from peer.ldp.fusion import average_arrays
from peer.nn.architectures import accuracy, input_tensor, model_from_arrays, state_arrays
from peer.nn.store import StoredModel

#: up to this many contributions every subset is a candidate (2^k − 1 of them); beyond it,
#: greedy forward selection (at most k(k+1)/2 candidates per α)
MAX_EXHAUSTIVE = 4


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
    from peer.nn.tracing import derive_structure

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
        points = derive_structure(model_from_arrays(arch, own), tuple(x_repair.shape[1:])).stat_points

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

    def score(arrays) -> float:
        x, y = data.validation
        return float(accuracy(arch, model_from_arrays(arch, arrays), x, y))

    kept, alpha = list(contributions), config.alpha
    chosen = None
    if data.validation is not None:
        alphas = list(dict.fromkeys(config.select_alphas or (config.alpha,)))
        names = list(contributions)
        tried: list[dict] = []

        def consider(sub: Sequence[str], a: float):
            arrays, _ = candidate(sub, a)
            acc = score(arrays)
            tried.append({"kept": list(sub), "alpha": a, "validation_accuracy": acc})
            return acc, arrays

        best = None
        for a in alphas:
            if len(names) <= MAX_EXHAUSTIVE:
                for sub in _subsets(names):
                    acc, arrays = consider(sub, a)
                    if best is None or acc > best[0]:
                        best = (acc, list(sub), a, arrays)
            else:
                current: list[str] = []
                current_acc = -1.0
                while True:
                    step = None
                    for n in names:
                        if n in current:
                            continue
                        acc, arrays = consider([*current, n], a)
                        if step is None or acc > step[0]:
                            step = (acc, [*current, n], arrays)
                    if step is None or step[0] <= current_acc:
                        break
                    current_acc, current = step[0], step[1]
                    if best is None or step[0] > best[0]:
                        best = (step[0], step[1], a, step[2])
        acc, kept, alpha, chosen = best
        own_acc = score(own)
        rep["select"] = {
            "validation": data.validation_source,
            "validation_examples": len(data.validation[1]),
            "alphas": alphas,
            "search": "exhaustive" if len(names) <= MAX_EXHAUSTIVE else "greedy forward",
            "candidates": tried,
            "own_validation_accuracy": own_acc,
            "fused_validation_accuracy": score(fused),
            "kept": kept,
            "dropped": [n for n in names if n not in kept],
            "alpha": alpha,
            "weights": dict(zip(["(own)", *kept], fusion_weights(alpha, len(kept)), strict=True)),
            "validation_accuracy": acc,
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
        rep["validation_accuracy"] = scored  # before/after each stage, on the PUBLIC validation set
    rep["adopt"], rep["adopt_reason"] = _adopt(out.stages, scored)
    rep["wall_s"] = time.monotonic() - started
    out.report = rep
    return out


def _stage_scores(stages, fused, own, score) -> dict[str, float]:
    """Public-validation accuracy of the site's own model and of every stage, in stage order."""
    order = ["fused", *(s for s in ("selected", "repaired", "finetuned") if s in stages)]
    return {"own": score(own), **{s: score(stages.get(s, fused)) for s in order}}


def _adopt(stages, scored: dict[str, float] | None) -> tuple[str, str]:
    """The stage a site should adopt (see the module docstring)."""
    if scored is None:
        last = next((s for s in ("finetuned", "repaired", "selected") if s in stages), "fused")
        return last, "the last stage run (no public validation set to compare stages on)"
    best = max(scored.values())
    # the latest stage among the best: later stages use more of what the site may use
    pick = next(s for s in reversed(list(scored)) if scored[s] == best)
    return pick, "best public-validation accuracy: " + ", ".join(f"{k} {v:.3f}" for k, v in scored.items())
