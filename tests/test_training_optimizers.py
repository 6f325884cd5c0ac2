"""DP-SGD with momentum or Adam on the privatised gradient (peer.dp.training.optimizer_update,
TrainingRecord.optimizer): the rules against torch.optim fed the same ĝ_t, whole runs replayed
from the generator, ε unchanged, records that round-trip and old records that mean SGD."""

import json

import numpy as np
import pytest
import torch

from peer.base.errors import InvalidArgument
from peer.base.rng import make_randomness
from peer.dp.accounting import GaussianStep, Optimizer, TrainingRecord, dpsgd_record, model_epsilon, surrogate_is_bound
from peer.dp.training import (
    classifier_loss,
    dpsgd_step,
    optimizer_update,
    privatised_gradient,
    run_dpsgd,
    train_dpsgd_classifier,
)
from peer.nn.architectures import build_model, input_tensor

MLP = {"kind": "mlp", "input_dim": 6, "hidden": [5], "output_dim": 3}
ADAM = Optimizer.of("adam", beta1=0.8, beta2=0.99, eps=1e-6)
MOMENTUM = Optimizer.of("momentum", momentum=0.7)


def _torch_reference(optimizer: Optimizer, p0, lr0):
    """The torch.optim counterpart of ``optimizer`` over the float64 tensors ``p0``."""
    params = {k: torch.nn.Parameter(v.detach().clone()) for k, v in p0.items()}
    if optimizer.name == "adam":
        opt = torch.optim.Adam(
            params.values(), lr=lr0, betas=(optimizer["beta1"], optimizer["beta2"]), eps=optimizer["eps"]
        )
    else:
        opt = torch.optim.SGD(
            params.values(), lr=lr0, momentum=optimizer["momentum"] if optimizer.name == "momentum" else 0
        )
    return params, opt


def _torch_step(params, opt, gradient, lr):
    for g in opt.param_groups:
        g["lr"] = lr
    for k, p in params.items():
        p.grad = gradient[k].clone()
    opt.step()


@pytest.mark.parametrize("optimizer", [Optimizer(), MOMENTUM, Optimizer.of("momentum"), ADAM, Optimizer.of("adam")])
def test_each_rule_equals_torch_optim_fed_the_same_gradients(optimizer):
    """40 steps of arbitrary gradients (heavy-tailed, some exactly 0) with a changing learning
    rate: our rule and torch.optim agree to float64 rounding."""
    gen = torch.Generator().manual_seed(0)
    p0 = {"w": torch.randn(7, 3, generator=gen, dtype=torch.float64), "b": torch.zeros(3, dtype=torch.float64)}
    ours, state = dict(p0), {}
    ref, opt = _torch_reference(optimizer, p0, 0.1)
    for t in range(1, 41):
        g = {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) ** 3 for k, v in p0.items()}
        g["b"][0] = 0.0
        lr = 0.1 / (1 + 0.05 * t)
        ours = optimizer_update(optimizer, ours, g, state, t, lr)
        _torch_step(ref, opt, g, lr)
    for k in p0:
        assert torch.allclose(ours[k], ref[k].detach(), rtol=1e-12, atol=1e-14)
        assert not torch.equal(ours[k], p0[k])


def test_the_sgd_rule_is_dpsgd_step():
    model = build_model(MLP, seed=1)
    rng = np.random.default_rng(0)
    x = input_tensor(MLP, rng.normal(size=(9, 6)))
    y = torch.as_tensor(rng.integers(0, 3, size=9))
    p = {k: v.detach() for k, v in model.named_parameters()}
    z = {k: torch.randn_like(v) for k, v in p.items()}
    kw = dict(clip_norm=0.7, noise_multiplier=1.5, denominator=4.5, noise=z)
    with torch.no_grad():
        direct = dpsgd_step(classifier_loss(model), p, x, y, learning_rate=0.3, **kw)
        g = privatised_gradient(classifier_loss(model), p, x, y, **kw)
    via = optimizer_update(Optimizer(), p, g, {}, 1, 0.3)
    for k in p:
        assert torch.allclose(direct[k], via[k], rtol=1e-6, atol=1e-7)


