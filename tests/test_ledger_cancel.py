"""Ledger: cancelling a charge whose release never left, and relayed charges (a release to a
relay on behalf of a final caller, charged to the per-counterparty budgets of both)."""

from __future__ import annotations

import json
import math
import sqlite3

import numpy as np
import pytest
from ledger_reference import gaussian_rdp, gaussian_record, laplace_record

from peer.base.errors import (
    BudgetExhausted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from peer.budget.ledger import Ledger
from peer.budget.policy import Policy


def policy(total=(100.0, 1e-5), per_cp=(100.0, 1e-5), caps=None, peers=None) -> Policy:
    d = {
        "model": {
            "total": {"epsilon": total[0], "delta": total[1]},
            "per_counterparty": {"epsilon": per_cp[0], "delta": per_cp[1]},
        },
        "peers": peers or {"*": {"allow": ["features", "weights", "fuse"]}},
    }
    if caps:
        d["caps"] = caps
    return Policy.from_mapping(d)


def totals(path) -> dict[str, tuple]:
    con = sqlite3.connect(path)
    try:
        return {r[0]: r[1:] for r in con.execute("SELECT budget, count, rdp, pure_epsilon FROM totals")}
    finally:
        con.close()


def test_cancel_restores_every_budget_the_charge_touched_bit_for_bit(tmp_path):
    path = tmp_path / "l.db"
    led = Ledger(path, policy())
    r1, r2, r3 = (gaussian_record(noise_std=s) for s in (20.0, 7.0, 30.0))
    led.charge(r1, "b")
    led.charge(r2, "c")
    led.charge(r3, "b")
    cancelled = led.cancel(r2.release_id, "the partner refused")
    assert cancelled["budgets"] == ["model/m/total", "model/m/peer/c"]
    # the same two charges in a fresh ledger: every remaining total is the same sum, to the bit
    ref_path = tmp_path / "ref.db"
    ref = Ledger(ref_path, policy())
    ref.charge(r1, "b")
    ref.charge(r3, "b")
    assert totals(path) == totals(ref_path)
    assert "model/m/peer/c" not in totals(path)  # no charge of c's is left
    rho = gaussian_rdp(led.orders, 1.0, 20.0) + gaussian_rdp(led.orders, 1.0, 30.0)
    np.testing.assert_allclose(json.loads(totals(path)["model/m/total"][1]), rho, rtol=1e-12)
    assert [e.release_id for e in led.entries()] == [r1.release_id, r3.release_id]
    assert [e.release_id for e in led.entries(include_cancelled=True)] == [r1.release_id, r2.release_id, r3.release_id]
    assert [c["release_id"] for c in led.cancellations()] == [r2.release_id]
    assert led.summary(pld=False)["cancelled"][0]["reason"] == "the partner refused"
    led.close()
    Ledger(path, policy()).verify()  # the chain, the cancellations' chain, totals from the rows
    Ledger(path).verify()  # read-only as well


def test_a_cancelled_charge_frees_its_budget_for_the_next_request(tmp_path):
    led = Ledger(tmp_path / "f.db", policy(total=(2.0, 0.0), per_cp=(2.0, 0.0)))
    first = laplace_record(epsilon=1.5)
    led.charge(first, "b")
    with pytest.raises(BudgetExhausted):
        led.charge(laplace_record(epsilon=1.5), "b")
    led.cancel(first.release_id, "nothing left")
    led.charge(laplace_record(epsilon=1.5), "b")
    (total, per) = led.budget_states()
    assert total.count == per.count == 1 and total.spent_epsilon == pytest.approx(1.5)


def test_cancel_is_refused_once_bytes_may_have_left_and_is_final(tmp_path):
    led = Ledger(tmp_path / "r.db", policy())
    for event in ("sent", "send-failed"):
        rec = gaussian_record(noise_std=20.0)
        led.charge(rec, "b")
        led.record_event(rec.release_id, event)
        with pytest.raises(FailedPrecondition, match=f"'{event}' event.*never refunded"):
            led.cancel(rec.release_id, "too late")
    noted = gaussian_record(noise_std=20.0)
    led.charge(noted, "b")
    led.record_event(noted.release_id, "note", "a note is not a delivery")
    led.cancel(noted.release_id, "the note does not say bytes left")
    with pytest.raises(NotFound):
        led.cancel("no-such-release", "x")
    rec = gaussian_record(noise_std=20.0)
    led.charge(rec, "b")
    with pytest.raises(InvalidArgument, match="reason"):
        led.cancel(rec.release_id, " ")
    led.cancel(rec.release_id, "the partner refused")
    with pytest.raises(FailedPrecondition, match="already cancelled"):
        led.cancel(rec.release_id, "again")
    # a cancelled release can be neither sent nor charged again (same record, same id)
    for event in ("sent", "send-failed"):
        with pytest.raises(FailedPrecondition, match="cancelled"):
            led.record_event(rec.release_id, event)
    with pytest.raises(FailedPrecondition, match="cancelled"):
        led.charge(rec, "b")
    assert len(led.entries()) == 2 and len(led.cancellations()) == 2
    with pytest.raises(FailedPrecondition, match="without a policy"):
        Ledger(tmp_path / "r.db").cancel(led.entries()[0].release_id, "read-only")


def test_cancellations_are_append_only_and_chained(tmp_path):
    path = tmp_path / "c.db"
    led = Ledger(path, policy())
    recs = [gaussian_record(noise_std=20.0) for _ in range(3)]
    for r in recs:
        led.charge(r, "b")
    led.cancel(recs[0].release_id, "one")
    led.cancel(recs[1].release_id, "two")
    led.close()
    con = sqlite3.connect(path)
    for sql in ("UPDATE cancellations SET reason = 'x'", "DELETE FROM cancellations"):
        with pytest.raises(sqlite3.DatabaseError, match="append-only"):
            con.execute(sql)
    # a rewritten reason breaks the cancellations' chain
    con.execute("DROP TRIGGER cancellations_no_update")
    con.execute("UPDATE cancellations SET reason = 'rewritten' WHERE release_id = ?", (recs[0].release_id,))
    con.commit()
    con.close()
    with pytest.raises(FailedPrecondition, match="cancellation hash chain broken"):
        Ledger(path, policy())


def test_a_deleted_cancellation_is_detected(tmp_path):
    path = tmp_path / "d.db"
    led = Ledger(path, policy())
    recs = [gaussian_record(noise_std=20.0) for _ in range(2)]
    for r in recs:
        led.charge(r, "b")
    led.cancel(recs[1].release_id, "withdrawn")
    led.close()
    con = sqlite3.connect(path)
    con.execute("DROP TRIGGER cancellations_no_delete")
    con.execute("DELETE FROM cancellations")
    con.commit()
    con.close()
    # the totals no longer equal the sums of the rows that count
    with pytest.raises(FailedPrecondition, match="totals cache for model/m/total differs"):
        Ledger(path, policy())


def test_a_ledger_without_the_cancellations_table_still_reads(tmp_path):
    path = tmp_path / "old.db"
    led = Ledger(path, policy())
    led.charge(gaussian_record(noise_std=20.0), "b")
    led.close()
    con = sqlite3.connect(path)
    for op in ("update", "delete"):
        con.execute(f"DROP TRIGGER cancellations_no_{op}")
    con.execute("DROP TABLE cancellations")
    con.commit()
    con.close()
    old = Ledger(path)
    assert len(old.entries()) == 1 and old.cancellations() == [] and old.budget_states(pld=True)[0].count == 1
    old.close()
    Ledger(path, policy()).cancel(old.entries()[0].release_id, "the table is created at a writable open")


# ---- relayed releases -------------------------------------------------------------------------


def relayed(record, final="c"):
    return record.with_(parameters={**record.parameters, "on_behalf_of": final})


def test_a_relayed_charge_touches_the_relays_and_the_final_callers_budgets_at_once(tmp_path):
    led = Ledger(tmp_path / "rel.db", policy(per_cp=(3.0, 0.0), total=(100.0, 0.0)))
    entry = led.charge(relayed(laplace_record(epsilon=1.0)), "b", also_counterparties=("c",))
    assert sorted(entry.budgets) == ["model/m/peer/b", "model/m/peer/c", "model/m/total"]
    assert entry.counterparty == "b" and entry.record.parameters["on_behalf_of"] == "c"
    # c spends the rest of its own budget directly; a relay asking for c is then refused, and
    # the refusal writes nothing, also not to the relay's budget
    led.charge(laplace_record(epsilon=2.0), "c")
    before = {s.key.name: (s.count, s.spent_epsilon) for s in led.budget_states()}
    with pytest.raises(BudgetExhausted, match="model/m/peer/c"):
        led.charge(relayed(laplace_record(epsilon=1.0)), "b", also_counterparties=("c",))
    assert {s.key.name: (s.count, s.spent_epsilon) for s in led.budget_states()} == before
    # another final caller through the same relay: b's budget has room for it
    led.charge(relayed(laplace_record(epsilon=1.0), "d"), "b", also_counterparties=("d",))
    spent = {s.key.name: s.spent_epsilon for s in led.budget_states()}
    assert spent["model/m/peer/b"] == pytest.approx(2.0) and spent["model/m/peer/d"] == pytest.approx(1.0)
    led.verify()


def test_a_relayed_charge_must_name_whom_it_is_for_and_everyone_must_be_allowed(tmp_path):
    pol = policy(
        caps={"features": 1.0, "weights": 2.0},
        peers={"b": {"allow": ["features", "weights"]}, "c": {"allow": ["features"]}},
    )
    led = Ledger(tmp_path / "n.db", pol)
    with pytest.raises(InvalidArgument, match="on_behalf_of"):
        led.charge(laplace_record(epsilon=0.5), "b", also_counterparties=("c",))  # the record does not say so
    with pytest.raises(InvalidArgument, match="also_counterparties"):
        led.charge(relayed(laplace_record(epsilon=0.5), "b"), "b", also_counterparties=("b",))
    with pytest.raises(InvalidArgument, match="also_counterparties"):
        led.charge(laplace_record(epsilon=0.5), "b", also_counterparties="c")
    led.charge(relayed(laplace_record(epsilon=0.5)), "b", kind="features", also_counterparties=("c",))
    with pytest.raises(PermissionDenied, match="'c'"):
        led.charge(relayed(gaussian_record(noise_std=20.0)), "b", kind="weights", also_counterparties=("c",))
    with pytest.raises(PermissionDenied, match="'x'"):
        led.charge(relayed(laplace_record(epsilon=0.5), "x"), "b", kind="features", also_counterparties=("x",))
    assert len(led.entries()) == 1


def composite(parts, relay_for=None):
    from peer.base.rng import make_randomness
    from peer.ldp.mechanisms import composite_record

    rec = composite_record(parts, "sequential", randomness=make_randomness(0)).with_(subject="m")
    return relayed(rec, relay_for) if relay_for else rec


def test_parts_of_one_release_meet_their_own_caps(tmp_path):
    pol = policy(
        total=(100.0, 0.5),
        per_cp=(100.0, 0.5),
        caps={"features": 1.0, "weights": 2.0},
        peers={"b": {"allow": ["features", "weights"]}, "f": {"allow": ["features"]}},
    )
    led = Ledger(tmp_path / "p.db", pol)
    ok = composite([laplace_record(epsilon=1.0), laplace_record(epsilon=2.0)])
    led.charge(ok, "b", kind=("features", "weights"))  # 3 in all: each part within its cap
    with pytest.raises(InvalidArgument, match="cap 1 for features"):
        led.charge(
            composite([laplace_record(epsilon=1.5), laplace_record(epsilon=0.5)]), "b", kind=("features", "weights")
        )
    with pytest.raises(InvalidArgument, match="cap 2 for weights"):
        led.charge(
            composite([laplace_record(epsilon=0.5), laplace_record(epsilon=2.5)]), "b", kind=("features", "weights")
        )
    with pytest.raises(PermissionDenied, match="weights"):
        led.charge(
            composite([laplace_record(epsilon=0.5), laplace_record(epsilon=0.5)]), "f", kind=("features", "weights")
        )
    with pytest.raises(InvalidArgument, match="kind"):
        led.charge(laplace_record(epsilon=0.5), "b", kind=("features", "weights"))
    assert [e.release_id for e in led.entries()] == [ok.release_id]
    assert math.isclose(led.entries()[0].epsilon, 3.0)
