"""Fuse through three real daemons: every charge covers what leaves, a refused Fuse spends
nothing anywhere, the partner charges both the relay and the final caller, and no
permutation ever leaves the owner.

Sites: X (the partner, model "mx"), B (the owner serving Fuse, model "mb", a probe set, X's
address) and C (the caller). Every daemon's service records the requests it received
(``Recording``: the real service, with a tap on its inputs), so "nothing reached the partner
but the probe" is checked on what X's handlers were given.
"""

from __future__ import annotations

import contextlib
import sqlite3
from typing import ClassVar

import numpy as np
import pytest
from peer_harness import ARCH, client, make_site, model_arrays, pin_each_other, running

from peer.budget.ledger import Ledger
from peer.net.client import PeerError
from peer.net.receipts import verify_receipt
from peer.net.service import PeerService
from privfusion.v1 import peer_pb2 as pb

PROBE = np.random.default_rng(5).random((32, 64))
#: one Fuse of these parameters costs ε ≈ 7.8 at δ = 1e-3 by the filter (8 by basic
#: composition); two cost ≈ 13.5: a per-counterparty budget of 10 admits exactly one
FUSE = {
    "partner": "site-x",
    "partner_model": "mx",
    "alpha": 0.5,
    "activation_epsilon": 2.0,
    "weight_epsilon": 2.0,
    "weights_epsilon": 4.0,
    "weights_delta": 1e-5,
}


def policy(
    allow_x: str = '"*" = { allow = ["features", "weights", "fuse", "ledger"] }', per_cp: float = 10.0, caps: str = ""
) -> str:
    return f"""
[policy]
show_remaining = "own"
caps = {{ {caps} }}

[policy.model]
total = {{ epsilon = 1000.0, delta = 1e-3 }}
per_counterparty = {{ epsilon = {per_cp}, delta = 1e-3 }}

[policy.peers]
{allow_x}
"""


class Recording(PeerService):
    """The real service; every request message its release handlers receive is kept."""

    seen: ClassVar[list[tuple[str, str, object]]] = []

    def _keep(self, method, message):
        Recording.seen.append((self.site.name, method, message))

    def ReleaseFeatures(self, request_iterator, context):
        def tap():
            for m in request_iterator:
                self._keep("ReleaseFeatures", m)
                yield m

        yield from super().ReleaseFeatures(tap(), context)

    def ReleaseWeights(self, request, context):
        self._keep("ReleaseWeights", request)
        yield from super().ReleaseWeights(request, context)

    def ReleaseMerged(self, request, context):
        self._keep("ReleaseMerged", request)
        yield from super().ReleaseMerged(request, context)

    def Fuse(self, request, context):
        self._keep("Fuse", request)
        yield from super().Fuse(request, context)

    def GetPeerInfo(self, request, context):
        self._keep("GetPeerInfo", request)
        return super().GetPeerInfo(request, context)

    def ListLedger(self, request, context):
        self._keep("ListLedger", request)
        yield from super().ListLedger(request, context)


def seen_at(name: str) -> list[tuple[str, object]]:
    return [(m, r) for s, m, r in Recording.seen if s == name]


@pytest.fixture(autouse=True)
def recording(monkeypatch):
    Recording.seen = []
    monkeypatch.setattr("peer.net.daemon.PeerService", Recording)


@contextlib.contextmanager
def three_sites(
    tmp_path, *, x_policy: str | None = None, b_policy: str | None = None, x_models=None, x_address: str | None = None
):
    """X, B and C running; yields (x, b, c, b_address, x_address)."""
    x = make_site(
        tmp_path,
        "site-x",
        models=x_models or {"mx": (ARCH, model_arrays(seed=2))},
        seed=21,
        policy=x_policy or policy(),
    )
    with running(x) as (_, real_x_address):
        b = make_site(
            tmp_path,
            "site-b",
            models={"mb": (ARCH, model_arrays(seed=1))},
            seed=12,
            probe=PROBE,
            peers={"site-x": x_address or real_x_address},
            policy=b_policy or policy(caps="fuse = 10.0"),
        )
        c = make_site(tmp_path, "site-c", models={})
        pin_each_other(b, x)
        pin_each_other(b, c)
        pin_each_other(c, x)
        with running(b) as (_, b_address):
            yield x, b, c, b_address, real_x_address


