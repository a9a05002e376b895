"""The concrete functions the converter sees: each signature of a `Trainer` traced with static
input specs (the generic layout's inputs, `model_export.trainer`'s docstring), named after the
signature's keyword arguments."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import tensorflow as tf

from contracts.manifest import (
    CENTRAL_GRADIENT_WEIGHT,
    GRADIENT_SIGNATURE,
    HYPERPARAMETERS,
    NUM_BATCHES,
    WEIGHTS,
    central_gradient_input,
    task_rows_input,
)

if TYPE_CHECKING:
    from model_export.trainer import Trainer


def training_specs(trainer: Trainer, signature: str) -> dict[str, tf.TensorSpec]:
    """The generic layout's inputs of a training/evaluation signature."""
    s, b = trainer.spec.max_batches, trainer.spec.batch_size
    sparse_features = set(trainer.row_sparse.values())
    specs = {
        f.name: tf.TensorSpec(
            [s, b, *f.shape], tf.int32 if f.name in sparse_features else f.dtype, name=f.name
        )
        for f in trainer.features
    }
    for name, var in trainer.global_vars.items():
        shape = [s * b, *var.shape[1:]] if name in trainer.row_sparse else var.shape
        specs[name] = tf.TensorSpec(shape, var.dtype, name=name)
    for feature in trainer.task_row_features:
        key = task_rows_input(feature)
        specs[key] = tf.TensorSpec([s * b], tf.int32, name=key)
    specs[WEIGHTS] = tf.TensorSpec([s, b], tf.float32, name=WEIGHTS)
    specs[NUM_BATCHES] = tf.TensorSpec([], tf.int32, name=NUM_BATCHES)
    for h in HYPERPARAMETERS[signature]:
        specs[h] = tf.TensorSpec([], tf.int32 if h == "num_steps" else tf.float32, name=h)
    if signature == "update":
        for name in trainer.global_vars:
            key = central_gradient_input(name)
            specs[key] = tf.TensorSpec(specs[name].shape, tf.float32, name=key)
        specs[CENTRAL_GRADIENT_WEIGHT] = tf.TensorSpec([], tf.float32, name=CENTRAL_GRADIENT_WEIGHT)
    return specs


def concrete_signatures(trainer: Trainer) -> dict[str, Any]:
    """Named concrete functions with static input signatures, ready for conversion."""

    def keyword_fn(method: Any, specs: dict[str, tf.TensorSpec]) -> Any:
        # TFLite signature inputs are named after keyword arguments.
        return tf.function(lambda **kw: method(**kw)).get_concrete_function(**specs)

    global_specs = {k: tf.TensorSpec(v.shape, v.dtype, name=k) for k, v in trainer.global_vars.items()}
    local_specs = {k: tf.TensorSpec(v.shape, v.dtype, name=k) for k, v in trainer.local_vars.items()}
    if trainer.spec.task.kind == "ranking":
        catalog = next(f for f in trainer.features if f.name == trainer.spec.task.catalog_feature)
        exclude = tf.TensorSpec([catalog.num_values], tf.float32, name="exclude")
        context = [f for f in trainer.inputs if f.name != catalog.name]
        if context:
            infer = keyword_fn(
                trainer.infer_ranking,
                {
                    "exclude": exclude,
                    **{f.name: tf.TensorSpec(f.shape, f.dtype, name=f.name) for f in context},
                },
            )
        else:
            infer = tf.function(trainer.infer_ranking).get_concrete_function(exclude)
    else:
        b = trainer.spec.batch_size
        infer = keyword_fn(
            trainer.infer_batch,
            {f.name: tf.TensorSpec([b, *f.shape], f.dtype, name=f.name) for f in trainer.inputs},
        )
    signatures = {
        "update": keyword_fn(trainer.update, training_specs(trainer, "update")),
        "evaluate": keyword_fn(trainer.evaluate, training_specs(trainer, "evaluate")),
        GRADIENT_SIGNATURE: keyword_fn(trainer.gradient, training_specs(trainer, "evaluate")),
        "infer": infer,
        "get_global": tf.function(trainer.get_global).get_concrete_function(),
        "set_global": keyword_fn(trainer.set_global, global_specs),
    }
    if trainer.local_vars:
        # Without local variables there is nothing to reconstruct, read or reset (and a
        # signature without outputs would not even convert): plain FedAvg on the model.
        signatures |= {
            "reconstruct": keyword_fn(trainer.reconstruct, training_specs(trainer, "reconstruct")),
            "get_local": tf.function(trainer.get_local).get_concrete_function(),
            "set_local": keyword_fn(trainer.set_local, local_specs),
            "reset_local": tf.function(trainer.reset_local).get_concrete_function(),
        }
    return signatures
