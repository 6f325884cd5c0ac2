import numpy as np
import pytest
import torch

from peer.base.errors import InvalidArgument
from peer.ldp.fusion import (
    average_arrays,
    ensemble_proba,
    fuse_arrays,
    fuse_many,
    permute_arrays,
    vanilla_average,
    weight_matching,
)
from peer.nn.architectures import build_model, input_tensor, model_from_arrays, state_arrays

MLP = {"kind": "mlp", "input_dim": 20, "hidden": [16, 12], "output_dim": 5}
CNN = {
    "kind": "cnn",
    "input_shape": [2, 8, 8],
    "channels": [4, 6],
    "kernel_size": 3,
    "pool": [2, 2],
    "hidden": [10],
    "output_dim": 5,
}


def random_perms(arch, rng):
    sizes = arch.get("channels", []) + arch["hidden"]
    return [rng.permutation(n) for n in sizes]


def inverse(p):
    inv = np.empty_like(p)
    inv[p] = np.arange(len(p))
    return inv


@pytest.mark.parametrize("arch", [MLP, CNN])
def test_permutation_preserves_the_function(arch):
    rng = np.random.default_rng(0)
    arrays = state_arrays(build_model(arch, seed=0))
    perms = random_perms(arch, rng)
    permuted = permute_arrays(arch, arrays, perms)
    x = rng.random((9, 20 if arch["kind"] == "mlp" else 128)).astype(np.float32)
    with torch.no_grad():
        y0 = model_from_arrays(arch, arrays)(input_tensor(arch, x))
        y1 = model_from_arrays(arch, permuted)(input_tensor(arch, x))
    assert torch.allclose(y0, y1, atol=1e-5)
    assert not np.allclose(arrays["0.weight"], permuted["0.weight"])
    # the inverse permutation undoes it
    back = permute_arrays(arch, permuted, [inverse(p) for p in perms])
    for k in arrays:
        assert np.array_equal(arrays[k], back[k])


@pytest.mark.parametrize("arch", [MLP, CNN])
def test_weight_matching_recovers_a_permuted_copy(arch):
    rng = np.random.default_rng(1)
    a = state_arrays(build_model(arch, seed=3))
    perms = random_perms(arch, rng)
    b = permute_arrays(arch, a, perms)
    res = weight_matching(arch, a, b)
    assert res.converged
    aligned = permute_arrays(arch, b, res.permutations)
    for k in a:
        assert np.allclose(aligned[k], a[k])


def test_alpha_fusion_and_averaging():
    a = state_arrays(build_model(MLP, seed=0))
    b = state_arrays(build_model(MLP, seed=1))
    f = fuse_arrays(a, b, 0.25)
    assert np.allclose(f["0.weight"], 0.25 * a["0.weight"] + 0.75 * b["0.weight"], atol=1e-6)
    assert np.allclose(vanilla_average(a, b)["2.bias"], (a["2.bias"] + b["2.bias"]) / 2, atol=1e-6)
    many = fuse_many(MLP, [a, b, b], [None, None, None], [0.5, 0.25, 0.25])
    assert np.allclose(many["0.weight"], f["0.weight"] * 0 + 0.5 * a["0.weight"] + 0.5 * b["0.weight"], atol=1e-6)
    x = np.random.default_rng(0).random((4, 20)).astype(np.float32)
    p = ensemble_proba(MLP, a, b, x, 0.3)
    assert np.allclose(p.sum(axis=1), 1.0, atol=1e-5)


def test_bad_inputs_are_named():
    a = state_arrays(build_model(MLP, seed=0))
    with pytest.raises(InvalidArgument, match="alpha"):
        fuse_arrays(a, a, 1.5)
    with pytest.raises(InvalidArgument, match=r"permutations\[1\]"):
        permute_arrays(MLP, a, [np.arange(16), np.zeros(12, dtype=int)])
    with pytest.raises(InvalidArgument, match="permutations"):
        permute_arrays(MLP, a, [np.arange(16)])
    other = state_arrays(build_model({**MLP, "hidden": [16, 13]}, seed=0))
    with pytest.raises(InvalidArgument, match="shapes differ"):
        fuse_arrays(a, other, 0.5)
    with pytest.raises(InvalidArgument, match="weights"):
        average_arrays([a, a], [0.7, 0.7])
