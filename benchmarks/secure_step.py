"""A step of peer-to-peer DP training, secure aggregation against plain P2P, over real daemons.

    .venv/bin/python benchmarks/secure_step.py                # 998,070-parameter MLP, k = 4 and 12, 5 steps
    .venv/bin/python benchmarks/secure_step.py --sites 4 --loops processes --records 32
    .venv/bin/python benchmarks/secure_step.py --quick        # a 4,810-parameter MLP, k = 4, 3 steps

What runs, for each k of --sites (every site a directory in a temporary folder, or --work DIR):

- k sites, each with its own identity (``init_identity``: an ECDSA key and a certificate for
  127.0.0.1), every site's certificate pinned in every other's trust store, a model store holding
  the MLP 64 → [1024, 900] → 10 (998,070 parameters; --quick: 64 → [64] → 10, 4,810), its own
  records (``records.npz``: --records rows of 64 features drawn around ten class means), a fresh
  ledger (data budget per record, add-remove) and a site.toml that allows its peers segments,
  ledger and secure sums.
- k daemons: ``privfusion peer serve`` of each site, a process of its own on 127.0.0.1 (mutual
  TLS, pinned certificates; ``benchmarks.round_scale.Daemon``), and a roster of their addresses.
- **plain**: every site's loop runs ``method = "iterate"`` (local noise: each round one DP-SGD
  segment of 1 full-batch step on its records, charged, published on its daemon, the k − 1 peers'
  segments fetched and averaged), --steps rounds × 1 local step.
- **secure**: the same plan with ``secure = true``, coalition t = 1
  (``coordinator_free.secure_iterate``: per step the per-record gradients of every record at θ,
  in float64, clipped, summed, scaled by γ = 1024 and rounded (no rotation: the run's encoding
  has none), plus the site's Skellam share, masked by k − 1 pairwise ChaCha20 streams mod 2^32,
  signed, exchanged, digests forwarded, summed and decoded), --steps steps. The secure run takes the full batch too (sample_rate 1): it computes
  every record's gradient each step whatever q is, so a smaller q would not shorten its step.
  Both runs: η = 0.5, C = 1, ε = 8 at δ = 1e-5 over the run, declared_records = --records,
  wait_s = call_timeout_s = 300 (12 sites on 2 cores are slow, and a late peer must not become a
  dropout).
- The loops are the real ``privfusion round`` code (``coordinator_free.runner.run_rounds``), each
  site's on a thread of this process (default, ``--loops threads``: ``scenarios.processes
  .RoundThread``, as ``privfusion simulate`` runs them) or in a ``privfusion round`` process of its
  own (``--loops processes``: ``RoundProcess``, one torch thread each, as a site runs it; each
  process holds torch again, about 0.5 GB more per site); every call a mutual-TLS call to a peer's
  daemon either way.

**Time per step**, from the sites' own ledgers: the interval between a site's consecutive charges
of the run (each round's segment; each step's masked vector, charged before it leaves), so one
full period of the synchronised loop — the rest of step s, then the gradients, keys and encoding
of step s + 1. From each site's second charge on (its first comes before it waits for anyone: a
plain site charges round 1 as soon as it has started, whoever else has), so --steps S gives
k × (S − 2) intervals; the step is their median. Beside it, the plain run's own report
(``seconds`` of each round: segment to fused model), the secure run's (its start to its end,
start-up included) and each run's wall time (the first loop's start to the last one's end).

**Bytes per site per step**, from the real counters: plain, the report's segment bytes fetched
and served (``bytes_received``, ``bytes_sent``: the float32 arrays, k − 1 copies each way); secure,
each site's boundary put together from every site's report (``DaemonTransport.traffic``,
protobuf ``ByteSize()`` at the gRPC clients, polls included: ``scenarios.iterate_sites
.secure_bytes``), divided by the steps; the masked vector itself is d residues of 4 bytes,
the size of the float32 segment.

**Memory**: the loops' resident sets, sampled every 0.1 s (threads: this process's VmHWM, reset
before each run; processes: each one's VmHWM, summed, and the largest), the most they held at once
(the largest sampled sum of VmRSS), and each daemon's peak (VmHWM at the end, or its RSS at ready
if larger). A secure site holds its records' per-example gradients in float32, then flattened into
one float32 matrix (the sampled rows are that matrix at q = 1, a copy otherwise): about
2 × 4 bytes × records × d, so records per site are few (--records, default 16) — a few hundred
would need gigabytes per site at d = 10⁶.

**Floors**, measured in this process in the same run, before the daemons start: one float32
matmul of n × n (n = 2048, about 17 GFLOP; --quick 512), one forward + backward pass of the model
on one site's batch (the mean loss), the per-example gradients of that batch as DP-SGD takes them
(``per_example_gradients``, vmap), and the model's float32 bytes over loopback TCP
(``benchmarks.transfer.raw_round``). And one site's local work of a step, alone, through the
runs' own calls: plain, its segment (``run_dpsgd``, one step); secure, the gradients as
``secure_iterate`` takes them (per-example, flattened into float32, the sampled rows) and then
secure aggregation's core at the run's encoding for k sites (``benchmarks.secagg.one_round``:
encode, noise share, keys, masks, digest, sum, decode; no wire) — what the step of each mode
costs one site before any waiting, so which part of the difference is computation.

Results: a table on stdout and benchmarks/results/secure_step.json (secure_step_quick.json for
--quick), with the machine's facts (cores, load average, Python and torch versions).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "proto"))

import numpy as np  # noqa: E402

from benchmarks.round_scale import Daemon  # noqa: E402  (`privfusion peer serve` of one site)
from benchmarks.transfer import machine_facts, raw_round, reset_hwm, vm  # noqa: E402

MIB = 1 << 20
TARGET_RATIO = 1.30  # issue 22: secure aggregation adds under 30% to a step's wall time at 4 sites
FULL = {"hidden": [1024, 900], "records": 16, "steps": 5, "matmul": 2048}
QUICK = {"hidden": [64], "records": 16, "steps": 3, "matmul": 512}
EPSILON, DELTA = 8.0, 1e-5
WAIT_S = 300.0

POLICY = """
[policy]
show_remaining = "own"

