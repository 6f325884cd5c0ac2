"""Empirical privacy audits: every mechanism, run for real, never looks less private than the
ledger says it is — and for the pure-ε mechanisms the audit comes close to the charge, so it has
the power to catch an undercharge.

Method (Jagielski et al. 2020; Nasr et al. 2021). Run the mechanism N times on each of two
neighbouring inputs D, D′ at the extremes of the public clip box (every neuron's row is an
independent run: the mechanisms draw independent noise per row). Split the runs in halves. On the
first half choose a threshold test "S > t ⇒ D′" on a statistic S (the likelihood-ratio statistic
of the pair, or the obvious projection) and its mirror "−S > t ⇒ D′"; on the second half count
its false positives (D called D′) and false negatives, take their 95% Clopper–Pearson upper
bounds FPR_hi, FNR_hi and bound

    ε_LB = max(log((1 − δ − FNR_hi)/FPR_hi), log((1 − δ − FPR_hi)/FNR_hi)).

Any (ε, δ)-DP mechanism has FPR + e^ε·FNR ≥ 1 − δ and FNR + e^ε·FPR ≥ 1 − δ, so ε_LB ≤ ε
whenever both upper bounds hold (each fails with probability ≤ 2.5%, the two together hold with
probability ≥ 95%; the threshold comes from the other half, so it does not bias them).

What ε is compared: the LEDGER's, by its own interpretation of the real record
(``peer.budget.ledger.per_neuron_record``, then ``peer.dp.accounting.rdp_of_record`` at the filter's
orders): the pure track's ε for pure mechanisms (δ = 0), else the RDP conversion at δ — the
figure the filter charges, not a formula copied here.

False failures: seeds are fixed, so every run is the same. Over the seed, the "never above" check
fails with probability ≤ 5% by construction (well under 1% in practice: both bounds must fail at
once); the "within 15%" check needs ε_LB ≥ 0.85 ε where its expectation is ≈ 0.98 ε at
N = 100k per half with a standard error ≈ 0.01 ε: > 10 standard errors away.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

import peer.dp.accounting as accounting
from peer.base.records import ReleaseRecord
from peer.base.rng import make_randomness
from peer.budget.filter import FILTER_ORDERS
from peer.budget.ledger import per_neuron_record
from peer.dp.training import run_dpsgd
from peer.ldp.mechanisms import gaussian_perturbation, laplace_activations, multibit, perturb_graph
from peer.nn.architectures import weight_layers
from peer.nn.graph import HiddenLayer, NetworkGraph

N = 200_000  # runs per neighbour (half to fit the threshold, half to bound ε)
CONFIDENCE = 0.95


def clopper_pearson_upper(k: np.ndarray, n: int) -> np.ndarray:
    """Upper end of the two-sided (CONFIDENCE) Clopper–Pearson interval for k successes of n."""
    k = np.asarray(k, dtype=float)
    upper = stats.beta.ppf(1 - (1 - CONFIDENCE) / 2, k + 1, n - k)
    return np.where(k >= n, 1.0, upper)


def epsilon_lower_bounds(s0: np.ndarray, s1: np.ndarray, thresholds: np.ndarray, delta: float) -> np.ndarray:
    """ε_LB of the tests "S > t ⇒ D′" for every t, from samples of S under D (s0) and D′ (s1)."""
    s0, s1 = np.sort(s0), np.sort(s1)
    false_pos = s0.size - np.searchsorted(s0, thresholds, side="right")  # S_D > t
    false_neg = np.searchsorted(s1, thresholds, side="right")  # S_D′ <= t
    fpr_hi = clopper_pearson_upper(false_pos, s0.size)
    fnr_hi = clopper_pearson_upper(false_neg, s1.size)
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.log((1 - delta - fnr_hi) / fpr_hi)
        b = np.log((1 - delta - fpr_hi) / fnr_hi)
    return np.nan_to_num(np.maximum(a, b), nan=-np.inf)


def audit(s0: np.ndarray, s1: np.ndarray, delta: float, n: int = N) -> float:
    """The audited ε_LB: the threshold and orientation fitted on the first half of the runs,
    the bound taken on the second (max(0, ·): a test that finds nothing bounds ε by 0)."""
    assert s0.shape == s1.shape == (n,)
    half = n // 2
    best = (-np.inf, 1, 0.0)
    for sign in (1, -1):
        fit0, fit1 = sign * s0[:half], sign * s1[:half]
        grid = np.unique(np.quantile(np.concatenate([fit0, fit1]), np.linspace(0.0005, 0.9995, 2000)))
        lbs = epsilon_lower_bounds(fit0, fit1, grid, delta)
        i = int(np.argmax(lbs))
        if lbs[i] > best[0]:
            best = (lbs[i], sign, grid[i])
    _, sign, t = best
    held = epsilon_lower_bounds(sign * s0[half:], sign * s1[half:], np.array([t]), delta)[0]
    return max(0.0, float(held))


def ledger_epsilon(record: ReleaseRecord, delta: float) -> float:
    """The ε the ledger charges for ``record`` at δ: its per-neuron restatement, interpreted by
    the accountant at the filter's orders; the pure track for δ = 0, else min(pure, RDP at δ)."""
    charged = per_neuron_record(record)
    rdp = accounting.rdp_of_record(charged, FILTER_ORDERS)
    pure = charged.epsilon if charged.delta == 0 else math.inf
    return min(pure, accounting.rdp_to_epsilon(FILTER_ORDERS, rdp, delta) if delta > 0 else math.inf)


