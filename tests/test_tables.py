"""A site's own records (peer.nn.tables): readers that refuse bad input naming file, column and
row; preprocessing fitted on the training split only; its JSON form and its round trip through
the model store."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.base.errors import InvalidArgument
from peer.nn.tables import Preprocessing, architecture_for, prepare_records, read_table

HEADER = ["age", "ward", "bp", "outcome"]
ROWS = [
    ["50", "A", "120.5", "yes"],
    ["61", "B", "130", "no"],
    ["45", "A", "118", "yes"],
    ["70", "C", "140", "no"],
    ["66", "B", "135", "no"],
    ["52", "C", "121", "yes"],
]


def write_csv(path: Path, rows=ROWS, header=HEADER) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def with_cell(row: int, col: str, value: str) -> list[list[str]]:
    rows = [list(r) for r in ROWS]
    rows[row - 1][HEADER.index(col)] = value
    return rows


def records(n: int, seed: int) -> list[list[str]]:
    """A table whose label is (almost) a function of its features: numeric age and blood
    pressure, categorical ward and sex, label "sick"/"well"."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        age, bp = rng.normal(60, 10), rng.normal(130, 15)
        ward, sex = rng.choice(["A", "B", "C"]), rng.choice(["f", "m"])
        score = (age - 60) / 10 + (1.5 if ward == "C" else -0.5) + (bp - 130) / 30
        out.append([f"{age:.1f}", ward, f"{bp:.1f}", sex, "sick" if score > 0 else "well"])
    return out


# ---------------------------------------------------------------------------------- reading


def test_kinds_follow_the_rule(tmp_path):
    t = read_table(write_csv(tmp_path / "r.csv"), label="outcome")
    assert t.features == ("age", "ward", "bp")
    assert [t.columns[c].kind for c in t.features] == ["numeric", "categorical", "numeric"]
    # integer codes are numbers unless declared categorical
    t = read_table(tmp_path / "r.csv", label="outcome", categorical=["age"])
    assert t.columns["age"].kind == "categorical"
    p = Preprocessing.fit(t)
    assert p.input_names()[:2] == ["age=45", "age=50"] and p.width == 6 + 3 + 1


BAD_INPUTS = [
    # (rows, read kwargs, fit?, fragments the message must hold)
    (
        with_cell(3, "age", "12,5"),
        {},
        False,
        [
            "r.csv, column 'age', data row 3 (spreadsheet row 4)",
            "a non-numeric value (written with a decimal comma?",
            "--categorical age",
        ],
    ),
    (
        with_cell(1, "bp", "n/a?"),
        {},
        False,
        ["column 'bp', data row 1 (spreadsheet row 2): a non-numeric value in"],
    ),
    (with_cell(2, "bp", "inf"), {}, False, ["column 'bp', data row 2", "an infinite value in"]),
    (
        with_cell(4, "bp", ""),
        {},
        False,
        ["column 'bp', data row 4 (spreadsheet row 5)", "empty or missing", "--impute"],
    ),
    (with_cell(5, "ward", "NA"), {}, False, ["column 'ward', data row 5", "empty or missing"]),
    (
        with_cell(2, "outcome", ""),
        {"missing": "impute"},
        False,
        ["column 'outcome', data row 2", "labels are never imputed"],
    ),
    (ROWS, {"label": "death"}, False, ["r.csv: label", "no column 'death'", "['age', 'ward', 'bp', 'outcome']"]),
    (ROWS, {"features": ["age", "weight"]}, False, ["r.csv: features", "unknown columns ['weight']"]),
    (ROWS, {"features": ["age", "outcome"]}, False, ["include the label column 'outcome'"]),
    (ROWS, {"categorical": ["outcome"]}, False, ["r.csv: categorical", "not features"]),
    ([[*r[:3], "yes"] for r in ROWS], {}, True, ["label 'outcome'", "one class in the training split", "at least two"]),
]


@pytest.mark.parametrize("rows,kwargs,fit,fragments", BAD_INPUTS)
def test_bad_input_is_refused_naming_file_column_and_row(tmp_path, rows, kwargs, fit, fragments):
    path = write_csv(tmp_path / "r.csv", rows)
    kwargs = {"label": "outcome", **kwargs}
    with pytest.raises(InvalidArgument) as e:
        t = read_table(path, **kwargs)
        assert fit, "read_table accepted it"
        Preprocessing.fit(t)
    for f in fragments:
        assert f in str(e.value), (f, str(e.value))
    # no message holds a record's value: none of the cells this case changed appears in it
    changed = {v for r, ref in zip(rows, ROWS, strict=True) for v, w in zip(r, ref, strict=True) if v != w and v}
    assert not any(repr(v) in str(e.value) for v in changed), str(e.value)