def _replayed(optimizer, model, x, y, steps, seed, n, replicas=None):
    """The run redrawn from the generator in run_dpsgd's order (z parameter by parameter, then
    the Poisson mask over all rows), every row's gradient masked, each replica's ĝ_t handed to
    torch.optim as .grad (Adam and SGD are elementwise, so one optimiser over the stacked
    replicas is R independent ones)."""
    gen = make_randomness(seed).generator
    lead = () if replicas is None else (replicas,)
    p0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    if replicas is not None:
        p0 = {k: v.unsqueeze(0).repeat(replicas, *([1] * v.dim())) for k, v in p0.items()}
    params, opt = _torch_reference(optimizer, p0, steps[0].learning_rate)
    loss = classifier_loss(model)
    for s in steps:
        z = {k: torch.from_numpy(gen.standard_normal(tuple(v.shape))).to(v.dtype) for k, v in params.items()}
        mask = torch.from_numpy(gen.random((*lead, len(x))) < s.sample_rate).to(x.dtype)
        kw = dict(clip_norm=s.clip_norm, noise_multiplier=s.noise_multiplier, denominator=s.sample_rate * n)
        with torch.no_grad():
            if replicas is None:
                g = privatised_gradient(loss, dict(params), x, y, noise=z, mask=mask, **kw)
            else:
                per = [
                    privatised_gradient(
                        loss,
                        {k: v[r] for k, v in params.items()},
                        x,
                        y,
                        noise={k: v[r] for k, v in z.items()},
                        mask=mask[r],
                        **kw,
                    )
                    for r in range(replicas)
                ]
                g = {k: torch.stack([p[k] for p in per]) for k in params}
        _torch_step(params, opt, g, s.learning_rate)
    return {k: v.detach() for k, v in params.items()}


@pytest.mark.parametrize("optimizer", [MOMENTUM, ADAM])
@pytest.mark.parametrize("replicas", [None, 3])
def test_a_run_is_torch_optim_on_the_privatised_gradients(optimizer, replicas):
    """run_dpsgd with momentum/Adam (Poisson batches, the batch's rows only in a single run)
    equals torch.optim fed the ĝ_t of the masked rule, drawn from the same seed: the noise and
    batches are those of an SGD run, only the update differs."""
    model = build_model(MLP, seed=2)
    rng = np.random.default_rng(1)
    x = input_tensor(MLP, rng.normal(size=(20, 6)) * 3)
    y = torch.as_tensor(rng.integers(0, 3, size=20))
    steps = [GaussianStep(0.05, 1.0, 0.8, 0.4)] * 4 + [GaussianStep(0.02, 0.5, 1.2, 0.3)] * 4
    run = run_dpsgd(
        classifier_loss(model),
        {k: v.detach() for k, v in model.named_parameters()},
        x,
        y,
        steps,
        randomness=make_randomness(5),
        dataset_size=25,
        replicas=replicas,
        optimizer=optimizer,
    )
    ref = _replayed(optimizer, model, x, y, steps, 5, 25, replicas)
    for k, v in ref.items():
        assert torch.allclose(run.params[k], v, rtol=1e-4, atol=1e-5), k
    sgd = run_dpsgd(
        classifier_loss(model),
        {k: v.detach() for k, v in model.named_parameters()},
        x,
        y,
        steps,
        randomness=make_randomness(5),
        dataset_size=25,
        replicas=replicas,
    )
    assert sgd.batch_sizes == run.batch_sizes  # the same batches were drawn
    assert not torch.allclose(sgd.params["0.weight"], run.params["0.weight"])


def test_epsilon_is_the_same_whatever_the_optimizer():
    """Post-processing: the record's ε (PLD and RDP), and every accountant's, are identical."""
    steps = [(GaussianStep(0.1, 1.0, 1.1, 0.01), 500), (GaussianStep(0.05, 0.5, 2.0, 0.02), 100)]
    base = TrainingRecord.from_runs("add-remove", steps)
    sgd = dpsgd_record(base, 1e-5).to_dict()
    for opt in (MOMENTUM, ADAM):
        other = base.with_optimizer(opt)
        assert other != base and other.steps == base.steps
        rec = dpsgd_record(other, 1e-5).to_dict()
        assert rec["epsilon"] == sgd["epsilon"]
        assert rec["parameters"]["epsilon_rdp"] == sgd["parameters"]["epsilon_rdp"]
        assert model_epsilon(other, 1e-5) == model_epsilon(base, 1e-5)
        assert rec["parameters"]["training"]["optimizer"] == opt.to_dict()
    full = TrainingRecord.constant("replace-one", 50, 0.5, 1.0, 20.0, state_independent_gradients=True)
    assert dpsgd_record(full.with_optimizer(ADAM), 1e-5).epsilon == dpsgd_record(full, 1e-5).epsilon
    # the LC surrogate assumes θ_T = θ_0 − Σ η_t ĝ_t: not a bound for momentum or Adam
    assert surrogate_is_bound([full, full])
    assert not surrogate_is_bound([full, full.with_optimizer(MOMENTUM)])


