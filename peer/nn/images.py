"""A site's own image records: a folder of images by class, or a manifest, prepared for a model.

Two layouts, told apart by the path (:func:`is_image_source`):

- **a folder by class** (the torchvision ``ImageFolder`` convention): ``DIR/<class>/<file>``,
  one sub-folder per class, files ending in ``.png``, ``.jpg``, ``.jpeg`` or ``.dcm`` (any
  case). The label is the sub-folder's name; its column is called :data:`FOLDER_LABEL`. Hidden
  entries (a leading dot) and files of other types are skipped, as ImageFolder skips them; a
  class folder with no image is refused by path;
- **a manifest**: a CSV/TSV/Parquet file with a column :data:`PATH_COLUMN` (the image's path,
  relative to the manifest's folder, or absolute) and a label column (``--label COL``).

Pixels. PNG/JPEG are decoded by Pillow; single-frame DICOM (``.dcm``) by pydicom, its modality
LUT applied (RescaleSlope/Intercept), and a file holding several frames is refused by path.
Accepted modes: grayscale (``1``, ``L``, ``I;16``, ``I``, ``F``, DICOM MONOCHROME1/2 with one
sample per pixel) and RGB (``RGB``, DICOM with three samples). Anything else (palette ``P``,
``RGBA``, ``LA``, ``CMYK`` ...) is refused by path: dropping an alpha channel or a palette
silently would change what the model sees. Values are scaled to [0, 1] by the depth of the
mode (8-bit /255, 16-bit /65535, bilevel 0/1); ``I``, ``F`` and DICOM keep their own units, so
one set of records is DICOM or PNG/JPEG, never a mix (refused by the first path that differs).

The preparation (:class:`ImagePreprocessing`, stored with the model in the same place and the
same JSON style as a table's ``peer.nn.tables.Preprocessing``):

1. channel count C: the images' own (all grayscale → 1, all RGB → 3; a mix is refused by the
   first path that differs) unless declared (``channels``: grayscale is replicated to RGB, RGB
   becomes luminance L = 0.299 R + 0.587 G + 0.114 B by Pillow's rule);
2. size H×W: the images' own when they all share one, else refused by the first path that
   differs, unless declared (``size``): then every image is resized to H×W (Pillow's bilinear
   filter, per channel in 32-bit float);
3. per channel c: x' = (x − mean_c) / std_c, mean and (population) std over every pixel of the
   training split (a constant channel gets std 1).

Inputs are flattened (C·H·W entries per record, C-major) with ``input_shape`` (C, H, W), as an
``.npz`` of images is. Every file is opened (header pass: type, mode, frames, size) and then
decoded before any statistic is fitted or any training step runs, and a bad file is reported by
its path: unreadable, wrong mode or channel count, several frames, another size, an empty class
folder, a manifest path that does not exist. No message holds a pixel value, only paths, rows,
modes, sizes and counts.

Privacy: the statistics (C means and standard deviations, the class names) are exact functions of
the records they were fitted on, as a table's are (``peer.nn.tables``): a DP pool's preprocessing
is fitted on public images (``--public DIR``) or given, never on its protected records.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from peer.base.errors import InvalidArgument
from peer.nn.tables import FORMAT, KINDS, PreparedRecords, Preprocessing, file_digest, split_indices

KIND = "images"
#: the label "column" of a folder by class: the class sub-folder's name
FOLDER_LABEL = "folder"
#: the manifest's column of image paths
PATH_COLUMN = "path"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".dcm")
MANIFEST_SUFFIXES = (".csv", ".tsv", ".txt", ".parquet", ".pq")
_GRAY = {"1": 1.0, "L": 255.0, "I;16": 65535.0, "I;16L": 65535.0, "I;16B": 65535.0, "I": 1.0, "F": 1.0}
_RGB = {"RGB": 255.0}


# --------------------------------------------------------------------------------------------
# Which paths are images


def manifest_columns(path: str | os.PathLike) -> list[str] | None:
    """The column names of a CSV/TSV/Parquet file (header only), or None when it is no such file."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in MANIFEST_SUFFIXES or not p.is_file():
        return None
    try:
        if suffix in (".parquet", ".pq"):
            import pyarrow.parquet as pq

            return [str(n) for n in pq.read_schema(p).names]
        import pandas as pd

        from peer.nn.tables import _separator

        return [str(c) for c in pd.read_csv(p, nrows=0, sep=_separator(p, suffix), encoding="utf-8-sig").columns]
    except Exception:  # not readable as a manifest: the table reader says why
        return None


