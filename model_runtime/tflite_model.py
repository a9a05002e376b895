"""The exported model on the device: its signatures behind typed, checked methods."""

from __future__ import annotations

import hashlib
import math
import mmap
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from contracts.features import Examples
from contracts.manifest import (
    CENTRAL_GRADIENT_WEIGHT,
    GRADIENT_SIGNATURE,
    MODEL_FILE,
    Manifest,
    ManifestError,
    central_gradient_input,
    load_manifest,
    task_rows_input,
)
from contracts.params import Params, ParamsError, SparseTensor, check_params, row_shape
from model_runtime.interpreter import InterpreterUnavailable, Signature, load_backend
from model_runtime.task_batches import TaskBatches


class ModelLoadError(RuntimeError):
    """The model file is missing, corrupt, or not the one its manifest describes."""


@dataclass(frozen=True)
class EvaluationSums:
    """Weighted sums over evaluated examples (`loss_sum`, `weight_sum`, `<metric>_sum`); they add
    across devices."""

    sums: dict[str, float]

    @classmethod
    def zero(cls) -> EvaluationSums:
        return cls({})

    @property
    def weight_sum(self) -> float:
        return self.sums.get("weight_sum", 0.0)

    def as_dict(self) -> dict[str, float]:
        return dict(self.sums)

    def __add__(self, other: EvaluationSums) -> EvaluationSums:
        keys = self.sums.keys() | other.sums.keys()
        return EvaluationSums({k: self.sums.get(k, 0.0) + other.sums.get(k, 0.0) for k in sorted(keys)})

    def metrics(self) -> dict[str, float]:
        """Example-weighted means of the loss and of each metric over everything summed (NaN when
        empty); `rmse` from a `squared_error` metric and `accuracy` from a `correct` one."""
        others = [k.removesuffix("_sum") for k in self.sums if k.endswith("_sum")]
        names = ["loss", *(n for n in others if n not in ("loss", "weight"))]
        if self.weight_sum <= 0:
            return {
                **dict.fromkeys(names, math.nan),
                **_named(dict.fromkeys(names, math.nan)),
                "examples": 0.0,
            }
        means = {name: self.sums[f"{name}_sum"] / self.weight_sum for name in names}
        return {**means, **_named(means), "examples": self.weight_sum}


def _named(means: dict[str, float]) -> dict[str, float]:
    named = {}
    if "squared_error" in means:
        named["rmse"] = math.sqrt(means["squared_error"]) if means["squared_error"] >= 0 else math.nan
    if "correct" in means:
        named["accuracy"] = means["correct"]
    return named


@dataclass(frozen=True)
class Update:
    delta: Params  # dense, one tensor per global parameter
    loss: float  # mean batch loss over the steps
    max_abs_change: float  # over every changed value; inf/NaN if any was non-finite


@dataclass(frozen=True)
class RowUpdate:
    """An update as the task's rows: what a server that aggregates sparse deltas needs."""

    rows: dict[str, np.ndarray]  # row-sparse global -> the rows it changed (increasing)
    delta: Params  # row-sparse globals: one row per entry of `rows[name]`; the other globals whole
    loss: float  # mean batch loss over the steps
    max_abs_change: float  # over every changed value; inf/NaN if any was non-finite


# A gradient per global parameter, as the rows it touches (a dense global: all its rows), e.g. the
# central gradient a server sends for gradient transfer. Missing globals: zero.
SparseGradient = dict[str, SparseTensor]


@dataclass(frozen=True)
class BatchGradient:
    """`gradient`'s result: the mean data loss's gradient w.r.t. each global (row-sparse globals:
    the batches' rows), the mean loss, and the examples' weight sum (to average several calls)."""

    gradient: SparseGradient
    loss: float
    weight_sum: float


def all_rows(values: np.ndarray) -> SparseTensor:
    """A tensor as a sparse tensor with every row."""
    rows = values.reshape(row_shape(values.shape))
    return SparseTensor(values.shape, np.arange(len(rows), dtype=np.int32), rows)


@dataclass(frozen=True)
class Ranking:
    scores: np.ndarray  # [catalog size]
    top_items: np.ndarray  # [top_k], best first, excluded items last
    top_scores: np.ndarray  # [top_k]


def lazy_zeros(shape: tuple[int, ...]) -> np.ndarray:
    """float32 zeros whose untouched pages never become resident, and go back to the OS when freed.

    np.zeros does this only until glibc raises its mmap threshold after the first large free;
    from then on a 4 MB delta comes from the heap, is zeroed page by page, and stays resident.
    """
    size = int(np.prod(shape)) * 4
    if size == 0:
        return np.zeros(shape, np.float32)
    return np.frombuffer(mmap.mmap(-1, size), dtype=np.float32).reshape(shape)


