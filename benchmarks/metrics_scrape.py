"""What one scrape of the metrics endpoint costs the ledger, by ledger size.

    .venv/bin/python benchmarks/metrics_scrape.py [--charges 100 1000 3000] [--dir /tmp]

Fills a fresh ledger with the given numbers of charges (Gaussian per-neuron records to four
counterparties and four models, as benchmarks/ledger_throughput.py charges them), then times
the ledger collector's read (``Ledger.summary(pld=False)``, what every uncached scrape does:
it parses every charged record) and a whole exposition of the registry
(``prometheus_client.generate_latest``), uncached and cached. The median of 5 runs each. The
cache (peer.net.metrics.LEDGER_CACHE_S) bounds the ledger's load to one read per window,
however often it is scraped. Results: a table on stdout and benchmarks/results/metrics_scrape.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

from benchmarks.ledger_throughput import POLICY, record  # noqa: E402
from peer.budget.ledger import Ledger  # noqa: E402
from peer.net.metrics import LedgerCollector  # noqa: E402


def median_s(fn, runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(ledger: Ledger) -> tuple[float, float, float, int]:
    """(summary s, uncached scrape s, cached scrape s, exposition bytes) of one ledger."""
    read = median_s(lambda: ledger.summary(pld=False))
    registry = CollectorRegistry()
    collector = LedgerCollector(lambda: ledger.summary(pld=False), cache_s=0.0)
    registry.register(collector)
    scrape = median_s(lambda: generate_latest(registry))
    collector.cache_s = 3600.0
    generate_latest(registry)
    cached = median_s(lambda: generate_latest(registry))
    return read, scrape, cached, len(generate_latest(registry))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--charges", type=int, nargs="+", default=[100, 1000, 3000])
    parser.add_argument("--dir", default=None)
    args = parser.parse_args(argv)
    print(f"{'charges':>8} {'summary ms':>11} {'scrape ms':>10} {'cached ms':>10} {'bytes':>7}")
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for n in args.charges:
            ledger = Ledger(Path(tmp) / f"l{n}.sqlite", POLICY, verify=False)
            for i in range(n):
                ledger.charge(record(i), f"site-{i % 4}")
            read, scrape, cached, size = measure(ledger)
            print(f"{n:>8} {read * 1e3:>11.1f} {scrape * 1e3:>10.1f} {cached * 1e3:>10.2f} {size:>7}")
            rows.append({"charges": n, "summary_s": read, "scrape_s": scrape, "cached_scrape_s": cached, "bytes": size})
            ledger.close()
    out = ROOT / "benchmarks" / "results" / "metrics_scrape.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"runs": 5, "statistic": "median", "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