def ledger_state(site) -> tuple[list, list]:
    """(release ids of the charges that count, every budget's totals row): what a refused Fuse
    must leave as it found."""
    con = sqlite3.connect(site.ledger)
    try:
        live = [
            r[0]
            for r in con.execute(
                "SELECT release_id FROM charges WHERE seq NOT IN (SELECT seq FROM cancellations) ORDER BY seq"
            )
        ]
        totals = con.execute("SELECT budget, count, rdp, pure_epsilon FROM totals ORDER BY budget").fetchall()
        return live, totals
    finally:
        con.close()


def cancellations(site) -> list[dict]:
    with Ledger(site.ledger) as led:  # opening also verifies both chains and every total
        return led.cancellations()


def fuse(c, b_address, **kw):
    with client(c, b_address, peer="site-b") as cl:
        return cl.fuse("mb", **(FUSE | kw))


def refused(c, b_address, **kw) -> PeerError:
    with pytest.raises(PeerError) as e:
        fuse(c, b_address, **kw)
    return e.value


def keys(value) -> set[str]:
    """Every key of a nested JSON-like value."""
    if isinstance(value, dict):
        return set(value) | set().union(*(keys(v) for v in value.values()))
    if isinstance(value, (list, tuple)):
        return set().union(*(keys(v) for v in value)) if value else set()
    return set()


# ------------------------------------------------------------------------ a Fuse that succeeds


def test_a_fuse_charges_the_partner_for_relay_and_caller_and_only_the_probe_reaches_it(tmp_path):
    with three_sites(tmp_path) as (x, b, c, b_address, _):
        got = fuse(c, b_address)
        x_calls = seen_at("site-x")
    # what reached X: an (uncharged) GetPeerInfo, then one ReleaseFeatures call whose params
    # ask features + weights on behalf of C, and B's public probe set, byte for byte; nothing
    # else (no weights request, no match)
    assert [m for m, _ in x_calls] == ["GetPeerInfo"] + ["ReleaseFeatures"] * (len(x_calls) - 1)
    params, header, *chunks = [r for m, r in x_calls if m == "ReleaseFeatures"]
    p = params.params
    assert params.WhichOneof("part") == "params" and header.WhichOneof("part") == "probe"
    assert (p.header.sender, p.header.on_behalf_of, p.model) == ("site-b", "site-c", "mx")
    assert (p.weights_epsilon, p.weights_delta) == (4.0, 1e-5)
    assert all(m.WhichOneof("part") == "chunk" for m in chunks)
    assert b"".join(m.chunk.data for m in chunks) == np.ascontiguousarray(PROBE).tobytes()
    assert "permutations" not in pb.WeightsRequest.DESCRIPTOR.fields_by_name
    # X charged ONE release (features + unpermuted weights) to B and to C's budget as well
    with Ledger(x.ledger) as led:
        [entry] = led.entries()
        states = {s.key.name: s for s in led.budget_states()}
    assert entry.counterparty == "site-b" and entry.record.parameters["on_behalf_of"] == "site-c"
    assert sorted(entry.budgets) == ["model/mx/peer/site-b", "model/mx/peer/site-c", "model/mx/total"]
    assert states["model/mx/peer/site-b"].spent_epsilon == states["model/mx/peer/site-c"].spent_epsilon > 0
    assert entry.record.parameters["release"] == "features+weights"
    assert not any("perm" in k for k in keys(entry.record.to_dict()))
    # B charged C its own contribution once; X's receipt travels along and verifies
    with Ledger(b.ledger) as led:
        [own] = led.entries()
    assert own.counterparty == "site-c" and own.release_id == got.receipt.record.release_id
    [upstream] = got.upstream
    assert verify_receipt(upstream, x.identity.cert_pem, "site-x").release_id == entry.release_id
    assert got.metadata["upstream"] == [str(entry.entry_id)] and cancellations(b) == []


# ------------------------------------------------------------------------ refused at the owner


