"""Local-DP releases over permutation groups: one unit = one group element."""

import numpy as np
import pytest
import torch
from site_models import networks
from site_models.networks import randomise

from peer.base.errors import InvalidArgument
from peer.base.rng import make_randomness
from peer.ldp.group_matching import group_activations
from peer.ldp.mechanisms.gaussian import gaussian_sigma
from peer.ldp.mechanisms.groups import (
    CLIP_SCALE,
    perturb_group_activations,
    perturb_group_weight_features,
    perturb_group_weights,
    release_units,
)
from peer.ldp.mechanisms.multibit import multibit_rectifier
from peer.ldp.mechanisms.network import default_entry_bound
from peer.nn.tracing import AxisRef, PermutationGroup, PermutationStructure, import_structure


@pytest.fixture(scope="module")
def resnet():
    model = randomise(networks.small_resnet(), seed=2)
    s = import_structure(model, [1, 8, 8])
    return model, s, {k: v.numpy().copy() for k, v in model.state_dict().items()}


def test_units_own_every_row_once(resnet):
    _, s, _ = resnet
    units = release_units(s)
    owned = [p for params in units.values() for p in params]
    assert len(owned) == len(set(owned))
    assert set(owned) == {p for p, shape in s.parameters.items() if len(shape) > 0}
    # one residual-stream channel is written by the stem and by stage 1's second conv, and
    # normalised by two BatchNorms: all of those rows are one unit
    assert {"stem.weight", "stem_bn.running_var", "stage1.conv2.weight", "stage1.bn2.bias"} <= set(units["stem"])
    assert units["fixed:fc"] == ["fc.weight", "fc.bias"]


def test_weight_release_record_shapes_and_calibration(resnet):
    _, s, arrays = resnet
    out, record = perturb_group_weights(s, arrays, epsilon=2.0, delta=1e-5, randomness=make_randomness(0))
    assert set(out) == set(arrays)
    for k, v in arrays.items():
        assert out[k].shape == v.shape and out[k].dtype == v.dtype
    assert np.all(out["stage1.bn1.running_var"] > 0)
    assert out["stage1.bn1.num_batches_tracked"] == arrays["stage1.bn1.num_batches_tracked"]
    assert record.epsilon == 2.0 and record.delta == 1e-5 and record.parameters["parallel_over"] == "neurons"
    stem = next(c for c in record.components if c.parameters["unit_owner"] == "stem")
    length = stem.parameters["shape"][1]
    # replace-one on a row clipped to L2 norm c: Δ₂ = 2c, σ from the analytic Gaussian mechanism
    assert stem.sensitivity == pytest.approx(2 * CLIP_SCALE * np.sqrt(length))
    assert stem.parameters["noise_std"] == pytest.approx(gaussian_sigma(2.0, 1e-5, stem.sensitivity))
    with pytest.raises(InvalidArgument, match="epsilon"):
        perturb_group_weights(s, arrays, epsilon=0.0, delta=1e-5)
    with pytest.raises(InvalidArgument, match="arrays"):
        perturb_group_weights(s, {k: v for k, v in arrays.items() if k != "fc.bias"}, epsilon=1.0, delta=1e-5)


def test_weight_noise_matches_its_calibration(resnet):
    """Without smoothing, released − clipped is Gaussian with the recorded σ (in each entry's
    scale). 24 release runs of the stem unit's rows: the sample std of thousands of N(0, σ²)
    draws lies within 5% of σ with failure probability far below 1e-6."""
    _, s, arrays = resnet
    diffs = []
    for seed in range(24):
        out, record = perturb_group_weights(
            s, arrays, epsilon=1.0, delta=1e-5, smoothing=False, randomness=make_randomness(seed)
        )
        stem = next(c for c in record.components if c.parameters["unit_owner"] == "stem")
        scale = stem.parameters["scales"][stem.parameters["parameters"].index("stage1.conv2.weight")]
        # entries are small against their box and the row's norm is below the clip: nothing clipped
        diffs.append(((out["stage1.conv2.weight"] - arrays["stage1.conv2.weight"]) / scale).ravel())
    d = np.concatenate(diffs)
    assert np.std(d) == pytest.approx(stem.parameters["noise_std"], rel=0.05)
    assert abs(np.mean(d)) < 5 * stem.parameters["noise_std"] / np.sqrt(d.size)


def test_activation_release_is_laplace_per_group_element(resnet):
    model, s, _ = resnet
    acts = group_activations(model, s, torch.randn(16, 1, 8, 8, generator=torch.Generator().manual_seed(0)))
    noisy, record = perturb_group_activations(acts, epsilon=1.0, clip=(-2.0, 2.0), randomness=make_randomness(1))
    for comp in record.components:
        g = comp.parameters["group"]
        n, width = acts[g].shape
        assert noisy[g].shape == (n, width)
        assert comp.sensitivity == pytest.approx(width * 4.0)  # P·m probes × (hi − lo), per element
    assert record.epsilon == 1.0 and record.parameters["unit_is"] == "one group element"


