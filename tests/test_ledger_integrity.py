"""The ledger file against an attacker with write access and against concurrent writers.

- Tamper matrix: with the append-only triggers dropped (as anyone who can write the file can),
  every column of every table that decides a budget is edited, one at a time, in the first and
  the last row; the ledger must refuse to open, with or without a policy.
- Readers take one snapshot: ``verify()`` and ``summary()`` against a ledger another process is
  charging never see rows and totals from different moments.
"""

from __future__ import annotations

import json
import multiprocessing
import shutil
import sqlite3
import traceback

import pytest
from ledger_reference import gaussian_record, laplace_record
from test_ledger import collect, full_batch

from peer.base.errors import BudgetExhausted, FailedPrecondition
from peer.budget.ledger import Ledger
from peer.budget.policy import Policy


def policy(**over) -> Policy:
    d = {
        "peers": {"*": {"allow": ["features", "weights", "merge", "fuse", "ledger"]}},
        "model": {"total": {"epsilon": 6.0, "delta": 1e-6}, "per_counterparty": {"epsilon": 4.0, "delta": 1e-6}},
        "data": {"unit": "record:add-remove", "epsilon": 50.0, "delta": 1e-5},
    }
    d.update(over)
    return Policy.from_mapping(d)


def build(path) -> None:
    """A ledger with every kind of row: model-level charges to two counterparties (two budgets
    each; pure and approximate), data-level RS and DP-SGD charges (pool model rows), events."""
    from peer.dp.accounting.release_accounting import dpsgd_record, rs_merge_record

    pool = {f"pool/m{i}": full_batch(s, steps=2) for i, s in enumerate([3.0, 6.0])}
    with Ledger(path, policy()) as led:
        led.charge(laplace_record(epsilon=0.5), "b")
        led.charge(gaussian_record(noise_std=20.0), "c")
        led.charge(rs_merge_record(list(pool.values()), [0.25, 0.75], 1e-5, names=list(pool), subject="pool"), "b")
        led.charge(dpsgd_record(pool["pool/m1"], 1e-5, subject="pool/m1"), "c")
        e = led.charge(laplace_record(epsilon=0.25), "c")
        led.record_event(e.release_id, "sent")
        led.record_event(led.entries()[0].release_id, "send-failed", "stream ended")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tamper") / "pristine.db"
    build(path)
    assert not path.with_name(path.name + "-wal").exists() or path.with_name(path.name + "-wal").stat().st_size == 0
    return path


def tweak(column: str, value):
    """A different value of the same kind (valid JSON stays valid JSON, numbers stay numbers)."""
    if column == "lc":
        return 1 - value
    if isinstance(value, int):
        return value + 1000
    if isinstance(value, float):
        return 0.5 if value in (0.0, float("inf")) else value / 2
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    if isinstance(parsed, list) and parsed:
        first = parsed[0]
        parsed[0] = first / 2 if isinstance(first, (int, float)) and first else (first or "") + "x"
        return json.dumps(parsed, separators=(",", ":"))
    if isinstance(parsed, dict):
        key = next(
            k for k, v in sorted(parsed.items()) if isinstance(v, (int, float)) and not isinstance(v, bool) and v
        )
        parsed[key] = parsed[key] / 2
        return json.dumps(parsed, separators=(",", ":"), sort_keys=True)
    return value + "x"


TABLES = {
    "charges": "seq",
    "charge_budgets": "seq, budget",
    "charge_models": "seq, model",
    "totals": "budget",
    "events": "id",
}
# meta is covered by its own tests below: the filter's orders and the schema version
# (meta.created_at decides nothing).


def columns(con, table):
    return [r[1] for r in con.execute(f"PRAGMA table_info({table})")]


def cases(path):
    con = sqlite3.connect(path)
    try:
        out = []
        for table, order in TABLES.items():
            for column in columns(con, table):
                for which in ("first", "last"):
                    out.append((table, column, which, order))
        return out
    finally:
        con.close()


def tamper(path, sql, args=()) -> None:
    con = sqlite3.connect(path)
    try:
        for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall():
            con.execute(f"DROP TRIGGER {name}")
        cur = con.execute(sql, args)
        assert cur.rowcount == 1, sql
        con.commit()
    finally:
        con.close()


def refuses(path) -> None:
    with pytest.raises(FailedPrecondition):
        Ledger(path, policy()).close()
    with pytest.raises(FailedPrecondition):
        Ledger(path).close()


def test_the_pristine_file_opens(pristine, tmp_path):
    copy = tmp_path / "copy.db"
    shutil.copy(pristine, copy)
    with Ledger(copy, policy()) as led:
        assert len(led.entries()) == 5 and len(led.events()) == 2
        assert {s.key.name for s in led.budget_states()} == {
            "data/record:add-remove",
            "model/m/total",
            "model/m/peer/b",
            "model/m/peer/c",
        }
    with Ledger(copy) as led:
        led.verify()


