"""Data-level DP: accounting, DP-SGD training, model pools and RS/LC merging."""
