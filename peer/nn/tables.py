"""A site's own records as tables: read from CSV, Parquet or ``.npz``, prepared for a model.

Two steps, kept apart so that a model always sees inputs prepared exactly as in its training:

1. :func:`read_table` reads the raw columns of a file (no statistics, no scaling) and checks
   them: the label column exists, the named features exist, every cell of a numeric column is
   a finite number, and no cell is empty unless missing values are to be imputed. Every error
   names the file, the column and the row.
2. :class:`Preprocessing` is *fitted* on the site's own training split — never on validation,
   test or public rows — and then *transforms* any table with the same columns into
   ``(X float32 (m, width), y int64 (m,))``. It is plain JSON (:meth:`Preprocessing.to_dict`)
   and is stored with every model and pool trained through it (``peer.nn.store``).

Column kinds (the rule, checked per feature column):

- a column is **categorical** when it is declared so (``categorical=[...]``, ``--categorical
  COL`` on the command line: integer codes such as ward numbers), or when *none* of its
  non-empty cells is a number (``"A"``, ``"yes"``, a Parquet string or boolean column);
- a column is **numeric** when every non-empty cell is a finite number;
- a column where some cells are numbers and others are not is refused, naming the first
  non-numeric cell (a typo such as ``"12,5"`` or ``"n/a"`` in a column of numbers): fix the
  cell, or declare the column categorical.

The label is always categorical. Its class list is sorted (numerically when every label is an
integer, else as text); class index k is the k-th entry.

The preparation (its statistics come from the training split only):

- numeric column j: x'_j = (x_j − mean_j) / std_j (population standard deviation; a constant
  column gets std_j = 1, so x'_j = 0);
- categorical column with training categories c_1 < … < c_K: K one-hot entries. A category
  the training split never saw is refused at transform time, naming it, unless the
  preprocessing was fitted with ``unseen="zeros"``: then it becomes all-zero entries.
- missing cells (empty, ``NA``, ``N/A``, ``NaN``, ``null``, ``None``) are refused unless the
  table was read with ``missing="impute"``: then the fit records a fill value per column (the
  training mean of a numeric column, the most frequent training category of a categorical one,
  ties broken by the sorted order) and transform fills with it. Labels are never imputed.

CSV files are UTF-8 (a byte-order mark, as spreadsheets write, is skipped), separated by commas,
or by semicolons or tabs when the header line holds no comma; ``.tsv`` is tab-separated.

Rows in messages are 1-based data rows, the header not counted; for CSV the spreadsheet row
(header = row 1) is given as well. No message holds a value of a record — not a cell, not a
category, not a list of them — only the file, the column, the row and counts: messages end up
on terminals and in logs.

Identifiers are no features. With the default features (every column but the label), a column
that looks like an identifier is refused by name with the ``--features`` that leave it out
(:func:`identifier_reason`: named like one, or holding a different non-float value in each of
at least :data:`UNIQUE_MIN_RECORDS` records). As a categorical feature it would one-hot every
record into an input of its own, write every value into the preprocessing, and meet only
values the training never saw in held-out records. Columns named in ``features`` are taken as
given; a label with a different value in each of at least that many records is refused.

Privacy: the statistics a preprocessing holds (means, standard deviations, category lists,
class list, fill values) are exact functions of the records it was fitted on, covered by no DP
guarantee. Two consequences:

- a DP-SGD pool's guarantee is for one training record *given* its preprocessing. Fitted on
  the protected records themselves, the preparation of every record would change with one
  record, and the statistics would travel inside every released model. So a pool's
  preprocessing is fitted on public records (``Preprocessing.fit(public_table,
  split="public")``, ``pool train --public FILE``) or given (a preprocessing agreed between
  sites), never fitted on the pool's own training records;
- a model's preprocessing stays with the site's files (model store manifests), and the daemon
  never sends it; but a probe set is prepared by it, and whoever knows the public file the
  probe came from can recover the statistics from the prepared rows. A site that wants none of
  its statistics out fits its models' preprocessing on public records as well
  (``model train --public FILE``).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from peer.base.errors import InvalidArgument

__all__ = [
    "FORMAT",
    "KINDS",
    "ColumnPrep",
    "PreparedRecords",
    "Preprocessing",
    "architecture_for",
    "file_digest",
    "identifier_reason",
    "input_size",
    "prepare_records",
    "read_table",
    "refuse_preprocessing_of",
    "split_indices",
]

FORMAT = 1
MISSING_TEXT = frozenset({"", "na", "n/a", "nan", "null", "none"})
SUFFIXES = (".csv", ".tsv", ".txt", ".parquet", ".pq", ".npz")

#: the preprocessings of other kinds of records, by the "kind" of their JSON form (a table's has
#: none): ``peer.nn.images`` registers "images" (``peer.nn`` imports it, so it is always there)
KINDS: dict[str, type[Preprocessing]] = {}

Missing = Literal["refuse", "impute"]
Unseen = Literal["refuse", "zeros"]


# --------------------------------------------------------------------------------------------
# Raw tables


@dataclass(frozen=True)
class Column:
    """One column's raw cells: ``text`` (str, or None where the cell is missing) and
    ``numbers`` (float64; NaN where the cell is missing or not a number)."""

    name: str
    kind: Literal["numeric", "categorical"]
    text: np.ndarray
    numbers: np.ndarray

    @property
    def missing(self) -> np.ndarray:
        return np.array([t is None for t in self.text], dtype=bool)

    def take(self, index: np.ndarray) -> Column:
        return replace(self, text=self.text[index], numbers=self.numbers[index])


@dataclass(frozen=True)
class Table:
    """Raw records read from one file: the label column (None for unlabelled public data),
    the feature columns in order, and each row's 1-based data row number in the file."""

    source: str  # the file, as named in messages
    label: str | None
    features: tuple[str, ...]
    columns: Mapping[str, Column]  # features and label
    rows: np.ndarray  # 1-based data row of each record in the file
    missing: Missing = "refuse"
    spreadsheet: bool = False  # CSV: also say the spreadsheet row (header = row 1)
    input_shape: tuple[int, ...] | None = None  # npz images: (channels, height, width)
    digest: str = ""  # sha256 of the file's bytes

    def __len__(self) -> int:
        return len(self.rows)

    def where(self, column: str, position: int) -> str:
        """``FILE, column 'C', data row R`` for the record at ``position``."""
        r = int(self.rows[position])
        sheet = f" (spreadsheet row {r + 1})" if self.spreadsheet else ""
        return f"{self.source}, column {column!r}, data row {r}{sheet}"

    def take(self, index: Sequence[int] | np.ndarray) -> Table:
        index = np.asarray(index, dtype=np.int64)
        return replace(self, columns={k: c.take(index) for k, c in self.columns.items()}, rows=self.rows[index])

    def labels_text(self) -> np.ndarray:
        if self.label is None:
            raise InvalidArgument("label", f"{self.source} was read without a label column")
        return self.columns[self.label].text

    def split(self, fraction: float, *, seed: int) -> tuple[Table, Table]:
        """(rest, held out): ``fraction`` of the records held out at random (seeded), stratified
        by label when every class has at least two records (:func:`split_indices`)."""
        labels = None if self.label is None else self.labels_text()
        rest, held = split_indices(len(self), labels, fraction, seed)
        return self.take(rest), self.take(held)


