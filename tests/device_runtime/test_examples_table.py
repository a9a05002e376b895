"""The per-device examples table: read, checked row by row against a model, written as example stores."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from contracts.features import FeatureSpec
from device_runtime.__main__ import main
from device_runtime.example_store import Event, ExampleStore
from device_runtime.examples_table import (
    IfExists,
    TableError,
    read_table,
    store_path,
    write_example_stores,
)
from model_export.config import ModelConfig
from tests.conftest import BIASED, SMALL

CSV = """device_id,timestamp,item,label
alice,2026-11-25T21:00:00Z,3,4
bob,1700000000,17,2.5
alice,2026-11-25T21:05:00,199,5
007,1700000100.5,0,1
"""


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def stores_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def run(*args: str | Path) -> int:
    return main([str(a) for a in args])


def test_import_writes_one_store_per_device(
    export: Callable[[ModelConfig], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = export(BIASED)
    table = write(tmp_path / "ratings.csv", CSV)
    out = tmp_path / "stores"

    assert run("import", "--model-dir", model_dir, "--examples", table, "--out", out) == 0

    assert "4 examples of 4 rows in 3 example stores (3 created" in capsys.readouterr().out
    assert stores_in(out) == ["007.sqlite", "alice.sqlite", "bob.sqlite"]  # "007" stays text
    with ExampleStore(store_path(out, "alice")) as store:
        events = list(store.iter_events())
    # Newest first; an ISO time without a zone is UTC.
    assert [(int(e.features["item"]), float(e.features["label"])) for e in events] == [(199, 5.0), (3, 4.0)]
    assert [e.timestamp for e in events] == [1795640700.0, 1795640400.0]
    with ExampleStore(store_path(out, "007")) as store:
        assert [e.timestamp for e in store.iter_events()] == [1700000100.5]


def test_parquet_reads_as_the_csv_does(export: Callable[[ModelConfig], Path], tmp_path: Path) -> None:
    from contracts.manifest import load_manifest
    from device_runtime.examples_table import read_examples_table

    manifest = load_manifest(export(BIASED))
    from_csv = read_examples_table(write(tmp_path / "t.csv", CSV), manifest)
    parquet = tmp_path / "t.parquet"
    pq.write_table(
        pa.table(
            {
                "device_id": ["alice", "bob", "alice", "007"],
                "timestamp": pa.array(
                    [1795640400_000000, 1700000000_000000, 1795640700_000000, 1700000100_500000],
                    pa.timestamp("us", "UTC"),
                ),
                "item": pa.array([3, 17, 199, 0], pa.int16()),
                "label": [4.0, 2.5, 5.0, 1.0],
            }
        ),
        parquet,
    )
    from_parquet = read_examples_table(parquet, manifest)

    assert list(from_parquet.devices) == list(from_csv.devices) == ["alice", "bob", "007"]
    for device, rows in from_csv.devices.items():
        other = from_parquet.devices[device]
        np.testing.assert_array_equal(rows.timestamps, other.timestamps)
        for feature in manifest.features:
            assert rows.examples[feature.name].dtype == np.dtype(feature.dtype)
            np.testing.assert_array_equal(rows.examples[feature.name], other.examples[feature.name])


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("carol,5,200,3", "row 3, column 'item': got 200; expected an integer in [0, 199] (the rows of"),
        ("carol,5,2.5,3", "row 3, column 'item': got '2.5'; expected an integer in [0, 199]"),
        ("carol,5,2,", "row 3, column 'label': got an empty cell; expected a finite number in [1, 5]"),
        ("carol,5,2,nan", "row 3, column 'label': got nan; expected a finite number in [1, 5]"),
        ("carol,5,2,four", "row 3, column 'label': got 'four'; expected a finite number in [1, 5]"),
        ("car/ol,5,2,3", "row 3, column 'device_id': got 'car/ol'; expected a device id"),
        (
            "carol,yesterday,2,3",
            "row 3, column 'timestamp': got 'yesterday'; expected seconds since the epoch",
        ),
    ],
)
def test_a_bad_row_is_one_line_and_nothing_is_written(
    export: Callable[[ModelConfig], Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    row: str,
    message: str,
) -> None:
    table = write(
        tmp_path / "ratings.csv", "device_id,timestamp,item,label\nalice,1,3,4\nbob,2,5,5\n" + row + "\n"
    )
    out = tmp_path / "stores"

    assert run("import", "--model-dir", export(BIASED), "--examples", table, "--out", out) == 2

    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {table}, ") and message in err, err
    assert stores_in(out) == []


def test_the_first_bad_value_says_how_many_rows_are_wrong(
    export: Callable[[ModelConfig], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = "".join(f"d{i},{i},{300 + i},4\n" for i in range(5))
    table = write(tmp_path / "t.csv", "device_id,timestamp,item,label\nok,0,1,4\n" + rows)

    assert run("import", "--model-dir", export(BIASED), "--examples", table, "--out", tmp_path / "o") == 2

    err = capsys.readouterr().err
    assert "row 2, column 'item': got 300; expected an integer in [0, 199]" in err
    assert "(5 rows are wrong)" in err


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ("device_id,timestamp,item", "no column 'label'; a table for this model has the columns"),
        ("device_id,timestamp,item,label,hour", "unexpected column 'hour'"),
        ("user,timestamp,item,label", "no column 'device_id'; unexpected column 'user'"),
    ],
)
def test_columns_must_be_the_models(
    export: Callable[[ModelConfig], Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    header: str,
    message: str,
) -> None:
    values = ",".join(["a", "1", "2", "3", "4"][: header.count(",") + 1])
    table = write(tmp_path / "t.csv", f"{header}\n{values}\n")

    assert run("import", "--model-dir", export(BIASED), "--examples", table, "--out", tmp_path / "o") == 2

    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_other_column_names(export: Callable[[ModelConfig], Path], tmp_path: Path) -> None:
    table = write(tmp_path / "t.tsv", "user\twhen\titem\tlabel\nu1\t5\t3\t4\n")
    out = tmp_path / "o"

    code = run(
        "import",
        "--model-dir",
        export(BIASED),
        "--examples",
        table,
        "--out",
        out,
        "--device-column",
        "user",
        "--time-column",
        "when",
    )

    assert code == 0 and stores_in(out) == ["u1.sqlite"]


def test_existing_stores_are_refused_appended_or_replaced_whole(
    export: Callable[[ModelConfig], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = export(BIASED)
    out = tmp_path / "stores"
    out.mkdir()
    with ExampleStore(store_path(out, "alice"), BIASED.features()) as store:
        store.add([Event({"item": 50, "label": 3.0}, 10.0)])
    table = write(tmp_path / "t.csv", CSV)
    common: list[str | Path] = ["import", "--model-dir", model_dir, "--examples", table, "--out", out]

    assert run(*common) == 2
    assert "already hold examples" in capsys.readouterr().err
    assert stores_in(out) == ["alice.sqlite"]  # bob and 007 were not created either

    assert run(*common, "--append") == 0
    with ExampleStore(store_path(out, "alice")) as store:
        assert sorted(int(e.features["item"]) for e in store.iter_events()) == [3, 50, 199]

    assert run(*common, "--replace") == 0
    with ExampleStore(store_path(out, "alice")) as store:
        assert sorted(int(e.features["item"]) for e in store.iter_events()) == [3, 199]
    assert stores_in(out) == ["007.sqlite", "alice.sqlite", "bob.sqlite"]


def test_a_store_of_another_model_stops_the_import_before_any_write(
    export: Callable[[ModelConfig], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "stores"
    out.mkdir()
    other = (FeatureSpec("word", "int32", (3,)), FeatureSpec("label", "float32", role="label"))
    ExampleStore(store_path(out, "bob"), other).close()
    table = write(tmp_path / "t.csv", CSV)

    assert run("import", "--model-dir", export(BIASED), "--examples", table, "--out", out, "--append") == 2

    err = capsys.readouterr().err
    assert "bob.sqlite holds examples with the features" in err and "nothing was written" in err
    assert stores_in(out) == ["bob.sqlite"]


def test_a_store_is_never_half_written(export: Callable[[ModelConfig], Path], tmp_path: Path) -> None:
    """An existing store's transaction: a write that fails inside it leaves the store as it was."""
    out = tmp_path / "stores"
    out.mkdir()
    path = store_path(out, "alice")
    with ExampleStore(path, BIASED.features()) as store:
        store.add([Event({"item": 50, "label": 3.0}, 10.0)])
    from contracts.manifest import load_manifest
    from device_runtime.examples_table import read_examples_table

    table = read_examples_table(write(tmp_path / "t.csv", CSV), load_manifest(export(BIASED)))
    blocker = sqlite3.connect(path)
    blocker.execute(
        "CREATE TRIGGER refuse BEFORE INSERT ON examples WHEN NEW.timestamp > 1795640500 "
        "BEGIN SELECT RAISE(ABORT, 'disk full'); END"
    )
    blocker.commit()
    blocker.close()

    with pytest.raises(sqlite3.IntegrityError):
        write_example_stores(table, out, if_exists=IfExists.REPLACE)

    with ExampleStore(path) as store:
        assert [int(e.features["item"]) for e in store.iter_events()] == [50]


