"""peer.nn.probes: input signatures of models and probe files, and the rule that binds them."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from peer.base.errors import FailedPrecondition, InvalidArgument
from peer.nn.images import ImagePreprocessing
from peer.nn.probes import (
    INPUT_KEY,
    check_probe_input,
    describe_input,
    input_signature,
    model_input,
    probe_bytes,
    read_probe,
)
from peer.nn.store import StoredModel
from peer.nn.tables import ColumnPrep, Preprocessing

SECRET_CATEGORY = "ward-of-patient-17"


def table(*names: str) -> Preprocessing:
    columns = tuple(
        ColumnPrep(n, "categorical", categories=("A", SECRET_CATEGORY))
        if n == "ward"
        else ColumnPrep(n, "numeric", 1.0, 2.0)
        for n in names
    )
    return Preprocessing("outcome", (0, 1), columns)


def images(channels: int, size: tuple[int, int]) -> ImagePreprocessing:
    return ImagePreprocessing(
        "folder", ("a", "b"), (), channels=channels, size=size, mean=(0.5,) * channels, std=(0.2,) * channels
    )


def test_a_signature_holds_public_structure_only():
    sig = input_signature(table("age", "ward", "bp"))
    assert sig == {
        "kind": "table",
        "columns": [["age", "numeric", 1], ["ward", "categorical", 2], ["bp", "numeric", 1]],
        "width": 4,
    }
    text = json.dumps(sig) + describe_input(sig)
    assert SECRET_CATEGORY not in text and "2.0" not in text  # no category, no statistic
    assert describe_input(sig) == "table columns age, ward (2 one-hot), bp (4 entries)"
    assert input_signature(images(3, (8, 8))) == {"kind": "images", "channels": 3, "size": [8, 8], "width": 192}
    assert input_signature(None, [1, 8, 8]) == {"kind": "unprepared", "shape": [1, 8, 8], "width": 64}
    with pytest.raises(InvalidArgument, match="input_shape"):
        input_signature(None)


def test_a_model_reads_the_input_its_manifest_stores():
    mlp = StoredModel("m", {"kind": "mlp", "input_dim": 3, "hidden": [], "output_dim": 2}, {}, {}, table("a", "b", "c"))
    assert model_input(mlp) == input_signature(table("a", "b", "c"))
    cnn = {"kind": "cnn", "input_shape": [1, 4, 4], "channels": [2], "kernel_size": 3, "hidden": [], "output_dim": 2}
    assert model_input(StoredModel("c", cnn, {})) == {"kind": "unprepared", "shape": [1, 4, 4], "width": 16}


def test_the_rule_refuses_another_input_naming_both_and_passes_the_same():
    ours = input_signature(table("a", "b", "c"))
    check_probe_input(ours, input_signature(table("a", "b", "c")), "p.safetensors", "m")
    check_probe_input(None, ours, "old.safetensors", "m")  # a file of the previous version: unchecked
    with pytest.raises(FailedPrecondition) as e:
        check_probe_input(ours, input_signature(table("c", "a", "b")), "p.safetensors", "m")
    msg = str(e.value)
    assert "table columns a, b, c" in msg and "table columns c, a, b" in msg and "another order" in msg
    assert "privfusion probe make --model m" in msg
    with pytest.raises(FailedPrecondition) as e:
        check_probe_input(ours, input_signature(table("a", "b", "d")), "p.safetensors", "m")
    assert "another order" not in str(e.value)
    with pytest.raises(FailedPrecondition, match=r"images of 1 channel\(s\), 8x8.*images of 3 channel\(s\), 8x8"):
        check_probe_input(input_signature(images(1, (8, 8))), input_signature(images(3, (8, 8))), "p", "m")


def test_probe_files_carry_their_input_and_old_ones_still_read(tmp_path):
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    sig = input_signature(table("a", "b", "c"))
    (tmp_path / "p.safetensors").write_bytes(probe_bytes(x, sig, "m"))
    probe = read_probe(tmp_path / "p.safetensors")
    assert probe.signature == sig and probe.model == "m"
    np.testing.assert_array_equal(probe.x, x)
    save_file({"x": x}, str(tmp_path / "old.safetensors"))  # what probe make wrote before
    old = read_probe(tmp_path / "old.safetensors")
    assert old.signature is None and old.model == ""
    np.testing.assert_array_equal(old.x, x)
    save_file({"x": x}, str(tmp_path / "bad.safetensors"), metadata={INPUT_KEY: "[1, 2]"})
    with pytest.raises(InvalidArgument, match=INPUT_KEY):
        read_probe(tmp_path / "bad.safetensors")
    save_file({"y": x}, str(tmp_path / "noy.safetensors"))
    with pytest.raises(InvalidArgument, match="tensor 'x'"):
        read_probe(tmp_path / "noy.safetensors", "site.probe")
    x[0, 0] = np.nan
    save_file({"x": x}, str(tmp_path / "nan.safetensors"))
    with pytest.raises(InvalidArgument, match="NaN"):
        read_probe(tmp_path / "nan.safetensors")
