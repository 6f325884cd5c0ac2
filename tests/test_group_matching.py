"""Group matching: recovers a permuted copy of a residual network; fusion over the whole state."""

import numpy as np
import pytest
import torch
from site_models import networks
from site_models.networks import randomise

from peer.base.errors import InvalidArgument
from peer.ldp.group_matching import fuse_state, group_activations, match_groups
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