def _int32(name: str, value: int) -> np.int32:
    """A signature's int32 input; a value it cannot hold is an error, never a wrapped number."""
    if not -(2**31) <= value < 2**31:
        raise ValueError(f"{name} must fit the model's int32 input, got {value}")
    return np.int32(value)


def _float32(name: str, value: float) -> np.float32:
    """A signature's float32 input; a value that would overflow it (or NaN) is an error."""
    if not abs(value) <= np.finfo(np.float32).max:
        raise ValueError(f"{name} must be a finite number within float32's range, got {value}")
    return np.float32(value)


class TFLiteModel:
    """One interpreter over one exported model; not thread-safe (use one per thread).

    The global parameters live here as numpy arrays (as downloaded); training and
    evaluation get just the task's rows, and the interpreter's global variables are
    written only when `infer` needs them, once per new set of globals.
    """

    def __init__(
        self,
        model_dir: Path,
        *,
        backend: str | None = None,
        num_threads: int = 1,
        default_delegates: bool = True,
    ) -> None:
        """`default_delegates=False`: the builtin kernels only, without XNNPACK (whose creation
        prints an INFO line on stderr, which a server's JSON log must not get), for a model
        that is only loaded and checked."""
        model_dir = Path(model_dir)
        self.manifest: Manifest = load_manifest(model_dir, verify_model=False)
        model_path = model_dir / MODEL_FILE
        try:
            # Checked and loaded from the same bytes: loaded from its path, the interpreter would
            # map the file, and a cache file damaged later would change the model under it.
            self._content = model_path.read_bytes()
        except OSError as e:
            raise ModelLoadError(
                f"no model file at {model_path} ({e.strerror}); expected the output of "
                "`python -m model_export`"
            ) from None
        actual = hashlib.sha256(self._content).hexdigest()
        if actual != self.manifest.model_sha256:
            raise ModelLoadError(
                f"{model_path} has sha256 {actual[:12]}..., its manifest expects "
                f"{self.manifest.model_sha256[:12]}...: the file is corrupt or from another export"
            )
        try:
            self._model = load_backend(
                self._content, backend, num_threads=num_threads, default_delegates=default_delegates
            )
        except InterpreterUnavailable:
            raise
        except (ValueError, RuntimeError) as e:
            raise ModelLoadError(f"{model_path} is not a loadable TFLite model: {e}") from None
        self.backend = self._model.name
        self._runners: dict[str, Signature] = {}
        self._check_signatures()
        # Row-sparse global -> the feature whose task rows it is given in.
        self._row_sparse = {s.name: s.row_sparse for s in self.manifest.global_params if s.row_sparse}
        # None: still the exported initial values, read from the interpreter only if asked.
        self._global: Params | None = None
        self._variables_current = True

    def _check_signatures(self) -> None:
        """Every signature the manifest declares must exist with the same inputs and outputs."""
        available = self._model.signature_names()
        for name, declared in self.manifest.signatures.items():
            if name not in available:
                raise ManifestError(
                    f"the manifest declares signature {name!r}; the model has {sorted(available)}"
                )
            runner = self._model.signature(name)
            for side, shapes in (("inputs", runner.inputs), ("outputs", runner.outputs)):
                actual = {k: (s.shape, s.dtype) for k, s in shapes.items()}
                expected = {k: (s.shape, s.dtype) for k, s in declared[side].items()}
                if actual != expected:
                    raise ManifestError(
                        f"signature {name!r} {side} disagree with the manifest: model has {actual}, "
                        f"manifest says {expected}"
                    )
            self._runners[name] = runner

    def _call(self, name: str, **inputs: Any) -> dict[str, np.ndarray]:
        result: dict[str, np.ndarray] = self._runners[name](**inputs)
        return result

    # ---- parameters --------------------------------------------------------------------

    def set_global(self, params: Params) -> None:
        """Install global parameters (checked against the manifest); the model keeps a reference."""
        self._global = check_params(params, self.manifest.global_params, "global parameters")
        self._variables_current = False

    def _globals(self) -> Params:
        if self._global is None:
            self._global = dict(self._call("get_global"))
        return self._global

    def get_global(self) -> Params:
        return {k: v.copy() for k, v in self._globals().items()}

    def _batch_inputs(self, batches: TaskBatches) -> dict[str, np.ndarray]:
        """A training signature's inputs of `batches`: the batches, the catalog values of the task
        rows where the model looks catalog constants up at them, and the task's globals."""
        rows = {task_rows_input(f): batches.rows[f] for f in self.manifest.task_row_features}
        return {**batches.inputs(), **rows, **self._task_globals(batches)}

    def _task_globals(self, batches: TaskBatches) -> Params:
        """The task's rows of the row-sparse globals, and the other globals whole."""
        rows = self._row_sparse
        return {k: v[batches.rows[rows[k]]] if k in rows else v for k, v in self._globals().items()}

    # A model without local parameters (plain FedAvg) has no local signatures: its locals are the
    # empty set, which these read, write and reset as such.

    def set_local(self, params: Params) -> None:
        checked = check_params(params, self.manifest.local_params, "local parameters")
        if self.manifest.local_params:
            self._call("set_local", **checked)

    def get_local(self) -> Params:
        if not self.manifest.local_params:
            return {}
        return {k: v.copy() for k, v in self._call("get_local").items()}

    def reset_local(self) -> None:
        if self.manifest.local_params:
            self._call("reset_local")

    # ---- training and evaluation -------------------------------------------------------

    def reconstruct(
        self, batches: TaskBatches, num_steps: int, learning_rate: float, l2_local: float = 0.0
    ) -> float:
        """Fit the local parameters on `batches` (globals frozen); returns the mean batch loss."""
        if not self.manifest.local_params:
            raise ValueError("this model has no local parameters to reconstruct")
        out = self._call(
            "reconstruct",
            **self._batch_inputs(batches),
            num_steps=_int32("num_steps", num_steps),
            learning_rate=_float32("learning_rate", learning_rate),
            l2_local=_float32("l2_local", l2_local),
        )
        return float(out["loss"])

    def update_rows(
        self,
        batches: TaskBatches,
        num_steps: int,
        learning_rate: float,
        *,
        local_learning_rate: float = 0.0,
        l2_global: float = 0.0,
        l2_local: float = 0.0,
        central_gradient: Mapping[str, SparseTensor] | None = None,
        central_gradient_weight: float = 0.0,
    ) -> RowUpdate:
        """Train the global parameters on `batches`; returns the change of the task's rows.

        Gradient transfer: every step adds `central_gradient_weight` times `central_gradient` to
        the globals' gradient; the task's rows then include the central gradient's rows (returned
        in the change too). At weight 0 (or without one) this is exactly the plain update."""
        steps = _int32("num_steps", num_steps)
        rate = _float32("learning_rate", learning_rate)
        weight = _float32("central_gradient_weight", central_gradient_weight)
        central = self._checked_central_gradient(central_gradient, float(weight))
        outside: dict[str, np.ndarray] = {}
        if central:
            batches, outside = self._widened(batches, central)
        mixing: dict[str, np.ndarray] = {}
        if self.manifest.takes_central_gradient:
            # Without a central gradient: zeros at weight 0, exactly the plain update.
            mixing = self._central_inputs(batches, central)
            mixing[CENTRAL_GRADIENT_WEIGHT] = np.asarray(weight if central else 0.0, np.float32)
        out = self._call(
            "update",
            **self._batch_inputs(batches),
            **mixing,
            num_steps=steps,
            learning_rate=rate,
            local_learning_rate=_float32("local_learning_rate", local_learning_rate),
            l2_global=_float32("l2_global", l2_global),
            l2_local=_float32("l2_local", l2_local),
        )
        # The steps the signature ran (it runs none on no batches).
        ran = max(int(steps), 0) if batches.num_batches > 0 else 0
        delta: Params = {}
        rows: dict[str, np.ndarray] = {}
        max_abs = 0.0
        for spec in self.manifest.global_params:
            compact = out[f"{spec.name}_delta"]
            if spec.row_sparse is not None:
                compact = compact[: batches.num_rows[spec.row_sparse]]
                rows[spec.name] = batches.used_rows(spec.row_sparse)
                extra = outside.get(spec.row_sparse)
                if extra is not None and extra.size and spec.name in central:
                    # Rows beyond one call's capacity that no example uses: nothing but the central
                    # gradient moves them, by exactly -rate * weight * g at each step.
                    g = central[spec.name]
                    at = np.searchsorted(g.rows, extra)
                    found = (at < g.rows.size) & (g.rows[np.minimum(at, g.rows.size - 1)] == extra)
                    moved = np.zeros((extra.size, *compact.shape[1:]), np.float32)
                    moved[found] = (-float(ran) * float(rate) * float(weight)) * g.values[at[found]]
                    order = np.argsort(np.concatenate([rows[spec.name], extra]), kind="stable")
                    rows[spec.name] = np.concatenate([rows[spec.name], extra])[order]
                    compact = np.concatenate([compact, moved])[order]
            delta[spec.name] = compact.astype(np.float32, copy=True)
            if compact.size:
                max_abs = max(max_abs, float(np.max(np.abs(compact))))
        return RowUpdate(rows, delta, float(out["loss"]), max_abs)

    def _checked_central_gradient(
        self, central_gradient: Mapping[str, SparseTensor] | None, weight: float
    ) -> SparseGradient:
        """The central gradient to apply (empty at weight 0 or when none is given); a ValueError
        (ParamsError) says what does not fit the model."""
        if central_gradient is None or weight == 0.0:
            return {}
        if not self.manifest.takes_central_gradient:
            raise ValueError(
                "this model was exported without gradient transfer (no 'gradient' signature); "
                "export it again with `python -m model_export` to train with a central gradient"
            )
        specs = {s.name: s for s in self.manifest.global_params}
        unknown = sorted(set(central_gradient) - set(specs))
        if unknown:
            raise ParamsError(f"central gradient: unknown globals {unknown}; the model's are {sorted(specs)}")
        for name, tensor in central_gradient.items():
            if tensor.shape != specs[name].shape:
                raise ParamsError(
                    f"central gradient: {name!r} has shape {list(tensor.shape)}, the global is "
                    f"{list(specs[name].shape)}"
                )
            if not np.all(np.isfinite(tensor.values)):
                raise ParamsError(f"central gradient: {name!r} has non-finite values")
        return dict(central_gradient)

    def _widened(
        self, batches: TaskBatches, central: SparseGradient
    ) -> tuple[TaskBatches, dict[str, np.ndarray]]:
        """The batches with the central gradient's rows added to the task rows, as many as one call
        takes; and per feature, the central rows left out (none of the examples uses them)."""
        wanted: dict[str, np.ndarray] = {}
        for name, tensor in central.items():
            feature = self._row_sparse.get(name)
            if feature is not None:
                wanted[feature] = np.union1d(wanted.get(feature, np.zeros(0, np.int64)), tensor.rows)
        inside: dict[str, np.ndarray] = {}
        outside: dict[str, np.ndarray] = {}
        for feature, rows in wanted.items():
            extra = np.setdiff1d(rows, batches.used_rows(feature))
            room = self.manifest.max_rows(feature) - batches.num_rows[feature]
            inside[feature], outside[feature] = extra[:room], extra[room:].astype(np.int32)
        return batches.with_rows(inside, self.manifest), outside

    def _central_inputs(self, batches: TaskBatches, central: SparseGradient) -> dict[str, np.ndarray]:
        """`update`'s central gradient inputs: per global, its training shape (the task rows' slots
        for a row-sparse global), zero where the gradient has no row."""
        inputs: dict[str, np.ndarray] = {}
        for spec in self.manifest.global_params:
            value = np.zeros(self.manifest.training_shape(spec.name), np.float32)
            tensor = central.get(spec.name)
            if tensor is not None and spec.row_sparse is None:
                value = tensor.dense()
            elif tensor is not None and spec.row_sparse is not None:
                task_rows = batches.used_rows(spec.row_sparse)
                slots = np.searchsorted(task_rows, tensor.rows)
                present = (slots < task_rows.size) & (
                    task_rows[np.minimum(slots, max(task_rows.size - 1, 0))] == tensor.rows
                )
                value[slots[present]] = tensor.values[present]
            inputs[central_gradient_input(spec.name)] = value
        return inputs

    def gradient(self, batches: TaskBatches) -> BatchGradient:
        """The gradient of the example-weighted mean data loss over `batches` w.r.t. each global at
        the current globals and locals (a server computes the central gradient with it)."""
        if not self.manifest.takes_central_gradient:
            raise ValueError(
                "this model was exported without the 'gradient' signature; export it again with "
                "`python -m model_export`"
            )
        out = self._call(GRADIENT_SIGNATURE, **self._batch_inputs(batches))
        gradient: SparseGradient = {}
        for spec in self.manifest.global_params:
            values = out[f"{spec.name}_gradient"]
            if spec.row_sparse is None:
                gradient[spec.name] = all_rows(values.astype(np.float32, copy=True))
            else:
                rows = batches.used_rows(spec.row_sparse)
                gradient[spec.name] = SparseTensor(
                    spec.shape, rows.copy(), values[: rows.size].astype(np.float32, copy=True)
                )
        return BatchGradient(gradient, float(out["loss"]), float(out["weight_sum"]))

    def update(
        self,
        batches: TaskBatches,
        num_steps: int,
        learning_rate: float,
        *,
        local_learning_rate: float = 0.0,
        l2_global: float = 0.0,
        l2_local: float = 0.0,
        central_gradient: Mapping[str, SparseTensor] | None = None,
        central_gradient_weight: float = 0.0,
    ) -> Update:
        """Train the global parameters on `batches`; returns the dense delta per global tensor
        (gradient transfer as in `update_rows`)."""
        rows = self.update_rows(
            batches,
            num_steps,
            learning_rate,
            local_learning_rate=local_learning_rate,
            l2_global=l2_global,
            l2_local=l2_local,
            central_gradient=central_gradient,
            central_gradient_weight=central_gradient_weight,
        )
        return Update(self.dense_delta(rows), rows.loss, rows.max_abs_change)

    def dense_delta(self, update: RowUpdate) -> Params:
        """`update`'s change as one dense tensor per global (zeros outside the task's rows)."""
        delta: Params = {}
        for spec in self.manifest.global_params:
            if spec.name in update.rows:
                dense = lazy_zeros(spec.shape)
                dense[update.rows[spec.name]] = update.delta[spec.name]
                delta[spec.name] = dense
            else:
                delta[spec.name] = update.delta[spec.name]
        return delta

    def evaluate(self, batches: TaskBatches) -> EvaluationSums:
        out = self._call("evaluate", **self._batch_inputs(batches))
        return EvaluationSums({k: float(out[k]) for k in sorted(out)})

    def _install_globals(self) -> None:
        if not self._variables_current:
            self._call("set_global", **self._globals())
            self._variables_current = True

    def infer(self, exclude: np.ndarray | None = None, context: Mapping[str, Any] | None = None) -> Ranking:
        """A ranking model's scores for this user over the catalog, with the current local and
        global parameters; `exclude` is a bool mask (or indices) of catalog rows to rank last;
        `context`: one value of each of the model's context features (e.g. `{"hour": 21}`), which a
        model with context needs (a ValueError says what is missing or wrong)."""
        if self.manifest.task.kind != "ranking":
            raise ValueError(
                f"infer ranks a catalog; this model's task is {self.manifest.task.kind!r} (use predict)"
            )
        values = self.checked_context(context or {})
        self._install_globals()
        mask = np.zeros(self.manifest.catalog_size, np.float32)
        if exclude is not None:
            mask[exclude] = 1.0
        out = self._call("infer", exclude=mask, **values)
        return Ranking(out["scores"].copy(), out["top_items"].copy(), out["top_scores"].copy())

    def checked_context(self, context: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """One value per context feature, checked against its spec and cast (a ValueError, e.g.
        `InvalidExamples`, names what is missing, unexpected or out of range)."""
        features = self.manifest.context_features
        expected = sorted(f.name for f in features)
        if set(context) != set(expected):
            missing, extra = set(expected) - set(context), set(context) - set(expected)
            raise ValueError(
                (
                    f"this model ranks in a context of {expected}"
                    if expected
                    else "this model ranks without context"
                )
                + (f"; missing {sorted(missing)}" if missing else "")
                + (f"; it takes no {sorted(extra)}" if extra else "")
            )
        try:
            columns = {f.name: np.asarray([context[f.name]]) for f in features}
        except (TypeError, ValueError) as e:
            raise ValueError(f"context values must be numbers or arrays of numbers: {e}") from None
        checked = Examples(columns).validated(features)
        return {f.name: checked[f.name][0] for f in features}

    def predict(self, examples: Examples) -> dict[str, np.ndarray]:
        """A classification or regression model's `infer` outputs for each example (in batches of
        the model's batch size; labels, if given, are ignored)."""
        if self.manifest.task.kind == "ranking":
            raise ValueError("a ranking model ranks its catalog: use infer")
        self._install_globals()
        inputs = self.manifest.input_features
        checked = Examples({f.name: examples[f.name] for f in inputs}).validated(inputs)
        b, n = self.manifest.batch_size, checked.num_examples
        parts: dict[str, list[np.ndarray]] = {}
        for start in range(0, n, b):
            count = min(b, n - start)
            batch = {}
            for f in inputs:
                padded = np.zeros((b, *f.shape), f.dtype)
                padded[:count] = checked[f.name][start : start + count]
                batch[f.name] = padded
            for k, v in self._call("infer", **batch).items():
                parts.setdefault(k, []).append(v[:count].copy())
        return {k: np.concatenate(v) for k, v in parts.items()}
