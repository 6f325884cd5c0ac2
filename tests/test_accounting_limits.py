"""The accountant refuses, at once and by name, a DP-SGD record too weak to cost: the PLD of a
near-noiseless Gaussian step spans thousands of nats, and building and composing it on the
default grid took minutes and gigabytes (σ = 0.01 at q = 0.05 did not finish 100 steps in ten
minutes; the numerical RDP integral of the same step neither)."""

from __future__ import annotations

import numpy as np
import pytest

from peer.base.errors import InvalidArgument
from peer.base.rng import make_randomness
from peer.dp.accounting import TrainingRecord, privacy_profile
from peer.dp.accounting import pld as pldm
from peer.dp.accounting.profiles import DEFAULT_INTERVAL, check_accountable, model_rdp
from peer.dp.training import train_dpsgd_classifier

FIELD = "training.steps.noise_multiplier"


@pytest.mark.parametrize(
    "sigma, q, relation",
    [
        (0.7, 0.1, pldm.NeighboringRelation.REPLACE_ONE),
        (0.7, 0.1, pldm.NeighboringRelation.ADD_OR_REMOVE_ONE),
        (0.4, 1.0, pldm.NeighboringRelation.ADD_OR_REMOVE_ONE),
        (2.0, 0.01, pldm.NeighboringRelation.REPLACE_ONE),
    ],
)
def test_the_bin_count_is_the_size_of_the_pmf_that_is_built(sigma, q, relation):
    h = 1e-3
    built = pldm.fast_gaussian_pld(sigma, 1.0, h, q, relation)
    sizes = [built._pmf_remove.size] + ([] if built._symmetric else [built._pmf_add.size])
    bins, lo, hi = pldm.gaussian_pmf_bins(sigma, 1.0, h, q, relation)
    assert bins == max(sizes) and lo < 0 < hi


def test_a_near_noiseless_poisson_step_is_refused_by_every_accountant_path():
    record = TrainingRecord.constant("replace-one", 100, 0.1, 1.0, 0.01, 0.05)
    for account in (privacy_profile, model_rdp, check_accountable):
        with pytest.raises(InvalidArgument) as e:
            account(record)
        assert e.value.field == FIELD
        assert "noise multiplier 0.01 at sample rate 0.05" in e.value.rule and "use more noise" in e.value.rule


def test_full_batch_steps_are_judged_by_their_composition():
    # T full-batch steps compose to one Gaussian of mu = sqrt(T)*k/sigma (k = 2 replace-one): its
    # loss spans about mu^2/2 + 10 mu either way, so the limit falls near mu = 49 on the 1e-4 grid
    def bins(mu):
        return pldm.gaussian_pmf_bins(1.0, mu, DEFAULT_INTERVAL)[0]

    assert bins(40) <= pldm.MAX_PMF_BINS < bins(50)
    ok = TrainingRecord.constant("replace-one", 16, 0.1, 1.0, 0.2)  # mu = 4 * 2 / 0.2 = 40
    too_weak = TrainingRecord.constant("replace-one", 36, 0.1, 1.0, 0.2)  # mu = 60
    check_accountable(ok)
    with pytest.raises(InvalidArgument, match=r"the 36 full-batch steps compose to a Gaussian mechanism of μ = 60"):
        check_accountable(too_weak)
    # the same steps under add-remove have half the sensitivity (mu = 30): accountable
    check_accountable(too_weak, "add-remove")
    # sigma = 0 is exactly non-private (its profile is), never refused
    check_accountable(TrainingRecord.constant("replace-one", 5, 0.1, 1.0, 0.0))


def test_ordinary_records_pass_and_keep_their_epsilon():
    record = TrainingRecord.constant("replace-one", 1000, 0.1, 1.0, 1.0, 0.05)
    check_accountable(record)
    assert privacy_profile(record).epsilon(1e-5).pld == pytest.approx(18.742, abs=0.01)


def test_training_is_refused_before_it_starts():
    # an empty training set would be refused by the trainer; the accountant's refusal comes first
    record = TrainingRecord.constant("replace-one", 100, 0.1, 1.0, 0.01, 0.05)
    with pytest.raises(InvalidArgument) as e:
        train_dpsgd_classifier(
            {"kind": "mlp", "input_dim": 4, "hidden": [3], "output_dim": 2},
            np.zeros((0, 4), np.float32),
            np.zeros(0, np.int64),
            record,
            init_seed=0,
            randomness=make_randomness(0),
            delta=1e-5,
            dataset_size=100,
        )
    assert e.value.field == FIELD