def split_indices(n: int, labels: np.ndarray | None, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(rest, held out) sorted record indices: ``fraction`` of ``n`` records held out at random
    (seeded), stratified by ``labels`` when every class has at least two records. Both parts
    are non-empty. One rule for tables and image records alike."""
    if not 0 < fraction < 1:
        raise InvalidArgument("validation_fraction", f"must be in (0, 1), got {fraction!r}")
    k = round(n * fraction)
    if k < 1 or k > n - 1:
        raise InvalidArgument(
            "validation_fraction",
            f"{fraction:g} of {n} records leaves an empty part; a split needs at least 2 records",
        )
    from sklearn.model_selection import train_test_split

    idx = np.arange(n)
    stratify = None
    if labels is not None:
        counts = Counter(labels)
        if min(counts.values()) >= 2 and len(counts) <= min(k, n - k):
            stratify = labels
    rest, held = train_test_split(idx, test_size=k, random_state=seed, stratify=stratify)
    return np.sort(rest), np.sort(held)


def file_digest(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _cells_from_text(values: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    """Text cells → (text with None for missing, float64 numbers with NaN where not a number)."""
    text = np.empty(len(values), dtype=object)
    numbers = np.full(len(values), np.nan)
    for i, v in enumerate(values):
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        s = str(v).strip()
        if s.lower() in MISSING_TEXT:
            continue
        text[i] = s
        with contextlib.suppress(ValueError):  # not a number: the text stays
            numbers[i] = float(s)
    return text, numbers


def _cells_from_array(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A typed array → cells. Numbers stay numbers (NaN = missing); booleans and everything
    else become text (and are then categorical, unless they read as numbers)."""
    if values.dtype.kind in "iuf":
        numbers = values.astype(np.float64)
        text = np.empty(len(values), dtype=object)
        for i, v in enumerate(values.tolist()):
            if not (isinstance(v, float) and math.isnan(v)):
                text[i] = str(int(v)) if values.dtype.kind in "iu" or float(v).is_integer() else repr(float(v))
        return text, numbers
    if values.dtype.kind == "b":
        return _cells_from_text([str(bool(v)) for v in values])
    return _cells_from_text(list(values))


def _kind_of(
    table_name: str,
    name: str,
    text: np.ndarray,
    numbers: np.ndarray,
    rows: np.ndarray,
    declared_categorical: bool,
    spreadsheet: bool,
) -> Literal["numeric", "categorical"]:
    present = np.array([t is not None for t in text], dtype=bool)
    is_number = present & ~np.isnan(numbers)
    infinite = is_number & ~np.isfinite(numbers)
    if declared_categorical:
        return "categorical"
    if not is_number.any():
        return "categorical"
    not_number = present & np.isnan(numbers)
    bad = np.flatnonzero(not_number | infinite)
    if len(bad):
        i = int(bad[0])
        r = int(rows[i])
        sheet = f" (spreadsheet row {r + 1})" if spreadsheet else ""
        what = "an infinite value" if infinite[i] else "a non-numeric value"
        hint = (
            " (written with a decimal comma? numbers are written with a point: 12.5)"
            if re.fullmatch(r"[-+]?\d+,\d+", text[i])
            else ""
        )
        raise InvalidArgument(
            f"{table_name}, column {name!r}, data row {r}{sheet}",
            f"{what}{hint} in a numeric column ({int(is_number.sum())} of its cells are numbers; "
            f"{len(bad)} are not): fix the cell, or declare the column categorical (--categorical {name})",
        )
    return "numeric"


#: a column name is an identifier's when one of its words (split at non-letters and camelCase,
#: any case) is one of these ...
IDENTIFIER_WORDS = frozenset(
    {
        "id",
        "ids",
        "uuid",
        "guid",
        "identifier",
        "mrn",
        "ssn",
        "nhs",
        "name",
        "names",
        "firstname",
        "lastname",
        "surname",
        "fullname",
        "email",
        "phone",
        "telephone",
        "address",
    }
)
#: ... or when it is one of these words alone, or with a word of NUMBER_WORDS, or run
#: together with "id"/"no" (``patient``, ``subject_no``, ``PatientNumber``, ``patientid``)
RECORD_WORDS = frozenset({"patient", "subject", "person", "participant", "record", "encounter", "customer"})
NUMBER_WORDS = frozenset({"no", "nr", "num", "number", "code", "key", "ref", "index", "idx"})
#: a column whose every record holds a different non-float value is an identifier only in a
#: table of at least this many records (in a handful of rows, codes or ages are unique by chance)
UNIQUE_MIN_RECORDS = 20
_INTEGER_TEXT = re.compile(r"[-+]?\d+")


def _name_words(name: str) -> list[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1 \2", name))
    return [w.lower() for w in re.split(r"[^A-Za-z0-9]+", spaced) if w]


def identifier_reason(name: str, text: np.ndarray, records: int) -> str | None:
    """Why a column looks like an identifier rather than a feature, or None.

    By its name (:data:`IDENTIFIER_WORDS`, :data:`RECORD_WORDS`), or by its values: with at
    least :data:`UNIQUE_MIN_RECORDS` records, no cell missing and every cell different, and no
    cell a non-integer number (text codes ``P0017``, integers ``100234``; a measured quantity
    such as ``120.5`` is not an identifier even when unique). The reason names no value."""
    words = _name_words(name)
    if any(w in IDENTIFIER_WORDS for w in words):
        return "its name"
    if words and words[0] in RECORD_WORDS and all(w in NUMBER_WORDS for w in words[1:]):
        return "its name"
    if any(w.endswith(("id", "no")) and w[:-2] in RECORD_WORDS for w in words):
        return "its name"
    present = [t for t in text if t is not None]
    unique = records >= UNIQUE_MIN_RECORDS and len(present) == records and len(set(present)) == records
    if unique and not any(_is_float_text(t) for t in present):
        return f"a different value in each of its {records} records"
    return None


def _is_float_text(t: str) -> bool:
    if _INTEGER_TEXT.fullmatch(t):
        return False
    try:
        float(t)
    except ValueError:
        return False
    return True


def _refuse_identifier_features(
    source: str, chosen: list[str], cells: Mapping[str, tuple[np.ndarray, np.ndarray]], records: int
) -> None:
    """Refuse, by name, default feature columns that look like identifiers: a one-hot of an
    identifier gives each record an input of its own and puts every value in the
    preprocessing, and every held-out record's value is one the training never saw."""
    flagged = {n: r for n in chosen if (r := identifier_reason(n, cells[n][0], records)) is not None}
    if not flagged:
        return
    import shlex

    rest = [n for n in chosen if n not in flagged]
    which = ", ".join(f"{n!r} ({r})" for n, r in flagged.items())
    many = len(flagged) > 1
    hint = f"--features {' '.join(shlex.quote(n) for n in rest)}" if rest else "--features COL [COL ...]"
    raise InvalidArgument(
        f"{source}: features",
        f"column{'s' if many else ''} {which} look{'' if many else 's'} like {'identifiers' if many else 'an identifier'}, "
        "and by default every column but the label is a feature; an identifier is no feature (each record's "
        f"value would be an input of its own): name the features, e.g. {hint} (in a scenario: features = [...] "
        "in [data])",
    )


def _refuse_identifier_label(source: str, label: str, text: np.ndarray, records: int) -> None:
    present = [t for t in text if t is not None]
    if records >= UNIQUE_MIN_RECORDS and len(set(present)) == records:
        raise InvalidArgument(
            f"{source}: label {label!r}",
            f"has a different value in each of its {records} records: it looks like an identifier, not a class "
            "(a classifier needs classes shared by records); give the label column with --label",
        )


def _separator(path: Path, suffix: str) -> str:
    """Comma, unless the header line has none and holds semicolons (spreadsheets in locales
    whose decimal mark is a comma write those) or tabs (and always tab for .tsv)."""
    if suffix == ".tsv":
        return "\t"
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        header = f.readline()
    if "," not in header:
        for sep in (";", "\t"):
            if sep in header:
                return sep
    return ","


def _frame_cells(path: Path, suffix: str) -> tuple[list[str], dict[str, tuple[np.ndarray, np.ndarray]], int]:
    """Column names, cells per column and row count of a CSV or Parquet file (pandas)."""
    import pandas as pd

    try:
        if suffix in (".parquet", ".pq"):
            frame = pd.read_parquet(path)
            cells = {str(c): _cells_from_array(frame[c].to_numpy()) for c in frame.columns}
        else:
            # Every cell as text: the kinds are decided here, by the rule of the module
            # docstring, not by pandas' guess (which turns "12,5" in a numeric column into
            # a whole column of strings without saying where).
            frame = pd.read_csv(
                path,
                dtype=str,
                keep_default_na=False,
                na_filter=False,
                sep=_separator(path, suffix),
                skipinitialspace=True,
                encoding="utf-8-sig",
            )
            cells = {str(c): _cells_from_text(frame[c].tolist()) for c in frame.columns}
    except pd.errors.EmptyDataError:
        raise InvalidArgument(
            str(path), "is empty: expected a header line with the column names, then one line per record"
        ) from None
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError, OSError) as e:
        raise InvalidArgument(
            str(path), f"cannot be read as {'Parquet' if suffix in ('.parquet', '.pq') else 'CSV'}: {e}"
        ) from None
    names = [str(c) for c in frame.columns]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise InvalidArgument(str(path), f"has duplicate column names {dup}")
    return names, cells, len(frame)


def _npz_cells(
    path: Path, label: str | None
) -> tuple[list[str], dict[str, tuple[np.ndarray, np.ndarray]], int, tuple[int, ...] | None]:
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: np.asarray(data[k]) for k in data.files}
    except (ValueError, OSError) as e:
        raise InvalidArgument(str(path), f"is not a readable .npz file (arrays only, nothing pickled): {e}") from None
    if "x" not in arrays:
        raise InvalidArgument(str(path), f"must hold the inputs as array 'x'; it holds {sorted(arrays)}")
    x = arrays["x"]
    if x.ndim < 2 or x.shape[0] == 0:
        raise InvalidArgument(f"{path}: x", f"must have shape (m, ...) with m > 0, got {x.shape}")
    if x.dtype.kind not in "iuf":
        raise InvalidArgument(f"{path}: x", f"must be numbers, got dtype {x.dtype}")
    m = int(x.shape[0])
    flat = x.reshape(m, -1)
    names = [f"x{j}" for j in range(flat.shape[1])]
    cells = {n: _cells_from_array(flat[:, j]) for j, n in enumerate(names)}
    if label is not None:
        if label not in arrays:
            raise InvalidArgument(f"{path}: label", f"no array {label!r} in the file; it holds {sorted(arrays)}")
        y = arrays[label]
        if y.shape != (m,):
            raise InvalidArgument(f"{path}: {label}", f"must have shape ({m},) (one label per row of x), got {y.shape}")
        names.append(label)
        cells[label] = _cells_from_array(y)
    shape = None
    if x.ndim == 4:
        shape = tuple(int(s) for s in x.shape[1:])
    elif x.ndim == 3:
        shape = (1, int(x.shape[1]), int(x.shape[2]))
    return names, cells, m, shape


