"""Several hosts without Docker: every site in its own network namespace with its own address
(10.231.0.0/24 inside namespaces this test creates; nothing outside them is touched), joined by
veth pairs to a bridge in a hub namespace. Two sites run rounds across the "network" at once;
the third site's link is cut (``ip link set eth0 down``) as soon as it has released something.
The others must finish, and every ledger must be consistent with the receipts the rounds got.

Needs root and iproute2. Under CI (CI=true) a missing capability is a failure; elsewhere the
test skips and says why. Namespaces are deleted even when the test fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
from peer_harness import make_site, model_arrays, pin_each_other

from coordinator_free.roster import write_roster
from peer.budget.ledger import Ledger

pytestmark = pytest.mark.slow

ARCH = {"kind": "mlp", "input_dim": 64, "hidden": [128, 128], "output_dim": 10, "activation": "relu"}
SUBNET = "10.231.0"
SITES = ["site-a", "site-b", "site-c"]
POLICY = """
[policy]
[policy.model]
total = { epsilon = 10000.0, delta = 1e-3 }
per_counterparty = { epsilon = 5000.0, delta = 1e-3 }
[policy.peers."*"]
allow = ["features", "weights", "ledger"]
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _unavailable(reason: str):
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"network namespaces are required in CI: {reason}")
    pytest.skip(f"network namespaces unavailable: {reason}")


