"""How a pool model was made private, as small immutable values (dp_accounting's DpEvent habit):
``GaussianStep`` (one DP-SGD step), ``TrainingRecord`` (a training run: its steps, dataset size and
declared unit of privacy) and ``ApproxDP`` (a model known only by its final (ε, δ)).

Accountants (``peer.dp.accounting.profiles``, ``rs``, ``lc``, ``release_accounting``) interpret
these values; these classes only describe and validate.

Unit of privacy: one training record, with the adjacency written on every value:

- ``"replace-one"``: neighbouring datasets have the same size and differ in one record's value;
- ``"add-remove"``: one dataset is the other with one record added.

The DP-SGD step being described (``peer.dp.training``; Abadi et al. 2016, Alg. 1, with a
data-independent normalisation)::

    θ_{t+1} = θ_t − η_t · ( Σ_{i∈B_t} clip_{C_t}(∇ℓ(θ_t; x_i)) + σ_t C_t z_t ) / (q_t n),   z_t ~ N(0, I)

``n`` is the declared dataset size, a public constant, so the update is a post-processing of the
Gaussian mechanism on the clipped gradient sum. That sum has L2 sensitivity ``C_t`` under
add-remove and ``2 C_t`` under replace-one (the replaced record's clipped gradient leaves, the new
one enters: ‖g − g'‖ ≤ 2C); the noise std is ``σ_t C_t``. The factor η_t/(q_t n) scales the
sensitivity and the noise alike, so one model's per-step privacy depends only on (σ_t, q_t); η_t
and C_t matter when several models are combined linearly (``peer.dp.accounting.lc``).

The optimiser that turns each step's privatised gradient
ĝ_t = (Σ_{i∈B_t} clip_{C_t}(∇ℓ(θ_t; x_i)) + σ_t C_t z_t)/(q_t n) into a parameter update is
``TrainingRecord.optimizer`` (``Optimizer``): plain SGD θ_{t+1} = θ_t − η_t ĝ_t (the default, and the
meaning of every record without the field), heavy-ball momentum or Adam. Momentum and Adam read
ĝ_1..ĝ_t and public constants only, so they are post-processing of the same per-step Gaussian
releases: one model's privacy (every accountant's ε) does not depend on the optimiser. Only the
LC per-step surrogate does (it assumes θ_T = θ_0 − Σ_t η_t ĝ_t): ``peer.dp.accounting.lc``.

Because the record describes the *mechanism*, its guarantee can be derived under either adjacency
exactly (the sensitivity above changes, nothing else); ``TrainingRecord.adjacency`` is the unit of
privacy the model was declared under. An ``ApproxDP`` model, known only by its final (ε, δ), is
different: its guarantee holds for its own adjacency only (see ``ApproxDP.under``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from peer.base.checks import check_delta, check_epsilon
from peer.base.errors import InvalidArgument

ADJACENCIES = ("replace-one", "add-remove")
_STEP_FIELDS = ("learning_rate", "clip_norm", "noise_multiplier", "sample_rate")


def check_adjacency(adjacency: Any, field_name: str = "adjacency") -> str:
    """The adjacency, validated: one of ``ADJACENCIES`` exactly."""
    if adjacency not in ADJACENCIES:
        raise InvalidArgument(field_name, f"must be one of {ADJACENCIES}, got {adjacency!r}")
    return adjacency


def _number(value: Any, field_name: str) -> float:
    if isinstance(value, bool) or (not isinstance(value, (int, float)) and not hasattr(value, "__float__")):
        raise InvalidArgument(field_name, f"must be a number, got {value!r}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise InvalidArgument(field_name, f"must be a number, got {value!r}") from None
    if not math.isfinite(v):
        raise InvalidArgument(field_name, f"must be finite, got {value!r}")
    return v


@dataclass(frozen=True)
class GaussianStep:
    """One DP-SGD step: learning rate η, clip norm C, noise multiplier σ (noise std σ·C on the
    clipped sum), Poisson sample rate q (1 = full batch). σ = 0 describes a non-private step
    (every accountant then reports ε = ∞)."""

    learning_rate: float
    clip_norm: float
    noise_multiplier: float
    sample_rate: float = 1.0

    def __post_init__(self) -> None:
        lr = _number(self.learning_rate, "learning_rate")
        clip = _number(self.clip_norm, "clip_norm")
        sigma = _number(self.noise_multiplier, "noise_multiplier")
        q = _number(self.sample_rate, "sample_rate")
        if not lr > 0:
            raise InvalidArgument("learning_rate", f"must be > 0, got {self.learning_rate!r}")
        if not clip > 0:
            raise InvalidArgument("clip_norm", f"must be > 0, got {self.clip_norm!r}")
        if not sigma >= 0:
            raise InvalidArgument("noise_multiplier", f"must be >= 0, got {self.noise_multiplier!r}")
        if not 0 < q <= 1:
            raise InvalidArgument("sample_rate", f"must be in (0, 1], got {self.sample_rate!r}")
        for name, v in zip(_STEP_FIELDS, (lr, clip, sigma, q), strict=True):
            object.__setattr__(self, name, v)

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in _STEP_FIELDS}


OPTIMIZERS = ("sgd", "momentum", "adam")
# each optimiser's public constants and their defaults (PyTorch's and Kingma & Ba's)
_OPTIMIZER_DEFAULTS: dict[str, dict[str, float]] = {
    "sgd": {},
    "momentum": {"momentum": 0.9},
    "adam": {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8},
}


@dataclass(frozen=True)
class Optimizer:
    """How a DP-SGD run turns the privatised gradient ĝ_t of step t into an update (all
    constants public; η_t is the step's ``learning_rate``):

    - ``"sgd"``: θ_{t+1} = θ_t − η_t ĝ_t;
    - ``"momentum"`` (heavy ball, as ``torch.optim.SGD(momentum=β)``): v_t = β v_{t−1} + ĝ_t
      (v_0 = 0), θ_{t+1} = θ_t − η_t v_t;
    - ``"adam"`` (Kingma & Ba 2015, Alg. 1, as ``torch.optim.Adam``): m_t = β₁ m_{t−1} + (1−β₁) ĝ_t,
      v_t = β₂ v_{t−1} + (1−β₂) ĝ_t², θ_{t+1} = θ_t − η_t m̂_t / (√v̂_t + ε) with the bias
      corrections m̂_t = m_t/(1−β₁ᵗ), v̂_t = v_t/(1−β₂ᵗ) (elementwise).

    Every rule is a function of ĝ_1..ĝ_t and public constants: post-processing of the per-step
    Gaussian mechanism, so a model's privacy is the same whatever the optimiser. ``params``
    holds the optimiser's constants (``momentum``; ``beta1``, ``beta2``, ``eps``); a missing one
    takes its default (momentum 0.9; β₁ 0.9, β₂ 0.999, ε 1e-8)."""

    name: str = "sgd"
    params: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise InvalidArgument("optimizer", f"must be one of {OPTIMIZERS}, got {self.name!r}")
        defaults = _OPTIMIZER_DEFAULTS[self.name]
        given = dict(self.params)
        unknown = sorted(set(given) - set(defaults))
        if unknown:
            allowed = sorted(defaults) if defaults else "none"
            raise InvalidArgument(
                f"optimizer.{unknown[0]}", f"is not a parameter of {self.name!r} (its parameters: {allowed})"
            )
        values = {k: _number(given.get(k, d), f"optimizer.{k}") for k, d in defaults.items()}
        for k in ("momentum", "beta1", "beta2"):
            if k in values and not 0 <= values[k] < 1:
                raise InvalidArgument(f"optimizer.{k}", f"must be in [0, 1), got {values[k]!r}")
        if "eps" in values and not values["eps"] > 0:
            raise InvalidArgument("optimizer.eps", f"must be > 0, got {values['eps']!r}")
        object.__setattr__(self, "params", tuple(sorted(values.items())))

    @classmethod
    def of(cls, name: str = "sgd", **params: float) -> Optimizer:
        return cls(name, tuple(params.items()))

    def __getitem__(self, key: str) -> float:
        return dict(self.params)[key]

    def to_dict(self) -> dict:
        return {"name": self.name, **dict(self.params)}

    @classmethod
    def from_dict(cls, data: Any, field_name: str = "optimizer") -> Optimizer:
        if not isinstance(data, Mapping) or not isinstance(data.get("name"), str):
            raise InvalidArgument(field_name, f"must be an object with a 'name' in {OPTIMIZERS}, got {data!r}")
        try:
            return cls(data["name"], tuple((k, v) for k, v in data.items() if k != "name"))
        except InvalidArgument as e:
            raise InvalidArgument(field_name + e.field.removeprefix("optimizer"), e.rule) from None


SGD = Optimizer()


@dataclass(frozen=True, repr=False)
class TrainingRecord:
    """A DP-SGD run as the accountant sees it: the adjacency it was declared under and every
    step's public hyperparameters. ``to_dict`` run-length encodes repeated steps, so a run of
    T = 10,000 identical steps is one entry ``{"count": 10000, ...}``.

    ``state_independent_gradients`` is a declaration by whoever ran the training: every clipped
    per-example gradient clip_{C_t}(∇ℓ(θ_t; x)) is a function of the record x (and public
    values) alone, never of the model's own parameters θ_t — e.g. a linear loss ℓ(θ; x) = −⟨θ, x⟩,
    Gaussian mean estimation by DP-GD. Only then is a linear combination of runs one Gaussian
    mechanism that the LC per-step surrogate bounds (``peer.dp.accounting.lc``). Default False; DP-SGD
    on a neural network never sets it (its gradients depend on its weights). It changes nothing in
    one model's own privacy; it is serialised only when True.

    ``optimizer`` says how each step's privatised gradient became the update (``Optimizer``;
    post-processing, so it changes no accountant's ε for this model). It is serialised only
    when it is not plain SGD, so a record without the field — every record written before the
    field existed — means SGD and keeps its bytes and digests."""

    adjacency: str
    steps: tuple[GaussianStep, ...]
    state_independent_gradients: bool = False
    optimizer: Optimizer = SGD
    _runs: tuple[tuple[GaussianStep, int], ...] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        check_adjacency(self.adjacency)
        if not isinstance(self.state_independent_gradients, bool):
            raise InvalidArgument(
                "state_independent_gradients", f"must be true or false, got {self.state_independent_gradients!r}"
            )
        if not isinstance(self.optimizer, Optimizer):
            raise InvalidArgument("optimizer", f"must be an Optimizer, got {type(self.optimizer).__name__}")
        steps = tuple(self.steps)
        if not steps:
            raise InvalidArgument("steps", "must contain at least one step")
        for t, s in enumerate(steps):
            if not isinstance(s, GaussianStep):
                raise InvalidArgument(f"steps[{t}]", f"must be a GaussianStep, got {type(s).__name__}")
        runs: list[list] = []
        for s in steps:
            if runs and runs[-1][0] == s:
                runs[-1][1] += 1
            else:
                runs.append([s, 1])
        object.__setattr__(self, "steps", steps)
        object.__setattr__(self, "_runs", tuple((s, n) for s, n in runs))

    def __hash__(self) -> int:
        # the runs (maximal runs of equal steps) determine the steps and are short: hashing them
        # instead of 10,000 steps makes a profile cache lookup cheap; equal records have equal runs
        return hash((self.adjacency, self._runs, self.state_independent_gradients, self.optimizer))

    def __repr__(self) -> str:
        runs = ", ".join(f"{n}x{s!r}" for s, n in self._runs)
        declared = ", state_independent_gradients=True" if self.state_independent_gradients else ""
        opt = "" if self.optimizer == SGD else f", optimizer={self.optimizer!r}"
        return f"TrainingRecord(adjacency={self.adjacency!r}, runs=[{runs}]{declared}{opt})"

    @classmethod
    def constant(
        cls,
        adjacency: str,
        steps: int,
        learning_rate: float,
        clip_norm: float,
        noise_multiplier: float,
        sample_rate: float = 1.0,
        *,
        state_independent_gradients: bool = False,
        optimizer: Optimizer = SGD,
    ) -> TrainingRecord:
        """``steps`` identical steps."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
            raise InvalidArgument("steps", f"must be a positive integer, got {steps!r}")
        return cls(
            adjacency,
            (GaussianStep(learning_rate, clip_norm, noise_multiplier, sample_rate),) * steps,
            state_independent_gradients,
            optimizer,
        )

    @classmethod
    def from_runs(
        cls,
        adjacency: str,
        runs: Iterable[tuple[GaussianStep, int]],
        *,
        state_independent_gradients: bool = False,
        optimizer: Optimizer = SGD,
    ) -> TrainingRecord:
        steps: list[GaussianStep] = []
        for i, (s, n) in enumerate(runs):
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise InvalidArgument(f"steps[{i}].count", f"must be a positive integer, got {n!r}")
            steps.extend([s] * n)
        return cls(adjacency, tuple(steps), state_independent_gradients, optimizer)

    def with_optimizer(self, optimizer: Optimizer) -> TrainingRecord:
        """The same steps, taken with ``optimizer``."""
        return TrainingRecord(self.adjacency, self.steps, self.state_independent_gradients, optimizer)

    @property
    def runs(self) -> tuple[tuple[GaussianStep, int], ...]:
        """Maximal runs of identical consecutive steps: ((step, count), ...)."""
        return self._runs

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def full_batch(self) -> bool:
        return all(s.sample_rate == 1.0 for s, _ in self._runs)

    @property
    def private(self) -> bool:
        """False when some step adds no noise (σ = 0): no finite guarantee then."""
        return all(s.noise_multiplier > 0 for s, _ in self._runs)

    def to_dict(self) -> dict:
        out = {"adjacency": self.adjacency, "steps": [{"count": n, **s.to_dict()} for s, n in self._runs]}
        if self.state_independent_gradients:
            out["state_independent_gradients"] = True
        if self.optimizer != SGD:
            out["optimizer"] = self.optimizer.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], field_name: str = "training") -> TrainingRecord:
        """Inverse of ``to_dict``; every error names the offending entry (``training.steps[2].clip_norm``)."""
        if not isinstance(data, Mapping):
            raise InvalidArgument(field_name, "must be an object with 'adjacency' and 'steps'")
        unknown = set(data) - {"adjacency", "steps", "state_independent_gradients", "optimizer"}
        if unknown:
            raise InvalidArgument(field_name, f"unknown fields {sorted(unknown)}")
        adjacency = check_adjacency(data.get("adjacency"), f"{field_name}.adjacency")
        declared = data.get("state_independent_gradients", False)
        if not isinstance(declared, bool):
            raise InvalidArgument(
                f"{field_name}.state_independent_gradients", f"must be true or false, got {declared!r}"
            )
        # absent: plain SGD, what every record written before the field existed means
        optimizer = Optimizer.from_dict(data["optimizer"], f"{field_name}.optimizer") if "optimizer" in data else SGD
        raw = data.get("steps")
        if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)) or not raw:
            raise InvalidArgument(f"{field_name}.steps", "must be a non-empty list of runs")
        runs = []
        for i, run in enumerate(raw):
            where = f"{field_name}.steps[{i}]"
            if not isinstance(run, Mapping):
                raise InvalidArgument(where, "must be an object")
            unknown = set(run) - {"count", *_STEP_FIELDS}
            if unknown:
                raise InvalidArgument(where, f"unknown fields {sorted(unknown)}")
            missing = [k for k in ("count", *_STEP_FIELDS) if k not in run]
            if missing:
                raise InvalidArgument(f"{where}.{missing[0]}", "is required")
            count = run["count"]
            if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
                raise InvalidArgument(f"{where}.count", f"must be a positive integer, got {count!r}")
            try:
                step = GaussianStep(*(run[k] for k in _STEP_FIELDS))
            except InvalidArgument as e:
                raise InvalidArgument(f"{where}.{e.field}", e.rule) from None
            runs.append((step, count))
        return cls.from_runs(adjacency, runs, state_independent_gradients=declared, optimizer=optimizer)