def test_empty_and_header_only_files(tmp_path):
    (tmp_path / "e.csv").write_text("")
    with pytest.raises(InvalidArgument, match=r"e\.csv: is empty"):
        read_table(tmp_path / "e.csv", label="y")
    (tmp_path / "h.csv").write_text("a,b,y\n")
    with pytest.raises(InvalidArgument, match=r"h\.csv: has no records \(columns \['a', 'b', 'y'\]"):
        read_table(tmp_path / "h.csv", label="y")
    with pytest.raises(InvalidArgument, match="unknown type"):
        read_table(tmp_path / "r.xlsx", label="y")


def test_spreadsheet_exports_read_alike(tmp_path):
    """A UTF-8 byte-order mark and semicolon or tab separators, as spreadsheets save them."""
    reference = Preprocessing.fit(read_table(write_csv(tmp_path / "r.csv"), label="outcome"))
    text = "\n".join(",".join(r) for r in [HEADER, *ROWS]) + "\n"
    for name, body in (
        ("bom.csv", "\ufeff" + text),
        ("semi.csv", text.replace(",", ";")),
        ("tab.csv", text.replace(",", "\t")),
        ("t.tsv", text.replace(",", "\t")),
    ):
        (tmp_path / name).write_text(body, encoding="utf-8")
        p = Preprocessing.fit(read_table(tmp_path / name, label="outcome"))
        assert p.columns == reference.columns and p.classes == reference.classes, name


def test_unseen_categories_are_refused_unless_the_training_said_so(tmp_path):
    train = read_table(write_csv(tmp_path / "train.csv"), label="outcome")
    later = read_table(write_csv(tmp_path / "later.csv", with_cell(2, "ward", "D")), label="outcome")
    with pytest.raises(InvalidArgument) as e:
        Preprocessing.fit(train).transform(later)
    assert "later.csv, column 'ward', data row 2" in str(e.value)
    assert "a category the training split never saw (it saw 3)" in str(e.value) and "--allow-unseen" in str(e.value)
    # neither the unseen value nor the training's categories (values of records) are named
    assert not any(f"'{v}'" in str(e.value) for v in "ABCD")
    x, _ = Preprocessing.fit(train, unseen="zeros").transform(later)
    assert x[1, 1:4].tolist() == [0.0, 0.0, 0.0]  # ward's one-hot entries
    assert x[0, 1:4].tolist() == [1.0, 0.0, 0.0]


def test_transform_prepares_as_documented(tmp_path):
    t = read_table(write_csv(tmp_path / "r.csv"), label="outcome")
    p = Preprocessing.fit(t)
    x, y = p.transform(t)
    age = np.array([50, 61, 45, 70, 66, 52], dtype=np.float64)
    assert x.dtype == np.float32 and y.dtype == np.int64 and x.shape == (6, 5)
    np.testing.assert_allclose(x[:, 0], (age - age.mean()) / age.std(), rtol=1e-6)
    assert p.classes == ("no", "yes") and y.tolist() == [1, 0, 1, 0, 0, 1]
    assert x[:, 1:4].sum(axis=1).tolist() == [1.0] * 6 and x[3, 3] == 1.0  # ward C of row 4
    # a column missing from a later file is named
    other = read_table(
        write_csv(tmp_path / "o.csv", [r[:1] + r[2:] for r in ROWS], ["age", "bp", "outcome"]), label="outcome"
    )
    with pytest.raises(InvalidArgument, match="no column 'ward', which the model was trained with"):
        p.transform(other)


def test_imputation_uses_training_statistics_and_is_recorded(tmp_path):
    rows = with_cell(2, "bp", "")
    rows = [list(r) for r in rows]
    rows[4][HEADER.index("ward")] = ""
    t = read_table(write_csv(tmp_path / "r.csv", rows), label="outcome", missing="impute")
    p = Preprocessing.fit(t)
    bp = np.array([120.5, 118, 140, 135, 121])
    assert p.columns[2].fill == pytest.approx(bp.mean()) and p.columns[2].mean == pytest.approx(bp.mean())
    # ward: A twice, C twice, B once among the present cells -> tie broken by sorted order
    assert p.columns[1].fill == "A"
    x, _ = p.transform(t)
    assert x[1, 4] == pytest.approx(0.0, abs=1e-6) and x[4, 1:4].tolist() == [1.0, 0.0, 0.0]
    assert json.loads(json.dumps(p.to_dict()))["columns"][2]["fill"] == pytest.approx(bp.mean())
    # a preprocessing fitted without imputation refuses the same file
    strict = Preprocessing.fit(read_table(write_csv(tmp_path / "s.csv"), label="outcome"))
    with pytest.raises(InvalidArgument, match=r"column .ward., data row 5.*fitted without imputation"):
        strict.transform(t)


