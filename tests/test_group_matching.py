"""Group matching: recovers a permuted copy of a residual network; fusion over the whole state."""

from copy import deepcopy as copy_module

import numpy as np
import pytest
import torch
from site_models import networks
from site_models.networks import randomise
from torch import nn

from peer.base.errors import InvalidArgument
from peer.ldp.group_matching import (
    fuse_state,
    group_activations,
    group_correlations,
    match_correlations,
    match_groups,
)
from peer.nn.tracing import import_structure, permute_state, random_permutations


def _arrays(m):
    return {k: v.detach().numpy().copy() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("factory,shape", [(networks.small_resnet, [1, 8, 8]), (networks.residual_mlp, [64])])
def test_a_permuted_copy_is_recovered_exactly(factory, shape):
    model = randomise(factory(), seed=3)
    s = import_structure(model, shape)
    a = _arrays(model)
    perms = random_permutations(s, np.random.default_rng(1))
    b = permute_state(s, a, perms)
    copy = randomise(factory(), seed=9)
    copy.load_state_dict({k: torch.as_tensor(v) for k, v in b.items()})
    probes = torch.randn(64, *shape, generator=torch.Generator().manual_seed(0))
    fa, fb = group_activations(model, s, probes), group_activations(copy, s, probes)
    assert all(fa[g.name].shape[0] == g.size for g in s.groups)
    for kwargs in ({"activations_a": fa, "activations_b": fb}, {}):  # with activations, and weights alone
        found = match_groups(s, a, b, **kwargs)
        for g, p in perms.items():
            assert np.array_equal(found[g], np.argsort(p)), g
    aligned = permute_state(s, b, found)
    for k in a:
        np.testing.assert_array_equal(aligned[k], a[k])


def test_fuse_state_interpolates_floats_and_keeps_counters():
    model = randomise(networks.small_resnet())
    s = import_structure(model, [1, 8, 8])
    a = _arrays(model)
    b = _arrays(randomise(networks.SmallResNet(), seed=5))
    f = fuse_state(s, a, b, 0.25)
    np.testing.assert_allclose(
        f["stage1.bn1.running_var"], 0.25 * a["stage1.bn1.running_var"] + 0.75 * b["stage1.bn1.running_var"], rtol=1e-6
    )
    assert f["stage1.bn1.num_batches_tracked"].dtype == a["stage1.bn1.num_batches_tracked"].dtype
    with pytest.raises(InvalidArgument, match="alpha"):
        fuse_state(s, a, b, -0.1)
    with pytest.raises(InvalidArgument, match="arrays_b"):
        match_groups(s, a, {k: v for k, v in b.items() if k != "fc.weight"})


def test_group_graph_nodes_move_with_their_permutation():
    from peer.nn.graph import extract_group_graph

    model = randomise(networks.small_resnet(), seed=3)
    s = import_structure(model, [1, 8, 8])
    probes = torch.randn(32, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    graph = extract_group_graph(model, s, probes).by_name()
    stem = graph["stem"]
    # written by the stem conv (1·3·3) and stage 1's second conv (8·3·3), both without bias;
    # pooled over those two and the two BatchNorms normalising the stream
    assert stem.incoming.shape == (8, 9 + 72) and stem.members == ("stem", "stage1.conv2", "stem_bn", "stage1.bn2")
    assert stem.activations.shape == (8, 32 * 4)
    assert graph["widen"].incoming.shape == (16, 8 * 9 + 1 + 16 * 9)  # widen (with bias), stage2.conv2
    perms = random_permutations(s, np.random.default_rng(4))
    copy = networks.SmallResNet().eval()
    copy.load_state_dict(permute_state(s, model.state_dict(), perms))
    moved = extract_group_graph(copy, s, probes).by_name()
    for g, p in perms.items():
        # node i of the copy is node p[i] of the original; incoming rows also see their inputs
        # permuted, so compare the activations (which do not)
        np.testing.assert_allclose(moved[g].activations, graph[g].activations[p], rtol=1e-9, atol=1e-6)


def _digits_cnn():
    from peer.nn.architectures import build_model

    arch = {
        "kind": "cnn",
        "input_shape": [1, 8, 8],
        "channels": [6, 12],
        "pool": [2, 2],
        "hidden": [20],
        "output_dim": 10,
    }
    return build_model(arch, seed=0).eval()


def _tv_resnet():
    torch.manual_seed(0)
    return networks.TVResNet()


@pytest.mark.parametrize(
    "factory,shape",
    [
        (networks.small_resnet, [1, 8, 8]),
        (networks.residual_mlp, [64]),
        (_tv_resnet, [3, 16, 16]),  # 1×1 projection shortcuts with their own BatchNorms
        (_digits_cnn, [1, 8, 8]),  # a Linear reading a flattened (C, H, W) map
    ],
)
def test_activation_matching_recovers_a_permuted_copy_which_fuses_to_itself_at_any_alpha(factory, shape):
    """A network and a copy with every group randomly permuted: each unit correlates exactly 1
    with its own copy (units dead on x through their pre-activations, which these random
    networks have plenty of), the linear assignments give back the permutation, and the α-fusion with
    the re-aligned copy *is* the network at every α (BatchNorm statistics included)."""
    model = randomise(factory(), seed=3)
    x = torch.randn(72, *shape, generator=torch.Generator().manual_seed(0))
    s = import_structure(model, shape)
    a = _arrays(model)
    perms = random_permutations(s, np.random.default_rng(1))
    b = permute_state(s, a, perms)
    copy = randomise(factory(), seed=9)
    copy.load_state_dict({k: torch.as_tensor(v) for k, v in b.items()})
    corr = group_correlations(model, copy, s, x, batch_size=32)  # batches that do not divide 72
    for g, p in perms.items():
        truth = np.argsort(p)
        np.testing.assert_allclose(np.diag(corr[g][:, truth]), 1.0, atol=1e-9)
        assert np.all(np.abs(corr[g]) <= 1 + 1e-9)
    found = match_correlations(s, corr)
    for g, p in perms.items():
        assert np.array_equal(found[g], np.argsort(p)), g
    aligned = permute_state(s, b, found)
    with torch.no_grad():
        y = model(x)
        for alpha in (0.0, 0.3, 0.5, 0.9):
            fused = randomise(factory(), seed=11)
            fused.load_state_dict({k: torch.as_tensor(v) for k, v in fuse_state(s, a, aligned, alpha).items()})
            torch.testing.assert_close(fused(x), y, rtol=1e-5, atol=1e-5)


def test_correlations_are_read_where_the_next_layer_reads_the_units():
    from peer.ldp.group_matching import _read_points

    model = networks.small_resnet()
    s = import_structure(model, [1, 8, 8])
    assert _read_points(model, s) == {
        "stem": [("stage1.conv1", 1), ("widen", 1)],  # the residual stream, read by every block
        "stage1.conv1": [("stage1.conv2", 1)],
        "widen": [("stage2.conv1", 1), ("fc", 16)],  # fc reads 16 positions per channel
        "stage2.conv1": [("stage2.conv2", 1)],
    }


def test_models_trained_from_one_initialisation_are_matched_to_the_identity():
    """Two copies of one initialisation, each trained 30 Adam steps on its own random data: their
    units still correspond one to one, and activation matching must say so."""
    start = networks.residual_mlp()
    s = import_structure(start, [64])
    models = []
    for seed in (1, 2):
        m = copy_module(start).train()
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(256, 64, generator=g), torch.randint(0, 10, (256,), generator=g)
        opt = torch.optim.Adam(m.parameters(), lr=1e-3)
        for i in range(30):
            opt.zero_grad()
            nn.functional.cross_entropy(m(x[i % 8 * 32 : i % 8 * 32 + 32]), y[i % 8 * 32 : i % 8 * 32 + 32]).backward()
            opt.step()
        models.append(m.eval())
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(0))
    found = match_correlations(s, group_correlations(models[0], models[1], s, x))
    for g in s.groups:
        assert np.array_equal(found[g.name], np.arange(g.size)), g.name


def test_match_correlations_checks_its_input():
    model = networks.small_resnet()
    s = import_structure(model, [1, 8, 8])
    good = {g.name: np.eye(g.size) for g in s.groups}
    assert all(np.array_equal(p, np.arange(len(p))) for p in match_correlations(s, good).values())
    with pytest.raises(InvalidArgument, match=r"correlations\[widen\]"):
        match_correlations(s, {**good, "widen": np.eye(3)})
    with pytest.raises(InvalidArgument, match=r"correlations\[stem\]"):
        match_correlations(s, {k: v for k, v in good.items() if k != "stem"})
    with pytest.raises(InvalidArgument, match="x"):
        group_correlations(model, model, s, torch.zeros(0, 1, 8, 8))