def is_image_source(path: str | os.PathLike | None) -> bool:
    """A directory (a folder by class), or a manifest: a table with a :data:`PATH_COLUMN` column."""
    if path is None:
        return False
    p = Path(path)
    if p.is_dir():
        return True
    columns = manifest_columns(p)
    return columns is not None and PATH_COLUMN in [c.strip() for c in columns]


# --------------------------------------------------------------------------------------------
# The records: which files, with which labels


@dataclass(frozen=True)
class ImageSet:
    """Image records named by one folder or manifest: each record's file, label text (None when
    read without labels) and, for a manifest, its 1-based data row. Nothing decoded yet."""

    source: str
    layout: str  # "folder" or "manifest"
    label: str | None
    paths: tuple[Path, ...]
    labels: tuple[str | None, ...]
    rows: tuple[int, ...]  # manifest data rows (folder: position, 1-based, in sorted order)
    digest: str = ""

    def __len__(self) -> int:
        return len(self.paths)

    def where(self, i: int) -> str:
        """The file of record ``i`` for a message (and its manifest row)."""
        row = f" ({self.source}, data row {self.rows[i]})" if self.layout == "manifest" else ""
        return f"{self.paths[i]}{row}"

    def take(self, index: Sequence[int] | np.ndarray) -> ImageSet:
        idx = [int(i) for i in index]
        return replace(
            self,
            paths=tuple(self.paths[i] for i in idx),
            labels=tuple(self.labels[i] for i in idx),
            rows=tuple(self.rows[i] for i in idx),
        )

    def split(self, fraction: float, *, seed: int) -> tuple[ImageSet, ImageSet]:
        """(rest, held out), by the same rule as a table's split (``peer.nn.tables.split_indices``)."""
        labels = None if self.label is None else np.array(self.labels, dtype=object)
        rest, held = split_indices(len(self), labels, fraction, seed)
        return self.take(rest), self.take(held)


def _image_files(folder: Path) -> list[Path]:
    return sorted(
        p for p in folder.iterdir() if not p.name.startswith(".") and p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
    )


def _set_digest(paths: Sequence[Path], labels: Sequence[str | None], root: Path) -> str:
    """sha256 over every record's (path relative to the source, label, sha256 of its bytes)."""
    h = hashlib.sha256()
    for p, y in zip(paths, labels, strict=True):
        try:
            rel = os.path.relpath(p, root)
        except ValueError:
            rel = str(p)
        h.update(f"{rel}\t{'' if y is None else y}\t{file_digest(p)}\n".encode())
    return h.hexdigest()


def read_images(path: str | os.PathLike, *, label: str | None = FOLDER_LABEL) -> ImageSet:
    """The image records of a folder by class or of a manifest (see the module docstring).

    ``label``: for a folder, :data:`FOLDER_LABEL` (labelled) or None (unlabelled, e.g. public
    probe images; the class folders still give the files); for a manifest, its label column
    or None. Files are listed and checked to exist; :func:`check_images` opens them."""
    p = Path(path)
    if p.is_dir():
        if label not in (None, FOLDER_LABEL):
            raise InvalidArgument(
                "--label",
                f"is {label!r}, but {p} is a folder by class: the label is the class folder's name "
                f"(give --label {FOLDER_LABEL}, or none)",
            )
        classes = sorted(c for c in p.iterdir() if c.is_dir() and not c.name.startswith("."))
        if not classes:
            raise InvalidArgument(
                str(p), "holds no class folders: expected DIR/<class>/<image>.png|jpg|jpeg|dcm (ImageFolder layout)"
            )
        paths: list[Path] = []
        labels: list[str | None] = []
        for c in classes:
            files = _image_files(c)
            if not files:
                raise InvalidArgument(
                    str(c), f"is an empty class folder: it holds no image ({', '.join(IMAGE_SUFFIXES)})"
                )
            paths += files
            labels += [c.name if label is not None else None] * len(files)
        rows = tuple(range(1, len(paths) + 1))
        return ImageSet(str(p), "folder", label, tuple(paths), tuple(labels), rows, _set_digest(paths, labels, p))
    columns = manifest_columns(p)
    if columns is None:
        if not p.exists():
            raise InvalidArgument(str(p), "does not exist")
        raise InvalidArgument(
            str(p), f"is neither a folder by class nor a manifest (a table with a {PATH_COLUMN!r} column)"
        )
    from peer.nn.tables import read_table

    wanted = [PATH_COLUMN]
    if label is not None:
        if label not in columns:
            raise InvalidArgument(f"{p}: label", f"no column {label!r}; the manifest's columns are {columns}")
        if label == PATH_COLUMN:
            raise InvalidArgument("--label", f"is the manifest's path column {PATH_COLUMN!r}")
    table = read_table(p, label=label, features=wanted, categorical=wanted)
    base = p.parent
    paths = []
    for i, text in enumerate(table.columns[PATH_COLUMN].text):
        f = Path(text)
        f = f if f.is_absolute() else base / f
        if not f.is_file():
            raise InvalidArgument(table.where(PATH_COLUMN, i), f"names {f}, which is not a file")
        if f.suffix.lower() not in IMAGE_SUFFIXES:
            raise InvalidArgument(
                table.where(PATH_COLUMN, i), f"names {f}, which is not an image file ({', '.join(IMAGE_SUFFIXES)})"
            )
        paths.append(f)
    labels = [None] * len(paths) if label is None else list(table.columns[label].text)
    rows = tuple(int(r) for r in table.rows)
    return ImageSet(str(p), "manifest", label, tuple(paths), tuple(labels), rows, _set_digest(paths, labels, base))


