"""`manifest.json`: the contract between an exported model, the orchestrator and devices.

No TensorFlow, so that every part can read it. Shapes are read
from here, never guessed; `load_manifest` checks the file against the `.tflite` beside it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contracts.features import FeatureSpec, FeatureSpecError, check_feature_specs

FORMAT_VERSION = 2
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
# What only a model with local parameters has: a model with none (plain FedAvg on the user's
# model) is exported without them, and its tasks skip the reconstruction.
LOCAL_SIGNATURES = ("reconstruct", "get_local", "set_local", "reset_local")
DTYPES = ("float32", "int32")
TRAINING_SIGNATURES = ("reconstruct", "update", "evaluate")  # the signatures that take packed batches
# The batch inputs every training signature takes besides features, task rows and dense globals.
WEIGHTS, NUM_BATCHES = "weights", "num_batches"
HYPERPARAMETERS = {
    "reconstruct": ("num_steps", "learning_rate", "l2_local"),
    "update": ("num_steps", "learning_rate", "local_learning_rate", "l2_global", "l2_local"),
    "evaluate": (),
}
TASK_KINDS = ("ranking", "classification", "regression")
# Gradient transfer (Augenstein et al., Algorithm 4): a model exported with the `gradient`
# signature also takes, in `update`, a central gradient per global (`<name>_central_gradient`,
# shaped like that global's training input) and its weight. Optional, so that manifests exported
# before it still load: a model without it trains as before and refuses a central gradient.
GRADIENT_SIGNATURE = "gradient"
CENTRAL_GRADIENT_WEIGHT = "central_gradient_weight"


def task_rows_input(feature: str) -> str:
    """The training signatures' input with the catalog values of `feature`'s task rows, which a
    model with per-row constants (`Manifest.task_row_features`) takes."""
    return f"{feature}_task_rows"


def central_gradient_input(name: str) -> str:
    """The `update` input that takes the central gradient of global `name`."""
    return f"{name}_central_gradient"


def required_signatures(has_locals: bool) -> tuple[str, ...]:
    """The signatures a model must have: without local parameters, none of `LOCAL_SIGNATURES`."""
    return tuple(s for s in REQUIRED_SIGNATURES if has_locals or s not in LOCAL_SIGNATURES)


class ManifestError(ValueError):
    """The manifest is missing, malformed, or disagrees with the model file."""


@dataclass(frozen=True)
class TensorSpec:
    """A named tensor; a global parameter read and trained only in the rows a task's examples use
    has `row_sparse` = the feature that indexes it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    row_sparse: str | None = None

    @property
    def num_elements(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}
        if self.row_sparse is not None:
            data["row_sparse"] = self.row_sparse
        return data

    @classmethod
    def from_json(cls, data: Any, where: str) -> TensorSpec:
        if not isinstance(data, dict):
            raise ManifestError(f"{where}: expected an object with name, shape, dtype")
        name, shape, dtype = data.get("name"), data.get("shape"), data.get("dtype")
        row_sparse = data.get("row_sparse")
        if not isinstance(name, str) or not name:
            raise ManifestError(f"{where}: 'name' must be a non-empty string, got {name!r}")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise ManifestError(f"{where} ({name}): 'shape' must be a list of ints >= 0")
        if dtype not in DTYPES:
            raise ManifestError(f"{where} ({name}): 'dtype' must be one of {DTYPES}")
        if row_sparse is not None and not isinstance(row_sparse, str):
            raise ManifestError(f"{where} ({name}): 'row_sparse' must name a feature, got {row_sparse!r}")
        return cls(name=name, shape=tuple(shape), dtype=dtype, row_sparse=row_sparse)


@dataclass(frozen=True)
class MetricSpec:
    """A metric `evaluate` sums over examples (`<name>_sum`); `value_range` bounds one example's value."""

    name: str
    value_range: tuple[float, float] | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name}
        if self.value_range is not None:
            data["range"] = list(self.value_range)
        return data

    @classmethod
    def from_json(cls, data: Any) -> MetricSpec:
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
            raise ManifestError(f"a metric must be an object with a name, got {data!r}")
        value_range = data.get("range")
        if value_range is not None and (
            not isinstance(value_range, list)
            or len(value_range) != 2
            or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in value_range)
            or value_range[0] > value_range[1]
        ):
            raise ManifestError(f"metric {data['name']!r}: 'range' must be [low, high], got {value_range!r}")
        return cls(
            data["name"], None if value_range is None else (float(value_range[0]), float(value_range[1]))
        )


