"""Tests of peer.nn.architectures' one listing of weight layers: ``weight_layers`` (from the
architecture alone) against the modules ``build_model`` actually builds, and ``weight_modules``
(the pairing graph extraction uses) against models that do not fit."""

import itertools
import math

import numpy as np
import pytest
from torch import nn

from peer.base.errors import InvalidArgument
from peer.nn.architectures import (
    architecture_structure,
    build_model,
    example_shape,
    hidden_sizes,
    state_arrays,
    weight_layers,
    weight_modules,
)

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


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: f"{a['kind']}-{len(a.get('channels', []))}-{len(a['hidden'])}")
def test_a_builtin_architecture_traces_into_the_chain_of_its_weight_layers(arch):
    """A built-in architecture is a factory traced like a site's own module
    (``architecture_structure``: peer.nn.tracing, proven by its self-check), and the groups the
    trace finds are exactly the layer listing's chain: group k is hidden weight layer k (named by
    its state-dict prefix, its units as size, itself as sole producer), acting on its weight rows,
    its bias and the next weight layer's input axis (in blocks of that layer's
    ``entries_per_input`` for a Linear: H·W after Flatten; a conv kernel's k·k entries lie on
    axes of their own); nothing else is permuted (the input axis of the first layer and the
    output layer's rows are fixed), and each hidden layer is its group's affine statistic point."""
    layers = weight_layers(arch)
    structure = architecture_structure(arch)
    expected = []
    for layer, nxt in itertools.pairwise(layers):
        axes = {
            (f"{layer.name}.weight", 0, 1),
            (f"{layer.name}.bias", 0, 1),
            (f"{nxt.name}.weight", 1, nxt.entries_per_input if nxt.kind == "linear" else 1),
        }
        expected.append((layer.name, layer.units, (layer.name,), axes))
    found = [(g.name, g.size, g.producers, {(a.param, a.axis, a.block) for a in g.axes}) for g in structure.groups]
    assert found == expected
    assert [(p.module, p.kind, p.group) for p in structure.stat_points] == [
        (layer.name, "affine", layer.name) for layer in layers[:-1]
    ]
    assert structure.parameters == {k: tuple(v.shape) for k, v in build_model(arch).state_dict().items()}
    assert structure.input_shape == example_shape(arch)
    assert structure.sizes == tuple(hidden_sizes(arch))


def test_the_traced_chain_permutes_a_builtin_model_as_the_layer_listing_does():
    """Permuting a built-in model's groups (peer.nn.tracing.permute_state) is the layer-wise
    permutation of peer.ldp.fusion.permute_arrays, entry for entry, CNN flatten blocks included."""
    from peer.ldp.fusion import permute_arrays
    from peer.nn.tracing import permute_state

    for arch in ARCHS:
        structure = architecture_structure(arch)
        arrays = state_arrays(build_model(arch, seed=1))
        rng = np.random.default_rng(2)
        perms = [rng.permutation(n) for n in hidden_sizes(arch)]
        by_layer = permute_arrays(arch, arrays, perms)
        by_group = permute_state(structure, arrays, {g.name: p for g, p in zip(structure.groups, perms, strict=True)})
        assert by_layer.keys() == by_group.keys()
        for k in by_layer:
            assert np.array_equal(by_layer[k], by_group[k]), k
