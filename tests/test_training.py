"""DP-SGD core: per-example gradients, clipping, the exact update rule, noise and sampling.

Statistical tests use fixed seeds; each states its false-failure rate (the probability that a
correct implementation fails it for a random seed)."""

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from scipy import stats

from peer.base.errors import InvalidArgument
from peer.base.rng import make_randomness
from peer.dp.training import classifier_loss, clipped_sum, dpsgd_step, per_example_gradients, run_dpsgd
from peer.nn.architectures import build_model, input_tensor

MLP = {"kind": "mlp", "input_dim": 6, "hidden": [5], "output_dim": 3}
CNN = {
    "kind": "cnn",
    "input_shape": [1, 4, 4],
    "channels": [2],
    "kernel_size": 3,
    "pool": [2],
    "hidden": [],
    "output_dim": 3,
}


@dataclass(frozen=True)
class Step:
    learning_rate: float
    clip_norm: float
    noise_multiplier: float
    sample_rate: float = 1.0


def _data(arch, n=12, seed=0):
    rng = np.random.default_rng(seed)
    dim = 6 if arch["kind"] == "mlp" else 16
    x = input_tensor(arch, rng.normal(size=(n, dim)) * 3)
    y = torch.as_tensor(rng.integers(0, 3, size=n))
    return x, y


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _naive_gradients(model, x, y):
    """One backward pass per example: the reference for vmap(grad)."""
    out = []
    for i in range(len(x)):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        out.append({k: p.grad.detach().clone() for k, p in model.named_parameters()})
    return out


def _flat(g):
    return torch.cat([v.reshape(-1) for v in g.values()])


@pytest.mark.parametrize("arch", [MLP, CNN])
def test_per_example_gradients_match_a_loop(arch):
    model = build_model(arch, seed=1)
    x, y = _data(arch)
    batched = per_example_gradients(classifier_loss(model), _params(model), x, y)
    for i, ref in enumerate(_naive_gradients(model, x, y)):
        for k in ref:
            torch.testing.assert_close(batched[k][i], ref[k], rtol=1e-5, atol=1e-6)


def test_clipping_bounds_each_example_and_matches_a_loop():
    model = build_model(MLP, seed=2)
    x, y = _data(MLP, n=20)
    naive = _naive_gradients(model, x, y)
    norms = torch.stack([_flat(g).norm() for g in naive])
    clip = float(norms.median())  # half the examples are clipped, half are not
    mask = torch.tensor([1.0, 0.0] * 10)
    expected = {k: torch.zeros_like(v) for k, v in naive[0].items()}
    for i, g in enumerate(naive):
        # clip_C(g) = g · min(1, C/‖g‖), the norm over all parameters together
        scaled = {k: v * min(1.0, clip / float(norms[i])) for k, v in g.items()}
        assert float(_flat(scaled).norm()) <= clip * (1 + 1e-6)
        if mask[i]:
            expected = {k: expected[k] + scaled[k] for k in expected}
    got = clipped_sum(per_example_gradients(classifier_loss(model), _params(model), x, y), clip, mask)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-5, atol=1e-6)


def test_step_follows_the_stated_rule_exactly():
    """θ' = θ − η·(Σ clip_C(g_i) + σ·C·z)/denominator, checked with a known z."""
    model = build_model(MLP, seed=3)
    x, y = _data(MLP)
    params = _params(model)
    z = {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(7)) for k, v in params.items()}
    lr, clip, sigma, denom = 0.7, 0.3, 1.9, 37.0
    got = dpsgd_step(
        classifier_loss(model),
        params,
        x,
        y,
        learning_rate=lr,
        clip_norm=clip,
        noise_multiplier=sigma,
        denominator=denom,
        noise=z,
    )
    summed = {k: torch.zeros_like(v) for k, v in params.items()}
    for g in _naive_gradients(model, x, y):
        f = min(1.0, clip / float(_flat(g).norm()))
        summed = {k: summed[k] + f * g[k] for k in summed}
    for k in params:
        torch.testing.assert_close(
            got[k], params[k] - lr * (summed[k] + sigma * clip * z[k]) / denom, rtol=1e-5, atol=1e-6
        )