[policy.data]
unit = "record:add-remove"
epsilon = 1000.0
delta = 1e-3

[policy.peers."*"]
allow = ["segment", "ledger", "secure-sum"]
"""


def architecture(hidden: list[int]) -> dict:
    return {"kind": "mlp", "input_dim": 64, "hidden": list(hidden), "output_dim": 10, "activation": "relu"}


def parameters(arch: dict) -> int:
    widths = [arch["input_dim"], *arch["hidden"], arch["output_dim"]]
    return sum(a * b + b for a, b in itertools.pairwise(widths))


@dataclass
class BenchSite:
    """What ``scenarios.processes.RoundThread`` needs of a site: its name and directory."""

    name: str
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "site.toml"

    @property
    def ledger(self) -> Path:
        return self.root / "ledger.sqlite"


def records(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` rows of 64 features around ten public class means, and their labels."""
    means = np.random.default_rng(0).normal(size=(10, 64))
    rng = np.random.default_rng(seed)
    y = rng.permutation(np.arange(n) % 10).astype(np.int64)
    return (means[y] + rng.normal(size=(n, 64))).astype(np.float32), y


def make_sites(root: Path, k: int, arch: dict, n: int) -> list[BenchSite]:
    """k sites on disk (identity, model store, records, ledger-to-be, site.toml), pinned to each other."""
    from peer.net.identity import init_identity
    from peer.net.trust import TrustStore
    from peer.nn.architectures import build_model
    from peer.nn.store import save_model

    arrays = {k_: v.detach().numpy() for k_, v in build_model(arch, seed=0).state_dict().items()}
    sites, certs = [], {}
    for i in range(k):
        s = BenchSite(f"site-{i:02d}", root / f"site-{i:02d}")
        s.root.mkdir(parents=True)
        certs[s.name] = init_identity(s.root / "identity", s.name, ["127.0.0.1"]).cert_pem
        save_model(s.root / "models", "mlp", arch, arrays)
        x, y = records(n, 100 + i)
        np.savez(s.root / "records.npz", x=x, y=y)
        s.config.write_text(
            "\n".join(
                [
                    "[site]",
                    f'name = "{s.name}"',
                    'listen = "127.0.0.1:0"',
                    'identity = "identity"',
                    'models = "models"',
                    'ledger = "ledger.sqlite"',
                    "workers = 16",
                    "shutdown_grace_s = 5",
                ]
            )
            + "\n"
            + POLICY
        )
        sites.append(s)
    for s in sites:
        store = TrustStore(s.root / "identity" / "trusted")
        for o, pem in certs.items():
            if o != s.name:
                store.add(pem)
    return sites


