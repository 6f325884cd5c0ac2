"""peer.base.checks: the one rule for ε and δ, with the ranges its callers widen or narrow."""

from __future__ import annotations

import math

import numpy as np
import pytest

from peer.base.checks import check_delta, check_epsilon
from peer.base.errors import InvalidArgument


@pytest.mark.parametrize(
    "value,kw,expected",
    [
        (1, {}, 1.0),
        (np.float64(0.5), {}, 0.5),
        (np.int64(3), {}, 3.0),
        (0.0, {"zero": True}, 0.0),
        (math.inf, {"infinite": True}, math.inf),
        (1000.0, {"maximum": 1000.0}, 1000.0),
    ],
)
def test_epsilon_accepts(value, kw, expected):
    out = check_epsilon(value, **kw)
    assert out == expected and type(out) is float


@pytest.mark.parametrize(
    "value,kw,rule",
    [
        (0.0, {}, "must be a finite number > 0, got 0.0"),
        (-1e-9, {"zero": True}, "must be a finite number >= 0, got -1e-09"),
        (math.inf, {}, "must be a finite number > 0, got inf"),
        (math.nan, {"infinite": True}, "must be a number (or inf) > 0, got nan"),
        (1000.5, {"maximum": 1000.0}, "must be a finite number > 0 and <= 1000, got 1000.5"),
        (True, {}, "must be a finite number > 0, got True"),
        ("1.0", {}, "must be a finite number > 0, got '1.0'"),
        (None, {}, "must be a finite number > 0, got None"),
    ],
)
def test_epsilon_refuses_naming_field_and_rule(value, kw, rule):
    with pytest.raises(InvalidArgument) as e:
        check_epsilon(value, "weights_epsilon", **kw)
    assert (e.value.field, e.value.rule) == ("weights_epsilon", rule)


@pytest.mark.parametrize(
    "value,kw,expected",
    [
        (1e-5, {}, 1e-5),
        (0, {"zero": True}, 0.0),
        (0.1, {"maximum": 0.1}, 0.1),
        (np.float32(0.25), {}, 0.25),
    ],
)
def test_delta_accepts(value, kw, expected):
    out = check_delta(value, **kw)
    assert out == expected and type(out) is float


@pytest.mark.parametrize(
    "value,kw,rule",
    [
        (0.0, {}, "must be a number in (0, 1), got 0.0"),
        (1.0, {"zero": True}, "must be a number in [0, 1), got 1.0"),
        (0.2, {"maximum": 0.1}, "must be a number in (0, 0.1], got 0.2"),
        (math.nan, {}, "must be a number in (0, 1), got nan"),
        (False, {"zero": True}, "must be a number in [0, 1), got False"),
        ("1e-5", {}, "must be a number in (0, 1), got '1e-5'"),
    ],
)
def test_delta_refuses_naming_field_and_rule(value, kw, rule):
    with pytest.raises(InvalidArgument) as e:
        check_delta(value, "delta", **kw)
    assert (e.value.field, e.value.rule) == ("delta", rule)


def test_delta_maximum_must_be_a_probability_below_one():
    with pytest.raises(ValueError):
        check_delta(0.5, maximum=1.0)
