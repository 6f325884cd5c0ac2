"""Speed and memory of the factorised spectral matcher, side by side with pygmtools' dense ``sm``.

    .venv/bin/python benchmarks/matching.py            # full run: prints a table, writes JSON
    .venv/bin/python benchmarks/matching.py --quick    # a smoke run (small widths only)

Part 1, where the dense K fits: widths 16–96 with 2 hidden layers (the joint dense K has
(2·n²)² float64 entries: 2.7 GB at n = 96; with 3 hidden layers it would be 6.1 GB), and
3 hidden layers at widths 32 and 64 (1.2 GB). The same pair of graphs goes to both solvers.
Part 2, the factorised solver alone at widths 256, 1024 and 4096 with 3 hidden layers.

Part 1 times each solver three times on the same pair and reports the minimum (the median is
in the JSON); part 2 runs once. Every case runs in its own subprocess, after a warm-up match on a tiny pair of the same kind
(first calls into torch, scipy and pygmtools pay one-off initialisation that a long-running peer
pays once), so that peak memory is that case's: the peak resident
set (VmHWM, which sees torch's and numpy's allocations alike) is reset after the graphs are
built (``/proc/self/clear_refs``), so it is the peak while matching, graphs included; the
resident size before matching is reported next to it. CPU time (user + system, both threads)
is reported next to wall time: this machine is shared, and under load the wall time of a
multi-threaded product can stretch while its CPU time does not.

Graphs are synthetic (training 4096-wide networks is beside the point): A is a random MLP
(64 inputs, Gaussian weights N(0, 1/fan_in), ReLU activations on 128 random probes, 10
outputs); B is A with every hidden layer permuted and 10% Gaussian noise added to its weights
and activations. Feature cases:
  exact  — both graphs' exact weights (Chebyshev expansion, error bound ≤ expansion_tol);
  noisy  — both graphs' weight features through peer.ldp.mechanisms.multibit at ε = 1, bounds
           [−1, 1] (three values per layer, one non-zero per row): the exact few-valued
           expansion on both sides;
  mixed  — A exact (a site's own model), B noisy (what it receives): the usual PrivFusion case.
``recovered`` is the fraction of nodes matched to their true counterpart.

Exact weights at width 4096 cost 8·R n³-products per iteration (R ≈ 20 expansion terms), about
two minutes per iteration here; that case runs ``--exact-4096-iterations`` iterations (default
2) and reports the measured time per iteration with the projection to the iteration count
measured at width 1024, labelled as a projection.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "matching.json"
DENSE_CAP = 3 * 2**30
REPEATS = 3  # part 1: each solver matches the same pair 3 times in its process; min (and median) reported


# ------------------------------------------------------------------------------------------
# One case (runs in a subprocess)
# ------------------------------------------------------------------------------------------


def multibit_output(w: np.ndarray, epsilon: float, seed: int, bounds: tuple[float, float] = (-1.0, 1.0)) -> np.ndarray:
    """Each node's incoming weight vector (w reshaped to (n, n_prev·e)) through the multi-bit
    mechanism (peer.ldp.mechanisms.multibit, unit = one neuron, a fixed seed): three values per
    layer, m = max(1, ⌊ε/2.18⌋) non-zero x* per row."""
    from peer.base.rng import make_randomness
    from peer.ldp.mechanisms import multibit

    noisy, _ = multibit(w.reshape(w.shape[0], -1), epsilon=epsilon, bounds=bounds, randomness=make_randomness(seed))
    return noisy.reshape(w.shape)


def synthetic_pair(
    width: int,
    layers: int,
    features: str,
    seed: int = 0,
    inputs: int = 64,
    outputs: int = 10,
    probes: int = 128,
    noise: float = 0.1,
):
    """(graph A, graph B, true permutations) as described in the module docstring."""
    from peer.nn.graph import HiddenLayer, NetworkGraph

    rng = np.random.default_rng(seed)
    x = rng.random((probes, inputs))
    hidden, prev, h = [], inputs, x
    for ell in range(layers):
        w = rng.normal(0.0, 1.0 / math.sqrt(prev), (width, prev))
        b = rng.normal(0.0, 0.1, width)
        h = np.maximum(h @ w.T + b, 0.0)
        hidden.append(HiddenLayer(str(2 * ell), "linear", h.T.copy(), w[:, :, None], b))
        prev = width
    out_w = rng.normal(0.0, 1.0 / math.sqrt(prev), (outputs, prev, 1))
    arch = {"kind": "mlp", "input_dim": inputs, "hidden": [width] * layers, "output_dim": outputs, "activation": "relu"}
    graph_a = NetworkGraph(arch, inputs, tuple(hidden), out_w, np.zeros(outputs))

    perms, hidden_b, prev_p = [], [], None
    for layer in hidden:
        p = rng.permutation(width)
        w = layer.incoming[p]
        if prev_p is not None:
            w = w[:, prev_p]
        w = w + noise * w.std() * rng.standard_normal(w.shape)
        act = layer.activations[p] + noise * layer.activations.std() * rng.standard_normal(layer.activations.shape)
        hidden_b.append(HiddenLayer(layer.name, layer.kind, act, w, layer.bias[p]))
        perms.append(p)
        prev_p = p
    out_b = out_w[:, prev_p] + noise * out_w.std() * rng.standard_normal(out_w.shape)
    graph_b = NetworkGraph(arch, inputs, tuple(hidden_b), out_b, np.zeros(outputs))

    def released(g, seed_):
        hid = tuple(
            HiddenLayer(h.name, h.kind, h.activations, multibit_output(h.incoming, 1.0, seed_ + 10 * k), h.bias)
            for k, h in enumerate(g.hidden)
        )
        return g.with_layers(hid, multibit_output(g.output_incoming, 1.0, seed_ + 10 * len(g.hidden)))

    if features in ("noisy", "mixed"):
        graph_b = released(graph_b, seed + 1)
    if features == "noisy":
        graph_a = released(graph_a, seed + 2)
    return graph_a, graph_b, perms


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def run_case(spec: dict) -> dict:
    """Build the pair, match it, measure. ``spec``: width, layers, features, solver, max_iter."""
    import torch

    from peer.ldp.matching import MatchOptions, match_graphs

    # Warm up on a tiny pair of the same kind: first calls into torch, scipy and pygmtools pay
    # one-off initialisation that a long-running peer pays once, not per match.
    tiny_a, tiny_b, _ = synthetic_pair(8, spec["layers"], spec["features"], seed=99)
    match_graphs(tiny_a, tiny_b, MatchOptions(solver=spec["solver"]))
    graph_a, graph_b, perms = synthetic_pair(spec["width"], spec["layers"], spec["features"])
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM: the peak below is the matcher's (graphs included)
        reset = True
    except OSError:
        reset = False
    rss_before = _status_kib("VmRSS")
    opts = MatchOptions(
        solver=spec["solver"],
        dense_memory_cap=DENSE_CAP,
        max_iter=spec.get("max_iter", 100),
        threads=spec.get("threads"),
    )
    walls, cpus = [], []
    for _ in range(spec.get("repeats", 1)):
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        result = match_graphs(graph_a, graph_b, opts)
        walls.append(time.perf_counter() - t0)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        cpus.append((r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime))
    d = result.diagnostics
    truth = [np.argsort(p) for p in perms]  # A's node i is B's node argsort(p)[i]
    return {
        **spec,
        "wall_s": min(walls),
        "wall_median_s": float(np.median(walls)),
        "cpu_s": min(cpus),
        "walls_s": walls,
        "peak_rss_mb": _status_kib("VmHWM") / 1024 if reset else r1.ru_maxrss / 1024,
        "rss_before_mb": rss_before / 1024,
        "iterations": result.iterations,
        "converged": result.converged,
        "seconds": d["seconds"],
        "dtype": d["dtype"],
        "products_per_iteration": d["dense_products_per_iteration"],
        "n3_products_per_iteration": d["n3_products_per_iteration"],
        "flops_per_iteration": d["flops_per_iteration"],
        "terms": [b["terms"] for b in d["blocks"]],
        "expansions": [b["expansion"] for b in d["blocks"]],
        "error_bound": d["expansion_error_bound"],
        "recovered": float(np.mean(np.concatenate([p == t for p, t in zip(result.permutations, truth, strict=True)]))),
        "permutations": [p.tolist() for p in result.permutations] if spec["width"] <= 128 else None,
        "objective": result.objective,
        "torch_threads": torch.get_num_threads(),
    }


# ------------------------------------------------------------------------------------------
# The driver
# ------------------------------------------------------------------------------------------


def in_subprocess(spec: dict, timeout: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--case", json.dumps(spec)]
    try:
        out = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
    except subprocess.TimeoutExpired:
        return {**spec, "error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        return {**spec, "error": (out.stderr or out.stdout).strip().splitlines()[-1:] or [f"exit {out.returncode}"]}
    return json.loads(lines[-1])


def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="small widths only (a smoke run)")
    ap.add_argument(
        "--exact-4096-iterations", type=int, default=2, help="iterations to time for exact weights at width 4096"
    )
    ap.add_argument(
        "--skip-exact-4096",
        action="store_true",
        help="leave out exact weights at width 4096 (minutes per iteration here)",
    )
    ap.add_argument("--part", type=int, choices=(1, 2), help="run only part 1 (against dense) or part 2 (large widths)")
    ap.add_argument("--threads", type=int, help="torch threads for the factorised solver (default: MatchOptions' rule)")
    ap.add_argument("--out", default=str(RESULTS), help="where to write the JSON")
    args = ap.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))))
        return 0

    started = time.time()
    load_start = os.getloadavg()
    dense_cases = [(2, w) for w in ((16, 32) if args.quick else (16, 32, 48, 64, 80, 96))] + [
        (3, w) for w in ((32,) if args.quick else (32, 64))
    ]
    large_widths = (256,) if args.quick else (256, 1024, 4096)
    if args.part == 2:
        dense_cases = []
    if args.part == 1:
        large_widths = ()

    print(
        "Part 1: factorised vs pygmtools' dense sm (same graphs; wall = min of 3 runs; 'same perm': yes, or tie = equal objective)"
    )
    head = f"{'layers':>6} {'width':>5} {'features':>8} | {'dense s':>8} {'dense MB':>8} {'it':>3} | {'fact s':>7} {'fact MB':>7} {'it':>3} | {'speed-up':>8} {'cpu ratio':>9} {'same perm':>9} {'recovered':>9}"
    print(head)
    print("-" * len(head))
    dense_rows = []
    for layers, width in dense_cases:
        for features in ("exact", "noisy"):
            spec = {"width": width, "layers": layers, "features": features, "repeats": REPEATS}
            fact = in_subprocess({**spec, "solver": "factorised", "threads": args.threads}, 600)
            dense = in_subprocess({**spec, "solver": "dense"}, 1800)
            row = {"layers": layers, "width": width, "features": features, "factorised": fact, "dense": dense}
            if "error" not in fact and "error" not in dense:
                row["speedup_wall"] = dense["wall_s"] / fact["wall_s"]
                row["speedup_cpu"] = dense["cpu_s"] / max(fact["cpu_s"], 1e-9)
                row["same_permutations"] = fact["permutations"] == dense["permutations"]
                # different permutations with the same QAP objective: a choice among exactly tied
                # nodes (identical features), which float rounding may break either way
                row["tie"] = not row["same_permutations"] and math.isclose(
                    fact["objective"], dense["objective"], rel_tol=1e-9
                )
                same = "yes" if row["same_permutations"] else ("tie" if row["tie"] else "NO")
                print(
                    f"{layers:>6} {width:>5} {features:>8} | {dense['wall_s']:>8.2f} {dense['peak_rss_mb']:>8.0f} {dense['iterations']:>3} | "
                    f"{fact['wall_s']:>7.3f} {fact['peak_rss_mb']:>7.0f} {fact['iterations']:>3} | {row['speedup_wall']:>7.0f}x {row['speedup_cpu']:>8.0f}x "
                    f"{same:>9} {fact['recovered']:>9.3f}"
                )
            else:
                print(f"{layers:>6} {width:>5} {features:>8} | error: {fact.get('error') or dense.get('error')}")
            dense_rows.append(row)

    print()
    print(
        "Part 2: factorised alone, 3 hidden layers (products = dense matrix products per iteration; n³-eq = their flops / 2n³)"
    )
    head = f"{'width':>5} {'features':>8} | {'wall s':>8} {'cpu s':>8} {'peak MB':>8} {'it':>3} {'products':>8} {'n³-eq':>6} {'terms':>12} | {'setup':>6} {'iter':>7} {'assign':>6} | {'recovered':>9}"
    print(head)
    print("-" * len(head))
    large_rows = []
    iterations_1024 = {}
    for width in large_widths:
        for features in ("noisy", "mixed", "exact"):
            spec = {"width": width, "layers": 3, "features": features, "solver": "factorised", "threads": args.threads}
            projected = width >= 4096 and features == "exact"
            if projected and args.skip_exact_4096:
                continue
            if projected:
                spec["max_iter"] = args.exact_4096_iterations
            r = in_subprocess(spec, 3600)
            if "error" in r:
                print(f"{width:>5} {features:>8} | error: {r['error']}")
                large_rows.append(r)
                continue
            if width == 1024:
                iterations_1024[features] = r["iterations"]
            if projected:
                per_iter = r["seconds"]["iterations"] / max(1, r["iterations"])
                its = iterations_1024.get("exact", r["iterations"])
                r["projection"] = {
                    "seconds_per_iteration": per_iter,
                    "iterations_assumed": its,
                    "projected_wall_s": r["seconds"]["setup"] + per_iter * its + r["seconds"]["assignment"],
                    "note": f"ran {r['iterations']} iterations only; iterations assumed = those measured at width 1024",
                }
            s = r["seconds"]
            print(
                f"{width:>5} {features:>8} | {r['wall_s']:>8.2f} {r['cpu_s']:>8.2f} {r['peak_rss_mb']:>8.0f} {r['iterations']:>3} {r['products_per_iteration']:>8} "
                f"{r['n3_products_per_iteration']:>6.2f} {r['terms']!s:>12} | {s['setup']:>6.2f} {s['iterations']:>7.2f} {s['assignment']:>6.2f} | {r['recovered']:>9.3f}"
                + (
                    f"   projected {r['projection']['projected_wall_s']:.0f} s for {r['projection']['iterations_assumed']} iterations"
                    if projected
                    else ""
                )
            )
            large_rows.append(r)

    report = {
        "command": "benchmarks/matching.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": {"cpus": os.cpu_count(), "load_average_start": load_start, "load_average_end": os.getloadavg()},
        "seconds": time.time() - started,
        "dense_comparison": dense_rows,
        "factorised": large_rows,
        "notes": [
            "Dense comparison: 2 hidden layers at widths 16-96 (joint dense K (2n²)² float64: 2.7 GB at 96) and 3 hidden layers at 32, 64 (1.2 GB at 64).",
            "Part 1 times each solver 3 times on the same pair in its process and reports the minimum (wall_median_s and walls_s hold the rest); part 2 runs once.",
            "peak_rss_mb is the peak resident set while matching (VmHWM reset after building the graphs), graphs and the Python/torch runtime included; rss_before_mb is the resident set just before matching.",
            "The machine is shared with other jobs: compare ratios measured side by side, and cpu_s next to wall_s.",
        ],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