def test_integer_labels_are_classes_in_numeric_order(tmp_path):
    rows = [[*r[:3], lab] for r, lab in zip(ROWS, ["10", "2", "10", "2", "2.0", "10"], strict=True)]
    t = read_table(write_csv(tmp_path / "r.csv", rows), label="outcome")
    p = Preprocessing.fit(t)
    assert p.classes == (2, 10)
    assert p.transform(t)[1].tolist() == [1, 0, 1, 0, 0, 1]
    later = read_table(write_csv(tmp_path / "l.csv", [[*r[:3], "3"] for r in ROWS]), label="outcome")
    with pytest.raises(InvalidArgument, match=r"data row 1.*the label is not one of the model's 2 classes$"):
        p.transform(later)


def test_parquet_and_csv_read_alike(tmp_path):
    import pandas as pd

    frame = pd.DataFrame(
        {
            "age": [50, 61, 45, 70, 66, 52],
            "ward": list("ABACBC"),
            "bp": [120.5, 130.0, 118.0, 140.0, 135.0, 121.0],
            "outcome": ["yes", "no", "yes", "no", "no", "yes"],
        }
    )
    frame.to_parquet(tmp_path / "r.parquet")
    a = read_table(tmp_path / "r.parquet", label="outcome")
    b = read_table(write_csv(tmp_path / "r.csv"), label="outcome")
    pa, pb = Preprocessing.fit(a), Preprocessing.fit(b)
    assert pa.columns == pb.columns and pa.classes == pb.classes
    np.testing.assert_array_equal(pa.transform(a)[0], pb.transform(b)[0])
    # a Parquet null is a missing cell, named by its row
    frame.loc[3, "bp"] = None
    frame.to_parquet(tmp_path / "m.parquet")
    with pytest.raises(InvalidArgument, match=r"m\.parquet, column 'bp', data row 4: is empty or missing"):
        read_table(tmp_path / "m.parquet", label="outcome")


