"""A site's own network through the store and the command line, under its own key names."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from site_models import networks
from site_models.networks import randomise

from peer.base.errors import InvalidArgument, Unsupported
from peer.cli.app import main
from peer.nn.imported import (
    build_module,
    export_model,
    import_model,
    load_factory,
    load_imported,
    load_site_state,
    read_weights,
)
from peer.nn.store import load_model

NETWORKS = Path(networks.__file__)


@pytest.mark.parametrize(
    "factory,cls,shape",
    [
        ("clinic_mlp", networks.ClinicMLP, [64]),
        ("residual_mlp", networks.ResidualMLP, [64]),
        ("small_resnet", networks.SmallResNet, [1, 8, 8]),
    ],
)
def test_import_export_round_trip_through_the_cli(tmp_path, capsys, factory, cls, shape):
    trained = randomise(getattr(networks, factory)(), seed=4)
    torch.manual_seed(11)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.1 * torch.randn_like(p))
    weights = tmp_path / "site_weights.pt"
    torch.save(trained.state_dict(), weights)
    site = tmp_path / "site"
    argv = [
        "model",
        "import",
        "--site",
        str(site),
        "--name",
        "m1",
        "--factory",
        f"{NETWORKS}:{factory}",
        "--weights",
        str(weights),
        "--json",
    ]
    if len(shape) > 1:
        argv += ["--input-shape", *map(str, shape)]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["self_check"] == "passed" and out["groups"]
    manifest = json.loads((site / "own_models" / "m1.json").read_text())
    assert manifest["imported"]["factory"] == f"{NETWORKS}:{factory}"
    assert [p["name"] for p in manifest["imported"]["structure"]["parameters"]] == list(trained.state_dict())

    for fmt in ("pt", "safetensors"):
        out_file = tmp_path / f"export.{fmt}"
        assert (
            main(["model", "export", "--site", str(site), "--model", "m1", "--format", fmt, "--out", str(out_file)])
            == 0
        )
        fresh = cls().eval()
        state = torch.load(out_file, weights_only=True) if fmt == "pt" else read_weights(out_file)
        # the site's own keys (a .pt keeps its order too; safetensors sorts its header)
        assert (list(state) if fmt == "pt" else sorted(state)) == (
            list(trained.state_dict()) if fmt == "pt" else sorted(trained.state_dict())
        )
        fresh.load_state_dict(state)
        x = torch.randn(7, *shape, generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            assert torch.equal(fresh(x), trained(x))
    capsys.readouterr()


def test_safetensors_weights_and_module_factory_by_name(tmp_path):
    model = networks.clinic_mlp()
    path = tmp_path / "w.safetensors"
    save_file(model.state_dict(), str(path))
    built = build_module(load_factory("site_models.networks:clinic_mlp", [NETWORKS.parent.parent]))
    load_site_state(built, read_weights(path))
    stored = import_model(tmp_path, "mlp", built, [64], factory="site_models.networks:clinic_mlp")
    again = load_imported(tmp_path, "mlp")
    assert again.structure == stored.structure
    assert all(np.array_equal(again.arrays[k], model.state_dict()[k].numpy()) for k in model.state_dict())
    with pytest.raises(InvalidArgument, match="imported model"):
        load_model(tmp_path, "mlp")
    export_model(again, tmp_path / "back.safetensors", "safetensors")


def test_bad_inputs_are_refused_clearly(tmp_path, capsys):
    model = networks.clinic_mlp()
    state = model.state_dict()
    renamed = {("enc." + k[len("encoder.") :] if k.startswith("encoder.") else k): v for k, v in state.items()}
    with pytest.raises(InvalidArgument, match=r"missing \['encoder.bias', 'encoder.weight'\]"):
        load_site_state(networks.clinic_mlp(), renamed)
    state = dict(state)
    state["classifier.bias"] = torch.full((10,), float("nan"))
    with pytest.raises(InvalidArgument, match=r"weights\[classifier.bias\]"):
        load_site_state(networks.clinic_mlp(), state)
    pickled = tmp_path / "code.pt"
    torch.save({"model": networks.ClinicMLP()}, pickled)  # a whole module: needs unpickling code
    with pytest.raises(InvalidArgument, match="weights_only"):
        read_weights(pickled)
    with pytest.raises(InvalidArgument, match="factory"):
        load_factory("no_colon_here")
    with pytest.raises(InvalidArgument, match="cannot import"):
        load_factory("surely_not_a_module_xyz:f")
    # an unsupported network is refused at import by the CLI, naming the node
    weights = tmp_path / "attn.pt"
    torch.save(networks.WithAttention().state_dict(), weights)
    (tmp_path / "f.py").write_text(
        "from site_models.networks import WithAttention\n\ndef make():\n    return WithAttention()\n"
    )
    import sys

    sys.path.insert(0, str(NETWORKS.parent.parent))
    try:
        rc = main(
            [
                "model",
                "import",
                "--site",
                str(tmp_path / "s"),
                "--name",
                "a",
                "--factory",
                f"{tmp_path / 'f.py'}:make",
                "--weights",
                str(weights),
                "--input-shape",
                "5",
                "16",
            ]
        )
    finally:
        sys.path.remove(str(NETWORKS.parent.parent))
    assert rc == 2 and "model.node[attn]" in capsys.readouterr().err
    assert not (tmp_path / "s" / "own_models" / "a.json").exists()


def test_unsupported_is_an_invalid_argument():
    assert issubclass(Unsupported, InvalidArgument)


def test_an_aliased_network_is_refused_by_model_import_naming_both_keys(tmp_path, capsys):
    """``self.shortcut = self.skip``: torch.save of its state dict holds both names (one tensor),
    and the import used to store them as two units. The command refuses it naming the keys,
    before anything is loaded or stored; so do build_module and load_site_state."""
    weights = tmp_path / "aliased.pt"
    torch.save(networks.aliased_skip().state_dict(), weights)
    assert set(torch.load(weights, weights_only=True)) == {
        "skip.weight",
        "skip.bias",
        "shortcut.weight",
        "shortcut.bias",
    }
    rc = main(
        [
            "model",
            "import",
            "--site",
            str(tmp_path / "s"),
            "--name",
            "aliased",
            "--factory",
            f"{NETWORKS}:aliased_skip",
            "--weights",
            str(weights),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "'skip.weight' = 'shortcut.weight'; 'skip.bias' = 'shortcut.bias'" in err
    assert not (tmp_path / "s" / "own_models" / "aliased.json").exists()
    with pytest.raises(Unsupported, match=r"model\.state_dict"):
        build_module(networks.aliased_skip)
    with pytest.raises(Unsupported, match=r"model\.state_dict"):
        load_site_state(networks.TiedLinear(), networks.TiedLinear().state_dict())
