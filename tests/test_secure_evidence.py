"""Evidence for the secure-aggregation round (``coordinator_free.secure_iterate`` over
``peer.net.secagg``): what it costs on the wire, and what an observer or a coalition sees.

1. **Bytes.** A secure run over real daemons reports the payload bytes each site moved
   (``DaemonTransport.traffic``, counted at its gRPC clients), and the simulator's row adds up
   what crossed each site's boundary (``scenarios.iterate_sites.secure_bytes``); both equal what
   the daemons' own servers counted for the same calls (the metrics interceptor,
   ``peer.net.metrics``), call for call.
2. **One peer's masked vector is uniform** on Z_{2^b} (χ² goodness of fit), whatever its input;
   the same test rejects the unmasked input and a vector under a biased mask.
3. **A coalition's view.** With k sites and a coalition bound t ≤ k − 2, any coalition of at most
   t sites that strips its own pairwise masks off an honest site's vector still sees a uniform
   vector (any two honest vectors jointly uniform while three or more sites are honest; with two
   left, the second is the revealed sum less what the coalition knows); the k − 1 others
   together strip every mask and recover the honest input exactly.

**The uniformity verdict** (:func:`looks_uniform`). n residues mod 2^b are cut into c
equiprobable cells twice, by their top and by their bottom log₂ c bits (2^b is a multiple of c,
so each cell holds the same number of residues); with several vectors the cell is made of an
equal share of each one's bits, so the test is of their joint law. c is Mann & Wald's (1942)
number of equiprobable classes for n samples at level a, c ≈ 4·(2(n − 1)²/z_a²)^{1/5} with z_a
the upper a quantile of N(0, 1), rounded down to a power of two and at most 2^b; the critical
value is the upper-a quantile of χ²(c − 1) (``scipy.stats.chi2.isf``). Each verdict runs its two
tests at a = ALPHA/2, so a uniform input is called non-uniform with probability at most ALPHA =
1e-6 (Bonferroni); a test that makes m verdicts runs each at ALPHA/m, so the whole test's
false-failure rate is at most ALPHA over the choice of its seed. Every statistical test is
seeded (the pairwise keys too, from a fixed-seed generator) except the real protocol step of
``test_what_a_site_sends_in_a_real_step_...``, whose ephemeral keys are fresh from the OS: it
fails falsely with probability ≤ 1e-6 per run.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import socket
import threading
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from peer_harness import client, make_site, model_arrays, pin_each_other, running
from scipy import stats
from secagg_helpers import identities
from test_iterate import ARCH, policy, round_file
from test_secure_iterate import POLICY

from coordinator_free.roster import write_roster
from coordinator_free.runner import run_rounds
from coordinator_free.secure_iterate import InProcessBoard, SecureParty, SecureSumPlan, secure_sum
from peer.desk.desk import ReleaseDesk
from peer.dp.accounting.conversions import DEFAULT_ORDERS
from peer.dp.distributed.encoding import Encoding, encode_sum, to_modular
from peer.dp.distributed.skellam import calibrate_share, check_sites, skellam_share
from peer.net.client import PeerError
from peer.net.daemon import open_site
from peer.net.secagg import Ephemeral, MaskContext, SignedKey, aggregate, masked_vector, pair_seed, prg_mask
from peer.net.signing import wire_transport
from scenarios.iterate_sites import secure_bytes
from scenarios.report import SECURE_ROW, comparison_rows

ALPHA = 1e-6
BITS = 32
PEER = "privfusion.v1.Peer/"


# ----------------------------------------------------------------------------- the χ² verdict


def equiprobable_cells(n: int, bits: int, level: float) -> int:
    """Mann & Wald's number of equiprobable cells for n samples at ``level``, rounded down to a
    power of two, at most 2^bits (module docstring)."""
    z = stats.norm.isf(level)
    c = 4 * (2 * (n - 1) ** 2 / z**2) ** 0.2
    return min(1 << math.floor(math.log2(c)), 1 << bits)


def chi2_test(cells_of_samples: np.ndarray, cells: int, level: float) -> tuple[float, float]:
    """(statistic, critical value) of χ² goodness of fit to the uniform law on ``cells``."""
    counts = np.bincount(cells_of_samples.astype(np.int64), minlength=cells)
    expected = cells_of_samples.size / cells
    return float(((counts - expected) ** 2 / expected).sum()), float(stats.chi2.isf(level, cells - 1))


def looks_uniform(*vectors: np.ndarray, bits: int = BITS, alpha: float = ALPHA) -> tuple[bool, list]:
    """Whether the residues mod 2^bits of ``vectors`` (equal lengths n; their joint law, coordinate
    by coordinate) pass both χ² tests (top bits, bottom bits), each at alpha/2; and the tests'
    (statistic, critical value, cells)."""
    n, m = vectors[0].size, len(vectors)
    share = int(math.log2(equiprobable_cells(n, bits * m, alpha / 2))) // m  # bits per vector
    if share < 1:
        raise ValueError(f"{n} samples are too few for a joint test of {m} vectors")
    cells = 1 << (share * m)
    top = np.zeros(n, dtype=np.uint64)
    low = np.zeros(n, dtype=np.uint64)
    for v in vectors:
        v = np.asarray(v, dtype=np.uint64)
        top = (top << np.uint64(share)) | (v >> np.uint64(bits - share))
        low = (low << np.uint64(share)) | (v & np.uint64((1 << share) - 1))
    tests = [(*chi2_test(view, cells, alpha / 2), cells) for view in (top, low)]
    return all(stat <= critical for stat, critical, _ in tests), tests


def test_the_verdict_accepts_uniform_residues_at_its_stated_rate_and_derives_its_cells():
    # Mann & Wald at n = 65536, a = 5e-7: 4·(2·65535²/4.89²)^{1/5} ≈ 215 → 128 cells
    assert equiprobable_cells(65536, 32, ALPHA / 2) == 128
    assert equiprobable_cells(65536, 3, ALPHA / 2) == 8  # never more cells than residues
    # 200 uniform vectors (a fixed seed): at 1e-6 each, none should be rejected (P(any) ≤ 2e-4)
    rng = np.random.default_rng(11)
    for _ in range(200):
        assert looks_uniform(rng.integers(0, 2**BITS, size=4096, dtype=np.uint64))[0]
    # at a loose level the statistic does follow χ²(c − 1): a verdict at a = 0.1 (two tests at
    # 0.05) rejects with probability between 0.05 and 0.1; 2000 verdicts, bounds 6σ of the
    # binomial count (fails falsely with probability < 1e-8)
    runs = 2000
    rejected = sum(
        not looks_uniform(rng.integers(0, 2**BITS, size=4096, dtype=np.uint64), alpha=0.1)[0] for _ in range(runs)
    )
    low, high = 0.05 * runs - 6 * math.sqrt(runs * 0.05 * 0.95), 0.1 * runs + 6 * math.sqrt(runs * 0.1 * 0.9)
    assert low < rejected < high, rejected


# ----------------------------------------------------------------------------- real inputs


def encoded_input(dim: int, sites: int, coalition: int, seed: int) -> np.ndarray:
    """A site's real unmasked input x: its clipped gradient sum rounded once (``encode_sum``)
    plus its Skellam share calibrated for ε = 4 over 10 steps, mod 2^32."""
    enc = Encoding(dim=dim, clip_norm=1.0, scale=4096.0, bits=BITS, beta=0.0)
    cal = calibrate_share(4.0, 1e-5, sites, coalition, enc.l1_sensitivity, enc.l2_sensitivity, 1.0, 10, DEFAULT_ORDERS)
    gen = np.random.default_rng(seed)
    rows = gen.normal(size=(20, dim)) * 0.01
    return to_modular(encode_sum(rows, enc, gen) + skellam_share(cal.share_variance, enc.padded_dim, gen), BITS)


def fixed_keys(ids, context: MaskContext, rng: np.random.Generator) -> dict[str, Ephemeral]:
    """Each site's X25519 key pair from a seeded generator (the real key type; unsigned: the
    masks do not depend on the signatures)."""
    out = {}
    for i in ids:
        private = X25519PrivateKey.from_private_bytes(rng.bytes(32))
        public = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        out[i.name] = Ephemeral(private, SignedKey(i.name, context, public, b""))
    return out


def seeds_of(context: MaskContext, keys: dict[str, Ephemeral]) -> dict[str, dict[str, bytes]]:
    """site → {other: s_{site,other}} by the real key agreement (``pair_seed``)."""
    public = {n: k.private_key.public_key() for n, k in keys.items()}
    return {
        n: {o: pair_seed(context, n, keys[n], o, public[o]) for o in context.sites if o != n} for n in context.sites
    }


# ----------------------------------------------------------------------------- 2. one peer's vector


def test_one_peers_masked_vector_is_uniform_and_the_unmasked_or_a_biased_one_is_not():
    """k = 4, d = 65536: site-01's masked vector (it has a lower and two higher peers, so both
    signs of masks are in it) passes; its unmasked input (its encoded gradients plus its noise
    share, concentrated near 0 mod 2^32) is rejected by the same verdict, and so is its input
    under masks drawn for the wrong modulus (2^31: a bug that leaves the top bit to the input)."""
    ids = identities(4)
    ctx = MaskContext("run-u", 0, 0, tuple(i.name for i in ids), BITS)
    seeds = seeds_of(ctx, fixed_keys(ids, ctx, np.random.default_rng(2026)))
    x = encoded_input(65536, 4, 1, seed=5)
    own = ctx.sites[1]
    y = masked_vector(x, ctx, own, seeds[own])
    ok, tests = looks_uniform(y, alpha=ALPHA / 3)
    assert ok, tests
    ok, tests = looks_uniform(x, alpha=ALPHA / 3)
    assert not ok, tests
    narrow = MaskContext(ctx.run_id, ctx.step, ctx.attempt, ctx.sites, BITS - 1)
    biased_mask = masked_vector(np.zeros(x.size, np.uint64), narrow, own, seeds[own])
    ok, tests = looks_uniform((x + biased_mask) & ctx.mask, alpha=ALPHA / 3)
    assert not ok, tests


def test_what_a_site_sends_in_a_real_step_is_uniform_and_its_input_is_not(tmp_path):
    """One real secure step among 4 sites (identities, pinned trust, ledgers, release desks, the
    board in memory): every masked vector a site published passes the verdict, every site's
    unmasked input (``SecureSum.own_input``) fails it. The ephemeral keys are fresh from the
    OS, so over them the 4 verdicts on masked vectors fail falsely with probability ≤ 1e-6 in
    all (each at 2.5e-7)."""
    dim, records = 1 << 14, 20
    enc = Encoding(dim=dim, clip_norm=1.0, scale=4096.0, bits=BITS, beta=0.0)
    cal = calibrate_share(4.0, 1e-5, 4, 1, enc.l1_sensitivity, enc.l2_sensitivity, 1.0, 4, DEFAULT_ORDERS)
    plan = SecureSumPlan("run-real", enc, 1, cal.total_variance, 1.0, 1e-5)
    files = [make_site(tmp_path, f"site-{i:02d}", policy=POLICY) for i in range(4)]
    pin_each_other(*files)
    opened = [open_site(f.config) for f in files]
    board = InProcessBoard(wait_s=30)
    out: dict[str, object] = {}
    try:
        parties = [SecureParty(s, ReleaseDesk(s, wire_transport(s))) for s in opened]
        names = sorted(p.name for p in parties)

        def one(party, i):
            data = np.random.default_rng(40 + i).normal(size=(records, dim)) * 0.01
            try:
                out[party.name] = secure_sum(party, board, plan, 0, names, lambda idx: data[idx], records)
            except Exception as e:  # the test looks at each site's outcome
                out[party.name] = e

        threads = [threading.Thread(target=one, args=(p, i)) for i, p in enumerate(parties)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        for s in opened:
            s.close()
    assert all(not isinstance(r, Exception) for r in out.values()), out
    context = out[names[0]].context
    for n in names:
        sent = board.published(context, "masked", n)
        assert sorted(sent) == [m for m in names if m != n]  # the same vector to every peer
        y = next(iter(sent.values())).y
        assert all(np.array_equal(s.y, y) for s in sent.values())
        ok, tests = looks_uniform(y, alpha=ALPHA / 4)
        assert ok, (n, tests)
        ok, tests = looks_uniform(out[n].own_input, alpha=ALPHA / 4)
        assert not ok, (n, tests)


# ----------------------------------------------------------------------------- 3. coalitions


def strip(y: np.ndarray, honest: str, coalition, seeds, context: MaskContext) -> np.ndarray:
    """What a coalition can do to honest site ``honest``'s masked vector with its own seeds:
    remove the masks it shares with it (honest adds PRG(s) toward a higher name, subtracts it
    toward a lower one), mod 2^b."""
    u = y.copy()
    for c in coalition:
        m = prg_mask(seeds[c][honest], y.size, context.bits)
        u = u - m if honest < c else u + m
    return u & context.mask


def test_a_coalition_of_at_most_t_sees_uniform_vectors_and_all_k_minus_1_others_recover_the_input():
    """k = 5 sites, coalition bound t = 3 (= k − 2, the most secure aggregation can tolerate:
    ``check_sites``), d = 65536. For every coalition C of at most t sites and every honest site h
    outside it, h's vector with C's masks stripped passes the verdict; with three or more honest
    sites left, every two of their stripped vectors are jointly uniform; with two left (|C| = t)
    the second is the revealed sum less C's own inputs less the first — the view is made of one
    uniform vector and what C knows anyway (the χ² on that pair rejects it as jointly uniform,
    as it must). The coalition of all k − 1 others strips every mask and holds h's input bit for
    bit, which the same verdict rejects. Each verdict at ALPHA / (number of verdicts)."""
    k, t = 5, 3
    assert check_sites(k, t) == (k, t)
    ids = identities(k)
    ctx = MaskContext("run-c", 2, 0, tuple(i.name for i in ids), BITS)
    seeds = seeds_of(ctx, fixed_keys(ids, ctx, np.random.default_rng(77)))
    xs = {n: encoded_input(65536, k, t, seed=100 + j) for j, n in enumerate(ctx.sites)}
    ys = {n: masked_vector(xs[n], ctx, n, seeds[n]) for n in ctx.sites}
    total = aggregate(ys, ctx)
    assert np.array_equal(total, sum(xs.values()) & ctx.mask)  # the masks cancel in the sum
    coalitions = [c for size in range(t + 1) for c in itertools.combinations(ctx.sites, size)]
    honest = {c: [n for n in ctx.sites if n not in c] for c in coalitions}
    marginal = [(c, h) for c in coalitions for h in honest[c]]
    joint = [(c, pair) for c in coalitions if len(honest[c]) >= 3 for pair in itertools.combinations(honest[c], 2)]
    assert len(marginal) == 5 + 5 * 4 + 10 * 3 + 10 * 2 and len(joint) == 10 + 5 * 6 + 10 * 3
    level = ALPHA / (len(marginal) + len(joint) + 1)
    stripped = {(c, h): strip(ys[h], h, c, seeds, ctx) for c, h in marginal}
    for c, h in marginal:
        ok, tests = looks_uniform(stripped[c, h], alpha=level)
        assert ok, (c, h, tests)
    for c, (h1, h2) in joint:
        ok, tests = looks_uniform(stripped[c, h1], stripped[c, h2], alpha=level)
        assert ok, (c, h1, h2, tests)
    for c in coalitions:
        if len(honest[c]) == 2:
            h1, h2 = honest[c]
            own = sum((xs[n] for n in c), start=np.zeros(total.size, np.uint64))
            assert np.array_equal(stripped[c, h2], (total - own - stripped[c, h1]) & ctx.mask)
    c = coalitions[-1]
    assert not looks_uniform(stripped[c, honest[c][0]], stripped[c, honest[c][1]], alpha=level)[0]
    # the negative control: all k − 1 others together recover each honest input exactly
    for h in ctx.sites:
        others = [n for n in ctx.sites if n != h]
        u = strip(ys[h], h, others, seeds, ctx)
        assert np.array_equal(u, xs[h])
        assert not looks_uniform(u, alpha=ALPHA)[0]


# ----------------------------------------------------------------------------- 1. bytes


def server_bytes(daemon, method: str) -> tuple[float, float]:
    """(request bytes received, reply bytes sent) of ``method`` by the daemon's own metrics
    interceptor (``peer.net.metrics``)."""
    registry = daemon.metrics.registry
    labels = {"method": PEER + method}
    return (
        registry.get_sample_value("privfusion_rpc_received_bytes_total", labels) or 0.0,
        registry.get_sample_value("privfusion_rpc_sent_bytes_total", labels) or 0.0,
    )


def test_a_secure_runs_bytes_are_the_messages_the_daemons_served_and_go_into_the_simulators_row(tmp_path):
    """``privfusion round``'s runner, ``method = "iterate"``, ``secure = true``: three sites on
    loopback, each daemon with its metrics endpoint on. The bytes every run report states equal
    what the servers counted for the same calls: a site's FetchSecAgg requests and the replies it
    got are what the peers' daemons received and sent it, its PublishSecAgg traffic is what its
    own daemon counted, each step's figures add up to the run's; and the simulator's row for the
    secure method carries the mean of what crossed each site's boundary."""
    allow = '"segment", "ledger", "secure-sum"'
    sites = [
        make_site(
            tmp_path,
            n,
            models={"mlp": (ARCH, model_arrays(ARCH))},
            policy=policy(8.0, allow=allow),
            extra_site='metrics_listen = "127.0.0.1:0"',
        )
        for n in ("site-a", "site-b", "site-c")
    ]
    pin_each_other(*sites)
    results = {}
    with contextlib.ExitStack() as stack:
        running_daemons = [stack.enter_context(running(s)) for s in sites]
        daemons = {s.name: d for s, (d, _) in zip(sites, running_daemons, strict=True)}
        roster = write_roster(
            tmp_path / "roster.toml",
            [(s.name, a, str(s.identity_dir / "site.crt")) for s, (_, a) in zip(sites, running_daemons, strict=True)],
        )
        extra = "secure = true\ncoalition = 1\nsecure_scale = 256.0\n"
        files = {s.name: round_file(s, roster, rounds=1, wait_s=20.0, extra=extra) for s in sites}
        for s in sites:  # one public n at every site
            path = Path(files[s.name])
            path.write_text(path.read_text().replace("declared_records = 50", "declared_records = 25"))

        def run(site):
            [(_, result)] = list(run_rounds(site.config, [files[site.name]]))
            results[site.name] = result

        threads = [threading.Thread(target=run, args=(s,)) for s in sites]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        # every run has ended, so every call it made has been answered and counted by both sides
        served = {n: {m: server_bytes(d, m) for m in ("FetchSecAgg", "PublishSecAgg")} for n, d in daemons.items()}
    assert set(results) == {"site-a", "site-b", "site-c"}
    reports = {}
    for s in sites:
        assert results[s.name].status == "finished", results[s.name].reason
        reports[s.name] = json.loads((s.root / "rounds" / "t1.json").read_text())  # the round report
    names = sorted(reports)
    steps = 2  # 1 round × 2 local steps
    dim = sum(int(np.prod(a.shape)) for a in model_arrays(ARCH).values())
    for n, rep in reports.items():
        assert len(rep["steps"]) == steps
        for field in ("bytes_sent", "bytes_received", "bytes_published"):
            assert sum(st[field] for st in rep["steps"]) == rep[field]
        # its own daemon counted exactly its publications (only its own run publishes there)
        received, sent = served[n]["PublishSecAgg"]
        assert rep["bytes_published"] == received + sent
        # the peers' daemons counted exactly its fetches and what they answered
        for p in names:
            if p == n:
                continue
            assert rep["by_peer"][p]["unanswered"] == 0
        got_by_peers = sum(reports[m]["by_peer"][n]["received"] for m in names if m != n)
        asked_by_peers = sum(reports[m]["by_peer"][n]["sent"] for m in names if m != n)
        assert (asked_by_peers, got_by_peers) == served[n]["FetchSecAgg"]
        # from every peer, at least its masked vector of each step (4-byte residues) came
        for p in names:
            if p != n:
                assert rep["by_peer"][p]["received"] > steps * 4 * dim
    # the simulator's figures: what crossed each site's boundary, both ways
    rows = {}
    for n in names:
        b = secure_bytes(n, reports)
        fetch_received, fetch_sent = served[n]["FetchSecAgg"]
        assert b["bytes_sent"] == reports[n]["bytes_sent"] + fetch_sent
        assert b["bytes_received"] == reports[n]["bytes_received"] + fetch_received
        rows[n] = {"status": "finished", "final_accuracy": 0.5, "coalition": 1, "wall_s": 1.0, **b}
    report = {
        "sites": {n: {"own_accuracy": 0.5, "oracle": {"accuracy": 0.5}, "secure_iterate": rows[n]} for n in names},
        "plan": [],
        "scenario": {"iterate": {"rounds": 1}},
    }
    [row] = [r for r in comparison_rows(report) if r["method"] == SECURE_ROW]
    mean = sum(rows[n]["bytes_sent"] + rows[n]["bytes_received"] for n in names) / len(names)
    assert row["bytes_per_site"] == pytest.approx(mean) and mean > 0


def test_a_call_nobody_answered_is_counted_apart_with_no_bytes(tmp_path):
    """A call that reached no daemon (UNAVAILABLE: nothing listens) is not payload that moved."""
    site = make_site(tmp_path, "site-a")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with client(site, f"127.0.0.1:{port}", peer="site-a") as c:
        with pytest.raises(PeerError) as e:
            c.info(timeout=5)
        assert e.value.status == "UNAVAILABLE"
        assert c.traffic.by_method() == {"GetPeerInfo": {"calls": 0, "unanswered": 1, "sent": 0, "received": 0}}
