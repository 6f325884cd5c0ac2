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


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow end-to-end test: run with --run-slow (scripts/test.sh does)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