@dataclass(frozen=True)
class TaskSpec:
    """What `infer` does.

    - `ranking`: scores every row of the catalog feature's table for this user (`infer(exclude,
      <context>)` -> `scores`, `top_items`, `top_scores`); the model's other input features are its
      *context* (e.g. the hour), one value each per call, the same for every catalog row;
      `negative_sampling`: labels are implicit (1 = shared) and tasks add sampled non-shared
      catalog items as 0s (in the context of the share they stand against); `popularity`: a global
      [catalog] tensor that ranks for a user with no examples yet (e.g. item biases), or None.
    - `classification`: `infer(<input features of one batch>)` -> `top_classes`, `top_scores`
      [batch_size, top_k] over `num_classes`.
    - `regression`: `infer(<input features of one batch>)` -> `predictions` [batch_size].
    """

    kind: str
    top_k: int = 0
    catalog_feature: str | None = None
    negative_sampling: bool = False
    popularity: str | None = None
    num_classes: int = 0

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"kind": self.kind}
        if self.kind == "ranking":
            data |= {
                "catalog_feature": self.catalog_feature,
                "top_k": self.top_k,
                "negative_sampling": self.negative_sampling,
                "popularity": self.popularity,
            }
        elif self.kind == "classification":
            data |= {"num_classes": self.num_classes, "top_k": self.top_k}
        return data

    @classmethod
    def from_json(cls, data: Any) -> TaskSpec:
        if not isinstance(data, dict) or data.get("kind") not in TASK_KINDS:
            raise ManifestError(f"'task' must be an object with 'kind' one of {TASK_KINDS}, got {data!r}")
        kind = data["kind"]
        if kind == "ranking":
            catalog, popularity = data.get("catalog_feature"), data.get("popularity")
            if not isinstance(catalog, str) or not (popularity is None or isinstance(popularity, str)):
                raise ManifestError(
                    "a ranking task names its 'catalog_feature' (and optionally 'popularity')"
                )
            return cls(
                kind,
                top_k=_require(data, "top_k", int),
                catalog_feature=catalog,
                negative_sampling=bool(data.get("negative_sampling", False)),
                popularity=popularity,
            )
        if kind == "classification":
            return cls(
                kind, top_k=_require(data, "top_k", int), num_classes=_require(data, "num_classes", int)
            )
        return cls(kind)


