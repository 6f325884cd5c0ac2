"""Speed and memory of the factorised spectral matcher: against pygmtools' dense ``sm``, against
its own reference path, and against the floor of the machine.

    .venv/bin/python benchmarks/matching.py            # full run: prints tables, writes JSON
    .venv/bin/python benchmarks/matching.py --quick    # a smoke run (small widths only)
    .venv/bin/python benchmarks/matching.py --part 2 --widths 4096 --features mixed exact

Part 1, where the dense K fits: widths 16–96 with 2 hidden layers (the joint dense K has
(2·n²)² float64 entries: 2.7 GB at n = 96; with 3 hidden layers it would be 6.1 GB), and
3 hidden layers at widths 32 and 64 (1.2 GB). The same pair of graphs goes to both solvers.
Part 2, 3 hidden layers at widths 256, 1024 and 4096: the default path (layer-wise
Rayleigh–Ritz iteration with the operator-adapted expansion) and the reference path
(``MatchOptions(eigensolver="power", expansion_rule="uniform")``: shifted power iteration, every
kernel value within 1e-4 — the solver before) on the same pair, with the number of nodes they
match differently, the speed-up, the n³-products each counted, the floor (one float32 n³
product and one Hungarian assignment at that width, measured in the same run) and the ratio of
the wall time to the floor of the counted work; the error bound each path reports (the default
path: a certified ‖Kv − θv‖/θ against the exact-kernel K — with the spectral-norm bounds of the
centred expansion terms it holds except with the reported probability, and the Frobenius-only
bound, which always holds, is printed beside it with the ranks and residuals per step; the
reference: its kernel-value bound). ``--merge`` puts this run's rows into the JSON at ``--out``
instead of replacing it (e.g. after rerunning part 2 at one width). The reference path with exact weights at width 4096 (about 140 n³-products per step,
minutes each here) runs ``--exact-4096-iterations`` steps (default 1) and is projected to the
step count measured at width 1024, labelled as a projection; ``--reference-npz 4096 exact FILE``
compares the default path with the permutations of a full reference run made separately.
Part 3, permutation groups: a residual MLP (a stream written by the stem and two residual
blocks, LayerNorm on it; peer.nn.tracing derives its groups) against a copy with every group
permuted and 10% noise, matched side by side by peer.ldp.group_matching.match_groups
(activations + weight matching by coordinate descent) and by the factorised spectral matcher
over the groups (peer.ldp.matching.groups.match_group_features), at stream widths 256 and
1024: time, n³ products, the floor ratio, recovered fractions, and how many elements the two
match differently.

Part 1 times each solver three times on the same pair and reports the minimum (the median is
in the JSON); parts 2 and 3 run once. Every case runs in its own subprocess, after a warm-up match on a tiny pair of the same kind
(first calls into torch, scipy and pygmtools pay one-off initialisation that a long-running peer
pays once), so that peak memory is that case's: the peak resident
set (VmHWM, which sees torch's and numpy's allocations alike) is reset after the graphs are
built (``/proc/self/clear_refs``), so it is the peak while matching, graphs included; the
resident size before matching is reported next to it. CPU time (user + system, both threads)
is reported next to wall time, and the load average next to each case: this machine is shared,
and under load the wall time of a multi-threaded product can stretch while its CPU time does not.

Graphs are synthetic (training 4096-wide networks is beside the point): A is a random MLP
(64 inputs, Gaussian weights N(0, 1/fan_in), ReLU activations on 128 random probes, 10
outputs); B is A with every hidden layer permuted and 10% Gaussian noise added to its weights
and activations. Feature cases:
  exact  — both graphs' exact weights (Chebyshev expansions: operator-adapted on the default path);
  noisy  — both graphs' weight features through peer.ldp.mechanisms.multibit at ε = 1, bounds
           [−1, 1] (three values per layer, one non-zero per row): the exact few-valued
           expansion on both sides;
  mixed  — A exact (a site's own model), B noisy (what it receives): the usual PrivFusion case.
``recovered`` is the fraction of nodes matched to their true counterpart.
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


# The reference path: today's shifted power iteration with every kernel value within
# expansion_tol (what the factorised solver did before the Rayleigh–Ritz iteration).
REFERENCE = {"eigensolver": "power", "expansion_rule": "uniform"}
PERMS_DIR = ROOT / "benchmarks" / "results" / "matching-permutations"


def _save_permutations(spec: dict, perms) -> str:
    """Large cases' permutations go to a file so that the driver can compare the two paths."""
    PERMS_DIR.mkdir(parents=True, exist_ok=True)
    name = f"{spec['width']}-{spec['layers']}-{spec['features']}-{spec.get('variant', 'fast')}-{spec.get('max_iter', 100)}.npz"
    np.savez(PERMS_DIR / name, *perms)
    return str(PERMS_DIR / name)


