"""How much a result moves when only the CPU's kernels change: `privfusion experiment fusion`
run under each kernel set a machine can be told to use, with everything else fixed.

    python benchmarks/kernel_spread.py --model cnn --seeds 0 1 --threads 1 2 [--json OUT.json]

Each run is a fresh process with one kernel set forced for all three numeric libraries torch
uses on the CPU: ATen's own vectorised kernels (``ATEN_CPU_CAPABILITY``), MKL's BLAS
(``MKL_ENABLE_INSTRUCTIONS``) and oneDNN's convolutions (``ONEDNN_MAX_CPU_ISA``):

- ``native``: whatever the machine offers (AVX-512 on the machines these figures came from);
- ``avx2``: AVX2 only, as on most older servers and laptops;
- ``default``: no vector extensions beyond SSE4 (ATen's scalar path).

A kernel set only changes the order in which floating-point sums are taken (vector width,
blocking, thread split), so a single matrix product differs in its last bits; 80 epochs of SGD
turn those bits into a different model. That is why a seeded result is reproducible bit for
bit on one machine and kernel set, and not across them: docs/experiments.md, "Reproducibility
across machines", lists the spreads this script measured and how the tests' margins follow
from them. The table printed (and the JSON) gives each run's methods' accuracies and, per
method, the range over all runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

KERNELS = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "default": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"},
}

RUNNER = """
import json, sys, torch
torch.set_num_threads(int(sys.argv[3]))
from peer.experiments.fusion import FusionConfig, run_split
cfg = FusionConfig(model=sys.argv[1], seed=int(sys.argv[2]), epsilons=(), alphas=(0.0, 0.5, 1.0))
out = {"capability": torch.backends.cpu.get_cpu_capability()}
for split in ("homogeneous", "heterogeneous"):
    r = run_split(cfg, split)
    out[split] = dict(r.methods, agreement=r.permutation_agreement.get("activation_matching"))
print(json.dumps(out))
"""


def run_one(model: str, seed: int, kernels: str, threads: int) -> dict:
    env = dict(os.environ, **KERNELS[kernels])
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, model, str(seed), str(threads)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{kernels} seed {seed}: exited {proc.returncode}\n{proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"seed": seed, "kernels": kernels, "threads": threads, "seconds": time.monotonic() - started, **out}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["mlp", "cnn", "resnet"], default="cnn")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--kernels", nargs="+", choices=list(KERNELS), default=list(KERNELS))
    p.add_argument("--threads", type=int, nargs="+", default=[1])
    p.add_argument("--json", metavar="OUT", help="also write every run as JSON")
    args = p.parse_args()
    runs = [run_one(args.model, s, k, t) for s in args.seeds for k in args.kernels for t in args.threads]
    methods = sorted({m for r in runs for m in r["homogeneous"] if m != "agreement"})
    for split in ("homogeneous", "heterogeneous"):
        print(f"\n{args.model}, {split}")
        print(
            f"{'method':<28}" + "".join(f"{r['kernels'][:7]:>8}/{r['seed']}/{r['threads']}" for r in runs) + "   range"
        )
        for m in methods:
            values = [r[split][m] for r in runs]
            cells = "".join(f"{v:>12.4f}" for v in values)
            print(f"{m:<28}{cells}   {max(values) - min(values):.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
