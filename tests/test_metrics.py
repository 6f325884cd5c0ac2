"""The opt-in Prometheus endpoint (peer.net.metrics) scraped over HTTP during real releases and
refusals of a real daemon (mutual TLS, real ledger): calls by method and status, refusals by
their ErrorInfo reason, bytes, calls in flight, and the ledger's releases and budgets equal to
what ``privfusion ledger show --json`` says; no label value but public names; the example alert
rules of docs/deployment.md name only metrics a real scrape has; off by default."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import signal
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml
from peer_harness import DaemonProcess, client, make_site, pin_each_other, running
from prometheus_client.parser import text_string_to_metric_families

from peer.base.errors import FailedPrecondition
from peer.net import wire
from peer.net.client import PeerError
from peer.net.metrics import LedgerCollector, is_loopback, refusal_reason
from peer.net.site import SiteConfig
from privfusion.v1 import peer_pb2 as pb
from privfusion.v1 import peer_pb2_grpc as pb_grpc
from privfusion.v1 import tensor_pb2 as tpb

ROOT = Path(__file__).resolve().parents[1]
PROBE = np.random.default_rng(0).random((24, 64))
METRICS = 'metrics_listen = "127.0.0.1:0"'
PEER = "privfusion.v1.Peer/"

POLICY = """
[policy]
show_remaining = "own"

[policy.data]
unit = "record:replace-one"
epsilon = 1000.0
delta = 1e-3

[policy.model]
total = { epsilon = 10.0, delta = 1e-5 }
per_counterparty = { epsilon = 5.0, delta = 1e-5 }

[policy.peers."*"]
allow = ["features", "weights", "ledger"]
"""


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """GET /metrics on loopback, parsed by prometheus_client's own parser: sample → value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def wait_for(port: int, ok, tries: int = 200) -> dict:
    """Scrape until ``ok(samples)`` (the daemon sees a call some moments after the client
    starts or cancels it), at most ``tries`` times 50 ms; the last scrape."""
    for _ in range(tries):
        samples = scrape(port)
        if ok(samples):
            break
        threading.Event().wait(0.05)
    return samples


