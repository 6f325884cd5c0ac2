"""REPAIR: renormalise a fused network's hidden units to the interpolation of its endpoints.

Averaging two aligned networks, θ = α·θ_A + (1 − α)·π(θ_B), shrinks the spread of hidden
activations: a fused unit's pre-activation is a mix of two units that are correlated but not
equal, so its variance falls below either endpoint's, and the collapse compounds layer after
layer ("variance collapse", Jordan et al., REPAIR, ICLR 2023, §3). REPAIR measures, for every
hidden unit u at every statistic point (the output of a Linear/Conv that produces a permutation
group, before its activation), the mean and standard deviation of the endpoints,

    μ_A(u), σ_A(u)   on model A,           μ_B(u), σ_B(u)   on B aligned to A,

sets the targets μ*(u) = α·μ_A(u) + (1 − α)·μ_B(u), σ*(u) = α·σ_A(u) + (1 − α)·σ_B(u), and then,
point by point in execution order (each point is measured after the earlier ones are
repaired), rescales the fused layer producing u so that its output has exactly those moments:

    W'[u] = s(u)·W[u],   b'[u] = s(u)·(b[u] − μ_f(u)) + μ*(u),   s(u) = σ*(u) / σ_f(u),

with μ_f, σ_f the fused network's own moments on the same data (Jordan et al. eq. 2, folded
into the layer instead of a separate affine). A unit whose fused std is ~0 keeps its scale.
For a Linear/Conv that feeds a BatchNorm the BatchNorm's running statistics are reset to the
fused network's actual per-channel mean and variance instead (the paper's "reset BN"
variant: the interpolated affine of the BatchNorm then gives the interpolated output scale).

Which data, and what it costs in privacy: the requester A computes every statistic here. A's
own statistics come from A's own records (A's data never leaves A); B's come from running the
model A *received* — a DP release (noisy weights) — on A's own records or the public probe set.
That is post-processing of B's release, so it costs B nothing more and A nothing it had to
declare. Nothing here reads B's exact weights or B's data.

Pure functions over modules and arrays; the optional :func:`fine_tune` is plain local training
on the requester's own records.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from peer.base.errors import InvalidArgument
from peer.nn.tracing import StatPoint

__all__ = [
    "UnitStatistics",
    "combined_statistics",
    "fine_tune",
    "interpolated_statistics",
    "repair",
    "repair_fused",
    "repair_fusion",
    "unit_statistics",
]

#: a fused unit with std below this (relative to its target) is left unscaled: it is dead on
#: the data, and dividing by ~0 would blow it up
MIN_STD_RATIO = 1e-6


@dataclass(frozen=True)
class UnitStatistics:
    """Per-unit mean and standard deviation (float64 arrays of one length)."""

    mean: np.ndarray
    std: np.ndarray


def _unit_axis(module: nn.Module) -> int:
    return -1 if isinstance(module, nn.Linear) else 1


def _moments(t: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(sum, sum of squares, count) per unit of ``t`` along ``axis``, in float64."""
    t = t.detach().double().movedim(axis, -1)
    flat = t.reshape(-1, t.shape[-1])
    return flat.sum(0), (flat * flat).sum(0), flat.shape[0]


def _batches(x: np.ndarray | torch.Tensor, batch_size: int):
    t = torch.as_tensor(np.asarray(x, dtype=np.float32)) if not isinstance(x, torch.Tensor) else x
    for i in range(0, t.shape[0], batch_size):
        yield t[i : i + batch_size]


def _measure(model: nn.Module, module_name: str, x, *, inputs: bool, batch_size: int) -> UnitStatistics:
    """Moments of ``module_name``'s output (or its input, ``inputs=True``) per unit over ``x``."""
    return _moments_at(model, [(module_name, inputs)], x, batch_size)[module_name]


def unit_statistics(
    model: nn.Module, stat_points: Sequence[StatPoint], x, *, batch_size: int = 512
) -> dict[str, UnitStatistics]:
    """Each statistic point's per-unit mean and std of its output, on data ``x``: every point
    in the same passes over ``x`` (the model is not changed, so each point's figures are those
    a pass of its own would give)."""
    return _moments_at(model, [(p.module, False) for p in stat_points], x, batch_size)