def round_toml(roster: Path, run: str, steps: int, n: int, secure: bool) -> str:
    lines = [
        "[round]",
        f'roster = "{roster}"',
        'model = "mlp"',
        'method = "iterate"',
        'out = "rounds"',
        f"call_timeout_s = {WAIT_S}",
        "health_timeout_s = 30.0",
        "",
        "[round.iterate]",
        'records = "records.npz"',
        f'run = "{run}"',
        f"rounds = {steps}",
        "local_steps = 1",
        "learning_rate = 0.5",
        "clip_norm = 1.0",
        f"epsilon = {EPSILON}",
        f"delta = {DELTA}",
        'adjacency = "add-remove"',
        f"declared_records = {n}",
        "init_seed = 11",
        f"wait_s = {WAIT_S}",
        *(["secure = true", "coalition = 1"] if secure else []),
    ]
    return "\n".join(lines) + "\n"


class Sampler:
    """Resident memory of the loops while they run, every ``every`` seconds: ``pids()`` gives the
    processes that hold them (this one for threads); per process the largest VmHWM and VmRSS
    read, and the largest sum of their VmRSS at one sampling (what they held at once)."""

    def __init__(self, pids, every: float = 0.1):
        self.pids = pids
        self.hwm: dict = {}
        self.rss: dict = {}
        self.together = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)

    def _run(self, every: float) -> None:
        while not self._stop.is_set():
            total = 0
            for pid in self.pids():
                try:
                    m = vm(pid)
                except OSError:  # exiting
                    continue
                if not m:
                    continue
                self.hwm[pid] = max(self.hwm.get(pid, 0), m["VmHWM"])
                self.rss[pid] = max(self.rss.get(pid, 0), m["VmRSS"])
                total += m["VmRSS"]
            self.together = max(self.together, total)
            time.sleep(every)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def at(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def charge_times(ledger: Path, run: str) -> list[float]:
    """Epoch seconds of every data-level charge of ``run`` in a site's ledger, in order."""
    from peer.budget.ledger import Ledger

    led = Ledger(ledger)
    try:
        return sorted(at(e.charged_at) for e in led.entries(level="data", subject=run))
    finally:
        led.close()


def run_mode(sites: list[BenchSite], roster: Path, mode: str, k: int, steps: int, n: int, loops: str) -> dict:
    """Every site's loop of one run (plain or secure), all at once: each a thread of this process
    (``loops = "threads"``: ``scenarios.processes.RoundThread``, as ``privfusion simulate``) or a
    ``privfusion round`` process (``"processes"``: ``RoundProcess``, one torch thread each)."""
    from scenarios.processes import RoundProcess, RoundThread

    run = f"{mode}-k{k}"
    secure = mode == "secure"
    files = {}
    for s in sites:
        f = s.root / f"{run}.toml"
        f.write_text(round_toml(roster, run, steps, n, secure))
        files[s.name] = f
    if loops == "threads":
        reset_hwm()
    started: dict = {}

    def pids():
        if loops == "threads":
            return [os.getpid()]
        return [r.proc.pid for r in started.values()]

    t0 = time.time()
    with Sampler(pids) as sampler:
        kind = RoundThread if loops == "threads" else RoundProcess
        for s in sites:
            started[s.name] = kind(s, [files[s.name]], lambda e: None)
        codes = {name: loop.wait() for name, loop in started.items()}
    wall = time.time() - t0
    if loops == "threads":
        own = vm()
        peaks = [max(own["VmHWM"], sampler.hwm.get(os.getpid(), 0))]
    else:
        peaks = list(sampler.hwm.values())
    bad = {name: c for name, c in codes.items() if c != 0}
    if bad:
        logs = {s.name: (s.root / "rounds.log").read_text()[-2000:] for s in sites if (s.root / "rounds.log").exists()}
        raise SystemExit(f"{run}: loops exited {bad}: {logs}")
    reports = {s.name: json.loads((s.root / "rounds" / f"{run}.json").read_text()) for s in sites}
    for name, rep in reports.items():
        if rep["status"] != "finished":
            raise SystemExit(f"{run} at {name}: {rep['status']}: {rep['reason']}")
    return {
        "run": run,
        "wall_s": wall,
        "reports": reports,
        # the sum of every loop process's peak (threads: the one process's), and the most they
        # held at once by the samples
        "loops_peak_rss": sum(peaks),
        "loop_process_peak_rss": max(peaks),
        "loops_rss_sampled": sampler.together,
    }


def summarise(mode: str, k: int, steps: int, measured: dict, charges: dict[str, list[float]]) -> dict:
    """Per-step figures of one run from its reports and the sites' charge times."""
    from scenarios.iterate_sites import secure_bytes

    reports = measured["reports"]
    # from each site's second charge on: its first comes before any wait for a peer (plain: the
    # segment of round 1 is charged as soon as the site has started, before the others have)
    intervals = [b - a for times in charges.values() for a, b in itertools.pairwise(times[1:])]
    counts = {name: len(t) for name, t in charges.items()}
    if any(c != steps for c in counts.values()):
        raise SystemExit(f"{measured['run']}: expected {steps} charges per site, the ledgers hold {counts}")
    out = {
        "mode": mode,
        "sites": k,
        "steps": steps,
        "step_s": statistics.median(intervals) if intervals else None,
        "step_intervals_s": intervals,
        "wall_s": measured["wall_s"],
        "loops_peak_rss": measured["loops_peak_rss"],
        "loop_process_peak_rss": measured["loop_process_peak_rss"],
        "loops_rss_sampled": measured["loops_rss_sampled"],
    }
    if mode == "plain":
        rounds = [r for rep in reports.values() for r in rep["rounds"]]
        out["report_round_s"] = statistics.median(r["seconds"] for r in rounds)
        out["report_round_s_after_first"] = (
            statistics.median(r["seconds"] for r in rounds if r["round"] > 1) if steps > 1 else None
        )
        out["bytes_sent_per_step"] = statistics.mean(rep["bytes_sent"] / steps for rep in reports.values())
        out["bytes_received_per_step"] = statistics.mean(rep["bytes_received"] / steps for rep in reports.values())
        out["segment_bytes"] = rounds[0]["segment"]["bytes"]
        out["fresh"] = all(p["state"] == "fresh" for r in rounds for p in r["peers"].values())
    else:
        per_site = {name: secure_bytes(name, reports) for name in reports}
        out["bytes_sent_per_step"] = statistics.mean(b["bytes_sent"] / steps for b in per_site.values())
        out["bytes_received_per_step"] = statistics.mean(b["bytes_received"] / steps for b in per_site.values())
        out["bytes_published_per_step"] = statistics.mean(b["bytes_published"] / steps for b in per_site.values())
        # the peers' replies alone (keys, masked vectors, forwarded digests): no polls in them
        out["bytes_replies_received_per_step"] = statistics.mean(
            b["bytes_wire"]["replies_received"] / steps for b in per_site.values()
        )
        out["padded_dim"] = next(iter(reports.values()))["plan"]["padded_dim"]
        out["bits"] = next(iter(reports.values()))["plan"]["modulus_bits"]
        out["attempts_rerun"] = sum(1 for rep in reports.values() for st in rep["steps"] if st["attempt"] > 0)
        out["report_run_s"] = statistics.median(
            at(rep["finished_at"]) - at(rep["started_at"]) for rep in reports.values()
        )
    return out


def bench_sites(work: Path, k: int, arch: dict, n: int, steps: int, loops: str) -> dict:
    root = work / f"k{k}"
    sites = make_sites(root, k, arch, n)
    daemons = {s.name: Daemon(s.root) for s in sites}
    try:
        addresses = {name: d.wait_ready() for name, d in daemons.items()}
        from coordinator_free.roster import write_roster

        roster = write_roster(
            root / "roster.toml",
            [(s.name, addresses[s.name], str((s.root / "identity" / "site.crt").resolve())) for s in sites],
        )
        measured = {}
        for mode in ("plain", "secure"):
            print(f"k = {k}: {mode} run of {steps} steps", file=sys.stderr, flush=True)
            measured[mode] = run_mode(sites, Path(roster).resolve(), mode, k, steps, n, loops)
        daemon_memory = {
            name: {"idle_rss": d.idle_rss, "peak_rss": max(vm(d.proc.pid)["VmHWM"], d.idle_rss)}
            for name, d in daemons.items()
        }
    finally:
        for d in daemons.values():
            d.stop()
    out = {"sites": k, "daemons_peak_rss": max(m["peak_rss"] for m in daemon_memory.values()), "daemons": daemon_memory}
    for mode, m in measured.items():
        charges = {s.name: charge_times(s.ledger, m["run"]) for s in sites}
        out[mode] = summarise(mode, k, steps, m, charges)
    p, s = out["plain"], out["secure"]
    out["ratio_step"] = s["step_s"] / p["step_s"] if p["step_s"] and s["step_s"] else None
    out["ratio_wall"] = s["wall_s"] / p["wall_s"]
    out["ratio_bytes_received"] = s["bytes_received_per_step"] / p["bytes_received_per_step"]
    return out


# ------------------------------------------------------------------------------ floors


def median_time(fn, repeats: int = 3) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def floors(arch: dict, n: int, matmul: int, sites: list[int]) -> dict:
    import torch

    from benchmarks.secagg import identity, one_round
    from coordinator_free.secure_iterate import flat_gradients, sampled_rows
    from peer.base.rng import make_randomness
    from peer.dp.accounting import TrainingRecord
    from peer.dp.distributed.encoding import Encoding
    from peer.dp.distributed.skellam import calibrate_share
    from peer.dp.training import classifier_loss, per_example_gradients, run_dpsgd
    from peer.nn.architectures import build_model

    a = torch.randn(matmul, matmul)
    b = torch.randn(matmul, matmul)
    out = {"matmul_n": matmul, "matmul_s": median_time(lambda: a @ b)}
    out["matmul_gflops"] = 2 * matmul**3 / out["matmul_s"] / 1e9
    model = build_model(arch, seed=0)
    x, y = records(n, 1)
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)

    def fwd_bwd():
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(xt), yt).backward()

    out["forward_backward_s"] = median_time(fwd_bwd)
    loss = classifier_loss(model)
    params = {k_: v.detach() for k_, v in model.named_parameters()}
    out["per_example_gradients_s"] = median_time(lambda: per_example_gradients(loss, params, xt, yt))
    nbytes = parameters(arch) * 4
    out["model_bytes"] = nbytes
    out["loopback_s"] = statistics.median(raw_round(nbytes) for _ in range(3))
    out["loopback_bytes_per_s"] = nbytes / out["loopback_s"]
    # one site's local work of a step, alone on the machine, the runs' own calls in their order.
    # plain: the segment (run_dpsgd: per-example gradients, clip, sum, Gaussian noise, update).
    training = TrainingRecord.constant("add-remove", 1, 0.5, 1.0, 1.0)
    out["plain_segment_s"] = median_time(
        lambda: run_dpsgd(loss, params, xt, yt, training.steps, randomness=make_randomness(None), dataset_size=n)
    )
    # secure, before the core: the gradients as secure_iterate takes them (per-example, then
    # flattened into one float32 matrix, then the sampled rows: every row at q = 1, no copy)
    order = sorted(params)
    timings: dict[str, list[float]] = {"gradients": [], "flatten": [], "rows": []}
    for _ in range(3):
        t0 = time.perf_counter()
        grads = per_example_gradients(loss, params, xt, yt)
        t1 = time.perf_counter()
        flat = flat_gradients(grads, order, n)
        t2 = time.perf_counter()
        rows = sampled_rows(flat, np.arange(n))
        t3 = time.perf_counter()
        for key, v in zip(timings, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            timings[key].append(v)
        del grads, flat, rows
    out["secure_gradients_s"] = {key: statistics.median(v) for key, v in timings.items()}
    # then secure aggregation's core for one site at the run's encoding (summed, γ = 1024,
    # b = 32, no rotation): encode, noise share, keys, masks, digest, sum, decode
    dim = parameters(arch)
    enc = Encoding(dim=dim, clip_norm=1.0, scale=1024.0, bits=32, beta=0.0)
    rng = np.random.default_rng(2)
    out["secagg_core"] = {}
    for k in sites:
        cal = calibrate_share(EPSILON, DELTA, k, 1, enc.l1_sensitivity, enc.l2_sensitivity, 1.0, 10)
        ids = [identity(f"site-{i:02d}") for i in range(k)]
        runs = [one_round(dim, k, enc, cal.share_variance, rng, ids, n) for _ in range(2)]
        core = {key: statistics.median(r["seconds"][key] for r in runs) for key in runs[0]["seconds"]}
        out["secagg_core"][str(k)] = core
    return out


# ------------------------------------------------------------------------------ report


def table(result: dict) -> str:
    f = result["floors"]
    mb = 1e6
    lines = [
        f"MLP 64 → {result['architecture']['hidden']} → 10: {result['parameters']:,} parameters "
        f"({result['parameters'] * 4 / mb:.2f} MB float32); {result['records_per_site']} records per site, "
        f"full batch, {result['steps']} steps per run; each site's loop "
        f"{'a privfusion round process' if result['loops'] == 'processes' else 'a thread of this process'}",
        "step: the median interval between a site's consecutive charges (all sites, all intervals); "
        "bytes: per site per step",
        "",
        "| k | mode | step s | wall s (run) | MB sent | MB received | loops' RSS MiB: peaks summed (largest) "
        "| daemon peak RSS MiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["sites"].values():
        for mode in ("plain", "secure"):
            m = r[mode]
            step = f"{m['step_s']:.2f}" if m["step_s"] is not None else "-"
            lines.append(
                f"| {r['sites']} | {mode} | {step} | {m['wall_s']:.1f} | {m['bytes_sent_per_step'] / mb:.2f} | "
                f"{m['bytes_received_per_step'] / mb:.2f} | {m['loops_peak_rss'] / MIB:.0f} "
                f"({m['loop_process_peak_rss'] / MIB:.0f}) | "
                f"{r['daemons_peak_rss'] / MIB:.0f} |"
            )
        ratio = f"{r['ratio_step']:.2f}" if r["ratio_step"] is not None else "-"
        lines.append(
            f"| {r['sites']} | secure / plain | {ratio} | {r['ratio_wall']:.2f} | | {r['ratio_bytes_received']:.3f} | | |"
        )
    lines += [
        "",
        f"floor: float32 matmul {f['matmul_n']}×{f['matmul_n']}: {f['matmul_s'] * 1e3:.0f} ms "
        f"({f['matmul_gflops']:.0f} GFLOP/s); forward+backward of one site's batch: "
        f"{f['forward_backward_s'] * 1e3:.0f} ms; its per-example gradients (vmap): "
        f"{f['per_example_gradients_s'] * 1e3:.0f} ms; the model's {f['model_bytes'] / mb:.2f} MB over loopback "
        f"TCP: {f['loopback_s'] * 1e3:.1f} ms ({f['loopback_bytes_per_s'] / MIB:.0f} MiB/s)",
    ]
    g = f["secure_gradients_s"]
    lines.append(
        f"one site's local work of a step, alone (ms): plain segment (run_dpsgd) {f['plain_segment_s'] * 1e3:.0f}; "
        f"secure: per-example gradients {g['gradients'] * 1e3:.0f}, flattened (float32) "
        f"{g['flatten'] * 1e3:.0f}, rows {g['rows'] * 1e3:.0f}, then the core:"
    )
    for k, core in f["secagg_core"].items():
        parts = ", ".join(f"{key} {v * 1e3:.0f}" for key, v in core.items())
        local = core["total"] + sum(g.values())
        lines.append(f"  k = {k} (no wire): {parts}; secure local work in all {local * 1e3:.0f}")
    t = result.get("target")
    if t:
        lines.append(
            f"target: secure adds under 30% to a step at 4 sites: ratio {t['ratio']:.2f}, "
            f"{'met' if t['met'] else 'MISSED'}"
        )
    m = result["machine"]
    lines.append(
        f"machine: {m['cpus']} cores, load average {', '.join(f'{v:.2f}' for v in m['load_avg_before'])} before, "
        f"{', '.join(f'{v:.2f}' for v in m['load_avg_after'])} after; python {m['python']}, torch {m['torch']} "
        f"({m['torch_threads']} threads)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 4,810-parameter MLP, k = 4, 3 steps: a short check")
    parser.add_argument("--sites", type=int, nargs="+", help="site counts (default 4 12; --quick: 4)")
    parser.add_argument(
        "--steps", type=int, help="steps per run (rounds × 1 local step; default 5, --quick 3; at least 3)"
    )
    parser.add_argument("--records", type=int, help="records per site (default 32, --quick 16)")
    parser.add_argument(
        "--loops",
        choices=("processes", "threads"),
        default="threads",
        help="each site's loop a thread of this process (default) or a `privfusion round` process of its own",
    )
    parser.add_argument("--work", type=Path, help="work directory (kept; default: a temporary one)")
    parser.add_argument("--out", type=Path, help="JSON results (default benchmarks/results/secure_step[_quick].json)")
    args = parser.parse_args(argv)
    size = QUICK if args.quick else FULL
    ks = args.sites or ([4] if args.quick else [4, 12])
    steps = args.steps or size["steps"]
    n = args.records or size["records"]
    if steps < 3:
        raise SystemExit("--steps: at least 3 (the step time is the interval between charges from the second on)")
    if min(ks) < 3:
        raise SystemExit("--sites: a secure run with coalition 1 needs at least 3 sites")
    arch = architecture(size["hidden"])
    # the loop processes import this checkout (the daemons' env sets the same)
    from benchmarks.round_scale import child_env

    os.environ["PYTHONPATH"] = child_env()["PYTHONPATH"]
    out = args.out or ROOT / "benchmarks" / "results" / ("secure_step_quick.json" if args.quick else "secure_step.json")

    load_before = os.getloadavg()
    print(f"{parameters(arch):,} parameters; floors first", file=sys.stderr, flush=True)
    fl = floors(arch, n, size["matmul"], ks)
    result = {
        "quick": args.quick,
        "architecture": arch,
        "parameters": parameters(arch),
        "records_per_site": n,
        "steps": steps,
        "loops": args.loops,
        "plan": {
            "epsilon": EPSILON,
            "delta": DELTA,
            "learning_rate": 0.5,
            "clip_norm": 1.0,
            "sample_rate": 1.0,
            "coalition": 1,
            "wait_s": WAIT_S,
            "local_steps": 1,
        },
        "step_measure": "median over sites and steps of the interval between a site's consecutive charges of the run "
        "(its ledger's charged_at), from each site's second charge on",
        "floors": fl,
        "sites": {},
    }
    with tempfile.TemporaryDirectory(prefix="secure-step-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for k in ks:
            result["sites"][str(k)] = bench_sites(work, k, arch, n, steps, args.loops)
    if "4" in result["sites"] and result["sites"]["4"]["ratio_step"] is not None:
        ratio = result["sites"]["4"]["ratio_step"]
        result["target"] = {"ratio_limit": TARGET_RATIO, "ratio": ratio, "met": ratio < TARGET_RATIO}
    result["machine"] = {**machine_facts(), "load_avg_before": load_before, "load_avg_after": os.getloadavg()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, sort_keys=True))
    print(table(result))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