def rows(value: float, width: int) -> np.ndarray:
    return np.full((N, width), value)


# ------------------------------------------------------------------------------- pure ε: power


def test_laplace_audit_lands_within_15_percent_of_the_charge_and_never_above():
    # one neuron, one probe: row D = lo, D′ = hi (the clip box's extremes). S = the noisy value
    # (the likelihood ratio is monotone in it).
    clip = (0.0, 1.0)
    y0, record = laplace_activations(rows(0.0, 1), epsilon=1.0, clip=clip, randomness=make_randomness(1))
    y1, _ = laplace_activations(rows(1.0, 1), epsilon=1.0, clip=clip, randomness=make_randomness(2))
    charged = ledger_epsilon(record, 0.0)
    lb = audit(y0[:, 0], y1[:, 0], 0.0)
    print(f"laplace: ledger ε = {charged:.4f}, audited ε_LB = {lb:.4f}")
    assert charged == pytest.approx(1.0)
    assert 0.85 * charged <= lb <= charged


def test_multibit_audit_lands_within_15_percent_of_the_charge_and_never_above():
    # one neuron's 4-vector at the corners of the box [−1, 1]^4; ε = 1 → m = 1 coordinate
    # reported. S = the sum of the centred outputs (the reported code: the LR statistic).
    bounds = (-1.0, 1.0)
    y0, record = multibit(rows(-1.0, 4), epsilon=1.0, bounds=bounds, randomness=make_randomness(3))
    y1, _ = multibit(rows(1.0, 4), epsilon=1.0, bounds=bounds, randomness=make_randomness(4))
    assert record.parameters["m"] == 1
    centre = record.parameters["centre"]
    charged = ledger_epsilon(record, 0.0)
    lb = audit((y0 - centre).sum(axis=1), (y1 - centre).sum(axis=1), 0.0)
    print(f"multibit: ledger ε = {charged:.4f}, audited ε_LB = {lb:.4f}")
    assert charged == pytest.approx(1.0)
    assert 0.85 * charged <= lb <= charged


# ------------------------------------------------------------------------------- (ε, δ): never above


def test_gaussian_unit_audit_never_exceeds_the_charge():
    # the PFA's perturbation unit, per neuron, replace-one: rows (+C) and (−C), L2 distance 2C.
    delta = 1e-5
    kw = dict(epsilon=1.0, delta=delta, clip_norm=1.0, entry_bound=1.0)
    y0, record = gaussian_perturbation(rows(1.0, 1), randomness=make_randomness(5), **kw)
    y1, _ = gaussian_perturbation(rows(-1.0, 1), randomness=make_randomness(6), **kw)
    assert record.sensitivity == pytest.approx(2.0)
    charged = ledger_epsilon(record, delta)
    lb = audit(y0[:, 0], y1[:, 0], delta)
    print(f"gaussian unit: ledger ε(δ={delta:g}) = {charged:.4f}, audited ε_LB = {lb:.4f}")
    assert 0.3 < lb <= charged


