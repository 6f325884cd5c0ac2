"""One accountant: holds the Rényi orders and the PLD discretisation, and interprets events.

``Accountant(orders=…, value_discretization_interval=…)`` reads a typed event
(``peer.dp.accounting.events``) — or a ``ReleaseRecord``, read into its event first — and gives
its RDP curve at the orders (:meth:`Accountant.rdp`), a dp-accounting PrivacyLossDistribution
(pessimistic, :meth:`Accountant.pld`), (ε by PLD, ε by RDP) at a δ (:meth:`Accountant.epsilon`)
and whether it can interpret it at all (:meth:`Accountant.supports`). Interpretation dispatches
on the event's class through two registries (``_RDP``, ``_PLD``), one function per kind:

- :class:`LaplaceRelease`: ε = Δ₁/b; RDP by Mironov 2017 Prop. 6 (``rdp.rdp_laplace``), PLD by
  dp-accounting's ``from_laplace_mechanism``.
- :class:`MultiBitRelease`: pure ε-DP; RDP and PLD of binary randomised response with that ε,
  the dominating pair of every ε-DP mechanism.
- :class:`GaussianRelease`: μ = Δ₂/σ; RDP order·μ²/2, PLD dp-accounting's Gaussian PLD.
- :class:`Composition`: ``sequential`` — RDP summed, PLDs composed; ``parallel`` (components
  touch disjoint units, so a neighbouring pair changes one component) — RDP: the elementwise
  maximum over components (for each pair the divergence is that of the one component that
  changed). PLD: a single PLD dominating every component is needed. We return the dominating
  component's PLD when the components are ordered by one parameter (all Gaussian: largest μ;
  all Laplace: largest ε; pure ε-DP kinds — multi-bit and Laplace — randomised response with
  the largest ε), or when one component dominates every other one mechanism by mechanism
  (``_dominates``: each is a sequential composition of Gaussian / Laplace / multi-bit releases,
  and the other's can be matched one to one to its own of the same kind with a parameter at
  least as large — a features release's layers, (Laplace ε_x then multi-bit ε_w) each, against
  its output layer's multi-bit ε_w). Otherwise we fall back to the sequential composition of
  the components, which dominates each of them (sound, conservative, and possibly above the RDP
  figure, which takes the maximum exactly); :meth:`Accountant.pld_fallbacks` counts where that
  happened so reports can say so.
- :class:`DpSgdTraining`: the training record's profile under the event's adjacency
  (``profiles.model_rdp`` / ``profiles.privacy_profile``; registered by ``profiles``).
- :class:`RandomSelectionMerge` / :class:`LinearCombinationMerge`: the RS / LC accountants on
  the listed models and weights (registered by ``rs`` and ``lc``, which take this accountant). An LC merge is interpreted by its charged, proven bound
  (``lc.lc_rdp`` / ``lc.lc_pld``): the composition of the models with λ_i > 0, or the per-step
  surrogate only when every such model's training record declares state-independent
  gradients. A merge whose weights were chosen by measured utility (``scored`` set) is
  post-processing of releasing every scored model: it is interpreted as their composition (RDP
  summed, PLDs composed).
- :class:`DistributedSkellamSteps`: RDP only — Agarwal, Kairouz & Liu's Skellam bound at the
  honest shares' variance (k − t)·v, Poisson-subsampled by Zhu & Wang's bound, times the steps
  (``skellam.rdp_skellam_steps``; registered by ``skellam``). No PLD is offered for it (a
  dominating pair for the subsampled multi-dimensional Skellam is not implemented):
  :meth:`Accountant.supports` says so (``pld`` False, with the reason) and the ledger charges the
  RDP figure, which is the filter's figure anyway; :meth:`Accountant.pld` refuses it
  (FailedPrecondition, reason PLD_NOT_OFFERED) and :meth:`Accountant.epsilon` gives None for the
  PLD figure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from peer.base.checks import check_delta
from peer.base.errors import FailedPrecondition, InvalidArgument
from peer.base.records import ReleaseRecord
from peer.dp.accounting import pld as pldm
from peer.dp.accounting.conversions import DEFAULT_ORDERS, check_orders, pld_epsilon, rdp_to_epsilon
from peer.dp.accounting.events import (
    Composition,
    Event,
    GaussianRelease,
    LaplaceRelease,
    MultiBitRelease,
    event_of,
)
from peer.dp.accounting.pld import DEFAULT_INTERVAL
from peer.dp.accounting.rdp import rdp_gaussian, rdp_laplace, rdp_pure


@dataclass(frozen=True)
class Support:
    """Whether an accountant can interpret a release (charge it: its RDP), and if not why (the
    field and the rule). ``pld`` says whether a PLD is offered too; when it is not (a mechanism
    registered with :func:`pld_not_offered`), ``reason`` says so and that the RDP figure is
    what is charged."""

    supported: bool
    reason: str = ""
    pld: bool = True

    def __bool__(self) -> bool:
        return self.supported


_RDP: dict[type, Callable[[Accountant, Event], np.ndarray]] = {}
_PLD: dict[type, Callable[[Accountant, Event], pldm.PLD]] = {}
#: kinds interpreted by RDP alone, with the reason no PLD is offered
_NO_PLD: dict[type, str] = {}


def rdp_of(kind: type):
    """Register the RDP interpreter ``fn(accountant, event) -> curve at accountant.orders`` of ``kind``."""

    def register(fn):
        _RDP[kind] = fn
        return fn

    return register


def pld_of(kind: type):
    """Register the PLD interpreter ``fn(accountant, event) -> pessimistic PLD`` of ``kind``."""

    def register(fn):
        _PLD[kind] = fn
        return fn

    return register


def pld_not_offered(kind: type, reason: str) -> None:
    """Declare that ``kind`` is interpreted by RDP alone (no PLD), and why."""
    _NO_PLD[kind] = reason


class Accountant:
    """RDP at fixed ``orders`` and PLDs at a fixed ``value_discretization_interval``."""

    def __init__(
        self,
        orders: Sequence[float] = DEFAULT_ORDERS,
        value_discretization_interval: float = DEFAULT_INTERVAL,
    ):
        orders = np.array(check_orders(orders))
        orders.flags.writeable = False  # an accountant is shared (DEFAULT_ACCOUNTANT): never changed
        self._orders = orders
        self._interval = pldm.check_interval(value_discretization_interval)

    @property
    def orders(self) -> np.ndarray:
        """The Rényi orders the RDP curves are given at (read-only)."""
        return self._orders

    @property
    def value_discretization_interval(self) -> float:
        """The PLDs' value discretisation interval."""
        return self._interval

    def __repr__(self) -> str:
        return (
            f"Accountant(orders=<{len(self.orders)} orders {self.orders[0]:g}..{self.orders[-1]:g}>, "
            f"value_discretization_interval={self.value_discretization_interval:g})"
        )

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Accountant)
            and self.orders.shape == other.orders.shape
            and bool(np.all(self.orders == other.orders))
            and self.value_discretization_interval == other.value_discretization_interval
        )

    def __hash__(self) -> int:
        return hash((tuple(self.orders.tolist()), self.value_discretization_interval))

    def with_orders(self, orders: Sequence[float]) -> Accountant:
        """The same discretisation at other orders (a ledger's filter fixes its own)."""
        return Accountant(orders, self.value_discretization_interval)

    @staticmethod
    def event(release: ReleaseRecord | Event) -> Event:
        """The typed event of ``release`` (a record is read by ``events.event_of``)."""
        if isinstance(release, ReleaseRecord):
            return event_of(release)
        if type(release) not in _RDP:
            raise InvalidArgument("record", f"must be a ReleaseRecord or an event, got {type(release).__name__}")
        return release

    def supports(self, release: ReleaseRecord | Event) -> Support:
        """Whether :meth:`rdp` and :meth:`pld` can interpret ``release``; if not, why. A release
        with a part of a kind that offers no PLD (:func:`pld_not_offered`) is supported with
        ``pld`` False: its RDP figure is charged."""
        try:
            event = self.event(release)
        except InvalidArgument as e:
            return Support(False, f"{e.field}: {e.rule}")
        parts = list(_walk(event))
        missing = [
            type(e).__name__ for e in parts if type(e) not in _RDP or (type(e) not in _PLD and type(e) not in _NO_PLD)
        ]
        if missing:
            return Support(False, f"no accountant for {sorted(set(missing))}")
        if any(type(e) not in _PLD for e in parts):
            why = "; ".join(
                f"{n}: {_NO_PLD[k]}"
                for n, k in sorted(
                    {(type(e).__name__, type(e)) for e in parts if type(e) not in _PLD}, key=lambda x: x[0]
                )
            )
            return Support(True, f"PLD not offered for this mechanism ({why}); RDP figure charged", pld=False)
        return Support(True)

    def rdp(self, release: ReleaseRecord | Event) -> np.ndarray:
        """RDP ε at each of the accountant's orders (module docstring per kind)."""
        event = self.event(release)
        return _RDP[type(event)](self, event)

    def pld(self, release: ReleaseRecord | Event) -> pldm.PLD:
        """A dp-accounting PrivacyLossDistribution (pessimistic) of the release; refused
        (FailedPrecondition, reason PLD_NOT_OFFERED) for a kind interpreted by RDP alone."""
        event = self.event(release)
        if type(event) in _NO_PLD:
            raise FailedPrecondition(
                f"PLD not offered for this mechanism ({type(event).__name__}: {_NO_PLD[type(event)]}); RDP figure charged",
                reason="PLD_NOT_OFFERED",
                metadata={"event": type(event).__name__},
            )
        return _PLD[type(event)](self, event)

    def epsilon(self, release: ReleaseRecord | Event, delta: float) -> tuple[float | None, float]:
        """(ε by PLD, ε by RDP) at ``delta``; the PLD figure is None when no PLD is offered
        for some part of the release (:meth:`supports` says which)."""
        delta = check_delta(delta)
        event = self.event(release)
        rdp_eps = rdp_to_epsilon(self.orders, self.rdp(event), delta)
        if not self.supports(event).pld:
            return None, rdp_eps
        return pld_epsilon(self.pld(event), delta), rdp_eps

    def pld_fallbacks(self, release: ReleaseRecord | Event) -> int:
        """How many parallel compositions in the release get the conservative PLD of
        :meth:`pld` (the sequential composition of their parts: no part dominates)."""
        event = self.event(release)
        if not isinstance(event, Composition):
            return 0
        inner = sum(self.pld_fallbacks(c) for c in event.events)
        if event.how != "parallel" or _ordered_family(event.events) is not None:
            return inner
        dominant = _dominant(event.events)
        return self.pld_fallbacks(dominant) if dominant is not None else inner + 1


