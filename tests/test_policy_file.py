"""The policy is read by the one TOML reader (peer.base.config): its errors name the file, the
line and the key, also for keys the reader alone knows how to find (dotted keys in a table body),
and its ε/δ rules are the common ones (peer.base.checks). The key/line cases of the example
policy are in test_ledger.py."""

from __future__ import annotations

import pytest

from peer.base.config import ConfigError
from peer.budget.filter import FilterBudget
from peer.budget.policy import Policy, PolicyError

TEXT = """\
[site]
name = "a"

[policy]
show_remaining = "own"
model.total = { epsilon = 4.0, delta = 1e-6 }

[policy.caps]
features = 2.0
"""


def test_a_good_file_with_dotted_keys_parses(tmp_path):
    path = tmp_path / "site.toml"
    path.write_text(TEXT)
    p = Policy.from_toml(path)
    assert p.model.total == FilterBudget(4.0, 1e-6) and p.caps == {"features": 2.0}


@pytest.mark.parametrize(
    "change,key,line,rule",
    [
        (("epsilon = 4.0", "epsilon = -4.0"), "policy.model.total.epsilon", 6, "must be a finite number > 0"),
        (("delta = 1e-6", "delta = 1"), "policy.model.total.delta", 6, "must be a number in [0, 1)"),
        (("features = 2.0", "features = 0"), "policy.caps.features", 9, "must be a finite number > 0"),
        (("features = 2.0", "features = true"), "policy.caps.features", 9, "got True"),
        (('show_remaining = "own"', "show_remaining = 3"), "policy.show_remaining", 5, "non-empty string"),
    ],
)
def test_errors_name_file_line_and_key(tmp_path, change, key, line, rule):
    path = tmp_path / "site.toml"
    text = TEXT.replace(*change)
    assert text != TEXT
    path.write_text(text)
    with pytest.raises(PolicyError) as e:
        Policy.from_toml(path)
    assert isinstance(e.value, ConfigError)
    assert (e.value.key, e.value.line, e.value.source) == (key, line, str(path))
    assert str(e.value).startswith(f"{key} ({path}, line {line}): ") and rule in str(e.value), str(e.value)


def test_a_mapping_has_no_file_or_line():
    with pytest.raises(PolicyError) as e:
        Policy.from_mapping({"caps": {"merge": -1.0}})
    assert (e.value.key, e.value.line) == ("policy.caps.merge", None)
    assert str(e.value) == "policy.caps.merge: must be a finite number > 0, got -1.0"
    with pytest.raises(PolicyError, match=r"^policy: must be a table"):
        Policy.from_mapping([1, 2])  # type: ignore[arg-type]


def test_an_unreadable_file_is_named(tmp_path):
    with pytest.raises(PolicyError, match="cannot read the policy file"):
        Policy.from_toml(tmp_path / "missing.toml")
