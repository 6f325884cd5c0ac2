"""DP-SGD: per-example clipping plus Gaussian noise, full-batch or Poisson-subsampled.

The update (Abadi et al. 2016, "Deep learning with differential privacy", Algorithm 1, with the
normalisation made data-independent)::

    full batch (sample_rate q = 1), every step uses all n records:
        θ_{t+1} = θ_t − η_t · ( Σ_{i=1..n} clip_{C_t}(∇ℓ(θ_t; x_i, y_i)) + σ_t C_t z_t ) / n

    Poisson subsampling (q < 1), record i is in B_t independently with probability q_t:
        θ_{t+1} = θ_t − η_t · ( Σ_{i ∈ B_t} clip_{C_t}(∇ℓ(θ_t; x_i, y_i)) + σ_t C_t z_t ) / (q_t n)

    clip_C(g) = g · min(1, C / ‖g‖₂)   (‖·‖₂ over all parameters of the model together)
    z_t ~ N(0, I), fresh for every step and independent of everything else.

``n`` here is the *declared* dataset size, a public constant of the mechanism. It never changes
with the data: for Poisson sampling the denominator is the expected batch size q·n, not the
realised |B_t|, so the sensitivity of the update stays data-independent. The unit of privacy is
one training record:

- ``"replace-one"``: neighbouring datasets differ in one record's value, so both have the same
  number of records: that count is public in this neighbourhood and is n by default. One step
  is a Gaussian mechanism on the clipped sum with L2 sensitivity 2·C_t and noise std σ_t·C_t.
- ``"add-remove"``: one record is added or removed; the clipped sum has L2 sensitivity C_t.
  Here the record count is *private* (D and D + {x} differ in it), so n must be a constant the
  operator declares (``declared_records``), never the true count: the classifier and pool
  trainers below refuse add-remove without an explicit ``dataset_size``. The mechanism is then
  the same function on both neighbours, and its record states n (public) and that it was
  declared (``parameters.dataset_size_source``), so the records of D and D + {x} are the same
  bytes apart from what the noise decides. (Were the true count published, only replace-one
  neighbours would remain protected: sensitivity 2·C_t, e.g. ε 8.36 instead of 3.70 at the
  bundled iterate plan.)

The coefficient η_t/n (or η_t/(q_t n)) multiplies both the sensitivity and the noise of the
parameter update, so each step's privacy depends only on σ_t: this is the per-step Gaussian
mechanism the accountant (``peer.dp.accounting``) composes, with ``TrainingRecord`` steps
``GaussianStep(learning_rate=η_t, clip_norm=C_t, noise_multiplier=σ_t, sample_rate=q_t)``.
For a linear combination of models (``peer.dp.merging``), η_t enters the accountant's per-step noise
and sensitivity; models combined there share the same declared n, so the common factor 1/n
cancels in every step's sensitivity-to-noise ratio.

The update above is plain SGD on the privatised gradient ĝ_t = (Σ clip + σ_t C_t z_t)/(q_t n).
A run may instead feed the same ĝ_t to heavy-ball momentum or Adam (``TrainingRecord.optimizer``,
``peer.dp.accounting.training_records.Optimizer``; :func:`optimizer_update`): their state and
update are functions of ĝ_1..ĝ_t and public constants only, i.e. post-processing of the same
per-step Gaussian releases, so the accountant's ε is the same for the same steps whatever the
optimiser (Abadi et al. train with momentum; Opacus wraps any torch optimiser this way).

The initial parameters θ_0 are public (built from a public seed), so models of one pool share
them and can be combined without alignment. The Gaussian noise z_t and the Poisson masks come
from ``peer.base.rng.Randomness``'s NumPy PCG64 generator — seeded with 128 bits from the operating
system's CSPRNG unless a fixed seed is asked for (reported in the record), the one source of all
DP noise in this package — drawn in float64 and cast to the parameters' dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.func import functional_call, grad, vmap

from peer.base.errors import InvalidArgument
from peer.base.records import ReleaseRecord
from peer.base.rng import Randomness
from peer.dp.accounting import Optimizer, TrainingRecord
from peer.dp.accounting.profiles import check_accountable
from peer.dp.accounting.release_accounting import dpsgd_record
from peer.dp.accounting.training_records import SGD
from peer.nn.architectures import build_model, input_tensor, model_from_arrays, validate_architecture

__all__ = [
    "ADD_REMOVE_NEEDS_DECLARED",
    "LossFn",
    "TrainedModel",
    "check_private_training",
    "classifier_loss",
    "clipped_sum",
    "dpsgd_release_record",
    "dpsgd_step",
    "draw_step",
    "module_loss",
    "optimizer_update",
    "per_example_gradients",
    "privatised_gradient",
    "run_dpsgd",
    "take_step",
    "train_dpsgd_classifier",
    "train_dpsgd_module",
    "train_pool",
]

# A per-example loss: (parameters, one input, one label) -> scalar tensor.
LossFn = Callable[[dict[str, torch.Tensor], torch.Tensor, torch.Tensor], torch.Tensor]


def per_example_gradients(
    loss_fn: LossFn, params: Mapping[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
) -> dict[str, torch.Tensor]:
    """∇_θ ℓ(θ; x_i, y_i) for every row i of ``x`` at once (torch.func vmap over grad): arrays
    of shape (len(x), *p.shape). Row i's gradient depends on (θ, x_i, y_i) alone."""
    return vmap(grad(loss_fn), in_dims=(None, 0, 0))(dict(params), x, y)