def _walk(event: Event):
    yield event
    if isinstance(event, Composition):
        for c in event.events:
            yield from _walk(c)


# ---- one function per kind ---------------------------------------------------------------------


@rdp_of(LaplaceRelease)
def _laplace_rdp(acc: Accountant, e: LaplaceRelease) -> np.ndarray:
    return rdp_laplace(e.epsilon, acc.orders)


@pld_of(LaplaceRelease)
def _laplace_pld(acc: Accountant, e: LaplaceRelease) -> pldm.PLD:
    return pldm.laplace_pld(e.epsilon, acc.value_discretization_interval)


@rdp_of(MultiBitRelease)
def _pure_rdp(acc: Accountant, e: MultiBitRelease) -> np.ndarray:
    return rdp_pure(e.epsilon, acc.orders)


@pld_of(MultiBitRelease)
def _pure_pld(acc: Accountant, e: MultiBitRelease) -> pldm.PLD:
    return pldm.approx_dp_pld(e.epsilon, 0.0, acc.value_discretization_interval)


@rdp_of(GaussianRelease)
def _gaussian_rdp(acc: Accountant, e: GaussianRelease) -> np.ndarray:
    return rdp_gaussian(e.mu, acc.orders)


@pld_of(GaussianRelease)
def _gaussian_pld(acc: Accountant, e: GaussianRelease) -> pldm.PLD:
    return pldm.gaussian_pld(e.mu, acc.value_discretization_interval)