def read_table(
    path: str | os.PathLike,
    *,
    label: str | None,
    features: Sequence[str] | None = None,
    categorical: Sequence[str] = (),
    missing: Missing = "refuse",
) -> Table:
    """Read a site's records from ``path`` (``.csv``, ``.tsv``, ``.parquet``/``.pq`` or ``.npz``).

    ``label``: the label column (for ``.npz``, the label array; ``"y"`` by convention), or None
    for unlabelled data (a public probe file). ``features``: the feature columns, in order
    (default: every other column; for ``.npz`` the columns of x are ``x0, x1, …``).
    ``categorical``: feature columns to treat as categories even when they hold numbers.
    ``missing``: ``"refuse"`` (default) or ``"impute"`` (keep missing feature cells for
    :class:`Preprocessing` to fill). Raw values only: nothing is scaled here."""
    p = Path(path)
    if missing not in ("refuse", "impute"):
        raise InvalidArgument("missing", f"must be 'refuse' or 'impute', got {missing!r}")
    suffix = p.suffix.lower()
    if suffix not in SUFFIXES:
        raise InvalidArgument(str(p), f"has an unknown type; expected one of {list(SUFFIXES)}")
    if not p.is_file():
        raise InvalidArgument(str(p), "is not a file")
    if p.stat().st_size == 0:
        raise InvalidArgument(
            str(p), "is empty: expected a header line with the column names, then one line per record"
        )
    shape = None
    if suffix == ".npz":
        names, cells, m, shape = _npz_cells(p, label)
    else:
        names, cells, m = _frame_cells(p, suffix)
    source = str(p)
    if m == 0:
        raise InvalidArgument(source, f"has no records (columns {names}, no data rows)")
    if label is not None and label not in cells:
        raise InvalidArgument(f"{source}: label", f"no column {label!r}; the file's columns are {names}")
    if features is None:
        chosen = [n for n in names if n != label]
    else:
        chosen = list(features)
        unknown = [f for f in chosen if f not in cells]
        if unknown:
            raise InvalidArgument(f"{source}: features", f"unknown columns {unknown}; the file's columns are {names}")
        if label is not None and label in chosen:
            raise InvalidArgument(f"{source}: features", f"include the label column {label!r}")
        if len(set(chosen)) != len(chosen):
            raise InvalidArgument(f"{source}: features", f"name a column twice: {chosen}")
    if not chosen:
        raise InvalidArgument(f"{source}: features", "no feature columns (the file holds only the label)")
    if label is not None:
        _refuse_identifier_label(source, label, cells[label][0], m)
    if features is None and suffix != ".npz":  # npz columns are x's entries, not named columns
        _refuse_identifier_features(source, chosen, cells, m)
    stray = [c for c in categorical if c not in chosen]
    if stray:
        raise InvalidArgument(
            f"{source}: categorical", f"names columns that are not features: {stray}; features are {chosen}"
        )
    rows = np.arange(1, m + 1, dtype=np.int64)
    spreadsheet = suffix in (".csv", ".tsv", ".txt")
    columns: dict[str, Column] = {}
    for name in chosen:
        text, numbers = cells[name]
        kind = _kind_of(source, name, text, numbers, rows, name in categorical, spreadsheet)
        columns[name] = Column(name, kind, text, numbers)
    if label is not None:
        text, numbers = cells[label]
        columns[label] = Column(label, "categorical", text, numbers)
    table = Table(source, label, tuple(chosen), columns, rows, missing, spreadsheet, shape, file_digest(p))
    checked = chosen if missing == "refuse" else []
    for name in checked + ([label] if label is not None else []):
        holes = np.flatnonzero(columns[name].missing)
        if len(holes):
            fix = "labels are never imputed" if name == label else "fill it, or impute missing values (--impute)"
            raise InvalidArgument(
                table.where(name, int(holes[0])),
                f"is empty or missing ({len(holes)} missing cell(s) in this column): {fix}",
            )
    return table


