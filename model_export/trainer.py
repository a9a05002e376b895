"""A user's Keras model as a `tf.Module` with the TFLite training signatures (the generic layout).

Every signature that trains or evaluates takes one call's worth of padded, weighted batches:

- per feature, `[max_batches, batch_size, *shape]`; a feature that indexes a row-sparse table
  arrives as *slots* (int32) into that table's task rows;
- per row-sparse global, its *task rows* `[max_rows, *row_shape]` (the rows the examples use,
  gathered by the runtime, then padding); every dense global whole;
- for a row-sparse feature that also feeds `CatalogAttribute` layers (constants of each catalog
  row, e.g. an item's topic), `<feature>_task_rows [max_rows]`: the catalog values of its task
  rows, at which the signature looks the constants up (so a topic can index a dense table);
- `weights [max_batches, batch_size]` (0 pads) and `num_batches`;
- hyperparameters: `num_steps`, `learning_rate`, `local_learning_rate`, `l2_global`, `l2_local`.

`reconstruct` trains the locals with the globals frozen; `update` trains the globals (and, at
`local_learning_rate` > 0, the locals) and returns each global's change (`<name>_delta`: the
task rows' change for a row-sparse table) and the mean loss; `evaluate` returns weighted sums
(`loss_sum`, `weight_sum`, `<metric>_sum`). For gradient transfer (Augenstein et al.,
Algorithm 4), `gradient` returns the gradient of the example-weighted mean data loss over the
batches w.r.t. each global's training input (`<name>_gradient`, task rows for a row-sparse
table) at the given globals and the current locals, and `update` takes a central gradient per
global (`<name>_central_gradient`, the same shape) that every step adds, times
`central_gradient_weight`, to that global's gradient (weight 0: exactly the plain update).

`model_export.signatures` traces them with these static inputs for the converter.

Whole reconstructions and updates run in one call (a `tf.while_loop` over the batches,
cycling). Why the task rows: a step costs O(batch), not O(table), and a signature that reads a
whole variable keeps its own full-size copy of it (TFLite's READ_VARIABLE copies into the
subgraph's arena), so only `infer` and `get_global` do.

The Keras model runs through `stateless_call` on the values these signatures hold (so
GradientTape differentiates with respect to them). Keras checks that each value has its
variable's shape, so training uses a *twin* of the model (`keras.models.clone_model`) whose
row-sparse tables have `max_rows` rows and share every other layer with the original.

The objective of one batch: the weighted mean of the per-example loss, plus `l2_global` times
the weighted mean over examples of the squared norm of the row-sparse rows each example uses
(so a step stays sparse), plus `l2_local` times the squared norm of the locals (on a batch
that is not all padding).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from contracts.manifest import (
    CENTRAL_GRADIENT_WEIGHT,
    NUM_BATCHES,
    WEIGHTS,
    central_gradient_input,
)
from model_export.local_start import history_mean, start_model, started
from model_export.spec import ExportError, ExportSpec
from model_export.spec_checks import (
    check_locals_not_row_sparse,
    check_model,
    check_names,
    check_task,
    checked_features,
    parameter_names,
    resolve_locals,
)
from model_export.task_rows import (
    attributes_on_row_sparse,
    checked_row_sparse,
    ranking_twin,
    task_constants,
    task_row_features,
    training_twin,
)


class _Hidden:
    """Keeps the Keras models out of the tf.Module's tracked state (their own variables are
    not part of the export; the module's are)."""

    def __init__(self, model: Any, twin: Any, ranking_twin: Any, start: Any = None) -> None:
        self.model, self.twin, self.ranking_twin, self.start = model, twin, ranking_twin, start