def test_weight_feature_release_is_multibit_per_group_element(resnet):
    _, s, arrays = resnet
    out, record = perturb_group_weight_features(s, arrays, epsilon=6.0, randomness=make_randomness(5))
    assert set(out) == set(arrays)
    for k, v in arrays.items():
        assert out[k].shape == v.shape, k
        # the rectifier's three levels times the parameter's public scale: the matcher's
        # exact few-valued expansion applies to every parameter
        assert len(np.unique(out[k])) <= 3, k
    assert out["stage1.bn1.num_batches_tracked"] == arrays["stage1.bn1.num_batches_tracked"]
    assert record.epsilon == 6.0 and record.delta == 0.0 and record.parameters["parallel_over"] == "neurons"
    assert record.parameters["unit_is"] == "one group element"
    assert record.parameters["release"] == "group_weight_features"
    units = release_units(s)
    assert {c.parameters["unit_owner"] for c in record.components} == set(units)
    stem = next(c for c in record.components if c.parameters["unit_owner"] == "stem")
    d = sum(int(np.prod(s.parameters[p][1:])) for p in units["stem"])
    # pure ε per group element, the box [−1, 1]^d of the scaled row: range 2 per coordinate
    assert stem.mechanism == "multibit" and stem.unit == "neuron" and stem.epsilon == 6.0 and stem.delta == 0.0
    assert stem.sensitivity == 2.0 and stem.sensitivity_norm == "range"
    assert stem.parameters["d"] == d and list(stem.parameters["bounds"]) == [-1.0, 1.0]
    assert stem.parameters["m"] == multibit_rectifier(d, epsilon=6.0, bounds=(-1.0, 1.0)).m == 2
    with pytest.raises(InvalidArgument, match="epsilon"):
        perturb_group_weight_features(s, arrays, epsilon=-1.0)
    bad = dict(arrays, **{"fc.bias": np.full(10, np.nan, np.float32)})
    with pytest.raises(InvalidArgument, match=r"arrays\[fc.bias\]"):
        perturb_group_weight_features(s, bad, epsilon=1.0)


# A two-layer network whose hidden group has AUDIT_N elements: each element is one unit, its
# row (fc1.weight[i], fc1.bias[i]) one independent run of the mechanism.
AUDIT_N = 200_000


def _wide(n: int) -> PermutationStructure:
    group = PermutationGroup("h", n, (AxisRef("fc1.weight", 0), AxisRef("fc1.bias", 0), AxisRef("fc2.weight", 1)))
    params = {"fc1.weight": (n, 2), "fc1.bias": (n,), "fc2.weight": (1, n), "fc2.bias": (1,)}
    return PermutationStructure((2,), (group,), params)


def _wide_state(n: int, corner: float) -> dict[str, np.ndarray]:
    c = default_entry_bound(2)  # the public scale of fc1's weights and bias (fan-in 2)
    return {
        "fc1.weight": np.full((n, 2), corner * c),
        "fc1.bias": np.full(n, corner * c),
        "fc2.weight": np.zeros((1, n)),
        "fc2.bias": np.zeros(1),
    }


def test_weight_features_are_unbiased_for_the_clipped_row():
    """E[x′] = the clipped value. Mean of 200k rows of a coordinate: its standard error is
    sqrt(Var/N) (``multibit`` variance); 5 standard errors fail with probability < 1e-6."""
    s = _wide(AUDIT_N)
    state = _wide_state(AUDIT_N, 0.5)
    state["fc1.bias"][:] = 10.0  # outside the box: clipped to the scale (1 in scaled coordinates)
    out, record = perturb_group_weight_features(s, state, epsilon=4.0, randomness=make_randomness(11))
    comp = next(c for c in record.components if c.parameters["unit_owner"] == "h")
    c = default_entry_bound(2)
    rect = multibit_rectifier(3, epsilon=4.0, bounds=(-1.0, 1.0))
    for key, want in (("fc1.weight", 0.5), ("fc1.bias", 1.0)):
        x = out[key].reshape(AUDIT_N, -1)[:, 0] / c
        se = np.sqrt((rect.half_step**2 * rect.m / rect.d - want**2) / AUDIT_N)
        assert abs(x.mean() - want) < 5 * se, key
    assert comp.parameters["d"] == 3