# --------------------------------------------------------------------------------------------
# Preprocessing


@dataclass(frozen=True)
class ColumnPrep:
    """How one feature column is prepared. Numeric: (x − mean) / std. Categorical: one-hot over
    ``categories``. ``fill``: the imputed value of a missing cell (None: missing is refused)."""

    name: str
    kind: Literal["numeric", "categorical"]
    mean: float = 0.0
    std: float = 1.0
    categories: tuple[str, ...] = ()
    fill: float | str | None = None

    @property
    def width(self) -> int:
        return 1 if self.kind == "numeric" else len(self.categories)

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"name": self.name, "kind": self.kind, "fill": self.fill}
        if self.kind == "numeric":
            out.update(mean=self.mean, std=self.std)
        else:
            out["categories"] = list(self.categories)
        return out


@dataclass(frozen=True)
class Preprocessing:
    """The preparation of a site's records for one model, fitted on its training split.

    ``columns`` in input order (the model's input entries follow it: one per numeric column,
    one per category of a categorical one); ``classes``: label values by class index;
    ``unseen``: what a category the training never saw becomes ("refuse" or "zeros");
    ``fitted_on``: the file (name and sha256) and number of training rows it came from."""

    label: str
    classes: tuple[int | str, ...]
    columns: tuple[ColumnPrep, ...]
    unseen: Unseen = "refuse"
    input_shape: tuple[int, ...] | None = None
    fitted_on: Mapping[str, Any] = field(default_factory=dict)

    # ---- shape ----------------------------------------------------------------------------

    @property
    def width(self) -> int:
        """Entries of one prepared input row."""
        return sum(c.width for c in self.columns)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def features(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    @property
    def categorical(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if c.kind == "categorical")

    @property
    def imputes(self) -> bool:
        return any(c.fill is not None for c in self.columns)

    def input_names(self) -> list[str]:
        """A name per input entry: ``age``, ``ward=A``, ``ward=B``, …"""
        out: list[str] = []
        for c in self.columns:
            out += [c.name] if c.kind == "numeric" else [f"{c.name}={v}" for v in c.categories]
        return out

    def describe_inputs(self, limit: int = 8) -> str:
        """The input columns for a message: names, and a categorical column's number of
        one-hot entries, never its categories (values of records): ``age, ward (3 one-hot), bp``."""
        parts = [c.name if c.kind == "numeric" else f"{c.name} ({c.width} one-hot)" for c in self.columns]
        return ", ".join(parts[:limit]) + (f", … ({len(parts)} columns)" if len(parts) > limit else "")

    def read(self, path: str | os.PathLike, *, labelled: bool = True) -> Table:
        """:func:`read_table` of a file with this preprocessing's columns, kinds and missing
        policy (and its label column when ``labelled``)."""
        return read_table(
            path,
            label=self.label if labelled else None,
            features=self.features,
            categorical=self.categorical,
            missing="impute" if self.imputes else "refuse",
        )

    # ---- fit ------------------------------------------------------------------------------

    @classmethod
    def fit(
        cls, table: Table, *, unseen: Unseen = "refuse", split: Literal["training", "public"] = "training"
    ) -> Preprocessing:
        """Statistics of ``table`` — the site's TRAINING split only, or public records
        (``split="public"``; never validation or test records) — for every feature column, and
        the label's class list. Missing cells get fill values when the table was read with
        ``missing="impute"``. ``split`` is recorded in ``fitted_on``."""
        if split not in ("training", "public"):
            raise InvalidArgument("split", f"must be 'training' or 'public', got {split!r}")
        if unseen not in ("refuse", "zeros"):
            raise InvalidArgument("unseen", f"must be 'refuse' or 'zeros', got {unseen!r}")
        if table.label is None:
            raise InvalidArgument("label", f"fitting needs labelled records; {table.source} was read without a label")
        if len(table) == 0:
            raise InvalidArgument(table.source, "the training split is empty")
        impute = table.missing == "impute"
        columns = []
        for name in table.features:
            col = table.columns[name]
            present = ~col.missing
            if not present.any():
                raise InvalidArgument(f"{table.source}, column {name!r}", "has no values in the training split")
            if col.missing.any() and not impute:
                raise InvalidArgument(
                    table.where(name, int(np.flatnonzero(col.missing)[0])),
                    "is empty or missing: fill it, or impute (--impute)",
                )
            if col.kind == "numeric":
                v = col.numbers[present]
                mean, std = float(v.mean()), float(v.std())
                fill = mean if impute else None
                columns.append(ColumnPrep(name, "numeric", mean, std if std > 0 else 1.0, (), fill))
            else:
                counts = Counter(col.text[present].tolist())
                categories = tuple(sorted(counts))
                fill = min(categories, key=lambda c: (-counts[c], c)) if impute else None
                columns.append(ColumnPrep(name, "categorical", categories=categories, fill=fill))
        classes = _classes(table)
        if len(classes) < 2:
            raise InvalidArgument(
                f"{table.source}: label {table.label!r}",
                "has one class in the training split; a classifier needs at least two",
            )
        fitted_on = {"file": Path(table.source).name, "sha256": table.digest, "rows": len(table), "split": split}
        width = sum(c.width for c in columns)
        shape = (
            table.input_shape if table.input_shape is not None and int(np.prod(table.input_shape)) == width else None
        )
        return cls(table.label, classes, tuple(columns), unseen, shape, fitted_on)

    # ---- transform ------------------------------------------------------------------------

    def transform(self, table: Table) -> tuple[np.ndarray, np.ndarray | None]:
        """``(X float32 (m, width), y int64 (m,))`` prepared as in training; y is None when the
        table was read without its label."""
        m = len(table)
        x = np.zeros((m, self.width), dtype=np.float32)
        offset = 0
        for c in self.columns:
            col = table.columns.get(c.name)
            if col is None:
                raise InvalidArgument(
                    f"{table.source}: features",
                    f"no column {c.name!r}, which the model was trained with; it needs {list(self.features)}",
                )
            holes = col.missing
            if holes.any() and c.fill is None:
                raise InvalidArgument(
                    table.where(c.name, int(np.flatnonzero(holes)[0])),
                    "is empty or missing, and the model's preprocessing was fitted without imputation",
                )
            if c.kind == "numeric":
                values = col.numbers.copy()
                bad = np.flatnonzero(~holes & ~np.isfinite(values))
                if len(bad):
                    raise InvalidArgument(
                        table.where(c.name, int(bad[0])),
                        "is not a finite number (the column is numeric)",
                    )
                values[holes] = float(c.fill) if c.fill is not None else 0.0
                x[:, offset] = (values - c.mean) / c.std
            else:
                index = {v: k for k, v in enumerate(c.categories)}
                for i, t in enumerate(col.text):
                    t = c.fill if t is None else t
                    k = index.get(t)
                    if k is None:
                        if self.unseen == "refuse":
                            raise InvalidArgument(
                                table.where(c.name, i),
                                f"holds a category the training split never saw (it saw {len(c.categories)}); "
                                "the preprocessing was fitted to refuse unseen categories (--allow-unseen: "
                                "all-zero one-hot instead)",
                            )
                        continue  # all-zero one-hot, as the training asked
                    x[i, offset + k] = 1.0
            offset += c.width
        y = None
        if table.label is not None:
            y = self._labels(table)
        return x, y

    def _labels(self, table: Table) -> np.ndarray:
        index = {v: k for k, v in enumerate(self.classes)}
        integer = all(isinstance(v, int) for v in self.classes)
        col = table.columns[table.label]
        y = np.empty(len(table), dtype=np.int64)
        for i, t in enumerate(col.text):
            if t is None:
                raise InvalidArgument(table.where(table.label, i), "the label is missing (labels are never imputed)")
            key: int | str = t
            if integer:
                v = col.numbers[i]
                key = int(v) if math.isfinite(v) and float(v).is_integer() else t
            k = index.get(key)
            if k is None:
                raise InvalidArgument(
                    table.where(table.label, i), f"the label is not one of the model's {len(self.classes)} classes"
                )
            y[i] = k
        return y

    # ---- JSON -----------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "label": self.label,
            "classes": list(self.classes),
            "columns": [c.to_dict() for c in self.columns],
            "unseen": self.unseen,
            "input_shape": None if self.input_shape is None else list(self.input_shape),
            "fitted_on": dict(self.fitted_on),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "preprocessing") -> Preprocessing:
        """Check and rebuild a preprocessing from its JSON form."""

        def bad(key: str, rule: str):
            raise InvalidArgument(f"{where}.{key}", rule)

        if not isinstance(data, Mapping):
            raise InvalidArgument(where, "must be an object")
        if "kind" in data:  # another kind of records (image records: peer.nn.images); a table's has no kind
            kind = KINDS.get(data["kind"]) if isinstance(data["kind"], str) else None
            if kind is None:
                bad("kind", f"must be one of {sorted(KINDS)} or absent (a table), got {data['kind']!r}")
            return kind.from_dict(data, where)
        if data.get("format") != FORMAT:
            bad("format", f"must be {FORMAT}, got {data.get('format')!r}")
        label = data.get("label")
        if not isinstance(label, str) or not label:
            bad("label", f"must be a non-empty string, got {label!r}")
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
            bad(
                "classes",
                f"must be at least two distinct labels, all integers or all strings, got {_shape_of(classes)}",
            )
        unseen = data.get("unseen", "refuse")
        if unseen not in ("refuse", "zeros"):
            bad("unseen", f"must be 'refuse' or 'zeros', got {unseen!r}")
        raw = data.get("columns")
        if not isinstance(raw, list) or not raw:
            bad("columns", "must be a non-empty list")
        columns = []
        for i, c in enumerate(raw):
            w = f"columns[{i}]"
            if (
                not isinstance(c, Mapping)
                or not isinstance(c.get("name"), str)
                or c.get("kind") not in ("numeric", "categorical")
            ):
                bad(w, f"must have a name and kind 'numeric' or 'categorical', got {_shape_of(c)}")
            fill = c.get("fill")
            if c["kind"] == "numeric":
                mean, std = c.get("mean"), c.get("std")
                for key, v in (("mean", mean), ("std", std)):
                    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                        bad(f"{w}.{key}", f"must be a finite number, got {v!r}")
                if not std > 0:
                    bad(f"{w}.std", f"must be > 0, got {std!r}")
                if fill is not None and (
                    isinstance(fill, bool) or not isinstance(fill, (int, float)) or not math.isfinite(fill)
                ):
                    bad(f"{w}.fill", f"must be a finite number or null, got {fill!r}")
                columns.append(
                    ColumnPrep(c["name"], "numeric", float(mean), float(std), (), None if fill is None else float(fill))
                )
            else:
                cats = c.get("categories")
                if (
                    not isinstance(cats, list)
                    or not cats
                    or not all(isinstance(v, str) for v in cats)
                    or len(set(cats)) != len(cats)
                ):
                    bad(f"{w}.categories", f"must be a non-empty list of distinct strings, got {_shape_of(cats)}")
                if fill is not None and fill not in cats:
                    bad(f"{w}.fill", "must be one of the categories or null")
                columns.append(ColumnPrep(c["name"], "categorical", categories=tuple(cats), fill=fill))
        names = [c.name for c in columns]
        if len(set(names)) != len(names) or label in names:
            bad("columns", f"names must be distinct and differ from the label, got {names}")
        shape = data.get("input_shape")
        if shape is not None:
            if not isinstance(shape, list) or not all(
                isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape
            ):
                bad("input_shape", f"must be null or a list of positive integers, got {shape!r}")
            shape = tuple(shape)
        fitted_on = data.get("fitted_on", {})
        if not isinstance(fitted_on, Mapping):
            bad("fitted_on", "must be an object")
        return cls(label, tuple(classes), tuple(columns), unseen, shape, dict(fitted_on))