# --------------------------------------------------------------------------------------------
# Decoding


@dataclass(frozen=True)
class Header:
    """What the header pass learns of one file: its channels (1 or 3) and size (H, W)."""

    channels: int
    height: int
    width: int


def _unreadable(where: str, what: str, e: BaseException) -> InvalidArgument:
    # the exception's type only: decoder messages are not ours to vet for pixel values
    return InvalidArgument(where, f"cannot be read as {what} ({type(e).__name__})")


def _dicom(path: Path, where: str, *, pixels: bool):
    import pydicom

    try:
        ds = pydicom.dcmread(path, stop_before_pixels=not pixels)
    except Exception as e:  # any failure to parse is an unreadable file
        raise _unreadable(where, "DICOM", e) from None
    frames = int(getattr(ds, "NumberOfFrames", 1) or 1)
    if frames != 1:
        raise InvalidArgument(where, f"is a multi-frame DICOM ({frames} frames); only single-frame files are records")
    samples = int(getattr(ds, "SamplesPerPixel", 1) or 1)
    if samples not in (1, 3) or "Rows" not in ds or "Columns" not in ds:
        raise InvalidArgument(
            where, f"is a DICOM with {samples} samples per pixel; expected 1 (grayscale) or 3 (RGB) and Rows/Columns"
        )
    return ds, samples


def read_header(path: Path, where: str) -> Header:
    """Open ``path`` without decoding its pixels; refuse, by ``where``, what cannot be a record."""
    if path.suffix.lower() == ".dcm":
        ds, samples = _dicom(path, where, pixels=False)
        return Header(samples, int(ds.Rows), int(ds.Columns))
    from PIL import Image

    try:
        with Image.open(path) as im:
            mode, (w, h), frames = im.mode, im.size, int(getattr(im, "n_frames", 1))
    except Exception as e:  # any failure to parse is an unreadable file
        raise _unreadable(where, "an image", e) from None
    if frames != 1:
        raise InvalidArgument(where, f"holds {frames} frames; a record is one image")
    if mode in _GRAY:
        return Header(1, h, w)
    if mode in _RGB:
        return Header(3, h, w)
    raise InvalidArgument(
        where,
        f"has mode {mode!r}; records are grayscale (L, I;16) or RGB: save it as one (a palette or an "
        "alpha channel is not converted silently)",
    )


def decode(path: Path, where: str) -> np.ndarray:
    """The pixels of ``path`` as float32 (channels, H, W), scaled as the module docstring says."""
    if path.suffix.lower() == ".dcm":
        ds, samples = _dicom(path, where, pixels=True)
        try:
            from pydicom.pixels import apply_modality_lut

            a = np.asarray(apply_modality_lut(ds.pixel_array, ds), dtype=np.float64)
        except Exception as e:  # missing or undecodable pixel data
            raise _unreadable(where, "DICOM pixel data", e) from None
        a = a[None] if samples == 1 else np.moveaxis(a, -1, 0)
        return _finite(a.astype(np.float32), where)
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.load()
            mode = im.mode
            a = np.asarray(im)
    except Exception as e:  # truncated or corrupt pixel data
        raise _unreadable(where, "an image", e) from None
    scale = _GRAY.get(mode) or _RGB.get(mode)
    if scale is None:
        raise InvalidArgument(where, f"has mode {mode!r}; records are grayscale (L, I;16) or RGB")
    a = a.astype(np.float32) / np.float32(scale)
    return _finite(a[None] if a.ndim == 2 else np.moveaxis(a, -1, 0), where)