@dataclass(frozen=True)
class ApproxDP:
    """A model known only by its final (ε, δ)-DP guarantee for ``adjacency``.

    Its worst-case privacy profile is that of the (ε, δ) "randomised response" pair (Kairouz, Oh
    & Viswanath 2015: every (ε, δ)-DP mechanism is a post-processing of it), which dp-accounting
    builds with ``from_privacy_parameters``. Its RDP is infinite when δ > 0.
    """

    epsilon: float
    delta: float
    adjacency: str

    def __post_init__(self) -> None:
        eps = check_epsilon(self.epsilon, "epsilon", zero=True)
        delta = check_delta(self.delta, "delta", zero=True)
        check_adjacency(self.adjacency)
        object.__setattr__(self, "epsilon", eps)
        object.__setattr__(self, "delta", delta)

    def under(self, adjacency: str) -> ApproxDP:
        """The guarantee under ``adjacency``.

        add-remove → replace-one: a replacement is a removal then an addition, so by group
        privacy for two steps an (ε, δ) add-remove guarantee gives (2ε, (1 + e^ε) δ) for
        replace-one (Dwork & Roth 2014, Thm 2.2 generalised to δ > 0). replace-one → add-remove
        does not follow (a replace-one mechanism may publish the dataset size), so it is refused.
        """
        check_adjacency(adjacency)
        if adjacency == self.adjacency:
            return self
        if adjacency == "add-remove":
            raise InvalidArgument(
                "adjacency",
                "an (epsilon, delta) guarantee for replace-one implies nothing for add-remove "
                "(the mechanism may reveal the dataset size); account the merge under replace-one",
            )
        delta = (1.0 + math.exp(self.epsilon)) * self.delta
        if delta >= 1:
            raise InvalidArgument(
                "adjacency",
                f"converting ({self.epsilon}, {self.delta}) add-remove to replace-one by group "
                f"privacy gives delta = {delta:.3g} >= 1: no guarantee; account under add-remove",
            )
        return ApproxDP(2.0 * self.epsilon, delta, "replace-one")

    def to_dict(self) -> dict:
        return {"epsilon": self.epsilon, "delta": self.delta, "adjacency": self.adjacency}
