"""Tests of peer.nn.architectures' one listing of weight layers: ``weight_layers`` (from the
architecture alone) against the modules ``build_model`` actually builds, and ``weight_modules``
(the pairing graph extraction uses) against models that do not fit."""

import math

import numpy as np
import pytest
from torch import nn

from peer.base.errors import InvalidArgument
from peer.nn.architectures import build_model, hidden_sizes, weight_layers, weight_modules

ARCHS = [
    {"kind": "mlp", "input_dim": 12, "hidden": [6, 7, 5], "output_dim": 4},
    {"kind": "mlp", "input_dim": 3, "hidden": [], "output_dim": 2},
    {
        "kind": "cnn",
        "input_shape": [1, 8, 8],
        "channels": [3, 4],
        "kernel_size": 3,
        "pool": [2, 2],
        "hidden": [5],
        "output_dim": 4,
    },
    {
        "kind": "cnn",
        "input_shape": [2, 8, 6],
        "channels": [3, 4, 2],
        "kernel_size": 5,
        "pool": [2, 1, 1],
        "hidden": [],
        "output_dim": 4,
    },
    {
        "kind": "cnn",
        "input_shape": [3, 4, 4],
        "channels": [3],
        "kernel_size": 1,
        "hidden": [7, 3],
        "output_dim": 4,
        "activation": "tanh",
    },
]


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: f"{a['kind']}-{len(a.get('channels', []))}-{len(a['hidden'])}")
def test_weight_layers_describe_the_built_model(arch):
    layers = weight_layers(arch)
    built = [(name, m) for name, m in build_model(arch).named_children() if isinstance(m, (nn.Linear, nn.Conv2d))]
    assert [layer.name for layer in layers] == [name for name, _ in built]
    for layer, (_, mod) in zip(layers, built, strict=True):
        assert layer.kind == ("conv" if isinstance(mod, nn.Conv2d) else "linear")
        assert layer.weight_shape == tuple(mod.weight.shape)
        assert layer.fan_in == math.prod(mod.weight.shape[1:])
        assert layer.units == mod.weight.shape[0]
    assert [layer.is_output for layer in layers] == [False] * (len(layers) - 1) + [True]
    # every layer's inputs are the previous layer's units (the first: input features/channels)
    first = arch["input_shape"][0] if arch["kind"] == "cnn" else arch["input_dim"]
    assert [layer.inputs for layer in layers] == [first] + [layer.units for layer in layers[:-1]]
    assert hidden_sizes(arch) == arch.get("channels", []) + arch["hidden"]


def test_flatten_columns_belong_to_their_channel():
    arch = ARCHS[2]  # 4 channels of 2x2 after two 2x2 poolings, then Linear(16, 5)
    conv1, conv2, first_linear, out = weight_layers(arch)
    assert (conv1.entries_per_input, conv2.entries_per_input) == (9, 9)
    assert (first_linear.inputs, first_linear.entries_per_input) == (4, 4)
    assert (out.inputs, out.entries_per_input) == (5, 1)
    # with no hidden Linear the output layer is the one after Flatten
    assert weight_layers(ARCHS[3])[-1].entries_per_input == 4 * 3  # 8x6 pooled once by 2


def test_weight_modules_pairs_layers_with_modules_and_refuses_misfits():
    arch = ARCHS[0]
    model = build_model(arch, seed=0)
    pairs = weight_modules(arch, model)
    assert [(layer.name, m) for layer, m in pairs] == [
        (n, m) for n, m in model.named_children() if isinstance(m, nn.Linear)
    ]
    wider = nn.Sequential(
        nn.Linear(12, 6), nn.ReLU(), nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5), nn.ReLU(), nn.Linear(5, 4)
    )
    with pytest.raises(InvalidArgument, match=r"model\[2\]"):
        weight_modules(arch, wider)
    shorter = nn.Sequential(nn.Linear(12, 6), nn.ReLU(), nn.Linear(6, 4))
    with pytest.raises(InvalidArgument, match="has 2 weight layers, the architecture describes 4"):
        weight_modules(arch, shorter)
    with pytest.raises(InvalidArgument, match=r"architecture\.hidden"):
        weight_layers({**arch, "hidden": [6, -1]})


def test_build_model_is_deterministic_given_a_seed():
    a, b = build_model(ARCHS[2], seed=3), build_model(ARCHS[2], seed=3)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb and np.array_equal(va.numpy(), vb.numpy())