def test_owner_budget_exhausted_spends_nothing_anywhere_and_asks_the_partner_nothing(tmp_path):
    with three_sites(tmp_path) as (x, b, c, b_address, _):
        fuse(c, b_address)  # the first fits C's budget at B; a second does not
        before = ledger_state(b), ledger_state(x), len(seen_at("site-x"))
        for _ in range(5):
            e = refused(c, b_address)
            assert e.status == "RESOURCE_EXHAUSTED" and "model/mb/peer/site-c" in str(e)
        after = ledger_state(b), ledger_state(x), len(seen_at("site-x"))
    assert after == before
    assert cancellations(b) == [] and cancellations(x) == []


def test_owner_per_request_cap_refuses_before_anything_is_charged_or_asked(tmp_path):
    with three_sites(tmp_path, b_policy=policy(caps="fuse = 7.0")) as (x, b, c, b_address, _):
        e = refused(c, b_address)
        assert e.status == "INVALID_ARGUMENT" and "cap 7 for fuse" in str(e)
        assert seen_at("site-x") == []
        assert ledger_state(b) == ([], []) and ledger_state(x) == ([], [])
    assert cancellations(b) == []


REFUSED_BEFORE_ANY_CHARGE = [
    ({"partner": "site-c"}, "INVALID_ARGUMENT", "must not be the caller"),
    ({"partner": "site-b"}, "INVALID_ARGUMENT", "must be another site"),
    ({"partner": ""}, "INVALID_ARGUMENT", "partner"),
    ({"partner": "Not A Site"}, "INVALID_ARGUMENT", "partner"),
    ({"partner": "site-q"}, "FAILED_PRECONDITION", "site-q"),  # no address known at B
    ({"partner_model": ""}, "INVALID_ARGUMENT", "partner_model"),
    ({"alpha": -0.1}, "INVALID_ARGUMENT", "alpha"),
    ({"activation_epsilon": 0.0}, "INVALID_ARGUMENT", "activation_epsilon"),
    ({"weight_epsilon": float("nan")}, "INVALID_ARGUMENT", "weight_epsilon"),
    ({"weights_epsilon": -1.0}, "INVALID_ARGUMENT", "weights_epsilon"),
    ({"weights_delta": 0.5}, "INVALID_ARGUMENT", "weights_delta"),
]


def test_every_refusal_before_the_charge_leaves_both_ledgers_empty(tmp_path):
    b_policy = policy(allow_x='"site-c" = { allow = ["fuse"] }\n"site-x" = { allow = ["ledger"] }', caps="fuse = 10.0")
    with three_sites(tmp_path, b_policy=b_policy) as (x, b, c, b_address, _):
        for kw, status, word in REFUSED_BEFORE_ANY_CHARGE:
            e = refused(c, b_address, **kw)
            assert e.status == status and word in str(e), (kw, e.status, str(e))
            if status == "FAILED_PRECONDITION":  # a reason a client can act on (docs/wire.md §7.3)
                assert e.reason == "PARTNER_UNKNOWN" and e.metadata["partner"] == kw["partner"], (e.reason, e.metadata)
        # a model B does not have; a Fuse header that claims to relay for someone
        with client(c, b_address, peer="site-b") as cl:
            with pytest.raises(PeerError) as e:
                cl.fuse("nope", **FUSE)
            assert e.value.status == "NOT_FOUND"
            req = pb.FuseRequest(
                header=pb.RequestHeader(sender="site-c", receiver="site-b", on_behalf_of="site-z"), model="mb", **FUSE
            )
            with pytest.raises(PeerError) as e:
                cl._read(cl._release["Fuse"](req, timeout=30), "fused", "mb")
            assert e.value.status == "INVALID_ARGUMENT" and "on_behalf_of" in str(e.value)
        # B's policy lets X see its ledger but not ask for a Fuse
        with client(x, b_address, peer="site-b") as cl:
            with pytest.raises(PeerError) as e:
                cl.fuse("mb", **(FUSE | {"partner": "site-c"}))
            assert e.value.status == "PERMISSION_DENIED"
        assert seen_at("site-x") == []
        assert ledger_state(b) == ([], []) and ledger_state(x) == ([], [])


# ------------------------------------------------------------------------ refused by the partner


def exhaust_c_at_x(x_address, c):
    """C spends most of its own budget at X directly (features: pure ε = 4 of 10)."""
    with client(c, x_address, peer="site-x") as cl:
        cl.features("mx", PROBE, activation_epsilon=2.0, weight_epsilon=2.0, activation_clip=(0.0, 4.0))