def test_records_round_trip_and_old_records_mean_sgd():
    base = TrainingRecord.constant("replace-one", 3, 0.1, 1.0, 2.0, 0.5)
    old = base.to_dict()
    assert "optimizer" not in old  # SGD records keep their bytes (and digests)
    assert TrainingRecord.from_dict(json.loads(json.dumps(old))).optimizer == Optimizer()
    adam = TrainingRecord.constant("replace-one", 3, 0.1, 1.0, 2.0, 0.5, optimizer=Optimizer.of("adam"))
    d = adam.to_dict()
    assert d["optimizer"] == {"name": "adam", "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}
    back = TrainingRecord.from_dict(json.loads(json.dumps(d)))
    assert back == adam and hash(back) == hash(adam) and back != base
    assert TrainingRecord.from_dict({**old, "optimizer": {"name": "momentum"}}).optimizer["momentum"] == 0.9
    assert TrainingRecord.from_dict({**old, "optimizer": {"name": "sgd"}}) == base


@pytest.mark.parametrize(
    ("optimizer", "field", "rule"),
    [
        ({"name": "rmsprop"}, r"training\.optimizer", "must be one of"),
        ("adam", r"training\.optimizer", "must be an object"),
        ({"name": "adam", "momentum": 0.9}, r"training\.optimizer\.momentum", "not a parameter of 'adam'"),
        ({"name": "sgd", "momentum": 0.9}, r"training\.optimizer\.momentum", "not a parameter of 'sgd'"),
        ({"name": "adam", "beta2": 1.0}, r"training\.optimizer\.beta2", r"must be in \[0, 1\)"),
        ({"name": "adam", "eps": 0}, r"training\.optimizer\.eps", "must be > 0"),
        ({"name": "momentum", "momentum": "x"}, r"training\.optimizer\.momentum", "must be a number"),
    ],
)
def test_bad_optimizers_are_refused_by_name(optimizer, field, rule):
    old = TrainingRecord.constant("replace-one", 1, 0.1, 1.0, 2.0).to_dict()
    with pytest.raises(InvalidArgument, match=rule) as e:
        TrainingRecord.from_dict({**old, "optimizer": optimizer})
    assert __import__("re").fullmatch(field, e.value.field)


def test_a_trained_model_records_its_optimizer_and_the_pool_reads_it(tmp_path):
    """The release record names the optimiser and its update; the stored pool model loads with
    it; replaying the record (steps, optimiser, seeds) reproduces the weights bit for bit."""
    from peer.dp.pools import load_pool, save_trained

    rng = np.random.default_rng(0)
    x = rng.normal(size=(30, 6)).astype(np.float32)
    y = rng.integers(0, 3, size=30)
    training = TrainingRecord.constant("add-remove", 6, 0.05, 1.0, 1.0, 0.5, optimizer=ADAM)
    model = train_dpsgd_classifier(
        MLP, x, y, training, init_seed=3, randomness=make_randomness(8), delta=1e-5, dataset_size=30
    )
    params = model.record.parameters
    assert params["training"]["optimizer"] == ADAM.to_dict() and "beta1" in params["update"]
    assert model.record.epsilon == model_epsilon(training, 1e-5).pld
    save_trained(tmp_path, "m", model, accuracy=0.5)
    (pm,) = load_pool(tmp_path)
    assert pm.privacy == training and pm.privacy.optimizer == ADAM
    replay = TrainingRecord.from_dict(params["training"])
    init = build_model(MLP, seed=params["init_seed"])
    again = run_dpsgd(
        classifier_loss(init),
        {k: v.detach() for k, v in init.named_parameters()},
        input_tensor(MLP, x),
        torch.as_tensor(y),
        replay.steps,
        randomness=make_randomness(model.record.seed),
        dataset_size=params["dataset_size"],
        optimizer=replay.optimizer,
    )
    for k, v in again.params.items():
        assert np.array_equal(v.numpy(), model.arrays[k])
    sgd = train_dpsgd_classifier(
        MLP,
        x,
        y,
        training.with_optimizer(Optimizer()),
        init_seed=3,
        randomness=make_randomness(8),
        delta=1e-5,
        dataset_size=30,
    )
    assert "optimizer" not in sgd.record.parameters["training"]
    assert sgd.record.parameters["update"].startswith("theta <- theta - lr_t * (sum")
