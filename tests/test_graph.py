import numpy as np
import pytest
import torch
from torch import nn

from peer.base.errors import InvalidArgument
from peer.nn.architectures import build_model
from peer.nn.graph import extract_graph

MLP = {"kind": "mlp", "input_dim": 64, "hidden": [32, 16], "output_dim": 10}
CNN = {
    "kind": "cnn",
    "input_shape": [1, 8, 8],
    "channels": [4, 8],
    "kernel_size": 3,
    "pool": [2, 2],
    "hidden": [16],
    "output_dim": 10,
}


def test_mlp_graph_shapes_and_features():
    m = build_model(MLP, seed=0)
    probe = np.random.default_rng(0).random((7, 64))
    g = extract_graph(MLP, m, probe)
    assert g.sizes == (32, 16) and g.input_size == 64
    assert g.hidden[0].incoming.shape == (32, 64, 1) and g.hidden[1].incoming.shape == (16, 32, 1)
    assert g.output_incoming.shape == (10, 16, 1)
    h1 = torch.relu(m[0](torch.tensor(probe, dtype=torch.float32)))
    assert np.allclose(g.hidden[0].activations, h1.T.detach().numpy(), atol=1e-6)
    assert np.allclose(g.hidden[0].bias, m[0].bias.detach().numpy())


def test_cnn_graph_pools_spatially_and_groups_flatten_columns():
    m = build_model(CNN, seed=0)
    probe = np.random.default_rng(0).random((5, 64))
    g = extract_graph(CNN, m, probe)
    assert g.sizes == (4, 8, 16) and g.input_size == 1
    assert g.hidden[0].incoming.shape == (4, 1, 9)
    assert g.hidden[1].incoming.shape == (8, 4, 9)
    assert g.hidden[2].incoming.shape == (16, 8, 4)  # 2x2 spatial positions per channel
    assert g.hidden[1].activations.shape == (8, 5)
    x = torch.tensor(probe, dtype=torch.float32).reshape(5, 1, 8, 8)
    c1 = torch.relu(m[0](x))
    assert np.allclose(g.hidden[0].activations, c1.mean(dim=(2, 3)).T.detach().numpy(), atol=1e-6)


def test_bad_inputs_are_named():
    m = build_model(MLP, seed=0)
    with pytest.raises(InvalidArgument, match="probe_x"):
        extract_graph(MLP, m, np.zeros((0, 64)))
    with pytest.raises(InvalidArgument, match="probe_x"):
        extract_graph(MLP, m, np.full((3, 64), np.nan))
    with torch.no_grad():
        m[2].weight[0, 0] = float("inf")
    with pytest.raises(InvalidArgument, match=r"weights\[2.weight\]"):
        extract_graph(MLP, m, np.zeros((3, 64)))
    bad = nn.Sequential(nn.Linear(64, 32), nn.LayerNorm(32), nn.Linear(32, 10))
    with pytest.raises(InvalidArgument, match="not supported"):
        extract_graph({"kind": "mlp", "input_dim": 64, "hidden": [32], "output_dim": 10}, bad, np.zeros((3, 64)))


def test_cnn_graph_keeps_every_position_when_asked():
    """``conv_features="positions"``: a conv channel's row is its whole map, probe-major, and its
    per-probe means are the default row; Linear rows and every weight are unchanged."""
    m = build_model(CNN, seed=0)
    probe = np.random.default_rng(0).random((5, 64))
    mean = extract_graph(CNN, m, probe)
    pos = extract_graph(CNN, m, probe, conv_features="positions")
    assert pos.hidden[0].activations.shape == (4, 5 * 8 * 8)
    assert pos.hidden[1].activations.shape == (8, 5 * 4 * 4)  # after the first 2x2 pool
    assert pos.hidden[2].activations.shape == (16, 5)
    x = torch.tensor(probe, dtype=torch.float32).reshape(5, 1, 8, 8)
    c1 = torch.relu(m[0](x)).double().detach()
    assert np.allclose(pos.hidden[0].activations[2], c1[:, 2].reshape(-1).numpy(), atol=1e-6)
    for hm, hp in zip(mean.hidden, pos.hidden, strict=True):
        n = hm.activations.shape[1]
        assert np.allclose(hp.activations.reshape(hp.size, n, -1).mean(axis=2), hm.activations, atol=1e-12)
        assert np.array_equal(hp.incoming, hm.incoming) and np.array_equal(hp.bias, hm.bias)
    with pytest.raises(InvalidArgument, match="conv_features"):
        extract_graph(CNN, m, probe, conv_features="grid")


def test_standardised_rows_make_the_distance_a_correlation():
    """``standardise=True``: each row has mean 0 and (population) std 1, so
    ‖a − b‖² = 2L(1 − ρ(a, b)) for rows of length L; a dead unit's constant row becomes 0."""
    m = build_model(CNN, seed=0)
    with torch.no_grad():
        m[0].weight[1] = 0.0
        m[0].bias[1] = -1.0  # channel 1 is dead: ReLU of a negative constant
    probe = np.random.default_rng(1).random((6, 64))
    raw = extract_graph(CNN, m, probe, conv_features="positions")
    z = extract_graph(CNN, m, probe, conv_features="positions", standardise=True)
    assert np.array_equal(z.hidden[0].activations[1], np.zeros(6 * 64))
    for hr, hz in zip(raw.hidden, z.hidden, strict=True):
        live = hr.activations.std(axis=1) > 0
        assert np.allclose(hz.activations[live].mean(axis=1), 0, atol=1e-12)
        assert np.allclose(hz.activations[live].std(axis=1), 1, atol=1e-12)
    a, b = raw.hidden[1].activations[0], raw.hidden[1].activations[3]
    za, zb = z.hidden[1].activations[0], z.hidden[1].activations[3]
    rho = np.corrcoef(a, b)[0, 1]
    assert np.sum((za - zb) ** 2) == pytest.approx(2 * len(a) * (1 - rho), rel=1e-9)


def test_the_matcher_takes_per_position_rows_and_recovers_a_permuted_copy():
    """Rows of different lengths per layer (conv: P·H·W, Linear: P) are accepted as long as the
    two graphs agree layer by layer; a permuted copy of a network is matched back exactly."""
    from peer.ldp.fusion import permute_arrays
    from peer.ldp.matching import match_graphs
    from peer.nn.architectures import model_from_arrays, state_arrays

    m = build_model(CNN, seed=2)
    perms = [np.random.default_rng(3 + i).permutation(n) for i, n in enumerate((4, 8, 16))]
    copy = model_from_arrays(CNN, permute_arrays(CNN, state_arrays(m), perms))
    probe = np.random.default_rng(0).random((20, 64))
    options = {"conv_features": "positions", "standardise": True}
    ga, gb = extract_graph(CNN, m, probe, **options), extract_graph(CNN, copy, probe, **options)
    res = match_graphs(ga, gb)
    for p, found in zip(perms, res.permutations, strict=True):
        assert np.array_equal(np.asarray(found), np.argsort(p))
    short = extract_graph(CNN, copy, probe[:10], **options)
    with pytest.raises(InvalidArgument, match=r"graph_b\.hidden\[0\]\.activations.*same probe set"):
        match_graphs(ga, short)