@torch.no_grad()
def _moments_at(model: nn.Module, points: Sequence[tuple[str, bool]], x, batch_size: int) -> dict[str, UnitStatistics]:
    """Per-unit moments over ``x`` at each (module, inputs) point — the module's output, or its
    input when ``inputs`` (per channel) — all in the same passes, the model in eval mode."""
    modules = dict(model.named_modules())
    acc: dict[str, list] = {}
    handles = []
    try:
        for name, inputs in points:
            mod = modules.get(name)
            if mod is None:
                raise InvalidArgument("stat_points", f"the model has no module {name!r}")
            acc[name] = [0.0, 0.0, 0]
            axis = 1 if inputs else _unit_axis(mod)

            def record(t: torch.Tensor, name=name, axis=axis) -> None:
                s, s2, n = _moments(t, axis)
                acc[name][0] = acc[name][0] + s
                acc[name][1] = acc[name][1] + s2
                acc[name][2] += n

            handles.append(
                mod.register_forward_pre_hook(lambda m, a, rec=record: rec(a[0]))
                if inputs
                else mod.register_forward_hook(lambda m, a, out, rec=record: rec(out))
            )
        was_training = model.training
        model.eval()
        try:
            for xb in _batches(x, batch_size):
                model(xb)
        finally:
            model.train(was_training)
    finally:
        for h in handles:
            h.remove()
    return {name: _statistics(a) for name, a in acc.items()}


def _statistics(acc: list) -> UnitStatistics:
    """Mean and std from accumulated (sum, sum of squares, count)."""
    if acc[2] == 0:
        raise InvalidArgument("x", "no data to measure statistics on")
    mean = (acc[0] / acc[2]).numpy()
    var = np.maximum((acc[1] / acc[2]).numpy() - mean * mean, 0.0)
    return UnitStatistics(mean, np.sqrt(var))


def interpolated_statistics(
    a: Mapping[str, UnitStatistics], b: Mapping[str, UnitStatistics], alpha: float
) -> dict[str, UnitStatistics]:
    """μ* = α·μ_A + (1 − α)·μ_B and σ* = α·σ_A + (1 − α)·σ_B for every point."""
    if not 0.0 <= alpha <= 1.0:
        raise InvalidArgument("alpha", f"must lie in [0, 1], got {alpha}")
    return combined_statistics([a, b], [alpha, 1 - alpha])


def combined_statistics(
    endpoints: Sequence[Mapping[str, UnitStatistics]], weights: Sequence[float]
) -> dict[str, UnitStatistics]:
    """The k-model interpolation of the endpoints' statistics, with the fusion's own weights:
    μ* = Σ_j w_j·μ_j and σ* = Σ_j w_j·σ_j for every point (w_j ≥ 0, Σ w_j = 1; two endpoints
    with weights (α, 1 − α) are :func:`interpolated_statistics`). This is the target for a
    fused network θ = Σ_j w_j·θ_j of k aligned models, as REPAIR's interpolation is for two."""
    if len(endpoints) != len(weights) or not endpoints:
        raise InvalidArgument("weights", f"need one weight per endpoint, got {len(weights)} for {len(endpoints)}")
    w = np.asarray(weights, dtype=np.float64)
    if not np.all(np.isfinite(w)) or np.any(w < 0) or abs(w.sum() - 1.0) > 1e-9:
        raise InvalidArgument("weights", f"must be non-negative and sum to 1, got {list(weights)}")
    points = set(endpoints[0])
    for e in endpoints[1:]:
        if set(e) != points:
            raise InvalidArgument("statistics", f"endpoints measured at different points: {sorted(points ^ set(e))}")
    return {
        k: UnitStatistics(
            sum(wj * e[k].mean for wj, e in zip(w, endpoints, strict=True)),
            sum(wj * e[k].std for wj, e in zip(w, endpoints, strict=True)),
        )
        for k in endpoints[0]
    }