class Trainer(tf.Module):  # type: ignore[misc]
    """The exported module; see the module docstring for the signatures."""

    def __init__(self, spec: ExportSpec) -> None:
        super().__init__(name="trainer")
        self.spec = spec
        check_model(spec)
        model = spec.model
        paths = [v.path for v in model.trainable_variables]
        self.names = parameter_names(paths)
        features = checked_features(spec, model)
        # param name -> the feature that indexes it; the features with their tables filled in
        self.row_sparse, self.features = checked_row_sparse(spec, model, features, self.names)
        # Catalog attributes on a row-sparse feature: their constant's path -> that feature.
        self.attributes = attributes_on_row_sparse(model, self.features, self.row_sparse)
        self.task_row_features = task_row_features(self.features, self.attributes)
        local_paths = resolve_locals(spec.local_variables, paths, self.names)
        check_locals_not_row_sparse(local_paths, set(spec.row_sparse))
        self.local_paths = [p for p in paths if p in local_paths]
        self.global_paths = [p for p in paths if p not in local_paths]
        check_names(
            self.features, self.names, [self.names[p] for p in self.global_paths], self.task_row_features
        )
        self.label = next(f for f in self.features if f.role == "label")
        self.inputs = [f for f in self.features if f.role == "input"]
        by_path = {v.path: v for v in model.trainable_variables}
        self.global_vars = {
            self.names[p]: tf.Variable(np.asarray(by_path[p].numpy()), name=self.names[p])
            for p in self.global_paths
        }
        self.local_vars = {
            self.names[p]: tf.Variable(np.asarray(by_path[p].numpy()), name=self.names[p])
            for p in self.local_paths
        }
        self._initial_local = {n: v.numpy().copy() for n, v in self.local_vars.items()}
        self._constants = {v.path: tf.constant(np.asarray(v.numpy())) for v in model.non_trainable_variables}
        check_task(spec.task, self.features, self.row_sparse, list(self.global_vars))
        twin = training_twin(model, spec, self.attributes)
        start = None
        if spec.local_start is not None:
            shapes = {n: tuple(v.shape.as_list()) for n, v in self.local_vars.items()}
            start = start_model(twin, spec.local_start, shapes)
        self._keras = _Hidden(model, twin, ranking_twin(model, spec), start)

    # ---- maths shared by the signatures -------------------------------------------------

    def _task_constants(self, inputs: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        return task_constants(self._constants, self.attributes, inputs)

    def _forward(
        self,
        model: Any,
        values: dict[str, tf.Tensor],
        inputs: dict[str, tf.Tensor],
        constants: dict[str, tf.Tensor] | None = None,
    ) -> tf.Tensor:
        """The model's outputs for `inputs` with the variables at `values` (by manifest name) and
        the constants at `constants` (by path) where given, else as exported."""
        trainable = [values[self.names[v.path]] for v in model.trainable_variables]
        given = constants or {}
        non_trainable = [given.get(v.path, self._constants[v.path]) for v in model.non_trainable_variables]
        outputs, _ = model.stateless_call(trainable, non_trainable, inputs, training=False)
        return outputs

    def _per_example(self, fn: Callable[[Any, Any], Any], label: tf.Tensor, outputs: tf.Tensor) -> tf.Tensor:
        value = tf.convert_to_tensor(fn(label, outputs))
        batch = label.shape[0]
        if value.shape != (batch,):
            raise ExportError(
                f"loss and metrics must return one value per example, shape [{batch}]; got {value.shape} "
                f"for labels {label.shape} and model outputs {outputs.shape}"
            )
        return tf.cast(value, tf.float32)

    def _batch_objective(
        self,
        values: dict[str, tf.Tensor],
        batch: dict[str, tf.Tensor],
        weights: tf.Tensor,
        l2_global: tf.Tensor,
        l2_local: tf.Tensor,
        constants: dict[str, tf.Tensor],
    ) -> tuple[tf.Tensor, tf.Tensor]:
        """(objective with L2, data loss) of one padded batch; both 0 for an all-padding batch."""
        total = tf.reduce_sum(weights)
        outputs = self._forward(
            self._keras.twin, values, {f.name: batch[f.name] for f in self.inputs}, constants
        )
        losses = self._per_example(self.spec.loss, batch[self.label.name], outputs)
        data_loss = tf.math.divide_no_nan(tf.reduce_sum(weights * losses), total)
        objective = data_loss
        if self.row_sparse:
            squares = []
            for name, feature in self.row_sparse.items():
                rows = tf.gather(values[name], batch[feature])
                squares.append(tf.reduce_sum(tf.square(rows), axis=list(range(1, rows.shape.rank))))
            row_sq = tf.add_n(squares) if len(squares) > 1 else squares[0]
            objective += l2_global * tf.math.divide_no_nan(tf.reduce_sum(weights * row_sq), total)
        if self.local_vars:
            local_sq = tf.add_n([tf.reduce_sum(tf.square(values[n])) for n in self.local_vars])
            objective += tf.cast(total > 0.0, tf.float32) * l2_local * local_sq
        return objective, data_loss

    def _clamp_batches(self, num_batches: tf.Tensor) -> tf.Tensor:
        # tf.where, not clip_by_value: the converter turns an int clamp to [0, 6] into a
        # Relu6 that TFLite has no int32 builtin for.
        upper = tf.constant(self.spec.max_batches)
        num_batches = tf.where(num_batches > upper, upper, num_batches)
        return tf.where(num_batches < 0, tf.zeros_like(num_batches), num_batches)

    def _loop_bounds(self, num_batches: tf.Tensor, num_steps: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """Clamp caller-supplied counts so a bad call cannot index outside the padded arrays."""
        num_batches = self._clamp_batches(num_batches)
        num_steps = tf.where(num_batches > 0, tf.maximum(num_steps, 0), 0)
        return tf.maximum(num_batches, 1), num_steps

    def _train(
        self,
        inputs: dict[str, tf.Tensor],
        trained: list[str],
        rates: list[tf.Tensor],
        frozen: dict[str, tf.Tensor],
        start: list[tf.Tensor],
        l2_global: tf.Tensor,
        l2_local: tf.Tensor,
        added: list[tf.Tensor | None] | None = None,
    ) -> tuple[tf.Tensor, list[tf.Tensor]]:
        """`num_steps` SGD steps on the `trained` values over the batches, cycling; `added[i]`
        (if given) is added to the gradient of `trained[i]` at every step. Returns (mean loss,
        final values)."""
        added = added or [None] * len(trained)
        modulus, num_steps = self._loop_bounds(inputs[NUM_BATCHES], inputs["num_steps"])
        features = [f.name for f in self.features]
        constants = self._task_constants(inputs)

        def body(step: tf.Tensor, loss_sum: tf.Tensor, *current: tf.Tensor) -> Any:
            b = tf.math.floormod(step, modulus)
            batch = {name: inputs[name][b] for name in features}
            with tf.GradientTape() as tape:
                tape.watch(current)
                values = {**frozen, **dict(zip(trained, current, strict=True))}
                objective, data_loss = self._batch_objective(
                    values, batch, inputs[WEIGHTS][b], l2_global, l2_local, constants
                )
            grads = [
                g if a is None else a if g is None else tf.convert_to_tensor(g) + a
                for g, a in zip(tape.gradient(objective, list(current)), added, strict=True)
            ]
            new = [
                v if g is None else v - r * tf.convert_to_tensor(g)
                for v, r, g in zip(current, rates, grads, strict=True)
            ]
            return (step + 1, loss_sum + data_loss, *new)

        _, loss_sum, *final = tf.while_loop(
            lambda step, *_: step < num_steps, body, (tf.constant(0), tf.constant(0.0), *start)
        )
        return tf.math.divide_no_nan(loss_sum, tf.cast(num_steps, tf.float32)), final

    # ---- signatures ----------------------------------------------------------------------

    def _local_start(
        self, inputs: dict[str, tf.Tensor], current: dict[str, tf.Tensor]
    ) -> dict[str, tf.Tensor]:
        """The locals `reconstruct` starts from: `current`, with `spec.local_start`'s local at
        its scaled history mean (`model_export.local_start`) when the spec asks for one."""
        start = self.spec.local_start
        if start is None:
            return current
        weights, flat = self._flat(inputs)
        values = {**{n: inputs[n] for n in self.global_vars}, **current}
        vectors = self._forward(
            self._keras.start,
            values,
            {f.name: flat[f.name] for f in self.inputs},
            self._task_constants(inputs),
        )
        mean, total = history_mean(vectors, weights, flat[self.label.name], start.contrast)
        return {**current, start.local: started(current[start.local], mean, total, float(start.scale))}

    def reconstruct(self, **inputs: tf.Tensor) -> dict[str, tf.Tensor]:
        """`num_steps` SGD steps on the local parameters, globals frozen, from their current values
        (or, with `spec.local_start`, from the support's history mean)."""
        names = list(self.local_vars)
        frozen = {n: inputs[n] for n in self.global_vars}
        begin = self._local_start(inputs, {n: self.local_vars[n].read_value() for n in names})
        loss, final = self._train(
            inputs,
            names,
            [inputs["learning_rate"]] * len(names),
            frozen,
            [begin[n] for n in names],
            tf.constant(0.0),
            inputs["l2_local"],
        )
        for n, v in zip(names, final, strict=True):
            self.local_vars[n].assign(v)
        return {"loss": loss}

    def update(self, **inputs: tf.Tensor) -> dict[str, tf.Tensor]:
        """`num_steps` SGD steps on the globals (and the locals at `local_learning_rate` > 0);
        returns the change of each global given. The global variables are not touched: the
        device's copy of the model is the server's."""
        global_names, local_names = list(self.global_vars), list(self.local_vars)
        start_global = [inputs[n] for n in global_names]
        rates = [inputs["learning_rate"]] * len(global_names) + [inputs["local_learning_rate"]] * len(
            local_names
        )
        weight = inputs[CENTRAL_GRADIENT_WEIGHT]
        central = [weight * inputs[central_gradient_input(n)] for n in global_names]
        loss, final = self._train(
            inputs,
            global_names + local_names,
            rates,
            {},
            start_global + [self.local_vars[n].read_value() for n in local_names],
            inputs["l2_global"],
            inputs["l2_local"],
            [*central, *[None] * len(local_names)],
        )
        outputs = {"loss": loss}
        for n, begin, end in zip(global_names, start_global, final, strict=False):
            outputs[f"{n}_delta"] = end - begin
        for n, v in zip(local_names, final[len(global_names) :], strict=True):
            self.local_vars[n].assign(v)
        return outputs

    def _flat(self, inputs: dict[str, tf.Tensor]) -> tuple[tf.Tensor, dict[str, tf.Tensor]]:
        """(weights, features) of the first `num_batches` batches as one batch of `max_batches *
        batch_size` examples (the rest weighted 0): evaluation does not step between batches."""
        s, b = self.spec.max_batches, self.spec.batch_size
        in_range = tf.cast(tf.range(s) < self._clamp_batches(inputs[NUM_BATCHES]), tf.float32)[:, None]
        weights = tf.reshape(inputs[WEIGHTS] * in_range, [s * b])
        return weights, {f.name: tf.reshape(inputs[f.name], [s * b, *f.shape]) for f in self.features}

    def evaluate(self, **inputs: tf.Tensor) -> dict[str, tf.Tensor]:
        """Weighted sums over the first `num_batches` batches, so that devices' metrics add up."""
        weights, flat = self._flat(inputs)
        values = {
            **{n: inputs[n] for n in self.global_vars},
            **{n: v.read_value() for n, v in self.local_vars.items()},
        }
        outputs = self._forward(
            self._keras.twin,
            values,
            {f.name: flat[f.name] for f in self.inputs},
            self._task_constants(inputs),
        )
        label = flat[self.label.name]
        sums = {
            "loss_sum": tf.reduce_sum(weights * self._per_example(self.spec.loss, label, outputs)),
            "weight_sum": tf.reduce_sum(weights),
        }
        for metric in self.spec.metrics:
            sums[f"{metric.name}_sum"] = tf.reduce_sum(
                weights * self._per_example(metric.per_example, label, outputs)
            )
        return sums

    def gradient(self, **inputs: tf.Tensor) -> dict[str, tf.Tensor]:
        """The gradient of the example-weighted mean data loss (no L2) over the first
        `num_batches` batches w.r.t. each global's training input, at the given globals and the
        current locals; with the mean loss and the weight sum, so that calls' gradients average."""
        weights, flat = self._flat(inputs)
        names = list(self.global_vars)
        given = [inputs[n] for n in names]
        with tf.GradientTape() as tape:
            tape.watch(given)
            values = {
                **dict(zip(names, given, strict=True)),
                **{n: v.read_value() for n, v in self.local_vars.items()},
            }
            outputs = self._forward(
                self._keras.twin,
                values,
                {f.name: flat[f.name] for f in self.inputs},
                self._task_constants(inputs),
            )
            losses = self._per_example(self.spec.loss, flat[self.label.name], outputs)
            total = tf.reduce_sum(weights)
            loss = tf.math.divide_no_nan(tf.reduce_sum(weights * losses), total)
        out = {"loss": loss, "weight_sum": total}
        for n, v, g in zip(names, given, tape.gradient(loss, given), strict=True):
            out[f"{n}_gradient"] = tf.zeros_like(v) if g is None else _static(tf.convert_to_tensor(g))
        return out

    def _infer_scores(self, inputs: dict[str, tf.Tensor], model: Any) -> tf.Tensor:
        values = {
            **{n: v.read_value() for n, v in self.global_vars.items()},
            **{n: v.read_value() for n, v in self.local_vars.items()},
        }
        outputs = self._forward(model, values, inputs)
        if self.spec.infer_scores is not None:
            return tf.convert_to_tensor(self.spec.infer_scores(inputs, outputs))
        if outputs.shape.rank >= 2 and outputs.shape[-1] == 1 and self.spec.task.kind != "classification":
            outputs = tf.squeeze(outputs, -1)
        return outputs

    def infer_ranking(self, exclude: tf.Tensor, **context: tf.Tensor) -> dict[str, tf.Tensor]:
        """Scores for every catalog row in this `context` (one value per context feature, the same
        for every row) and the `top_k` best; rows with `exclude` > 0 rank last."""
        catalog = self.spec.task.catalog_feature
        assert catalog is not None
        n = exclude.shape[0]
        inputs = {catalog: tf.range(n, dtype=tf.int32)}
        for name, value in context.items():
            inputs[name] = tf.broadcast_to(value[None], [n, *value.shape])
        scores = self._infer_scores(inputs, self._keras.ranking_twin)
        ranked = tf.where(exclude > 0.0, tf.fill(tf.shape(scores), -3.0e38), scores)
        top = tf.math.top_k(ranked, k=self.spec.task.top_k, sorted=True)
        return {"scores": scores, "top_items": top.indices, "top_scores": top.values}

    def infer_batch(self, **inputs: tf.Tensor) -> dict[str, tf.Tensor]:
        """Classification: the `top_k` classes per example; regression: the prediction per example."""
        scores = self._infer_scores(inputs, self._keras.model)
        if self.spec.task.kind == "classification":
            top = tf.math.top_k(scores, k=self.spec.task.top_k, sorted=True)
            return {"top_classes": top.indices, "top_scores": top.values}
        return {"predictions": tf.cast(scores, tf.float32)}

    def get_global(self) -> dict[str, tf.Tensor]:
        return {k: v.read_value() for k, v in self.global_vars.items()}

    def set_global(self, **values: tf.Tensor) -> dict[str, tf.Tensor]:
        for k, v in values.items():
            self.global_vars[k].assign(v)
        return {"ok": tf.constant(1)}

    def get_local(self) -> dict[str, tf.Tensor]:
        return {k: v.read_value() for k, v in self.local_vars.items()}

    def set_local(self, **values: tf.Tensor) -> dict[str, tf.Tensor]:
        for k, v in values.items():
            self.local_vars[k].assign(v)
        return {"ok": tf.constant(1)}

    def reset_local(self) -> dict[str, tf.Tensor]:
        """Local parameters back to their exported initial values, before a reconstruction."""
        for k, v in self.local_vars.items():
            v.assign(tf.constant(self._initial_local[k]))
        return {"ok": tf.constant(1)}


def _static(value: tf.Tensor) -> tf.Tensor:
    """`value` through an op that allocates its output: a gathered row's gradient is an
    UNSORTED_SEGMENT_SUM, whose output TFLite makes a dynamic tensor, and LiteRT's CompiledModel
    cannot bind a signature's output buffer to one (the signature fails to run)."""
    return tf.where(tf.math.is_nan(value), value, value)