def test_every_column_of_every_table_is_covered(pristine, tmp_path):
    done = []
    for table, column, which, order in cases(pristine):
        copy = tmp_path / f"{table}.{column}.{which}.db"
        shutil.copy(pristine, copy)
        con = sqlite3.connect(copy)
        direction = "ASC" if which == "first" else "DESC"
        rowid, value = con.execute(
            f"SELECT rowid, {column} FROM {table} ORDER BY {order.replace(',', f' {direction},')} {direction} LIMIT 1"
        ).fetchone()
        con.close()
        tamper(copy, f"UPDATE {table} SET {column} = ? WHERE rowid = ?", (tweak(column, value), rowid))
        try:
            refuses(copy)
        except pytest.fail.Exception:
            pytest.fail(
                f"an edit of {table}.{column} ({which} row: {value!r} -> {tweak(column, value)!r}) went unnoticed"
            )
        done.append((table, column))
    # every column of the five tables, the charges table's seventeen among them
    assert len({c for t, c in done if t == "charges"}) == 17 and len(done) == 2 * (17 + 8 + 3 + 9 + 7)


@pytest.mark.parametrize(
    "sql",
    [
        "DELETE FROM charges WHERE seq = 2",
        "DELETE FROM charge_budgets WHERE seq = 2 AND budget = 'model/m/peer/c'",
        "DELETE FROM charge_models WHERE seq = 3 AND model = 'pool/m0'",
        "INSERT INTO charge_models VALUES (2, 'pool/m0', 0)",
        "INSERT INTO charge_budgets VALUES (1, 'model/m/peer/c', 'model', 'neuron', 'm', 'c', 4.0, 1e-6)",
        "DELETE FROM totals WHERE budget = 'model/m/peer/b'",
        "DELETE FROM events WHERE id = 1",
        "UPDATE meta SET value = '1' WHERE key = 'schema_version'",
    ],
)
def test_deleted_and_inserted_rows_are_noticed(pristine, tmp_path, sql):
    copy = tmp_path / "rows.db"
    shutil.copy(pristine, copy)
    tamper(copy, sql)
    refuses(copy)


def test_the_filter_orders_are_covered(pristine, tmp_path):
    copy = tmp_path / "orders.db"
    shutil.copy(pristine, copy)
    con = sqlite3.connect(copy)
    orders = json.loads(con.execute("SELECT value FROM meta WHERE key = 'orders'").fetchone()[0])
    con.close()
    # the same number of orders, each a little higher: every stored RDP vector now reads lower
    tamper(copy, "UPDATE meta SET value = ? WHERE key = 'orders'", (json.dumps([o + 0.5 for o in orders]),))
    with pytest.raises(FailedPrecondition, match="hash chain broken at entry 1"):
        Ledger(copy).close()
    with pytest.raises(FailedPrecondition, match="orders"):
        Ledger(copy, policy(orders=[o + 0.5 for o in orders])).close()


def test_zeroing_pure_epsilon_in_rows_and_totals_is_refused(tmp_path):
    """The attack the old chain let through: on a pure budget of 1, after ε = 1 of Laplace,
    zero the pure ε of the charges and of the cache consistently; the old ledger reopened and
    admitted another 1.0."""
    path = tmp_path / "pure.db"
    pure = policy(model={"total": {"epsilon": 1.0, "delta": 0.0}})
    with Ledger(path, pure) as led:
        led.charge(laplace_record(epsilon=0.5), "b")
        led.charge(laplace_record(epsilon=0.5), "b")
        with pytest.raises(BudgetExhausted):
            led.charge(laplace_record(epsilon=0.5), "b")
    con = sqlite3.connect(path)
    for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall():
        con.execute(f"DROP TRIGGER {name}")
    con.execute("UPDATE charges SET pure_epsilon = 0")
    con.execute("UPDATE totals SET pure_epsilon = 0")
    con.commit()
    con.close()
    with pytest.raises(FailedPrecondition, match="hash chain broken at entry 1"):
        Ledger(path, pure)


def test_a_schema_1_ledger_is_refused_with_the_reason(pristine, tmp_path):
    copy = tmp_path / "v1.db"
    shutil.copy(pristine, copy)
    tamper(copy, "UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    with pytest.raises(FailedPrecondition, match=r"schema version 1.*not migrated.*start a new ledger"):
        Ledger(copy, policy())


# ---- one snapshot per reader ---------------------------------------------------------------------


def _charging_child(path, n, queue):
    try:
        with Ledger(path, policy()) as led:
            for i in range(n):
                led.charge(gaussian_record(noise_std=400.0), "b" if i % 2 else "c")
        queue.put(("ok", n))
    except BaseException:
        queue.put(("error", traceback.format_exc()))


def test_readers_see_one_snapshot_while_another_process_charges(tmp_path):
    """verify() (rows, chain and totals) and summary() (entries and budgets) run in a loop while
    a child process commits charges; each read must be consistent in itself. Before readers took
    one read transaction, verify() reported 'totals cache … differs' in a few of these loops."""
    path = tmp_path / "live.db"
    Ledger(path, policy()).close()
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_charging_child, args=(path, 300, queue))
    child.start()
    reads = 0
    with Ledger(path) as reader:
        while child.is_alive() or reads < 5:
            reader.verify()
            s = reader.summary(pld=False)
            counts = {b["budget"]: b["count"] for b in s["budgets"]}
            assert counts.get("model/m/total", 0) == len(s["entries"])
            assert counts.get("model/m/peer/b", 0) + counts.get("model/m/peer/c", 0) == len(s["entries"])
            reads += 1
    assert collect(queue, [child]) == [300]
    child.join(30)
    assert child.exitcode == 0 and reads >= 5
    with Ledger(path) as reader:
        assert len(reader.entries()) == 300