def test_npz_records_and_image_shape(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.random((20, 1, 4, 4)).astype(np.float32)
    np.savez(tmp_path / "img.npz", x=x, target=np.arange(20) % 3)
    with pytest.raises(InvalidArgument, match=r"no array 'y'.*\['target', 'x'\]"):
        read_table(tmp_path / "img.npz", label="y")
    t = read_table(tmp_path / "img.npz", label="target")
    assert t.features[:2] == ("x0", "x1") and len(t.features) == 16 and t.input_shape == (1, 4, 4)
    p = Preprocessing.fit(t)
    arch = architecture_for("cnn", p)
    assert arch["input_shape"] == [1, 4, 4] and arch["output_dim"] == 3
    with pytest.raises(InvalidArgument, match="needs image records"):
        architecture_for("cnn", Preprocessing.fit(read_table(write_csv(tmp_path / "r.csv"), label="outcome")))


# ---------------------------------------------------------------------------------- fit on train only


def test_preprocessing_is_fitted_on_the_training_split_only(tmp_path):
    path = write_csv(tmp_path / "r.csv", records(200, seed=1), ["age", "ward", "bp", "sex", "outcome"])
    r = prepare_records(path, label="outcome", validation_fraction=0.25, split_seed=5)
    table = read_table(path, label="outcome")
    train, held = table.split(0.25, seed=5)
    assert len(train) == 150 and len(held) == 50 and r.description["training_rows"] == 150
    assert set(train.rows.tolist()).isdisjoint(held.rows.tolist())
    age = r.preprocessing.columns[0]
    assert age.name == "age"
    assert age.mean == pytest.approx(train.columns["age"].numbers.mean(), rel=1e-12)
    assert age.std == pytest.approx(train.columns["age"].numbers.std(), rel=1e-12)
    assert age.mean != pytest.approx(table.columns["age"].numbers.mean(), rel=1e-9)
    assert r.preprocessing.fitted_on["rows"] == 150
    # the training part is centred by its own statistics, the held-out part is not
    assert abs(float(r.x_train[:, 0].mean())) < 1e-5 and abs(float(r.x_val[:, 0].mean())) > 1e-4
    # stratified: each class's share differs by at most one record from proportional
    for c in (0, 1):
        total = int((np.concatenate([r.y_train, r.y_val]) == c).sum())
        assert abs(int((r.y_val == c).sum()) - total * 0.25) <= 1


def test_preprocessing_fitted_on_a_public_file(tmp_path):
    header = ["age", "ward", "bp", "sex", "outcome"]
    private = write_csv(tmp_path / "private.csv", records(100, seed=7), header)
    public = write_csv(tmp_path / "public.csv", records(30, seed=8), header)
    r = prepare_records(private, label="outcome", public=public)
    pub = read_table(public, label="outcome")
    assert r.preprocessing.fitted_on["split"] == "public" and r.preprocessing.fitted_on["rows"] == 30
    assert r.preprocessing.columns[0].mean == pytest.approx(pub.columns["age"].numbers.mean(), rel=1e-12)
    assert r.description["preprocessing"] == "fitted on public records (public.csv)"
    assert len(r.y_train) == 80 and len(r.y_val) == 20
    with pytest.raises(InvalidArgument, match="not both"):
        prepare_records(private, label="outcome", public=public, preprocessing=r.preprocessing)
    with pytest.raises(InvalidArgument, match="split: must be 'training' or 'public'"):
        Preprocessing.fit(pub, split="validation")


def test_a_category_seen_only_in_held_out_records_is_refused(tmp_path):
    rows = records(40, seed=2)
    path = write_csv(tmp_path / "r.csv", rows, ["age", "ward", "bp", "sex", "outcome"])
    table = read_table(path, label="outcome")
    _, held = table.split(0.25, seed=0)
    rows[int(held.rows[0]) - 1][1] = "Z"  # a ward only a held-out record has
    write_csv(path, rows, ["age", "ward", "bp", "sex", "outcome"])
    with pytest.raises(InvalidArgument, match=f"data row {int(held.rows[0])}.*a category the training split never saw"):
        prepare_records(path, label="outcome", validation_fraction=0.25, split_seed=0)
    r = prepare_records(path, label="outcome", validation_fraction=0.25, split_seed=0, unseen="zeros")
    assert "Z" not in r.preprocessing.columns[1].categories


# ---------------------------------------------------------------------------------- identifiers


def patients(n: int = 300, seed: int = 7) -> tuple[list[list[str]], list[str]]:
    """``records(n)`` with a ``patient_id`` column in front (P0001, P0002, …), and the IDs."""
    ids = [f"P{i:04d}" for i in range(1, n + 1)]
    return [[pid, *r] for pid, r in zip(ids, records(n, seed), strict=True)], ids


PATIENT_COLUMNS = ["patient_id", "age", "ward", "bp", "sex", "outcome"]


def test_an_identifier_column_is_refused_by_name_with_the_features_hint(tmp_path):
    """Issue 20, item 7: every column but the label is a feature by default, so a patient_id
    column became a categorical feature (a one-hot of 240 IDs) and the held-out records' IDs,
    never seen in training, were refused listing every training ID. Now the column is refused
    before anything is read from it, by name, with the --features that leave it out; no ID is
    in the message."""
    rows, ids = patients()
    path = write_csv(tmp_path / "p.csv", rows, PATIENT_COLUMNS)
    with pytest.raises(InvalidArgument) as e:
        read_table(path, label="outcome")
    msg = str(e.value)
    assert "p.csv: features: column 'patient_id' (its name) looks like an identifier" in msg
    assert "--features age ward bp sex" in msg and not any(pid in msg for pid in ids)
    # by its values: a text code different in every record, under a harmless name
    coded = write_csv(tmp_path / "c.csv", rows, ["code", *PATIENT_COLUMNS[1:]])
    with pytest.raises(InvalidArgument, match=r"'code' \(a different value in each of its 300 records\)"):
        read_table(coded, label="outcome")
    # integers different in every record too (an accession number)
    numbered = write_csv(
        tmp_path / "n.csv", [[str(100000 + i), *r[1:]] for i, r in enumerate(rows)], ["acc", *PATIENT_COLUMNS[1:]]
    )
    with pytest.raises(InvalidArgument, match=r"'acc' \(a different value"):
        read_table(numbered, label="outcome")
    # several at once are all named; the hint keeps the rest in order
    both = write_csv(
        tmp_path / "b.csv", [[r[0], r[0] + "x", *r[1:]] for r in rows], ["mrn", "Name", *PATIENT_COLUMNS[1:]]
    )
    with pytest.raises(
        InvalidArgument,
        match=r"columns 'mrn' \(its name\), 'Name' \(its name\) look like identifiers.*--features age ward bp sex",
    ):
        read_table(both, label="outcome")


def test_what_is_not_an_identifier(tmp_path):
    """A measured quantity different in every record (bp with one decimal), a small table whose
    integer codes happen to differ (ROWS' ages: 6 records < 20), and names that only contain an
    identifier's letters are features; named explicitly (--features), even an identifier is."""
    rows, _ = patients(60)
    unique_bp = [[r[0], r[1], r[2], f"{100 + i * 0.7:.1f}", r[4], r[5]] for i, r in enumerate(rows)]
    t = read_table(write_csv(tmp_path / "u.csv", [r[1:] for r in unique_bp], PATIENT_COLUMNS[1:]), label="outcome")
    assert t.features == ("age", "ward", "bp", "sex")
    assert read_table(write_csv(tmp_path / "r.csv"), label="outcome").features == ("age", "ward", "bp")
    t = read_table(
        write_csv(tmp_path / "p.csv", rows, PATIENT_COLUMNS), label="outcome", features=["patient_id", "age"]
    )
    assert t.features == ("patient_id", "age")


@pytest.mark.parametrize(
    "name, identifier",
    [
        ("patient_id", True),
        ("PatientID", True),
        ("patientid", True),
        ("MRN", True),
        ("ssn", True),
        ("subject_no", True),
        ("PatientNumber", True),
        ("email_address", True),
        ("drug_name", True),
        ("patient", True),
        ("patient_age", False),
        ("valid", False),
        ("paid", False),
        ("case", False),
        ("visit", False),
        ("ward", False),
    ],
)
def test_identifier_names(name, identifier):
    from peer.nn.tables import identifier_reason

    assert (identifier_reason(name, np.array(["a", "a"], dtype=object), 2) is not None) == identifier


def test_a_label_different_in_every_record_is_refused(tmp_path):
    rows, ids = patients(50)
    path = write_csv(tmp_path / "p.csv", [[*r[1:5], r[0]] for r in rows], ["age", "ward", "bp", "sex", "who"])
    with pytest.raises(InvalidArgument, match=r"label 'who': has a different value in each of its 50 records") as e:
        read_table(path, label="who")
    assert not any(pid in str(e.value) for pid in ids)


def test_an_identifier_named_as_a_feature_is_refused_later_without_its_values(tmp_path):
    """Named with --features, patient_id is taken; the held-out records' IDs are categories
    the training split never saw. The refusal names the file, column and row and counts the
    training's categories (240): it used to list them all."""
    rows, ids = patients()
    path = write_csv(tmp_path / "p.csv", rows, PATIENT_COLUMNS)
    with pytest.raises(InvalidArgument) as e:
        prepare_records(path, label="outcome", features=["patient_id", "age", "ward", "bp", "sex"])
    msg = str(e.value)
    assert "p.csv, column 'patient_id', data row" in msg and "never saw (it saw 240)" in msg
    assert not any(pid in msg for pid in ids)


# ---------------------------------------------------------------------------------- JSON and the store


def test_json_round_trip_and_checks(tmp_path):
    p = Preprocessing.fit(read_table(write_csv(tmp_path / "r.csv"), label="outcome", missing="impute"), unseen="zeros")
    d = json.loads(json.dumps(p.to_dict(), allow_nan=False))
    assert Preprocessing.from_dict(d) == p
    bad = json.loads(json.dumps(d))
    bad["columns"][0]["std"] = 0
    with pytest.raises(InvalidArgument, match=r"preprocessing\.columns\[0\]\.std: must be > 0"):
        Preprocessing.from_dict(bad)
    bad = json.loads(json.dumps(d))
    bad["columns"][1]["fill"] = "Q"
    with pytest.raises(InvalidArgument, match=r"columns\[1\]\.fill: must be one of the categories"):
        Preprocessing.from_dict(bad)
    bad = dict(d, classes=["yes"])
    with pytest.raises(InvalidArgument, match="classes: must be at least two"):
        Preprocessing.from_dict(bad)
    # a malformed category list is described, not printed (its entries are values of records)
    bad = json.loads(json.dumps(d))
    bad["columns"][1]["categories"] = ["A", "A", "B"]
    with pytest.raises(InvalidArgument, match=r"categories: .*got a list of 3 \(2 distinct; str\)$") as e:
        Preprocessing.from_dict(bad)
    assert "'A'" not in str(e.value)


def test_preprocessing_round_trips_through_the_store(tmp_path):
    from peer.nn.architectures import build_model, predict_proba, state_arrays
    from peer.nn.store import load_model, save_model

    path = write_csv(tmp_path / "r.csv", records(60, seed=3), ["age", "ward", "bp", "sex", "outcome"])
    r = prepare_records(path, label="outcome", categorical=["sex"])
    arch = architecture_for("mlp", r.preprocessing, hidden=[4])
    model = build_model(arch, seed=0)
    save_model(tmp_path / "models", "m", arch, state_arrays(model), {"note": 1}, r.preprocessing)
    stored = load_model(tmp_path / "models", "m")
    assert stored.preprocessing == r.preprocessing and stored.metadata == {"note": 1}
    # the stored preparation gives the same inputs, hence the same predictions
    x, _ = stored.preprocessing.transform(stored.preprocessing.read(path))
    full = read_table(path, label="outcome", categorical=["sex"])
    np.testing.assert_array_equal(x, r.preprocessing.transform(full)[0])
    np.testing.assert_array_equal(predict_proba(arch, stored.module(), x), predict_proba(arch, model, x))
    # a model without one has none; a preprocessing of the wrong width is refused
    save_model(tmp_path / "models", "plain", arch, state_arrays(model))
    assert load_model(tmp_path / "models", "plain").preprocessing is None
    wide = dict(arch, input_dim=arch["input_dim"] + 1)
    with pytest.raises(InvalidArgument, match="prepares 7 input entries but the architecture takes 8"):
        save_model(tmp_path / "models", "w", wide, state_arrays(build_model(wide, seed=0)), None, r.preprocessing)
    manifest = json.loads((tmp_path / "models" / "m.json").read_text())
    manifest["preprocessing"]["columns"][0]["kind"] = "text"
    (tmp_path / "models" / "m.json").write_text(json.dumps(manifest))
    with pytest.raises(InvalidArgument, match=r"m\.json: preprocessing\.columns\[0\]"):
        load_model(tmp_path / "models", "m")


# ---------------------------------------------------------------------------------- invariants


@st.composite
def small_tables(draw):
    n = draw(st.integers(min_value=4, max_value=30))
    numbers = draw(st.lists(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False), min_size=n, max_size=n))
    cats = draw(st.lists(st.sampled_from(["a", "b", "c d", "é"]), min_size=n, max_size=n))
    labels = draw(st.lists(st.sampled_from(["0", "1", "2"]), min_size=n, max_size=n).filter(lambda v: len(set(v)) >= 2))
    holes = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return [[("" if h else repr(x)), c, y] for x, c, y, h in zip(numbers, cats, labels, holes, strict=True)]


