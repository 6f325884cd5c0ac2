"""Image records (``peer.nn.images``) on files the tests write: folders by class (PNG, JPEG,
grayscale and RGB), a manifest CSV, a single-frame DICOM, and corrupt files (a truncated PNG, a
text file named .png, an empty class folder, a multi-frame DICOM). The commands run as a
subprocess, as a site runs them; refusals must name the path and print no pixel value.

Every draw is seeded (the digits picked, the split, the model's initialisation and batch order,
the DP noise via --seed), so the one accuracy threshold (> 0.8 on 30 held-out digits of three
classes, measured well above it) is deterministic: no false-failure rate to state."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import numpy as np
import pytest
from peer_harness import cli, digits_images, write_folder
from PIL import Image

from peer.base.errors import InvalidArgument
from peer.nn.images import (
    FOLDER_LABEL,
    ImagePreprocessing,
    check_images,
    decode,
    is_image_source,
    prepare_image_records,
    read_images,
)
from peer.nn.tables import Preprocessing

# pixel values the corrupt-file messages must never show (every value a test image holds is in
# 0..255; the messages are checked for none of the records' distinctive values)


def write_dicom(path: Path, pixels: np.ndarray, *, frames: int = 1) -> Path:
    """A DICOM file (uncompressed, explicit VR little endian) of 16-bit grayscale pixels."""
    from pydicom.dataset import FileDataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, SecondaryCaptureImageStorage, generate_uid

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = SecondaryCaptureImageStorage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = FileDataset(str(path), {}, file_meta=meta, preamble=b"\0" * 128)
    ds.SOPClassUID = meta.MediaStorageSOPClassUID
    ds.SOPInstanceUID = meta.MediaStorageSOPInstanceUID
    ds.Modality = "OT"
    ds.SamplesPerPixel = 1
    ds.PhotometricInterpretation = "MONOCHROME2"
    ds.Rows, ds.Columns = pixels.shape[-2:]
    ds.BitsAllocated = 16
    ds.BitsStored = 16
    ds.HighBit = 15
    ds.PixelRepresentation = 0
    data = np.ascontiguousarray(pixels.astype("<u2"))
    if frames > 1:
        ds.NumberOfFrames = frames
        data = np.ascontiguousarray(np.stack([data] * frames))
    ds.PixelData = data.tobytes()
    ds.save_as(path, enforce_file_format=True)
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("images")
    x, y = digits_images(150, seed=3)
    pub_x, pub_y = digits_images(60, seed=4)
    return {
        "dir": d,
        "private": write_folder(d / "private", x[:120], y[:120], jpeg_every=7),
        "held": write_folder(d / "held", x[120:], y[120:]),
        "public": write_folder(d / "public", pub_x, pub_y),
        "rgb": write_folder(d / "rgb", x[:30], y[:30], rgb=True),
    }


# --------------------------------------------------------------------------------------------
# The core: reading, checking, fitting, transforming


def test_folder_is_read_by_class_and_prepared_with_training_statistics(data):
    records = prepare_image_records(data["private"], validation_fraction=0.25, split_seed=1)
    prep = records.preprocessing
    assert isinstance(prep, ImagePreprocessing) and isinstance(prep, Preprocessing)
    assert prep.classes == (0, 1, 2) and prep.label == FOLDER_LABEL
    assert prep.input_shape == (1, 8, 8) and records.x_train.shape == (90, 64)
    # the training split's statistics: the prepared training pixels have mean 0 and std 1
    assert abs(float(records.x_train.mean())) < 1e-5
    assert abs(float(records.x_train.std()) - 1) < 1e-5
    # the same numbers by hand: decode the training files, normalise by their own statistics
    train, _ = read_images(data["private"]).split(0.25, seed=1)
    raw = np.stack([decode(p, str(p)) for p in train.paths])
    expect = (raw - raw.mean()) / raw.std()
    np.testing.assert_allclose(records.x_train, expect.reshape(90, -1), atol=1e-5)
    # stored like a table's preprocessing: JSON round trip through the one reader
    again = Preprocessing.from_dict(json.loads(json.dumps(prep.to_dict())))
    assert again == prep
    x, y = again.transform(again.read(data["held"]))
    assert x.shape == (30, 64) and set(y.tolist()) <= {0, 1, 2}


def test_resize_and_channels_are_declared_stored_and_applied(data):
    records = prepare_image_records(data["rgb"], size=(16, 12), channels=3, validation_fraction=0.2)
    prep = records.preprocessing
    assert prep.input_shape == (3, 16, 12) and prep.resize and prep.convert
    assert len(prep.mean) == 3
    # a grayscale folder prepared by the same preprocessing: replicated to three channels, resized
    x, _ = prep.transform(prep.read(data["held"]))
    a = x.reshape(-1, 3, 16, 12)
    np.testing.assert_allclose(a[:, 0] * prep.std[0] + prep.mean[0], a[:, 1] * prep.std[1] + prep.mean[1], atol=1e-5)
    # without a declared size, images of another size are refused by path
    own = prepare_image_records(data["private"]).preprocessing
    with pytest.raises(InvalidArgument, match=r"16x12 pixels|is 8x8"):
        own.transform(own.read(write_bigger(data["dir"] / "bigger")))


def write_bigger(root: Path) -> Path:
    x, y = digits_images(6, seed=9)
    big = np.stack([np.asarray(Image.fromarray(a).resize((12, 16))) for a in x])
    return write_folder(root, big, y)


def test_mixed_modes_are_refused_by_path_unless_channels_are_declared(tmp_path, data):
    x, y = digits_images(8, seed=5)
    root = write_folder(tmp_path / "mixed", x, y)
    one = sorted((root / str(int(y[0]))).iterdir())[0]
    Image.fromarray(x[0]).convert("RGB").save(one)
    with pytest.raises(InvalidArgument) as e:
        check_images(read_images(root))
    assert "--channels" in e.value.rule and "mix" in e.value.rule
    assert check_images(read_images(root), channels=1) == (1, (8, 8))


def test_dicom_single_frame_is_decoded_and_multi_frame_refused(tmp_path):
    pixels = (np.arange(64).reshape(8, 8) * 1000).astype(np.uint16)
    one = write_dicom(tmp_path / "scan.dcm", pixels)
    np.testing.assert_array_equal(decode(one, str(one))[0], pixels.astype(np.float32))
    many = write_dicom(tmp_path / "cine.dcm", pixels, frames=3)
    with pytest.raises(InvalidArgument) as e:
        decode(many, str(many))
    assert e.value.field == str(many) and "multi-frame" in e.value.rule


def test_manifest_with_paths_relative_to_it(tmp_path, data):
    files = sorted(Path(data["private"]).rglob("*.png"))[::3]
    manifest = tmp_path / "m" / "manifest.csv"
    manifest.parent.mkdir()
    with open(manifest, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "diagnosis"])
        for p in files:
            w.writerow([os.path.relpath(p, manifest.parent), f"d{p.parent.name}"])
    assert is_image_source(manifest)
    records = prepare_image_records(manifest, label="diagnosis")
    assert records.preprocessing.classes == ("d0", "d1", "d2")
    assert records.preprocessing.layout == "manifest"
    with pytest.raises(InvalidArgument) as e:
        read_images(manifest, label="outcome")
    assert "no column 'outcome'" in e.value.rule and "manifest.csv" in e.value.field
    # the same manifest as Parquet reads the same records
    import pandas as pd

    parquet = manifest.with_suffix(".parquet")
    pd.read_csv(manifest).to_parquet(parquet)
    assert is_image_source(parquet)
    again = prepare_image_records(parquet, label="diagnosis")
    np.testing.assert_array_equal(again.x_train, records.x_train)
    # a table without a path column stays a table
    table = tmp_path / "table.csv"
    table.write_text("age,outcome\n1,0\n2,1\n")
    assert not is_image_source(table)


def test_a_stored_preprocessing_of_unknown_kind_is_refused_by_field(data):
    stored = prepare_image_records(data["private"]).preprocessing.to_dict()
    with pytest.raises(InvalidArgument) as e:
        Preprocessing.from_dict({**stored, "kind": "video"}, "m.json.preprocessing")
    assert e.value.field == "m.json.preprocessing.kind" and "images" in e.value.rule
    with pytest.raises(InvalidArgument) as e:
        Preprocessing.from_dict({**stored, "std": [0.0]}, "p")
    assert e.value.field == "p.std"


# --------------------------------------------------------------------------------------------
# The commands, as a site runs them


def test_model_train_and_evaluate_on_an_image_folder(tmp_path, data):
    site = tmp_path / "site"
    out = cli(
        "model", "train", "--site", str(site), "--data", str(data["private"]), "--preset", "cnn",
        "--name", "img", "--epochs", "15", "--json",
    )  # fmt: skip
    summary = json.loads(out.stdout)
    assert summary["architecture"]["input_shape"] == [1, 8, 8]
    manifest = json.loads((site / "models" / "img.json").read_text())
    assert manifest["preprocessing"]["kind"] == "images"
    assert manifest["preprocessing"]["fitted_on"]["split"] == "training"
    scored = json.loads(
        cli("evaluate", "--model", str(site / "models" / "img"), "--data", str(data["held"]), "--json").stdout
    )
    assert scored["records"] == 30 and scored["accuracy"] > 0.8
    # the probe set from public images, prepared by the model's stored preprocessing
    cli("probe", "make", "--site", str(site), "--data", str(data["public"]), "--model", "img", "--rows", "20")
    from safetensors.numpy import load_file

    probe = load_file(site / "probe.safetensors")["x"]
    prep = Preprocessing.from_dict(manifest["preprocessing"])
    x, _ = prep.transform(prep.read(data["public"], labelled=False))
    assert probe.shape == (20, 64)
    assert all(any(np.array_equal(r, s) for s in x) for r in probe)


def test_pool_train_on_images_with_public_preprocessing(tmp_path, data):
    site = tmp_path / "site"
    out = cli(
        "pool", "train", "--site", str(site), "--data", str(data["private"]), "--public", str(data["public"]),
        "--model", "noise=4,clip=1,steps=10", "--seed", "0", "--json",
    )  # fmt: skip
    summary = json.loads(out.stdout)
    assert summary["input_width"] == 64 and summary["dataset_size"] == 96
    stored = json.loads((site / "pool" / "dpsgd-0.json").read_text())
    assert stored["preprocessing"]["kind"] == "images" and stored["preprocessing"]["fitted_on"]["split"] == "public"
    # a preprocessing fitted on the pool's own protected images is refused (their statistics would
    # travel inside every released model, outside the guarantee)
    cli("model", "train", "--site", str(site), "--data", str(data["private"]), "--name", "own", "--epochs", "1")
    proc = cli(
        "pool", "train", "--site", str(site), "--data", str(data["private"]),
        "--preprocessing", str(site / "models" / "own.json"), "--model", "noise=4,clip=1,steps=2", "--force",
        check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and "the protected records DP-SGD would train on" in proc.stderr
    # the pool's merge-validation set from public images, labelled by their class folders
    cli("probe", "make", "--site", str(site), "--data", str(data["public"]), "--pool", "pool", "--label", FOLDER_LABEL)
    with np.load(site / "validation.npz") as v:
        assert v["x"].shape == (60, 64) and sorted(set(v["y"].tolist())) == [0, 1, 2]


def _corrupt_folder(root: Path, kind: str) -> Path:
    x, y = digits_images(12, seed=7)
    write_folder(root, x, y)
    cls = root / str(int(y[0]))
    victim = sorted(cls.glob("*.png"))[0]
    if kind == "truncated":
        victim.write_bytes(victim.read_bytes()[:60])
    elif kind == "text":
        victim.write_text("patient 0042 glucose 7.3\n")
    elif kind == "empty":
        victim = root / "9"
        victim.mkdir()
    elif kind == "rgba":
        Image.fromarray(x[0]).convert("RGBA").save(victim)
    return victim


@pytest.mark.parametrize(
    ("kind", "rule"),
    [
        ("truncated", "cannot be read as an image"),
        ("text", "cannot be read as an image"),
        ("empty", "empty class folder"),
        ("rgba", "mode 'RGBA'"),
    ],
)
def test_bad_files_are_refused_by_path_before_training(tmp_path, kind, rule):
    root = tmp_path / kind
    victim = _corrupt_folder(root, kind)
    site = tmp_path / "site"
    proc = cli("model", "train", "--site", str(site), "--data", str(root), "--name", "m", check=False)
    assert proc.returncode == 2, proc.stderr
    assert str(victim) in proc.stderr and rule in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (site / "models" / "m.json").exists()
    assert "glucose" not in proc.stderr and "7.3" not in proc.stderr


def test_multi_frame_dicom_and_missing_manifest_path_are_refused_by_path(tmp_path):
    x, y = digits_images(10, seed=8)
    root = write_folder(tmp_path / "dcm", x, y)
    pngs = sorted(root.rglob("*.png"))
    for p in pngs[:4]:
        write_dicom(p.with_suffix(".dcm"), np.asarray(Image.open(p)).astype(np.uint16) * 257)
        p.unlink()
    # DICOM (own units) beside PNG (scaled to [0, 1]) in one set: refused by the first that differs
    proc = cli("model", "train", "--site", str(tmp_path / "s"), "--data", str(root), "--name", "m", check=False)
    assert proc.returncode == 2 and "DICOM" in proc.stderr and "PNG/JPEG" in proc.stderr
    for p in pngs[4:]:
        write_dicom(p.with_suffix(".dcm"), np.asarray(Image.open(p)).astype(np.uint16) * 257)
        p.unlink()
    multi = write_dicom(root / str(int(y[0])) / "cine.dcm", x[0].astype(np.uint16), frames=2)
    proc = cli("model", "train", "--site", str(tmp_path / "s"), "--data", str(root), "--name", "m", check=False)
    assert proc.returncode == 2 and str(multi) in proc.stderr and "multi-frame" in proc.stderr
    multi.unlink()
    cli("model", "train", "--site", str(tmp_path / "s"), "--data", str(root), "--name", "m", "--epochs", "2")
    manifest = tmp_path / "manifest.csv"
    manifest.write_text("path,label\ndcm/0/nothing.png,0\n" + "".join(
        f"{p.relative_to(tmp_path)},{p.parent.name}\n" for p in sorted(root.rglob("*.*"))
    ))  # fmt: skip
    proc = cli(
        "model", "train", "--site", str(tmp_path / "s"), "--data", str(manifest), "--label", "label",
        "--name", "m2", check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and str(tmp_path / "dcm/0/nothing.png") in proc.stderr
    assert "data row 1" in proc.stderr


CONV_FACTORY = """
from torch import nn