@torch.no_grad()
def repair(
    fused: nn.Module,
    stat_points: Sequence[StatPoint],
    targets: Mapping[str, UnitStatistics],
    x,
    *,
    batch_size: int = 512,
) -> nn.Module:
    """A copy of ``fused`` whose units at every statistic point have the ``targets``' moments
    on data ``x`` (affine points), or whose BatchNorms carry the fused network's actual
    statistics on ``x`` (batchnorm points). See the module docstring for the formulas.

    Each point is measured after the earlier ones are repaired. When ``x`` is one batch this
    takes one forward pass: each point is repaired by a hook as the pass reaches it, and its
    output recomputed with the repaired layer (so every later point sees exactly what a pass of
    its own would); otherwise, or when a module runs more than once in a pass, one pass per
    point."""
    modules = dict(fused.named_modules())
    for p in stat_points:
        mod = modules.get(p.module)
        if mod is None:
            raise InvalidArgument("stat_points", f"the model has no module {p.module!r}")
        if p.kind == "batchnorm" and (not isinstance(mod, nn.modules.batchnorm._BatchNorm) or mod.running_mean is None):
            raise InvalidArgument("stat_points", f"{p.module!r} is not a BatchNorm with running statistics")
        if p.kind != "batchnorm" and p.module not in targets:
            raise InvalidArgument("targets", f"no target statistics for {p.module!r}")
    rows = (x if isinstance(x, torch.Tensor) else np.asarray(x)).shape[0]
    if 0 < rows <= batch_size:
        model = _repair_in_one_pass(fused, stat_points, targets, x, batch_size)
        if model is not None:
            return model
    model = copy.deepcopy(fused)
    modules = dict(model.named_modules())
    for p in stat_points:
        cur = _measure(model, p.module, x, inputs=p.kind == "batchnorm", batch_size=batch_size)
        _repair_point(modules[p.module], p, cur, targets)
    return model


class _RanTwice(Exception):
    """A statistic point's module ran a second time in one pass (weights shared by two uses)."""


@torch.no_grad()
def _repair_in_one_pass(fused, stat_points, targets, x, batch_size) -> nn.Module | None:
    """:func:`repair` in one pass over ``x`` (one batch), or None when a point's module does
    not run exactly once in it (then :func:`repair` takes one pass per point)."""
    model = copy.deepcopy(fused)
    modules = dict(model.named_modules())
    done: set[str] = set()
    handles = []

    def once(name: str) -> None:
        if name in done:
            raise _RanTwice(name)
        done.add(name)

    for p in stat_points:
        mod = modules[p.module]
        if p.kind == "batchnorm":

            def reset(m, args, point=p) -> None:
                once(point.module)
                _repair_point(m, point, _statistics(list(_moments(args[0], 1))), targets)

            handles.append(mod.register_forward_pre_hook(reset))
        else:

            def rescale(m, args, out, point=p):
                once(point.module)
                _repair_point(m, point, _statistics(list(_moments(out, _unit_axis(m)))), targets)
                return m.forward(*args)  # the repaired layer's output, as a pass of its own computes it

            handles.append(mod.register_forward_hook(rescale))
    model.eval()
    try:
        for xb in _batches(x, batch_size):
            model(xb)
    except _RanTwice:
        return None
    finally:
        for h in handles:
            h.remove()
    if done != {p.module for p in stat_points}:
        return None
    model.train(fused.training)
    return model


def _repair_point(mod: nn.Module, p: StatPoint, cur: UnitStatistics, targets: Mapping[str, UnitStatistics]) -> None:
    """Repair one statistic point given the fused network's current moments there (its input's
    per channel for a BatchNorm, its output's per unit otherwise)."""
    if p.kind == "batchnorm":
        mod.running_mean.copy_(torch.as_tensor(cur.mean, dtype=mod.running_mean.dtype))
        mod.running_var.copy_(torch.as_tensor(cur.std**2, dtype=mod.running_var.dtype))
        return
    tgt = targets[p.module]
    if cur.mean.shape != tgt.mean.shape:
        raise InvalidArgument(f"targets[{p.module}]", f"has {tgt.mean.shape[0]} units, the module {cur.mean.shape[0]}")
    ok = cur.std > MIN_STD_RATIO * np.maximum(tgt.std, 1e-12)
    scale = np.where(ok, tgt.std / np.where(ok, cur.std, 1.0), 1.0)
    w = mod.weight
    shape = (-1,) + (1,) * (w.dim() - 1)
    w.mul_(torch.as_tensor(scale, dtype=w.dtype).reshape(shape))
    if mod.bias is not None:
        b = mod.bias.detach().double().numpy()
        mod.bias.copy_(torch.as_tensor(scale * (b - cur.mean) + tgt.mean, dtype=mod.bias.dtype))
    # without a bias only the scale can be set (the mean follows the scale)


