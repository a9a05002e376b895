"""Export the kit's small model into vectors/task/model: `python -m conformance.export_model`.

A matrix-factorization recommender of 12 items and 4 dimensions (a model.tflite under 50 kB);
the exporter runs in its own process, as everywhere on the device side (TensorFlow stays out)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from conformance.vectors import MODEL_DIR

CONFIG = {"num_items": 12, "embedding_dim": 4, "batch_size": 2, "max_batches": 2, "top_k": 5}


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "config.json"
        config.write_text(json.dumps(CONFIG))
        command = [
            sys.executable,
            "-m",
            "model_export",
            "--config",
            str(config),
            "--output-dir",
            str(MODEL_DIR),
        ]
        result = subprocess.run(command, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}, check=False)
    if result.returncode != 0:
        sys.exit(f"the export failed (exit {result.returncode}); see its output above")


if __name__ == "__main__":
    main()