def refuse_preprocessing_of(preprocessing, records_digest: str, records_name: str, field: str, fix: str) -> None:
    """Refuse ``preprocessing`` (a table's or images') for DP-SGD on the records whose sha256 is
    ``records_digest`` when it was fitted on their own training split: its statistics are then
    functions of every protected record, so one record would change how every other record is
    prepared, and DP-SGD's guarantee (for one record given its preparation) would not hold.
    Fitted on public records (``split="public"``) or on other records (an agreed preparation),
    it passes. ``fix`` says, in the caller's words, what to do instead."""
    fitted = preprocessing.fitted_on
    if fitted.get("split") == "training" and fitted.get("sha256") == records_digest:
        raise InvalidArgument(
            field,
            f"the preprocessing was fitted on the training split of {records_name}, the protected "
            f"records DP-SGD would train on (its statistics would change with one record, outside "
            f"the guarantee); {fix}",
        )


def _shape_of(value: Any) -> str:
    """What a malformed value is, without its contents (a preprocessing's categories and
    classes are values of records): its type, its length, and for a list the element types."""
    if isinstance(value, (list, tuple)):
        kinds = sorted({type(v).__name__ for v in value})
        distinct = len({repr(v) for v in value})
        return f"a list of {len(value)} ({distinct} distinct; {', '.join(kinds) or 'empty'})"
    if isinstance(value, Mapping):
        return f"an object with keys {sorted(map(str, value))}"
    return f"a {type(value).__name__}"