def test_vector_features_from_csv_cells_and_parquet_lists(tmp_path: Path) -> None:
    features = (
        FeatureSpec("tokens", "int32", (3,), value_range=(0, 9)),
        FeatureSpec("target", "int32", role="label", value_range=(0, 9)),
    )
    csv = write(tmp_path / "t.csv", 'device_id,timestamp,tokens,target\na,1,"[1, 2, 3]",4\na,2,4 5 6,7\n')
    parquet = tmp_path / "t.parquet"
    pq.write_table(
        pa.table(
            {"device_id": ["a", "a"], "timestamp": [1, 2], "tokens": [[1, 2, 3], [4, 5, 6]], "target": [4, 7]}
        ),
        parquet,
    )

    for path in (csv, parquet):
        rows = read_table(path, features).devices["a"]
        np.testing.assert_array_equal(rows.examples["tokens"], [[1, 2, 3], [4, 5, 6]])

    bad = write(tmp_path / "bad.csv", "device_id,timestamp,tokens,target\na,1,1 2,4\n")
    with pytest.raises(
        TableError, match=r"row 1, column 'tokens': got '1 2'; expected 3 integers \(shape \[3\]\)"
    ):
        read_table(bad, features)


def test_an_implicit_label_may_be_left_out(tmp_path: Path) -> None:
    features = (
        FeatureSpec("item", "int32", value_range=(0, 9), tables=("items",)),
        FeatureSpec("label", "float32", role="label", value_range=(0, 1), discrete=True),
    )
    table = write(tmp_path / "shares.csv", "device_id,timestamp,item\na,1,3\na,2,4\n")

    rows = read_table(table, features, implicit_label="label").devices["a"]

    np.testing.assert_array_equal(rows.examples["label"], [1.0, 1.0])
    with pytest.raises(TableError, match="no column 'label'"):
        read_table(table, features)


