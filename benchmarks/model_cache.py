"""Exported models for the benchmark, by configuration."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from contracts.manifest import MANIFEST_FILE
from model_export.config import ModelConfig
from model_export.in_subprocess import export_in_subprocess


class ModelCache:
    """Exports by configuration, reused across runs (an export takes ~10 s)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def get(self, config: ModelConfig) -> Path:
        key = hashlib.sha256(json.dumps(config.to_json(), sort_keys=True).encode()).hexdigest()[:16]
        model_dir = self.root / key
        if not (model_dir / MANIFEST_FILE).is_file():  # the exporter writes the manifest last
            export_in_subprocess(config, model_dir)
        return model_dir
