"""A `merged` round at ResNet-18 scale between two real daemons: each stage's time, each
process's peak memory, and the floor measured in the same run.

    .venv/bin/python benchmarks/round_scale.py            # ResNet-18 widths 64-128-256-512 (≈11M parameters)
    .venv/bin/python benchmarks/round_scale.py --quick    # widths 8-16-32-64, well under a minute

What runs (everything through the `privfusion` command, as two sites run it; work files in a
temporary directory, or --work DIR, kept):

- A factory module written into the work directory (``code/resnet18.py``): the ResNet-18 of
  CIFAR-sized inputs (3x3 stem, four stages of two BasicBlocks with BatchNorm, channels
  64-128-256-512, strided 1x1 shortcuts, global pooling, a Linear head of 10 classes) on
  32x32x3 images: 11.2M parameters at full width.
- Synthetic records the script draws (Gaussian images around ten random class means): each
  site's own records, public records (preprocessing, BatchNorm statistics,
  validation of merges) and a public probe set. Nothing is learnt from them and nothing is meant
  to be: the own networks get two Adam steps, each pool two full-batch DP-SGD steps on a few
  dozen records (real DP-SGD: per-example clipping, Gaussian noise, accounted and charged) — the
  point is what a round on a network of this size costs, not its accuracy.
- Set-up, timed but not part of the round: `site new`, `model import --factory
  code/resnet18.py:make_model --input-shape 3 32 32` of each site's own network, `pool train
  --from-model resnet --data records.npz` (a pool of two models), pinning, two `peer serve`
  daemons (mutual TLS on loopback).
- The round: `privfusion round --events` at st-anne, method `merged` (an RS merge of
  riverside's pool at ε = 8, δ = 1e-5), no `[round.repair]`, so the own network is REPAIRed
  on the probe set (BatchNorm statistics reset). Stages come from the round's own event
  timestamps (microseconds, the round process's clock): start-up (interpreter, imports, site,
  own network traced on the probe set) until `started`; health; info; release (the peer's
  merge, charge and signed receipt: `step merged` to `charged`); transfer (receipt to
  `received`: the model's bytes over gRPC); alignment (group matching on the probe set,
  `received` to `contributed`); fusion (to `fused`); REPAIR (to `after-fusion`: the own
  model's BatchNorm reset, the reference a round scores, then REPAIR of the fused model: the
  endpoints' statistics in one pass each, and the fused model's 20 BatchNorm resets in one
  pass of the probe set when it is one batch, each reset by a hook as the pass reaches it);
  write-out (storing the models and the report, to the
  process's exit).

The floor, measured in this process during the same run: one forward pass of the probe set
through st-anne's network (eval mode, the median of 3 after a warm-up, torch's default
threads like the round process), and the transfer of the model's bytes (its state dict in
float32) at the loopback rate measured here: a child process `sendall`s that many bytes from
one buffer over TCP on 127.0.0.1 and this one `recv_into`s a fresh buffer (median of 3). Each
stage is reported as a multiple of the round's floor (forward + bytes) and, where one applies,
of its own (transfer: the bytes; alignment, fusion, REPAIR: the forward pass).

Memory: the peak resident set (VmHWM from /proc/PID/status, Linux) of each daemon over its whole
life, read after the round, and of every command's process (from os.wait4's ru_maxrss). The
round process is also sampled every 0.05 s (VmRSS, VmHWM), so each stage shows the largest
resident set seen in it and the high-water mark at its end: the stage where the mark jumps is
the one that set the process's peak.

Targets (issue: ResNet scale): the round under 60 s and every process of the round (the round
process and both daemons) under 4 GB, on a 2-core machine; each is reported met or missed, with
the machine's core count and load. Results: a table on stdout and
benchmarks/results/round_scale.json (round_scale_quick.json for --quick).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks.transfer import machine_facts, vm  # noqa: E402  (VmRSS and VmHWM: bytes)

MIB = 1 << 20
GB = 10**9
SITES = ("st-anne", "riverside")
TARGET_ROUND_S = 60.0
TARGET_PROCESS_BYTES = 4 * GB
TARGET_EPSILON = 8.0
FULL = {"widths": (64, 128, 256, 512), "records": 24, "public": 32, "probe": 128}
QUICK = {"widths": (8, 16, 32, 64), "records": 20, "public": 20, "probe": 32}
#: the round's stages: (name, the event that ends it); each starts where the one before ended
STAGES = (
    ("start-up", "started"),
    ("health", "alive"),
    ("info", "step merged"),
    ("release", "charged"),
    ("transfer", "received"),
    ("alignment", "contributed"),
    ("fusion", "fused"),
    ("REPAIR", "after-fusion"),
    ("write-out", None),  # to the process's exit
)
OWN_FLOOR = {"transfer": "bytes", "alignment": "forward", "fusion": "forward", "REPAIR": "forward"}

RESNET_PY = '''\
"""ResNet-18 for 32x32 RGB images (CIFAR layout: a 3x3 stem, no max-pool), BatchNorm everywhere."""

import torch.nn.functional as F
from torch import nn

WIDTHS = {widths!r}


class BasicBlock(nn.Module):
    def __init__(self, inp, out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(inp, out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.conv2 = nn.Conv2d(out, out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.shortcut = None
        if stride != 1 or inp != out:
            self.shortcut = nn.Sequential(nn.Conv2d(inp, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + (x if self.shortcut is None else self.shortcut(x)))


class ResNet18(nn.Module):
    def __init__(self, widths=WIDTHS, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        layers, inp = [], widths[0]
        for i, w in enumerate(widths):
            stride = 1 if i == 0 else 2
            layers.append(nn.Sequential(BasicBlock(inp, w, stride), BasicBlock(w, w, 1)))
            inp = w
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(widths[-1], classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.pool(x).flatten(1))


def make_model():
    return ResNet18()
'''


# ------------------------------------------------------------------------------ processes


def child_env() -> dict[str, str]:
    path = os.pathsep.join([str(ROOT), str(ROOT / "proto"), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path.rstrip(os.pathsep), PYTHONUNBUFFERED="1")


def wait_with_peak(proc: subprocess.Popen, samples: list | None = None, every: float = 0.05) -> int:
    """Wait for ``proc``; its peak resident set in bytes (ru_maxrss of wait4, KiB on Linux).
    With ``samples``, (epoch seconds, VmRSS, VmHWM) of the process are appended every ``every``
    seconds while it runs."""
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG if samples is not None else 0)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return usage.ru_maxrss * 1024
        try:
            m = vm(proc.pid)
        except OSError:  # exiting: its status is gone a moment before wait4 can reap it
            m = None
        if m:
            samples.append((time.time(), m["VmRSS"], m["VmHWM"]))
        time.sleep(every)


def privfusion(*commands: tuple[str, ...], log: Path) -> list[dict]:
    """``privfusion`` commands at once (different sites' commands, each on its own machine in real
    life); each must exit 0. Per command: its stdout, wall seconds and peak RSS."""
    t0 = time.monotonic()
    results = []
    with contextlib.ExitStack() as files:
        procs = []
        for c in commands:
            out, err = files.enter_context(tempfile.TemporaryFile()), files.enter_context(tempfile.TemporaryFile())
            cmd = [sys.executable, "-m", "peer.cli", *c]
            procs.append((c, out, err, subprocess.Popen(cmd, stdout=out, stderr=err, env=child_env())))
        for c, out, err, p in procs:
            peak = wait_with_peak(p)
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
            with log.open("a") as f:
                f.write(f"$ privfusion {' '.join(c)}\n{stderr}\n")
            if p.returncode != 0:
                raise SystemExit(f"privfusion {' '.join(c)} exited {p.returncode}:\n{stdout[-2000:]}\n{stderr[-4000:]}")
            results.append({"stdout": stdout, "seconds": time.monotonic() - t0, "peak_rss": peak})
    return results


class Daemon:
    """``privfusion peer serve`` of one site in its own process."""

    def __init__(self, site: Path):
        self.site = site
        self.ready = site / "ready.json"
        self.ready.unlink(missing_ok=True)
        self.log = open(site / "daemon.log", "ab")  # noqa: SIM115 (closed in stop)
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "peer.cli", "peer", "serve", "--config", str(site / "site.toml"),
             "--ready-file", str(self.ready)],
            stdout=self.log, stderr=self.log, env=child_env(),
        )  # fmt: skip

    def wait_ready(self) -> str:
        from peer.net.readiness import DEFAULT_CPU_SECONDS, wait_for_ready_file

        try:
            info = wait_for_ready_file(self.ready, self.proc.pid, self.proc.poll, cpu_seconds=DEFAULT_CPU_SECONDS)
        except (ChildProcessError, TimeoutError) as e:
            log = (self.site / "daemon.log").read_text()[-3000:]
            raise SystemExit(f"{self.site.name}'s daemon: {e}: {log}") from None
        self.ready_seconds = time.monotonic() - self.started
        self.idle_rss = vm(self.proc.pid)["VmRSS"]
        return f"127.0.0.1:{info['port']}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# ------------------------------------------------------------------------------ the sites


def synthetic_records(n: int, seed: int, means: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``n`` 3x32x32 images, Gaussian around the public class ``means``, and their labels 0..9
    (every class as often as the others, within one: ``n`` ≥ 10 holds them all)."""
    rng = np.random.default_rng(seed)
    y = rng.permutation(np.arange(n) % len(means)).astype(np.int64)
    x = (means[y] + rng.standard_normal((n, 3, 32, 32))).astype(np.float32)
    return x, y


