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