@rdp_of(Composition)
def _composition_rdp(acc: Accountant, e: Composition) -> np.ndarray:
    parts = np.array([acc.rdp(c) for c in e.events])
    return parts.sum(axis=0) if e.how == "sequential" else parts.max(axis=0)


@pld_of(Composition)
def _composition_pld(acc: Accountant, e: Composition) -> pldm.PLD:
    interval = acc.value_discretization_interval
    if e.how == "sequential":
        return pldm.compose_plds([acc.pld(c) for c in e.events], interval)
    family = _ordered_family(e.events)
    if family is not None:
        kind, parameter = family
        if kind == "gaussian":
            return pldm.gaussian_pld(parameter, interval)
        if kind == "laplace":
            return pldm.laplace_pld(parameter, interval)
        # Laplace(ε) is ε-DP, hence dominated by randomised response with the same ε.
        return pldm.approx_dp_pld(parameter, 0.0, interval)
    dominant = _dominant(e.events)
    if dominant is not None:
        return acc.pld(dominant)
    return pldm.compose_plds([acc.pld(c) for c in e.events], interval)


# The data-level kinds (DpSgdTraining, RandomSelectionMerge, LinearCombinationMerge) are
# interpreted by the modules that implement their accounting, which register their functions here
# (``profiles``, ``rs``, ``lc``); the package's ``__init__`` imports them, so the registries are
# complete whenever this module can be imported.


