"""Fusion of a site's own ResNet with a peer's DP-SGD model of the same network (digits), with
the production steps of a ``merged`` round, in one process (no daemons: the e2e test
``tests/test_imported_e2e.py`` runs the same steps through them).

    .venv/bin/python benchmarks/imported_fusion.py [--steps 30 --noise 5 --q 1] [--optimizer adam --lr 0.01] [--seed 1] [--alpha 0.5 0.7 0.9]

Site A and site B each train the small ResNet of the e2e test (conv → BN → relu, two residual
blocks, pooling, Linear) on their own half of digits' protected records (Adam, non-private,
local). B's pool model is DP-SGD from the factory's public initialisation on B's half
(``peer.dp.training.train_dpsgd_module``: eval mode, BatchNorm statistics of the public
validation split per step), its privatised gradients fed to ``--optimizer`` (sgd, momentum or
adam: post-processing, so the same ε for the same steps). A aligns what it receives by group matching on a public probe
set (128 validation rows), fuses α·A + (1 − α)·B_aligned, and repairs (BatchNorm statistics
reset on the probe set) — ``peer.ldp.pipeline.align_groups / average_states /
repair_states``. Prints test accuracy of: own A, own B, B's DP model, fused and fused + REPAIR
for each α, and the same with B's own (non-private) network as the oracle partner; and A with
its BatchNorm statistics reset on the probe set alone (no fusion), the honest reference for
"fused + REPAIR".
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch import nn

from peer.base.rng import make_randomness
from peer.dp.accounting import Optimizer, TrainingRecord
from peer.dp.pools import load_splits
from peer.dp.training import train_dpsgd_module
from peer.ldp.pipeline import align_groups, average_states, repair_states
from peer.nn.imported import imported_architecture, input_batch, module_accuracy, module_from_arrays
from peer.nn.tracing import import_structure


class Block(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv_a = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm_a = nn.BatchNorm2d(channels)
        self.conv_b = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm_b = nn.BatchNorm2d(channels)

    def forward(self, x):
        h = F.relu(self.norm_a(self.conv_a(x)))
        return F.relu(x + self.norm_b(self.conv_b(h)))


class DigitsResNet(nn.Module):
    def __init__(self, width=12, classes=10):
        super().__init__()
        self.entry = nn.Conv2d(1, width, 3, padding=1, bias=False)
        self.entry_norm = nn.BatchNorm2d(width)
        self.res1 = Block(width)
        self.res2 = Block(width)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(width, classes)

    def forward(self, x):
        x = F.relu(self.entry_norm(self.entry(x)))
        x = self.res2(self.res1(x))
        return self.classifier(self.pool(x).flatten(1))


def train_own(x, y, seed: int, epochs: int) -> nn.Module:
    torch.manual_seed(seed)
    model = DigitsResNet()
    xt, yt = torch.as_tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8), torch.as_tensor(y)
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        model.train()
        order = torch.randperm(len(xt), generator=gen)
        for i in range(0, len(xt), 32):
            b = order[i : i + 32]
            opt.zero_grad()
            F.cross_entropy(model(xt[b]), yt[b]).backward()
            opt.step()
    return model.eval()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--optimizer", choices=("sgd", "momentum", "adam"), default="sgd")
    ap.add_argument("--lr", type=float, default=None, help="default: 4 (sgd), 0.4 (momentum), 0.01 (adam)")
    ap.add_argument("--noise", type=float, default=5.0)
    ap.add_argument("--q", type=float, default=1.0, help="Poisson sample rate (default 1: full batch)")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--seed", type=int, default=1, help="fixed seed of the DP-SGD noise (default 1)")
    ap.add_argument("--alpha", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    args = ap.parse_args()
    torch.set_num_threads(1)
    s = load_splits("digits")
    n = len(s.y_train)
    a = train_own(s.x_train[: n // 2], s.y_train[: n // 2], 10, args.epochs)
    b = train_own(s.x_train[n // 2 :], s.y_train[n // 2 :], 11, args.epochs)
    structure = import_structure(a, [1, 8, 8])
    t0 = time.monotonic()
    lr = args.lr if args.lr is not None else {"sgd": 4.0, "momentum": 0.4, "adam": 0.01}[args.optimizer]
    training = TrainingRecord.constant(
        "replace-one", args.steps, lr, 1.0, args.noise, args.q, optimizer=Optimizer(args.optimizer)
    )
    dp = train_dpsgd_module(
        DigitsResNet,
        imported_architecture(structure),
        [1, 8, 8],
        s.x_train[n // 2 :],
        s.y_train[n // 2 :],
        training,
        init_seed=0,
        randomness=make_randomness(args.seed),
        delta=1e-5,
        public_x=s.x_val,
    )
    dp_model = module_from_arrays(DigitsResNet, structure, dp.arrays)
    dp_seconds = time.monotonic() - t0

    def acc(m):
        return round(module_accuracy(m, structure, s.x_test, s.y_test), 4)

    probe = input_batch(structure, s.x_val[:128])
    own_a = {k: v.numpy() for k, v in a.state_dict().items()}
    rows = {
        "own A": acc(a),
        "own B": acc(b),
        # the same BatchNorm reset on the probe set applied to A alone: what REPAIR's reset is
        # worth without any fusion (A's running statistics come from its training batches)
        "own A + BN reset on the probe set": acc(repair_states(structure, a, [a], [1.0], probe)),
        f"B's DP-SGD model ({args.optimizer}, lr {lr:g}; eps {dp.record.epsilon:.2f} at delta 1e-5, "
        f"{dp_seconds:.0f}s)": acc(dp_model),
    }
    for label, partner in (("DP", dp_model), ("oracle (B's own)", b)):
        aligned = align_groups(structure, a, partner, probe).apply(
            structure, {k: v.numpy() for k, v in partner.state_dict().items()}
        )
        partner_aligned = module_from_arrays(DigitsResNet, structure, aligned)
        for alpha in args.alpha:
            fused = module_from_arrays(
                DigitsResNet, structure, average_states(structure, [own_a, aligned], [alpha, 1 - alpha])
            )
            repaired = repair_states(structure, fused, [a, partner_aligned], [alpha, 1 - alpha], probe)
            rows[f"{label} alpha={alpha}: fused"] = acc(fused)
            rows[f"{label} alpha={alpha}: fused + REPAIR"] = acc(repaired)
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
