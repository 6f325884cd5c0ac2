"""``benchmarks/round_scale.py --quick`` as a user runs it (a subprocess): two real daemons, a
narrow ResNet-18 imported from the factory module it writes, DP-SGD pools, one `merged` round.

What is checked is what the benchmark claims to measure, not how fast anything was: every stage
of the round and both parts of the floor were measured (positive seconds), every process's peak
memory was read, the network has ResNet-18's shape (its parameter count against a closed form
written here), the round really fused with its peer and was charged once, and the targets'
verdicts agree with the figures beside them. Timings on a shared machine are noise; no timing
threshold is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STAGES = ["start-up", "health", "info", "release", "transfer", "alignment", "fusion", "REPAIR", "write-out"]


def resnet18_parameters(widths, inputs: int = 3, classes: int = 10) -> int:
    """ResNet-18's parameter count (CIFAR layout: 3x3 stem, two BasicBlocks per stage, 1x1
    shortcut where the width or stride changes, BatchNorm weight and bias per channel)."""
    conv_bn = lambda c_in, c_out, k: k * k * c_in * c_out + 2 * c_out  # noqa: E731
    total = conv_bn(inputs, widths[0], 3)
    c_in = widths[0]
    for stage, w in enumerate(widths):
        strided = stage > 0  # every stage after the first halves the image
        total += conv_bn(c_in, w, 3) + conv_bn(w, w, 3) + (conv_bn(c_in, w, 1) if strided or c_in != w else 0)
        total += 2 * conv_bn(w, w, 3)
        c_in = w
    return total + widths[-1] * classes + classes


def test_the_closed_form_is_resnet18():
    # the figure usually quoted for CIFAR ResNet-18 (torchvision's ImageNet one has 11.69M: 7x7
    # stem, 1000 classes)
    assert resnet18_parameters((64, 128, 256, 512)) == 11_173_962


@pytest.mark.slow
def test_quick_round_scale_measures_every_stage_the_floor_and_each_process(tmp_path):
    out = tmp_path / "round_scale.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "round_scale.py"), "--quick", "--work", str(tmp_path / "work"),
         "--out", str(out)],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    print(proc.stdout)

    assert r["quick"] is True and r["widths"] == [8, 16, 32, 64]
    assert r["parameters"] == resnet18_parameters(r["widths"])
    assert r["model_bytes"] > 4 * r["parameters"]  # float32 parameters and BatchNorm buffers
    assert (tmp_path / "work" / "code" / "resnet18.py").exists()  # the factory it imported

    rnd = r["round"]
    stages = rnd["stages"]
    assert [s["stage"] for s in stages] == STAGES
    assert all(s["seconds"] > 0 for s in stages), stages
    assert sum(s["seconds"] for s in stages) == pytest.approx(rnd["seconds"], rel=1e-9)  # they tile the round
    assert rnd["status"] == "fused"
    (charge,) = rnd["charges"]  # one release, charged at the peer's data level
    assert (charge["peer"], charge["step"], charge["level"]) == ("riverside", "merged", "data")
    assert 0 < charge["epsilon"] <= 8.0  # within the round's target
    assert rnd["repair"]["data"] == "probe" and len(rnd["repair"]["batchnorm_reset"]) == 20

    assert sum(s["samples"] for s in stages) > 0
    assert 0 < max(s["hwm_at_end"] for s in stages) <= rnd["round_peak_rss"]
    assert all(s["rss_max_sampled"] <= s["hwm_at_end"] for s in stages)

    floor = r["floor"]
    assert floor["forward_s"] > 0 and floor["bytes_s"] > 0 and floor["loopback_bytes_per_s"] > 0
    assert floor["round_floor_s"] == pytest.approx(floor["forward_s"] + floor["bytes_s"])

    peaks = [rnd["round_peak_rss"]] + [d["peak_rss"] for d in rnd["daemons"].values()]
    assert set(rnd["daemons"]) == {"st-anne", "riverside"}
    assert all(p > 50 * 2**20 for p in peaks), peaks  # a Python process with torch loaded, at least
    assert all(d["peak_rss"] >= d["idle_rss"] > 0 for d in rnd["daemons"].values())
    assert all(s["seconds"] > 0 and s["peak_rss"] > 0 for s in r["setup"].values()), r["setup"]
    assert {m["name"] for m in r["setup"]["pool train"]["models"]} == {"p1", "p2"}

    t = r["targets"]
    assert t["round_seconds_met"] == (rnd["seconds"] < t["round_seconds"])
    assert t["largest_process_peak_rss"] == max(peaks)
    assert t["process_memory_met"] == (max(peaks) < t["process_bytes"])
    verdict = "met" if t["round_seconds_met"] else "MISSED"
    assert f"target: round under 60 s: {rnd['seconds']:.1f} s, {verdict}" in proc.stdout
    assert "not accuracy" in proc.stdout