def test_one_dpsgd_step_audit_never_exceeds_the_charge():
    # full-batch DP-SGD, replace-one: two records whose gradient of ℓ(w; x) = w·x is x, clipped to
    # C = 1; D′ replaces record 0's x = +5 by −5, moving the clipped sum by 2C. N replicas of one
    # step (each its own noise from the same PCG64 stream).
    training = accounting.TrainingRecord.constant("replace-one", 1, 1.0, 1.0, 2.0)
    delta = 1e-5

    def loss(params, x_i, y_i):
        return (params["w"] * x_i).sum()

    w0 = {"w": torch.zeros(1, dtype=torch.float64)}
    y = torch.zeros(2, dtype=torch.long)
    released = []
    for first, seed in ((5.0, 7), (-5.0, 8)):
        x = torch.tensor([[first], [5.0]], dtype=torch.float64)
        run = run_dpsgd(loss, w0, x, y, training.steps, randomness=make_randomness(seed), replicas=N)
        released.append(run.params["w"][:, 0].numpy())
    record = accounting.dpsgd_record(training, delta, randomness=make_randomness(7).record_fields(), subject="audit")
    charged = ledger_epsilon(record, delta)
    lb = audit(released[0], released[1], delta)
    print(f"dp-sgd step: ledger ε(δ={delta:g}) = {charged:.4f}, audited ε_LB = {lb:.4f}")
    assert 0.5 < lb <= charged


N_SELECTION = 6_000  # merges per neighbour (each a real merge_rs call, ~1 ms)


def test_rs_merge_with_utility_selection_audit_never_exceeds_the_charge():
    """An RS merge whose π is chosen from measured utilities (selection="utility"), run for real
    on pools trained by real DP-GD on neighbouring datasets. Model a: σ = 20 (μ = 0.1), model b:
    σ = 1 (μ = 2); one full-batch step on two records, replace-one (D′ replaces x = +5 by −5).
    The score prefers the model whose weight moved furthest, so which model is released depends
    on the data. The ledger charges the composition of the scored models (μ = sqrt(2² + 0.1²));
    the audit, on the released weight, must stay below it — and it lands above what an RS bound
    of the chosen π would have claimed when a is chosen (ε_a ≈ 0.445), so charging the mixture
    (the old behaviour) would be caught.

    False failures: ≤ 5% by construction for "never above" (fixed seeds: every run is the same);
    the "above ε_a" check needs ε_LB > 0.445 where the test statistic separates b's releases
    with μ = 2 (ε_LB ≈ 4 with these seeds) — far above at 3,000 runs per half."""
    from peer.dp.merging import PoolModel, merge_rs

    delta = 1e-5
    arch = {"kind": "mlp", "input_dim": 1, "hidden": [], "output_dim": 1}
    trainings = {
        "a": accounting.TrainingRecord.constant("replace-one", 1, 1.0, 1.0, 20.0),
        "b": accounting.TrainingRecord.constant("replace-one", 1, 1.0, 1.0, 1.0),
    }

    def loss(params, x_i, y_i):
        return (params["w"] * x_i).sum()

    w0 = {"w": torch.zeros(1, dtype=torch.float64)}
    y = torch.zeros(2, dtype=torch.long)
    released, picked_b, records = [], [], []
    for first, seed in ((5.0, 11), (-5.0, 12)):
        x = torch.tensor([[first], [5.0]], dtype=torch.float64)
        runs = {
            name: run_dpsgd(loss, w0, x, y, t.steps, randomness=make_randomness(seed + 100 * i), replicas=N_SELECTION)
            .params["w"][:, 0]
            .numpy()
            for i, (name, t) in enumerate(trainings.items())
        }
        out, chose_b = np.empty(N_SELECTION), 0
        draws = make_randomness(seed + 1000)
        for r in range(N_SELECTION):
            pool = [
                PoolModel(name, arch, {"w": np.array([[runs[name][r]]], dtype=np.float32)}, t, 2)
                for name, t in trainings.items()
            ]
            merged = merge_rs(
                pool, 11.0, delta, randomness=draws, selection="utility", score=lambda a: -float(a["w"][0, 0])
            )
            out[r] = float(merged.arrays["w"][0, 0])
            chose_b += merged.choice.weights[1] == 1.0
            if merged.choice.weights[0] == 1.0:
                records.append(merged.record)  # a release of a: its π alone would claim ε_a
        released.append(out)
        picked_b.append(chose_b / N_SELECTION)
    assert records and all(r.parameters["selection"]["scored"] == (0, 1) for r in records)
    # the charge of a release of a (the smallest an RS bound of the chosen π would claim)
    charged = ledger_epsilon(records[0], delta)
    lb = audit(released[0], released[1], delta, n=N_SELECTION)
    eps_a = accounting.gdp_epsilon(0.1, delta)
    print(
        f"rs utility selection: b chosen {picked_b[0]:.3f} (D) vs {picked_b[1]:.3f} (D′); ledger ε = {charged:.3f}, audited ε_LB = {lb:.3f}"
    )
    assert charged == pytest.approx(
        accounting.rdp_to_epsilon(FILTER_ORDERS, np.asarray(FILTER_ORDERS) * (4 + 0.01) / 2, delta)
    )
    assert eps_a < lb <= charged


# ------------------------------------------------------------------------------- per entry → per neuron