def build():
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 16 * 16, 3)
    )
"""


def test_model_import_fits_the_image_preprocessing_to_the_input_shape(tmp_path, data):
    import torch
    from safetensors.torch import save_file

    site = tmp_path / "site"
    site.mkdir()
    (site / "convnet.py").write_text(CONV_FACTORY)
    namespace: dict = {}
    exec(CONV_FACTORY, namespace)
    torch.manual_seed(0)
    save_file(namespace["build"]().state_dict(), tmp_path / "w.safetensors")
    factory = f"{site / 'convnet.py'}:build"
    common = [
        "model",
        "import",
        "--site",
        str(site),
        "--factory",
        factory,
        "--weights",
        str(tmp_path / "w.safetensors"),
    ]
    cli(*common, "--name", "conv", "--input-shape", "1", "16", "16", "--data", str(data["private"]))
    stored = json.loads((site / "own_models" / "conv.json").read_text())
    prep = Preprocessing.from_dict(stored["preprocessing"])
    assert isinstance(prep, ImagePreprocessing) and prep.input_shape == (1, 16, 16) and prep.resize
    x, y = prep.transform(prep.read(data["held"]))
    assert x.shape == (30, 256) and len(y) == 30
    # an input shape that is no image is refused by name, before anything is stored
    proc = cli(*common, "--name", "flat", "--input-shape", "256", "--data", str(data["private"]), check=False)
    assert proc.returncode == 2 and "--input-shape" in proc.stderr
    assert not (site / "own_models" / "flat.json").exists()
    # a DP pool of that network on the images, its preprocessing fitted on public images
    out = cli(
        "pool", "train", "--site", str(site), "--from-model", "conv", "--data", str(data["private"]),
        "--public", str(data["public"]), "--image-size", "16", "16", "--model", "noise=4,clip=1,steps=3",
        "--seed", "0", "--json",
    )  # fmt: skip
    pool = json.loads(out.stdout)
    assert pool["input_shape"] == [1, 16, 16] and pool["norm_statistics"] == "public records"
    proc = cli(
        "pool", "train", "--site", str(site), "--from-model", "conv", "--data", str(data["private"]),
        "--public", str(data["public"]), "--model", "noise=4,clip=1,steps=3", "--force", check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and "[1, 8, 8]" in proc.stderr and "--image-size H W" in proc.stderr


def test_a_png_model_refuses_dicom_records(tmp_path, data):
    prep = prepare_image_records(data["private"]).preprocessing
    assert prep.units == "scaled"
    x, y = digits_images(6, seed=12)
    root = tmp_path / "dicoms"
    for i, (a, label) in enumerate(zip(x, y, strict=True)):
        (root / str(int(label))).mkdir(parents=True, exist_ok=True)
        write_dicom(root / str(int(label)) / f"{i}.dcm", a.astype(np.uint16))
    with pytest.raises(InvalidArgument) as e:
        prep.transform(prep.read(root))
    assert "DICOM" in e.value.rule and e.value.field.endswith(".dcm")
    dicom = prepare_image_records(root, validation_fraction=0.5).preprocessing
    assert dicom.units == "dicom" and Preprocessing.from_dict(dicom.to_dict()) == dicom