# ---- parallel compositions: which part dominates -----------------------------------------------


def _family(event: Event) -> tuple[str, float] | None:
    """(family, parameter) when the event's PLD is one of a totally ordered family."""
    if isinstance(event, GaussianRelease):
        return "gaussian", event.mu
    if isinstance(event, LaplaceRelease):
        return "laplace", event.epsilon
    if isinstance(event, MultiBitRelease):
        return "pure", event.epsilon
    return None


def _ordered_family(events: Sequence[Event]) -> tuple[str, float] | None:
    """(family, largest parameter) when every part is of one ordered family (Laplace and pure
    ε-DP together count as pure ε-DP), else None."""
    families = [_family(e) for e in events]
    if not all(f is not None for f in families):
        return None
    kinds = {f[0] for f in families}
    largest = max(f[1] for f in families)
    if kinds in ({"gaussian"}, {"laplace"}):
        return next(iter(kinds)), largest
    if kinds <= {"laplace", "pure"}:
        return "pure", largest
    return None


def _leaves(event: Event) -> dict[str, list[float]] | None:
    """The releases an event composes sequentially, by ordered family ({"gaussian": [μ…],
    "laplace": [ε…], "pure": [ε…]}), or None when it holds anything else."""
    family = _family(event)
    if family is not None:
        return {family[0]: [family[1]]}
    if not isinstance(event, Composition) or event.how != "sequential":
        return None
    out: dict[str, list[float]] = {}
    for c in event.events:
        sub = _leaves(c)
        if sub is None:
            return None
        for kind, values in sub.items():
            out.setdefault(kind, []).extend(values)
    return out


def _dominates(a: dict[str, list[float]], b: dict[str, list[float]]) -> bool:
    """Whether the sequential composition ``a`` dominates ``b``: every release of ``b`` is matched
    to its own release of ``a`` of the same family with a parameter at least as large (sorted
    descending, elementwise — the test for such a matching). Sound because each family is
    ordered (a larger μ or ε is a more informative mechanism of the same kind), composition
    preserves that order (Dong, Roth & Su 2022, Lemma 3.3 on trade-off functions), and the
    releases of ``a`` left unmatched only add to it."""
    for kind, theirs in b.items():
        ours = sorted(a.get(kind, ()), reverse=True)
        theirs = sorted(theirs, reverse=True)
        if len(theirs) > len(ours) or any(x < y for x, y in zip(ours, theirs, strict=False)):
            return False
    return True


def _dominant(events: Sequence[Event]) -> Event | None:
    """The part of a parallel composition that dominates every other (``_dominates``), or None."""
    leaves = [_leaves(c) for c in events]
    if any(x is None for x in leaves):
        return None
    for i, a in enumerate(leaves):
        if all(_dominates(a, b) for b in leaves):
            return events[i]
    return None


#: The accountant at DEFAULT_ORDERS and DEFAULT_INTERVAL: every function that takes an
#: ``accountant`` uses it when given none.
DEFAULT_ACCOUNTANT = Accountant()

__all__ = ["DEFAULT_ACCOUNTANT", "Accountant", "Support", "pld_not_offered", "pld_of", "rdp_of"]
