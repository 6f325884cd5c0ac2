"""A site's own training loop for ``iterate`` (``[round.iterate] train = "MODULE:FUNCTION"``,
peer.dp.own_loop): the site's code, written here to the site's folder as a user would, runs
around our DP step object; its segments are charged exactly like the built-in loop's, and every
way of leaving the plan is refused before anything is charged.

Each run is one site alone (its roster lists only itself), with a real ledger, release store and
model store, and a fixed site seed (``simulation``) so that two sites given the same seed draw
the same noise and batches."""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from peer_harness import make_site, model_arrays

from coordinator_free.iterate import load_iterate_config, run_iterate
from coordinator_free.roster import write_roster
from peer.base.config import ConfigError
from peer.base.errors import InvalidArgument
from peer.base.rng import make_randomness
from peer.budget.ledger import Ledger
from peer.dp.accounting import TrainingRecord
from peer.dp.own_loop import run_own_loop
from peer.dp.training import classifier_loss, run_dpsgd
from peer.net.releases import ReleaseStore, segment_key
from peer.nn.architectures import build_model

ARCH = {"kind": "mlp", "input_dim": 6, "hidden": [5], "output_dim": 3, "activation": "relu"}
FIELD = "round.iterate.train"
ROUNDS, LOCAL_STEPS = 2, 3

POLICY = """
[policy]
show_remaining = "own"

[policy.data]
unit = "record:add-remove"
epsilon = 8.0
delta = 1e-5

[policy.peers."*"]
allow = ["segment", "ledger"]
"""

#: The site's own loop as a user would write it: random-noise augmentation of each record,
#: cross-entropy with label smoothing, a decaying learning rate; it logs what it was handed.
OWN_LOOP = """
import torch

SEEN = {"inputs": [], "outputs": [], "records": []}


def jitter(x):
    SEEN["inputs"].append(tuple(x.shape))
    return x + 0.05 * torch.randn_like(x)


def smoothed(outputs, labels):
    SEEN["outputs"].append(tuple(outputs.shape))
    return torch.nn.functional.cross_entropy(outputs, labels, label_smoothing=0.1)


def train(model, records, step):
    SEEN["records"].append(len(records))
    for t in range(step.steps):
        step(jitter, smoothed, 0.5 / (1 + t))


def plain(model, records, step):
    for _ in range(step.steps):
        step()


def one_short(model, records, step):
    for _ in range(step.steps - 1):
        step()


def one_more(model, records, step):
    for _ in range(step.steps + 1):
        step()


def one_more_swallowed(model, records, step):
    for _ in range(step.steps):
        step()
    try:
        step()
    except Exception:
        pass


def own_optimiser(model, records, step):
    for _ in range(step.steps):
        step()
    # an ordinary (non-private) step of the site's own on its records, outside the DP step
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.nn.functional.cross_entropy(model(records.x), records.y).backward()
    opt.step()


NOT_A_FUNCTION = 3
"""


def records(path, n: int = 30, seed: int = 1) -> None:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    x = rng.normal(size=(n, 6)).astype(np.float32) + y[:, None].astype(np.float32)
    np.savez(path, x=x, y=y)


#: the decaying learning rate OWN_LOOP's train takes, declared in its round file
SCHEDULE = [0.5 / (1 + t) for t in range(LOCAL_STEPS)]


def site_with_round(
    tmp_path,
    where: str,
    *,
    train: str | None = None,
    module: str = "",
    sample_rate: float = 0.5,
    schedule: list[float] | None = None,
):
    """A site alone in ``tmp_path/where`` (fixed seed 7), its records, the user's module
    ``MODULE.py`` in its folder when ``module`` is given, and a round file whose
    ``[round.iterate]`` names ``train``."""
    site = make_site(tmp_path / where, "site-a", models={"mlp": (ARCH, model_arrays(ARCH))}, policy=POLICY, seed=7)
    if module:
        (site.root / f"{module}.py").write_text(textwrap.dedent(OWN_LOOP))
    roster = write_roster(site.root / "roster.toml", [("site-a", "127.0.0.1:1", str(site.identity_dir / "site.crt"))])
    records(site.root / "records.npz")
    train_line = "" if train is None else f'train = "{train}"'
    if schedule is not None:
        train_line += f"\nlearning_rate_schedule = [{', '.join(map(repr, schedule))}]"
    path = site.root / "iterate.toml"
    path.write_text(
        f"""
[round]
roster = "{roster}"
model = "mlp"
method = "iterate"
out = "rounds"

[round.iterate]
records = "records.npz"
run = "own"
rounds = {ROUNDS}
local_steps = {LOCAL_STEPS}
learning_rate = 0.5
clip_norm = 1.0
sample_rate = {sample_rate!r}
epsilon = 4.0
delta = 1e-5
declared_records = 25
init_seed = 5
wait_s = 0.0
{train_line}
"""
    )
    return site, path


