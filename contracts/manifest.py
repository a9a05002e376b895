"""`manifest.json`: the contract between an exported model, the orchestrator and devices.

Pure Python (no TensorFlow, no numpy) so that every part can read it. Shapes are read
from here, never guessed; `load_manifest` checks the file against the `.tflite` beside it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
MODEL_FILE = "model.tflite"
MANIFEST_FILE = "manifest.json"
INITIAL_GLOBAL_FILE = "global_params.safetensors"
REQUIRED_SIGNATURES = (
    "reconstruct",
    "update",
    "infer",
    "evaluate",
    "get_global",
    "set_global",
    "get_local",
    "set_local",
    "reset_local",
)
DTYPES = ("float32", "int32")
_TRAINING = ("reconstruct", "update", "evaluate")  # the signatures that take packed batches


class ManifestError(ValueError):
    """The manifest is missing, malformed, or disagrees with the model file."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def num_elements(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, data: Any, where: str) -> TensorSpec:
        if not isinstance(data, dict):
            raise ManifestError(f"{where}: expected an object with name, shape, dtype")
        name, shape, dtype = data.get("name"), data.get("shape"), data.get("dtype")
        if not isinstance(name, str) or not name:
            raise ManifestError(f"{where}: 'name' must be a non-empty string, got {name!r}")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise ManifestError(f"{where} ({name}): 'shape' must be a list of ints >= 0")
        if dtype not in DTYPES:
            raise ManifestError(f"{where} ({name}): 'dtype' must be one of {DTYPES}")
        return cls(name=name, shape=tuple(shape), dtype=dtype)