def _classes(table: Table) -> tuple[int | str, ...]:
    col = table.columns[table.label]
    text = [t for t in col.text if t is not None]
    numbers = col.numbers[[t is not None for t in col.text]]
    if len(text) and np.all(np.isfinite(numbers)) and np.all(numbers == np.round(numbers)):
        return tuple(sorted({int(v) for v in numbers}))
    return tuple(sorted(set(text)))


def architecture_for(
    spec: Mapping[str, Any] | str, preprocessing: Preprocessing, *, hidden: Sequence[int] = (64,)
) -> dict:
    """An architecture (``peer.nn.architectures``) whose input and output sizes come from the
    preprocessing. ``spec``: a preset name (``"mlp"``, ``"cnn"``) or an architecture object
    whose ``input_dim``/``input_shape`` and ``output_dim`` may be left out (given, they must
    agree with the preprocessing)."""
    from peer.nn.architectures import validate_architecture

    if isinstance(spec, str):
        if spec == "mlp":
            spec = {"kind": "mlp", "hidden": list(hidden)}
        elif spec == "cnn":
            spec = {"kind": "cnn", "channels": [16, 32], "hidden": list(hidden)}
        else:
            raise InvalidArgument("preset", f"must be 'mlp' or 'cnn', got {spec!r}")
    arch = dict(spec)
    kind = arch.get("kind")
    if kind == "mlp":
        arch.setdefault("input_dim", preprocessing.width)
        if arch["input_dim"] != preprocessing.width:
            raise InvalidArgument(
                "architecture.input_dim",
                f"is {arch['input_dim']!r} but the prepared records have {preprocessing.width} entries ({preprocessing.describe_inputs()})",
            )
    elif kind == "cnn":
        shape = preprocessing.input_shape
        if "input_shape" not in arch:
            if shape is None or len(shape) != 3:
                raise InvalidArgument(
                    "architecture.input_shape",
                    "a CNN needs image records ([channels, height, width]); these records are a table: use an MLP, or give input_shape",
                )
            arch["input_shape"] = list(shape)
        if int(np.prod(arch["input_shape"])) != preprocessing.width:
            raise InvalidArgument(
                "architecture.input_shape",
                f"{arch['input_shape']} does not hold the {preprocessing.width} prepared entries",
            )
        if "pool" not in arch:
            h, w = arch["input_shape"][1], arch["input_shape"][2]
            pool = []
            for _ in arch.get("channels", []):
                p = 2 if h % 2 == 0 and w % 2 == 0 and h >= 4 and w >= 4 else 1
                h, w = h // p, w // p
                pool.append(p)
            arch["pool"] = pool
    arch.setdefault("output_dim", preprocessing.num_classes)
    if arch["output_dim"] != preprocessing.num_classes:
        raise InvalidArgument(
            "architecture.output_dim",
            f"is {arch['output_dim']!r} but the label has {preprocessing.num_classes} classes",
        )
    return validate_architecture(arch)


