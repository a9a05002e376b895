"""`--model-arg key=value`: a builder's keyword arguments, converted by its annotations, and
refused with a message naming what the builder takes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from model_export.model_args import ModelArgError, format_model_args, parse_model_args
from tests.conftest import ROOT


def builder(vocabulary: int = 100, rate: float = 0.5, local: bool = True, name: str = "m") -> None:
    """Stands for a model builder: what matters here is its signature."""


def test_values_are_converted_to_the_parameter_types() -> None:
    values = parse_model_args(builder, ["vocabulary=1000", "rate=1e-2", "local=false", "name=nwp=v2"])

    assert values == {"vocabulary": 1000, "rate": 0.01, "local": False, "name": "nwp=v2"}
    assert type(values["vocabulary"]) is int


def test_formatted_arguments_parse_back_to_the_same_values() -> None:
    values = {"vocabulary": 7, "rate": 0.25, "local": False, "name": "x"}

    args = format_model_args(values)

    assert parse_model_args(builder, args[1::2]) == values
    assert args[0::2] == ["--model-arg"] * 4


@pytest.mark.parametrize(
    ("pair", "message"),
    [
        ("vocab=10", "takes no argument 'vocab'; it takes: vocabulary (int, default 100), rate (float"),
        ("vocabulary=ten", "vocabulary='ten': expected an integer"),
        ("vocabulary=1.5", "vocabulary='1.5': expected an integer"),
        ("rate=nan", "rate='nan': expected a finite number"),
        ("local=maybe", "local='maybe': expected true or false"),
        ("vocabulary", "takes KEY=VALUE"),
        ("=3", "takes KEY=VALUE"),
    ],
)
def test_bad_arguments_are_refused_with_what_the_builder_takes(pair: str, message: str) -> None:
    with pytest.raises(ModelArgError) as refused:
        parse_model_args(builder, [pair])

    assert message in str(refused.value)


def test_an_argument_given_twice_is_refused() -> None:
    with pytest.raises(ModelArgError, match="given twice"):
        parse_model_args(builder, ["rate=1", "rate=2"])


def test_a_builder_whose_parameters_cannot_come_from_text_is_named() -> None:
    def needs_a_list(sizes: list[int] | None = None) -> None: ...

    with pytest.raises(ModelArgError, match="parameter 'sizes' must have a default and one of the types"):
        parse_model_args(needs_a_list, ["sizes=1"])


def export_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "model_export", *args], capture_output=True, text=True, cwd=ROOT, timeout=300
    )


def test_the_cli_refuses_bad_model_arguments_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    next_word = ("--model", "model_export.models.next_word:build", "--out", str(out))

    unknown = export_cli(*next_word, "--model-arg", "num_oov_bucket=100")
    out_of_range = export_cli(*next_word, "--model-arg", "seq_len=0")
    without_model = export_cli("--model-arg", "seq_len=4", "--out", str(out))

    assert unknown.returncode == 2
    assert "takes no argument 'num_oov_bucket'; it takes: num_global_tokens (int, default 1003)" in (
        unknown.stderr
    )
    assert out_of_range.returncode == 2
    assert "seq_len is 0; expected at least 1" in out_of_range.stderr
    assert without_model.returncode == 2
    assert "--model-arg needs --model" in without_model.stderr
    assert not out.exists()