def _load_permutations(row: dict):
    if row.get("permutations") is not None:
        return [np.asarray(p) for p in row["permutations"]]
    with np.load(row["permutations_file"]) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


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
    variant = REFERENCE if spec.get("variant") == "reference" else {}
    match_graphs(tiny_a, tiny_b, MatchOptions(solver=spec["solver"], **variant))
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
        **variant,
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
        "permutations_file": _save_permutations(spec, result.permutations) if spec["width"] > 128 else None,
        "eigensolver": d.get("eigensolver"),
        "expansion_rule": opts.expansion_rule,
        "n3_products_total": d.get("n3_products_total"),
        "ranks": d.get("ranks"),
        "residual": d.get("residual"),
        "residual_bound": d.get("residual_bound"),
        "operator_error_bound": d.get("operator_error_bound"),
        "bound_failure_probability": d.get("bound_failure_probability"),
        "operator_error_bound_deterministic": d.get("operator_error_bound_deterministic"),
        "residual_bound_deterministic": d.get("residual_bound_deterministic"),
        "residuals": d.get("residuals"),
        "load_average": os.getloadavg(),
        "objective": result.objective,
        "torch_threads": torch.get_num_threads(),
    }


def run_floor(width: int) -> dict:
    """The floor at this width: one float32 n×n by n×n product (torch's threads, min of 3) and
    scipy's linear_sum_assignment on a centred random n×n matrix (min of 3)."""
    import torch
    from scipy.optimize import linear_sum_assignment

    from peer.ldp.matching import AUTO_SINGLE_THREAD_MAX_WIDTH

    if width <= AUTO_SINGLE_THREAD_MAX_WIDTH:
        torch.set_num_threads(1)  # the matcher's products run on one thread at these widths
    rng = np.random.default_rng(0)
    a = torch.as_tensor(rng.standard_normal((width, width)), dtype=torch.float32)
    b = torch.as_tensor(rng.standard_normal((width, width)), dtype=torch.float32)
    products, lsa = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        _ = a @ b
        products.append(time.perf_counter() - t0)
        x = rng.random((width, width))
        x -= x.mean(axis=1, keepdims=True)
        t0 = time.perf_counter()
        linear_sum_assignment(x, maximize=True)
        lsa.append(time.perf_counter() - t0)
    return {"width": width, "product_s": min(products), "assignment_s": min(lsa), "load_average": os.getloadavg()}


def residual_pair(width: int, seed: int = 0, noise: float = 0.1, probes: int = 128):
    """A residual MLP (stem → stream of ``width`` units; two blocks Linear–ReLU–Linear added to
    the stream, a LayerNorm on it; head), random Gaussian weights, and B = A with every
    permutation group permuted and 10% Gaussian noise on its floating-point state. Returns the
    structure (peer.nn.tracing), both states, both group activations, the true permutations."""
    import torch
    from torch import nn

    from peer.ldp.group_matching import group_activations
    from peer.nn.tracing import import_structure, permute_state, random_permutations

    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Linear(64, width)
            self.block1 = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
            self.norm = nn.LayerNorm(width)
            self.block2 = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
            self.head = nn.Linear(width, 10)

        def forward(self, x):
            h = self.stem(x)
            h = self.norm(h + self.block1(h))
            return self.head(h + self.block2(h))

    torch.manual_seed(seed)
    model_a = Residual().eval()
    structure = import_structure(model_a, [64], seed=seed)
    arrays_a = {k: v.detach().numpy().copy() for k, v in model_a.state_dict().items()}
    rng = np.random.default_rng(seed)
    perms = random_permutations(structure, rng)
    arrays_b = permute_state(structure, arrays_a, perms)
    for k, v in arrays_b.items():
        if np.issubdtype(v.dtype, np.floating) and v.std() > 0:
            arrays_b[k] = (v + noise * v.std() * rng.standard_normal(v.shape)).astype(v.dtype)
    model_b = Residual().eval()
    model_b.load_state_dict({k: torch.as_tensor(v) for k, v in arrays_b.items()})
    x = torch.as_tensor(rng.random((probes, 64)), dtype=torch.float32)
    return (
        structure,
        arrays_a,
        arrays_b,
        group_activations(model_a, structure, x),
        group_activations(model_b, structure, x),
        perms,
    )