def input_size(architecture: Mapping[str, Any]) -> int:
    """Entries of one input row of an architecture (MLP input_dim, CNN prod(input_shape))."""
    if architecture.get("kind") == "cnn":
        return int(np.prod(architecture["input_shape"]))
    return int(architecture["input_dim"])


# --------------------------------------------------------------------------------------------
# A site's records, split and prepared for training


@dataclass(frozen=True)
class PreparedRecords:
    """A site's records split into a training part and a held-out validation part, both
    prepared by ``preprocessing`` (fitted on the training part only, unless one was given).
    ``description`` says which file and split, for the model's metadata."""

    preprocessing: Preprocessing
    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    description: dict


def prepare_records(
    path: str | os.PathLike,
    *,
    label: str,
    features: Sequence[str] | None = None,
    categorical: Sequence[str] = (),
    missing: Missing = "refuse",
    unseen: Unseen = "refuse",
    validation_fraction: float = 0.2,
    split_seed: int = 0,
    preprocessing: Preprocessing | None = None,
    public: str | os.PathLike | None = None,
) -> PreparedRecords:
    """Read ``path``, hold out ``validation_fraction`` of the records (stratified, seeded by the
    public ``split_seed``), fit the preprocessing on the rest (the training split) — or on the
    records of the ``public`` file, or use the given one — and prepare both parts."""
    if public is not None:
        if preprocessing is not None:
            raise InvalidArgument("public", "give a preprocessing or a public file to fit one on, not both")
        public_table = read_table(public, label=label, features=features, categorical=categorical, missing=missing)
        preprocessing = Preprocessing.fit(public_table, unseen=unseen, split="public")
    if preprocessing is None:
        table = read_table(path, label=label, features=features, categorical=categorical, missing=missing)
    else:
        if label != preprocessing.label:
            raise InvalidArgument(
                "label", f"is {label!r} but the given preprocessing was fitted for label {preprocessing.label!r}"
            )
        table = preprocessing.read(path)
    train, val = table.split(validation_fraction, seed=split_seed)
    prep = preprocessing if preprocessing is not None else Preprocessing.fit(train, unseen=unseen)
    x_train, y_train = prep.transform(train)
    x_val, y_val = prep.transform(val)
    description = {
        "file": Path(table.source).name,
        "sha256": table.digest,
        "label": label,
        "rows": len(table),
        "training_rows": len(train),
        "validation_rows": len(val),
        "validation_fraction": validation_fraction,
        "split_seed": split_seed,
        "preprocessing": (
            "fitted on the training split"
            if preprocessing is None
            else f"fitted on public records ({preprocessing.fitted_on.get('file')})"
            if preprocessing.fitted_on.get("split") == "public"
            else "given"
        ),
    }
    return PreparedRecords(prep, x_train, y_train, x_val, y_val, description)