def value(samples, name: str, **labels) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def listening_ports() -> set[int]:
    """TCP ports this process listens on (its own socket fds, LISTEN in /proc/net/tcp{,6})."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = fd.readlink()
        except OSError:
            continue
        if str(target).startswith("socket:["):
            inodes.add(str(target)[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def probe_requests(params: pb.FeaturesParams, hold: threading.Event | None = None):
    """A ReleaseFeatures request stream; with ``hold``, its last frame waits for the event."""
    msgs = [pb.FeaturesRequest(params=params)]
    for m in wire.tensor_messages("probe", PROBE):
        msgs.append(pb.FeaturesRequest(probe=m) if isinstance(m, tpb.TensorHeader) else pb.FeaturesRequest(chunk=m))
    for i, m in enumerate(msgs):
        if hold is not None and i == len(msgs) - 1:
            hold.wait(30)
        yield m


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    """One daemon with metrics on; real releases and refusals; scrapes during and after, and
    ``ledger show --json`` of the same ledger."""
    from peer.cli import main

    root = tmp_path_factory.mktemp("metrics")
    a = make_site(root, "site-a", policy=POLICY, extra_site=METRICS)
    b = make_site(root, "site-b", models={})
    pin_each_other(a, b)
    before = listening_ports()
    out: dict = {"site": a}
    with running(a) as (daemon, address):
        # every scrape below must see the ledger as it is now (the cache has its own test)
        daemon.metrics.ledger.cache_s = 0.0
        port = daemon.metrics.port
        out["ports"] = listening_ports() - before
        out["grpc_port"], out["metrics_port"] = int(address.rsplit(":", 1)[1]), port
        with client(b, address) as c:
            c.info()
            out["features"] = c.features("mlp", PROBE, activation_epsilon=1.0, weight_epsilon=0.5)
            out["weights"] = c.weights("mlp", epsilon=1.0, delta=1e-5)
            refusals = {}
            for what, call in {
                "exhausted": lambda: c.weights("mlp", epsilon=4.5, delta=1e-5),
                "unknown model": lambda: c.weights("no-such-model", epsilon=0.5, delta=1e-5),
            }.items():
                with pytest.raises(PeerError) as e:
                    call()
                refusals[what] = (e.value.status, e.value.reason or "none")
            out["refusals"] = refusals
        # a call in flight: the probe's last frame is held back until after the scrape
        hold = threading.Event()
        creds = grpc.ssl_channel_credentials(
            root_certificates=a.identity.cert_pem, private_key=b.identity.key_pem, certificate_chain=b.identity.cert_pem
        )
        params = pb.FeaturesParams(
            header=pb.RequestHeader(sender="site-b", receiver="site-a"),
            model="mlp",
            activation_epsilon=0.25,
            weight_epsilon=0.25,
        )
        with grpc.secure_channel(
            address, creds, options=[*wire.grpc_options(), ("grpc.ssl_target_name_override", "site-a")]
        ) as ch:
            stream = pb_grpc.PeerStub(ch).ReleaseFeatures(probe_requests(params, hold), timeout=60)
            during = wait_for(port, lambda s: value(s, "privfusion_rpc_in_flight", method=PEER + "ReleaseFeatures"))
            out["during"] = during
            hold.set()
            out["held_frames"] = sum(1 for _ in stream)
            # a call the caller cancels while its upload is held: it ends, and leaves no call in flight
            never = threading.Event()  # set only once the call is cancelled: the frame never goes
            stream = pb_grpc.PeerStub(ch).ReleaseFeatures(probe_requests(params, never), timeout=60)
            wait_for(port, lambda s: value(s, "privfusion_rpc_in_flight", method=PEER + "ReleaseFeatures") == 1)
            stream.cancel()
            never.set()  # frees the client's request thread (its stream is cancelled: nothing is sent)
            out["after_cancel"] = wait_for(
                port, lambda s: value(s, "privfusion_rpc_in_flight", method=PEER + "ReleaseFeatures") == 0
            )
        out["after"] = scrape(port)
        # what the operator's command says of the same ledger, while the daemon holds it
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert main(["ledger", "show", "--db", str(a.ledger), "--policy", str(a.config), "--json", "--no-pld"]) == 0
        out["ledger_show"] = json.loads(printed.getvalue())
    out["stopped_port"] = port
    return out


# ------------------------------------------------------------------------ RPCs


def test_calls_are_counted_by_method_and_final_status(observed):
    after = observed["after"]
    calls = "privfusion_rpc_calls_total"
    assert value(after, calls, method=PEER + "ReleaseFeatures", code="OK") == 2  # one via the client, one held
    assert value(after, calls, method=PEER + "ReleaseFeatures", code="CANCELLED") == 1
    assert value(after, calls, method=PEER + "ReleaseWeights", code="OK") == 1
    assert value(after, calls, method=PEER + "ReleaseWeights", code="RESOURCE_EXHAUSTED") == 1
    assert value(after, calls, method=PEER + "ReleaseWeights", code="NOT_FOUND") == 1
    assert value(after, calls, method=PEER + "GetPeerInfo", code="OK") >= 1
    # the latency histogram has one observation per finished call
    for method in ("ReleaseFeatures", "ReleaseWeights", "GetPeerInfo"):
        finished = sum(v for (n, lab), v in after.items() if n == calls and ("method", PEER + method) in lab)
        assert value(after, "privfusion_rpc_duration_seconds_count", method=PEER + method) == finished
        assert value(after, "privfusion_rpc_duration_seconds_bucket", method=PEER + method, le="+Inf") == finished


def test_a_refusal_is_counted_under_the_reason_the_caller_received(observed):
    after, refusals = observed["after"], observed["refusals"]
    assert refusals["exhausted"] == ("RESOURCE_EXHAUSTED", "BUDGET_EXHAUSTED")
    for code, reason in refusals.values():
        assert value(after, "privfusion_refusals_total", method=PEER + "ReleaseWeights", code=code, reason=reason) == 1
    # successes are not refusals
    assert not any(n == "privfusion_refusals_total" and ("code", "OK") in lab for n, lab in after)


def test_a_call_the_caller_cancels_is_counted_and_leaves_nothing_in_flight(observed):
    samples = observed["after_cancel"]
    assert value(samples, "privfusion_rpc_in_flight", method=PEER + "ReleaseFeatures") == 0
    assert value(samples, "privfusion_rpc_calls_total", method=PEER + "ReleaseFeatures", code="CANCELLED") == 1
    # the caller went away: not a refusal of the site
    assert not any(n == "privfusion_refusals_total" and ("code", "CANCELLED") in lab for n, lab in samples)


def test_bytes_cover_the_messages_and_streams_in_flight_return_to_zero(observed):
    during, after = observed["during"], observed["after"]
    assert value(during, "privfusion_rpc_in_flight", method=PEER + "ReleaseFeatures") == 1
    for (name, _), v in after.items():
        if name == "privfusion_rpc_in_flight":
            assert v == 0, name
    # the probe set's tensor bytes arrived twice (two feature releases); the weights' tensors left once
    received = value(after, "privfusion_rpc_received_bytes_total", method=PEER + "ReleaseFeatures")
    assert received >= 2 * PROBE.nbytes
    sent = value(after, "privfusion_rpc_sent_bytes_total", method=PEER + "ReleaseWeights")
    assert sent >= sum(x.nbytes for x in observed["weights"].arrays.values()) > 0
    assert value(after, "privfusion_rpc_sent_bytes_total", method=PEER + "ReleaseFeatures") >= sum(
        x.nbytes for x in observed["features"].arrays.values()
    )
    assert observed["held_frames"] > 0


def test_the_endpoint_listens_only_where_asked_and_stops_with_the_daemon(observed):
    assert observed["ports"] == {observed["grpc_port"], observed["metrics_port"]}
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{observed['stopped_port']}/metrics", timeout=5)


def test_peer_serve_opens_the_endpoint_and_closes_it_at_sigterm(tmp_path):
    """The production path: ``privfusion peer serve`` in its own process, its JSON log naming the
    endpoint, a scrape after a real call, and SIGTERM closing the port with the daemon."""
    a = make_site(tmp_path, "site-a", extra_site=METRICS)
    b = make_site(tmp_path, "site-b", models={})
    pin_each_other(a, b)
    daemon = DaemonProcess(a)
    try:
        address = daemon.wait_ready()
        lines = [json.loads(line) for line in daemon.log_path.read_text().splitlines() if line.startswith("{")]
        [serving] = [e for e in lines if e.get("event") == "metrics-serving"]
        assert serving["loopback"] is True and serving["listen"] == "127.0.0.1:0"
        assert not any(e.get("event") == "metrics-not-loopback" for e in lines)
        with client(b, address) as c:
            c.weights("mlp", epsilon=1.0, delta=1e-5)
        samples = scrape(serving["port"])
        assert value(samples, "privfusion_rpc_calls_total", method=PEER + "ReleaseWeights", code="OK") == 1
        assert (
            value(
                samples, "privfusion_ledger_releases", level="model", unit="neuron", counterparty="site-b", model="mlp"
            )
            == 1
        )
        daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.proc.wait(60) == 0
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(f"http://127.0.0.1:{serving['port']}/metrics", timeout=5)
    finally:
        daemon.close()


def test_metrics_are_off_by_default(tmp_path):
    a = make_site(tmp_path, "site-a")
    assert SiteConfig.load(a.config).metrics_listen is None
    before = listening_ports()
    with running(a) as (daemon, address):
        assert daemon.metrics is None
        assert listening_ports() - before == {int(address.rsplit(":", 1)[1])}


# ------------------------------------------------------------------------ the ledger


def test_ledger_figures_equal_ledger_show(observed):
    after, shown = observed["after"], observed["ledger_show"]
    assert shown["entries"], "the fixture made releases"
    want_count, want_eps = {}, {}
    for e in shown["entries"]:
        key = frozenset(
            {"level": e["level"], "unit": e["unit"], "counterparty": e["counterparty"], "model": e["subject"]}.items()
        )
        want_count[key] = want_count.get(key, 0) + 1
        want_eps[key] = want_eps.get(key, 0.0) + e["epsilon"]
    got_count = {lab: v for (n, lab), v in after.items() if n == "privfusion_ledger_releases"}
    got_eps = {lab: v for (n, lab), v in after.items() if n == "privfusion_ledger_epsilon_charged"}
    assert got_count == want_count
    assert got_eps.keys() == want_eps.keys()
    for k in want_eps:
        assert got_eps[k] == pytest.approx(want_eps[k], rel=1e-12)
    # three releases to site-b (two features, one weights), the refused ones charged nothing
    assert sum(got_count.values()) == 3
    budgets = {b["budget"]: b for b in shown["budgets"]}
    assert "model/mlp/peer/site-b" in budgets
    for name, b in budgets.items():
        labels = dict(
            budget=name, level=b["level"], unit=b["unit"], model=b["model"] or "", counterparty=b["counterparty"] or ""
        )
        for metric, field in (
            ("privfusion_budget_epsilon_limit", "epsilon_limit"),
            ("privfusion_budget_delta_limit", "delta_limit"),
            ("privfusion_budget_epsilon_spent", "spent_epsilon_filter"),
            ("privfusion_budget_epsilon_remaining", "remaining_epsilon_filter"),
            ("privfusion_budget_releases", "count"),
        ):
            assert value(after, metric, **labels) == pytest.approx(b[field], rel=1e-12), (name, metric)
    assert value(after, "privfusion_ledger_up") == 1
    assert value(after, "process_open_fds") > 0  # the process's own figures are there too


def test_one_ledger_read_serves_the_scrapes_of_its_cache_window():
    now = [100.0]
    summaries = []

    def read():
        summaries.append(1)
        return {"entries": [], "budgets": []}

    collector = LedgerCollector(read, cache_s=5.0, clock=lambda: now[0])
    for _ in range(50):  # a scrape storm
        list(collector.collect())
    assert len(summaries) == 1
    now[0] += 4.9
    list(collector.collect())
    assert len(summaries) == 1
    now[0] += 0.2
    list(collector.collect())
    assert len(summaries) == 2
    collector.close()


def open_files(path: Path) -> int:
    """How many file descriptors of this process are open on ``path``."""
    n = 0
    for fd in Path("/proc/self/fd").iterdir():
        try:
            n += fd.readlink() == path
        except OSError:
            continue
    return n


def test_scrapes_do_not_open_a_ledger_connection_each(tmp_path):
    """The HTTP server answers each scrape on a thread of its own and the ledger keeps one
    SQLite connection per thread it is read from: the collector reads on one thread of its own,
    so twenty uncached scrapes leave at most the one connection it made."""
    a = make_site(tmp_path, "site-a", extra_site=METRICS)
    with running(a) as (daemon, _):
        daemon.metrics.ledger.cache_s = 0.0
        ledger = a.ledger.resolve()
        before = open_files(ledger)
        for _ in range(20):
            assert value(scrape(daemon.metrics.port), "privfusion_ledger_up") == 1
        assert open_files(ledger) - before <= 1


def test_an_unreadable_ledger_is_reported_not_raised(caplog):
    def read():
        raise OSError("disk gone: value 0.1234 of row 7")

    with caplog.at_level(logging.ERROR, logger="privfusion.peer"):
        collector = LedgerCollector(read, cache_s=0.0)
        families = list(collector.collect())
        collector.close()
    assert [(f.name, [s.value for s in f.samples]) for f in families] == [("privfusion_ledger_up", [0.0])]
    assert "OSError" in caplog.text and "0.1234" not in caplog.text


# ------------------------------------------------------------------------ nothing private


def test_no_label_value_but_public_names(observed):
    """Every label value is a name the site publishes anyway: an RPC method of its services, a
    status code, a refusal reason, a site, model or budget name, a level or unit; bucket bounds
    are numbers. Checked as a whitelist, so a record value, a release id or a hash in a label
    fails it; and, directly, none of the releases' ids or records' values appears anywhere."""
    after, shown = observed["after"], observed["ledger_show"]
    public = {"", "site-a", "site-b", "mlp"}
    public |= {c.name for c in grpc.StatusCode}
    public |= {reason for _, reason in observed["refusals"].values()}
    public |= {"/".join(m.full_name.rsplit(".", 1)) for m in pb.DESCRIPTOR.services_by_name["Peer"].methods}
    public |= {"grpc.health.v1.Health/Check", "grpc.health.v1.Health/Watch"}
    for b in shown["budgets"]:
        public |= {b["budget"], b["level"], b["unit"]}
    for e in shown["entries"]:
        public |= {e["level"], e["unit"]}
    secrets = {e["release_id"] for e in shown["entries"]} | {e["ledger_hash"] for e in shown["entries"]}
    text = "\n".join(f"{n} {sorted(lab)}" for n, lab in after)
    for s in secrets:
        assert s not in text
    for name, labels in after:
        for key, v in labels:
            if key == "le":
                float(v)  # a bucket bound
                continue
            assert v in public, (name, key, v)
    # a record's released values are floats: none is a label
    floats = {f"{x:g}" for r in (observed["features"], observed["weights"]) for a in r.arrays.values() for x in a.flat}
    assert not any(v in floats for _, labels in after for k, v in labels if k != "le")


def test_a_refusal_reason_label_is_never_free_text():
    from google.rpc import error_details_pb2, status_pb2

    def trailer(reason):
        status = status_pb2.Status(code=8, message="m")
        status.details.add().Pack(error_details_pb2.ErrorInfo(reason=reason, domain="privfusion.v1"))
        return [("grpc-status-details-bin", status.SerializeToString())]

    assert refusal_reason(trailer("BUDGET_EXHAUSTED")) == "BUDGET_EXHAUSTED"
    assert refusal_reason(trailer("epsilon 0.37 of record 12")) == "OTHER"
    assert refusal_reason(trailer("")) == "none"
    assert refusal_reason([("grpc-status-details-bin", b"\xff\x00garbage")]) == "none"
    assert refusal_reason(None) == "none"


# ------------------------------------------------------------------------ config and docs


def test_metrics_listen_is_checked_and_a_non_loopback_address_is_logged(tmp_path, caplog):
    a = make_site(tmp_path, "site-a", extra_site='metrics_listen = "9464"')
    with pytest.raises(Exception, match=r"metrics_listen.*HOST:PORT"):
        SiteConfig.load(a.config)
    b = make_site(tmp_path, "site-b", extra_site='metrics_listen = "0.0.0.0:0"')
    with caplog.at_level(logging.WARNING, logger="privfusion.peer"), running(b) as (daemon, _):
        assert daemon.metrics.port > 0
    assert "metrics-not-loopback" in caplog.text
    assert [
        is_loopback(h) for h in ("127.0.0.1", "localhost", "[::1]", "127.8.0.1", "0.0.0.0", "10.0.0.2", "[::]")
    ] == [
        True,
        True,
        True,
        True,
        False,
        False,
        False,
    ]


def test_the_site_new_template_offers_the_key_commented_out(tmp_path):
    from peer.cli.site import new_site

    path = new_site("hospital-a", tmp_path / "a", "127.0.0.1:0")
    text = path.read_text()
    assert SiteConfig.load(path).metrics_listen is None  # opt-in: off as written
    path.write_text(text.replace('# metrics_listen = "127.0.0.1:9464"', 'metrics_listen = "127.0.0.1:9464"', 1))
    assert SiteConfig.load(path).metrics_listen == "127.0.0.1:9464"


def test_a_taken_metrics_port_is_refused_naming_the_key(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        a = make_site(tmp_path, "site-a", extra_site=f'metrics_listen = "127.0.0.1:{taken}"')
        from peer.net.daemon import Daemon, open_site

        daemon = Daemon(open_site(a.config))
        try:
            with pytest.raises(FailedPrecondition, match=rf"site.metrics_listen: cannot listen on '127.0.0.1:{taken}'"):
                daemon.start()
        finally:
            daemon.server.stop(0)
            daemon.site.close()


def alert_rules() -> list[dict]:
    text = (ROOT / "docs" / "deployment.md").read_text()
    section = text[text.index("### Monitoring") :]
    block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    return [rule for group in yaml.safe_load(block)["groups"] for rule in group["rules"]]


def test_the_documented_alert_rules_name_only_metrics_a_scrape_has(observed):
    rules = alert_rules()
    assert {r["alert"] for r in rules} >= {"PrivFusionBudgetBelow10Percent", "PrivFusionRefusalsSpiking"}
    names = {n for n, _ in observed["after"]}
    for rule in rules:
        used = set(re.findall(r"\bprivfusion_[a-z_]+", rule["expr"]))
        assert used, rule["alert"]
        assert used <= names, (rule["alert"], used - names)
    text = (ROOT / "docs" / "deployment.md").read_text()
    for name in {n.removesuffix("_total") for n in names if n.startswith("privfusion_")}:
        base = re.sub(r"_(bucket|count|sum|created)$", "", name)
        assert base in text, f"docs/deployment.md does not name {base}"