@dataclass(frozen=True)
class Manifest:
    format_version: int
    model_sha256: str
    model_bytes: int
    feedback: str
    num_items: int
    embedding_dim: int
    batch_size: int
    max_batches: int
    top_k: int
    label_range: tuple[float, float]
    global_params: tuple[TensorSpec, ...]
    local_params: tuple[TensorSpec, ...]
    signatures: dict[str, dict[str, dict[str, TensorSpec]]]
    training_defaults: dict[str, float | int]
    config: dict[str, Any] = field(default_factory=dict)
    exported_with: dict[str, str] = field(default_factory=dict)

    @property
    def max_examples(self) -> int:
        return self.max_batches * self.batch_size

    def global_spec(self, name: str) -> TensorSpec:
        for spec in self.global_params:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "model": {"file": MODEL_FILE, "sha256": self.model_sha256, "bytes": self.model_bytes},
            "feedback": self.feedback,
            "num_items": self.num_items,
            "embedding_dim": self.embedding_dim,
            "batch_size": self.batch_size,
            "max_batches": self.max_batches,
            "top_k": self.top_k,
            "label_range": list(self.label_range),
            "global_params": [s.to_json() for s in self.global_params],
            "local_params": [s.to_json() for s in self.local_params],
            "signatures": {
                name: {side: [s.to_json() for s in specs.values()] for side, specs in sig.items()}
                for name, sig in self.signatures.items()
            },
            "training_defaults": self.training_defaults,
            "config": self.config,
            "exported_with": self.exported_with,
        }

    @classmethod
    def from_json(cls, data: Any) -> Manifest:
        if not isinstance(data, dict):
            raise ManifestError("manifest must be a JSON object")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise ManifestError(
                f"unsupported manifest format_version {version!r}; this code reads {FORMAT_VERSION}"
            )
        model = _require(data, "model", dict)
        ints = {
            k: _require(data, k, int)
            for k in ("num_items", "embedding_dim", "batch_size", "max_batches", "top_k")
        }
        for k, v in ints.items():
            if v < 1:
                raise ManifestError(f"'{k}' must be >= 1, got {v}")
        feedback = _require(data, "feedback", str)
        if feedback not in ("explicit", "implicit"):
            raise ManifestError(f"'feedback' must be 'explicit' or 'implicit', got {feedback!r}")
        label_range = _require(data, "label_range", list)
        if (
            len(label_range) != 2
            or not all(isinstance(x, (int, float)) for x in label_range)
            or not label_range[0] < label_range[1]
        ):
            raise ManifestError(f"'label_range' must be [low, high] with low < high, got {label_range}")
        signatures: dict[str, dict[str, dict[str, TensorSpec]]] = {}
        for name, sig in _require(data, "signatures", dict).items():
            if not isinstance(sig, dict):
                raise ManifestError(f"signature {name!r}: expected inputs and outputs")
            signatures[name] = {}
            for side in ("inputs", "outputs"):
                specs = sig.get(side)
                if not isinstance(specs, list):
                    raise ManifestError(f"signature {name!r}: '{side}' must be a list")
                parsed = [TensorSpec.from_json(s, f"signature {name!r} {side}") for s in specs]
                signatures[name][side] = {s.name: s for s in parsed}
        missing = [s for s in REQUIRED_SIGNATURES if s not in signatures]
        if missing:
            raise ManifestError(f"manifest lacks required signatures {missing}")
        manifest = cls(
            format_version=version,
            model_sha256=_require(model, "sha256", str),
            model_bytes=_require(model, "bytes", int),
            feedback=feedback,
            label_range=(float(label_range[0]), float(label_range[1])),
            global_params=tuple(
                TensorSpec.from_json(s, "global_params") for s in _require(data, "global_params", list)
            ),
            local_params=tuple(
                TensorSpec.from_json(s, "local_params") for s in _require(data, "local_params", list)
            ),
            signatures=signatures,
            training_defaults=_require(data, "training_defaults", dict),
            config=data.get("config", {}),
            exported_with=data.get("exported_with", {}),
            **ints,
        )
        manifest._check_consistency()
        return manifest

    def _check_consistency(self) -> None:
        """The parameter specs must agree with the numbers and with set_global/set_local."""
        try:
            items = self.global_spec("item_embeddings")
        except KeyError:
            raise ManifestError("global_params must include 'item_embeddings'") from None
        if items.shape != (self.num_items, self.embedding_dim):
            raise ManifestError(
                f"item_embeddings shape {list(items.shape)} disagrees with num_items x "
                f"embedding_dim = [{self.num_items}, {self.embedding_dim}]"
            )
        # The runtime packs batches and reads rankings by these numbers: the model must take them.
        shapes: dict[tuple[str, str, str], tuple[int, ...]] = {
            (name, "inputs", "labels"): (self.max_batches, self.batch_size) for name in _TRAINING
        }
        shapes[("infer", "inputs", "exclude")] = (self.num_items,)
        shapes[("infer", "outputs", "top_items")] = (self.top_k,)
        for (name, side, tensor), shape in shapes.items():
            spec = self.signatures[name][side].get(tensor)
            if spec is None or spec.shape != shape:
                raise ManifestError(
                    f"signature {name!r} {side} {tensor!r} has shape "
                    f"{None if spec is None else list(spec.shape)}; the manifest's batch_size, "
                    f"max_batches, num_items and top_k say {list(shape)}"
                )
        for setter, params in (("set_global", self.global_params), ("set_local", self.local_params)):
            declared = {s.name: s for s in params}
            if self.signatures[setter]["inputs"] != declared:
                raise ManifestError(
                    f"signature {setter!r} inputs {sorted(self.signatures[setter]['inputs'])} "
                    f"disagree with the declared parameters {sorted(declared)}"
                )


def _require(data: dict[str, Any], key: str, kind: type) -> Any:
    value = data.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ManifestError(f"manifest field '{key}' must be {kind.__name__}, got {value!r}")
    return value


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load_manifest(model_dir: Path, *, verify_model: bool = True) -> Manifest:
    """Read `manifest.json` from an export directory; check the `.tflite` hash unless told not to."""
    path = Path(model_dir) / MANIFEST_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ManifestError(
            f"no manifest at {path}; expected the output of `python -m model_export`"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path} is not valid JSON: {e}") from None
    manifest = Manifest.from_json(data)
    if verify_model:
        model_path = Path(model_dir) / MODEL_FILE
        if not model_path.is_file():
            raise ManifestError(f"no model file at {model_path}")
        actual = sha256_file(model_path)
        if actual != manifest.model_sha256:
            raise ManifestError(
                f"{model_path} has sha256 {actual[:12]}..., the manifest expects "
                f"{manifest.model_sha256[:12]}...: the file is corrupt or from another export"
            )
    return manifest
