"""A population that starts from trained globals (e.g. `android_sim simulate`'s) instead of the export's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load
from sqlalchemy import select
from sqlalchemy.orm import Session

from contracts.manifest import INITIAL_GLOBAL_FILE
from contracts.params import encode_params
from model_export.config import ModelConfig
from orchestrator.__main__ import main
from orchestrator.db import ModelVersion, make_engine
from tests.conftest import BIASED


def create(url: str, model: Path, globals_file: Path) -> int:
    return main(
        [
            "--database-url",
            url,
            "create-population",
            "p",
            "--model-dir",
            str(model),
            "--initial-globals",
            str(globals_file),
        ]
    )


def test_create_population_starts_from_the_given_globals(
    export: Callable[[ModelConfig], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = export(BIASED)
    trained = {name: value + 0.25 for name, value in load((model / INITIAL_GLOBAL_FILE).read_bytes()).items()}
    path = tmp_path / "global_params.safetensors"
    path.write_bytes(encode_params(trained))
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"

    code = create(url, model, path)

    assert code == 0, capsys.readouterr().err
    with Session(make_engine(url)) as session:
        version = session.scalars(select(ModelVersion)).one()
        stored = load(version.params)
    assert version.version == 0 and set(stored) == set(trained)
    for name, value in trained.items():
        np.testing.assert_array_equal(stored[name], value)


def test_globals_of_another_shape_or_no_file_are_one_line(
    export: Callable[[ModelConfig], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = export(BIASED)
    exported = load((model / INITIAL_GLOBAL_FILE).read_bytes())
    name = sorted(exported)[0]
    wrong = tmp_path / "other.safetensors"
    wrong.write_bytes(encode_params({**exported, name: np.zeros((3, 1), exported[name].dtype)}))
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"

    shape = create(url, model, wrong)
    shape_err = capsys.readouterr().err
    missing = create(url, model, tmp_path / "nope.safetensors")
    missing_err = capsys.readouterr().err

    assert shape == 2 and shape_err.splitlines() == [
        f"error: --initial-globals {wrong}: tensor {name!r} is {exported[name].dtype}[3, 1], "
        f"expected {exported[name].dtype}{list(exported[name].shape)}"
    ]
    assert missing == 2 and missing_err.splitlines() == [
        f"error: --initial-globals {tmp_path / 'nope.safetensors'}: no such file"
    ]
    with Session(make_engine(url)) as session:
        assert session.scalars(select(ModelVersion)).first() is None  # nothing was created
