"""Device runtime benchmark: client task time, top-10 latency, peak RSS, model size.

    ./dev bench            (or: python -m benchmarks.device [--repeats N])

Exports 3,706 x 50 and 20,000 x 50 models (TensorFlow, in a subprocess), then measures
each in a fresh process where importing TensorFlow is blocked, once per interpreter backend
(`ai_edge_litert`'s and `tflite_runtime`'s Interpreter, LiteRT's CompiledModel):

- one full client task for a 300-example client (set globals, reconstruct, update, delta),
  with the protocol's steps (reconstruction min(50, 5 epochs) = 50, update 1 epoch = 30)
  and with the update raised to 50 steps (2 epochs); median over repeats;
- top-10 over the whole catalog with cached local parameters (median);
- installing a new set of global parameters (validation; the interpreter copy happens lazily);
- the process's peak RSS (ru_maxrss), training and serving in one process;
- the `.tflite` size against the raw bytes of its parameters.
Targets (issue 2): task <= 15 ms, top-10 <= 1 ms, RSS <= 80 MB.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from model_runtime.interpreter import BACKENDS

ROOT = Path(__file__).resolve().parent.parent

SIZES = ((3706, 50), (20000, 50))

BLOCK_TENSORFLOW = """
import importlib.abc, sys
class _NoTensorFlow(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "tensorflow" or name.startswith("tensorflow."):
            raise ImportError("tensorflow is blocked in the device benchmark")
sys.meta_path.insert(0, _NoTensorFlow())
"""


def measure(model_dir: Path, backend: str, repeats: int) -> dict[str, float]:
    """Runs in the child process: the device's view only."""
    import resource

    import numpy as np

    from contracts.manifest import INITIAL_GLOBAL_FILE
    from contracts.params import decode_params
    from contracts.task_config import TaskConfig
    from device_runtime.client_task import Task, run_training_task
    from device_runtime.example_store import Event, ExampleStore
    from device_runtime.recommender import Recommender
    from device_runtime.task_environment import Environment
    from model_export.config import ITEM, LABEL
    from model_runtime.support_query import num_steps
    from model_runtime.tflite_model import TFLiteModel

    model = TFLiteModel(model_dir, backend=backend)
    n = model.manifest.catalog_size
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        store = ExampleStore(Path(tmp) / "device.sqlite", model.manifest.features)
        items = rng.choice(n, 300, replace=False)
        store.add(
            Event({ITEM: int(i), LABEL: float(rng.integers(1, 6))}, float(t)) for t, i in enumerate(items)
        )
        # As a device gets them: a safetensors download, not a read from the interpreter.
        global_params = decode_params(
            (model_dir / INITIAL_GLOBAL_FILE).read_bytes(), model.manifest.global_params, "globals"
        )
        configs = {
            "task_ms": TaskConfig.from_manifest(model.manifest),
            "task_50_update_steps_ms": TaskConfig.from_manifest(model.manifest, update_max_epochs=2),
        }
        results: dict[str, float] = {}
        for name, config in configs.items():
            times = []
            for _ in range(repeats + 3):
                start = time.perf_counter()
                outcome = run_training_task(model, Environment.of(store), global_params, Task(config))
                times.append(time.perf_counter() - start)
                assert outcome.outcome.value == "completed", outcome.message
            results[name] = statistics.median(times[3:]) * 1e3
            query_batches = -(-int(outcome.metrics["num_query"]) // model.manifest.batch_size)
            results[name.replace("_ms", "_update_steps")] = float(
                num_steps(query_batches, config.update_max_epochs, config.update_max_steps)
            )
        start = time.perf_counter()
        for _ in range(repeats):
            model.set_global(global_params)
        results["set_global_ms"] = (time.perf_counter() - start) / repeats * 1e3

        recommender = Recommender(model, store, global_params)
        recommender.recommend(10)  # reconstructs once, then cached
        times = []
        for _ in range(max(repeats, 200)):
            start = time.perf_counter()
            recommender.recommend(10)
            times.append(time.perf_counter() - start)
        results["top10_ms"] = statistics.median(times) * 1e3
        store.close()
    results["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    results["tensorflow_loaded"] = float(any(m.startswith("tensorflow") for m in sys.modules))
    return results


def export(num_items: int, dim: int, out: Path) -> dict[str, float]:
    from contracts.manifest import load_manifest
    from model_export.config import ModelConfig
    from model_export.in_subprocess import export_in_subprocess

    config = ModelConfig(
        num_items=num_items,
        embedding_dim=dim,
        batch_size=5,
        max_batches=64,
        item_bias=True,
        user_bias=True,
        global_mean=True,
        global_mean_init=3.5,
    )
    manifest = load_manifest(export_in_subprocess(config, out))
    params = sum(4 * s.num_elements for s in (*manifest.global_params, *manifest.local_params))
    return {"tflite_bytes": manifest.model_bytes, "param_bytes": params}


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.device",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--child", nargs=2, metavar=("MODEL_DIR", "BACKEND"), help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(Path(args.child[0]), args.child[1], args.repeats)))
        return 0

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for num_items, dim in SIZES:
            out = Path(tmp) / f"{num_items}x{dim}"
            out.mkdir()
            sizes = export(num_items, dim, out)
            for backend in BACKENDS:
                code = BLOCK_TENSORFLOW + (
                    "import runpy, sys\n"
                    f"sys.argv = ['bench', '--child', {str(out)!r}, {backend!r}, "
                    f"'--repeats', '{args.repeats}']\n"
                    "runpy.run_module('benchmarks.device', run_name='__main__')\n"
                )
                child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
                if child.returncode != 0:
                    print(child.stderr, file=sys.stderr)
                    return 1
                figures = json.loads(child.stdout.strip().splitlines()[-1])
                rows.append({"items": f"{num_items} x {dim}", "backend": backend, **sizes, **figures})

    print(
        f"device runtime benchmark (medians of {args.repeats} runs; 300-example client; TensorFlow blocked)"
    )
    header = (
        f"{'model':<12} {'interpreter':<15} {'task ms':>8} {'(50 upd)':>9} {'top-10 ms':>10} "
        f"{'RSS MB':>7} {'globals ms':>11} {'tflite/params':>14}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['items']:<12} {r['backend']:<15} {r['task_ms']:>8.2f} {r['task_50_update_steps_ms']:>9.2f} "
            f"{r['top10_ms']:>10.3f} {r['peak_rss_mb']:>7.1f} {r['set_global_ms']:>11.2f} "
            f"{r['tflite_bytes'] / r['param_bytes']:>13.2f}x"
        )
    print("targets: task <= 15 ms, top-10 <= 1 ms, peak RSS <= 80 MB")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