class Network:
    """A hub namespace with a bridge, and one namespace per site with ``eth0`` on the bridge."""

    def __init__(self, names: list[str]):
        self.tag = f"pf{uuid.uuid4().hex[:6]}"
        self.hub = f"{self.tag}-hub"
        self.ns = {n: f"{self.tag}-{i}" for i, n in enumerate(names)}
        self.address = {n: f"{SUBNET}.{i + 1}" for i, n in enumerate(names)}
        self.created: list[str] = []

    def __enter__(self) -> Network:
        try:
            self._add(self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for i, (name, ns) in enumerate(self.ns.items()):
                self._add(ns)
                _ip("link", "add", f"h{i}", "netns", self.hub, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("-n", self.hub, "link", "set", f"h{i}", "master", "br0")
                _ip("-n", self.hub, "link", "set", f"h{i}", "up")
                _ip("-n", ns, "addr", "add", f"{self.address[name]}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def _add(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self.created.append(ns)

    def cut(self, name: str) -> None:
        _ip("-n", self.ns[name], "link", "set", "eth0", "down")

    def run(self, name: str, args: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.ns[name], *args], **kw)

    def __exit__(self, *exc) -> None:
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.created.clear()


@pytest.fixture
def netns_available():
    if shutil.which("ip") is None:
        _unavailable("the `ip` command (iproute2) is not installed")
    if os.geteuid() != 0:
        _unavailable("the test must run as root to create network namespaces")
    probe = f"pfprobe{uuid.uuid4().hex[:6]}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        _unavailable(f"`ip netns add` failed: {r.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def _env() -> dict:
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PRIVFUSION_LOG_LEVEL="INFO")


def _entries(site):
    with Ledger(site.ledger) as ledger:  # opening verifies the hash chain and the totals
        return ledger.entries()


def test_sites_in_separate_namespaces_survive_a_cut_link(tmp_path, netns_available):
    rng = np.random.default_rng(0)
    probe = rng.uniform(0, 1, size=(100, 64)).astype(np.float32)
    sites = [
        make_site(
            tmp_path,
            name,
            models={"mlp": (ARCH, model_arrays(ARCH, seed=i))},
            policy=POLICY,
            probe=probe,
            seed=10 + i,
            activation_clip=(0.0, 4.0),
        )
        for i, name in enumerate(SITES)
    ]
    pin_each_other(*sites)
    by_name = {s.name: s for s in sites}
    procs: list[subprocess.Popen] = []
    with Network(SITES) as net, contextlib.ExitStack() as stack:

        def stop_all():
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()

        stack.callback(stop_all)
        for s in sites:
            s.config.write_text(
                s.config.read_text().replace('listen = "127.0.0.1:0"', f'listen = "{net.address[s.name]}:50051"')
            )
            ready = s.root / "ready.json"
            log = stack.enter_context(open(s.root / "daemon.log", "wb"))
            procs.append(
                net.run(
                    s.name,
                    [
                        sys.executable,
                        "-m",
                        "peer.cli",
                        "peer",
                        "serve",
                        "--config",
                        str(s.config),
                        "--simulation",
                        "--ready-file",
                        str(ready),
                    ],
                    stdout=log,
                    stderr=log,
                    env=_env(),
                )
            )
        deadline = time.monotonic() + 120
        for s in sites:
            while not (s.root / "ready.json").exists():
                assert time.monotonic() < deadline, (s.root / "daemon.log").read_text()[-2000:]
                time.sleep(0.05)
        roster = write_roster(
            tmp_path / "roster.toml",
            [(s.name, f"{net.address[s.name]}:50051", str(s.identity_dir / "site.crt")) for s in sites],
        )
        rounds = {}
        for name in ("site-a", "site-b"):
            f = tmp_path / f"round-{name}.toml"
            f.write_text(f"""[round]
roster = "{roster}"
model = "mlp"
out = "{tmp_path / ("rounds-" + name)}"
call_timeout_s = 10.0
health_timeout_s = 3.0
[round.features]
activation_epsilon = 100.0
weight_epsilon = 100.0
[round.weights]
epsilon = 100.0
""")
            rounds[name] = net.run(
                name,
                [
                    sys.executable,
                    "-m",
                    "peer.cli",
                    "round",
                    "--config",
                    str(by_name[name].config),
                    "--round",
                    str(f),
                    "--events",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=_env(),
                text=True,
            )
            procs.append(rounds[name])

        # cut site-c's link as soon as its ledger holds a release: mid-round
        cut_at = None
        while cut_at is None and any(p.poll() is None for p in rounds.values()):
            if (by_name["site-c"].ledger).exists() and _entries(by_name["site-c"]):
                net.cut("site-c")
                cut_at = time.monotonic()
            time.sleep(0.01)
        assert cut_at is not None, "site-c released nothing before the rounds ended"
        outputs = {name: p.communicate(timeout=120) for name, p in rounds.items()}

    reports = {}
    for name, (out, err) in outputs.items():
        assert rounds[name].returncode == 0, err[-3000:]
        events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        [report_file] = list((tmp_path / f"rounds-{name}").glob("round-*.json"))
        reports[name] = json.loads(report_file.read_text())
        r = reports[name]
        assert r["status"] == "fused", r["reason"]
        other = "site-b" if name == "site-a" else "site-a"
        assert other in r["contributors"]
        assert any(e["event"] == "fused" for e in events)
    dropped = {
        name: r["peers"]["site-c"]["drop"] for name, r in reports.items() if r["peers"]["site-c"]["state"] == "dropped"
    }
    assert dropped, "the cut link must have dropped site-c from at least one round"
    # the link is cut when site-c's ledger holds its first release, i.e. while one round is at
    # features or weights; the other round may be behind it, still asking site-c who it is
    # ("info": under a load of 4 on 2 cores it was), and is dropped there
    for d in dropped.values():
        assert d["status"] in ("DEADLINE_EXCEEDED", "UNAVAILABLE") and d["step"] in ("info", "features", "weights")

    # every ledger opens consistent; every receipt a round got is in the releasing site's ledger;
    # an entry without a receipt is one whose delivery the cut interrupted (charged: yes/unknown)
    for site in sites:
        entries = _entries(site)
        for name, r in reports.items():
            got = {c["release_id"] for c in r["charges"] if c["peer"] == site.name}
            charged = {e.release_id for e in entries if e.counterparty == name}
            assert got <= charged, (site.name, name)
            if charged - got:
                assert site.name == "site-c" and r["peers"]["site-c"]["drop"]["charged"] in ("unknown", "yes")
            if site.name != "site-c":
                assert got == charged