def _zero_loss(params, x_i, y_i):
    return sum((v * 0.0).sum() for v in params.values())


def _variance_bounds(m, failure):
    """Two-sided interval for the sample variance (known mean 0) of m draws over σ²: χ²_m/m."""
    return stats.chi2.ppf(failure / 2, m) / m, stats.chi2.ppf(1 - failure / 2, m) / m


@pytest.mark.parametrize("sample_rate", [1.0, 0.25])
def test_added_noise_has_the_recorded_std(sample_rate):
    """With a zero gradient only the noise moves θ: θ_T − θ_0 = −Σ_t η_t σ_t C_t z_t / (q n), so
    its entries are N(0, Σ_t (η_t σ_t C_t / (q n))²). Sample variance of 20,000 entries against
    χ² quantiles; false-failure rate 1e-6."""
    m, n = 20_000, 50
    params0 = {"w": torch.zeros(m)}
    x, y = torch.zeros(n, 1), torch.zeros(n, dtype=torch.long)
    steps = [Step(0.5, 2.0, 1.5, sample_rate), Step(1.0, 0.5, 3.0, sample_rate), Step(0.2, 1.0, 0.8, sample_rate)]
    run = run_dpsgd(_zero_loss, params0, x, y, steps, randomness=make_randomness(11))
    expected_var = sum((s.learning_rate * s.noise_multiplier * s.clip_norm / (sample_rate * n)) ** 2 for s in steps)
    delta = run.params["w"].double().numpy()
    lo, hi = _variance_bounds(m, 1e-6)
    ratio = float(np.mean(delta**2)) / expected_var
    assert lo < ratio < hi, (ratio, lo, hi)
    # the mean is 0: |mean| < z_{1-1e-6/2}·σ/√m
    assert abs(delta.mean()) < stats.norm.ppf(1 - 0.5e-6) * np.sqrt(expected_var / m)


def test_poisson_batches_include_each_record_with_probability_q():
    """ℓ_i(θ) = θ·e_i (gradient e_i, norm 1 ≤ C, so no clipping) and σ = 0: after T steps
    θ_T − θ_0 = −η/(q n)·c where c_i counts the batches that held record i, so the counts are read
    off the parameters themselves. Σ c_i ~ Binomial(nT, q) (two-sided binomial test) and the c_i
    are i.i.d. Binomial(T, q) (chi-square goodness of fit on the pooled counts); each test's
    false-failure rate is 1e-6."""
    n, T, q, lr = 400, 60, 0.3, 1.0
    x = torch.eye(n)
    y = torch.zeros(n, dtype=torch.long)

    def linear(params, x_i, y_i):
        return (params["w"] * x_i).sum()

    run = run_dpsgd(linear, {"w": torch.zeros(n)}, x, y, [Step(lr, 1.0, 0.0, q)] * T, randomness=make_randomness(5))
    counts = np.rint(-run.params["w"].double().numpy() * q * n / lr).astype(int)
    np.testing.assert_allclose(-run.params["w"].double().numpy() * q * n / lr, counts, atol=1e-3)
    assert counts.sum() == sum(run.batch_sizes) and len(run.batch_sizes) == T
    assert stats.binomtest(int(counts.sum()), n * T, q).pvalue > 1e-6
    observed = np.bincount(counts, minlength=T + 1)
    pmf = stats.binom.pmf(np.arange(T + 1), T, q)
    # pool the tails so every expected cell count is at least 5
    keep = pmf * n >= 5
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(pmf[keep], pmf[~keep].sum()) * n
    assert stats.chisquare(obs, exp).pvalue > 1e-6


def test_full_batch_uses_every_record_every_step():
    n, T = 30, 7
    x = torch.eye(n)

    def linear(params, x_i, y_i):
        return (params["w"] * x_i).sum()

    run = run_dpsgd(
        linear,
        {"w": torch.zeros(n)},
        x,
        torch.zeros(n, dtype=torch.long),
        [Step(1.0, 1.0, 0.0)] * T,
        randomness=make_randomness(0),
    )
    torch.testing.assert_close(run.params["w"], torch.full((n,), -T / n))
    assert run.batch_sizes is None


