"""A Rényi-DP privacy filter over a fixed set of orders, plus a pure-ε track.

Requests arrive adaptively: which mechanism a counterparty asks for next, and at what ε, may
depend on everything it has received so far. A *privacy filter* (Rogers, Roth, Ullman, Vadhan
2016) is a stopping rule that keeps a fixed overall guarantee however the privacy parameters
were chosen. This module is the math of the ledger's filter; it is pure (no I/O, no state).

What we rely on
---------------
**Single-order Rényi filter** (Feldman & Zrnic 2021, "Individual Privacy Accounting via a Rényi
Filter", Theorem 3.1, stated there for individual RDP, of which worst-case RDP is the special
case; Lécuyer 2021, "Practical Privacy Filters and Odometers with Rényi Differential Privacy",
the RDP filter for one order). Fix an order α > 1 and a budget B ≥ 0. Let A_1, A_2, … be
mechanisms chosen adaptively, where A_t is (α, ρ_t)-RDP and ρ_t is a function of the outputs of
A_1 … A_{t−1} only (it is fixed before A_t runs). Run A_t only if ρ_1 + … + ρ_t ≤ B (counting
only the mechanisms that ran); otherwise output ⊥ in its place (a refused request is a
mechanism with ρ = 0). Then the whole interaction is (α, B)-RDP. (Proof: exp((α−1)(L_t − Σρ))
with L_t the privacy loss is a supermartingale; the stopping rule keeps Σρ ≤ B on every path.)

**Several orders: what this filter does, and why it is valid (a union bound).** We keep one
running RDP sum S(α) per order α in a fixed, finite set Λ (chosen before any request, stored in
the ledger and never changed), and accept a request if *some* order stays within its budget:
∃ α ∈ Λ : S(α) + ρ(α) ≤ B(α). Whether this "continue while some order is within budget" rule
needs a union bound is exactly the point the references leave delicate, so we take the
conservative version and prove it here:

*Claim.* If each B(α) is chosen so that every (α, B(α))-RDP mechanism is (ε, δ_α)-DP, the
multi-order filter is (ε, Σ_{α∈Λ} δ_α)-DP.

*Proof.* For each α, let F_α be the interaction in which, in addition to the real filter's
refusals, every request that would push S(α) over B(α) is also refused. F_α is a single-order
filter, hence (α, B(α))-RDP, hence (ε, δ_α)-DP. Sums only grow, so in the real interaction the
orders within budget form a shrinking set, and the last accepted request left at least one
order within budget all along: every transcript lies in some A_α = {α stayed within budget}.
Order Λ and let A′_α = A_α minus the earlier A_β; these partition the transcripts. On A′_α the
real interaction and F_α take the same decisions, so P_real(S ∩ A′_α) = P_α(S ∩ A′_α) and
likewise under the neighbouring input. Hence for every event S,
P_real(S) = Σ_α P_α(S ∩ A′_α) ≤ Σ_α [e^ε Q_α(S ∩ A′_α) + δ_α] = e^ε Q_real(S) + Σ_α δ_α. ∎

So the guarantee is **(ε_G, δ_G)-DP with δ split evenly: δ_α = δ_G / |Λ_finite|**. We do not
rely on the unsplit version (δ_α = δ_G for every order): later work finds that "natural"
filters over a whole privacy curve are not free in general (Regehr, Hu, Leeman, Manurangsi,
Tholoniat, Lécuyer 2026, "Privacy Filters are Captured by Residues"; Tran, Koskela, Räisä,
Honkela 2026, "f-DP Filters: Validity and Approximate Solutions"), while the single-order
filter is (Haney et al. 2023 extend it to concurrent composition for RDP of a fixed order).
The split costs log|Λ| nats beside log(1/δ_G) in the conversion: with the default 20 orders,
ε_G = 1, δ_G = 1e-5, the filter admits 114 Gaussian releases at σ = 50 where the unsplit rule
would admit 150 (4 vs 6 at σ = 10); at ε_G = 8, σ = 3: 17 vs 22. The pure
track is the order "∞" of the same argument: pure ε-DP composes adaptively by summing ε
(basic composition; the loss is bounded on every path), so its δ_∞ = 0 and it costs nothing in
the split. A record with δ > 0 has infinite ε at order ∞.

**Per-order budgets** come from (ε_G, δ_α) by inverting the RDP-to-DP conversion dp-accounting
uses (``rdp.compute_epsilon``: Canonne, Kamath, Steinke 2020, Prop. 12; Asoodeh et al. 2020),
ε = S + log1p(−1/α) − log(δ α)/(α − 1) for α > 1.01, valid for every (α, S)-RDP mechanism and
so for the filtered interaction:

    B(α) = ε_G − log1p(−1/α) + log(δ_α · α)/(α − 1).

Orders whose B(α) ≤ 0 can never accept anything; they keep their share of δ (conservative).

**What "spent" means.** ``spent_epsilon`` is the smallest ε′ such that a filter with budget
(ε′, δ_G) over the same orders would have accepted every charge so far:
min( min_α conv_α(S(α)), S_pure ). It is monotone and never exceeds ε_G; it is a description
of the state, while the guarantee is the filter's (ε_G, δ_G).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from peer.base.checks import check_delta, check_epsilon
from peer.base.errors import InvalidArgument

__all__ = ["FILTER_ORDERS", "FilterBudget", "conversion_offset", "validate_orders"]

# The filter's default Rényi orders: few enough that the union bound costs little
# (log(20) ≈ 3 nats beside log(1/δ) ≈ 11.5 at δ = 1e-5), spread enough to fit Gaussian and
# Laplace curves from ε ≈ 0.1 to ε ≈ 30. All > 1.01, where dp-accounting's conversion holds.
FILTER_ORDERS: tuple[float, ...] = (
    1.25,
    1.5,
    1.75,
    2.0,
    2.5,
    3.0,
    4.0,
    5.0,
    6.0,
    8.0,
    10.0,
    12.0,
    16.0,
    20.0,
    24.0,
    32.0,
    48.0,
    64.0,
    128.0,
    256.0,
)


def validate_orders(orders: Sequence[float], field: str = "orders") -> tuple[float, ...]:
    """Finite, strictly increasing, each > 1.01 (where the improved conversion is valid)."""
    try:
        out = tuple(float(o) for o in orders)
    except (TypeError, ValueError):
        raise InvalidArgument(field, f"must be a list of numbers, got {orders!r}") from None
    if not out:
        raise InvalidArgument(field, "must hold at least one order")
    if len(out) > 64:
        raise InvalidArgument(field, f"at most 64 orders (each costs δ in the union bound), got {len(out)}")
    for o in out:
        if not (math.isfinite(o) and o > 1.01):
            raise InvalidArgument(field, f"every order must be finite and > 1.01, got {o!r}")
    if any(b <= a for a, b in pairwise(out)):
        raise InvalidArgument(field, "must be strictly increasing")
    return out


def conversion_offset(orders: Sequence[float], delta: float) -> np.ndarray:
    """c(α) such that (α, S)-RDP implies (S + c(α), δ)-DP (dp-accounting's improved bound).

    c(α) = log1p(−1/α) − log(δ α)/(α − 1). For δ = 0 every finite order gives +∞.
    """
    o = np.asarray(orders, dtype=float)
    if delta <= 0:
        return np.full(o.shape, np.inf)
    return np.log1p(-1.0 / o) - np.log(delta * o) / (o - 1.0)


@dataclass(frozen=True)
class FilterBudget:
    """An overall budget (epsilon, delta) enforced by the multi-order RDP filter.

    ``orders`` are the finite Rényi orders; each gets delta / len(orders) of the δ budget.
    ``delta == 0`` leaves only the pure track (basic composition of pure ε-DP releases).
    """

    epsilon: float
    delta: float
    orders: tuple[float, ...] = FILTER_ORDERS

    def __post_init__(self) -> None:
        object.__setattr__(self, "epsilon", check_epsilon(self.epsilon, "epsilon"))
        object.__setattr__(self, "delta", check_delta(self.delta, "delta", zero=True))
        object.__setattr__(self, "orders", validate_orders(self.orders))

    @property
    def delta_per_order(self) -> float:
        return self.delta / len(self.orders)

    def rdp_budget(self) -> np.ndarray:
        """B(α) for each finite order (−∞ when δ = 0: those orders can never accept)."""
        return self.epsilon - conversion_offset(self.orders, self.delta_per_order)

    def admits(self, rdp_total: np.ndarray, pure_total: float) -> bool:
        """Whether the state (RDP sums, pure-ε sum) — including a candidate charge — is allowed.

        True iff some finite order is within its budget or the pure sum is within ε.
        """
        rdp_total = np.asarray(rdp_total, dtype=float)
        return bool(np.any(rdp_total <= self.rdp_budget()) or pure_total <= self.epsilon)

    def spent_epsilon(self, rdp_total: np.ndarray, pure_total: float) -> tuple[float, float]:
        """(ε′, order): the smallest budget ε′ (at this δ) that admits the state, and the order
        that attains it (``math.inf`` for the pure track). 0 for an empty state."""
        per_order = np.asarray(rdp_total, dtype=float) + conversion_offset(self.orders, self.delta_per_order)
        i = int(np.argmin(per_order))
        best, order = float(per_order[i]), self.orders[i]
        if pure_total <= best:
            best, order = float(pure_total), math.inf
        return max(0.0, best), order

    def explain(self, rdp_total: np.ndarray, pure_total: float) -> str:
        """One line on where the state stands against the budget (for refusal messages)."""
        slack = self.rdp_budget() - np.asarray(rdp_total, dtype=float)
        i = int(np.argmax(slack))
        parts = [
            f"closest order {self.orders[i]:g}: RDP {float(rdp_total[i]):.6g} vs budget {float(self.rdp_budget()[i]):.6g}"
        ]
        parts.append(f"pure track: ε {pure_total:.6g} vs {self.epsilon:g}")
        return "; ".join(parts)
