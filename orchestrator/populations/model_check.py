"""Loading an uploaded model before a population is made of it.

A manifest whose sha256 matches the bytes says nothing about whether the bytes are a model:
random bytes, a truncated file, a flipped bit or 100 MB of zeros all match their own manifest.
Accepted, such a model fails on every device in turn, and on the server wherever it runs the
model (gradient transfer's central gradient, parallel training). So the server loads it with the
same runtime the devices use (model_runtime; never device_runtime) and checks it against its
manifest: every declared signature with the declared inputs and outputs, and the global (and
local) variables with the manifest's names, shapes and dtypes.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from contracts.manifest import MANIFEST_FILE, MODEL_FILE, Manifest, ManifestError, TensorSpec
from model_runtime.interpreter import InterpreterUnavailable
from model_runtime.tflite_model import ModelLoadError, TFLiteModel


class ModelUnusable(ValueError):
    """The uploaded model cannot be loaded, or disagrees with its manifest; the message says how."""


def check_model(tflite: bytes, manifest: Manifest) -> None:
    """Raise ModelUnusable unless `tflite` loads and agrees with `manifest`."""
    with tempfile.TemporaryDirectory(prefix="orchestrator-model-check-") as folder:
        model_dir = Path(folder)
        (model_dir / MODEL_FILE).write_bytes(tflite)
        (model_dir / MANIFEST_FILE).write_text(json.dumps(manifest.to_json()))
        try:
            model = TFLiteModel(model_dir, default_delegates=False)
            problems = _disagreements("global", model.get_global(), manifest.global_params)
            problems += _disagreements("local", model.get_local(), manifest.local_params)
        except (ModelLoadError, ManifestError) as e:
            raise ModelUnusable(
                f"the model does not load as its manifest describes: {described(e)}"
            ) from None
        except InterpreterUnavailable:
            raise  # the server's installation, not the upload: a 500 is right
        except (ValueError, RuntimeError, KeyError) as e:  # the interpreter failing on a damaged model
            raise ModelUnusable(f"the model's variables cannot be read: {described(e)}") from None
        if problems:
            raise ModelUnusable("the model's variables disagree with the manifest: " + "; ".join(problems))


def _disagreements(kind: str, found: dict[str, np.ndarray], declared: Sequence[TensorSpec]) -> list[str]:
    expected = {spec.name: (tuple(spec.shape), spec.dtype) for spec in declared}
    actual = {name: (tuple(int(n) for n in value.shape), value.dtype.name) for name, value in found.items()}
    problems = [f"{kind} {name!r} is missing from the model" for name in sorted(set(expected) - set(actual))]
    problems += [
        f"the model has {kind} {name!r}, not in the manifest" for name in sorted(set(actual) - set(expected))
    ]
    problems += [
        f"{kind} {name!r} is {actual[name][1]} {list(actual[name][0])}, the manifest says "
        f"{expected[name][1]} {list(expected[name][0])}"
        for name in sorted(set(expected) & set(actual))
        if actual[name] != expected[name]
    ]
    return problems


def described(error: Exception) -> str:
    """The error's first line, the temporary file named as the upload's field."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return re.sub(r"\S*/" + re.escape(MODEL_FILE), MODEL_FILE, text)
