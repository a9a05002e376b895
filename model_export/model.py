"""The FedRecon matrix-factorization model as a `tf.Module` with TFLite training signatures.

Parameters are split as in Federated Reconstruction:

- global: `item_embeddings` [num_items, dim], optional `item_bias` [num_items] and
  `global_mean` [1], trained federatedly;
- local: `user_embedding` [dim], optional `user_bias` [1], reconstructed on the device.

Every signature that trains or evaluates takes a *task batch*: the task's rows of the
per-item globals (`item_embeddings` [max_examples, dim], `item_bias` [max_examples]; the
rows of the task's distinct items, then padding), `global_mean`, and per example its
`slots` [max_batches, batch_size] into those rows, with `labels` and `weights` of the same
shape (weight 0 pads). Two reasons:
- a step costs O(batch), not O(catalog): a dense step over a 20,000 x 50 matrix is
  ~2.5 ms here, an order of magnitude over a client task's budget;
- a signature that reads the whole item variable keeps its own full-size copy (TFLite's
  READ_VARIABLE copies into the subgraph's arena), so only `infer` and `get_global` do.

Only builtin TFLite ops are used; shapes are static (a dynamic batch pulls in a Flex op).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from model_export.config import Feedback, ModelConfig

# Names shared with the manifest and the device runtime.
ITEM_EMBEDDINGS = "item_embeddings"
ITEM_BIAS = "item_bias"
GLOBAL_MEAN = "global_mean"
USER_EMBEDDING = "user_embedding"
USER_BIAS = "user_bias"


class FedReconModel(tf.Module):  # type: ignore[misc]
    """Matrix factorization with global item parameters and local user parameters."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(name="fedrecon")
        self.config = config
        n, d = config.num_items, config.embedding_dim
        init = tf.random.stateless_normal([n, d], seed=[config.seed, 0], stddev=config.init_stddev)
        self.global_vars: dict[str, tf.Variable] = {
            ITEM_EMBEDDINGS: tf.Variable(init, name=ITEM_EMBEDDINGS),
        }
        if config.item_bias:
            self.global_vars[ITEM_BIAS] = tf.Variable(tf.zeros([n]), name=ITEM_BIAS)
        if config.global_mean:
            self.global_vars[GLOBAL_MEAN] = tf.Variable(
                tf.fill([1], config.global_mean_init), name=GLOBAL_MEAN
            )
        self.local_vars: dict[str, tf.Variable] = {
            USER_EMBEDDING: tf.Variable(tf.zeros([d]), name=USER_EMBEDDING),
        }
        if config.user_bias:
            self.local_vars[USER_BIAS] = tf.Variable(tf.zeros([1]), name=USER_BIAS)

    # ---- maths shared by the signatures -------------------------------------------------

    def _split_task_globals(
        self, rows: dict[str, tf.Tensor]
    ) -> tuple[dict[str, tf.Tensor], tf.Tensor | None]:
        """(per-item tables, global mean or None) from a task's global inputs."""
        tables = {k: v for k, v in rows.items() if k in (ITEM_EMBEDDINGS, ITEM_BIAS)}
        return tables, rows.get(GLOBAL_MEAN)

    def _scores(
        self,
        tables: dict[str, tf.Tensor],
        local: dict[str, tf.Tensor],
        global_mean: tf.Tensor | None,
        slots: tf.Tensor,
    ) -> tf.Tensor:
        """Predicted rating (explicit) or logit (implicit) for the examples at `slots`."""
        rows = tf.gather(tables[ITEM_EMBEDDINGS], slots)
        scores = tf.reduce_sum(rows * local[USER_EMBEDDING], axis=-1)
        if ITEM_BIAS in tables:
            scores += tf.gather(tables[ITEM_BIAS], slots)
        if USER_BIAS in local:
            scores += local[USER_BIAS]
        if global_mean is not None:
            scores += global_mean
        return scores

    def _example_losses(self, scores: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        if self.config.feedback is Feedback.IMPLICIT:
            return tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=scores)
        error = scores - labels
        delta = self.config.huber_delta
        if delta > 0.0:
            # Huber, scaled to match the squared error (value and slope) at +-delta, so the
            # learning rates mean the same as without it.
            abs_error = tf.abs(error)
            return tf.where(abs_error <= delta, tf.square(error), 2.0 * delta * abs_error - delta * delta)
        return tf.square(error)

    def _batch_objective(
        self,
        tables: dict[str, tf.Tensor],
        local: dict[str, tf.Tensor],
        global_mean: tf.Tensor | None,
        slots: tf.Tensor,
        labels: tf.Tensor,
        weights: tf.Tensor,
        l2_global: tf.Tensor,
        l2_local: tf.Tensor,
    ) -> tuple[tf.Tensor, tf.Tensor]:
        """(objective with L2, data loss) of one padded batch; both 0 for an all-padding batch.

        L2 touches only the rows the batch uses, so that a step stays sparse.
        """
        total_weight = tf.reduce_sum(weights)
        scores = self._scores(tables, local, global_mean, slots)
        data_loss = tf.math.divide_no_nan(
            tf.reduce_sum(weights * self._example_losses(scores, labels)), total_weight
        )
        item_sq = tf.reduce_sum(tf.square(tf.gather(tables[ITEM_EMBEDDINGS], slots)), axis=-1)
        if ITEM_BIAS in tables:
            item_sq += tf.square(tf.gather(tables[ITEM_BIAS], slots))
        item_reg = tf.math.divide_no_nan(tf.reduce_sum(weights * item_sq), total_weight)
        local_sq = tf.add_n([tf.reduce_sum(tf.square(v)) for v in local.values()])
        nonempty = tf.cast(total_weight > 0.0, tf.float32)
        objective = data_loss + l2_global * item_reg + nonempty * l2_local * local_sq
        return objective, data_loss

    def _clamp_batches(self, num_batches: tf.Tensor) -> tf.Tensor:
        # tf.where, not clip_by_value: the converter turns an int clamp to [0, 6] into a
        # Relu6 that TFLite has no int32 builtin for.
        upper = tf.constant(self.config.max_batches)
        num_batches = tf.where(num_batches > upper, upper, num_batches)
        return tf.where(num_batches < 0, tf.zeros_like(num_batches), num_batches)

    def _loop_bounds(self, num_batches: tf.Tensor, num_steps: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """Clamp caller-supplied counts so a bad call cannot index outside the padded arrays."""
        num_batches = self._clamp_batches(num_batches)
        num_steps = tf.where(num_batches > 0, tf.maximum(num_steps, 0), 0)
        return tf.maximum(num_batches, 1), num_steps

    # ---- signatures ----------------------------------------------------------------------

    def task_spec(self) -> dict[str, tf.TensorSpec]:
        """Inputs every training/evaluation signature takes: the task's global rows and batches."""
        c = self.config
        rows: dict[str, tf.TensorSpec] = {
            k: tf.TensorSpec([c.max_examples, *v.shape[1:]], v.dtype, name=k)
            for k, v in self.global_vars.items()
            if k != GLOBAL_MEAN
        }
        if GLOBAL_MEAN in self.global_vars:
            rows[GLOBAL_MEAN] = tf.TensorSpec([1], tf.float32, name=GLOBAL_MEAN)
        batches = [
            tf.TensorSpec([c.max_batches, c.batch_size], tf.int32, name="slots"),
            tf.TensorSpec([c.max_batches, c.batch_size], tf.float32, name="labels"),
            tf.TensorSpec([c.max_batches, c.batch_size], tf.float32, name="weights"),
            tf.TensorSpec([], tf.int32, name="num_batches"),
        ]
        return {**rows, **{spec.name: spec for spec in batches}}

    def reconstruct(
        self,
        slots: tf.Tensor,
        labels: tf.Tensor,
        weights: tf.Tensor,
        num_batches: tf.Tensor,
        num_steps: tf.Tensor,
        learning_rate: tf.Tensor,
        l2_local: tf.Tensor,
        **task_globals: tf.Tensor,
    ) -> dict[str, tf.Tensor]:
        """`num_steps` SGD steps on the local parameters over the batches, cycling; globals frozen."""
        modulus, num_steps = self._loop_bounds(num_batches, num_steps)
        tables, global_mean = self._split_task_globals(task_globals)
        names = list(self.local_vars)
        start = [self.local_vars[k].read_value() for k in names]
        zero = tf.constant(0.0)

        def body(step: tf.Tensor, loss_sum: tf.Tensor, *values: tf.Tensor) -> Any:
            b = tf.math.floormod(step, modulus)
            local = dict(zip(names, values, strict=True))
            with tf.GradientTape() as tape:
                tape.watch(values)
                objective, data_loss = self._batch_objective(
                    tables, local, global_mean, slots[b], labels[b], weights[b], zero, l2_local
                )
            grads = tape.gradient(objective, list(values))
            new = [v - learning_rate * g for v, g in zip(values, grads, strict=True)]
            return (step + 1, loss_sum + data_loss, *new)

        _, loss_sum, *final = tf.while_loop(
            lambda step, *_: step < num_steps, body, (tf.constant(0), zero, *start)
        )
        for k, v in zip(names, final, strict=True):
            self.local_vars[k].assign(v)
        return {"loss": tf.math.divide_no_nan(loss_sum, tf.cast(num_steps, tf.float32))}

    def update(
        self,
        slots: tf.Tensor,
        labels: tf.Tensor,
        weights: tf.Tensor,
        num_batches: tf.Tensor,
        num_steps: tf.Tensor,
        learning_rate: tf.Tensor,
        local_learning_rate: tf.Tensor,
        l2_global: tf.Tensor,
        l2_local: tf.Tensor,
        **task_globals: tf.Tensor,
    ) -> dict[str, tf.Tensor]:
        """`num_steps` SGD steps on the global parameters; returns their change per task slot.

        Global variables are not touched: the device's copy of the model is the server's,
        and the result of the task is the delta of the rows it was given. With `local_learning_rate` > 0
        the local parameters train jointly (FURL, or FedAvg's shared user vector) and are
        written back; with 0 they stay frozen, as FedRecon's update step requires.
        """
        modulus, num_steps = self._loop_bounds(num_batches, num_steps)
        start_tables, global_mean = self._split_task_globals(task_globals)
        table_names = list(start_tables)
        local_names = list(self.local_vars)
        has_mean = global_mean is not None
        start_mean = [global_mean] if global_mean is not None else []
        start_local = [self.local_vars[k].read_value() for k in local_names]
        n_tables, n_mean = len(table_names), len(start_mean)

        def body(step: tf.Tensor, loss_sum: tf.Tensor, *values: tf.Tensor) -> Any:
            b = tf.math.floormod(step, modulus)
            tables = dict(zip(table_names, values[:n_tables], strict=True))
            mean = values[n_tables] if has_mean else None
            local = dict(zip(local_names, values[n_tables + n_mean :], strict=True))
            with tf.GradientTape() as tape:
                tape.watch(values)
                objective, data_loss = self._batch_objective(
                    tables, local, mean, slots[b], labels[b], weights[b], l2_global, l2_local
                )
            grads = tape.gradient(objective, list(values))
            rates = [learning_rate] * (n_tables + n_mean) + [local_learning_rate] * len(local)
            new = [v - r * tf.convert_to_tensor(g) for v, r, g in zip(values, rates, grads, strict=True)]
            return (step + 1, loss_sum + data_loss, *new)

        _, loss_sum, *final = tf.while_loop(
            lambda step, *_: step < num_steps,
            body,
            (tf.constant(0), tf.constant(0.0), *start_tables.values(), *start_mean, *start_local),
        )
        outputs = {"loss": tf.math.divide_no_nan(loss_sum, tf.cast(num_steps, tf.float32))}
        for k, start, end in zip(table_names, start_tables.values(), final[:n_tables], strict=True):
            outputs[f"{k}_delta"] = end - start
        if has_mean:
            outputs[f"{GLOBAL_MEAN}_delta"] = final[n_tables] - start_mean[0]
        for k, v in zip(local_names, final[n_tables + n_mean :], strict=True):
            self.local_vars[k].assign(v)
        return outputs

    def evaluate(
        self,
        slots: tf.Tensor,
        labels: tf.Tensor,
        weights: tf.Tensor,
        num_batches: tf.Tensor,
        **task_globals: tf.Tensor,
    ) -> dict[str, tf.Tensor]:
        """Weighted sums over the first `num_batches` batches, so that devices' metrics add up."""
        c = self.config
        tables, global_mean = self._split_task_globals(task_globals)
        local = {k: v.read_value() for k, v in self.local_vars.items()}
        clamped = self._clamp_batches(num_batches)
        in_range = tf.cast(tf.range(c.max_batches) < clamped, tf.float32)[:, None]
        weights = weights * in_range
        scores = self._scores(tables, local, global_mean, slots)
        losses = self._example_losses(scores, labels)
        if c.feedback is Feedback.EXPLICIT:
            # Within 0.5 inclusive, as TFF's RatingAccuracy: the prediction rounds to the rating.
            correct = tf.cast(tf.abs(scores - labels) <= 0.5, tf.float32)
            squared_error = tf.square(scores - labels)  # RMSE, whatever the training loss
        else:
            correct = tf.cast(tf.cast(scores > 0.0, tf.float32) == labels, tf.float32)
            squared_error = tf.square(tf.sigmoid(scores) - labels)
        return {
            "loss_sum": tf.reduce_sum(weights * losses),
            "squared_error_sum": tf.reduce_sum(weights * squared_error),
            "correct_sum": tf.reduce_sum(weights * correct),
            "weight_sum": tf.reduce_sum(weights),
        }

    def infer(self, exclude: tf.Tensor) -> dict[str, tf.Tensor]:
        """Scores for every item and the `top_k` best; items with `exclude` > 0 rank last."""
        local = {k: v.read_value() for k, v in self.local_vars.items()}
        items = self.global_vars[ITEM_EMBEDDINGS].read_value()
        scores = tf.linalg.matvec(items, local[USER_EMBEDDING])
        if ITEM_BIAS in self.global_vars:
            scores += self.global_vars[ITEM_BIAS].read_value()
        if USER_BIAS in local:
            scores += local[USER_BIAS]
        if GLOBAL_MEAN in self.global_vars:
            scores += self.global_vars[GLOBAL_MEAN].read_value()
        ranked = tf.where(exclude > 0.0, tf.fill(tf.shape(scores), -3.0e38), scores)
        top = tf.math.top_k(ranked, k=self.config.top_k, sorted=True)
        return {"scores": scores, "top_items": top.indices, "top_scores": top.values}

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
        """Local parameters back to their fresh state (zeros), before a reconstruction."""
        for v in self.local_vars.values():
            v.assign(tf.zeros_like(v))
        return {"ok": tf.constant(1)}

    # ---- the concrete functions the converter sees --------------------------------------

    def signatures(self) -> dict[str, Any]:
        """Named concrete functions with static input signatures, ready for conversion."""
        scalar_i = tf.TensorSpec([], tf.int32, name="num_steps")

        def scalar_f(name: str) -> tf.TensorSpec:
            return tf.TensorSpec([], tf.float32, name=name)

        task = self.task_spec()
        global_specs = {k: tf.TensorSpec(v.shape, v.dtype, name=k) for k, v in self.global_vars.items()}
        local_specs = {k: tf.TensorSpec(v.shape, v.dtype, name=k) for k, v in self.local_vars.items()}

        def keyword_fn(method: Any, specs: dict[str, tf.TensorSpec]) -> Any:
            # TFLite signature inputs are named after keyword arguments.
            return tf.function(lambda **kw: method(**kw)).get_concrete_function(**specs)

        hyper = {"num_steps": scalar_i, "learning_rate": scalar_f("learning_rate")}
        return {
            "reconstruct": keyword_fn(self.reconstruct, {**task, **hyper, "l2_local": scalar_f("l2_local")}),
            "update": keyword_fn(
                self.update,
                {
                    **task,
                    **hyper,
                    "local_learning_rate": scalar_f("local_learning_rate"),
                    "l2_global": scalar_f("l2_global"),
                    "l2_local": scalar_f("l2_local"),
                },
            ),
            "evaluate": keyword_fn(self.evaluate, task),
            "infer": tf.function(self.infer).get_concrete_function(
                tf.TensorSpec([self.config.num_items], tf.float32, name="exclude")
            ),
            "get_global": tf.function(self.get_global).get_concrete_function(),
            "set_global": keyword_fn(self.set_global, global_specs),
            "get_local": tf.function(self.get_local).get_concrete_function(),
            "set_local": keyword_fn(self.set_local, local_specs),
            "reset_local": tf.function(self.reset_local).get_concrete_function(),
        }
