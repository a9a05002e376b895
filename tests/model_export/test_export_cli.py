"""`python -m model_export`: help, outputs, builtin ops only, and refusal of bad options."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from contracts.manifest import REQUIRED_SIGNATURES, load_manifest
from model_export.config import ModelConfig
from tests.conftest import BIASED, ROOT


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "model_export", *args], capture_output=True, text=True, cwd=ROOT, timeout=300
    )


def test_help_lists_the_export_options() -> None:
    result = run_cli("--help")

    assert result.returncode == 0
    for option in (
        "--num-items",
        "--embedding-dim",
        "--batch-size",
        "--feedback",
        "--item-bias",
        "--output-dir",
    ):
        assert option in result.stdout


def test_export_writes_model_manifest_and_initial_globals(export: Callable[[ModelConfig], Path]) -> None:
    model_dir = export(BIASED)

    manifest = load_manifest(model_dir)

    assert {"reconstruct", "update", "infer"} <= set(manifest.signatures)
    assert set(REQUIRED_SIGNATURES) <= set(manifest.signatures)
    assert [s.name for s in manifest.global_params] == ["item_embeddings", "item_bias", "global_mean"]
    assert [s.name for s in manifest.local_params] == ["user_embedding", "user_bias"]
    assert manifest.global_spec("item_embeddings").shape == (200, 16)
    assert (model_dir / "global_params.safetensors").stat().st_size > 200 * 16 * 4


def test_model_uses_builtin_ops_only(export: Callable[[ModelConfig], Path]) -> None:
    # TF's analyzer lists every op; Flex (Select TF) or custom ops would not run on a phone.
    model_path = export(BIASED) / "model.tflite"
    code = (
        "import io, contextlib, tensorflow as tf\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n"
        f"    tf.lite.experimental.Analyzer.analyze(model_path={str(model_path)!r})\n"
        "print(buf.getvalue())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)

    assert result.returncode == 0, result.stderr
    ops = {
        line.split("Op#")[1].split()[1].split("(")[0] for line in result.stdout.splitlines() if "Op#" in line
    }
    assert {"WHILE", "GATHER", "UNSORTED_SEGMENT_SUM", "ASSIGN_VARIABLE", "TOPK_V2"} <= ops
    assert not [op for op in ops if op.startswith("Flex") or op == "CUSTOM"], ops


def test_bad_options_are_refused_with_a_message(tmp_path: Path) -> None:
    result = run_cli("--output-dir", str(tmp_path), "--num-items", "0")
    negative = run_cli("--output-dir", str(tmp_path), "--num-items", "-5")

    assert result.returncode == 2
    assert "num_items must be >= 1" in result.stderr
    assert not (tmp_path / "model.tflite").exists()
    # The option given is the one named (not the top-k it would have clamped to -5).
    assert negative.returncode == 2 and negative.stderr.splitlines()[-1] == (
        "error: invalid model config: num_items must be >= 1, got -5"
    )


def test_unknown_config_field_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_items": 10, "embeding_dim": 4}))

    result = run_cli("--config", str(config), "--output-dir", str(tmp_path))

    assert result.returncode == 2
    assert "embeding_dim" in result.stderr


def test_huber_delta_is_for_explicit_feedback_and_non_negative(tmp_path: Path) -> None:
    negative = run_cli("--output-dir", str(tmp_path), "--huber-delta", "-1")
    implicit = run_cli("--output-dir", str(tmp_path), "--feedback", "implicit", "--huber-delta", "1")

    assert negative.returncode == 2
    assert "huber_delta must be finite and >= 0, got -1.0" in negative.stderr
    assert implicit.returncode == 2
    assert "huber_delta applies to explicit feedback only" in implicit.stderr
    assert not (tmp_path / "model.tflite").exists()


def test_clip_predictions_is_for_explicit_feedback_and_a_boolean(tmp_path: Path) -> None:
    implicit = run_cli("--output-dir", str(tmp_path), "--feedback", "implicit", "--clip-predictions")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_items": 10, "clip_predictions": 1}))
    not_boolean = run_cli("--config", str(config), "--output-dir", str(tmp_path))

    assert implicit.returncode == 2
    assert "clip_predictions applies to explicit feedback only" in implicit.stderr
    assert not_boolean.returncode == 2
    assert "clip_predictions must be true or false, got 1" in not_boolean.stderr
    assert not (tmp_path / "model.tflite").exists()


def test_what_would_fail_after_the_export_is_refused_before_it(tmp_path: Path) -> None:
    a_file = tmp_path / "taken"
    a_file.write_text("")
    hour_model = "tests.device_runtime.hour_recommender:build"

    for args, message in (
        (
            ["--model", hour_model, "--out", str(a_file)],
            f"--output-dir {a_file}: exists and is not a directory",
        ),
        (["--config", str(tmp_path / "none.json"), "--out", str(tmp_path / "o")], "cannot read --config"),
        (
            ["--model", hour_model, "--model-arg", "top_k=31", "--out", str(tmp_path / "o")],
            "a ranking task's top_k must be in [1, 30] (the rows of its catalog feature 'expression')",
        ),
    ):
        result = run_cli(*args)
        last = result.stderr.strip().splitlines()[-1]  # after TensorFlow's start-up lines, if any
        assert result.returncode == 2 and last.startswith("error: ") and message in last, result.stderr
    assert not (tmp_path / "o").exists()


def test_the_console_script_imports_the_users_module_from_the_current_directory(tmp_path: Path) -> None:
    """As `python -m model_export` does: `model-export --model my_model:build` in the user's folder."""
    (tmp_path / "my_model.py").write_text("def build(size: int = 3):\n    raise ValueError(f'size {size}')\n")
    script = Path(sys.executable).parent / "model-export"

    result = subprocess.run(
        [str(script), "--model", "my_model:build", "--model-arg", "size=4", "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )

    # The module was found and its function ran (its own refusal is the user's message).
    assert result.returncode == 2 and "error: my_model:build: size 4" in result.stderr, result.stderr


def test_an_unsupported_op_is_the_export_s_message_alone_unless_verbose(tmp_path: Path) -> None:
    model = ["--model", "tests.model_export.export_cases:unsupported_gradient"]

    quiet = run_cli(*model, "--output-dir", str(tmp_path / "quiet"))
    verbose = run_cli(*model, "--output-dir", str(tmp_path / "verbose"), "--verbose")

    assert quiet.returncode == verbose.returncode == 2, (quiet.stderr, verbose.stderr)
    # Its message lists the ops (a line each); the converter's C++ diagnostics come only with --verbose.
    assert quiet.stderr.startswith("error: "), quiet.stderr
    assert "EluGrad (from layer 'smooth')" in quiet.stderr
    lines = len(verbose.stderr.splitlines()) - len(quiet.stderr.splitlines())
    assert lines >= 5 and quiet.stderr.strip() in verbose.stderr, (quiet.stderr, verbose.stderr)
