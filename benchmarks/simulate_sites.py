"""`privfusion simulate` at 4, 8 and 12 sites: wall time and resident memory of every process.

    .venv/bin/python benchmarks/simulate_sites.py              # 4, 8 and 12 sites
    .venv/bin/python benchmarks/simulate_sites.py --sites 4    # one size

What runs: the bundled 12-site scenario (scenarios/hospitals-12.toml) and variants of it with
its first N sites (the other tables of the file unchanged, the round quorum capped at N),
written to a temporary directory; each is run as `python -m peer.cli simulate SCENARIO --out
DIR`, one size after the other.

Memory: while the simulation runs, its process tree (children of the simulate process, found
through /proc/PID/task/*/children) is sampled every 0.1 s; each process's VmRSS and VmHWM come
from /proc/PID/status (Linux). Per daemon (`peer serve`): *idle* RSS, its VmRSS once it is
ready (imports, model, pool, ledger, warm-up; the largest sample before the simulator's
progress says the rounds started, or the first one after it is ready if that comes later), and
*peak*, its last VmHWM. The sites' rounds run in the simulate process (threads), so there is no
round process but in a failure scenario (its victim's). Also the round processes' largest peak
(if any), the parent's (simulate's: data, training, the rounds, evaluation) peak, and two
totals: the largest sum of the VmRSS of every process alive at one sample (what the machine had
to hold if no page were shared; sampled, so a short spike between samples can be missed) and
the sum of every process's own peak (an upper bound: the peaks need not coincide). Every process
maps the same torch, gRPC and NumPy libraries, which RSS counts once per process: the largest
sum of PSS (/proc/PID/smaps_rollup, shared pages divided among their users; every 0.5 s) is
what the processes used together.

Results: a table on stdout and benchmarks/results/simulate_sites.json. Timings on a shared
machine are noisy: the load average is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "scenarios" / "hospitals-12.toml"
MIB = 1 << 20
SIZES = (4, 8, 12)
ROUNDS_STARTED = b"started its rounds"  # simulate's progress line once every site's rounds run


def vm(pid: int) -> dict[str, int] | None:
    """VmRSS and VmHWM of a process, in bytes (None once it has gone)."""
    out = {}
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out if len(out) == 2 else None


def pss(pid: int) -> int:
    """Proportional set size (bytes): the process's resident pages, each shared page divided
    among the processes that map it (torch's libraries are mapped by every process)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def descendants(pid: int) -> list[int]:
    """Every live descendant of a process (children of each of its threads, recursively)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                kids = Path(f"/proc/{p}/task/{t}/children").read_text().split()
            except OSError:
                continue
            for k in kids:
                out.append(int(k))
                todo.append(int(k))
    return out


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def variant(text: str, n: int) -> str:
    """The scenario with its first n ``[sites.NAME]`` tables (and the quorum capped at n)."""
    head, *blocks = re.split(r"(?m)^(?=\[sites\.)", text)
    if n > len(blocks):
        raise SystemExit(f"--sites {n}: the scenario has only {len(blocks)} sites")
    head = re.sub(r"(?m)^quorum = (\d+)", lambda m: f"quorum = {min(int(m.group(1)), n)}", head)
    kept = [b.rstrip("\n") + "\n" for b in blocks[:n]]
    return head + "".join(kept)


def run_one(n: int, work: Path, python: str) -> dict:
    scenario = work / f"sites-{n}.toml"
    scenario.write_text(variant(SCENARIO.read_text(encoding="utf-8"), n), encoding="utf-8")
    out = work / f"out-{n}"
    log_path = work / f"simulate-{n}.log"
    log = open(log_path, "wb")  # noqa: SIM115 (closed below, after the run)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [python, "-m", "peer.cli", "simulate", str(scenario), "--out", str(out)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    daemons: dict[int, dict] = {}
    rounds: dict[int, dict] = {}
    parent_hwm = 0
    total_rss = total_pss = 0
    samples = 0
    rounds_started = False
    while proc.poll() is None:
        samples += 1
        with_pss = samples % 5 == 0  # smaps_rollup walks every mapping: every 0.5 s
        parent = vm(proc.pid)
        if parent:
            parent_hwm = max(parent_hwm, parent["VmHWM"])
        kids = descendants(proc.pid)
        alive = parent["VmRSS"] if parent else 0
        alive_pss = pss(proc.pid) if with_pss else 0
        for k in kids:
            args = cmdline(k)
            m = vm(k)
            if m is None:
                continue
            alive += m["VmRSS"]
            alive_pss += pss(k) if with_pss else 0
            if "serve" in args and "peer" in args:
                ready = Path(args[args.index("--ready-file") + 1]) if "--ready-file" in args else None
                site = Path(args[args.index("--config") + 1]).parent.name
                d = daemons.setdefault(k, {"site": site, "idle_rss": None, "peak": 0})
                d["peak"] = max(d["peak"], m["VmHWM"])
                d["_ready"] = bool(ready and ready.exists())
                d["_rss"] = m["VmRSS"]
            elif "round" in args:
                r = rounds.setdefault(k, {"site": Path(args[args.index("--config") + 1]).parent.name, "peak": 0})
                r["peak"] = max(r["peak"], m["VmHWM"])
        # the rounds start when the simulator says so (they run in its process, a round process
        # only for a failure scenario's victim)
        rounds_started = rounds_started or bool(rounds) or ROUNDS_STARTED in log_path.read_bytes()
        for d in daemons.values():
            if d.get("_ready") and (d["idle_rss"] is None or not rounds_started):
                # its first sample once ready, and the largest until the first round process
                d["idle_rss"] = max(d["idle_rss"] or 0, d["_rss"])
        total_rss = max(total_rss, alive)
        total_pss = max(total_pss, alive_pss)
        time.sleep(0.1)
    wall = time.monotonic() - t0
    log.close()
    if proc.returncode != 0:
        tail = (work / f"simulate-{n}.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"simulate at {n} sites exited with {proc.returncode}:\n{tail}")
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
    per_site = sorted(
        ({k: v for k, v in d.items() if not k.startswith("_")} for d in daemons.values()), key=lambda d: d["site"]
    )
    peaks = [d["peak"] for d in per_site] + [r["peak"] for r in rounds.values()] + [parent_hwm]
    return {
        "sites": n,
        "wall_s": wall,
        "timings": report.get("timings", {}),
        "rounds_fused": sum(
            r["status"] == "fused" for s in report.get("sites", {}).values() for r in s["rounds"].values()
        ),
        "rounds_run": sum(len(s["rounds"]) for s in report.get("sites", {}).values()),
        "daemons": per_site,
        "daemon_idle_rss_max": max((d["idle_rss"] or 0) for d in per_site) if per_site else 0,
        "daemon_peak_max": max((d["peak"] for d in per_site), default=0),
        "round_processes": len(rounds),
        "round_peak_max": max((r["peak"] for r in rounds.values()), default=0),
        "parent_peak": parent_hwm,
        "total_rss_peak_sampled": total_rss,
        "sum_of_peaks": sum(peaks),
        "total_pss_peak_sampled": total_pss,
        "load_avg": os.getloadavg(),
    }


def table(results: list[dict]) -> str:
    mb = lambda b: f"{(b or 0) / MIB:7.0f}"  # noqa: E731
    lines = [
        "sites  wall s  daemon idle MiB (min..max)  daemon peak MiB  round peak MiB  parent peak MiB"
        "  total RSS MiB (sampled)  sum of peaks MiB  total PSS MiB",
    ]
    for r in results:
        idle = [d["idle_rss"] or 0 for d in r["daemons"]]
        lines.append(
            f"{r['sites']:5d}  {r['wall_s']:6.1f}  {mb(min(idle, default=0))} ..{mb(max(idle, default=0))}          "
            f"{mb(r['daemon_peak_max'])}          {mb(r['round_peak_max'])}         {mb(r['parent_peak'])}"
            f"                  {mb(r['total_rss_peak_sampled'])}           {mb(r['sum_of_peaks'])}"
            f"        {mb(r['total_pss_peak_sampled'])}"
        )
    for r in results:
        lines.append(f"\n{r['sites']} sites, per daemon (idle / peak MiB):")
        lines.append(
            "  " + ", ".join(f"{d['site']} {mb(d['idle_rss']).strip()}/{mb(d['peak']).strip()}" for d in r["daemons"])
        )
        lines.append(f"  rounds fused: {r['rounds_fused']} of {r['rounds_run']}")
        lines.append(f"  timings: {json.dumps({k: round(v, 1) for k, v in r['timings'].items()})}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", type=int, action="append", help="run this size only (repeatable; default 4, 8, 12)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "simulate_sites.json")
    args = parser.parse_args(argv)
    sizes = args.sites or list(SIZES)
    if any(n < 2 for n in sizes):
        parser.error("--sites must be at least 2")
    results = []
    with tempfile.TemporaryDirectory(prefix="simulate-sites-") as tmp:
        for n in sizes:
            results.append(run_one(n, Path(tmp), sys.executable))
            print(f"{n} sites: {results[-1]['wall_s']:.1f}s", file=sys.stderr)
    result = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, sort_keys=True))
    print(table(results))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