def test_per_entry_row_converted_per_neuron_is_not_undercut():
    # a per-entry Laplace release of a neuron's 2-entry row at ε = 0.5 per entry. A test that
    # combines both entries (S = the sum of the clipped values, monotone in the LR) sees the
    # neuron at ε ≈ 2 × 0.5: above the per-entry figure, never above the ledger's per-neuron one.
    clip = (0.0, 1.0)
    y0, record = laplace_activations(rows(0.0, 2), epsilon=0.5, clip=clip, unit="entry", randomness=make_randomness(9))
    y1, _ = laplace_activations(rows(1.0, 2), epsilon=0.5, clip=clip, unit="entry", randomness=make_randomness(10))
    charged = ledger_epsilon(record, 0.0)
    lb = audit(np.clip(y0, *clip).sum(axis=1), np.clip(y1, *clip).sum(axis=1), 0.0)
    print(
        f"per-entry row of 2: record ε = {record.epsilon}, ledger ε per neuron = {charged:.4f}, audited ε_LB = {lb:.4f}"
    )
    assert charged == pytest.approx(1.0)
    assert record.epsilon < 0.85 * charged <= lb <= charged


def test_per_entry_graph_neuron_converted_per_neuron_is_not_undercut():
    # perturb_graph under unit="entry": a hidden neuron's activation (P = 1 probe, ε_x = 0.5) and
    # its two weight entries (one input and the bias, multi-bit at ε_w = 0.25 each) are parallel
    # per entry but all about one neuron. Its per-neuron cost is 0.5 + 2·0.25 = 1; taking the max
    # of the parts (0.5) undercharged it. Every hidden neuron is one run; D / D′ put all of a
    # neuron's values at the low / high corner of the public box.
    eps_x, eps_w = 0.5, 0.25
    arch = {"kind": "mlp", "input_dim": 1, "hidden": [N], "output_dim": 1, "activation": "relu"}
    names = [s.name for s in weight_layers(arch)]

    def graph(value: float) -> NetworkGraph:
        hidden = HiddenLayer(
            names[0], "linear", np.full((N, 1), max(value, 0.0)), np.full((N, 1, 1), value), np.full(N, value)
        )
        return NetworkGraph(arch, 1, (hidden,), np.zeros((1, N, 1)), np.zeros(1))

    kw = dict(epsilon_x=eps_x, epsilon_w=eps_w, activation_clip=(0.0, 1.0), weight_bounds=(-1.0, 1.0), unit="entry")
    g0, record = perturb_graph(graph(-1.0), randomness=make_randomness(11), **kw)
    g1, _ = perturb_graph(graph(1.0), randomness=make_randomness(12), **kw)

    def statistic(g: NetworkGraph) -> np.ndarray:
        # the log-likelihood ratio of the pair: Laplace part ε_x·(2·clip(a) − 1), each
        # randomised-response coordinate ±ε_w (the sign of its centred output)
        h = g.hidden[0]
        codes = np.sign(h.incoming[:, 0, 0]) + np.sign(h.bias)
        return eps_x * (2 * np.clip(h.activations[:, 0], 0.0, 1.0) - 1) + eps_w * codes

    layer = record.components[0]  # the hidden layer's release: the audited neurons
    charged = ledger_epsilon(layer, 0.0)
    lb = audit(statistic(g0), statistic(g1), 0.0)
    print(
        f"per-entry graph neuron: record ε = {layer.epsilon}, ledger ε per neuron = {charged:.4f}, audited ε_LB = {lb:.4f}"
    )
    assert charged == pytest.approx(eps_x + 2 * eps_w)
    assert layer.epsilon == max(eps_x, eps_w) < 0.85 * charged <= lb <= charged


# ------------------------------------------------------------------------------- add/remove: no count


def _without_noise(
    value, noisy=("release_id", "created_at", "release_sha256", "started_at", "finished_at", "ended_at", "seconds")
):
    """``value`` (JSON-like) without the fields that depend on the draw or the clock: ids,
    times and the digest of the noisy tensors."""
    if isinstance(value, dict):
        return {k: _without_noise(v, noisy) for k, v in value.items() if k not in noisy}
    if isinstance(value, list):
        return [_without_noise(v, noisy) for v in value]
    return value


