"""REPAIR: fused units get the interpolated endpoint statistics; a fused pair gets better."""

import numpy as np
import pytest
import torch
from site_models import networks
from site_models.networks import randomise
from torch import nn

from peer.base.errors import InvalidArgument
from peer.ldp.repair import (
    fine_tune,
    interpolated_statistics,
    repair,
    repair_fused,
    repair_fusion,
    unit_statistics,
)
from peer.nn.tracing import (
    StatPoint,
    derive_structure,
    import_structure,
    permute_state,
    random_permutations,
)


def _fuse(a: nn.Module, b_state: dict, alpha: float, template: nn.Module) -> nn.Module:
    fused = template
    sa = a.state_dict()
    fused.load_state_dict(
        {k: (alpha * v + (1 - alpha) * b_state[k]) if v.is_floating_point() else v for k, v in sa.items()}
    )
    return fused.eval()


def test_repair_sets_exactly_the_interpolated_moments():
    """Two unrelated residual MLPs averaged: the fused units' variance collapses; after
    REPAIR every statistic point has the target mean and std on the data it was fitted on."""
    x = torch.randn(400, 64, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    a = networks.ResidualMLP().eval()
    torch.manual_seed(2)
    b = networks.ResidualMLP().eval()
    s = import_structure(a, [64])
    fused = _fuse(a, b.state_dict(), 0.5, networks.ResidualMLP())
    sa, sb = unit_statistics(a, s.stat_points, x), unit_statistics(b, s.stat_points, x)
    sf = unit_statistics(fused, s.stat_points, x)
    targets = interpolated_statistics(sa, sb, 0.5)
    first = s.stat_points[0].module
    # unrelated units average towards zero variance: std/√2 in expectation for independent units
    assert np.mean(sf[first].std) < 0.8 * np.mean(targets[first].std)
    repaired = repair(fused, s.stat_points, targets, x)
    after = unit_statistics(repaired, s.stat_points, x)
    for p in s.stat_points:
        np.testing.assert_allclose(after[p.module].mean, targets[p.module].mean, atol=1e-4)
        np.testing.assert_allclose(after[p.module].std, targets[p.module].std, rtol=1e-4, atol=1e-6)
    # the input is untouched: repair works on a copy
    assert torch.equal(
        fused.state_dict()["stem.weight"],
        _fuse(a, b.state_dict(), 0.5, networks.ResidualMLP()).state_dict()["stem.weight"],
    )


def test_batchnorm_points_get_the_fused_networks_actual_statistics():
    x = torch.randn(300, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    a, b = randomise(networks.small_resnet(), seed=1), randomise(networks.SmallResNet(), seed=2)
    s = import_structure(a, [1, 8, 8])
    fused = _fuse(a, b.state_dict(), 0.5, networks.SmallResNet())
    repaired = repair_fusion(fused, a, b, s.stat_points, 0.5, x)
    # each BatchNorm now standardises its input on x: its pre-affine output has mean 0, std 1
    bn = repaired.stage1.bn1
    seen = []
    handle = bn.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    with torch.no_grad():
        repaired(x)
    handle.remove()
    z = (seen[0] - bn.running_mean[None, :, None, None]) / torch.sqrt(bn.running_var[None, :, None, None] + bn.eps)
    np.testing.assert_allclose(z.mean(dim=(0, 2, 3)).numpy(), 0, atol=1e-4)
    np.testing.assert_allclose(z.std(dim=(0, 2, 3), unbiased=False).numpy(), 1, atol=1e-3)


def test_repair_commutes_with_permutation_and_checks_its_inputs():
    """Repairing an aligned copy equals aligning the repaired network (REPAIR is per unit)."""
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(0))
    a = networks.residual_mlp()
    s = derive_structure(a, [64])
    torch.manual_seed(5)
    b = networks.ResidualMLP().eval()
    fused = _fuse(a, b.state_dict(), 0.3, networks.ResidualMLP())
    r1 = repair_fusion(fused, a, b, s.stat_points, 0.3, x)
    perms = random_permutations(s, np.random.default_rng(0))
    pa, pb, pf = (networks.ResidualMLP().eval() for _ in range(3))
    pa.load_state_dict(permute_state(s, a.state_dict(), perms))
    pb.load_state_dict(permute_state(s, b.state_dict(), perms))
    pf.load_state_dict(permute_state(s, fused.state_dict(), perms))
    r2 = repair_fusion(pf, pa, pb, s.stat_points, 0.3, x)
    for k, v in permute_state(s, r1.state_dict(), perms).items():
        torch.testing.assert_close(r2.state_dict()[k], v, rtol=1e-4, atol=1e-5)
    with pytest.raises(InvalidArgument, match="alpha"):
        interpolated_statistics({}, {}, 1.5)
    with pytest.raises(InvalidArgument, match="no target"):
        repair(fused, s.stat_points, {}, x)


def test_repair_improves_a_graph_matched_fused_pair_on_digits():
    """Two digits CNNs (different seeds, disjoint halves of the data), aligned by non-private
    graph matching on a public probe set and fused at α = ½: REPAIR with A's own records must
    raise test accuracy. Deterministic (fixed seeds, one thread); measured: endpoints 88.0% and
    89.1%, fused 61.1%, repaired 71.6%."""
    from peer.experiments.fusion import public_probes
    from peer.ldp.fusion import fuse_arrays, permute_arrays
    from peer.ldp.matching import match_graphs
    from peer.nn.architectures import (
        accuracy,
        input_tensor,
        model_from_arrays,
        state_arrays,
        train_classifier,
    )
    from peer.nn.data import load_dataset, split_homogeneous
    from peer.nn.graph import extract_graph

    arch = {
        "kind": "cnn",
        "input_shape": [1, 8, 8],
        "channels": [8, 16],
        "kernel_size": 3,
        "pool": [2, 2],
        "hidden": [32],
        "output_dim": 10,
    }
    ds = load_dataset("digits", seed=0)
    order = np.random.default_rng(0).permutation(len(ds.y_train))
    probe = public_probes(ds.x_train[order[:64]], True)
    x_tr, y_tr = ds.x_train[order[64:]], ds.y_train[order[64:]]
    parts = split_homogeneous(y_tr, 2, seed=0)
    ma, mb = (train_classifier(arch, x_tr[p], y_tr[p], seed=1 + i, epochs=40) for i, p in enumerate(parts))
    a, b = state_arrays(ma), state_arrays(mb)
    gm = match_graphs(extract_graph(arch, ma, probe), extract_graph(arch, mb, probe))
    b_aligned = permute_arrays(arch, b, gm.permutations)
    fused = model_from_arrays(arch, fuse_arrays(a, b_aligned, 0.5))
    s = derive_structure(ma, [1, 8, 8])
    xa = input_tensor(arch, x_tr[parts[0]])
    repaired = repair_fusion(fused, ma, model_from_arrays(arch, b_aligned), s.stat_points, 0.5, xa)
    before = accuracy(arch, fused, ds.x_test, ds.y_test)
    after = accuracy(arch, repaired, ds.x_test, ds.y_test)
    assert after > before + 0.01, (before, after)
    tuned = fine_tune(repaired, xa, y_tr[parts[0]], seed=0, epochs=2)
    assert accuracy(arch, tuned, ds.x_test, ds.y_test) > 0.5


def test_repair_of_a_cnn_sets_per_channel_moments_over_records_and_positions_and_is_idle_on_a_self_fusion():
    """On a CNN without BatchNorm every conv (and the hidden Linear) is an affine point: after
    REPAIR each channel's mean and std over (N, H, W) are the targets; and fusing a network with
    a permuted copy of itself, re-aligned, leaves nothing to repair (targets = its own moments)."""
    from peer.nn.architectures import build_model

    arch = {"kind": "cnn", "input_shape": [1, 8, 8], "channels": [6, 12], "pool": [2, 2], "hidden": [20]}
    arch["output_dim"] = 10
    a, b = build_model(arch, seed=1).eval(), build_model(arch, seed=2).eval()
    s = import_structure(a, [1, 8, 8])
    assert [(p.module, p.kind) for p in s.stat_points] == [("0", "affine"), ("3", "affine"), ("7", "affine")]
    x = torch.randn(200, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    fused = _fuse(a, b.state_dict(), 0.5, build_model(arch))
    repaired = repair_fusion(fused, a, b, s.stat_points, 0.5, x)
    targets = interpolated_statistics(unit_statistics(a, s.stat_points, x), unit_statistics(b, s.stat_points, x), 0.5)
    outs = {}
    hooks = [
        dict(repaired.named_modules())[p.module].register_forward_hook(
            lambda m, args, out, name=p.module: outs.__setitem__(name, out)
        )
        for p in s.stat_points
    ]
    with torch.no_grad():
        repaired(x)
    for h in hooks:
        h.remove()
    for name in ("0", "3"):  # conv outputs (N, C, H, W): moments per channel over N, H, W
        t = outs[name].double()
        np.testing.assert_allclose(t.mean(dim=(0, 2, 3)).numpy(), targets[name].mean, atol=1e-4)
        np.testing.assert_allclose(t.std(dim=(0, 2, 3), unbiased=False).numpy(), targets[name].std, rtol=1e-4)
    perms = random_permutations(s, np.random.default_rng(0))
    copy = build_model(arch).eval()
    copy.load_state_dict(permute_state(s, a.state_dict(), perms))
    aligned = permute_state(s, copy.state_dict(), {g: np.argsort(p) for g, p in perms.items()})
    self_fused = _fuse(a, aligned, 0.3, build_model(arch))
    again = repair_fusion(self_fused, a, self_fused, s.stat_points, 0.3, x)
    with torch.no_grad():
        torch.testing.assert_close(again(x), a(x), rtol=1e-4, atol=1e-4)


def test_fine_tune_never_hands_batchnorm_a_single_row():
    """65 records in batches of 64 leave one row over: it joins the batch before it (BatchNorm1d
    in training mode cannot normalise one row); exactly one record is refused by name."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(65, 4)).astype(np.float32), rng.integers(0, 2, 65)
    tuned = fine_tune(model, x, y, seed=0, epochs=2, batch_size=64)
    assert not torch.equal(tuned[0].weight, model[0].weight) and not tuned.training
    # the row over joined its batch (no row lost): one batch of all 65 rows trains identically
    whole = fine_tune(model, x, y, seed=0, epochs=2, batch_size=65)
    assert all(torch.equal(a, b) for a, b in zip(tuned.state_dict().values(), whole.state_dict().values(), strict=True))
    with pytest.raises(InvalidArgument, match="single row"):
        fine_tune(model, x[:1], y[:1], seed=0)
    # without BatchNorm a single record is fine-tuned as before
    plain = nn.Sequential(nn.Linear(4, 2))
    assert not torch.equal(fine_tune(plain, x[:1], y[:1], seed=0, epochs=1)[0].weight, plain[0].weight)


def _states_equal(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_repair_in_one_pass_is_the_per_point_repair_bit_for_bit(monkeypatch):
    """Data of one batch is repaired in one forward pass (each point by a hook as the pass
    reaches it); the result is the per-point repair's (one pass per point) exactly, BatchNorm
    resets and affine rescales alike; the per-point path is forced by switching the one-pass
    one off."""
    import peer.ldp.repair as repair_module

    torch.manual_seed(0)
    endpoints = [randomise(networks.SmallResNet()).eval() for _ in range(3)]
    structure = import_structure(endpoints[0], (1, 8, 8))
    kinds = {p.kind for p in structure.stat_points}
    assert kinds == {"affine", "batchnorm"}
    x = np.random.default_rng(0).normal(size=(120, 1, 8, 8)).astype(np.float32)
    fused = randomise(networks.SmallResNet()).eval()
    passes = []
    hook = fused.register_forward_pre_hook(lambda m, a: passes.append(a[0].shape[0]))
    one = repair_fused(fused, endpoints, [0.5, 0.25, 0.25], structure.stat_points, x)
    hook.remove()
    assert passes == [120]  # the repaired copy (it carries the hook) ran once, on all the data
    monkeypatch.setattr(repair_module, "_repair_in_one_pass", lambda *a: None)
    per_point = repair_fused(fused, endpoints, [0.5, 0.25, 0.25], structure.stat_points, x)
    assert _states_equal(one, per_point)
    assert not _states_equal(one, fused)  # it did repair something


class _TwiceHidden(nn.Module):
    """A hidden Linear applied twice in one pass (weights shared by two uses)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.relu(self.a(torch.relu(self.a(x)))))


def test_a_module_run_twice_in_a_pass_is_repaired_point_by_point(monkeypatch):
    """The one-pass repair cannot tell a module's second run from its first: it gives way to
    the per-point repair, whose result it then is."""
    import peer.ldp.repair as repair_module

    torch.manual_seed(1)
    fused, a, b = (_TwiceHidden().eval() for _ in range(3))
    points = [StatPoint("a", "affine", "g0")]
    x = np.random.default_rng(1).normal(size=(50, 4)).astype(np.float32)
    targets = interpolated_statistics(unit_statistics(a, points, x), unit_statistics(b, points, x), 0.5)
    assert repair_module._repair_in_one_pass(fused, points, targets, x, 512) is None
    got = repair(fused, points, targets, x)
    monkeypatch.setattr(repair_module, "_repair_in_one_pass", lambda *a: None)
    assert _states_equal(got, repair(fused, points, targets, x))
