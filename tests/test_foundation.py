import dataclasses
import math

import numpy as np
import pytest
import torch

from peer.base.errors import InvalidArgument
from peer.base.records import ReleaseRecord
from peer.base.rng import make_randomness
from peer.nn.architectures import build_model, model_from_arrays, state_arrays, validate_architecture
from peer.nn.data import load_dataset, split_dirichlet, split_homogeneous, split_label_skew

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


def test_record_round_trips_and_is_immutable():
    r = ReleaseRecord(
        mechanism="laplace",
        level="model",
        unit="neuron",
        epsilon=1.0,
        delta=0.0,
        sensitivity=2.0,
        sensitivity_norm="l1",
        parameters={"clip": [0, 1]},
        randomness="fixed-seed",
        seed=3,
    )
    back = ReleaseRecord.from_json(r.canonical_json())
    assert back == r and back.canonical_json() == r.canonical_json()
    with pytest.raises(TypeError):
        r.parameters["clip"] = 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.epsilon = 2.0


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("unit", {"unit": "person"}),
        ("delta", {"delta": 1.5}),
        ("seed", {"randomness": "fixed-seed", "seed": None}),
        ("parameters", {"parameters": {"x": math.nan}}),
    ],
)
def test_record_rejects_bad_fields_by_name(field, kwargs):
    base = dict(
        mechanism="laplace",
        level="model",
        unit="neuron",
        epsilon=1.0,
        delta=0.0,
        sensitivity=1.0,
        sensitivity_norm="l1",
    )
    base.update(kwargs)
    with pytest.raises(InvalidArgument, match=field):
        ReleaseRecord(**base)


def test_randomness_is_csprng_unless_seeded():
    r = make_randomness()
    assert r.source == "csprng" and r.seed is None
    a, b = make_randomness(5), make_randomness(5)
    assert a.record_fields() == {"randomness": "fixed-seed", "seed": 5}
    assert a.generator.random() == b.generator.random()
    with pytest.raises(InvalidArgument, match="seed"):
        make_randomness(-1)


@pytest.mark.parametrize("arch,shape", [(MLP, (5, 64)), (CNN, (5, 1, 8, 8))])
def test_models_build_and_round_trip(arch, shape):
    m = build_model(arch, seed=0)
    x = torch.randn(*shape)
    m2 = model_from_arrays(arch, state_arrays(m))
    assert torch.allclose(m(x), m2(x))
    assert torch.equal(build_model(arch, seed=1)[0].weight, build_model(arch, seed=1)[0].weight)


def test_model_rejects_bad_weights_and_architectures():
    arrays = state_arrays(build_model(MLP, seed=0))
    arrays["0.weight"] = arrays["0.weight"][:, :3]
    with pytest.raises(InvalidArgument, match=r"weights\[0.weight\]"):
        model_from_arrays(MLP, arrays)
    arrays = state_arrays(build_model(MLP, seed=0))
    arrays["2.bias"][0] = np.nan
    with pytest.raises(InvalidArgument, match="NaN"):
        model_from_arrays(MLP, arrays)
    with pytest.raises(InvalidArgument, match=r"architecture\.kind"):
        validate_architecture({"kind": "transformer"})
    with pytest.raises(InvalidArgument, match=r"architecture.pool\[1\]"):
        validate_architecture({**CNN, "pool": [2, 3]})


def test_splits_partition_the_data():
    ds = load_dataset("digits")
    n = len(ds.y_train)
    for parts in (
        split_homogeneous(ds.y_train, 4, seed=0),
        split_label_skew(ds.y_train, seed=0),
        split_dirichlet(ds.y_train, 4, concentration=0.5, seed=0),
    ):
        allidx = np.concatenate(parts)
        assert len(allidx) == n and len(np.unique(allidx)) == n
    a, b = split_label_skew(ds.y_train, seed=0)
    assert np.mean(ds.y_train[a] < 5) > 0.7 and np.mean(ds.y_train[b] >= 5) > 0.7
    bc = load_dataset("breast_cancer")
    assert abs(bc.x_train.mean()) < 1e-4 and bc.num_classes == 2
