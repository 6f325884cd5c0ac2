"""A site's privacy policy: budgets, per-request caps, who may ask for what.

Loaded from the ``[policy]`` table of a TOML file (the daemon's ``site.toml`` embeds it) or from
an already-parsed mapping. Everything defaults to *closed*: with no budget for a level nothing
of that level can be released, and with no entry for a peer that peer may ask for nothing.

Schema (every key optional; defaults in brackets)::

    [policy]
    show_remaining = "own"   # what remaining budget a peer may see: "none" | "own" | "all" ["none"]
    orders = [1.5, 2, 4, 8]  # Rényi orders of the filter, fixed when a ledger is created
                             # [peer.budget.filter.FILTER_ORDERS]

    [policy.data]            # data level: central DP on the site's training records [no budget]
    unit = "record:add-remove"   # or "record:replace-one"; releases in the other unit are refused
    epsilon = 8.0
    delta = 1e-5

    [policy.model]           # model level: LDP on a model's neurons, per model [no budget]
    total = { epsilon = 16.0, delta = 1e-6 }            # all counterparties together
    per_counterparty = { epsilon = 4.0, delta = 1e-6 }  # each counterparty on its own

    [policy.model.overrides."mlp-a"]   # a model with its own budgets (both keys optional;
    total = { epsilon = 8.0, delta = 0.0 }   # a key left out falls back to [policy.model])

    [policy.caps]            # the most ε one request may carry, per kind [no cap]
    features = 2.0
    weights = 2.0
    merge = 8.0
    fuse = 4.0

    [policy.peers."hospital-b"]        # what this peer may ask for [nothing]
    allow = ["features", "weights", "merge", "fuse", "ledger", "segment"]
    show_remaining = "all"             # overrides policy.show_remaining for this peer
                                       # ("segment": the site's published DP-SGD segments of a
                                       # multi-round run, coordinator_free.iterate; charged once
                                       # when published, never on request)
    [policy.peers."*"]                 # any other pinned peer
    allow = ["features"]

Fuse and relayed releases: the site serving Fuse (the owner) checks kind ``fuse`` (its cap
applies to its own contribution: activation + weight-feature + weights ε per neuron). Its
partner serves one release of features and weights on behalf of the final caller: the
partner's policy must allow ``features`` and ``weights`` for *both* the owner (the relay) and
the final caller, each part fits its own cap, and the release is charged to the
per-counterparty budgets of both.

A budget with ``delta = 0`` is a pure ε-DP budget: only pure releases (δ = 0) fit it. The
model-level unit is always one neuron: per-entry releases are converted by the ledger (see
``peer.budget.ledger``), never charged as if they were per-neuron.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from peer.base.checks import check_delta, check_epsilon
from peer.base.config import ConfigError, Section, parse_toml
from peer.base.errors import InvalidArgument, PermissionDenied
from peer.budget.filter import FILTER_ORDERS, FilterBudget, validate_orders

__all__ = ["Policy", "PolicyError"]

KINDS = ("features", "weights", "merge", "fuse", "ledger", "segment", "secure-sum")
CAPPED_KINDS = ("features", "weights", "merge", "fuse")
SHOW = ("none", "own", "all")
DATA_UNITS = ("record:add-remove", "record:replace-one")


class PolicyError(ConfigError):
    """A bad policy value: names the key (dotted path) and, when known, the file and the line
    (``peer.base.config`` reads the file and finds the line)."""

    @classmethod
    def of(cls, e: ConfigError) -> PolicyError:
        return e if isinstance(e, cls) else cls(e.key, e.rule, e.line, e.source)


@dataclass(frozen=True)
class DataBudget:
    """The data-level budget: one filter over every data-level release, in one unit."""

    unit: str
    epsilon: float
    delta: float


@dataclass(frozen=True)
class ModelBudgets:
    """Model-level budgets of one model; ``None`` means that constraint is absent."""

    total: FilterBudget | None = None
    per_counterparty: FilterBudget | None = None


@dataclass(frozen=True)
class PeerRule:
    allow: frozenset[str] = frozenset()
    show_remaining: str | None = None


@dataclass(frozen=True)
class Policy:
    """A site's policy (see the module docstring for the TOML schema and defaults)."""

    data: DataBudget | None = None
    model: ModelBudgets = ModelBudgets()
    model_overrides: Mapping[str, ModelBudgets] = field(default_factory=dict)
    caps: Mapping[str, float] = field(default_factory=dict)
    peers: Mapping[str, PeerRule] = field(default_factory=dict)
    show_remaining: str = "none"
    orders: tuple[float, ...] = FILTER_ORDERS

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_overrides", MappingProxyType(dict(self.model_overrides)))
        object.__setattr__(self, "caps", MappingProxyType(dict(self.caps)))
        object.__setattr__(self, "peers", MappingProxyType(dict(self.peers)))

    # ---- loading ----------------------------------------------------------------------------

    @classmethod
    def from_toml(cls, path: str | Path, *, table: str = "policy") -> Policy:
        """Parse the ``[policy]`` table of a TOML file (such as the daemon's ``site.toml``)."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise PolicyError(str(path), f"cannot read the policy file: {e.strerror}") from None
        return cls.from_toml_text(text, table=table, source=str(path))

    @classmethod
    def from_toml_text(cls, text: str, *, table: str = "policy", source: str | None = None) -> Policy:
        """Parse the ``[policy]`` table of TOML text (``source``: the file it came from, for errors).

        Syntax errors carry tomllib's line; bad keys and values carry the line of the key where
        it can be found in the text.
        """
        try:
            doc = parse_toml(text, source or "", table)
            if table not in doc:
                raise PolicyError(table, f"the file has no [{table}] table", None, source)
            return cls.from_section(Section(doc, (), text, source or "").section(table))
        except ConfigError as e:
            raise PolicyError.of(e) from None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, prefix: str = "policy") -> Policy:
        """Build from a parsed mapping (the value of the ``[policy]`` table)."""
        try:
            return cls.from_section(Section(data, (prefix,), "", ""))
        except ConfigError as e:
            raise PolicyError.of(e) from None

    @classmethod
    def from_section(cls, s: Section) -> Policy:
        """Build from the ``[policy]`` table as a :class:`peer.base.config.Section` (errors are
        :class:`peer.base.config.ConfigError` naming the key, the line and the file)."""
        s.known(("data", "model", "caps", "peers", "show_remaining", "orders"))
        orders = FILTER_ORDERS
        if "orders" in s:
            raw = s.numbers("orders")
            try:
                orders = validate_orders(raw)
            except InvalidArgument as e:
                s.fail("orders", e.rule)
        show = s.string("show_remaining", "none", choices=SHOW)

        data_budget = None
        if "data" in s:
            d = s.section("data")
            d.known(("unit", "epsilon", "delta"))
            for req in ("unit", "epsilon", "delta"):
                if req not in d:
                    d.fail(req, "is required in a data budget")
            unit = d.string("unit", choices=DATA_UNITS)
            eps, delta = _eps_delta(d, orders)
            data_budget = DataBudget(unit, eps, delta)

        model = ModelBudgets()
        overrides: dict[str, ModelBudgets] = {}
        if "model" in s:
            m = s.section("model")
            m.known(("total", "per_counterparty", "overrides"))
            model = _model_budgets(m, orders, ModelBudgets())
            for name, o in m.sections("overrides").items():
                o.known(("total", "per_counterparty"))
                overrides[name] = _model_budgets(o, orders, model)

        caps: dict[str, float] = {}
        c = s.section("caps")
        for kind in c.data:
            if kind not in CAPPED_KINDS:
                c.fail(kind, f"unknown request kind; caps apply to {list(CAPPED_KINDS)}")
            caps[kind] = _checked(c, kind, check_epsilon)

        peers: dict[str, PeerRule] = {}
        for name, r in s.sections("peers").items():
            if not name:
                r.fail((), "a peer name must be a non-empty string")
            r.known(("allow", "show_remaining"))
            allow = r.raw("allow", [])
            if not isinstance(allow, list):
                r.fail("allow", f"must be an array, got {allow!r}")
            for kind in allow:
                if kind not in KINDS:
                    r.fail("allow", f"unknown request kind {kind!r}; expected some of {list(KINDS)}")
            peers[name] = PeerRule(frozenset(allow), r.string("show_remaining", None, choices=SHOW))

        return cls(data_budget, model, overrides, caps, peers, show, orders)

    # ---- questions the daemon and the ledger ask ----------------------------------------------

    def model_budgets(self, model: str) -> ModelBudgets:
        return self.model_overrides.get(model, self.model)

    def data_filter(self) -> FilterBudget | None:
        if self.data is None:
            return None
        return FilterBudget(self.data.epsilon, self.data.delta, self.orders)

    def _rule(self, peer: str) -> PeerRule | None:
        return self.peers.get(peer, self.peers.get("*"))

    def allows(self, peer: str, kind: str) -> bool:
        rule = self._rule(peer)
        return rule is not None and kind in rule.allow

    def shows_remaining(self, peer: str) -> str:
        """``"none"``, ``"own"`` (the peer's own per-counterparty budgets) or ``"all"``."""
        rule = self._rule(peer)
        if rule is not None and rule.show_remaining is not None:
            return rule.show_remaining
        return self.show_remaining

    def check_request(self, peer: str, kind: str, epsilon: float) -> None:
        """Raise PermissionDenied if ``peer`` may not ask for ``kind``, or InvalidArgument if one
        request of ``kind`` at ``epsilon`` (in the budget's unit) exceeds the site's cap."""
        if kind not in KINDS:
            raise InvalidArgument("kind", f"must be one of {list(KINDS)}, got {kind!r}")
        if not self.allows(peer, kind):
            raise PermissionDenied(
                f"the site's policy does not let peer {peer!r} ask for {kind}",
                reason="KIND_NOT_ALLOWED",
                metadata={"kind": kind},
            )
        cap = self.caps.get(kind)
        if cap is not None and not epsilon <= cap:
            raise InvalidArgument("epsilon", f"{epsilon:g} exceeds the site's per-request cap {cap:g} for {kind}")

    def check_request_parts(self, peer: str, parts: Sequence[tuple[str, float]]) -> None:
        """:meth:`check_request` for a request made of several parts released together (e.g.
        features and weights in one release): ``peer`` must be allowed every part's kind, and
        each part's ε (in the budget's unit) must fit that kind's cap. All permissions are
        checked before any cap, so a peer that may not ask learns nothing about the caps."""
        for kind, _ in parts:
            if kind not in KINDS:
                raise InvalidArgument("kind", f"must be one of {list(KINDS)}, got {kind!r}")
            if not self.allows(peer, kind):
                raise PermissionDenied(
                    f"the site's policy does not let peer {peer!r} ask for {kind}",
                    reason="KIND_NOT_ALLOWED",
                    metadata={"kind": kind},
                )
        for kind, epsilon in parts:
            self.check_request(peer, kind, epsilon)


# ---- parsing helpers (each failure is Section.fail: key, line, file) ------------------------


def _checked(s: Section, name: str, check: Callable[..., float], **kw: Any) -> float:
    """``s[name]`` through one of ``peer.base.checks``; its rule, with key and line, if it fails."""
    value = s.raw(name)
    try:
        return check(value, name, **kw)
    except InvalidArgument as e:
        s.fail(name, e.rule)
        raise  # unreachable: fail raises


def _eps_delta(s: Section, orders: tuple[float, ...]) -> tuple[float, float]:
    eps = _checked(s, "epsilon", check_epsilon)
    delta = _checked(s, "delta", check_delta, zero=True)
    if delta > 0 and delta / len(orders) < 1e-300:
        s.fail("delta", f"too small to split over {len(orders)} orders")
    return eps, delta


def _filter(t: Section, orders: tuple[float, ...]) -> FilterBudget:
    t.known(("epsilon", "delta"))
    for req in ("epsilon", "delta"):
        if req not in t:
            t.fail(req, "is required in a budget")
    eps, delta = _eps_delta(t, orders)
    return FilterBudget(eps, delta, orders)


def _model_budgets(m: Section, orders: tuple[float, ...], fallback: ModelBudgets) -> ModelBudgets:
    total = _filter(m.section("total"), orders) if "total" in m else fallback.total
    per = _filter(m.section("per_counterparty"), orders) if "per_counterparty" in m else fallback.per_counterparty
    return ModelBudgets(total, per)


# ---- a policy's limits against the limits a ledger recorded ----------------------------------


@dataclass(frozen=True)
class LimitChange:
    """One budget whose limits in the policy differ from those its ledger recorded with its last
    charge. The ledger charges by the policy's limits, and records them with every charge (in
    its hash chain), so a change takes effect from the next charge on: this says so, loudly.

    ``recorded`` / ``limit``: (ε, δ) at the budget's last charge and in the policy now (None:
    the policy sets no such budget any more, so every release to it is refused); ``spent``: the
    filter's ε of what the budget already holds, at the policy's δ."""

    budget: str
    recorded: tuple[float, float]
    limit: tuple[float, float] | None
    spent: float

    @property
    def exhausted(self) -> bool:
        """The policy's limit is at or below what is already spent: nothing more fits."""
        return self.limit is None or self.spent >= self.limit[0]

    def describe(self) -> str:
        was = f"(ε={self.recorded[0]:g}, δ={self.recorded[1]:g})"
        if self.limit is None:
            return (
                f"budget {self.budget}: the ledger recorded limits {was} with its last charge; the policy sets no "
                "such budget now, so every further release to it is refused"
            )
        now = f"(ε={self.limit[0]:g}, δ={self.limit[1]:g})"
        verb = "raised" if self.limit[0] >= self.recorded[0] and self.limit[1] >= self.recorded[1] else "changed"
        if self.exhausted:
            return (
                f"budget {self.budget}: the policy lowers its limits from {was} (recorded with its last charge) to "
                f"{now}, at or below the ε={self.spent:.4g} already spent: the budget is exhausted, every further "
                "release to it is refused (spent budget is never given back)"
            )
        return (
            f"budget {self.budget}: the policy {verb} its limits from {was} (recorded with its last charge) to "
            f"{now}; applied from the next charge on, which records the new limits in the ledger "
            f"(ε={self.spent:.4g} spent, {self.limit[0] - self.spent:.4g} left)"
        )


def limit_changes(recorded: Sequence[Any], current: Sequence[Any]) -> list[LimitChange]:
    """The budgets whose limits differ between ``recorded`` (a ledger's budget states read
    without a policy: each budget's limits as recorded with its last charge) and ``current``
    (the same ledger's states under the policy). Both are ``peer.budget.ledger.BudgetState``
    lists; budgets with no charge yet have no recorded limits and are not a change."""
    now = {s.key.name: s for s in current}
    out = []
    for r in recorded:
        if r.count == 0 or r.epsilon_limit != r.epsilon_limit:  # no charge, or no limit recorded (NaN)
            continue
        c = now.get(r.key.name)
        limit = None if c is None or c.epsilon_limit != c.epsilon_limit else (c.epsilon_limit, c.delta_limit)
        if limit == (r.epsilon_limit, r.delta_limit):
            continue
        spent = c.spent_epsilon if limit is not None else r.spent_epsilon
        out.append(LimitChange(r.key.name, (r.epsilon_limit, r.delta_limit), limit, spent))
    return out
