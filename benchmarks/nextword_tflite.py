"""Next-word LSTM under TFLite: builtin ops only, its loss falls on the device, and it equals TensorFlow's.

    python -m benchmarks.nextword_tflite [--vocab-sizes 1000 10000] [--calls 10] [--steps 5]

A standalone check of `model_export.models.next_word` before the generic export wires it in.
For each variant of the paper's Table 2 (FedAvg with 1 shared OOV bucket, FedRecon with 1 local
bucket, FedRecon with many local buckets) and vocabulary size:

1. a TensorFlow process builds the model, wraps it in a `tf.Module` with three signatures over
   a static padded task (`tokens`/`targets` [num_batches, batch_size, seq_len] int32):
   `reconstruct` (SGD steps on the local variables, globals frozen), `update` (SGD steps on the
   global variables, locals frozen; all variables when none is local) and `evaluate`, each
   step a Keras `stateless_call` under a `tf.GradientTape` inside a `tf.while_loop`; converts
   with `TFLITE_BUILTINS` only and resource variables (as `model_export/export.py`); then runs
   the same calls in TensorFlow from the same initial variables, for reference;
2. one process per interpreter (`ai_edge_litert`, `tflite_runtime`), with TensorFlow blocked,
   runs the calls on the `.tflite`: `evaluate`, `reconstruct` once, then `update` `--calls`
   times of `--steps` steps each, then `evaluate`; timing each call.

The task is a real one: the first batches of a training role of Tiny Shakespeare. Printed per
variant: loss before/after under each runtime, the largest |TF - TFLite| loss difference over
all calls, the median time per training step, the `.tflite` size. `--json` writes everything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

BACKENDS = ("ai_edge_litert", "tflite_runtime")

BLOCK_TENSORFLOW = """
import importlib.abc, sys
class _NoTensorFlow(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "tensorflow" or name.startswith("tensorflow."):
            raise ImportError("tensorflow is blocked on the device side")
sys.meta_path.insert(0, _NoTensorFlow())
"""


@dataclass(frozen=True)
class Check:
    """One variant: the model's shapes, the task's shape and the calls to make."""

    vocab_size: int = 1000
    num_oov_buckets: int = 1
    oov_local: bool = True
    seq_len: int = 20
    embedding_dim: int = 32
    lstm_units: int = 64
    batch_size: int = 8
    num_batches: int = 4
    calls: int = 10
    steps: int = 5
    reconstruction_steps: int = 5
    learning_rate: float = 0.5
    reconstruction_learning_rate: float = 0.1

    @property
    def name(self) -> str:
        kind = "FedRecon" if self.oov_local else "FedAvg"
        where = "local" if self.oov_local else "shared"
        return f"{kind}, {self.num_oov_buckets} {where} OOV bucket(s), V={self.vocab_size}"


def task_batches(check: Check) -> tuple[Any, Any, int]:
    """(tokens, targets, num_global_tokens): the first batches of the first big-enough training role."""
    import numpy as np

    from android_sim.shakespeare import next_word_data, read_roles

    needed = check.num_batches * check.batch_size
    data = next_word_data(read_roles(), check.vocab_size, check.num_oov_buckets, check.seq_len)
    examples = next(e for e in data.train if len(e["tokens"]) >= needed)
    shape = (check.num_batches, check.batch_size, check.seq_len)
    tokens = np.ascontiguousarray(examples["tokens"][:needed].reshape(shape))
    targets = np.ascontiguousarray(examples["targets"][:needed].reshape(shape))
    return tokens, targets, data.vocabulary.num_global_tokens


def export(check: Check, out: Path) -> None:
    """TensorFlow side: write model.tflite, task.npz, reference.json (TF's outputs, parameter counts)."""
    import numpy as np
    import tensorflow as tf

    from model_export.models.next_word import (
        NextWordConfig,
        build_next_word_model,
        next_word_loss,
        next_word_metrics,
    )

    tokens, targets, num_global_tokens = task_batches(check)
    model = build_next_word_model(
        NextWordConfig(
            num_global_tokens=num_global_tokens,
            num_oov_buckets=check.num_oov_buckets,
            oov_local=check.oov_local,
            seq_len=check.seq_len,
            embedding_dim=check.embedding_dim,
            lstm_units=check.lstm_units,
        )
    )
    keras_model = model.keras_model
    is_local = [v.path in model.local_paths for v in keras_model.trainable_variables]
    # Keras state that `stateless_call` wants but no step changes (the LSTM's dropout seed).
    frozen = [tf.constant(v.numpy()) for v in keras_model.non_trainable_variables]
    batches_spec = tf.TensorSpec([check.num_batches, check.batch_size, check.seq_len], tf.int32)

    class Training(tf.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            # The tf.Variables under the Keras ones, tracked here: a module that holds only the
            # Keras 3 model saves none of them, and the converted model reads uninitialised
            # variables (NaN under LiteRT, a READ_VARIABLE failure under tflite_runtime).
            self.trainable = [v.value for v in keras_model.trainable_variables]

        def _logits(self, values: list[tf.Tensor], tokens: tf.Tensor) -> tf.Tensor:
            logits, _ = keras_model.stateless_call(values, frozen, tokens, training=True)
            return logits

        def _train(
            self, tokens: tf.Tensor, targets: tf.Tensor, num_steps: tf.Tensor, rate: tf.Tensor, local: bool
        ) -> dict[str, tf.Tensor]:
            trains = [flag == local for flag in is_local] if model.local_paths else [True] * len(is_local)
            start = [v.read_value() for v in self.trainable]

            def body(step: tf.Tensor, loss_sum: tf.Tensor, *values: tf.Tensor) -> Any:
                b = tf.math.floormod(step, check.num_batches)
                with tf.GradientTape() as tape:
                    tape.watch(values)
                    loss = next_word_loss(targets[b], self._logits(list(values), tokens[b]))
                grads = tape.gradient(loss, list(values))
                new = [
                    v - rate * tf.convert_to_tensor(g) if t else v
                    for v, g, t in zip(values, grads, trains, strict=True)
                ]
                return (step + 1, loss_sum + loss, *new)

            _, loss_sum, *final = tf.while_loop(
                lambda step, *_: step < num_steps, body, (tf.constant(0), tf.constant(0.0), *start)
            )
            for v, value, t in zip(self.trainable, final, trains, strict=True):
                if t:
                    v.assign(value)
            return {"loss": tf.math.divide_no_nan(loss_sum, tf.cast(num_steps, tf.float32))}

        def reconstruct(
            self, tokens: tf.Tensor, targets: tf.Tensor, num_steps: tf.Tensor, learning_rate: tf.Tensor
        ) -> dict[str, tf.Tensor]:
            return self._train(tokens, targets, num_steps, learning_rate, local=True)

        def update(
            self, tokens: tf.Tensor, targets: tf.Tensor, num_steps: tf.Tensor, learning_rate: tf.Tensor
        ) -> dict[str, tf.Tensor]:
            return self._train(tokens, targets, num_steps, learning_rate, local=False)

        def evaluate(self, tokens: tf.Tensor, targets: tf.Tensor) -> dict[str, tf.Tensor]:
            flat = [-1, check.seq_len]
            logits = self._logits([v.read_value() for v in self.trainable], tf.reshape(tokens, flat))
            return next_word_metrics(tf.reshape(targets, flat), logits, num_global_tokens)

    module = Training()
    training_spec = [batches_spec, batches_spec, tf.TensorSpec([], tf.int32), tf.TensorSpec([], tf.float32)]
    # Signature inputs are named after the methods' arguments.
    signatures = {
        "update": tf.function(module.update, input_signature=training_spec),
        "evaluate": tf.function(module.evaluate, input_signature=[batches_spec, batches_spec]),
    }
    if model.local_paths:
        signatures["reconstruct"] = tf.function(module.reconstruct, input_signature=training_spec)
    with tempfile.TemporaryDirectory() as saved:
        tf.saved_model.save(module, saved, signatures=signatures)
        converter = tf.lite.TFLiteConverter.from_saved_model(saved, signature_keys=list(signatures))
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
        converter.experimental_enable_resource_variables = True
        blob = converter.convert()
    (out / "model.tflite").write_bytes(blob)
    np.savez(out / "task.npz", tokens=tokens, targets=targets)

    def run(name: str, **inputs: Any) -> dict[str, float]:
        started = time.perf_counter()
        result = {k: float(v) for k, v in signatures[name](tokens=tokens, targets=targets, **inputs).items()}
        return {**result, "seconds": time.perf_counter() - started}

    reference = calls(check, run, bool(model.local_paths))
    sizes = {"global": 0, "local": 0}
    for v in keras_model.trainable_variables:
        sizes["local" if v.path in model.local_paths else "global"] += int(np.prod(v.shape))
    (out / "reference.json").write_text(json.dumps({"calls": reference, "floats": sizes}))


def calls(check: Check, run: Any, has_local: bool) -> list[dict[str, Any]]:
    """The same sequence of signature calls on either side; `run(name, **scalars)` makes one."""
    import numpy as np

    out = [{"call": "evaluate", **run("evaluate")}]
    if has_local:
        out.append(
            {
                "call": "reconstruct",
                **run(
                    "reconstruct",
                    num_steps=np.int32(check.reconstruction_steps),
                    learning_rate=np.float32(check.reconstruction_learning_rate),
                ),
            }
        )
    for _ in range(check.calls):
        step = {"num_steps": np.int32(check.steps), "learning_rate": np.float32(check.learning_rate)}
        out.append({"call": "update", **run("update", **step)})
    out.append({"call": "evaluate", **run("evaluate")})
    return out


def device(check: Check, folder: Path, backend: str) -> None:
    """Interpreter side, TensorFlow blocked: the same calls on the `.tflite`."""
    import importlib

    import numpy as np

    Interpreter = importlib.import_module(f"{backend}.interpreter").Interpreter
    interpreter = Interpreter(model_content=(folder / "model.tflite").read_bytes())
    task = np.load(folder / "task.npz")
    runners = {name: interpreter.get_signature_runner(name) for name in interpreter.get_signature_list()}

    def run(name: str, **inputs: Any) -> dict[str, float]:
        started = time.perf_counter()
        result = runners[name](tokens=task["tokens"], targets=task["targets"], **inputs)
        return {**{k: float(v) for k, v in result.items()}, "seconds": time.perf_counter() - started}

    (folder / f"{backend}.json").write_text(json.dumps(calls(check, run, "reconstruct" in runners)))


def _child(stage: str, check: Check, folder: Path, backend: str = "") -> None:
    code = (BLOCK_TENSORFLOW if stage == "device" else "") + (
        # `-c` puts the working directory (ROOT) first on the path, where `benchmarks` is.
        "from benchmarks.nextword_tflite import Check, export, device\n"
        "from pathlib import Path\n"
        f"check = Check(**{asdict(check)!r})\n"
        + (
            f"device(check, Path({str(folder)!r}), {backend!r})"
            if stage == "device"
            else f"export(check, Path({str(folder)!r}))"
        )
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    if result.returncode != 0:
        raise RuntimeError(f"{stage} {backend} failed for {check.name}: {result.stderr.strip()[-3000:]}")


def measure(check: Check, folder: Path) -> dict[str, Any]:
    """Export and run under both interpreters; the figures of one variant."""
    started = time.perf_counter()
    _child("export", check, folder)
    export_seconds = time.perf_counter() - started
    exported = json.loads((folder / "reference.json").read_text())
    runs = {"tensorflow": exported["calls"]}
    for backend in BACKENDS:
        _child("device", check, folder, backend)
        runs[backend] = json.loads((folder / f"{backend}.json").read_text())
    reference = runs["tensorflow"]

    def loss(call: dict[str, float]) -> float:
        return call["loss_sum"] / call["tokens_sum"] if "loss_sum" in call else call["loss"]

    figures: dict[str, Any] = {
        "check": asdict(check),
        "name": check.name,
        "tflite_bytes": (folder / "model.tflite").stat().st_size,
        "global_floats": exported["floats"]["global"],
        "local_floats": exported["floats"]["local"],
        "export_seconds": export_seconds,
    }
    for runtime, run in runs.items():
        updates = [c for c in run if c["call"] == "update"]
        before, after = run[0], run[-1]
        figures[runtime] = {
            "loss_before": loss(before),
            "loss_after": loss(after),
            "accuracy_before": before["correct_sum"] / before["tokens_sum"],
            "accuracy_after": after["correct_sum"] / after["tokens_sum"],
            "accuracy_in_vocab_after": after["correct_in_vocab_sum"] / max(after["in_vocab_tokens_sum"], 1.0),
            "update_losses": [c["loss"] for c in updates],
            "ms_per_update_step": 1000 * statistics.median(c["seconds"] for c in updates) / check.steps,
            "max_abs_loss_difference_from_tf": max(
                abs(loss(a) - loss(b)) for a, b in zip(run, reference, strict=True)
            ),
        }
    return figures


VARIANTS = {"fedavg": (False, False), "fedrecon_one": (True, False), "fedrecon_many": (True, True)}


def main(argv: list[str] | None = None) -> None:
    d = Check()
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.nextword_tflite",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--vocab-sizes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--many-buckets", type=int, default=500, help="OOV buckets of fedrecon_many")
    parser.add_argument("--calls", type=int, default=d.calls, help="update calls")
    parser.add_argument("--steps", type=int, default=d.steps, help="SGD steps per update call")
    parser.add_argument("--seq-len", type=int, default=d.seq_len)
    parser.add_argument("--embedding-dim", type=int, default=d.embedding_dim)
    parser.add_argument("--lstm-units", type=int, default=d.lstm_units)
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--num-batches", type=int, default=d.num_batches, help="batches in the task")
    parser.add_argument("--learning-rate", type=float, default=d.learning_rate, help="of update")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args(argv)
    checks = [
        Check(
            vocab_size=vocab_size,
            num_oov_buckets=args.many_buckets if many else 1,
            oov_local=local,
            seq_len=args.seq_len,
            embedding_dim=args.embedding_dim,
            lstm_units=args.lstm_units,
            batch_size=args.batch_size,
            num_batches=args.num_batches,
            calls=args.calls,
            steps=args.steps,
            learning_rate=args.learning_rate,
        )
        for vocab_size in args.vocab_sizes
        for local, many in (VARIANTS[v] for v in args.variants)
    ]
    results = []
    with tempfile.TemporaryDirectory() as work:
        for i, check in enumerate(checks):
            folder = Path(work) / str(i)
            folder.mkdir()
            figures = measure(check, folder)
            results.append(figures)
            size_mb, seconds = figures["tflite_bytes"] / 1e6, figures["export_seconds"]
            print(
                f"{check.name}: {figures['global_floats']:,} global and {figures['local_floats']:,} "
                f"local floats, .tflite {size_mb:.2f} MB, export {seconds:.0f} s"
            )
            for runtime in ("tensorflow", *BACKENDS):
                f = figures[runtime]
                print(
                    f"  {runtime:15s} loss {f['loss_before']:.4f} -> {f['loss_after']:.4f}, "
                    f"accuracy {f['accuracy_before']:.2%} -> {f['accuracy_after']:.2%}, "
                    f"{f['ms_per_update_step']:.1f} ms/step, "
                    f"max |loss - TF| {f['max_abs_loss_difference_from_tf']:.2e}"
                )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