@settings(max_examples=40, deadline=None)
@given(rows=small_tables())
def test_prepared_training_records_are_standardised_and_one_hot(tmp_path_factory, rows):
    path = write_csv(tmp_path_factory.mktemp("h") / "r.csv", rows, ["x", "c", "y"])
    present = [r for r in rows if r[0] != ""]
    if not present:
        with pytest.raises(InvalidArgument, match=r"no values|empty or missing"):
            Preprocessing.fit(read_table(path, label="y", missing="impute"))
        return
    p = Preprocessing.fit(read_table(path, label="y", missing="impute"))
    assert Preprocessing.from_dict(json.loads(json.dumps(p.to_dict(), allow_nan=False))) == p
    x, y = p.transform(read_table(path, label="y", missing="impute"))
    assert x.shape == (len(rows), 1 + len(p.columns[1].categories)) and np.all(np.isfinite(x))
    # the present numeric cells are standardised by their own mean and std; holes get the mean (0)
    v = np.array([float(r[0]) for r in present])
    filled = x[[r[0] != "" for r in rows], 0].astype(np.float64)
    if v.std() > 0:
        np.testing.assert_allclose(filled, (v - v.mean()) / v.std(), rtol=1e-4, atol=1e-4)
    assert np.all(
        x[[r[0] == "" for r in rows], 0] == np.float32((p.columns[0].fill - p.columns[0].mean) / p.columns[0].std)
    )
    assert np.all(x[:, 1:].sum(axis=1) == 1.0)  # every category was seen: exactly one entry set
    assert sorted(set(y.tolist())) == list(range(len(p.classes))) and p.classes == tuple(
        sorted({int(r[2]) for r in rows})
    )