def test_replicas_are_independent_runs_with_the_same_noise_law():
    """R replicas of a zero-gradient run: each replica's entries have the recorded variance
    (χ² bound on all R·m entries, false-failure rate 1e-6) and no two replicas coincide."""
    R, m, n = 16, 2000, 10
    steps = [Step(1.0, 1.0, 2.0)] * 3
    run = run_dpsgd(
        _zero_loss,
        {"w": torch.zeros(m)},
        torch.zeros(n, 1),
        torch.zeros(n, dtype=torch.long),
        steps,
        randomness=make_randomness(3),
        replicas=R,
    )
    w = run.params["w"].double().numpy()
    assert w.shape == (R, m)
    lo, hi = _variance_bounds(R * m, 1e-6)
    assert lo < float(np.mean(w**2)) / (3 * (2.0 / n) ** 2) < hi
    assert np.abs(np.corrcoef(w)[np.triu_indices(R, 1)]).max() < 0.15  # |ρ̂| ~ 1/√2000 ≈ 0.022


def test_fixed_seed_reproduces_and_csprng_differs():
    model = build_model(MLP, seed=4)
    x, y = _data(MLP)
    steps = [Step(0.5, 1.0, 1.0, 0.5)] * 5
    a = run_dpsgd(classifier_loss(model), _params(model), x, y, steps, randomness=make_randomness(9))
    b = run_dpsgd(classifier_loss(model), _params(model), x, y, steps, randomness=make_randomness(9))
    c = run_dpsgd(classifier_loss(model), _params(model), x, y, steps, randomness=make_randomness())
    assert all(torch.equal(a.params[k], b.params[k]) for k in a.params)
    assert not torch.equal(a.params["0.weight"], c.params["0.weight"])


def test_bad_steps_are_refused():
    x, y = torch.zeros(3, 1), torch.zeros(3, dtype=torch.long)
    p = {"w": torch.zeros(2)}
    r = make_randomness(0)
    with pytest.raises(InvalidArgument, match="clip_norm"):
        run_dpsgd(_zero_loss, p, x, y, [Step(1.0, 0.0, 1.0)], randomness=r)
    with pytest.raises(InvalidArgument, match="sample_rate"):
        run_dpsgd(_zero_loss, p, x, y, [Step(1.0, 1.0, 1.0, 1.5)], randomness=r)
    with pytest.raises(InvalidArgument, match="noise_multiplier"):
        run_dpsgd(_zero_loss, p, x, y, [Step(1.0, 1.0, -1.0)], randomness=r)
    with pytest.raises(InvalidArgument, match="steps"):
        run_dpsgd(_zero_loss, p, x, y, [], randomness=r)
    with pytest.raises(InvalidArgument, match="empty"):
        run_dpsgd(_zero_loss, p, x[:0], y[:0], [Step(1.0, 1.0, 1.0)], randomness=r)


def test_the_record_describes_exactly_the_run():
    """Re-running DP-SGD from nothing but the stored record (training steps, declared n, public
    init seed, architecture, noise seed) reproduces the weights bit for bit; the record's ε is
    the accountant's for that TrainingRecord."""
    from peer.dp.accounting import TrainingRecord, model_epsilon
    from peer.dp.training import train_dpsgd_classifier

    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 6)).astype(np.float32)
    y = rng.integers(0, 3, size=40)
    training = TrainingRecord.from_runs(
        "add-remove",
        [
            (TrainingRecord.constant("add-remove", 1, 0.5, 1.0, 3.0, 0.5).steps[0], 4),
            (TrainingRecord.constant("add-remove", 1, 0.2, 0.5, 5.0, 0.5).steps[0], 3),
        ],
    )
    model = train_dpsgd_classifier(
        MLP, x, y, training, init_seed=7, randomness=make_randomness(21), delta=1e-5, dataset_size=50
    )
    rec = model.record
    assert rec.mechanism == "dpsgd" and rec.level == "data" and rec.unit == "record:add-remove"
    assert rec.randomness == "fixed-seed" and rec.seed == 21
    replayed_steps = TrainingRecord.from_dict(rec.parameters["training"])
    assert replayed_steps == training and replayed_steps.num_steps == 7
    # add-remove: the declared n (50), never the true count (40)
    assert rec.parameters["dataset_size"] == 50 and rec.parameters["dataset_size_source"] == "declared"
    assert rec.parameters["init_seed"] == 7
    assert rec.epsilon == pytest.approx(model_epsilon(training, 1e-5).pld, rel=1e-12)
    arch = dict(rec.parameters["architecture"])
    init = build_model(arch, seed=rec.parameters["init_seed"])
    again = run_dpsgd(
        classifier_loss(init),
        _params(init),
        input_tensor(arch, x),
        torch.as_tensor(y),
        replayed_steps.steps,
        randomness=make_randomness(rec.seed),
        dataset_size=rec.parameters["dataset_size"],
    )
    for k, v in again.params.items():
        assert np.array_equal(v.numpy(), model.arrays[k])