def test_add_remove_segment_records_of_neighbours_are_the_same_bytes_apart_from_the_noise(tmp_path):
    """Issue 20, item 2: an iterate segment under add-remove stated n = len(y) in its record
    (``dataset_size``), its metadata (the fusion weights) and the run's report: the records of D
    (49 records) and D + {x} (50) said 49 and 50 — told apart with certainty (ε = ∞), whatever
    the noise. Now n is the declared public count: run for real on both neighbours (one site,
    same fixed seed, a simulation), everything published about the segments — the charged
    record, the release store's metadata, the fused models' metadata, the report — is the same
    bytes once the ids, the clock and the digest of the noisy tensors are left out. Only the
    tensors differ (the data and the noise decide them). Deterministic: no false failures."""
    import json

    from peer_harness import make_site, model_arrays

    from coordinator_free.iterate import load_iterate_config, run_iterate
    from coordinator_free.roster import write_roster
    from peer.budget.ledger import Ledger
    from peer.net.releases import ReleaseStore, segment_rounds

    arch = {"kind": "mlp", "input_dim": 4, "hidden": [3], "output_dim": 2, "activation": "relu"}
    policy = """
[policy]
show_remaining = "own"

[policy.data]
unit = "record:add-remove"
epsilon = 8.0
delta = 1e-5

[policy.peers."*"]
allow = ["segment"]
"""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    published = []
    for label, n in (("D", 49), ("D+x", 50)):
        site = make_site(tmp_path / label, "site-a", models={"mlp": (arch, model_arrays(arch))}, policy=policy, seed=3)
        np.savez(site.root / "records.npz", x=x[:n], y=y[:n])
        roster = write_roster(
            site.root / "roster.toml", [("site-a", "127.0.0.1:1", str(site.identity_dir / "site.crt"))]
        )
        (site.root / "iterate.toml").write_text(
            f'[round]\nroster = "{roster}"\nmodel = "mlp"\nmethod = "iterate"\nout = "rounds"\n\n'
            '[round.iterate]\nrecords = "records.npz"\nrun = "audit"\nrounds = 2\nlocal_steps = 2\n'
            'learning_rate = 0.5\nclip_norm = 1.0\nepsilon = 4.0\ndelta = 1e-5\nadjacency = "add-remove"\n'
            "declared_records = 64\ninit_seed = 5\nwait_s = 0.0\n"
        )
        result = run_iterate(site.config, load_iterate_config(site.root / "iterate.toml"), simulation=True)
        assert result.status == "finished"
        with Ledger(site.ledger) as led:
            records = [json.loads(e.record.canonical_json()) for e in led.entries()]
        store = ReleaseStore(site.root / "ledger.releases")
        stored = [store.get(key) for _, key in segment_rounds(store, "audit")]
        fused = [
            json.loads((site.root / "rounds" / "models" / f"audit-r{r}.json").read_text())["metadata"] for r in (1, 2)
        ]
        report = json.loads((site.root / "rounds" / "audit.json").read_text())
        published.append(
            {
                "records": records,
                "stored_records": [json.loads(s.record.canonical_json()) for s in stored],
                "stored_metadata": [dict(s.metadata) for s in stored],
                "fused_metadata": fused,
                "report": report,
                "tensors": [{k: a.tobytes() for k, a in s.tensors} for s in stored],
            }
        )
    d, dx = published
    for key in ("records", "stored_records", "stored_metadata", "fused_metadata", "report"):
        assert _without_noise(d[key]) == _without_noise(dx[key]), key
    assert d["records"][0]["parameters"]["dataset_size"] == 64
    assert d["records"][0]["parameters"]["dataset_size_source"] == "declared"
    assert d["tensors"] != dx["tensors"]  # the data moved the released bytes (through the noise's mask)


def test_add_remove_pool_records_of_neighbours_are_the_same_bytes_apart_from_the_noise():
    """The same for a pool (``train_pool``, what ``pool train --adjacency add-remove`` runs): the
    records of D and D + {x} are the same bytes once ids and times are left out; before the
    declared count they stated len(x) (49 against 50). Deterministic: no false failures."""
    import json

    from peer.dp.training import train_pool

    arch = {"kind": "mlp", "input_dim": 4, "hidden": [], "output_dim": 2}
    rng = np.random.default_rng(1)
    x = rng.normal(size=(50, 4)).astype(np.float32)
    y = (x[:, 1] > 0).astype(np.int64)
    trainings = [accounting.TrainingRecord.constant("add-remove", 3, 0.5, 1.0, s, 1.0) for s in (2.0, 6.0)]
    published = []
    for n in (49, 50):
        models = train_pool(
            arch, x[:n], y[:n], trainings, init_seed=0, randomness=make_randomness(4), delta=1e-5, dataset_size=64
        )
        published.append([_without_noise(json.loads(m.record.canonical_json())) for m in models])
    assert published[0] == published[1]
    assert published[0][0]["parameters"]["dataset_size"] == 64
