"""Data the project ships with: scikit-learn's bundled digits and breast-cancer sets, and the
ways experiments split them across sites. Nothing is downloaded.

Feature scaling uses public constants (digits: pixel values / 16) or statistics of the training
split only (breast cancer: standardisation), never of the test split.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from peer.base.errors import InvalidArgument

__all__ = [
    "DATASETS",
    "Dataset",
    "feature_names",
    "load_dataset",
    "remove_class",
    "split_by_feature",
    "split_dirichlet",
    "split_homogeneous",
    "split_label_skew",
]

DATASETS = ("digits", "breast_cancer")


@dataclass(frozen=True)
class Dataset:
    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    image_shape: tuple[int, int, int] | None  # (channels, height, width) where it is an image set

    @property
    def input_dim(self) -> int:
        return int(self.x_train.shape[1])


def load_dataset(name: str, *, test_fraction: float = 0.25, seed: int = 0) -> Dataset:
    """A stratified train/test split of a bundled dataset, as float32 features."""
    from sklearn import datasets
    from sklearn.model_selection import train_test_split

    if not 0 < test_fraction < 1:
        raise InvalidArgument("test_fraction", f"must be in (0, 1), got {test_fraction!r}")
    if name == "digits":
        bunch = datasets.load_digits()
        x = (bunch.data / 16.0).astype(np.float32)
        image_shape = (1, 8, 8)
    elif name == "breast_cancer":
        bunch = datasets.load_breast_cancer()
        x = bunch.data.astype(np.float32)
        image_shape = None
    else:
        raise InvalidArgument("dataset", f"must be one of {DATASETS}, got {name!r}")
    y = bunch.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_fraction, stratify=y, random_state=seed)
    if name == "breast_cancer":
        mu, sd = x_tr.mean(axis=0), x_tr.std(axis=0) + 1e-8
        x_tr, x_te = (x_tr - mu) / sd, (x_te - mu) / sd
    return Dataset(name, x_tr.astype(np.float32), y_tr, x_te.astype(np.float32), y_te, int(y.max()) + 1, image_shape)


def split_homogeneous(y: np.ndarray, n_sites: int, *, seed: int) -> list[np.ndarray]:
    """Indices of an IID, stratified split into ``n_sites`` near-equal parts."""
    _check_sites(n_sites)
    rng = np.random.default_rng(seed)
    parts: list[list[int]] = [[] for _ in range(n_sites)]
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        for s, chunk in enumerate(np.array_split(idx, n_sites)):
            parts[(s + int(c)) % n_sites].extend(chunk.tolist())
    return [np.sort(np.array(p, dtype=np.int64)) for p in parts]


def split_label_skew(y: np.ndarray, *, majority: float = 0.8, seed: int) -> list[np.ndarray]:
    """Two-site heterogeneous split (as in Git Re-Basin's split-data experiment): site A gets
    ``majority`` of each class in the lower half of the labels and ``1 - majority`` of the upper
    half; site B gets the rest."""
    if not 0.5 <= majority < 1:
        raise InvalidArgument("majority", f"must be in [0.5, 1), got {majority!r}")
    rng = np.random.default_rng(seed)
    classes = np.unique(y)
    lower = set(classes[: len(classes) // 2].tolist())
    a: list[int] = []
    b: list[int] = []
    for c in classes:
        idx = rng.permutation(np.flatnonzero(y == c))
        k = round(len(idx) * (majority if int(c) in lower else 1 - majority))
        a.extend(idx[:k].tolist())
        b.extend(idx[k:].tolist())
    return [np.sort(np.array(a, dtype=np.int64)), np.sort(np.array(b, dtype=np.int64))]


def split_dirichlet(
    y: np.ndarray, n_sites: int, *, concentration: float, seed: int, min_per_site: int = 10
) -> list[np.ndarray]:
    """Non-IID split by Dirichlet label skew: for each class, the share of each site is drawn
    from Dir(concentration · 1). Small concentration = strong skew. Redraws (bounded) until every
    site has at least ``min_per_site`` examples."""
    _check_sites(n_sites)
    if not concentration > 0:
        raise InvalidArgument("concentration", f"must be > 0, got {concentration!r}")
    if n_sites * min_per_site > len(y):
        raise InvalidArgument("min_per_site", f"{n_sites} sites x {min_per_site} exceeds the {len(y)} examples")
    rng = np.random.default_rng(seed)
    for _ in range(1000):
        parts: list[list[int]] = [[] for _ in range(n_sites)]
        for c in np.unique(y):
            idx = rng.permutation(np.flatnonzero(y == c))
            shares = rng.dirichlet(np.full(n_sites, concentration))
            cuts = (np.cumsum(shares)[:-1] * len(idx)).astype(int)
            for s, chunk in enumerate(np.split(idx, cuts)):
                parts[s].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_per_site:
            return [np.sort(np.array(p, dtype=np.int64)) for p in parts]
    raise InvalidArgument("concentration", f"{concentration} is too skewed to give every site {min_per_site} examples")


def split_by_feature(values: np.ndarray, n_sites: int) -> list[np.ndarray]:
    """Non-IID split by a covariate (the field study's regions): the records sorted by
    ``values`` (one feature, not the label; ties keep their order) and cut into ``n_sites``
    contiguous parts of near-equal size (part i ends at record ⌊n·(i+1)/n_sites⌋ of the
    order), the lowest values at the first site."""
    _check_sites(n_sites)
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 1 or not np.isfinite(values).all():
        raise InvalidArgument("values", f"must be a finite 1-D array, got shape {values.shape}")
    if len(values) < n_sites:
        raise InvalidArgument("n_sites", f"{n_sites} regions need at least as many records, got {len(values)}")
    order = np.argsort(values, kind="stable")
    cuts = [len(order) * i // n_sites for i in range(1, n_sites)]
    return [np.sort(part).astype(np.int64) for part in np.split(order, cuts)]


def remove_class(index: np.ndarray, y: np.ndarray, label: int, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """``index`` without ``round(fraction · m)`` of its m records of class ``label``, drawn
    uniformly without replacement (the field study's class imbalance); sorted."""
    if not 0.0 <= fraction <= 1.0:
        raise InvalidArgument("fraction", f"must be in [0, 1], got {fraction!r}")
    index = np.asarray(index, dtype=np.int64)
    of_class = index[y[index] == label]
    dropped = rng.choice(of_class, size=round(fraction * len(of_class)), replace=False)
    return np.setdiff1d(index, dropped)


def feature_names(name: str) -> tuple[str, ...]:
    """The feature columns of a bundled dataset, in the order of ``load_dataset``'s x
    (scikit-learn's names: ``mean texture``, ``pixel_0_0``, ...)."""
    from sklearn import datasets

    if name == "digits":
        return tuple(datasets.load_digits().feature_names)
    if name == "breast_cancer":
        return tuple(datasets.load_breast_cancer().feature_names)
    raise InvalidArgument("dataset", f"must be one of {DATASETS}, got {name!r}")


def _check_sites(n_sites: int) -> None:
    if isinstance(n_sites, bool) or not isinstance(n_sites, int) or n_sites < 1:
        raise InvalidArgument("n_sites", f"must be a positive integer, got {n_sites!r}")