# ------------------------------------------------------------ Poisson batches: the sampled rows only


def _masked_reference_run(loss_fn, params0, x, y, steps, seed, n):
    """The rule with every row's gradient computed and the unsampled ones masked to 0, drawing
    from the generator exactly as run_dpsgd does: per step z (parameter by parameter), then
    the Poisson mask over all rows when q < 1."""
    gen = make_randomness(seed).generator
    params = {k: v.detach().clone() for k, v in params0.items()}
    sizes = []
    for s in steps:
        z = {k: torch.from_numpy(gen.standard_normal(tuple(v.shape))).to(v.dtype) for k, v in params.items()}
        mask = None
        if s.sample_rate < 1:
            mask = torch.from_numpy(gen.random(len(x)) < s.sample_rate).to(x.dtype)
            sizes.append(int(mask.sum()))
        with torch.no_grad():
            params = dpsgd_step(
                loss_fn,
                params,
                x,
                y,
                learning_rate=s.learning_rate,
                clip_norm=s.clip_norm,
                noise_multiplier=s.noise_multiplier,
                denominator=s.sample_rate * n,
                noise=z,
                mask=mask,
            )
    return params, tuple(sizes)


@pytest.mark.parametrize("arch", [MLP, CNN])
@pytest.mark.parametrize("batch", ["empty", "poisson", "full"])
def test_the_sampled_rows_step_equals_the_masked_all_rows_step(arch, batch):
    """dpsgd_step on x[B] (no mask) against dpsgd_step on all rows with B's 0/1 mask: the
    unsampled rows contribute exactly 0 to the clipped sum, so the two differ only by float32
    summation order (rtol 1e-5). The clip is the median gradient norm, so both clipped and
    unclipped rows are in the batch; an empty batch is the noise step exactly."""
    model = build_model(arch, seed=5)
    x, y = _data(arch, n=16, seed=3)
    params = _params(model)
    loss = classifier_loss(model)
    norms = torch.stack([_flat(g).norm() for g in _naive_gradients(model, x, y)])
    clip = float(norms.median())
    sampled = {
        "empty": np.zeros(16, dtype=bool),
        "poisson": make_randomness(17).generator.random(16) < 0.4,
        "full": np.ones(16, dtype=bool),
    }[batch]
    assert batch != "poisson" or 0 < sampled.sum() < 16
    z = {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(2)) for k, v in params.items()}
    kw = dict(learning_rate=0.9, clip_norm=clip, noise_multiplier=1.3, denominator=0.4 * 16, noise=z)
    rows = torch.from_numpy(np.flatnonzero(sampled))
    got = dpsgd_step(loss, params, x[rows], y[rows], **kw)
    masked = dpsgd_step(loss, params, x, y, mask=torch.from_numpy(sampled).float(), **kw)
    for k in params:
        torch.testing.assert_close(got[k], masked[k], rtol=1e-5, atol=1e-6)
        if batch == "empty":
            assert torch.equal(got[k], params[k] - (0.9 / (0.4 * 16)) * ((1.3 * clip) * z[k]))
        else:  # the batch moved θ beyond the noise
            assert not torch.allclose(got[k], params[k] - (0.9 / (0.4 * 16)) * ((1.3 * clip) * z[k]))


