"""Local-DP mechanisms of PrivFusion (being split into one concept per file)."""

from peer.ldp.mechanisms.network import (  # noqa: F401
    CALIBRATIONS, COMPOSITIONS, DEFAULT_BOUND_FACTOR, DEFAULT_CLIP_NORM, MULTIBIT_EPSILON_PER_COORDINATE,
    PARALLEL_OVER, SPREAD_MARGIN, UNITS, MultibitRectifier, WeightLayer, analytic_gaussian_sigma,
    classical_gaussian_sigma, clip_rows, composite_record, default_clip_norm, default_entry_bound,
    gaussian_delta, gaussian_perturbation, gaussian_sensitivity, gaussian_sigma, laplace_activations,
    multibit, multibit_rectifier, multibit_variance, perturb_graph, perturb_model_weights,
    smoothing_filter, truncated_normal_mean, weight_layer_specs)
