import json

import numpy as np
import pytest

from peer.base.errors import InvalidArgument, NotFound
from peer.nn.architectures import build_model, state_arrays
from peer.nn.store import list_models, load_model, save_model

MLP = {"kind": "mlp", "input_dim": 8, "hidden": [4], "output_dim": 3}


def test_save_load_round_trip(tmp_path):
    arrays = state_arrays(build_model(MLP, seed=0))
    save_model(tmp_path, "site-a.m1", MLP, arrays, {"accuracy": 0.9})
    m = load_model(tmp_path, "site-a.m1")
    assert m.metadata == {"accuracy": 0.9} and m.architecture["hidden"] == [4]
    for k in arrays:
        assert np.array_equal(arrays[k], m.arrays[k])
    assert list_models(tmp_path) == ["site-a.m1"]
    assert not list(tmp_path.glob("*.tmp"))


def test_bad_names_and_missing_models(tmp_path):
    with pytest.raises(InvalidArgument, match="name"):
        save_model(tmp_path, "../escape", MLP, state_arrays(build_model(MLP)))
    with pytest.raises(NotFound):
        load_model(tmp_path, "absent")


def test_corrupt_files_are_refused(tmp_path):
    save_model(tmp_path, "m", MLP, state_arrays(build_model(MLP, seed=0)))
    (tmp_path / "m.safetensors").write_bytes(b"garbage")
    with pytest.raises(InvalidArgument, match="safetensors"):
        load_model(tmp_path, "m")
    save_model(tmp_path, "m", MLP, state_arrays(build_model(MLP, seed=0)))
    manifest = json.loads((tmp_path / "m.json").read_text())
    manifest["architecture"]["hidden"] = [5]
    (tmp_path / "m.json").write_text(json.dumps(manifest))
    with pytest.raises(InvalidArgument, match="weights"):
        load_model(tmp_path, "m")


def test_each_model_kind_says_which_architecture_its_releases_carry(tmp_path):
    """The model store, and only it, knows a model's kind: a built-in model's releases carry its
    JSON description, a site's own network's its traced structure and digest (never code);
    peer.net.site.Site.architecture_of reads ``release_architecture`` without asking the kind."""
    from peer.net.site import Site
    from peer.nn.architectures import validate_architecture
    from peer.nn.imported import import_model, imported_architecture, load_imported

    save_model(tmp_path, "builtin", MLP, state_arrays(build_model(MLP, seed=0)))
    builtin = load_model(tmp_path, "builtin")
    import_model(tmp_path / "own", "own", build_model(MLP, seed=1), [8], factory="not.used:factory")
    own = load_imported(tmp_path / "own", "own")
    assert builtin.release_architecture == builtin.architecture == validate_architecture(MLP)
    assert Site.architecture_of(builtin) == builtin.architecture
    assert own.release_architecture == imported_architecture(own.structure) == Site.architecture_of(own)
    assert own.release_architecture["kind"] == "imported"
