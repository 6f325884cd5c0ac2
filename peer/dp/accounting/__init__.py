"""Privacy accounting: mechanisms described as data, interpreted by RDP and PLD accountants.

Modules: ``training_records`` (how a model was trained: GaussianStep, TrainingRecord, ApproxDP),
``conversions`` (RDP → (ε, δ), μ-GDP, PLD ε/δ), ``rdp`` and ``pld`` (per-mechanism RDP and PLDs), ``profiles`` (one model's
privacy profile), ``rs`` and ``lc`` (merges; LC is charged the composition of its models unless
all declare state-independent gradients), ``targets`` (choose π / λ for a target ε: from a
public prior, or by measured utility charged as the composition of the scored models),
``events`` (one immutable event class per mechanism kind, read out of a ReleaseRecord by
``event_of``), ``accountant`` (``Accountant``: holds the orders and the PLD discretisation and
interprets events), ``per_unit`` (model-level records restated per neuron),
``release_accounting`` (build the data-level records; record-level entry points
``rdp_of_record``, ``pld_of_record``), ``skellam`` (the Skellam mechanism of secure aggregation: RDP, Poisson
subsampling, steps).
"""

from peer.dp.accounting.accountant import Accountant, Support
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
from peer.dp.accounting.events import (
    Composition,
    DpSgdTraining,
    GaussianRelease,
    LaplaceRelease,
    LinearCombinationMerge,
    MultiBitRelease,
    RandomSelectionMerge,
    event_of,
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
    "Accountant",
    "ApproxDP",
    "Composition",
    "Deltas",
    "DpSgdTraining",
    "Epsilons",
    "GaussianRelease",
    "GaussianStep",
    "LCReport",
    "LCSegments",
    "LaplaceRelease",
    "LinearCombinationMerge",
    "MultiBitRelease",
    "Optimizer",
    "PrivacyProfile",
    "RandomSelectionMerge",
    "Selection",
    "Support",
    "TrainingRecord",
    "UnreachableTarget",
    "WeightChoice",
    "choose_lam",
    "choose_lam_by_utility",
    "choose_pi",
    "choose_pi_by_utility",
    "composition_epsilon",
    "dpsgd_record",
    "event_of",
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
