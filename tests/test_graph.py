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
