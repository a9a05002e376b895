"""Next-word prediction (NWP): a small Keras LSTM whose out-of-vocabulary (OOV) rows can be local.

The Federated Reconstruction paper's second experiment: the vocabulary's input and output
embeddings are global, and the `num_oov_buckets` rows that OOV words hash to are local, so
each device learns its own rare words (names, places) and they never leave it.

Token ids (as `android_sim.shakespeare` makes them): `[0, num_global_tokens)` are the global
tokens, id 0 being padding; `[num_global_tokens, num_tokens)` are the OOV buckets. The model:

    tokens [B, L] int32
      -> rows of `embedding/global_embeddings` [G, E] or `embedding/oov_embeddings` [n, E]
      -> LSTM(lstm_units, unroll=True) -> Dense(embedding_dim) projection, linear
      -> logits [B, L, G + n] = concat(`global_output` Dense [E -> G], `oov_output` Dense [E -> n])

The OOV rows live in their own variables (`OOV_VARIABLES`) so that an export can declare them
local. Only TFLite builtin ops: tanh/sigmoid (no ReLU, whose gradient is Flex), no slicing
(whose gradient is Flex), `tf.where` in place of an integer clamp (a clamp becomes an int32
RELU6 that TFLite lacks), and the LSTM unrolled (`tf.unstack`, no while loop).

Exported for federated training by `build_spec(config)`, or from the command line with the sizes
as `build`'s keyword arguments::

    python -m model_export --model model_export.models.next_word:build \
        --model-arg num_global_tokens=1003 --model-arg num_oov_buckets=100 --out DIR
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import keras
import tensorflow as tf

from contracts.features import FeatureSpec
from contracts.manifest import TaskSpec
from model_export.spec import ExportSpec, Metric

PAD = 0
EMBEDDING = "embedding"
GLOBAL_EMBEDDINGS = "global_embeddings"
OOV_EMBEDDINGS = "oov_embeddings"
GLOBAL_OUTPUT = "global_output"
OOV_OUTPUT = "oov_output"
# Variable paths of the OOV rows: local in FedRecon, global (shared) in FedAvg.
OOV_VARIABLES = (f"{EMBEDDING}/{OOV_EMBEDDINGS}", f"{OOV_OUTPUT}/kernel", f"{OOV_OUTPUT}/bias")


@dataclass(frozen=True)
class NextWordConfig:
    """Shapes of the model.

    The defaults train a round in seconds on two CPU cores: the output layer dominates the cost
    (B x L x embedding_dim x (G + n) multiply-adds each way), hence a 32-wide projection before
    it; 64 LSTM units are enough for a corpus of 200K words; 20 tokens cover 90% of Shakespeare's
    sentences in at most two windows (as TFF's Stack Overflow NWP task uses 20).
    """

    num_global_tokens: int  # the vocabulary's words plus the special tokens (PAD first)
    num_oov_buckets: int = 1
    oov_local: bool = True  # FedRecon; False: the OOV rows are global too (FedAvg)
    seq_len: int = 20
    embedding_dim: int = 32
    lstm_units: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_oov_buckets", "seq_len", "embedding_dim", "lstm_units"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} is {getattr(self, name)}; expected at least 1")
        if self.num_global_tokens < 2:
            raise ValueError(
                f"num_global_tokens is {self.num_global_tokens}; expected PAD and a word at least"
            )

    @property
    def num_tokens(self) -> int:
        return self.num_global_tokens + self.num_oov_buckets


@keras.saving.register_keras_serializable(package="fedrecon")
class SplitEmbedding(keras.layers.Layer):  # type: ignore[misc]
    """An embedding over ids `[0, G + n)` whose last `n` rows are a variable of their own.

    Two gathers and a select, instead of a gather from the concatenated tables: a step copies
    B x L rows, not the whole G x E table, and each table gets its own gradient.
    """

    def __init__(self, num_global_tokens: int, num_oov_buckets: int, dim: int, seed: int, **kwargs: Any):
        super().__init__(**kwargs)
        self.num_global_tokens = num_global_tokens
        self.num_oov_buckets = num_oov_buckets
        self.dim = dim
        self.seed = seed

    def build(self, input_shape: Any) -> None:
        self.global_embeddings = self.add_weight(
            shape=(self.num_global_tokens, self.dim),
            initializer=keras.initializers.RandomUniform(-0.05, 0.05, seed=self.seed),
            name=GLOBAL_EMBEDDINGS,
        )
        self.oov_embeddings = self.add_weight(
            shape=(self.num_oov_buckets, self.dim),
            initializer=keras.initializers.RandomUniform(-0.05, 0.05, seed=self.seed + 1),
            name=OOV_EMBEDDINGS,
        )

    def call(self, tokens: tf.Tensor) -> tf.Tensor:
        is_oov = tokens >= self.num_global_tokens
        zero = tf.zeros_like(tokens)
        global_rows = tf.gather(self.global_embeddings, tf.where(is_oov, zero, tokens))
        oov_rows = tf.gather(self.oov_embeddings, tf.where(is_oov, tokens - self.num_global_tokens, zero))
        return tf.where(is_oov[..., None], oov_rows, global_rows)

    def compute_output_shape(self, input_shape: Any) -> Any:
        return (*input_shape, self.dim)

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "num_global_tokens": self.num_global_tokens,
            "num_oov_buckets": self.num_oov_buckets,
            "dim": self.dim,
            "seed": self.seed,
        }


@dataclass(frozen=True)
class NextWordModel:
    """The Keras model and which of its variables are local (by path, e.g. `oov_output/kernel`)."""

    config: NextWordConfig
    keras_model: keras.Model
    local_paths: tuple[str, ...]

    @property
    def global_variables(self) -> list[keras.Variable]:
        return [v for v in self.keras_model.trainable_variables if v.path not in self.local_paths]

    @property
    def local_variables(self) -> list[keras.Variable]:
        return [v for v in self.keras_model.trainable_variables if v.path in self.local_paths]


def build_next_word_model(config: NextWordConfig) -> NextWordModel:
    """The LSTM language model, its variables initialised from `config.seed`."""
    c = config
    tokens = keras.Input(shape=(c.seq_len,), dtype="int32", name="tokens")
    embedded = SplitEmbedding(
        c.num_global_tokens, c.num_oov_buckets, c.embedding_dim, c.seed, name=EMBEDDING
    )(tokens)
    hidden = keras.layers.LSTM(
        c.lstm_units,
        return_sequences=True,
        unroll=True,
        kernel_initializer=keras.initializers.GlorotUniform(seed=c.seed + 2),
        recurrent_initializer=keras.initializers.Orthogonal(seed=c.seed + 3),
        name="lstm",
    )(embedded)
    projected = keras.layers.Dense(
        c.embedding_dim,
        kernel_initializer=keras.initializers.GlorotUniform(seed=c.seed + 4),
        name="projection",
    )(hidden)
    global_logits = keras.layers.Dense(
        c.num_global_tokens,
        kernel_initializer=keras.initializers.GlorotUniform(seed=c.seed + 5),
        name=GLOBAL_OUTPUT,
    )(projected)
    oov_logits = keras.layers.Dense(
        c.num_oov_buckets,
        kernel_initializer=keras.initializers.GlorotUniform(seed=c.seed + 6),
        name=OOV_OUTPUT,
    )(projected)
    logits = keras.layers.Concatenate(axis=-1, name="logits")([global_logits, oov_logits])
    model = keras.Model(tokens, logits, name="next_word")
    paths = {v.path for v in model.trainable_variables}
    missing = set(OOV_VARIABLES) - paths
    if missing:
        raise RuntimeError(f"the model has no variables {sorted(missing)}; it has {sorted(paths)}")
    return NextWordModel(config, model, OOV_VARIABLES if c.oov_local else ())


def next_word_loss(targets: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """Mean softmax cross-entropy over the non-padding targets; 0 for an all-padding batch."""
    mask = tf.cast(targets != PAD, tf.float32)
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets, logits=logits)
    return tf.math.divide_no_nan(tf.reduce_sum(mask * losses), tf.reduce_sum(mask))


def next_word_metrics(targets: tf.Tensor, logits: tf.Tensor, num_global_tokens: int) -> dict[str, tf.Tensor]:
    """Sums, so that devices' metrics add up; accuracy = correct / tokens of the same kind.

    - `correct_in_vocab_sum` / `in_vocab_tokens_sum`: accuracy without OOV. Targets that are
      padding or an OOV bucket do not count, and predicting a bucket is wrong.
    - `correct_sum` / `tokens_sum`: accuracy with OOV: predicting the target's bucket is right.
    - `loss_sum`: cross-entropy summed over `tokens_sum` targets.
    End of sentence is a target like a word.
    """
    tokens = tf.cast(targets != PAD, tf.float32)
    in_vocab = tokens * tf.cast(targets < num_global_tokens, tf.float32)
    predicted = tf.argmax(logits, axis=-1, output_type=tf.int32)
    correct = tf.cast(predicted == targets, tf.float32)
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets, logits=logits)
    return {
        "loss_sum": tf.reduce_sum(tokens * losses),
        "correct_sum": tf.reduce_sum(tokens * correct),
        "tokens_sum": tf.reduce_sum(tokens),
        "correct_in_vocab_sum": tf.reduce_sum(in_vocab * correct),
        "in_vocab_tokens_sum": tf.reduce_sum(in_vocab),
    }


# ---- the model as an ExportSpec: what the device runtime and the federation train ----------

DEFAULT_NUM_GLOBAL_TOKENS = 1003  # 1,000 words plus PAD, BOS, EOS (`android_sim.shakespeare`)
DEFAULT_BATCH_SIZE, DEFAULT_MAX_BATCHES = 8, 8


def _token_mask(targets: tf.Tensor) -> tf.Tensor:
    return tf.cast(targets != PAD, tf.float32)


def _correct(targets: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    predicted = tf.argmax(logits, axis=-1, output_type=tf.int32)
    return tf.cast(predicted == targets, tf.float32)


def example_loss(targets: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """Per example (one window): the mean cross-entropy over its non-padding targets."""
    mask = _token_mask(targets)
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets, logits=logits)
    return tf.math.divide_no_nan(tf.reduce_sum(mask * losses, axis=-1), tf.reduce_sum(mask, axis=-1))


def example_metrics(num_global_tokens: int, seq_len: int) -> tuple[Metric, ...]:
    """Token counts per example, so that sums over examples and devices give the accuracies of
    `next_word_metrics`: `correct_tokens / tokens` with OOV (predicting the target's bucket is
    right), `correct_in_vocab_tokens / in_vocab_tokens` without (OOV targets do not count)."""

    def in_vocab(targets: tf.Tensor) -> tf.Tensor:
        return _token_mask(targets) * tf.cast(targets < num_global_tokens, tf.float32)

    bounds = (0.0, float(seq_len))
    return (
        Metric("correct_tokens", lambda y, p: tf.reduce_sum(_token_mask(y) * _correct(y, p), -1), bounds),
        Metric("tokens", lambda y, p: tf.reduce_sum(_token_mask(y), -1), bounds),
        Metric(
            "correct_in_vocab_tokens", lambda y, p: tf.reduce_sum(in_vocab(y) * _correct(y, p), -1), bounds
        ),
        Metric("in_vocab_tokens", lambda y, p: tf.reduce_sum(in_vocab(y), -1), bounds),
    )


def last_token_logits(inputs: Mapping[str, Any], logits: Any) -> Any:
    """`infer`: the logits after the last non-padding token of each window, [B, G + n]."""
    length = tf.reduce_sum(tf.cast(inputs["tokens"] != PAD, tf.int32), axis=-1)
    last = tf.where(length > 0, length - 1, tf.zeros_like(length))
    return tf.gather(logits, last, batch_dims=1)


def build_spec(
    config: NextWordConfig,
    batch_size: int = DEFAULT_BATCH_SIZE,
    max_batches: int = DEFAULT_MAX_BATCHES,
    top_k: int = 3,
) -> ExportSpec:
    """The next-word model as an `ExportSpec`: `tokens` in, `targets` the label (both int32
    [seq_len], ids in [0, num_tokens)); the OOV rows local when `config.oov_local`."""
    c = config
    built = build_next_word_model(c)
    ids = (0, c.num_tokens - 1)
    return ExportSpec(
        model=keras.Model({"tokens": built.keras_model.input}, built.keras_model.output, name="next_word"),
        features=(
            FeatureSpec("tokens", "int32", (c.seq_len,), value_range=ids, discrete=True),
            FeatureSpec("targets", "int32", (c.seq_len,), role="label", value_range=ids, discrete=True),
        ),
        local_variables=built.local_paths,
        loss=example_loss,
        metrics=example_metrics(c.num_global_tokens, c.seq_len),
        task=TaskSpec("classification", top_k=min(top_k, c.num_tokens), num_classes=c.num_tokens),
        infer_scores=last_token_logits,
        batch_size=batch_size,
        max_batches=max_batches,
        training_defaults={"reconstruction_learning_rate": 0.5, "update_learning_rate": 0.5},
        config={"model": "next_word", **asdict(c)},
    )


def build(
    num_global_tokens: int = DEFAULT_NUM_GLOBAL_TOKENS,
    num_oov_buckets: int = NextWordConfig.num_oov_buckets,
    oov_local: bool = NextWordConfig.oov_local,
    seq_len: int = NextWordConfig.seq_len,
    embedding_dim: int = NextWordConfig.embedding_dim,
    lstm_units: int = NextWordConfig.lstm_units,
    seed: int = NextWordConfig.seed,
    batch_size: int = DEFAULT_BATCH_SIZE,
    max_batches: int = DEFAULT_MAX_BATCHES,
    top_k: int = 3,
) -> ExportSpec:
    """`build_spec` from keyword arguments, for `python -m model_export --model
    model_export.models.next_word:build --model-arg num_oov_buckets=100 ...`; the sizes are
    `NextWordConfig`'s, checked there."""
    if batch_size < 1 or max_batches < 1 or top_k < 1:
        raise ValueError(
            f"batch_size, max_batches and top_k must be at least 1, got {batch_size}, {max_batches}, {top_k}"
        )
    config = NextWordConfig(
        num_global_tokens=num_global_tokens,
        num_oov_buckets=num_oov_buckets,
        oov_local=oov_local,
        seq_len=seq_len,
        embedding_dim=embedding_dim,
        lstm_units=lstm_units,
        seed=seed,
    )
    return build_spec(config, batch_size, max_batches, top_k)
