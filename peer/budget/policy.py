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
    allow = ["features", "weights", "merge", "fuse", "ledger"]
    show_remaining = "all"             # overrides policy.show_remaining for this peer
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

import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from peer.base.errors import InvalidArgument, PermissionDenied
from peer.budget.filter import FILTER_ORDERS, FilterBudget, validate_orders

KINDS = ("features", "weights", "merge", "fuse", "ledger")
CAPPED_KINDS = ("features", "weights", "merge", "fuse")
SHOW = ("none", "own", "all")
DATA_UNITS = ("record:add-remove", "record:replace-one")


class PolicyError(InvalidArgument):
    """A bad policy value: names the key (dotted path) and, when known, its line in the file."""

    def __init__(self, key: str, rule: str, line: int | None = None):
        self.line = line
        where = f"{key} (line {line})" if line else key
        super().__init__(where, rule)
        self.key = key


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
    def from_toml(cls, path: str | Path, *, table: str = "policy") -> "Policy":
        """Parse the ``[policy]`` table of a TOML file (such as the daemon's ``site.toml``)."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise PolicyError(str(path), f"cannot read the policy file: {e.strerror}") from None
        return cls.from_toml_text(text, table=table)

    @classmethod
    def from_toml_text(cls, text: str, *, table: str = "policy") -> "Policy":
        """Parse the ``[policy]`` table of TOML text.

        Syntax errors carry tomllib's line; bad keys and values carry the line of the key where
        it can be found in the text.
        """
        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            m = re.search(r"line (\d+)", str(e))
            raise PolicyError(table, f"is not valid TOML: {e}", int(m.group(1)) if m else None) from None
        if table not in doc:
            raise PolicyError(table, f"the file has no [{table}] table")
        try:
            return cls.from_mapping(doc[table], prefix=table)
        except PolicyError as e:
            if e.line is None:
                raise PolicyError(e.key, e.rule, _find_line(text, e.key)) from None
            raise

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, prefix: str = "policy") -> "Policy":
        """Build from a parsed mapping (the value of the ``[policy]`` table)."""
        _table(data, prefix)
        _known(data, prefix, ("data", "model", "caps", "peers", "show_remaining", "orders"))
        orders = FILTER_ORDERS
        if "orders" in data:
            raw = [_number(o, f"{prefix}.orders") for o in _list(data["orders"], f"{prefix}.orders")]
            try:
                orders = validate_orders(raw)
            except InvalidArgument as e:
                raise PolicyError(f"{prefix}.orders", e.rule) from None
        show = _choice(data.get("show_remaining", "none"), f"{prefix}.show_remaining", SHOW)

        data_budget = None
        if "data" in data:
            key = f"{prefix}.data"
            d = _table(data["data"], key)
            _known(d, key, ("unit", "epsilon", "delta"))
            for req in ("unit", "epsilon", "delta"):
                if req not in d:
                    raise PolicyError(f"{key}.{req}", "is required in a data budget")
            unit = _choice(d["unit"], f"{key}.unit", DATA_UNITS)
            eps, delta = _eps_delta(d, key, orders)
            data_budget = DataBudget(unit, eps, delta)

        model = ModelBudgets()
        overrides: dict[str, ModelBudgets] = {}
        if "model" in data:
            key = f"{prefix}.model"
            m = _table(data["model"], key)
            _known(m, key, ("total", "per_counterparty", "overrides"))
            model = _model_budgets(m, key, orders, ModelBudgets())
            for name, o in _table(m.get("overrides", {}), f"{key}.overrides").items():
                okey = f"{key}.overrides.{_quote(name)}"
                o = _table(o, okey)
                _known(o, okey, ("total", "per_counterparty"))
                overrides[name] = _model_budgets(o, okey, orders, model)

        caps: dict[str, float] = {}
        for kind, value in _table(data.get("caps", {}), f"{prefix}.caps").items():
            key = f"{prefix}.caps.{kind}"
            if kind not in CAPPED_KINDS:
                raise PolicyError(key, f"unknown request kind; caps apply to {list(CAPPED_KINDS)}")
            caps[kind] = _positive(value, key)

        peers: dict[str, PeerRule] = {}
        for name, rule in _table(data.get("peers", {}), f"{prefix}.peers").items():
            key = f"{prefix}.peers.{_quote(name)}"
            if not name or not isinstance(name, str):
                raise PolicyError(key, "a peer name must be a non-empty string")
            r = _table(rule, key)
            _known(r, key, ("allow", "show_remaining"))
            allow = _list(r.get("allow", []), f"{key}.allow")
            for kind in allow:
                if kind not in KINDS:
                    raise PolicyError(f"{key}.allow", f"unknown request kind {kind!r}; expected some of {list(KINDS)}")
            peer_show = None
            if "show_remaining" in r:
                peer_show = _choice(r["show_remaining"], f"{key}.show_remaining", SHOW)
            peers[name] = PeerRule(frozenset(allow), peer_show)

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
            raise PermissionDenied(f"the site's policy does not let peer {peer!r} ask for {kind}")
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
                raise PermissionDenied(f"the site's policy does not let peer {peer!r} ask for {kind}")
        for kind, epsilon in parts:
            self.check_request(peer, kind, epsilon)


# ---- parsing helpers ------------------------------------------------------------------------


def _quote(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name or "") else f'"{name}"'


def _table(value: Any, key: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise PolicyError(key, f"must be a table, got {type(value).__name__}")
    return value


def _list(value: Any, key: str) -> list:
    if not isinstance(value, list):
        raise PolicyError(key, f"must be an array, got {type(value).__name__}")
    return value


def _known(d: Mapping[str, Any], key: str, allowed: tuple[str, ...]) -> None:
    for k in d:
        if k not in allowed:
            raise PolicyError(f"{key}.{k}", f"unknown key; expected one of {list(allowed)}")


def _choice(value: Any, key: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise PolicyError(key, f"must be one of {list(choices)}, got {value!r}")
    return value


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PolicyError(key, f"must be a number, got {value!r}")
    if not math.isfinite(value):
        raise PolicyError(key, f"must be finite, got {value!r}")
    return float(value)


def _positive(value: Any, key: str) -> float:
    v = _number(value, key)
    if v <= 0:
        raise PolicyError(key, f"must be > 0, got {value!r}")
    return v


def _eps_delta(d: Mapping[str, Any], key: str, orders: tuple[float, ...]) -> tuple[float, float]:
    eps = _positive(d["epsilon"], f"{key}.epsilon")
    delta = _number(d["delta"], f"{key}.delta")
    if not 0 <= delta < 1:
        raise PolicyError(f"{key}.delta", f"must be in [0, 1), got {d['delta']!r}")
    if 0 < delta and delta / len(orders) < 1e-300:
        raise PolicyError(f"{key}.delta", f"too small to split over {len(orders)} orders")
    return eps, delta


def _filter(value: Any, key: str, orders: tuple[float, ...]) -> FilterBudget:
    t = _table(value, key)
    _known(t, key, ("epsilon", "delta"))
    for req in ("epsilon", "delta"):
        if req not in t:
            raise PolicyError(f"{key}.{req}", "is required in a budget")
    eps, delta = _eps_delta(t, key, orders)
    return FilterBudget(eps, delta, orders)


def _model_budgets(m: Mapping[str, Any], key: str, orders: tuple[float, ...], fallback: ModelBudgets) -> ModelBudgets:
    total = _filter(m["total"], f"{key}.total", orders) if "total" in m else fallback.total
    per = _filter(m["per_counterparty"], f"{key}.per_counterparty", orders) if "per_counterparty" in m else fallback.per_counterparty
    return ModelBudgets(total, per)


def _find_line(text: str, dotted: str) -> int | None:
    """Best effort: the line where the key at a dotted path is written (None if not found).

    Follows ``[table]`` headers; understands bare and quoted keys, not dotted keys inside a
    table body (those fall back to the table header's line).
    """
    parts = _split_dotted(dotted)
    table: list[str] = []
    header_line = None
    for no, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        m = re.match(r"^\[\[?\s*(.+?)\s*\]\]?\s*(#.*)?$", line)
        if m:
            table = _split_dotted(m.group(1))
            if table == parts:
                return no
            if table == parts[: len(table)]:
                header_line = no
            continue
        m = re.match(r'^("[^"]*"|[A-Za-z0-9_-]+)\s*=', line)
        if m and table + [m.group(1).strip('"')] == parts[: len(table) + 1] and len(table) < len(parts):
            return no
    return header_line


def _split_dotted(dotted: str) -> list[str]:
    return [p.strip().strip('"') for p in re.findall(r'"[^"]*"|[^.]+', dotted)]