def test_weight_feature_audit_lands_within_15_percent_of_the_charge_and_never_above():
    """The distinguishing audit of ``test_privacy_audit`` on ONE group element: D = the row at
    one corner of its public box, D′ at the other; every element of the wide group is an
    independent run. S = the sum of the row's rectified codes (the likelihood-ratio statistic).
    False-failure rate as there: "never above" ≤ 5% by construction (fixed seeds: the run is the
    same every time), "within 15%" more than 10 standard errors away."""
    from test_privacy_audit import N, audit, ledger_epsilon

    assert N == AUDIT_N
    s = _wide(N)
    y0, record = perturb_group_weight_features(s, _wide_state(N, -1.0), epsilon=1.0, randomness=make_randomness(3))
    y1, _ = perturb_group_weight_features(s, _wide_state(N, 1.0), epsilon=1.0, randomness=make_randomness(4))

    def statistic(out):
        return out["fc1.weight"].sum(axis=1) + out["fc1.bias"]

    comp = next(c for c in record.components if c.parameters["unit_owner"] == "h")
    assert comp.parameters["m"] == 1 and comp.parameters["centre"] == 0.0
    charged = ledger_epsilon(record, 0.0)
    lb = audit(statistic(y0), statistic(y1), 0.0)
    print(f"group multibit: ledger ε = {charged:.4f}, audited ε_LB = {lb:.4f}")
    assert charged == pytest.approx(1.0)
    assert 0.85 * charged <= lb <= charged


# ---------------------------------------------------------------------------------- aliases


def _stored_before_aliases_were_refused():
    """What ``model import`` stored for ``AliasedSkip`` (``self.shortcut = self.skip``) before
    aliases were refused: no groups (its units are all fixed), four keys, two of them the
    other two's tensors, stored as separate copies."""
    model = networks.aliased_skip()
    arrays = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    structure = PermutationStructure((4,), (), {k: tuple(v.shape) for k, v in arrays.items()})
    return model, structure, arrays


def test_an_aliased_tensor_was_two_units_released_twice_and_is_now_refused():
    """Issue 20, item 4. The old structure made ``skip`` and ``shortcut`` two units: the PFA
    released one tensor's rows twice with independent noise, under a parallel record charging
    ε = 4 per row. Two (4, 1e-5) Gaussian releases of one row are, by composition (dp-accounting's
    PLD of the recorded σ and Δ₂, an independent reference), ε = 5.99 at δ = 1e-5; averaging the
    two copies divides the noise's std by √2 ≈ 1.414 (Monte Carlo: 4000 releases × 15 entries;
    the std ratio's relative standard error is ≈ 1/sqrt(60000/2) ≈ 0.006, the tolerance 0.03 is
    5 of them: false failure < 1e-6). Now building the module for any release refuses it."""
    from dp_accounting.pld import privacy_loss_distribution

    from peer.nn.imported import module_from_arrays

    model, structure, arrays = _stored_before_aliases_were_refused()
    units = release_units(structure)
    assert units == {"fixed:skip": ["skip.weight", "skip.bias"], "fixed:shortcut": ["shortcut.weight", "shortcut.bias"]}
    rnd = make_randomness(20)
    first, second = [], []
    for _ in range(4000):
        out, record = perturb_group_weights(structure, arrays, epsilon=4.0, delta=1e-5, smoothing=False, randomness=rnd)
        first.append(np.concatenate([out["skip.weight"].ravel(), out["skip.bias"]]))
        second.append(np.concatenate([out["shortcut.weight"].ravel(), out["shortcut.bias"]]))
    first, second = np.array(first), np.array(second)
    assert record.epsilon == 4.0 and record.parameters["composition"] == "parallel" and len(record.components) == 2
    one = record.components[0]
    assert one.parameters["noise_std"] == record.components[1].parameters["noise_std"]
    # the true privacy loss of a row released twice: two Gaussians composed
    pld = privacy_loss_distribution.from_gaussian_mechanism(
        one.parameters["noise_std"], sensitivity=one.sensitivity, value_discretization_interval=1e-4
    )
    assert pld.get_epsilon_for_delta(1e-5) == pytest.approx(4.0, abs=0.01)
    assert pld.compose(pld).get_epsilon_for_delta(1e-5) == pytest.approx(5.99, abs=0.01)
    # the average of the copies has 1/sqrt(2) of the noise (errors from the mean release)
    e1 = first - first.mean(axis=0)
    avg = (first + second) / 2
    ratio = np.std(e1) / np.std(avg - avg.mean(axis=0))
    assert (
        ratio == pytest.approx(np.sqrt(2), abs=0.03)
        and abs(np.corrcoef(e1.ravel(), (second - second.mean(axis=0)).ravel())[0, 1]) < 0.03
    )
    # now: every release of the stored model builds the site's module first, and is refused
    with pytest.raises(InvalidArgument, match=r"'skip\.weight' = 'shortcut\.weight'"):
        module_from_arrays(networks.aliased_skip, structure, arrays)
    with pytest.raises(InvalidArgument, match=r"model\.state_dict: names one tensor under several keys"):
        import_structure(model, [4])