def run_groups(spec) -> dict:
    """Permutation-group matching of a residual pair (``residual_pair``): ``spec["method"]``
    "match_groups" (peer.ldp.group_matching, activations + weight-matching coordinate descent)
    or "spectral" (peer.ldp.matching.groups.match_group_features: the factorised spectral
    matcher over the groups, then its refinement). An int ``spec`` is match_groups (the old
    form)."""
    if isinstance(spec, int):
        spec = {"width": spec, "method": "match_groups"}
    width, method = spec["width"], spec.get("method", "match_groups")
    from peer.ldp.group_matching import match_groups
    from peer.ldp.matching import MatchOptions
    from peer.ldp.matching.groups import match_group_features

    def run(structure, arrays_a, arrays_b, act_a, act_b):
        if method == "match_groups":
            return match_groups(structure, arrays_a, arrays_b, act_a, act_b), {}
        r = match_group_features(structure, act_a, arrays_a, act_b, arrays_b, MatchOptions(threads=spec.get("threads")))
        return r.perms, r.diagnostics

    # warm-up on a tiny pair (first calls into torch and scipy), as part 1 and 2 do
    run(*residual_pair(8, seed=99)[:5])
    structure, arrays_a, arrays_b, act_a, act_b, perms = residual_pair(width)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    found, d = run(structure, arrays_a, arrays_b, act_a, act_b)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    truth = {g: np.argsort(p) for g, p in perms.items()}
    right = np.concatenate([found[g] == truth[g] for g in perms])
    out = {
        "width": width,
        "method": method,
        "groups": {g.name: g.size for g in structure.groups},
        "wall_s": wall,
        "cpu_s": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),
        "peak_rss_mb": _status_kib("VmHWM") / 1024,
        "recovered": float(np.mean(right)),
        "permutations": {g: np.asarray(p).tolist() for g, p in found.items()},
        "load_average": os.getloadavg(),
    }
    if d:
        spectral = np.concatenate([np.asarray(d["spectral_perms"][g]) == truth[g] for g in perms])
        out.update(
            recovered_spectral=float(np.mean(spectral)),
            iterations=d["iterations"],
            converged=d["converged"],
            n3_products_total=d["n3_products_total"] + d["refinement"].get("n3_products", 0.0),
            n3_products_eigensolver=d["n3_products_total"],
            seconds=d["seconds"],
            refinement=d["refinement"],
            dtype=d["dtype"],
            error_bound=d["expansion_error_bound"],
            expansions=[(e["param"], e["expansion"], e["terms"]) for e in d["edges"]],
        )
    return out


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


def _merged(old: dict, new: dict) -> dict:
    """``old`` with ``new``'s rows put in: a row replaces the old one of the same part and case
    (layers/width/features, or width for the groups); floors by width; commands kept as a list."""

    def key(row):
        return (row.get("layers"), row.get("width"), row.get("features"))

    merged = dict(old)
    for part in ("dense_comparison", "factorised", "groups"):
        rows = {key(r): r for r in old.get(part, [])}
        rows.update({key(r): r for r in new.get(part, [])})
        merged[part] = list(rows.values())
    merged["floors"] = {**old.get("floors", {}), **{str(k): v for k, v in new.get("floors", {}).items()}}
    merged["commands"] = [*old.get("commands", [old.get("command")]), new["command"]]
    merged["merged_runs"] = [*old.get("merged_runs", []), {k: new[k] for k in ("command", "machine", "seconds")}]
    return merged


