"""What robust aggregation costs in quality: FedRecon on MovieLens with each server aggregation.

    python -m benchmarks.robust_aggregation [--rounds 500] [--settings faithful,better]

The quality benchmark's in-process FedRecon (the exported TFLite model doing the device maths,
android_sim/simulation), trained once per aggregation with the same clients each round:
- "weighted mean": the paper's plain FedAvg mean (what the quality benchmark reports);
- "defaults": the orchestrator's defaults (per-tensor clipping at 3x the reference norm, weights
  capped at 5x the round's median; aggregation.registry.RobustAggregation);
- "trimmed_mean" (10% at each end) and "median": the robust options, with the same clipping.
Prints test RMSE and accuracy on the held-out users per run, each with its 95% interval over
the test users, and each run minus the weighted mean with the same settings (paired: the same
users resampled in both); writes them as JSON. The ceiling of each settings' rows is the quality
benchmark's centralized row (`--methods centralized_recon_eval` for faithful,
`centralized_better_recon_eval` for better); this script does not train it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from android_sim.run_config import DEFAULT_RATINGS
from android_sim.simulation.protocol import split_users
from android_sim.simulation.rounds import Rounds
from benchmarks.figures import paired_interval
from benchmarks.model_cache import ModelCache
from benchmarks.quality_methods import BETTER, FAITHFUL, load_dataset, run_fedrecon
from benchmarks.quality_report import CEILINGS, MethodResult, shown
from orchestrator.aggregation.registry import RobustAggregation

AGGREGATIONS: dict[str, RobustAggregation | None] = {
    "weighted mean": None,
    "defaults": RobustAggregation(),
    "trimmed_mean": RobustAggregation(method="trimmed_mean"),
    "median": RobustAggregation(method="median"),
}
SETTINGS = {"faithful": FAITHFUL, "better": BETTER}
# The quality benchmark's method with these settings, whose ceiling is each row's.
METHOD = {"faithful": "fedrecon", "better": "better"}


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.robust_aggregation",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
        ceiling = CEILINGS[METHOD[settings_name]]
        plain: MethodResult | None = None
        for name, aggregation in AGGREGATIONS.items():
            settings = dataclasses.replace(SETTINGS[settings_name], aggregation=aggregation)
            result = run_fedrecon(data, split, settings, rounds, models, args.workers)
            test = result.test
            row = {
                "settings": settings_name,
                "aggregation": name,
                **test,
                "intervals": result.intervals,
                "ceiling": ceiling,
                "seconds": result.seconds,
            }
            against = ""
            if plain is None:
                plain = result
            else:  # the same test users score both runs: resampled together
                gap = {key: test[key] - plain.test[key] for key in ("rmse", "accuracy")}
                row["minus_weighted_mean"] = gap
                row["minus_weighted_mean_95"] = {
                    key: paired_interval(result.per_user, plain.per_user, key, np.subtract) for key in gap
                }
                low, high = row["minus_weighted_mean_95"]["rmse"]
                against = f"; RMSE minus the weighted mean's {gap['rmse']:+.4f} [{low:+.4f}, {high:+.4f}]"
            results.append(row)
            print(
                f"{settings_name:<9} {name:<14} test RMSE {shown(test, result.intervals, 'rmse')}  "
                f"accuracy {shown(test, result.intervals, 'accuracy')}  ({result.seconds:.0f} s{against}; "
                f"ceiling: {ceiling})",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