def test_run_dpsgd_draws_and_applies_the_same_batches_as_the_masked_rule():
    """A seeded run through steps at q = 0.05 (16 rows: an empty batch with probability 0.44) and
    q = 0.999 (a full batch with probability 0.98) equals the masked all-rows rule drawing from
    the same stream in the same order: same batch sizes, parameters within float32 summation
    order (rtol 1e-5). The seed gives at least one empty and one full batch."""
    model = build_model(MLP, seed=6)
    x, y = _data(MLP, n=16, seed=4)
    steps = [Step(0.5, 1.0, 0.7, 0.05)] * 4 + [Step(0.5, 1.0, 0.7, 0.999)] * 3 + [Step(0.3, 0.5, 1.1, 0.4)] * 3
    run = run_dpsgd(classifier_loss(model), _params(model), x, y, steps, randomness=make_randomness(8))
    ref, sizes = _masked_reference_run(classifier_loss(model), _params(model), x, y, steps, 8, 16)
    assert run.batch_sizes == sizes
    assert 0 in sizes and 16 in sizes and any(0 < s < 16 for s in sizes), sizes
    for k in ref:
        torch.testing.assert_close(run.params[k], ref[k], rtol=1e-5, atol=1e-6)


def test_an_empty_poisson_batch_is_a_noise_only_step():
    """A single record at q = 0.05: most steps sample nobody. The zero-loss gradient is 0 anyway,
    so the run is exactly −Σ_t η σ C z_t / (q n) with z from the stream (noise first, then the
    mask), whatever the batches were; the seed gives both empty and non-empty batches."""
    n, q = 1, 0.05
    x, y = torch.zeros(n, 2), torch.zeros(n, dtype=torch.long)
    steps = [Step(0.5, 2.0, 1.5, q)] * 40
    run = run_dpsgd(_zero_loss, {"w": torch.zeros(3, dtype=torch.float64)}, x, y, steps, randomness=make_randomness(1))
    assert 0 in run.batch_sizes and 1 in run.batch_sizes
    gen = make_randomness(1).generator
    expected = np.zeros(3)
    for _ in steps:
        expected -= 0.5 * 1.5 * 2.0 * gen.standard_normal(3) / (q * n)
        gen.random(n)
    np.testing.assert_allclose(run.params["w"].numpy(), expected, rtol=1e-12)


def test_add_remove_training_needs_a_declared_count():
    """Under add-remove the number of records is private: every trainer refuses to default the
    denominator to len(x), naming the field and the rule, before any step runs; replace-one
    keeps the true count (public there) and says so in its record."""
    from peer.dp.accounting import TrainingRecord
    from peer.dp.training import train_dpsgd_classifier, train_dpsgd_module, train_pool

    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 6)).astype(np.float32)
    y = rng.integers(0, 3, size=12)
    add_remove = TrainingRecord.constant("add-remove", 2, 0.5, 1.0, 3.0, 1.0)
    for train in (
        lambda: train_dpsgd_classifier(MLP, x, y, add_remove, init_seed=0, randomness=make_randomness(), delta=1e-5),
        lambda: train_pool(MLP, x, y, [add_remove], init_seed=0, randomness=make_randomness(), delta=1e-5),
        lambda: train_dpsgd_module(
            lambda: torch.nn.Linear(6, 3),
            {"kind": "own"},
            [6],
            x,
            y,
            add_remove,
            init_seed=0,
            randomness=make_randomness(),
            delta=1e-5,
        ),
    ):
        with pytest.raises(InvalidArgument) as e:
            train()
        assert e.value.field == "dataset_size" and "declared_records" in e.value.rule
    replace_one = TrainingRecord.constant("replace-one", 2, 0.5, 1.0, 3.0, 1.0)
    rec = train_dpsgd_classifier(MLP, x, y, replace_one, init_seed=0, randomness=make_randomness(), delta=1e-5).record
    assert rec.parameters["dataset_size"] == 12 and rec.parameters["dataset_size_source"] == "count"