def ledger_entries(site) -> list:
    with Ledger(site.ledger) as led:
        return led.entries(include_cancelled=True)


def segment_tensors(site, r: int) -> dict[str, np.ndarray] | None:
    stored = ReleaseStore(site.root / "ledger.releases").get(segment_key("own", r))
    return None if stored is None else {k: np.asarray(a) for k, a in stored.tensors}


def user_module(site, name: str):
    """The user's module as the run imported it (the site's folder on the path)."""
    sys.path.insert(0, str(site.root))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(site.root))


def refused_with_nothing_charged(site, path, rule_part: str) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as e:
        run_iterate(site.config, load_iterate_config(path), simulation=True)
    assert e.value.field == FIELD, e.value
    assert rule_part in e.value.rule, e.value.rule
    assert not site.ledger.exists() or ledger_entries(site) == []  # no ledger yet: nothing charged either
    assert segment_tensors(site, 1) is None
    return e.value


def test_own_loop_with_augmentation_and_label_smoothing_is_charged_like_the_built_in_loop(tmp_path):
    """Two copies of one site with the same seed: one runs the built-in loop, one the site's own
    (augmentation, label smoothing, a decaying learning rate; Poisson batches at q = 0.5). Their
    ledgers hold the same charges — the same mechanism, level, unit, ε, δ and RDP curve, every
    step with the same (σ, C, q) and count — and the own loop's record lists the site's learning
    rates; the released parameters are the own loop's (they differ from the built-in loop's)."""
    builtin, builtin_path = site_with_round(tmp_path, "builtin")
    own, own_path = site_with_round(
        tmp_path, "own", train="clinic_loop_a:train", module="clinic_loop_a", schedule=SCHEDULE
    )
    a = run_iterate(builtin.config, load_iterate_config(builtin_path), simulation=True)
    b = run_iterate(own.config, load_iterate_config(own_path), simulation=True)
    assert a.status == b.status == "finished" and a.rounds_done == b.rounds_done == ROUNDS
    ea, eb = ledger_entries(builtin), ledger_entries(own)
    assert len(ea) == len(eb) == ROUNDS
    schedule = SCHEDULE
    for x, y in zip(ea, eb, strict=True):
        assert (x.mechanism, x.level, x.unit, x.counterparty, x.subject) == (
            y.mechanism,
            y.level,
            y.unit,
            y.counterparty,
            y.subject,
        )
        assert x.epsilon == y.epsilon and x.delta == y.delta
        assert x.rdp == y.rdp  # the same accountant call: the same curve, float for float
        ta = TrainingRecord.from_dict(x.record.parameters["training"])
        tb = TrainingRecord.from_dict(y.record.parameters["training"])
        assert [(s.noise_multiplier, s.clip_norm, s.sample_rate) for s in ta.steps] == [
            (s.noise_multiplier, s.clip_norm, s.sample_rate) for s in tb.steps
        ]
        assert tb.num_steps == ta.num_steps == LOCAL_STEPS
        assert [s.learning_rate for s in ta.steps] == [0.5] * LOCAL_STEPS
        assert [s.learning_rate for s in tb.steps] == pytest.approx(schedule, rel=1e-15)
        assert "loop" in y.record.parameters and "loop" not in x.record.parameters
        assert y.record.parameters["dataset_size"] == x.record.parameters["dataset_size"] == 25
    with Ledger(builtin.ledger) as la, Ledger(own.ledger) as lb:
        spent = [next(s.spent_epsilon for s in led.budget_states() if s.key.level == "data") for led in (la, lb)]
    assert spent[0] == spent[1] > 0
    assert a.report["epsilon_pld"] == b.report["epsilon_pld"]
    # the site's code ran: once per segment, on its records, with per-record inputs and outputs
    seen = user_module(own, "clinic_loop_a").SEEN
    assert seen["records"] == [30] * ROUNDS
    assert set(seen["inputs"]) == {(6,)} and set(seen["outputs"]) == {(1, 3)}
    # and its segment, not the built-in loop's, was released (the same seed: the same noise and
    # batches, so only the site's choices make them differ)
    assert not np.array_equal(segment_tensors(own, 1)["0.weight"], segment_tensors(builtin, 1)["0.weight"])