def clipped_sum(
    per_example: Mapping[str, torch.Tensor], clip_norm: float, mask: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Σ_{i: mask_i} clip_C(g_i) with clip_C(g) = g · min(1, C/‖g‖₂), the norm taken over all
    parameters together. ``mask`` (n,) of 0/1 selects the records of a Poisson batch; without it
    every row is summed (n = 0 rows give the zero sum)."""
    n = next(iter(per_example.values())).shape[0]
    sq = torch.zeros(n, dtype=torch.float64)
    for g in per_example.values():
        # explicit row length, not -1: reshape(0, -1) is ambiguous for an empty batch
        sq = sq + torch.linalg.vector_norm(g.reshape(n, math.prod(g.shape[1:])), dim=1).double().pow(2)
    # min(1, C/‖g‖) without dividing by zero: a zero gradient needs no clipping.
    factor = torch.clamp(clip_norm / torch.clamp(sq.sqrt(), min=1e-300), max=1.0)
    if mask is not None:
        factor = factor * mask.double()
    factor = factor.to(next(iter(per_example.values())).dtype)
    return {k: torch.tensordot(factor, g, dims=([0], [0])) for k, g in per_example.items()}


def dpsgd_step(
    loss_fn: LossFn,
    params: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    learning_rate: float,
    clip_norm: float,
    noise_multiplier: float,
    denominator: float,
    noise: Mapping[str, torch.Tensor],
    mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """One DP-SGD step, given the standard normal draw ``noise`` (same shapes as ``params``):
    θ − η·(Σ_{i∈B} clip_C(∇ℓ(θ; x_i, y_i)) + σ·C·z)/denominator. Pure: all randomness is in
    ``noise`` and ``mask``, so the rule itself can be checked exactly.

    B is every row of ``x`` without ``mask``, else the rows with mask_i = 1. The two ways of
    passing a Poisson batch give the same update: an unsampled row's term in the masked sum is
    mask_i · clip_C(g_i) = 0 exactly (for a finite g_i; x[B] never evaluates the unsampled rows
    at all), and a sampled row's clipping factor depends on its own gradient only, so x[B]
    without a mask sums exactly the same terms (only the floating-point summation order
    differs) while computing |B| gradients instead of n. Rows are gradients
    of one record each, so no row ever sees another (no batch statistics: see
    :func:`check_private_training`). An empty ``x`` (|B| = 0, a valid Poisson outcome) gives the
    zero clipped sum: the update is the noise alone."""
    g = _clipped_batch_sum(loss_fn, params, x, y, clip_norm, mask)
    scale = learning_rate / denominator
    return {k: p - scale * (g[k] + (noise_multiplier * clip_norm) * noise[k]) for k, p in params.items()}


def _clipped_batch_sum(loss_fn, params, x, y, clip_norm, mask) -> dict[str, torch.Tensor]:
    if x.shape[0] == 0:
        return {k: torch.zeros_like(p) for k, p in params.items()}
    return clipped_sum(per_example_gradients(loss_fn, params, x, y), clip_norm, mask)


def privatised_gradient(
    loss_fn: LossFn,
    params: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    clip_norm: float,
    noise_multiplier: float,
    denominator: float,
    noise: Mapping[str, torch.Tensor],
    mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The step's Gaussian release ĝ = (Σ_{i∈B} clip_C(∇ℓ(θ; x_i, y_i)) + σ·C·z)/denominator
    (B, ``mask`` and an empty batch as in :func:`dpsgd_step`, which is θ − η·ĝ). Everything an
    optimiser does afterwards with ĝ is post-processing."""
    g = _clipped_batch_sum(loss_fn, params, x, y, clip_norm, mask)
    return {k: (g[k] + (noise_multiplier * clip_norm) * noise[k]) / denominator for k in params}


def optimizer_update(
    optimizer: Optimizer,
    params: Mapping[str, torch.Tensor],
    gradient: Mapping[str, torch.Tensor],
    state: dict[str, dict[str, torch.Tensor]],
    step: int,
    learning_rate: float,
) -> dict[str, torch.Tensor]:
    """θ_{t+1} from θ_t and the privatised gradient ĝ_t by ``optimizer``'s rule (its docstring
    states them; torch.optim.SGD(momentum=β) and torch.optim.Adam compute the same), ``step`` =
    t counted from 1, η = ``learning_rate``. ``state`` (per-parameter tensors: the momentum
    buffer v, or Adam's moments m and v; empty before the first step) is updated in place. All
    operations are elementwise, so parameters with a leading replica axis work unchanged."""
    lr = float(learning_rate)
    if optimizer.name == "sgd":
        return {k: p - lr * gradient[k] for k, p in params.items()}
    if optimizer.name == "momentum":
        beta = optimizer["momentum"]
        v = state.setdefault("v", {k: torch.zeros_like(p) for k, p in params.items()})
        for k in params:
            v[k] = beta * v[k] + gradient[k]
        return {k: p - lr * v[k] for k, p in params.items()}
    beta1, beta2, eps = optimizer["beta1"], optimizer["beta2"], optimizer["eps"]
    m = state.setdefault("m", {k: torch.zeros_like(p) for k, p in params.items()})
    v = state.setdefault("v", {k: torch.zeros_like(p) for k, p in params.items()})
    correction1, correction2 = 1.0 - beta1**step, 1.0 - beta2**step
    out = {}
    for k, p in params.items():
        g = gradient[k]
        m[k] = beta1 * m[k] + (1.0 - beta1) * g
        v[k] = beta2 * v[k] + (1.0 - beta2) * g * g
        out[k] = p - (lr / correction1) * m[k] / (v[k].sqrt() / math.sqrt(correction2) + eps)
    return out


@dataclass(frozen=True)
class DPSGDRun:
    """What one run produced. ``batch_sizes`` are the realised Poisson batch sizes, kept only for
    local diagnostics and tests: they are not part of any release record."""

    params: dict[str, torch.Tensor]
    batch_sizes: tuple[int, ...] | None


def _check_steps(steps: Sequence, dataset_size: int) -> None:
    if len(steps) == 0:
        raise InvalidArgument("training.steps", "must contain at least one step")
    if isinstance(dataset_size, bool) or not isinstance(dataset_size, (int, np.integer)) or dataset_size <= 0:
        raise InvalidArgument("dataset_size", f"must be a positive integer, got {dataset_size!r}")
    for t, s in enumerate(steps):
        for name in ("learning_rate", "clip_norm", "noise_multiplier", "sample_rate"):
            v = getattr(s, name, None)
            if v is None or not math.isfinite(float(v)):
                raise InvalidArgument(f"training.steps[{t}].{name}", f"must be a finite number, got {v!r}")
        if not s.clip_norm > 0:
            raise InvalidArgument(f"training.steps[{t}].clip_norm", f"must be > 0, got {s.clip_norm!r}")
        if not s.noise_multiplier >= 0:
            raise InvalidArgument(f"training.steps[{t}].noise_multiplier", f"must be >= 0, got {s.noise_multiplier!r}")
        if not 0 < s.sample_rate <= 1:
            raise InvalidArgument(f"training.steps[{t}].sample_rate", f"must be in (0, 1], got {s.sample_rate!r}")


def draw_step(
    generator: np.random.Generator,
    params: Mapping[str, torch.Tensor],
    n_records: int,
    sample_rate: float,
    lead: tuple[int, ...] = (),
) -> tuple[dict[str, torch.Tensor], np.ndarray | None]:
    """One step's randomness (z_t, B_t), drawn from ``generator`` in this order: the noise z_t
    ~ N(0, I), parameter by parameter in ``params``' order (float64, cast to each parameter's
    dtype), then, when q = ``sample_rate`` < 1, the Poisson mask over all ``n_records`` records
    (True: record i is in B_t, independently with probability q; None for a full batch).
    ``lead`` prefixes a replica axis to the mask (the parameters already carry it). Every DP-SGD
    step of this package draws through here (:func:`run_dpsgd`, ``peer.dp.own_loop.DPStep``),
    so the same generator gives the same (z_t, B_t) whoever runs the loop."""
    noise = {k: torch.from_numpy(generator.standard_normal(tuple(v.shape))).to(v.dtype) for k, v in params.items()}
    q = float(sample_rate)
    sampled = generator.random((*lead, n_records)) < q if q < 1.0 else None
    return noise, sampled


def take_step(
    loss_fn: LossFn,
    params: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    step,
    *,
    dataset_size: int,
    noise: Mapping[str, torch.Tensor],
    sampled: np.ndarray | None,
    optimizer: Optimizer = SGD,
    state: dict[str, dict[str, torch.Tensor]] | None = None,
    t: int = 1,
    inputs: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """θ_{t+1} of one step (no replica axis) from the draw (z_t, B_t) of :func:`draw_step`:
    the batch's rows x[B_t] only (``sampled`` None: every row; :func:`dpsgd_step` says why this
    equals the masked sum), denominator q_t·``dataset_size``, then plain SGD
    (:func:`dpsgd_step`) or ``optimizer``'s update of the privatised gradient
    (:func:`privatised_gradient`, :func:`optimizer_update`; ``state`` its buffers, ``t`` the step
    counted from 1). ``step`` has ``learning_rate``, ``clip_norm``, ``noise_multiplier``,
    ``sample_rate`` (a GaussianStep). ``inputs`` (None: the rows as they are) maps the batch's
    rows x[B_t] to the inputs their gradients are taken at; it must treat every row on its own
    (``peer.dp.own_loop`` applies a site's augmentation record by record), so that each clipped
    gradient still depends on one record alone. The one place per-example clipping and noise meet the
    parameters in a single run: the built-in loop and a site's own loop both step through it."""
    q = float(step.sample_rate)
    step_x, step_y = x, y
    if sampled is not None:
        rows = torch.from_numpy(np.flatnonzero(sampled))
        step_x, step_y = x[rows], y[rows]
    if inputs is not None:
        step_x = inputs(step_x)
    lr, c, sigma = float(step.learning_rate), float(step.clip_norm), float(step.noise_multiplier)
    kw = {"clip_norm": c, "noise_multiplier": sigma, "denominator": q * dataset_size, "noise": noise}
    with torch.no_grad():
        if optimizer.name == "sgd":
            return dpsgd_step(loss_fn, params, step_x, step_y, learning_rate=lr, **kw)
        g_hat = privatised_gradient(loss_fn, params, step_x, step_y, **kw)
        return optimizer_update(optimizer, params, g_hat, {} if state is None else state, t, lr)


def run_dpsgd(
    loss_fn: LossFn,
    params0: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    steps: Sequence,
    *,
    randomness: Randomness,
    dataset_size: int | None = None,
    replicas: int | None = None,
    progress: Callable[[], None] | None = None,
    before_step: Callable[[dict[str, torch.Tensor]], None] | None = None,
    optimizer: Optimizer = SGD,
) -> DPSGDRun:
    """Run DP-SGD from ``params0`` through ``steps`` (objects with ``learning_rate``,
    ``clip_norm``, ``noise_multiplier``, ``sample_rate``, e.g. the accountant's GaussianStep).

    A step with sample_rate q = 1 uses every record; q < 1 draws a Poisson batch. The denominator
    is q_t·dataset_size (``dataset_size`` is the public constant n of the module docstring; it
    defaults to len(x), which is public under replace-one only: under add-remove the callers
    pass the declared count). Each step draws, from the one generator and in this order, the noise z_t
    (parameter by parameter) and then, when q_t < 1, the Poisson mask over all len(x) records.
    A single run computes per-example gradients for the batch's rows only (x[B_t]: about q_t·n of
    them, none at all for an empty batch; :func:`dpsgd_step` says why this equals the masked sum
    over all rows). ``replicas=R`` runs R independent copies at once (params then carry a
    leading axis of size R; used for Monte Carlo studies), each with its own noise and batches;
    their batches differ in size, so there every row's gradient is computed and the mask zeroes
    the unsampled ones.
    ``progress`` is called after every step (a progress bar; it sees nothing of the run).
    ``before_step(params)`` is called before every step with the current iterate (already a DP
    output of the steps before): what it changes must depend on public data only (e.g. norm
    statistics measured on public records), so that each step stays the Gaussian mechanism
    the accountant composes (adaptive composition).
    ``optimizer`` (default plain SGD, the update of :func:`dpsgd_step`) turns each step's
    privatised gradient (:func:`privatised_gradient`) into the update by
    :func:`optimizer_update`; the noise and batches drawn are the same whatever it is.
    """
    n_records = int(x.shape[0])
    if n_records == 0:
        raise InvalidArgument("x", "training set is empty")
    if int(y.shape[0]) != n_records:
        raise InvalidArgument("y", f"has {int(y.shape[0])} labels for {n_records} inputs")
    n = n_records if dataset_size is None else dataset_size
    _check_steps(steps, n)
    if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas <= 0):
        raise InvalidArgument("replicas", f"must be a positive integer, got {replicas!r}")
    # All noise and batch sampling come from the release's own NumPy PCG64 stream (128-bit
    # CSPRNG seed, or the recorded fixed seed), the same source as every other mechanism here;
    # drawn in float64 and cast to the parameters' dtype.
    if not isinstance(optimizer, Optimizer):
        raise InvalidArgument("optimizer", f"must be an Optimizer, got {type(optimizer).__name__}")
    plain = optimizer.name == "sgd"
    gen = randomness.generator
    params = {k: v.detach().clone() for k, v in params0.items()}
    state: dict[str, dict[str, torch.Tensor]] = {}
    if replicas is not None:
        params = {k: v.unsqueeze(0).repeat(replicas, *([1] * v.dim())) for k, v in params.items()}
        step_fn = vmap(
            lambda p, z, m, lr, c, s, d: dpsgd_step(
                loss_fn, p, x, y, learning_rate=lr, clip_norm=c, noise_multiplier=s, denominator=d, noise=z, mask=m
            ),
            in_dims=(0, 0, 0, None, None, None, None),
        )
        gradient_fn = vmap(
            lambda p, z, m, c, s, d: privatised_gradient(
                loss_fn, p, x, y, clip_norm=c, noise_multiplier=s, denominator=d, noise=z, mask=m
            ),
            in_dims=(0, 0, 0, None, None, None),
        )
    batch_sizes: list[int] | None = None
    for t, s in enumerate(steps, start=1):
        if before_step is not None:
            before_step(params)
        lead = () if replicas is None else (replicas,)
        noise, sampled = draw_step(gen, params, n_records, float(s.sample_rate), lead)
        if sampled is not None:
            batch_sizes = batch_sizes if batch_sizes is not None else []
            batch_sizes.extend(int(v) for v in sampled.sum(axis=-1).reshape(-1).tolist())
        if replicas is None:
            params = take_step(loss_fn, params, x, y, s, dataset_size=n, noise=noise, sampled=sampled,
                               optimizer=optimizer, state=state, t=t)  # fmt: skip
        else:
            q = float(s.sample_rate)
            denominator = q * n
            if sampled is not None:
                mask = torch.from_numpy(sampled).to(x.dtype)
            else:
                mask = torch.ones(*lead, n_records, dtype=x.dtype)
            lr, c, sigma = float(s.learning_rate), float(s.clip_norm), float(s.noise_multiplier)
            with torch.no_grad():
                if not plain:
                    g_hat = gradient_fn(params, noise, mask, c, sigma, denominator)
                    params = optimizer_update(optimizer, params, g_hat, state, t, lr)
                else:
                    params = step_fn(params, noise, mask, lr, c, sigma, denominator)
        if progress is not None:
            progress()
    return DPSGDRun({k: v.detach() for k, v in params.items()}, None if batch_sizes is None else tuple(batch_sizes))


def module_loss(model: torch.nn.Module, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> LossFn:
    """ℓ(θ; x_i, y_i) = ``loss``(model_θ(x_i[None]), y_i[None]): ``model`` called functionally with
    the given parameters on a batch of one example, ``loss`` of (outputs, labels) on it."""

    def per_example(params: dict[str, torch.Tensor], x_i: torch.Tensor, y_i: torch.Tensor) -> torch.Tensor:
        return loss(functional_call(model, params, (x_i.unsqueeze(0),)), y_i.unsqueeze(0))

    return per_example


def classifier_loss(model: torch.nn.Module) -> LossFn:
    """Cross-entropy of ``model`` (called functionally with the given parameters) on one example."""
    return module_loss(model, torch.nn.functional.cross_entropy)


# --------------------------------------------------------------------------------------------
# Classifiers and pools: the runs above, with their release records


@dataclass(frozen=True)
class TrainedModel:
    """One DP-SGD model and its complete mechanism description.

    ``training`` is exactly the sequence of steps that ran (the accountant's TrainingRecord);
    ``record`` is its "dpsgd" release record (level "data", ε/δ from the accountant);
    ``dataset_size`` is the public n of the update's denominator (declared under add-remove)."""

    architecture: dict
    arrays: dict[str, np.ndarray]
    training: TrainingRecord
    record: ReleaseRecord
    dataset_size: int
    init_seed: int


#: Where a record's ``dataset_size`` came from: set by the operator, or the true count
#: (replace-one only).
DATASET_SIZE_SOURCES = ("declared", "count")
ADD_REMOVE_NEEDS_DECLARED = (
    "under add-remove adjacency the number of training records is private (neighbouring datasets "
    "differ in it): DP-SGD divides by a public constant the operator declares (declared_records: "
    "privfusion pool train --declared-records N, [site] declared_records in site.toml, or "
    "[round.iterate] declared_records), never by the true count"
)


def declared_size(training: TrainingRecord, x, dataset_size: int | None) -> tuple[int, str]:
    """(n, source) of a run's denominator: the given ``dataset_size`` ("declared"), else the
    number of records ``len(x)`` ("count"), which is public under replace-one only; under
    add-remove a missing ``dataset_size`` is refused (InvalidArgument naming the rule)."""
    if dataset_size is not None:
        return dataset_size, "declared"
    if training.adjacency == "add-remove":
        raise InvalidArgument("dataset_size", ADD_REMOVE_NEEDS_DECLARED)
    return len(x), "count"


_G_HAT = "g_t = (sum_{i in B_t} clip_{C_t}(grad_i) + sigma_t * C_t * z_t) / (q_t * n)"
# the update rule in words, one per optimiser (its constants are in parameters.training.optimizer);
# the SGD text is the one every earlier record carries
_UPDATES = {
    "sgd": "theta <- theta - lr_t * (sum_{i in B_t} clip_{C_t}(grad_i) + sigma_t * C_t * z_t) / (q_t * n)",
    "momentum": f"{_G_HAT}; v_t = momentum * v_(t-1) + g_t (v_0 = 0); theta <- theta - lr_t * v_t",
    "adam": f"{_G_HAT}; m_t = beta1 * m_(t-1) + (1 - beta1) * g_t; v_t = beta2 * v_(t-1) + (1 - beta2) * g_t^2 "
    "(m_0 = v_0 = 0); theta <- theta - lr_t * (m_t / (1 - beta1^t)) / (sqrt(v_t / (1 - beta2^t)) + eps)",
}


def dpsgd_release_record(
    training: TrainingRecord,
    *,
    delta: float,
    dataset_size: int,
    randomness: Randomness,
    init_seed: int,
    architecture: Mapping,
    subject: str = "",
    source: str = "declared",
) -> ReleaseRecord:
    """The "dpsgd" release record of one run (built by the accountant: ε by PLD
    at ``delta``, RDP and closed form in parameters), plus the public constants of this run's
    update: the ``dataset_size`` n and where it comes from (``dataset_size_source``:
    "declared", a constant the operator set, or "count", the number of training records —
    public under replace-one only, so refused under add-remove), the public ``init_seed`` and
    the architecture."""
    if source not in DATASET_SIZE_SOURCES:
        raise InvalidArgument("dataset_size_source", f"must be one of {DATASET_SIZE_SOURCES}, got {source!r}")
    if training.adjacency == "add-remove" and source != "declared":
        raise InvalidArgument("dataset_size", ADD_REMOVE_NEEDS_DECLARED)
    record = dpsgd_record(training, delta, randomness=randomness.record_fields(), subject=subject)
    params = record.to_dict()["parameters"]
    params.update(
        {
            "dataset_size": int(dataset_size),
            "dataset_size_source": source,
            "init_seed": int(init_seed),
            "architecture": dict(architecture),
            "update": _UPDATES[training.optimizer.name],
        }
    )
    return record.with_(parameters=params)


def train_dpsgd_classifier(
    architecture: Mapping,
    x: np.ndarray,
    y: np.ndarray,
    training: TrainingRecord,
    *,
    init_seed: int,
    randomness: Randomness,
    delta: float,
    dataset_size: int | None = None,
    subject: str = "",
    progress: Callable[[], None] | None = None,
    init: Mapping[str, np.ndarray] | None = None,
    init_description: str = "",
) -> TrainedModel:
    """Train ``architecture`` (peer.nn.architectures) on (x, y) with cross-entropy by DP-SGD, running
    exactly ``training.steps`` (taken with ``training.optimizer``) from the public initialisation build_model(arch, seed=init_seed),
    or from the arrays ``init`` where given. ``init`` must be public — a model trained on public
    records only, say: it is not charged; ``init_description`` (required with it) says what it is
    and goes into the record as ``initialisation``.
    The unit of privacy is one record of (x, y) under ``training.adjacency``."""
    arch = validate_architecture(architecture)
    check_accountable(training)  # before any training: a record the accountant cannot cost is refused now
    n, source = declared_size(training, x, dataset_size)  # before any training, too
    if init is not None and not init_description:
        raise InvalidArgument("init_description", "a given initialisation must say what public data it comes from")
    model = build_model(arch, seed=init_seed) if init is None else model_from_arrays(arch, init)
    xt = input_tensor(arch, x)
    yt = torch.as_tensor(np.asarray(y), dtype=torch.long)
    params0 = {k: v.detach() for k, v in model.named_parameters()}
    run = run_dpsgd(
        classifier_loss(model),
        params0,
        xt,
        yt,
        training.steps,
        randomness=randomness,
        dataset_size=n,
        progress=progress,
        optimizer=training.optimizer,
    )
    arrays = {k: v.numpy().astype(np.float32) for k, v in run.params.items()}
    record = dpsgd_release_record(
        training,
        delta=delta,
        dataset_size=n,
        randomness=randomness,
        init_seed=init_seed,
        architecture=arch,
        subject=subject,
        source=source,
    )
    if init is not None:
        record = record.with_(parameters={**record.parameters, "initialisation": init_description})
    return TrainedModel(arch, arrays, training, record, int(n), int(init_seed))


def train_pool(
    architecture: Mapping,
    x: np.ndarray,
    y: np.ndarray,
    trainings: Sequence[TrainingRecord],
    *,
    init_seed: int,
    randomness: Randomness,
    delta: float,
    dataset_size: int | None = None,
    progress: Callable[[], None] | None = None,
    init: Mapping[str, np.ndarray] | None = None,
    init_description: str = "",
) -> list[TrainedModel]:
    """Several DP-SGD models on the same data from the same public initialisation (``init_seed``,
    or the public arrays ``init``: :func:`train_dpsgd_classifier`), each with its
    own independent noise stream (``randomness.spawn()``): the independence LC relies on.
    ``dataset_size`` is the declared n (required under add-remove: :func:`declared_size`)."""
    if not trainings:
        raise InvalidArgument("trainings", "must describe at least one model")
    adjacencies = {t.adjacency for t in trainings}
    if len(adjacencies) > 1:
        raise InvalidArgument("trainings", f"one pool has one unit of privacy; got adjacencies {sorted(adjacencies)}")
    declared_size(trainings[0], x, dataset_size)  # refused before the first model trains
    return [
        train_dpsgd_classifier(
            architecture,
            x,
            y,
            t,
            init_seed=init_seed,
            randomness=randomness.spawn(),
            delta=delta,
            dataset_size=dataset_size,
            progress=progress,
            init=init,
            init_description=init_description,
        )
        for t in trainings
    ]


# --------------------------------------------------------------------------------------------
# A site's own network (peer.nn.imported): DP-SGD on an arbitrary module


def check_private_training(module: torch.nn.Module) -> None:
    """Refuse, naming the module, what per-example DP-SGD cannot train.

    DP-SGD's guarantee needs each record's gradient to depend on that record alone (the clipped
    sum then has sensitivity C). A BatchNorm normalising with *batch* statistics mixes the
    records of a batch: one record moves every other record's gradient, and per-example
    clipping bounds nothing. Of the two known ways out — train with the norm layers in eval
    mode (their running statistics frozen), or replace BatchNorm by GroupNorm as Opacus's
    ``ModuleValidator.fix`` does — this project freezes: replacing layers would change the
    network's parameters and structure, so the pool's models would no longer be the site's
    architecture and could not be aligned or fused with its own model (their structure digest
    would differ). So the whole module runs in eval mode during DP-SGD: BatchNorm normalises by
    its running statistics, constants of each step (their initial values, or statistics of
    public records: :func:`train_dpsgd_module`), and only its γ and β are trained; Dropout is
    off. What eval mode cannot fix is refused: a BatchNorm without running statistics
    (``track_running_stats=False`` normalises by the batch even in eval mode)."""
    for name, m in module.named_modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and (
            not m.track_running_stats or m.running_mean is None
        ):
            raise InvalidArgument(
                f"model.{name}",
                f"{type(m).__name__} without running statistics normalises each batch by its own records, "
                "so per-example gradients (DP-SGD) are not defined; use track_running_stats=True (it is then "
                "frozen during DP-SGD) or a per-example norm (GroupNorm, LayerNorm)",
            )


@torch.no_grad()
def public_norm_statistics(module: torch.nn.Module, params: Mapping[str, torch.Tensor], public_x: torch.Tensor) -> None:
    """Set every BatchNorm's running mean and variance to its input's per-channel mean and
    variance on ``public_x`` under ``params``, measured in one pass in execution order (each
    BatchNorm normalises by these statistics before the next is measured)."""
    norms = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    saved = [(m.momentum, m.training) for m in norms]
    try:
        for m in norms:
            m.reset_running_stats()
            m.momentum = None  # cumulative average: one pass gives the exact statistics
            m.train()
        functional_call(module, dict(params), (public_x,))
    finally:
        for m, (momentum, training) in zip(norms, saved, strict=True):
            m.momentum = momentum
            m.train(training)


def train_dpsgd_module(
    factory: Callable[[], torch.nn.Module],
    architecture: Mapping,
    input_shape: Sequence[int],
    x: np.ndarray,
    y: np.ndarray,
    training: TrainingRecord,
    *,
    init_seed: int,
    randomness: Randomness,
    delta: float,
    dataset_size: int | None = None,
    subject: str = "",
    progress: Callable[[], None] | None = None,
    public_x: np.ndarray | None = None,
) -> TrainedModel:
    """DP-SGD on a site's own network, exactly as :func:`train_dpsgd_classifier` but from the
    module ``factory()`` builds under ``torch.manual_seed(init_seed)`` (a public
    initialisation: never the site's imported weights, which were trained on records outside
    any guarantee) and in eval mode (:func:`check_private_training` says why and what is
    refused). Only parameters are trained. BatchNorm's running statistics are constants of
    every step: their initial values (mean 0, variance 1), or, with ``public_x`` (records the
    site declares public, e.g. the pool's validation split), the per-channel mean and variance
    of the current iterate's activations on ``public_x``, measured before every step
    (:func:`public_norm_statistics`; a function of public data and earlier DP outputs only,
    so the accountant's per-step Gaussian mechanism is unchanged) — BatchNorm then normalises
    as in ordinary training, and the released model carries statistics of public data only.
    ``architecture`` is the public
    description recorded (``peer.nn.imported.imported_architecture``); the unit of privacy is
    one record of (x, y) under ``training.adjacency``."""
    check_accountable(training)  # before any training (see train_dpsgd_classifier)
    n, source = declared_size(training, x, dataset_size)
    from peer.nn.architectures import seeded_initialisation

    with seeded_initialisation(init_seed):
        module = factory()
    check_private_training(module)
    module = module.float().eval()
    xt = torch.as_tensor(np.asarray(x, dtype=np.float32)).reshape(len(x), *input_shape)
    yt = torch.as_tensor(np.asarray(y), dtype=torch.long)
    params0 = {k: v.detach() for k, v in module.named_parameters()}
    refresh = None
    if public_x is not None:
        px = torch.as_tensor(np.asarray(public_x, dtype=np.float32)).reshape(len(public_x), *input_shape)

        def refresh(params: dict[str, torch.Tensor]) -> None:
            public_norm_statistics(module, params, px)

    run = run_dpsgd(
        classifier_loss(module),
        params0,
        xt,
        yt,
        training.steps,
        randomness=randomness,
        dataset_size=n,
        progress=progress,
        before_step=refresh,
        optimizer=training.optimizer,
    )
    if refresh is not None:
        refresh(run.params)
    arrays = {}
    for k, v in module.state_dict().items():  # the site's key order, buffers included
        t = run.params.get(k, v)
        arrays[k] = np.array(t.detach().numpy(), copy=True)
    record = dpsgd_release_record(
        training,
        delta=delta,
        dataset_size=n,
        randomness=randomness,
        init_seed=init_seed,
        architecture=architecture,
        subject=subject,
        source=source,
    )
    record = record.with_(
        parameters={
            **record.parameters,
            "norm_layers": "eval mode; BatchNorm statistics measured on public records before every step"
            if public_x is not None
            else "eval mode: running statistics frozen at their initial values",
        }
    )
    return TrainedModel(dict(architecture), arrays, training, record, int(n), int(init_seed))
