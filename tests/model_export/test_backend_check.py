"""The export runs every signature on every installed interpreter backend: a model that runs on
one and not another is refused with a line naming the signature and the backend; what a port
must know is a warning."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from model_export.config import ModelConfig
from model_export.in_subprocess import export_spec_in_subprocess
from model_runtime.backend_agreement import compare_backends
from model_runtime.interpreter import BACKENDS
from tests.conftest import BIASED


def test_an_export_runs_alike_on_every_backend_and_warns_of_outputs_sharing_a_tensor(
    export: Callable[[ModelConfig], Path],
) -> None:
    agreement = compare_backends(export(BIASED))

    assert agreement.backends == list(BACKENDS)
    assert agreement.problems == []
    # A squared-error model's loss is its squared error: one tensor, named once by CompiledModel.
    assert agreement.warnings == [
        "signature 'evaluate': outputs loss_sum, squared_error_sum are one tensor, which LiteRT's "
        "CompiledModel names once: a port must name its outputs from the model's signature defs"
    ]


def test_a_model_whose_signature_fails_on_compiled_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError) as refused:
        export_spec_in_subprocess("tests.model_export.dynamic_output:build", tmp_path / "model")

    message = str(refused.value)
    assert "the model does not run alike on every interpreter backend" in message
    assert (
        "signature 'infer' (pass 1) runs on ai_edge_litert, tflite_runtime and fails on compiled_model"
        in message
    )
    assert not (tmp_path / "model" / "manifest.json").exists()
