"""What robust aggregation costs in quality: FedRecon on MovieLens with each server aggregation.

    python benchmarks/bench_robust_aggregation.py [--rounds 500] [--settings faithful,better]

The quality benchmark's in-process FedRecon (the exported TFLite model doing the device maths,
android_sim/bench), trained once per aggregation with the same clients each round:
- "weighted mean": the paper's plain FedAvg mean (what the quality benchmark reports);
- "defaults": the orchestrator's defaults (per-tensor clipping at 3x the reference norm, weights
  capped at 5x the round's median; aggregation.RobustAggregation);
- "trimmed_mean" (10% at each end) and "median": the robust options, with the same clipping.
Prints test RMSE and accuracy on the held-out users per run, and writes them as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from android_sim.bench.federated import Rounds  # noqa: E402
from android_sim.bench.models import ModelCache  # noqa: E402
from android_sim.bench.protocol import split_users  # noqa: E402
from android_sim.bench.quality import BETTER, FAITHFUL, load_dataset, run_fedrecon  # noqa: E402
from android_sim.run_config import DEFAULT_RATINGS  # noqa: E402
from orchestrator.aggregation import RobustAggregation  # noqa: E402

AGGREGATIONS: dict[str, RobustAggregation | None] = {
    "weighted mean": None,
    "defaults": RobustAggregation(),
    "trimmed_mean": RobustAggregation(method="trimmed_mean"),
    "median": RobustAggregation(method="median"),
}
SETTINGS = {"faithful": FAITHFUL, "better": BETTER}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ratings", type=Path, default=DEFAULT_RATINGS)
    parser.add_argument("--models-dir", type=Path, default=Path("runs/models"))
    parser.add_argument("--rounds", type=int, default=500)
    parser.add_argument("--settings", default="faithful,better", help=f"from {', '.join(SETTINGS)}")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    data = load_dataset(args.ratings)
    split = split_users(len(data.examples))
    models = ModelCache(args.models_dir)
    rounds = Rounds(rounds=args.rounds, evaluate_every=args.rounds)
    results = []
    for settings_name in [s.strip() for s in args.settings.split(",") if s.strip()]:
        for name, aggregation in AGGREGATIONS.items():
            settings = dataclasses.replace(SETTINGS[settings_name], aggregation=aggregation)
            result = run_fedrecon(data, split, settings, rounds, models, args.workers)
            test = result.test
            results.append(
                {"settings": settings_name, "aggregation": name, **test, "seconds": result.seconds}
            )
            print(
                f"{settings_name:<9} {name:<14} test RMSE {test['rmse']:.4f}  accuracy {test['accuracy']:.2%}"
                f"  ({result.seconds:.0f} s)",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
