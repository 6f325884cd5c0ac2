"""Benchmarks of PrivFusion (each script a table and JSON; see docs/experiments.md).

A regular package, not a namespace one: Opacus (a test dependency) installs a top-level
``benchmarks`` package of its own, which would otherwise shadow this folder for
``import benchmarks.transfer``."""
