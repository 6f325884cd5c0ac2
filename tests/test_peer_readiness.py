"""peer.net.readiness: the wait for a daemon's ready file is on the CPU time it used, so a
loaded machine waits longer instead of failing, while a stuck or dead process still fails."""

import subprocess
import sys
import time

import pytest

from peer.net.readiness import NotReady, process_cpu_seconds, wait_for_ready_file


def child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def test_cpu_seconds_of_a_busy_process_grow():
    p = child("while True: pass")
    try:
        time.sleep(0.5)
        first = process_cpu_seconds(p.pid)
        time.sleep(0.5)
        assert first is not None and process_cpu_seconds(p.pid) > first
    finally:
        p.kill()
        p.wait()
    assert process_cpu_seconds(2**22 + 12345) is None  # no such process


def test_a_process_that_writes_its_ready_file_late_is_waited_for(tmp_path):
    ready = tmp_path / "ready.json"
    # idle for longer than its CPU allowance would last in wall time, then ready
    p = child(
        f"import json, os, time; time.sleep(1.5); open({str(ready) + '.tmp'!r}, 'w').write(json.dumps({{'port': 5}}));"
        f" os.replace({str(ready) + '.tmp'!r}, {str(ready)!r}); time.sleep(30)"
    )
    try:
        assert wait_for_ready_file(ready, p.pid, p.poll, cpu_seconds=1.0) == {"port": 5}
    finally:
        p.kill()
        p.wait()


def test_a_process_that_burns_its_cpu_allowance_is_given_up(tmp_path):
    p = child("while True: pass")
    try:
        started = time.monotonic()
        with pytest.raises(NotReady, match="of CPU"):
            wait_for_ready_file(tmp_path / "never.json", p.pid, p.poll, cpu_seconds=0.5, wall_seconds=120)
        assert time.monotonic() - started < 60
    finally:
        p.kill()
        p.wait()


def test_a_process_that_makes_no_progress_meets_the_wall_cap(tmp_path):
    p = child("import time; time.sleep(60)")
    try:
        with pytest.raises(NotReady, match="not ready after"):
            wait_for_ready_file(tmp_path / "never.json", p.pid, p.poll, cpu_seconds=30, wall_seconds=1.0)
    finally:
        p.kill()
        p.wait()


def test_an_exit_is_reported_at_once(tmp_path):
    p = child("raise SystemExit(3)")
    with pytest.raises(ChildProcessError, match="exited with 3"):
        wait_for_ready_file(tmp_path / "never.json", p.pid, p.poll, wall_seconds=60)