def test_identity_transform_and_cross_entropy_reproduce_the_built_in_segments_bit_for_bit(tmp_path):
    """With nothing of its own (identity transform, cross-entropy, the config's learning rate)
    the own loop releases exactly the built-in loop's bytes from the same seed: the same noise
    and Poisson batches, from the same generator, through the same clipping and noise code."""
    builtin, builtin_path = site_with_round(tmp_path, "builtin")
    own, own_path = site_with_round(tmp_path, "own", train="clinic_loop_b:plain", module="clinic_loop_b")
    run_iterate(builtin.config, load_iterate_config(builtin_path), simulation=True)
    run_iterate(own.config, load_iterate_config(own_path), simulation=True)
    for r in range(1, ROUNDS + 1):
        ta, tb = segment_tensors(builtin, r), segment_tensors(own, r)
        assert set(ta) == set(tb)
        for k in ta:
            assert np.array_equal(ta[k], tb[k]), (r, k)
    assert [e.rdp for e in ledger_entries(builtin)] == [e.rdp for e in ledger_entries(own)]


def test_the_core_own_loop_equals_run_dpsgd_full_batch_and_poisson():
    """peer.dp.own_loop against peer.dp.training.run_dpsgd directly, full batch and Poisson, with
    an optimiser-free plan: equal parameters from equal generators, and the record of the steps
    taken equals the plan when the site keeps the plan's learning rate."""
    rng = np.random.default_rng(0)
    x = torch.tensor(rng.normal(size=(40, 6)), dtype=torch.float32)
    y = torch.tensor(rng.integers(0, 3, 40))
    for q in (1.0, 0.3):
        model = build_model(ARCH, seed=3)
        plan = TrainingRecord.constant("add-remove", 4, 0.5, 1.0, 1.1, q)
        params0 = {k: v.detach() for k, v in model.named_parameters()}
        ref = run_dpsgd(
            classifier_loss(model), params0, x, y, plan.steps, randomness=make_randomness(9), dataset_size=50
        )

        def train(m, recs, step):
            for _ in range(step.steps):
                step()

        got = run_own_loop(train, model, x, y, plan, randomness=make_randomness(9), dataset_size=50)
        assert got.training == plan
        for k in ref.params:
            assert torch.equal(ref.params[k], got.params[k]), (q, k)
            assert torch.equal(dict(model.named_parameters())[k].detach(), got.params[k])  # the module follows


@pytest.mark.parametrize(
    ("function", "rule_part"),
    [
        ("one_short", f"took {LOCAL_STEPS - 1} DP steps; the segment has exactly {LOCAL_STEPS}"),
        ("one_more", f"called for step {LOCAL_STEPS + 1}, but the segment has exactly {LOCAL_STEPS}"),
        ("one_more_swallowed", "the training function went on after it"),
    ],
)
def test_a_wrong_number_of_steps_is_refused_with_nothing_charged(tmp_path, function, rule_part):
    """Fewer steps are refused when the function returns; the extra step is refused by the step
    object itself, and stays refused when the site's code swallows the error."""
    module = f"clinic_loop_{function}"
    site, path = site_with_round(tmp_path, "s", train=f"{module}:{function}", module=module)
    refused_with_nothing_charged(site, path, rule_part)


def test_parameters_changed_outside_the_step_are_refused_with_nothing_charged(tmp_path):
    """The site's function takes its DP steps, then one ordinary SGD step of its own on its
    records: those parameters would leave without noise, so the segment is refused (the module is
    compared with the step object's own copy) before its record is built or charged."""
    site, path = site_with_round(tmp_path, "s", train="clinic_loop_c:own_optimiser", module="clinic_loop_c")
    error = refused_with_nothing_charged(site, path, "changed the module's parameters")
    assert "outside step()" in error.rule


@pytest.mark.parametrize(
    ("train", "rule_part"),
    [
        ("clinic_loop_absent_xyz:train", "cannot import 'clinic_loop_absent_xyz'"),
        ("clinic_loop_d:no_such_function", "has no callable 'no_such_function'"),
        ("clinic_loop_d:NOT_A_FUNCTION", "has no callable 'NOT_A_FUNCTION'"),
        ("missing_file.py:train", "does not exist"),
    ],
)
def test_an_unloadable_function_is_refused_naming_the_field_before_any_charge(tmp_path, train, rule_part):
    site, path = site_with_round(tmp_path, "s", train=train, module="clinic_loop_d")
    refused_with_nothing_charged(site, path, rule_part)
    assert not site.ledger.exists()  # refused when the run opens, before its ledger is even opened


def test_a_file_path_function_loads_relative_to_the_round_file(tmp_path):
    """``FILE.py:FUNCTION`` is read from the round file's folder (made absolute when the config
    is read, so the run finds it from any working directory)."""
    site, path = site_with_round(tmp_path, "s", train="loops/clinic.py:plain")
    (site.root / "loops").mkdir()
    (site.root / "loops" / "clinic.py").write_text(textwrap.dedent(OWN_LOOP))
    cfg = load_iterate_config(path)
    assert cfg.train == f"{(site.root / 'loops' / 'clinic.py').resolve()}:plain"
    assert run_iterate(site.config, cfg, simulation=True).status == "finished"
    assert len(ledger_entries(site)) == ROUNDS