def test_unreadable_tables_are_one_line(export: Callable[[ModelConfig], Path], tmp_path: Path) -> None:
    from contracts.manifest import load_manifest
    from device_runtime.examples_table import read_examples_table

    manifest = load_manifest(export(SMALL))
    for path, message in (
        (tmp_path / "missing.csv", "no examples table at"),
        (write(tmp_path / "t.xlsx", "x"), "unknown table format '.xlsx'"),
        (write(tmp_path / "t.parquet", "not parquet"), "not a readable PARQUET table"),
        (
            write(tmp_path / "ragged.csv", "device_id,timestamp,item,label\na,1,2\n"),
            "not a readable CSV table",
        ),
        (write(tmp_path / "empty.csv", "device_id,timestamp,item,label\n"), "the table has no rows"),
    ):
        with pytest.raises(TableError, match=message) as raised:
            read_examples_table(path, manifest)
        assert "\n" not in str(raised.value)


def test_text_that_is_not_utf8_is_named_at_its_row_and_a_bom_is_read_past(tmp_path: Path) -> None:
    features = (
        FeatureSpec("item", "int32", value_range=(0, 9), tables=("items",)),
        FeatureSpec("label", "float32", role="label", value_range=(1, 5)),
    )
    latin = tmp_path / "latin.csv"
    latin.write_bytes(b"device_id,timestamp,item,label\na,1,3,4\nb,2,\xff,4\n")
    excel = tmp_path / "excel.csv"
    excel.write_bytes(b"\xef\xbb\xbfdevice_id,timestamp,item,label\na,1,3,4\n")

    with pytest.raises(TableError, match=r"row 2, column 'item': got b'\\xff'; expected UTF-8 text"):
        read_table(latin, features)
    assert list(read_table(excel, features).devices) == ["a"]


INT_FEATURES = (
    FeatureSpec("item", "int32", value_range=(0, 99), tables=("items",)),
    FeatureSpec("label", "float32", role="label", value_range=(0, 5)),
)


@pytest.mark.parametrize(
    ("cells", "row", "shown"),
    [
        (["3.0"], 1, "'3.0'"),
        (["21", "21.0"], 2, "'21.0'"),
        (["7", "1e1"], 2, "'1e1'"),
        (["1_000"], 1, "'1_000'"),
    ],
)
def test_an_int32_feature_refuses_a_float_s_spelling_in_csv_at_its_row(
    tmp_path: Path, cells: list[str], row: int, shown: str
) -> None:
    rows = "".join(f"a,{i},{cell},1\n" for i, cell in enumerate(cells))
    table = write(tmp_path / "t.csv", "device_id,timestamp,item,label\n" + rows)

    with pytest.raises(
        TableError, match=rf"row {row}, column 'item': got {shown}; expected an integer in \[0, 99\]"
    ):
        read_table(table, INT_FEATURES)


def test_an_int32_feature_takes_integer_or_text_parquet_columns_and_refuses_floats(tmp_path: Path) -> None:
    def parquet(name: str, items: pa.Array) -> Path:
        path = tmp_path / f"{name}.parquet"
        table = {"device_id": ["a", "a"], "timestamp": [1, 2], "item": items, "label": [1.0, 2.0]}
        pq.write_table(pa.table(table), path)
        return path

    integers = read_table(parquet("integers", pa.array([3, 4], pa.int64())), INT_FEATURES)
    text = read_table(parquet("text", pa.array(["0", "1"])), INT_FEATURES)  # whole numbers as text

    np.testing.assert_array_equal(integers.devices["a"].examples["item"], [3, 4])
    np.testing.assert_array_equal(text.devices["a"].examples["item"], [0, 1])
    for kind in (pa.float64(), pa.float32()):
        with pytest.raises(
            TableError, match=rf"got 3\.0; expected an integer in \[0, 99\].* \(the column holds {kind}"
        ):
            read_table(parquet(f"floats-{kind}", pa.array([3.0, 4.0], kind)), INT_FEATURES)