@dataclass(frozen=True)
class Manifest:
    format_version: int
    model_sha256: str
    model_bytes: int
    features: tuple[FeatureSpec, ...]
    batch_size: int
    max_batches: int
    global_params: tuple[TensorSpec, ...]
    local_params: tuple[TensorSpec, ...]
    metrics: tuple[MetricSpec, ...]
    task: TaskSpec
    signatures: dict[str, dict[str, dict[str, TensorSpec]]]
    training_defaults: dict[str, float | int]
    config: dict[str, Any] = field(default_factory=dict)
    exported_with: dict[str, str] = field(default_factory=dict)
    # Row-sparse features whose task rows the training signatures also take by their catalog
    # values (`<feature>_task_rows`, [max_rows] int32): the model looks up constants of each
    # catalog row (`model_export.layers.CatalogAttribute`, e.g. an item's topic) at them.
    task_row_features: tuple[str, ...] = ()

    @property
    def max_examples(self) -> int:
        return self.max_batches * self.batch_size

    def feature(self, name: str) -> FeatureSpec:
        for spec in self.features:
            if spec.name == name:
                return spec
        raise KeyError(name)

    @property
    def input_features(self) -> tuple[FeatureSpec, ...]:
        return tuple(f for f in self.features if f.role == "input")

    @property
    def context_features(self) -> tuple[FeatureSpec, ...]:
        """A ranking model's inputs besides its catalog feature (e.g. the hour): `infer` takes one
        value of each and scores the whole catalog in that context. None for other tasks."""
        if self.task.kind != "ranking":
            return ()
        return tuple(f for f in self.input_features if f.name != self.task.catalog_feature)

    @property
    def label_features(self) -> tuple[FeatureSpec, ...]:
        return tuple(f for f in self.features if f.role == "label")

    def global_spec(self, name: str) -> TensorSpec:
        for spec in self.global_params:
            if spec.name == name:
                return spec
        raise KeyError(name)

    @property
    def row_sparse_features(self) -> tuple[str, ...]:
        """Features that index a row-sparse global, in declaration order (packed as slots)."""
        return tuple(f.name for f in self.features if any(p.row_sparse == f.name for p in self.global_params))

    def max_rows(self, feature: str) -> int:
        """Distinct rows a task can touch through `feature`: its values in one call's examples."""
        spec = self.feature(feature)
        per_example = 1
        for dim in spec.shape:
            per_example *= dim
        return self.max_examples * per_example

    @property
    def takes_central_gradient(self) -> bool:
        """Whether the model has the `gradient` signature and `update` takes a central gradient."""
        return GRADIENT_SIGNATURE in self.signatures

    @property
    def catalog_size(self) -> int:
        """The rows a ranking task ranks."""
        if self.task.catalog_feature is None:
            raise ManifestError(f"a {self.task.kind} model ranks no catalog")
        return self.feature(self.task.catalog_feature).num_values

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "model": {"file": MODEL_FILE, "sha256": self.model_sha256, "bytes": self.model_bytes},
            "features": [f.to_json() for f in self.features],
            "batch_size": self.batch_size,
            "max_batches": self.max_batches,
            "global_params": [s.to_json() for s in self.global_params],
            "local_params": [s.to_json() for s in self.local_params],
            "metrics": [m.to_json() for m in self.metrics],
            "task": self.task.to_json(),
            "signatures": {
                name: {side: [s.to_json() for s in specs.values()] for side, specs in sig.items()}
                for name, sig in self.signatures.items()
            },
            "training_defaults": self.training_defaults,
            "config": self.config,
            "exported_with": self.exported_with,
            **({"task_row_features": list(self.task_row_features)} if self.task_row_features else {}),
        }

    @classmethod
    def from_json(cls, data: Any) -> Manifest:
        if not isinstance(data, dict):
            raise ManifestError("manifest must be a JSON object")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise ManifestError(
                f"unsupported manifest format_version {version!r}; this code reads {FORMAT_VERSION} "
                "(export the model again with `python -m model_export`)"
            )
        model = _require(data, "model", dict)
        ints = {k: _require(data, k, int) for k in ("batch_size", "max_batches")}
        for k, v in ints.items():
            if v < 1:
                raise ManifestError(f"'{k}' must be >= 1, got {v}")
        try:
            features = tuple(FeatureSpec.from_json(f) for f in _require(data, "features", list))
            check_feature_specs(features)
        except FeatureSpecError as e:
            raise ManifestError(f"features: {e}") from None
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
        has_locals = bool(data.get("local_params"))
        missing = [s for s in required_signatures(has_locals) if s not in signatures]
        if missing:
            raise ManifestError(
                f"manifest lacks required signatures {missing}"
                + ("" if has_locals else " (a model without local parameters needs no local signatures)")
            )
        task_row_features = data.get("task_row_features", [])
        if not isinstance(task_row_features, list) or not all(isinstance(f, str) for f in task_row_features):
            raise ManifestError(
                f"'task_row_features' must be a list of feature names, got {task_row_features!r}"
            )
        manifest = cls(
            format_version=version,
            model_sha256=_require(model, "sha256", str),
            model_bytes=_require(model, "bytes", int),
            features=features,
            global_params=tuple(
                TensorSpec.from_json(s, "global_params") for s in _require(data, "global_params", list)
            ),
            local_params=tuple(
                TensorSpec.from_json(s, "local_params") for s in _require(data, "local_params", list)
            ),
            metrics=tuple(MetricSpec.from_json(m) for m in _require(data, "metrics", list)),
            task=TaskSpec.from_json(data.get("task")),
            signatures=signatures,
            training_defaults=_require(data, "training_defaults", dict),
            config=data.get("config", {}),
            exported_with=data.get("exported_with", {}),
            task_row_features=tuple(task_row_features),
            **ints,
        )
        manifest.check_consistency()
        return manifest

    def training_inputs(self, signature: str) -> dict[str, tuple[tuple[int, ...], str]]:
        """(shape, dtype) of every input a training/evaluation signature must take (the layout)."""
        b, s = self.batch_size, self.max_batches
        row_sparse = set(self.row_sparse_features)
        expected: dict[str, tuple[tuple[int, ...], str]] = {}
        for f in self.features:
            # A feature that indexes a row-sparse table arrives as slots into the task's rows.
            expected[f.name] = ((s, b, *f.shape), "int32" if f.name in row_sparse else f.dtype)
        for p in self.global_params:
            if p.row_sparse is not None:
                expected[p.name] = ((self.max_rows(p.row_sparse), *p.shape[1:]), p.dtype)
            else:
                expected[p.name] = (p.shape, p.dtype)
        for feature in self.task_row_features:
            expected[task_rows_input(feature)] = ((self.max_rows(feature),), "int32")
        expected[WEIGHTS] = ((s, b), "float32")
        expected[NUM_BATCHES] = ((), "int32")
        for h in HYPERPARAMETERS[signature]:
            expected[h] = ((), "int32" if h == "num_steps" else "float32")
        if signature == "update" and self.takes_central_gradient:
            for p in self.global_params:
                expected[central_gradient_input(p.name)] = expected[p.name][0], "float32"
            expected[CENTRAL_GRADIENT_WEIGHT] = ((), "float32")
        return expected

    def training_shape(self, name: str) -> tuple[int, ...]:
        """The shape a training signature takes global `name` in: its task rows if row-sparse."""
        p = self.global_spec(name)
        return (self.max_rows(p.row_sparse), *p.shape[1:]) if p.row_sparse else p.shape

    def check_consistency(self) -> None:
        """Parameters, features, task and signatures must agree; a ManifestError says where not."""
        names = {f.name for f in self.features}
        for p in self.global_params:
            if p.row_sparse is None:
                continue
            if p.row_sparse not in names:
                raise ManifestError(f"global {p.name!r} is row-sparse by unknown feature {p.row_sparse!r}")
            feature = self.feature(p.row_sparse)
            if p.name not in feature.tables or feature.role != "input":
                raise ManifestError(
                    f"feature {feature.name!r} indexing {p.name!r} must be an input with a table"
                )
            if not p.shape or p.shape[0] != feature.num_values:
                raise ManifestError(
                    f"row-sparse global {p.name!r} has shape {list(p.shape)}; feature {feature.name!r} "
                    f"indexes {feature.num_values} rows"
                )
        for f in self.task_row_features:
            if f not in self.row_sparse_features:
                raise ManifestError(
                    f"task_row_features: {f!r} indexes no row-sparse global, so it has no task rows"
                )
        if self.task.kind == "ranking":
            catalog = self.task.catalog_feature
            if catalog not in self.row_sparse_features:
                raise ManifestError(
                    f"ranking task: catalog feature {catalog!r} must index a row-sparse global"
                )
            if not 1 <= self.task.top_k <= self.catalog_size:
                raise ManifestError(f"ranking task: top_k must be in [1, {self.catalog_size}]")
            if self.task.popularity is not None and self.global_spec(self.task.popularity).shape != (
                self.catalog_size,
            ):
                raise ManifestError(f"ranking task: popularity {self.task.popularity!r} must be [catalog]")
        expected_io: dict[tuple[str, str], dict[str, tuple[tuple[int, ...], str]]] = {}
        present = set(required_signatures(bool(self.local_params)))
        for name in TRAINING_SIGNATURES:
            if name in present:
                expected_io[(name, "inputs")] = self.training_inputs(name)
        expected_io[("update", "outputs")] = {
            "loss": ((), "float32"),
            **{f"{p.name}_delta": (self.training_shape(p.name), "float32") for p in self.global_params},
        }
        if self.takes_central_gradient:
            # The same batches as `evaluate`; the gradient of the data loss per global training input.
            expected_io[(GRADIENT_SIGNATURE, "inputs")] = self.training_inputs("evaluate")
            expected_io[(GRADIENT_SIGNATURE, "outputs")] = {
                "loss": ((), "float32"),
                "weight_sum": ((), "float32"),
                **{
                    f"{p.name}_gradient": (self.training_shape(p.name), "float32") for p in self.global_params
                },
            }
        expected_io[("evaluate", "outputs")] = {
            f"{m}_sum": ((), "float32") for m in ("loss", "weight", *(m.name for m in self.metrics))
        }
        for setter, params in (("set_global", self.global_params), ("set_local", self.local_params)):
            if setter in present:
                expected_io[(setter, "inputs")] = {p.name: (p.shape, p.dtype) for p in params}
        b = self.batch_size
        if self.task.kind == "ranking":
            n, k = self.catalog_size, self.task.top_k
            expected_io[("infer", "inputs")] = {
                "exclude": ((n,), "float32"),
                **{f.name: (f.shape, f.dtype) for f in self.context_features},
            }
            expected_io[("infer", "outputs")] = {
                "scores": ((n,), "float32"),
                "top_items": ((k,), "int32"),
                "top_scores": ((k,), "float32"),
            }
        else:
            expected_io[("infer", "inputs")] = {f.name: ((b, *f.shape), f.dtype) for f in self.input_features}
            if self.task.kind == "classification":
                k = self.task.top_k
                expected_io[("infer", "outputs")] = {
                    "top_classes": ((b, k), "int32"),
                    "top_scores": ((b, k), "float32"),
                }
            else:
                expected_io[("infer", "outputs")] = {"predictions": ((b,), "float32")}
        for (name, side), expected in expected_io.items():
            actual = {k: (s.shape, s.dtype) for k, s in self.signatures[name][side].items()}
            if actual != expected:
                wrong = sorted(k for k in set(actual) | set(expected) if actual.get(k) != expected.get(k))
                raise ManifestError(
                    f"signature {name!r} {side} disagree with the manifest's features, parameters and "
                    f"task at {wrong}: declared {[actual.get(k) for k in wrong]}, the layout needs "
                    f"{[expected.get(k) for k in wrong]} ((shape, dtype) each; None: absent)"
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