def repair_fusion(
    fused: nn.Module,
    model_a: nn.Module,
    model_b_aligned: nn.Module,
    stat_points: Sequence[StatPoint],
    alpha: float,
    x_a,
    x_b=None,
    x_fused=None,
    *,
    batch_size: int = 512,
) -> nn.Module:
    """REPAIR in one call: A's statistics on ``x_a`` (A's own records), aligned B's on ``x_b``
    (default ``x_a``; A's records or the public probe set), the fused network measured on
    ``x_fused`` (default ``x_a``)."""
    sa = unit_statistics(model_a, [p for p in stat_points if p.kind == "affine"], x_a, batch_size=batch_size)
    sb = unit_statistics(
        model_b_aligned,
        [p for p in stat_points if p.kind == "affine"],
        x_a if x_b is None else x_b,
        batch_size=batch_size,
    )
    return repair(
        fused,
        stat_points,
        interpolated_statistics(sa, sb, alpha),
        x_a if x_fused is None else x_fused,
        batch_size=batch_size,
    )


def repair_fused(
    fused: nn.Module,
    endpoints: Sequence[nn.Module],
    weights: Sequence[float],
    stat_points: Sequence[StatPoint],
    x,
    *,
    batch_size: int = 512,
) -> nn.Module:
    """REPAIR of a k-model fusion θ = Σ_j w_j·θ_j: every endpoint (the requester's own model and
    each aligned contribution) measured on ``x``, targets by :func:`combined_statistics` with
    the fusion weights, the fused network repaired on the same ``x``. ``x`` is data the
    requester may use: its own records, or the public probe set."""
    affine = [p for p in stat_points if p.kind == "affine"]
    stats = [unit_statistics(m, affine, x, batch_size=batch_size) for m in endpoints]
    return repair(fused, stat_points, combined_statistics(stats, weights), x, batch_size=batch_size)


def fine_tune(
    model: nn.Module, x, y, *, seed: int, epochs: int = 5, batch_size: int = 64, learning_rate: float = 1e-4
) -> nn.Module:
    """A copy of ``model`` trained a few Adam epochs with cross-entropy on the requester's own
    records (``x`` shaped as the model expects, integer labels ``y``); deterministic given
    ``seed``. Local training on one's own data: it touches no other site's release beyond
    post-processing it.

    Batches are ``batch_size`` rows, except that a last batch of one row joins the batch
    before it: BatchNorm in training mode cannot normalise a single row (per-feature variance
    of one value), and one row's step would be noise anyway."""
    if len(x) == 0:
        raise InvalidArgument("x", "no records to fine-tune on")
    if len(x) == 1 and any(isinstance(mod, nn.modules.batchnorm._BatchNorm) for mod in model.modules()):
        raise InvalidArgument("x", "one record: a network with BatchNorm cannot be fine-tuned on a single row")
    m = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    xt = torch.as_tensor(np.asarray(x, dtype=np.float32))
    yt = torch.as_tensor(np.asarray(y, dtype=np.int64))
    opt = torch.optim.Adam(m.parameters(), lr=learning_rate)
    m.train()
    for _ in range(epochs):
        order = torch.randperm(len(xt), generator=gen)
        starts = list(range(0, len(xt), batch_size))
        if len(starts) > 1 and len(xt) - starts[-1] == 1:
            starts.pop()  # the last single row goes with the batch before it
        for k, i in enumerate(starts):
            idx = order[i : starts[k + 1] if k + 1 < len(starts) else len(xt)]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(m(xt[idx]), yt[idx])
            loss.backward()
            opt.step()
    m.eval()
    return m