def load_factory(path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("round_scale_resnet18", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_model


def own_network(make_model, x: np.ndarray, y: np.ndarray, seed: int):
    """A site's own network: its initialisation and two Adam steps on its own records (train
    mode, so BatchNorm's running statistics move off their initial values)."""
    import torch

    torch.manual_seed(seed)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    model.train()
    for b in (slice(0, len(x) // 2), slice(len(x) // 2, len(x))):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xt[b]), yt[b]).backward()
        opt.step()
    return model.eval()


def prepare(work: Path, size: dict, log: Path) -> dict:
    """Both sites on disk, their networks imported and pools trained, pinned to each other; the
    set-up's timings and peaks."""
    import torch
    from safetensors.numpy import save_file

    code = work / "code" / "resnet18.py"
    code.parent.mkdir(parents=True)
    code.write_text(RESNET_PY.format(widths=tuple(size["widths"])))
    make_model = load_factory(code)
    means = 0.5 * np.random.default_rng(0).standard_normal((10, 3, 32, 32))
    public_x, public_y = synthetic_records(size["public"], 1, means)
    probe = synthetic_records(size["probe"], 2, means)[0]
    root = work / "sites"
    setup: dict[str, dict] = {}
    new = privfusion(
        *[("site", "new", "--name", s, "--dir", str(root / s), "--listen", "127.0.0.1:0", "--address", "127.0.0.1",
           "--adjacency", "replace-one") for s in SITES],
        log=log,
    )  # fmt: skip
    setup["site new"] = {"seconds": new[-1]["seconds"], "peak_rss": max(r["peak_rss"] for r in new)}
    for i, s in enumerate(SITES):
        d = root / s
        x, y = synthetic_records(size["records"], 10 + i, means)
        np.savez(d / "records.npz", x=x, y=y)
        np.savez(d / "public.npz", x=public_x, y=public_y)
        np.savez(d / "validation.npz", x=public_x, y=public_y)
        save_file({"x": probe}, str(d / "probe.safetensors"))
        torch.save(own_network(make_model, x, y, seed=20 + i).state_dict(), d / "resnet.pt")
        toml = (d / "site.toml").read_text()
        # a benchmark's budgets: room for the pool's merge at the round's target
        for old, wide in (
            (
                "epsilon = 4.0                     # all data-level",
                "epsilon = 40.0                    # all data-level",
            ),
            ("merge = 4.0 ", "merge = 20.0"),
        ):
            if old not in toml:
                raise SystemExit(f"site new's site.toml changed: {old!r} not found in {d / 'site.toml'}")
            toml = toml.replace(old, wide)
        (d / "site.toml").write_text(toml)
    imported = privfusion(
        *[("model", "import", "--site", str(root / s), "--name", "resnet", "--factory", f"{code}:make_model",
           "--weights", str(root / s / "resnet.pt"), "--input-shape", "3", "32", "32", "--json") for s in SITES],
        log=log,
    )  # fmt: skip
    for r in imported:
        if json.loads(r["stdout"]).get("self_check") != "passed":
            raise SystemExit(f"model import: the self-check did not pass: {r['stdout'][-2000:]}")
    setup["model import"] = {"seconds": imported[-1]["seconds"], "peak_rss": max(r["peak_rss"] for r in imported)}
    pools = []
    for s in SITES:  # one after the other: two DP-SGD runs at once would share the two cores
        (r,) = privfusion(
            ("pool", "train", "--site", str(root / s), "--from-model", "resnet", "--data", str(root / s / "records.npz"),
             "--label", "y", "--public", str(root / s / "public.npz"), "--steps", "2", "--learning-rate", "0.5",
             "--model", "name=p1,noise=3,clip=1", "--model", "name=p2,noise=5,clip=1", "--json"),
            log=log,
        )  # fmt: skip
        pools.append(r)
    trained = json.loads(pools[1]["stdout"])
    setup["pool train"] = {
        "seconds": sum(r["seconds"] for r in pools),
        "peak_rss": max(r["peak_rss"] for r in pools),
        "per_site_seconds": [r["seconds"] for r in pools],
        "models": [{"name": m.get("name"), "epsilon": m.get("epsilon")} for m in trained["models"]],
    }
    pins = privfusion(
        *[("peer", "trust", "add", str(root / o / "identity" / "site.crt"), "--dir", str(root / s / "identity"))
          for s in SITES for o in SITES if o != s],
        log=log,
    )  # fmt: skip
    setup["peer trust add"] = {"seconds": pins[-1]["seconds"], "peak_rss": max(r["peak_rss"] for r in pins)}
    parameters = sum(p.numel() for p in make_model().parameters())
    return {"root": root, "code": code, "probe": probe, "make_model": make_model, "parameters": parameters,
            "setup": setup}  # fmt: skip


# ------------------------------------------------------------------------------ the floor


def forward_seconds(make_model, weights: Path, probe: np.ndarray) -> float:
    """One eval-mode forward pass of the probe set: the median of 3 after a warm-up."""
    import torch

    model = make_model()
    model.load_state_dict(torch.load(weights, weights_only=True))
    model.eval()
    x = torch.as_tensor(probe)
    times = []
    with torch.no_grad():
        model(x)
        for _ in range(3):
            t0 = time.perf_counter()
            model(x)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _send(port: int, nbytes: int) -> None:
    buf = bytearray(nbytes)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(buf)


def loopback_seconds(nbytes: int) -> float:
    """``nbytes`` over TCP on 127.0.0.1 from another process (sendall from one buffer) into a
    freshly allocated buffer here (recv_into): the median of 3, from accept to the last byte."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    times = []
    for _ in range(3):
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            sender = ctx.Process(target=_send, args=(server.getsockname()[1], nbytes))
            sender.start()
            conn, _ = server.accept()
            with conn:
                t0 = time.perf_counter()
                view = memoryview(bytearray(nbytes))
                got = 0
                while got < nbytes:
                    n = conn.recv_into(view[got:])
                    if n == 0:
                        raise SystemExit(f"loopback: the sender stopped after {got} of {nbytes} bytes")
                    got += n
                times.append(time.perf_counter() - t0)
            sender.join()
    return statistics.median(times)


# ------------------------------------------------------------------------------ the round


def at(event: dict) -> float:
    return datetime.fromisoformat(event["at"].replace("Z", "+00:00")).timestamp()


def stage_windows(events: list[dict], started: float, ended: float) -> list[tuple[str, float, float]]:
    """Each stage's (name, start, end) in epoch seconds from the round's events (``started`` /
    ``ended``: the process's start and exit); a stage whose closing event is missing is a failed
    measurement."""

    def find(spec: str) -> float:
        name, _, step = spec.partition(" ")
        hits = [e for e in events if e["event"] == name and (not step or e.get("step") == step)]
        if not hits:
            raise SystemExit(f"the round's events have no {spec!r}: {[e['event'] for e in events]}")
        return at(hits[-1])

    out, t = [], started
    for name, closing in STAGES:
        end = find(closing) if closing is not None else ended
        out.append((name, t, end))
        t = end
    return out


def stage_rows(windows: list[tuple[str, float, float]], samples: list) -> list[dict]:
    """One row per stage, in the round's order: its seconds and, from the round process's
    samples, the largest VmRSS sampled in it (a spike shorter than the sampling interval can be
    missed) and VmHWM at its last sample, so the stage that raised the process's peak is the one
    whose high-water mark jumps."""
    rows = []
    for name, start, end in windows:
        inside = [s for s in samples if start <= s[0] <= end]
        rows.append(
            {
                "stage": name,
                "seconds": end - start,
                "rss_max_sampled": max((s[1] for s in inside), default=0),
                "hwm_at_end": inside[-1][2] if inside else 0,
                "samples": len(inside),
            }
        )
    return rows


def run_round(root: Path) -> dict:
    a = root / SITES[0]
    daemons = {s: Daemon(root / s) for s in SITES}
    try:
        addresses = {s: d.wait_ready() for s, d in daemons.items()}
        roster = []
        for s in SITES:
            roster += [f"[sites.{s}]", f'address = "{addresses[s]}"', f'certificate = "{s}/identity/site.crt"', ""]
        (root / "roster.toml").write_text("\n".join(roster))
        (a / "round.toml").write_text(
            '[round]\nroster = "../roster.toml"\nmodel = "resnet"\nalpha = 0.5\nquorum = 2\nmethod = "merged"\n'
            f'call_timeout_s = 600\n[round.merge]\nmethod = "rs"\nepsilon = {TARGET_EPSILON}\ndelta = 1e-5\n'
        )
        events_file = root / "round-events.jsonl"
        with events_file.open("wb") as out, (root / "round.log").open("wb") as err:
            started = time.time()
            proc = subprocess.Popen(
                [sys.executable, "-m", "peer.cli", "round", "--config", str(a / "site.toml"), "--round",
                 str(a / "round.toml"), "--events"],
                stdout=out, stderr=err, env=child_env(),
            )  # fmt: skip
            samples: list = []
            peak = wait_with_peak(proc, samples)
            ended = time.time()
        if proc.returncode != 0:
            raise SystemExit(f"privfusion round exited {proc.returncode}:\n{(root / 'round.log').read_text()[-4000:]}")
        # the kernel moves VmHWM up lazily (at unmaps, with per-thread RSS counters folded in
        # late), so it can read below an RSS sampled earlier: a daemon's peak is the larger
        # (a fresh-clone CI run saw VmHWM at the end under the VmRSS at ready)
        daemon_memory = {
            s: {
                "idle_rss": d.idle_rss,
                "peak_rss": max(vm(d.proc.pid)["VmHWM"], d.idle_rss),
                "ready_seconds": d.ready_seconds,
            }
            for s, d in daemons.items()
        }
    finally:
        for d in daemons.values():
            d.stop()
    events = [json.loads(line) for line in events_file.read_text().splitlines() if line.startswith("{")]
    windows = stage_windows(events, started, ended)
    (report_path,) = sorted((a / "rounds").glob("round-*.json"))
    report = json.loads(report_path.read_text())
    if report["status"] != "fused" or report["contributors"] != [SITES[1]]:
        raise SystemExit(f"the round did not fuse with {SITES[1]}: {report['status']}, {report.get('events')}")
    return {
        "seconds": ended - started,
        "stages": stage_rows(windows, samples),
        "round_peak_rss": peak,
        "daemons": daemon_memory,
        "status": report["status"],
        "repair": {k: report["after_fusion"]["repair"].get(k) for k in ("data", "batchnorm_reset")},
        "charges": [{k: c[k] for k in ("peer", "step", "level", "epsilon")} for c in report["charges"]],
    }


# ------------------------------------------------------------------------------ report


def table(result: dict) -> str:
    floor = result["floor"]
    base = floor["forward_s"] + floor["bytes_s"]
    own = {"bytes": floor["bytes_s"], "forward": floor["forward_s"]}
    r = result["round"]
    lines = [
        f"ResNet-18 shape, widths {'-'.join(map(str, result['widths']))}, {result['parameters'] / 1e6:.2f}M parameters "
        f"({result['model_bytes'] / MIB:.1f} MiB float32), probe {result['probe_rows']} x 3x32x32",
        "DP-SGD: 2 full-batch steps on synthetic records: the round's cost is measured, not accuracy",
        "RSS: the round process's largest VmRSS sampled in the stage (every 0.05 s); HWM: its VmHWM at the stage's end",
        "",
        f"{'stage':<34}{'seconds':>9}{'x round floor':>15}{'x own floor':>20}{'RSS MiB':>9}{'HWM MiB':>9}",
    ]
    for row in r["stages"]:
        name, seconds = row["stage"], row["seconds"]
        mine = OWN_FLOOR.get(name)
        ratio = f"{seconds / own[mine]:.1f} ({mine})" if mine else ""
        lines.append(
            f"{name:<34}{seconds:9.2f}{seconds / base:15.1f}{ratio:>20}"
            + (
                f"{row['rss_max_sampled'] / MIB:9.0f}{row['hwm_at_end'] / MIB:9.0f}"
                if row["samples"]
                else f"{'-':>9}{'-':>9}"
            )
        )
    lines.append(f"{'round (process start to exit)':<34}{r['seconds']:9.2f}{r['seconds'] / base:15.1f}")
    lines += [
        f"{'floor: forward pass of the probe set':<34}{floor['forward_s']:9.3f}",
        f"{'floor: model bytes over loopback':<34}{floor['bytes_s']:9.3f}"
        f"   ({floor['loopback_bytes_per_s'] / MIB:.0f} MiB/s)",
        f"{'floor: round (forward + bytes)':<34}{base:9.3f}",
        "",
        f"{'process':<34}{'peak MiB':>9}",
        f"{'round (st-anne)':<34}{r['round_peak_rss'] / MIB:9.0f}",
    ]
    for s, d in r["daemons"].items():
        lines.append(f"{'daemon ' + s:<34}{d['peak_rss'] / MIB:9.0f}   (idle {d['idle_rss'] / MIB:.0f} at ready)")
    for name, s in result["setup"].items():
        lines.append(f"{'set-up: ' + name:<34}{s['peak_rss'] / MIB:9.0f}   ({s['seconds']:.1f} s)")
    t = result["targets"]
    lines += [
        "",
        f"target: round under {TARGET_ROUND_S:.0f} s: {r['seconds']:.1f} s, {'met' if t['round_seconds_met'] else 'MISSED'}",
        f"target: under {TARGET_PROCESS_BYTES / GB:.0f} GB per process: largest {t['largest_process_peak_rss'] / GB:.2f} GB, "
        f"{'met' if t['process_memory_met'] else 'MISSED'}",
        f"machine: {result['machine']['cpus']} cores (the targets are for 2), load average "
        f"{', '.join(f'{v:.1f}' for v in result['machine']['load_avg'])}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="narrow channels (8-64), fewer records: a short check")
    parser.add_argument("--work", type=Path, help="work directory (kept; default: a temporary one)")
    parser.add_argument("--out", type=Path, help="JSON results (default benchmarks/results/round_scale[_quick].json)")
    args = parser.parse_args(argv)
    size = QUICK if args.quick else FULL
    out = args.out or ROOT / "benchmarks" / "results" / ("round_scale_quick.json" if args.quick else "round_scale.json")
    with tempfile.TemporaryDirectory(prefix="round-scale-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        log = work / "setup.log"
        t0 = time.monotonic()
        sites = prepare(work, size, log)
        print(f"set-up done in {time.monotonic() - t0:.0f} s; floor next", file=sys.stderr)
        import torch

        weights = sites["root"] / SITES[0] / "resnet.pt"
        model_bytes = sum(v.numel() * 4 for v in torch.load(weights, weights_only=True).values())
        forward = forward_seconds(sites["make_model"], weights, sites["probe"])
        transfer = loopback_seconds(model_bytes)
        print("floor measured; the round next", file=sys.stderr)
        measured = run_round(sites["root"])
    peaks = [measured["round_peak_rss"]] + [d["peak_rss"] for d in measured["daemons"].values()]
    result = {
        "quick": args.quick,
        "widths": list(size["widths"]),
        "parameters": sites["parameters"],
        "model_bytes": model_bytes,
        "probe_rows": size["probe"],
        "records_per_site": size["records"],
        "note": "DP-SGD pools of 2 full-batch steps on synthetic records: the round's cost, not accuracy",
        "setup": sites["setup"],
        "floor": {
            "forward_s": forward,
            "bytes_s": transfer,
            "loopback_bytes_per_s": model_bytes / transfer,
            "round_floor_s": forward + transfer,
        },
        "round": measured,
        "targets": {
            "round_seconds": TARGET_ROUND_S,
            "process_bytes": TARGET_PROCESS_BYTES,
            "round_seconds_met": measured["seconds"] < TARGET_ROUND_S,
            "largest_process_peak_rss": max(peaks),
            "process_memory_met": max(peaks) < TARGET_PROCESS_BYTES,
        },
        "machine": {**machine_facts(), "load_avg": os.getloadavg()},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, sort_keys=True))
    print(table(result))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
