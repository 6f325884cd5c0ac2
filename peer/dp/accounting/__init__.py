"""Privacy accounting: mechanisms described as data, interpreted by RDP and PLD accountants.

Modules: ``training_records`` (how a model was trained: GaussianStep, TrainingRecord, ApproxDP),
``conversions`` (RDP → (ε, δ), μ-GDP, PLD ε/δ), ``rdp`` and ``pld`` (per-mechanism RDP and PLDs), ``profiles`` (one model's
privacy profile), ``rs`` and ``lc`` (merges; LC is charged the composition of its models unless
all declare state-independent gradients), ``targets`` (choose π / λ for a target ε: from a
public prior, or by measured utility charged as the composition of the scored models),
``release_accounting`` (interpret ReleaseRecords: ``rdp_of_record``, ``pld_of_record``; build
the data-level ones), ``skellam`` (the Skellam mechanism of secure aggregation: RDP, Poisson
subsampling, steps).
"""

from peer.dp.accounting.conversions import (
    DEFAULT_ORDERS,
    Deltas,
    Epsilons,
    gdp_delta,
    gdp_epsilon,
    gdp_mu,
    rdp_to_delta,
    rdp_to_epsilon,
)
from peer.dp.accounting.lc import (
    LCReport,
    LCSegments,
    lc_delta,
    lc_epsilon,
    lc_pld,
    lc_rdp,
    lc_report,
    lc_segments,
    lc_surrogate_epsilon,
    lc_surrogate_mu,
    surrogate_is_bound,
)
from peer.dp.accounting.profiles import PrivacyProfile, model_delta, model_epsilon, privacy_profile, privacy_profiles
from peer.dp.accounting.release_accounting import (
    dpsgd_record,
    lc_merge_record,
    pld_fallbacks,
    pld_of_record,
    rdp_of_record,
    record_epsilon,
    rs_merge_record,
)
from peer.dp.accounting.rs import composition_epsilon, rs_delta, rs_epsilon, rs_pld, rs_profiles, rs_rdp
from peer.dp.accounting.skellam import rdp_skellam, rdp_skellam_steps, rdp_subsampled_skellam
from peer.dp.accounting.targets import (
    Selection,
    UnreachableTarget,
    WeightChoice,
    choose_lam,
    choose_lam_by_utility,
    choose_pi,
    choose_pi_by_utility,
    privacy_prior,
)
from peer.dp.accounting.training_records import (
    ADJACENCIES,
    OPTIMIZERS,
    ApproxDP,
    GaussianStep,
    Optimizer,
    TrainingRecord,
)

__all__ = [
    "ADJACENCIES",
    "DEFAULT_ORDERS",
    "OPTIMIZERS",
    "ApproxDP",
    "Deltas",
    "Epsilons",
    "GaussianStep",
    "LCReport",
    "LCSegments",
    "Optimizer",
    "PrivacyProfile",
    "Selection",
    "TrainingRecord",
    "UnreachableTarget",
    "WeightChoice",
    "choose_lam",
    "choose_lam_by_utility",
    "choose_pi",
    "choose_pi_by_utility",
    "composition_epsilon",
    "dpsgd_record",
    "gdp_delta",
    "gdp_epsilon",
    "gdp_mu",
    "lc_delta",
    "lc_epsilon",
    "lc_merge_record",
    "lc_pld",
    "lc_rdp",
    "lc_report",
    "lc_segments",
    "lc_surrogate_epsilon",
    "lc_surrogate_mu",
    "model_delta",
    "model_epsilon",
    "pld_fallbacks",
    "pld_of_record",
    "privacy_prior",
    "privacy_profile",
    "privacy_profiles",
    "rdp_of_record",
    "rdp_skellam",
    "rdp_skellam_steps",
    "rdp_subsampled_skellam",
    "rdp_to_delta",
    "rdp_to_epsilon",
    "record_epsilon",
    "rs_delta",
    "rs_epsilon",
    "rs_merge_record",
    "rs_pld",
    "rs_profiles",
    "rs_rdp",
    "surrogate_is_bound",
]
