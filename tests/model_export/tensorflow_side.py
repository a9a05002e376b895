"""The TensorFlow side of the TFLite-vs-TensorFlow equality tests, run in its own process
(`python -m tests.model_export.tensorflow_side MODULE:FUNCTION INPUTS.npz OUTPUTS.npz`).

It builds the spec's `Trainer` and runs its signature methods eagerly, with TensorFlow's own
gradients (not the builtin rewrites the export traces with), on the inputs the test packed:
`global/<name>`, `local/<name>`, and `<signature>/<input>` for reconstruct, update, evaluate,
gradient and infer. Outputs: `<signature>/<output>`, and `<signature>/local/<name>` after training.
"""

from __future__ import annotations

import importlib
import sys

import numpy as np
import tensorflow as tf

from model_export.trainer import Trainer


def main(target: str, inputs_path: str, outputs_path: str) -> None:
    module, _, function = target.partition(":")
    trainer = Trainer(getattr(importlib.import_module(module), function)())
    data = dict(np.load(inputs_path))
    for name, variable in trainer.global_vars.items():
        variable.assign(data[f"global/{name}"])
    results: dict[str, np.ndarray] = {}
    for signature in ("reconstruct", "update", "evaluate", "gradient", "infer"):
        for name, variable in trainer.local_vars.items():
            variable.assign(data[f"local/{name}"])
        prefix = f"{signature}/"
        inputs = {k.removeprefix(prefix): tf.constant(v) for k, v in data.items() if k.startswith(prefix)}
        method = trainer.infer_batch if signature == "infer" else getattr(trainer, signature)
        for name, value in method(**inputs).items():
            results[f"{signature}/{name}"] = np.asarray(value)
        for name, variable in trainer.local_vars.items():
            results[f"{signature}/local/{name}"] = variable.numpy()
    np.savez(outputs_path, **results)


if __name__ == "__main__":
    main(*sys.argv[1:])
