"""Predicting, from public parameters alone, when a weights release carries no signal
(peer.ldp.mechanisms.signal), checked against the release itself; and the round's refusal."""

from __future__ import annotations

import numpy as np

from peer.base.rng import make_randomness
from peer.ldp.mechanisms import perturb_model_weights
from peer.ldp.mechanisms.groups import _scale, perturb_group_weights
from peer.ldp.mechanisms.signal import (
    architecture_parts,
    filter_keeps_signal,
    parts_without_signal,
    signal_epsilon,
    structure_parts,
)
from peer.nn.architectures import build_model, weight_layers
from peer.nn.tracing import import_structure

MLP = {"kind": "mlp", "input_dim": 30, "hidden": [32], "output_dim": 2, "activation": "relu"}
DELTA = 1e-5


def _box_filling(arch) -> dict[str, np.ndarray]:
    """Weights whose spread is the largest the public bounds allow: every entry ±min(c, C/√k)."""
    rng = np.random.default_rng(0)
    parts = {p.name: p for p in architecture_parts(arch)}
    out = {}
    for s in weight_layers(arch):
        b = parts[f"{s.name}.weight"].spread_bound
        out[f"{s.name}.weight"] = (rng.choice([-1.0, 1.0], size=(s.units, s.fan_in)) * b).astype(np.float32)
        out[f"{s.name}.bias"] = (rng.choice([-1.0, 1.0], size=s.units) * b).astype(np.float32)
    return out


def test_filter_rule_is_the_smoothing_filters_threshold_at_the_expected_variance():
    # m = 3·sqrt(2/(N−1)); clears iff s²(1 − m) > m σ²
    assert filter_keeps_signal(10_001, 1.0, 0.5)  # m = 0.042: 0.24 > 0.042
    assert not filter_keeps_signal(10_001, 3.0, 0.5)  # 0.24 < 0.38
    assert not filter_keeps_signal(19, 1e-9, 1.0)  # m = 1: too few values at any noise


def test_prediction_matches_the_release_on_both_sides_of_the_threshold():
    parts = architecture_parts(MLP)
    need = signal_epsilon(parts, DELTA)
    assert need is not None and 50 < need < 500  # the 30-32-2 MLP: ≈127 per neuron
    arrays = _box_filling(MLP)
    for epsilon, constant in ((need / 3, True), (need * 3, False)):
        predicted = {p.name for p in parts_without_signal(parts, epsilon, DELTA)}
        assert bool(predicted) == constant
        out, _ = perturb_model_weights(MLP, arrays, epsilon=epsilon, delta=DELTA, randomness=make_randomness(1))
        for s in weight_layers(MLP):
            w = out[f"{s.name}.weight"]
            assert (np.ptp(w) == 0.0) == (f"{s.name}.weight" in predicted), (epsilon, s.name)


def test_more_epsilon_never_loses_signal_and_the_threshold_is_tight():
    parts = architecture_parts(MLP)
    need = signal_epsilon(parts, DELTA)
    assert not parts_without_signal(parts, need, DELTA)
    assert parts_without_signal(parts, need / 1.01, DELTA)
    for eps in (need, 2 * need, 10 * need):
        assert not parts_without_signal(parts, eps, DELTA)


def test_group_parts_predict_the_group_release():
    module = build_model(MLP, seed=0)
    structure = import_structure(module, (30,))
    parts = structure_parts(structure)
    assert {p.name for p in parts} == set(structure.parameters)
    need = signal_epsilon(parts, DELTA)
    assert need is not None
    state = {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}
    rng = np.random.default_rng(3)
    for p in parts:  # entries at the scaled box's largest spread, scaled back
        state[p.name] = (
            rng.choice([-1.0, 1.0], size=state[p.name].shape) * p.spread_bound * _scale(structure, p.name)
        ).astype(np.float32)
    for epsilon, constant in ((need / 3, True), (need * 3, False)):
        predicted = {p.name for p in parts_without_signal(parts, epsilon, DELTA)}
        assert bool(predicted) == constant
        out, _ = perturb_group_weights(structure, state, epsilon=epsilon, delta=DELTA, randomness=make_randomness(2))
        for name in (p.name for p in parts if p.weights):
            assert (np.ptp(out[name]) == 0.0) == (name in predicted), (epsilon, name)
