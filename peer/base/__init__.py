"""Foundations every stage uses: domain errors, randomness, release records, the TOML reader."""