def _finite(a: np.ndarray, where: str) -> np.ndarray:
    if not np.all(np.isfinite(a)):
        raise InvalidArgument(where, "holds pixels that are not finite numbers")
    return a


def _to_channels(a: np.ndarray, channels: int) -> np.ndarray:
    if a.shape[0] == channels:
        return a
    if channels == 3:  # grayscale replicated
        return np.repeat(a, 3, axis=0)
    # luminance, ITU-R 601-2 (Pillow's RGB -> L)
    return (0.299 * a[0] + 0.587 * a[1] + 0.114 * a[2])[None].astype(np.float32)


def _resize(a: np.ndarray, height: int, width: int) -> np.ndarray:
    if a.shape[1:] == (height, width):
        return a
    from PIL import Image

    return np.stack(
        [np.asarray(Image.fromarray(ch, mode="F").resize((width, height), Image.Resampling.BILINEAR)) for ch in a]
    ).astype(np.float32)


def check_images(
    images: ImageSet, *, channels: int | None = None, size: tuple[int, int] | None = None
) -> tuple[int, tuple[int, int]]:
    """Open every file's header; refuse the first bad one by path. Returns the channel count and
    size (H, W) the records will have: the declared ones, else the images' own, which must
    then agree (a mix is refused by the first path that differs)."""
    if len(images) == 0:
        raise InvalidArgument(images.source, "holds no images")
    first: tuple[int, Header] | None = None
    for i, path in enumerate(images.paths):
        h = read_header(path, images.where(i))
        if first is None:
            first = (i, h)
            continue
        f = first[1]
        dicom, first_dicom = path.suffix.lower() == ".dcm", images.paths[first[0]].suffix.lower() == ".dcm"
        if dicom != first_dicom:
            raise InvalidArgument(
                images.where(i),
                f"is {'DICOM' if dicom else 'PNG/JPEG'} but {images.paths[first[0]]} is "
                f"{'DICOM' if first_dicom else 'PNG/JPEG'}: DICOM pixels keep their own units while PNG/JPEG are "
                "scaled to [0, 1], so one set of records holds one or the other",
            )
        if channels is None and h.channels != f.channels:
            raise InvalidArgument(
                images.where(i),
                f"has {h.channels} channel(s) but {images.paths[first[0]]} has {f.channels}: the records mix "
                "grayscale and RGB; give --channels 1 or 3 to convert them all",
            )
        if size is None and (h.height, h.width) != (f.height, f.width):
            raise InvalidArgument(
                images.where(i),
                f"is {h.height}x{h.width} pixels but {images.paths[first[0]]} is {f.height}x{f.width}: give "
                "--image-size H W to resize them all",
            )
    assert first is not None
    return (channels or first[1].channels, size or (first[1].height, first[1].width))


def pixel_units(images: ImageSet) -> str:
    """``"dicom"`` (modality units) or ``"scaled"`` (PNG/JPEG in [0, 1]): a set holds one kind
    (:func:`check_images` refuses a mix)."""
    return "dicom" if images.paths and images.paths[0].suffix.lower() == ".dcm" else "scaled"


def load_pixels(images: ImageSet, channels: int, size: tuple[int, int], *, convert: bool, resize: bool) -> np.ndarray:
    """Every record decoded to float32 (m, channels, H, W). Without ``convert`` / ``resize`` an
    image of another channel count / size is refused by path (the preprocessing was fitted on
    images that needed neither)."""
    out = np.empty((len(images), channels, *size), dtype=np.float32)
    for i, path in enumerate(images.paths):
        where = images.where(i)
        a = decode(path, where)
        if a.shape[0] != channels and not convert:
            raise InvalidArgument(
                where, f"has {a.shape[0]} channel(s) but the model's preprocessing takes {channels} (and converts none)"
            )
        if a.shape[1:] != tuple(size) and not resize:
            raise InvalidArgument(
                where,
                f"is {a.shape[1]}x{a.shape[2]} pixels but the model's preprocessing takes {size[0]}x{size[1]} "
                "(and resizes none)",
            )
        out[i] = _resize(_to_channels(a, channels), *size)
    return out


