import json
import math
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.base.errors import InvalidArgument
from peer.dp.accounting import ApproxDP, GaussianStep, TrainingRecord

steps_strategy = st.lists(
    st.tuples(
        st.sampled_from([0.05, 0.1]),
        st.sampled_from([0.5, 1.0]),
        st.sampled_from([0.0, 1.1, 2.0]),
        st.sampled_from([0.01, 1.0]),
        st.integers(1, 5),
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=60, deadline=None)
@given(steps_strategy, st.sampled_from(["replace-one", "add-remove"]))
def test_run_length_round_trip(runs, adjacency):
    steps = []
    for lr, clip, sigma, q, n in runs:
        steps += [GaussianStep(lr, clip, sigma, q)] * n
    record = TrainingRecord(adjacency, tuple(steps))
    data = json.loads(json.dumps(record.to_dict()))
    back = TrainingRecord.from_dict(data)
    assert back == record
    assert back.num_steps == len(steps)
    # Maximal runs: neighbouring entries always differ.
    entries = data["steps"]
    assert all(
        {k: v for k, v in a.items() if k != "count"} != {k: v for k, v in b.items() if k != "count"}
        for a, b in pairwise(entries)
    )
    assert sum(e["count"] for e in entries) == len(steps)


def test_constant_record_is_small_and_flags():
    record = TrainingRecord.constant("add-remove", 10_000, 0.1, 1.0, 1.1, 0.01)
    assert record.to_dict() == {
        "adjacency": "add-remove",
        "steps": [
            {"count": 10_000, "learning_rate": 0.1, "clip_norm": 1.0, "noise_multiplier": 1.1, "sample_rate": 0.01}
        ],
    }
    assert not record.full_batch and record.private and record.num_steps == 10_000
    assert TrainingRecord.constant("replace-one", 3, 0.1, 1.0, 0.0).private is False


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"learning_rate": 0}, "learning_rate"),
        ({"clip_norm": -1}, "clip_norm"),
        ({"noise_multiplier": -0.1}, "noise_multiplier"),
        ({"sample_rate": 0}, "sample_rate"),
        ({"sample_rate": 1.5}, "sample_rate"),
        ({"learning_rate": math.nan}, "learning_rate"),
        ({"clip_norm": "1"}, "clip_norm"),
        ({"noise_multiplier": True}, "noise_multiplier"),
    ],
)
def test_step_validation_names_the_field(kwargs, field):
    base = {"learning_rate": 0.1, "clip_norm": 1.0, "noise_multiplier": 1.0, "sample_rate": 1.0}
    with pytest.raises(InvalidArgument) as e:
        GaussianStep(**{**base, **kwargs})
    assert e.value.field == field


def test_record_validation():
    with pytest.raises(InvalidArgument, match="adjacency"):
        TrainingRecord("replace", (GaussianStep(0.1, 1, 1),))
    with pytest.raises(InvalidArgument, match="steps"):
        TrainingRecord("add-remove", ())
    with pytest.raises(InvalidArgument) as e:
        TrainingRecord.from_dict(
            {
                "adjacency": "add-remove",
                "steps": [
                    {"count": 2, "learning_rate": 0.1, "clip_norm": 1.0, "noise_multiplier": 1.0, "sample_rate": 1.0},
                    {"count": 1, "learning_rate": 0.1, "clip_norm": 0.0, "noise_multiplier": 1.0, "sample_rate": 1.0},
                ],
            }
        )
    assert e.value.field == "training.steps[1].clip_norm"
    with pytest.raises(InvalidArgument) as e:
        TrainingRecord.from_dict({"adjacency": "add-remove", "steps": [{"count": 2, "learning_rate": 0.1}]})
    assert e.value.field == "training.steps[0].clip_norm"
    with pytest.raises(InvalidArgument) as e:
        TrainingRecord.from_dict(
            {
                "adjacency": "add-remove",
                "steps": [
                    {"count": 0, "learning_rate": 0.1, "clip_norm": 1.0, "noise_multiplier": 1.0, "sample_rate": 1.0}
                ],
            }
        )
    assert e.value.field == "training.steps[0].count"


def test_approx_dp_adjacency_conversion():
    m = ApproxDP(0.5, 1e-6, "add-remove")
    r = m.under("replace-one")
    assert r.epsilon == 1.0 and r.delta == pytest.approx((1 + math.exp(0.5)) * 1e-6) and r.adjacency == "replace-one"
    assert m.under("add-remove") is m
    with pytest.raises(InvalidArgument, match="implies nothing for add-remove"):
        ApproxDP(1.0, 1e-6, "replace-one").under("add-remove")
    with pytest.raises(InvalidArgument, match="no guarantee"):
        ApproxDP(5.0, 0.01, "add-remove").under("replace-one")
    with pytest.raises(InvalidArgument, match="delta"):
        ApproxDP(1.0, 1.0, "add-remove")