@pytest.mark.parametrize(
    ("line", "rule_part"),
    [
        ('train = "no_colon"', "must be MODULE:FUNCTION or FILE.py:FUNCTION"),
        ('train = "a:b:c"', "must be MODULE:FUNCTION or FILE.py:FUNCTION"),
        ('train = "m:f"\nsecure = true\ncoalition = 0', "takes no own loop with secure = true"),
        ("learning_rate_schedule = [0.5, 0.25]", "must be an array of 3 numbers"),
        ("learning_rate_schedule = [0.5, 0.25, -1.0]", "must be > 0"),
        ("learning_rate_schedule = [0.5, 0.25, 0.1]\nsecure = true\ncoalition = 0", "takes no schedule"),
    ],
)
def test_a_bad_train_entry_is_refused_when_the_config_is_read(tmp_path, line, rule_part):
    _, path = site_with_round(tmp_path, "s")
    path.write_text(path.read_text() + line + "\n")
    with pytest.raises(ConfigError) as e:
        load_iterate_config(path)
    key = "round.iterate." + line.split("=")[0].strip()  # the first line's key is the one at fault
    assert str(e.value.key).startswith(key) and rule_part in e.value.rule, (e.value.key, e.value.rule)


def test_an_undeclared_learning_rate_is_refused_with_nothing_charged(tmp_path):
    """The site's loop takes a decaying η the round file does not declare: the first step that
    differs from the plan is refused (a rate the site's code chose could depend on its records),
    before anything is charged or released."""
    site, path = site_with_round(tmp_path, "s", train="clinic_loop_e:train", module="clinic_loop_e")
    refused_with_nothing_charged(site, path, "step 2: learning_rate 0.25 is not the declared 0.5")


def test_the_documented_own_loop_runs_as_written(tmp_path):
    """docs/deployment.md's example module, taken from the page, is a working own loop."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "deployment.md").read_text()
    section = page[page.index("**Your own training loop**") :]
    code = section[
        section.index("```python\n") + len("```python\n") : section.index("\n```", section.index("```python"))
    ]
    site, path = site_with_round(tmp_path, "s", train="site_training:train", schedule=SCHEDULE)
    (site.root / "site_training.py").write_text(code + "\n")
    assert run_iterate(site.config, load_iterate_config(path), simulation=True).status == "finished"
    entries = ledger_entries(site)
    assert len(entries) == ROUNDS
    steps = TrainingRecord.from_dict(entries[0].record.parameters["training"]).steps
    assert [s.learning_rate for s in steps] == pytest.approx([0.5 / (1 + t) for t in range(LOCAL_STEPS)], rel=1e-15)


@pytest.mark.parametrize(
    ("call", "rule_part"),
    [
        (lambda step: step(learning_rate=-0.1), "step 1: learning_rate -0.1 is not the declared 0.5"),
        (lambda step: step(learning_rate=float("nan")), "step 1: learning_rate nan is not the declared 0.5"),
        (lambda step: step(learning_rate=0.25), "η shapes what is released"),
        (lambda step: step(transform=lambda x: x[:3]), "must return one record's input as a tensor of shape (6,)"),
        (lambda step: step(transform=lambda x: x.numpy()), "got ndarray"),
        (lambda step: step(loss=lambda out, lab: out.sum(dim=0)), "must return one number"),
        (lambda step: step(transform=lambda x: 1 / 0), "the transform raised ZeroDivisionError"),
        (lambda step: [][1], "raised IndexError"),
    ],
)
def test_the_step_object_refuses_what_breaks_its_rules_naming_the_field(call, rule_part):
    """In the core (peer.dp.own_loop): a bad learning rate, an augmentation that is not per
    record, a loss that is not one number per record, and the site's code failing are each
    refused with the field named and nothing returned to release."""
    rng = np.random.default_rng(1)
    x = torch.tensor(rng.normal(size=(12, 6)), dtype=torch.float32)
    y = torch.tensor(rng.integers(0, 3, 12))
    plan = TrainingRecord.constant("add-remove", 2, 0.5, 1.0, 1.1, 1.0)

    def train(model, recs, step):
        call(step)
        step()

    with pytest.raises(InvalidArgument) as e:
        run_own_loop(
            train, build_model(ARCH, seed=3), x, y, plan, randomness=make_randomness(2), dataset_size=12, field=FIELD
        )
    assert e.value.field == FIELD and rule_part in e.value.rule, e.value.rule
