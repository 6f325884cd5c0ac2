import os

import pytest


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False, help="also run tests marked slow (CI does)")


def _cores_per_worker() -> int | None:
    """The CPU cores one pytest-xdist worker may keep busy (None: not a worker).

    Under ``-n N`` every worker runs its own tests at once, and torch (and the BLAS of each
    subprocess a test starts) would otherwise start one thread per core in every process: on CI's
    2 cores, 2 workers × 2 threads, and the OpenMP threads of a waiting process spin. Measured on
    the shared 2-core build machine (``tests/test_group_matching.py``, ``-n 0``, load about 7):
    14.1 s of CPU and 38.9 s wall with 2 threads, 5.4 s of CPU and 11.9 s wall with 1 — the same
    11 tests, the same assertions."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None:
        return None
    return max(1, len(os.sched_getaffinity(0)) // int(workers))


def pytest_configure(config):
    cores = _cores_per_worker()
    if cores is None:
        return
    import numpy  # noqa: F401  (loaded first: its BLAS keeps its threads, see below)
    import torch

    # this worker's torch, and every process a test starts (CLI commands, daemons) inherits the
    # limit; numpy's BLAS in this worker keeps its threads, so the tests of thread-independent
    # results (test_an_entry_written_with_other_blas_threads_is_read) still see several
    torch.set_num_threads(cores)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(name, str(cores))


# The files that take longest (seconds of one CI run on 2 cores, the durations that
# ``scripts/test.sh`` prints at the end of every run), longest first. With ``--dist loadfile`` the
# workers take files in collection order, so a long file collected last is a tail that one worker
# runs while the other idles (a CI run ended with the 145 s end-to-end test alone): these run first
# (longest-processing-time-first), the rest in their usual order. Out of date numbers only cost
# balance, never a result.
LONGEST_FILES = (  # by each file's total in a full run of 2026-12-04 (2 workers, 2 cores)
    "test_scenarios.py",
    "test_images_rounds.py",
    "test_config_traps.py",
    "test_docs.py",
    "test_experiment_merging.py",
    "test_site_e2e.py",
    "test_progress.py",
    "test_images.py",
    "test_records_cli.py",
    "test_round_scale_benchmark.py",
    "test_iterate_crash.py",
    "test_imported_e2e.py",
    "test_pool_own_network_records.py",
    "test_rounds.py",
    "test_peer_lifecycle.py",
    "test_ledger.py",
    "test_docker.py",
    "test_peer_limits.py",
    "test_experiment_fusion.py",
    "test_netns.py",
    "test_peer_transfer.py",
    "test_privacy_audit.py",
    "test_layout.py",
)


def _longest_first(items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def pytest_collection_modifyitems(config, items):
    _longest_first(items)
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow end-to-end test: run with --run-slow (scripts/test.sh does)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
