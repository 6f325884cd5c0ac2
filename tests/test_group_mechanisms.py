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
    perturb_group_weights,
    release_units,
)
from peer.nn.tracing import import_structure


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