OTHER_ARCH = {"kind": "mlp", "input_dim": 64, "hidden": [16, 8], "output_dim": 10, "activation": "relu"}

PARTNER_REFUSALS = {
    # C's own per-counterparty budget at X is what runs out (B's at X is untouched)
    "the final caller's budget at the partner": ({}, exhaust_c_at_x, "RESOURCE_EXHAUSTED", "model/mx/peer/site-c"),
    "the partner's policy refuses the final caller": (
        {"x_policy": policy(allow_x='"site-b" = { allow = ["features", "weights"] }')},
        None,
        "PERMISSION_DENIED",
        "site-c",
    ),
    "the partner's policy refuses the relay": (
        {
            "x_policy": policy(
                allow_x='"site-c" = { allow = ["features", "weights"] }\n"site-b" = { allow = ["features"] }'
            )
        },
        None,
        "PERMISSION_DENIED",
        "site-b",
    ),
    "the partner's per-request cap on the weights part": (
        {"x_policy": policy(caps="weights = 3.0")},
        None,
        "INVALID_ARGUMENT",
        "cap 3 for weights",
    ),
}

# refused before any release is asked of the partner: its GetPeerInfo (uncharged) does not list
# the model with the owner's architecture, or the partner cannot be reached; the owner's charge
# is withdrawn
PARTNER_PRECHECKS = {
    "the partner has no such model": (
        {"x_models": {"other": (ARCH, model_arrays(seed=2))}},
        "offers no model 'mx'",
        "PARTNER_LACKS_MODEL",
    ),
    "the partner's model is of another architecture": (
        {"x_models": {"mx": (OTHER_ARCH, model_arrays(OTHER_ARCH, seed=2))}},
        "has another architecture",
        "PARTNER_ARCHITECTURE_MISMATCH",
    ),
    "the partner is unreachable": ({"x_address": "127.0.0.1:1"}, "site-x", "PARTNER_UNAVAILABLE"),
}


@pytest.mark.parametrize("case", list(PARTNER_REFUSALS))
def test_a_partner_refusal_cancels_the_owners_charge_and_costs_the_partner_nothing(tmp_path, case):
    setup, before_fuse, partner_status, word = PARTNER_REFUSALS[case]
    with three_sites(tmp_path, **setup) as (x, b, c, b_address, x_address):
        if before_fuse is not None:
            before_fuse(x_address, c)
        x_before = ledger_state(x)
        e = refused(c, b_address)
        want = "UNAVAILABLE" if partner_status == "UNAVAILABLE" else "FAILED_PRECONDITION"
        assert e.status == want and partner_status in str(e) and word in str(e), (e.status, str(e))
        # the refusal names itself the partner's, with the partner's own status (docs/wire.md §7.3)
        assert e.reason == "PARTNER_REFUSED" and e.metadata["partner"] == "site-x", (e.reason, e.metadata)
        assert e.metadata["partner_status"] == partner_status
        assert ledger_state(b) == ([], [])  # B's charge is withdrawn: every budget as before
        assert ledger_state(x) == x_before  # the partner refused before charging anything
        assert "model/mx/peer/site-b" not in [t[0] for t in ledger_state(x)[1]]
    [cancelled] = cancellations(b)
    assert cancelled["counterparty"] == "site-c" and "Fuse" in cancelled["reason"]
    with Ledger(b.ledger) as led:
        [withdrawn] = led.entries(include_cancelled=True)
        assert withdrawn.release_id == cancelled["release_id"] and led.events(withdrawn.release_id) == []


@pytest.mark.parametrize("case", list(PARTNER_PRECHECKS))
def test_a_partner_that_cannot_serve_the_model_is_asked_for_no_release(tmp_path, case):
    setup, words, reason = PARTNER_PRECHECKS[case]
    with three_sites(tmp_path, **setup) as (x, b, c, b_address, _):
        x_before = ledger_state(x)
        e = refused(c, b_address)
        want = "UNAVAILABLE" if "unreachable" in case else "FAILED_PRECONDITION"
        assert e.status == want and words in str(e), (e.status, str(e))
        assert e.reason == reason and e.metadata["partner"] == "site-x", (e.reason, e.metadata)
        assert ledger_state(b) == ([], []) and ledger_state(x) == x_before
        assert "ReleaseFeatures" not in [m for m, _ in seen_at("site-x")]
    [cancelled] = cancellations(b)
    assert cancelled["counterparty"] == "site-c" and "Fuse" in cancelled["reason"]


