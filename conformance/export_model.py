"""Export the kit's small model into vectors/task/model: `python -m conformance.export_model`.

A matrix-factorization model of 12 items and 4 dimensions (48 KB of .tflite), committed: a
TensorFlow export is not byte-for-byte reproducible, so the task vectors are made from this file."""

from __future__ import annotations

from conformance.runner import VECTORS
from model_export.config import ModelConfig
from model_export.in_subprocess import export_in_subprocess

CONFIG = ModelConfig(num_items=12, embedding_dim=4, batch_size=2, max_batches=2, top_k=5)


def main() -> int:
    out = export_in_subprocess(CONFIG, VECTORS / "task" / "model")
    (out / "config.json").unlink(missing_ok=True)  # the manifest's 'config' holds it
    print(f"exported the kit's model into {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
