"""``benchmarks/secure_step.py --quick`` as a user runs it (a subprocess): four real daemons on
loopback, every site's plain iterate run and then the same plan with ``secure = true``.

What is checked is what the benchmark claims to measure, not how fast anything was: both runs
finished with every step charged at every site (the per-step times are intervals between those
charges), the bytes per site per step are at least what the protocol must move (each site fetches
k − 1 segments or masked vectors and serves its own k − 1 times), the ratios are the quotients of
the figures beside them, the floors and every process's memory were measured, and the target's
verdict agrees with its ratio. Timings on a shared machine are noise; no timing threshold is
asserted."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def mlp_parameters(widths: list[int]) -> int:
    return sum(a * b + b for a, b in itertools.pairwise(widths))


@pytest.mark.slow
def test_quick_secure_step_measures_both_runs_their_bytes_and_the_floor(tmp_path):
    out = tmp_path / "secure_step.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "secure_step.py"), "--quick", "--work", str(tmp_path / "work"),
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(proc.stdout)
    r = json.loads(out.read_text())

    assert r["quick"] is True and list(r["sites"]) == ["4"] and r["loops"] == "threads"
    arch = r["architecture"]
    assert r["parameters"] == mlp_parameters([arch["input_dim"], *arch["hidden"], arch["output_dim"]]) == 4810
    steps, k, d = r["steps"], 4, r["parameters"]
    assert steps >= 3
    s = r["sites"]["4"]
    plain, secure = s["plain"], s["secure"]
    for m in (plain, secure):
        assert m["sites"] == k and m["steps"] == steps
        # one interval between consecutive charges per site, from its second charge on
        assert len(m["step_intervals_s"]) == k * (steps - 2)
        assert all(v > 0 for v in m["step_intervals_s"])
        assert min(m["step_intervals_s"]) <= m["step_s"] <= max(m["step_intervals_s"])
        assert max(m["step_intervals_s"]) < m["wall_s"]  # the run holds its steps
        assert m["loops_peak_rss"] >= m["loops_rss_sampled"] > 50 * 2**20
        assert m["loops_peak_rss"] >= m["loop_process_peak_rss"] > 50 * 2**20

    # plain: every peer's segment of every round came fresh, k − 1 float32 copies each way
    assert plain["fresh"] is True
    assert plain["segment_bytes"] == 4 * d
    assert plain["bytes_received_per_step"] == pytest.approx((k - 1) * 4 * d)
    assert plain["bytes_sent_per_step"] == pytest.approx((k - 1) * 4 * d)
    assert plain["report_round_s"] > 0

    # secure: no rotation in the run's encoding (d residues of 4 bytes at b = 32), no dropout;
    # each site fetched k − 1 masked vectors and its daemon served its own k − 1 times, plus keys,
    # digests and the requests (polls included, so as many as the waits took): more than the
    # vectors alone; the replies it fetched (no polls in them) are the vectors and, per peer, one
    # signed key and k − 1 signed digests: within a few kB of the vectors
    assert secure["padded_dim"] == d and secure["bits"] == 32
    assert secure["attempts_rerun"] == 0
    vectors = (k - 1) * 4 * secure["padded_dim"]
    for key in ("bytes_received_per_step", "bytes_sent_per_step"):
        assert secure[key] > vectors, (key, secure[key], vectors)
    replies = secure["bytes_replies_received_per_step"]
    assert vectors < replies < vectors + 2_000 * (k - 1), (replies, vectors)
    assert replies <= secure["bytes_received_per_step"]
    assert secure["bytes_published_per_step"] > 4 * secure["padded_dim"]  # its vector, once, to its own daemon
    assert 0 < secure["report_run_s"] <= secure["wall_s"]

    assert s["ratio_step"] == pytest.approx(secure["step_s"] / plain["step_s"])
    assert s["ratio_wall"] == pytest.approx(secure["wall_s"] / plain["wall_s"])
    assert s["ratio_bytes_received"] == pytest.approx(
        secure["bytes_received_per_step"] / plain["bytes_received_per_step"]
    )
    assert set(s["daemons"]) == {f"site-{i:02d}" for i in range(k)}
    assert all(v["peak_rss"] >= v["idle_rss"] > 50 * 2**20 for v in s["daemons"].values())
    assert s["daemons_peak_rss"] == max(v["peak_rss"] for v in s["daemons"].values())

    f = r["floors"]
    for key in ("matmul_s", "forward_backward_s", "per_example_gradients_s", "loopback_s", "plain_segment_s"):
        assert f[key] > 0, key
    assert f["model_bytes"] == 4 * d
    assert f["loopback_bytes_per_s"] == pytest.approx(f["model_bytes"] / f["loopback_s"])
    assert all(v > 0 for v in f["secure_gradients_s"].values())
    core = f["secagg_core"]["4"]
    assert core["total"] == pytest.approx(sum(v for key, v in core.items() if key != "total"))

    t = r["target"]
    assert t["ratio"] == s["ratio_step"] and t["met"] == (t["ratio"] < t["ratio_limit"] == 1.3)
    assert f"ratio {t['ratio']:.2f}, {'met' if t['met'] else 'MISSED'}" in proc.stdout
    m = r["machine"]
    assert m["cpus"] >= 1 and len(m["load_avg_before"]) == 3 and m["python"] and m["torch"]
    assert "| 4 | secure / plain |" in proc.stdout
