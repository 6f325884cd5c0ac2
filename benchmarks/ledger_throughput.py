"""Charges per second of the ledger (SQLite WAL, synchronous=FULL) under contention.

    .venv/bin/python benchmarks/ledger_throughput.py [--charges 400] [--dir /tmp]

Runs the same number of charges (Gaussian per-neuron records read by peer.dp.accounting, a
budget large enough never to refuse) from 1 thread, from 8 threads, and from 4 processes, each against a
fresh ledger file, and prints charges/s side by side. Each charge is one BEGIN IMMEDIATE
transaction with an fsync of the WAL at commit, so the figure is bounded by the disk's fsync
rate; contention adds the busy-wait of writers queued on SQLite's write lock.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import tempfile
import threading
import time
from pathlib import Path

from peer.base.records import ReleaseRecord
from peer.budget.ledger import Ledger
from peer.budget.policy import Policy

POLICY = Policy.from_mapping({"model": {"total": {"epsilon": 1e9, "delta": 1e-6}}})


def record(i: int) -> ReleaseRecord:
    return ReleaseRecord(
        mechanism="gaussian",
        level="model",
        unit="neuron",
        epsilon=0.1,
        delta=1e-5,
        sensitivity=1.0,
        sensitivity_norm="l2",
        parameters={"noise_std": 50.0, "clip_norm": 1.0, "calibration": "analytic"},
        randomness="none",
        subject=f"m{i % 4}",
    )


def charge_many(path: Path, n: int, tag: str) -> None:
    ledger = Ledger(path, POLICY, verify=False)
    for i in range(n):
        ledger.charge(record(i), tag)
    ledger.close()


def _run_all(workers: list) -> float:
    """Start every thread or process at once and return the seconds until all have finished."""
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.perf_counter() - t0


def run_threads(path: Path, total: int, workers: int) -> float:
    Ledger(path, POLICY).close()
    ledger = Ledger(path, POLICY, verify=False)
    per = total // workers

    def work(w: int) -> None:
        for i in range(per):
            ledger.charge(record(i), f"peer-{w}")

    dt = _run_all([threading.Thread(target=work, args=(w,)) for w in range(workers)])
    ledger.verify()
    ledger.close()
    return per * workers / dt


def run_processes(path: Path, total: int, workers: int) -> float:
    Ledger(path, POLICY).close()
    ctx = multiprocessing.get_context("fork")
    per = total // workers
    procs = [ctx.Process(target=charge_many, args=(path, per, f"proc-{w}")) for w in range(workers)]
    dt = _run_all(procs)
    assert all(p.exitcode == 0 for p in procs)
    Ledger(path, POLICY).close()  # verify() at open
    return per * workers / dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--charges", type=int, default=400)
    ap.add_argument("--dir", default=None, help="where the ledger files go (default: a temporary directory)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        d = Path(d)
        rows = [
            ("1 thread", run_threads(d / "t1.db", args.charges, 1)),
            ("8 threads", run_threads(d / "t8.db", args.charges, 8)),
            ("4 processes", run_processes(d / "p4.db", args.charges, 4)),
        ]
    base = rows[0][1]
    print(f"{'writers':12} {'charges/s':>10} {'vs 1 thread':>12}")
    for name, rate in rows:
        print(f"{name:12} {rate:10.0f} {rate / base:12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