# --------------------------------------------------------------------------------------------
# Preprocessing


def _number_list(value: Any, n: int, where: str, *, positive: bool = False) -> tuple[float, ...]:
    if not isinstance(value, list) or len(value) != n:
        raise InvalidArgument(where, f"must be a list of {n} numbers (one per channel)")
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
            raise InvalidArgument(where, f"must hold finite numbers{' > 0' if positive else ''}")
        out.append(float(v))
    return tuple(out)


@dataclass(frozen=True)
class ImagePreprocessing(Preprocessing):
    """The preparation of image records for one model (module docstring): ``channels`` C,
    ``size`` (H, W), per-channel ``mean``/``std`` of the training split, whether other channel
    counts are ``convert``-ed and other sizes ``resize``-d, and the ``layout`` the records came
    in ("folder" or "manifest"). A ``peer.nn.tables.Preprocessing`` with no columns: the same
    store field, the same JSON style (``"kind": "images"`` tells them apart)."""

    channels: int = 1
    size: tuple[int, int] = (1, 1)
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    convert: bool = False
    resize: bool = False
    layout: str = "folder"
    units: str = "scaled"  # "scaled" (PNG/JPEG in [0, 1]) or "dicom" (modality units)

    @property
    def width(self) -> int:
        return self.channels * self.size[0] * self.size[1]

    @property
    def imputes(self) -> bool:
        return False

    def input_names(self) -> list[str]:
        return [f"c{c}y{y}x{x}" for c in range(self.channels) for y in range(self.size[0]) for x in range(self.size[1])]

    def describe_inputs(self, limit: int = 8) -> str:
        return f"images of {self.channels} channel(s), {self.size[0]}x{self.size[1]} pixels"

    def read(self, path: str | os.PathLike, *, labelled: bool = True) -> ImageSet:  # type: ignore[override]
        """The image records of ``path`` (a folder or a manifest, whatever the model was fitted on)."""
        return read_images(path, label=self.label if labelled else None)

    @classmethod
    def fit(  # type: ignore[override]
        cls,
        images: ImageSet,
        *,
        channels: int | None = None,
        size: tuple[int, int] | None = None,
        split: str = "training",
        pixels: np.ndarray | None = None,
    ) -> ImagePreprocessing:
        """Statistics of ``images`` — the site's TRAINING split, or public images (``split="public"``)
        — per channel, and the class list. ``pixels`` may give the decoded records already."""
        if split not in ("training", "public"):
            raise InvalidArgument("split", f"must be 'training' or 'public', got {split!r}")
        if images.label is None:
            raise InvalidArgument("label", f"fitting needs labelled records; {images.source} was read without labels")
        _check_declared(channels, size)
        c, hw = check_images(images, channels=channels, size=size)
        if pixels is None:
            pixels = load_pixels(images, c, hw, convert=channels is not None, resize=size is not None)
        flat = pixels.reshape(len(pixels), c, -1).astype(np.float64)
        mean = flat.mean(axis=(0, 2))
        std = flat.std(axis=(0, 2))
        std = np.where(std > 0, std, 1.0)
        classes = _classes(images.labels)
        if len(classes) < 2:
            raise InvalidArgument(
                f"{images.source}: label {images.label!r}",
                "has one class in the training split; a classifier needs at least two",
            )
        fitted_on = {
            "file": Path(images.source).name,
            "sha256": images.digest,
            "rows": len(images),
            "split": split,
        }
        return cls(
            images.label,
            classes,
            (),
            "refuse",
            (c, *hw),
            fitted_on,
            channels=c,
            size=tuple(hw),
            mean=tuple(float(v) for v in mean),
            std=tuple(float(v) for v in std),
            convert=channels is not None,
            resize=size is not None,
            layout=images.layout,
            units=pixel_units(images),
        )

    def pixels(self, images: ImageSet) -> np.ndarray:
        """Decoded records (m, C, H, W), before normalisation; every file is checked first, and
        must be of the kind (DICOM or PNG/JPEG) the statistics were fitted on."""
        check_images(images, channels=self.channels, size=self.size)
        if pixel_units(images) != self.units:
            kind = {"dicom": "DICOM", "scaled": "PNG/JPEG"}
            raise InvalidArgument(
                images.where(0),
                f"is {kind[pixel_units(images)]} but the model's preprocessing was fitted on {kind[self.units]} "
                "images (their pixel units differ)",
            )
        return load_pixels(images, self.channels, self.size, convert=self.convert, resize=self.resize)

    def transform(self, images: ImageSet, pixels: np.ndarray | None = None):  # type: ignore[override]
        """``(X float32 (m, C·H·W), y int64 (m,))`` prepared as in training (y None unlabelled)."""
        a = self.pixels(images) if pixels is None else pixels
        mean = np.asarray(self.mean, dtype=np.float32)[None, :, None, None]
        std = np.asarray(self.std, dtype=np.float32)[None, :, None, None]
        x = ((a - mean) / std).reshape(len(a), -1).astype(np.float32)
        y = None if images.label is None else self._image_labels(images)
        return x, y

    def _image_labels(self, images: ImageSet) -> np.ndarray:
        integer = all(isinstance(v, int) for v in self.classes)
        index = {str(v) if integer else v: k for k, v in enumerate(self.classes)}
        y = np.empty(len(images), dtype=np.int64)
        for i, t in enumerate(images.labels):
            key = None if t is None else (str(int(float(t))) if integer and _is_integer_text(t) else t)
            k = index.get(key)
            if k is None:
                raise InvalidArgument(
                    images.where(i),
                    "the label is missing"
                    if t is None
                    else f"the label is not one of the model's {len(self.classes)} classes",
                )
            y[i] = k
        return y

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "kind": KIND,
            "layout": self.layout,
            "units": self.units,
            "label": self.label,
            "classes": list(self.classes),
            "channels": self.channels,
            "size": list(self.size),
            "mean": list(self.mean),
            "std": list(self.std),
            "convert": self.convert,
            "resize": self.resize,
            "input_shape": [self.channels, *self.size],
            "fitted_on": dict(self.fitted_on),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "preprocessing") -> ImagePreprocessing:
        """Check and rebuild an image preprocessing from its JSON form."""

        def bad(key: str, rule: str):
            raise InvalidArgument(f"{where}.{key}", rule)

        if not isinstance(data, Mapping):
            raise InvalidArgument(where, "must be an object")
        if data.get("format") != FORMAT:
            bad("format", f"must be {FORMAT}, got {data.get('format')!r}")
        if data.get("kind") != KIND:
            bad("kind", f"must be {KIND!r}")
        layout = data.get("layout")
        if layout not in ("folder", "manifest"):
            bad("layout", f"must be 'folder' or 'manifest', got {layout!r}")
        units = data.get("units")
        if units not in ("scaled", "dicom"):
            bad("units", f"must be 'scaled' (PNG/JPEG) or 'dicom', got {units!r}")
        label = data.get("label")
        if not isinstance(label, str) or not label:
            bad("label", "must be a non-empty string")
        classes = data.get("classes")
        if (
            not isinstance(classes, list)
            or len(classes) < 2
            or len(set(classes)) != len(classes)
            or not (
                all(isinstance(v, int) and not isinstance(v, bool) for v in classes)
                or all(isinstance(v, str) for v in classes)
            )
        ):
            bad("classes", "must be at least two distinct labels, all integers or all strings")
        channels = data.get("channels")
        if channels not in (1, 3) or isinstance(channels, bool):
            bad("channels", f"must be 1 or 3, got {channels!r}")
        size = data.get("size")
        if (
            not isinstance(size, list)
            or len(size) != 2
            or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in size)
        ):
            bad("size", f"must be [height, width], positive integers, got {size!r}")
        mean = _number_list(data.get("mean"), channels, f"{where}.mean")
        std = _number_list(data.get("std"), channels, f"{where}.std", positive=True)
        flags = {}
        for key in ("convert", "resize"):
            v = data.get(key)
            if not isinstance(v, bool):
                bad(key, f"must be true or false, got {v!r}")
            flags[key] = v
        shape = [channels, *size]
        if data.get("input_shape", shape) != shape:
            bad("input_shape", f"must be [channels, height, width] = {shape}")
        fitted_on = data.get("fitted_on", {})
        if not isinstance(fitted_on, Mapping):
            bad("fitted_on", "must be an object")
        return cls(
            label,
            tuple(classes),
            (),
            "refuse",
            tuple(shape),
            dict(fitted_on),
            channels=channels,
            size=(size[0], size[1]),
            mean=mean,
            std=std,
            layout=layout,
            units=units,
            **flags,
        )


