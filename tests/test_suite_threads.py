"""The suite's own thread share (tests/conftest.py): a pytest-xdist worker runs torch on
cores // workers threads and the processes its tests start inherit the limit; outside xdist
nothing is changed."""

from __future__ import annotations

import os
import subprocess
import sys

import conftest
import pytest


@pytest.mark.parametrize(("cores", "workers", "share"), [(2, "2", 1), (2, "1", 2), (16, "4", 4), (2, "3", 1)])
def test_a_worker_gets_its_share_of_the_cores(monkeypatch, cores, workers, share):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", workers)
    assert conftest._cores_per_worker() == share


def test_outside_xdist_nothing_is_limited(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    assert conftest._cores_per_worker() is None


def test_this_process_and_its_children_run_on_the_share():
    import torch

    share = conftest._cores_per_worker()
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.environ.get('OMP_NUM_THREADS'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if share is None:  # -n 0: the process keeps torch's own choice and the caller's environment
        assert child == str(os.environ.get("OMP_NUM_THREADS"))
    else:
        assert torch.get_num_threads() == share
        assert child == os.environ["OMP_NUM_THREADS"]  # the share, or what the caller had set