def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="small widths only (a smoke run)")
    ap.add_argument(
        "--exact-4096-iterations",
        type=int,
        default=1,
        help="iterations of the reference path to time for exact weights at width 4096 (it is projected)",
    )
    ap.add_argument("--widths", type=int, nargs="*", help="part 2 widths (default 256 1024 4096; --quick: 256)")
    ap.add_argument(
        "--features", nargs="*", default=["noisy", "mixed", "exact"], help="part 2 feature cases (noisy mixed exact)"
    )
    ap.add_argument("--no-reference", action="store_true", help="part 2: the default path only")
    ap.add_argument(
        "--reference-npz",
        nargs=3,
        action="append",
        metavar=("WIDTH", "FEATURES", "PATH"),
        default=[],
        help="part 2: permutations of a full reference run of that case (an .npz of one array per hidden layer, "
        "e.g. from a long background run), compared with the default path's (for the case whose reference is projected)",
    )
    ap.add_argument(
        "--group-widths", type=int, nargs="*", default=None, help="part 3 widths (default 256 1024; --quick: 64)"
    )
    ap.add_argument(
        "--part", type=int, choices=(1, 2, 3), help="run only part 1 (against dense), 2 (large widths) or 3 (groups)"
    )
    ap.add_argument("--threads", type=int, help="torch threads for the factorised solver (default: MatchOptions' rule)")
    ap.add_argument("--out", default=str(RESULTS), help="where to write the JSON")
    ap.add_argument(
        "--merge",
        action="store_true",
        help="merge this run's rows into the JSON at --out (rows of the same part, width and features replaced, the rest kept)",
    )
    args = ap.parse_args(argv)
    if args.case:
        spec = json.loads(args.case)
        if "floor" in spec:
            print(json.dumps(run_floor(spec["floor"])))
        elif "groups" in spec:
            print(json.dumps(run_groups(spec["groups"])))
        else:
            print(json.dumps(run_case(spec)))
        return 0

    started = time.time()
    load_start = os.getloadavg()
    dense_cases = [(2, w) for w in ((16, 32) if args.quick else (16, 32, 48, 64, 80, 96))] + [
        (3, w) for w in ((32,) if args.quick else (32, 64))
    ]
    large_widths = args.widths if args.widths is not None else ((256,) if args.quick else (256, 1024, 4096))
    if args.group_widths is None:
        args.group_widths = [64] if args.quick else [256, 1024]
    if args.part in (2, 3):
        dense_cases = []
    if args.part in (1, 3):
        large_widths = ()
    if args.part in (1, 2):
        args.group_widths = []

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
        "Part 2: 3 hidden layers, the default path ('fast': Rayleigh–Ritz, operator-adapted expansion) against the\n"
        "reference ('ref': shifted power iteration, every kernel value within 1e-4). n³ = products counted in n³ units;\n"
        "floor = one fp32 n³ product / Hungarian at this width, measured here; 'x floor' = wall / (n³ · product + 3 · Hungarian);\n"
        "same = yes or the number of nodes matched differently; bound: fast = its certified ‖Kv − θv‖/θ against the exact-kernel K,\n"
        "ref = its expansion's bound on every kernel value; load = 1-minute load average when the case ended (2 cores)."
    )
    head = (
        f"{'width':>5} {'features':>8} {'path':>4} | {'wall s':>7} {'cpu s':>7} {'peak MB':>7} {'it':>3} {'n³':>6} {'x floor':>7} | "
        f"{'setup':>6} {'iter':>6} {'assign':>6} | {'recovered':>9} {'same':>6} {'speed-up':>8} {'bound':>8} {'load':>5}"
    )
    print(head)
    print("-" * len(head))
    large_rows, floors = [], {}
    reference_iterations = {}
    for width in large_widths:
        floors[width] = in_subprocess({"floor": width}, 600)
        fl = floors[width]
        if "error" not in fl:
            print(
                f"{width:>5} floor: product {fl['product_s']:.4f} s, Hungarian {fl['assignment_s']:.3f} s (load {fl['load_average'][0]:.1f})"
            )
        for features in [f for f in ("noisy", "mixed", "exact") if f in args.features]:
            base = {"width": width, "layers": 3, "features": features, "solver": "factorised", "threads": args.threads}
            fast = in_subprocess({**base, "variant": "fast"}, 3600)
            ref = None
            projected = width >= 4096 and features == "exact"
            if not args.no_reference:
                ref_spec = {**base, "variant": "reference"}
                if projected:
                    ref_spec["max_iter"] = args.exact_4096_iterations
                ref = in_subprocess(ref_spec, 3600)
                if "error" not in ref and projected:
                    per_iter = ref["seconds"]["iterations"] / max(1, ref["iterations"])
                    its = reference_iterations.get(features, 11)
                    ref["projection"] = {
                        "seconds_per_iteration": per_iter,
                        "iterations_assumed": its,
                        "projected_wall_s": ref["seconds"]["setup"] + per_iter * its + ref["seconds"]["assignment"],
                        "note": f"ran {ref['iterations']} iterations only; iterations assumed = those measured at width 1024",
                    }
                elif "error" not in ref and width == 1024:
                    reference_iterations[features] = ref["iterations"]
            row = {"width": width, "features": features, "fast": fast, "reference": ref, "floor": fl}
            for w_, f_, path in args.reference_npz:
                if int(w_) == width and f_ == features and "error" not in fast:
                    with np.load(path) as f:
                        given = [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]
                    differ = int(sum(np.sum(x != y) for x, y in zip(_load_permutations(fast), given, strict=True)))
                    row["reference_npz"] = {"path": path, "nodes_differing": differ}
                    print(
                        f"{width:>5} {features:>8}  ref | full reference run {path}: {differ} nodes matched differently"
                    )
            for name, r in (("fast", fast), ("ref", ref)):
                if r is None:
                    continue
                if "error" in r:
                    print(f"{width:>5} {features:>8} {name:>4} | error: {r['error']}")
                    continue
                n3 = r["n3_products_total"]
                if "error" not in fl:
                    r["floor_ratio"] = r["wall_s"] / (n3 * fl["product_s"] + 3 * fl["assignment_s"])
                    r["wall_in_products"] = r["wall_s"] / fl["product_s"]
                s_ = r["seconds"]
                same, speed = "", ""
                if name == "fast" and ref is not None and "error" not in ref:
                    if "projection" in ref:
                        row["speedup_wall"] = ref["projection"]["projected_wall_s"] / r["wall_s"]
                        speed = f"{row['speedup_wall']:.0f}x(p)"
                        same = "-"
                    else:
                        pa, pb = _load_permutations(r), _load_permutations(ref)
                        differ = int(sum(np.sum(x != y) for x, y in zip(pa, pb, strict=True)))
                        row["nodes_differing"] = differ
                        row["same_permutations"] = differ == 0
                        row["speedup_wall"] = ref["wall_s"] / r["wall_s"]
                        row["speedup_cpu"] = ref["cpu_s"] / max(r["cpu_s"], 1e-9)
                        same = "yes" if differ == 0 else f"{differ}"
                        speed = f"{row['speedup_wall']:.1f}x"
                bound = (
                    r["residual_bound"] if name == "fast" and r.get("residual_bound") is not None else r["error_bound"]
                )
                print(
                    f"{width:>5} {features:>8} {name:>4} | {r['wall_s']:>7.2f} {r['cpu_s']:>7.2f} {r['peak_rss_mb']:>7.0f} {r['iterations']:>3} "
                    f"{n3:>6.0f} {r.get('floor_ratio', float('nan')):>7.2f} | {s_['setup']:>6.2f} {s_['iterations']:>6.2f} {s_['assignment']:>6.2f} | "
                    f"{r['recovered']:>9.3f} {same:>6} {speed:>8} {bound:>8.1e} {r['load_average'][0]:>5.1f}"
                    + (
                        f"   projected {r['projection']['projected_wall_s']:.0f} s for {r['projection']['iterations_assumed']} iterations"
                        if "projection" in r
                        else ""
                    )
                )
                if name == "fast" and r.get("residual_bound_deterministic") is not None:
                    print(
                        f"{'':>19} | ranks {r['ranks']}, residual bound {r['residual_bound']:.1e} except with probability "
                        f"{r['bound_failure_probability']:.0e} (spectral-norm bounds), {r['residual_bound_deterministic']:.1e} always (Frobenius)"
                    )
            large_rows.append(row)

    group_rows = []
    if args.group_widths:
        print()
        print(
            "Part 3: permutation groups (a residual MLP: a stream written by the stem and two residual blocks, LayerNorm on it,\n"
            "3 groups of `width` units; B = A permuted, 10% noise). mg = peer.ldp.group_matching.match_groups (activations +\n"
            "weight-matching coordinate descent); spec = peer.ldp.matching.groups.match_group_features (factorised spectral\n"
            "matcher over the groups: Rayleigh–Ritz iteration, then refinement). n³ = products counted in n³ units; floor as in\n"
            "part 2 ('x floor' = wall / (n³ · product + 3 · Hungarian)), n³ = the eigensolver's and the refinement's together;\n"
            "recovered: final (spectral solution alone in brackets); differ = elements the two methods match differently."
        )
        head = (
            f"{'width':>5} {'method':>6} | {'wall s':>7} {'cpu s':>7} {'peak MB':>7} {'it':>3} {'n³':>6} {'x floor':>7} | "
            f"{'recovered':>15} {'differ':>6} {'load':>5}"
        )
        print(head)
        print("-" * len(head))
        for width in args.group_widths:
            fl = floors.get(width) or in_subprocess({"floor": width}, 600)
            floors[width] = fl
            if "error" not in fl:
                print(
                    f"{width:>5} floor: product {fl['product_s']:.4f} s, Hungarian {fl['assignment_s']:.3f} s (load {fl['load_average'][0]:.1f})"
                )
            rows = {}
            for method in ("match_groups", "spectral"):
                rows[method] = in_subprocess(
                    {"groups": {"width": width, "method": method, "threads": args.threads}}, 3600
                )
            mg, sp = rows["match_groups"], rows["spectral"]
            if "error" not in mg and "error" not in sp:
                sp["elements_differing_from_match_groups"] = int(
                    sum(
                        np.sum(np.asarray(sp["permutations"][g]) != np.asarray(mg["permutations"][g]))
                        for g in mg["permutations"]
                    )
                )
            for name, r in (("mg", mg), ("spec", sp)):
                if "error" in r:
                    print(f"{width:>5} {name:>6} | error: {r['error']}")
                    continue
                n3 = r.get("n3_products_total")
                ratio = None
                if n3 is not None and "error" not in fl:
                    ratio = r["wall_s"] / (n3 * fl["product_s"] + 3 * fl["assignment_s"])
                    r["floor_ratio"] = ratio
                rec = f"{r['recovered']:.3f}" + (
                    f" ({r['recovered_spectral']:.3f})" if "recovered_spectral" in r else ""
                )
                differ = r.get("elements_differing_from_match_groups")
                print(
                    f"{width:>5} {name:>6} | {r['wall_s']:>7.2f} {r['cpu_s']:>7.2f} {r['peak_rss_mb']:>7.0f} {fmt(r.get('iterations'), 'd'):>3} "
                    f"{fmt(n3, '.0f'):>6} {fmt(ratio):>7} | {rec:>15} {fmt(differ, 'd'):>6} {r['load_average'][0]:>5.1f}"
                )
                r.pop("permutations", None)
            group_rows.append(rows)

    report = {
        "command": "benchmarks/matching.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": {"cpus": os.cpu_count(), "load_average_start": load_start, "load_average_end": os.getloadavg()},
        "seconds": time.time() - started,
        "dense_comparison": dense_rows,
        "factorised": large_rows,
        "floors": floors,
        "groups": group_rows,
        "notes": [
            "Dense comparison: 2 hidden layers at widths 16-96 (joint dense K (2n²)² float64: 2.7 GB at 96) and 3 hidden layers at 32, 64 (1.2 GB at 64).",
            "Part 1 times each solver 3 times on the same pair in its process and reports the minimum (wall_median_s and walls_s hold the rest); part 2 runs once.",
            "peak_rss_mb is the peak resident set while matching (VmHWM reset after building the graphs), graphs and the Python/torch runtime included; rss_before_mb is the resident set just before matching.",
            "The machine is shared with other jobs: compare ratios measured side by side, and cpu_s next to wall_s.",
        ],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.merge and out.exists():
        report = _merged(json.loads(out.read_text()), report)
    out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
