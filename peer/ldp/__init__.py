"""Model-level local DP: the mechanisms, spectral graph matching, weight-space fusion."""