# ------------------------------------------------------------------------ relayed requests at the partner


def test_relayed_requests_are_allowed_and_charged_for_both_sites(tmp_path):
    x_policy = policy(allow_x='"*" = { allow = ["features", "weights"] }\n"site-z" = { allow = ["ledger"] }')
    with three_sites(tmp_path, x_policy=x_policy) as (x, b, _c, _b_address, x_address):
        with client(b, x_address, peer="site-x") as cl:
            got = cl.weights("mx", epsilon=2.0, delta=1e-5, on_behalf_of="site-c")
            assert got.receipt.record.parameters["on_behalf_of"] == "site-c"
            with pytest.raises(PeerError) as e:  # X's policy gives site-z no weights
                cl.weights("mx", epsilon=2.0, delta=1e-5, on_behalf_of="site-z")
            assert e.value.status == "PERMISSION_DENIED" and "site-z" in str(e.value)
            with pytest.raises(PeerError) as e:
                cl.features(
                    "mx",
                    PROBE,
                    activation_epsilon=1.0,
                    weight_epsilon=1.0,
                    activation_clip=(0.0, 4.0),
                    weights_epsilon=1.0,
                    weights_delta=1e-5,
                    on_behalf_of="site-b",
                )
            assert e.value.status == "INVALID_ARGUMENT" and "on_behalf_of" in str(e.value)
            with pytest.raises(PeerError) as e:
                cl.features(
                    "mx",
                    PROBE,
                    activation_epsilon=1.0,
                    weight_epsilon=1.0,
                    activation_clip=(0.0, 4.0),
                    weights_epsilon=1.0,
                    weights_delta=1e-5,
                    on_behalf_of="site-x",
                )
            assert e.value.status == "INVALID_ARGUMENT" and "on_behalf_of" in str(e.value)
            merge = pb.MergeRequest(header=cl.header("site-c"), pool="p", method="rs", epsilon=1.0, delta=1e-5)
            with pytest.raises(PeerError) as e:
                cl._read(cl._release["ReleaseMerged"](merge, timeout=30), "merged", "p")
            assert e.value.status == "INVALID_ARGUMENT" and "on_behalf_of" in str(e.value)
        with Ledger(x.ledger) as led:
            [entry] = led.entries()
        assert sorted(entry.budgets) == ["model/mx/peer/site-b", "model/mx/peer/site-c", "model/mx/total"]


def test_a_probe_set_made_for_another_input_is_refused_before_anything_is_charged_or_asked(tmp_path):
    """Fuse matches on B's probe set: one made for another input than B's model reads
    (peer.nn.probes; here a table of other columns) is refused, FAILED_PRECONDITION with a
    reason, naming the model but not B's columns; nothing is charged, the partner is not asked."""
    from peer.nn.probes import input_signature, probe_bytes
    from peer.nn.tables import ColumnPrep, Preprocessing

    x = make_site(tmp_path, "site-x", models={"mx": (ARCH, model_arrays(seed=2))}, seed=21, policy=policy())
    b = make_site(
        tmp_path, "site-b", models={"mb": (ARCH, model_arrays(seed=1))}, seed=12, probe=PROBE,
        peers={"site-x": "127.0.0.1:1"}, policy=policy(caps="fuse = 10.0"),
    )  # fmt: skip
    c = make_site(tmp_path, "site-c", models={})
    pin_each_other(b, x)
    pin_each_other(b, c)
    columns = tuple(ColumnPrep(f"secret_column_{i}", "numeric") for i in range(64))
    other = input_signature(Preprocessing("y", (0, 1), columns))
    (b.root / "probe.safetensors").write_bytes(probe_bytes(PROBE, other, "another-model"))
    with running(b) as (_, b_address):
        e = refused(c, b_address)
    assert e.status == "FAILED_PRECONDITION" and e.reason == "PROBE_NOT_FOR_MODEL", (e.status, e.reason, str(e))
    assert "'mb'" in str(e) and "secret_column" not in str(e) and e.metadata["model"] == "mb"
    assert seen_at("site-x") == []
    assert ledger_state(b) == ([], [])
