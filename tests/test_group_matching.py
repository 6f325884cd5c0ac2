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
    np.testing.assert_allclose(f["stage1.bn1.running_var"], 0.25 * a["stage1.bn1.running_var"] + 0.75 * b["stage1.bn1.running_var"], rtol=1e-6)
    assert f["stage1.bn1.num_batches_tracked"].dtype == a["stage1.bn1.num_batches_tracked"].dtype
    with pytest.raises(InvalidArgument, match="alpha"):
        fuse_state(s, a, b, -0.1)
    with pytest.raises(InvalidArgument, match="arrays_b"):
        match_groups(s, a, {k: v for k, v in b.items() if k != "fc.weight"})
