"""A per-entry features release through a real daemon is charged per neuron: everything released
about one neuron (its activation row and its weight vector) composes sequentially; only other
neurons (other layers) compose in parallel."""

import numpy as np
import pytest
from peer_harness import client, make_site, model_arrays, pin_each_other, running

from peer.budget.ledger import Ledger
from peer.net.client import PeerError

ARCH31 = {"kind": "mlp", "input_dim": 31, "hidden": [32, 32], "output_dim": 10, "activation": "relu"}

PURE_3 = """
[policy]
show_remaining = "own"

[policy.model]
total = { epsilon = 3.0, delta = 0.0 }

[policy.peers."*"]
allow = ["features", "ledger"]
"""


def test_per_entry_features_over_the_wire_are_charged_per_neuron_sequentially(tmp_path):
    # 60 probes, 31 inputs, ε_x = 0.01, ε_w = 0.02. A neuron of the second hidden layer: its
    # activation row costs 60·0.01 = 0.6, its weight vector (32 inputs + bias) 33·0.02 = 0.66;
    # together 1.26 (≥ 0.6 + 31·0.02 = 1.22, the least any hidden neuron releases). The max of
    # the two parts — what the ledger used to charge — was 0.66.
    a = make_site(tmp_path, "site-a", models={"mlp": (ARCH31, model_arrays(ARCH31))}, policy=PURE_3)
    b = make_site(tmp_path, "site-b", models={})
    pin_each_other(a, b)
    probe = np.random.default_rng(3).random((60, 31))
    charged = []
    with running(a) as (_, address), client(b, address) as c:
        for _ in range(2):
            got = c.features("mlp", probe, activation_epsilon=0.01, weight_epsilon=0.02, unit="entry")
            assert got.receipt.record.unit == "entry" and got.receipt.record.epsilon == pytest.approx(0.02)
            with Ledger(a.ledger) as led:
                charged.append(led.entries()[-1])
        # 1.26 + 1.26 = 2.52 fits the pure per-neuron budget of 3.0; a third does not (at the old
        # 0.66 per request four would have)
        with pytest.raises(PeerError) as e:
            c.features("mlp", probe, activation_epsilon=0.01, weight_epsilon=0.02, unit="entry")
        assert e.value.status == "RESOURCE_EXHAUSTED" and "model/mlp/total" in str(e.value)
    for entry in charged:
        assert entry.unit == "neuron" and entry.epsilon >= 1.22
        assert entry.epsilon == pytest.approx(0.6 + 33 * 0.02)
    with Ledger(a.ledger) as led:
        assert len(led.entries()) == 2
        [state] = led.budget_states()
    assert state.spent_epsilon == pytest.approx(2 * 1.26)