KINDS[KIND] = ImagePreprocessing


def _check_declared(channels: int | None, size: tuple[int, int] | None) -> None:
    if channels is not None and (isinstance(channels, bool) or channels not in (1, 3)):
        raise InvalidArgument("--channels", f"must be 1 or 3, got {channels!r}")
    if size is not None and (
        len(size) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in size)
    ):
        raise InvalidArgument("--image-size", f"must be two positive integers H W, got {list(size)!r}")


def _is_integer_text(t: str) -> bool:
    try:
        return float(t).is_integer()
    except ValueError:
        return False


def _classes(labels: Sequence[str | None]) -> tuple[int | str, ...]:
    """Sorted class list: integers when every label is one (as a table's), else text."""
    text = [t for t in labels if t is not None]
    if text and all(_is_integer_text(t) for t in text):
        return tuple(sorted({int(float(t)) for t in text}))
    return tuple(sorted(set(text)))


# --------------------------------------------------------------------------------------------
# A site's image records, split and prepared for training


def prepare_image_records(
    path: str | os.PathLike,
    *,
    label: str | None = FOLDER_LABEL,
    channels: int | None = None,
    size: tuple[int, int] | None = None,
    validation_fraction: float = 0.2,
    split_seed: int = 0,
    preprocessing: Preprocessing | None = None,
    public: str | os.PathLike | None = None,
) -> PreparedRecords:
    """As ``peer.nn.tables.prepare_records`` for images: read ``path``, check every file, hold
    out ``validation_fraction`` (stratified, public ``split_seed``), fit the preprocessing on
    the rest — or on the ``public`` images, or use the given one — and prepare both parts."""
    _check_declared(channels, size)
    if label is None:
        label = FOLDER_LABEL if Path(path).is_dir() else None
    if label is None:
        raise InvalidArgument("--label", f"is required: the label column of the manifest {path}")
    if public is not None:
        if preprocessing is not None:
            raise InvalidArgument("public", "give a preprocessing or a public file to fit one on, not both")
        preprocessing = ImagePreprocessing.fit(
            read_images(public, label=label), channels=channels, size=size, split="public"
        )
    if preprocessing is not None and not isinstance(preprocessing, ImagePreprocessing):
        raise InvalidArgument(
            "--preprocessing", f"prepares a table, but {path} holds images: give an image preprocessing"
        )
    images = read_images(path, label=label)
    if preprocessing is not None and label != preprocessing.label:
        raise InvalidArgument(
            "label", f"is {label!r} but the given preprocessing was fitted for label {preprocessing.label!r}"
        )
    if preprocessing is None:
        c, hw = check_images(images, channels=channels, size=size)
        pixels = load_pixels(images, c, hw, convert=channels is not None, resize=size is not None)
    else:
        pixels = preprocessing.pixels(images)
    rest, held = split_indices(len(images), np.array(images.labels, dtype=object), validation_fraction, split_seed)
    train, val = images.take(rest), images.take(held)
    prep = preprocessing
    if prep is None:
        prep = ImagePreprocessing.fit(train, channels=channels, size=size, pixels=pixels[rest])
    x_train, y_train = prep.transform(train, pixels[rest])
    x_val, y_val = prep.transform(val, pixels[held])
    description = {
        "file": Path(images.source).name,
        "sha256": images.digest,
        "label": label,
        "rows": len(images),
        "training_rows": len(train),
        "validation_rows": len(val),
        "validation_fraction": validation_fraction,
        "split_seed": split_seed,
        "images": {"layout": images.layout, "input_shape": list(prep.input_shape)},
        "preprocessing": (
            "fitted on the training split"
            if preprocessing is None
            else f"fitted on public records ({preprocessing.fitted_on.get('file')})"
            if preprocessing.fitted_on.get("split") == "public"
            else "given"
        ),
    }
    return PreparedRecords(prep, x_train, y_train, x_val, y_val, description)


__all__ = [
    "FOLDER_LABEL",
    "IMAGE_SUFFIXES",
    "PATH_COLUMN",
    "ImagePreprocessing",
    "ImageSet",
    "check_images",
    "decode",
    "is_image_source",
    "prepare_image_records",
    "read_images",
]
