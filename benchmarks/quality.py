"""`python -m benchmarks.quality`: FedRecon and the paper's baselines on MovieLens through the
exported TFLite model (docs/benchmarks.md).

Train and evaluate every method with the exported model's signatures doing the device maths and
the orchestrator's aggregation; print the test figures and write quality.json and
learning_curves.png to --out."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from android_sim.movielens import DataFormatError
from android_sim.run_config import DEFAULT_RATINGS
from contracts.command_line import CommandParser


def _parser() -> argparse.ArgumentParser:
    # The studies load TensorFlow's interpreter: imported here, `--help` stays quick.
    from android_sim.simulation.rounds import Rounds
    from benchmarks.quality_study import (
        DP_CLIP_NORM,
        DP_NOISE_MULTIPLIERS,
        METHODS,
        SECURE_BITS,
        SPLIT_SEEDS,
    )
    from benchmarks.staleness import StalenessOptions

    d = Rounds()
    parser = CommandParser(
        prog="python -m benchmarks.quality",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--ratings", type=Path, default=DEFAULT_RATINGS, help="MovieLens u.data or ratings.dat (.gz ok)"
    )
    parser.add_argument("--out", type=Path, help="output directory (default: runs/quality-<time>)")
    parser.add_argument(
        "--models-dir", type=Path, default=Path("runs/models"), help="exported models, reused"
    )
    parser.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma-separated subset of: {', '.join(METHODS)}"
    )
    parser.add_argument("--rounds", type=int, default=d.rounds)
    parser.add_argument("--clients-per-round", type=int, default=d.clients_per_round)
    parser.add_argument("--evaluate-every", type=int, default=d.evaluate_every, help="validation cadence")
    parser.add_argument("--sampling-seed", type=int, default=d.sampling_seed, help="client sampling")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="interpreter threads")
    parser.add_argument(
        "--split-seeds", default=",".join(map(str, SPLIT_SEEDS)), help="user-split seeds for better_seeds"
    )
    parser.add_argument("--centralized-epochs", type=int, default=30)
    parser.add_argument("--better-settings", type=Path, help="JSON file: FedRecon settings for 'better'")
    parser.add_argument(
        "--staleness-participations",
        type=int,
        default=StalenessOptions().participations,
        help="staleness: client tasks per run (the same at 100, 20 and 5 clients per round)",
    )
    parser.add_argument(
        "--staleness-scale-server-rate",
        action="store_true",
        help="staleness: scale the server learning rate by clients-per-round / 100",
    )
    parser.add_argument(
        "--dp-clip-norm", type=float, default=DP_CLIP_NORM, help="dp_fedrecon, secure_fedrecon clip norm"
    )
    parser.add_argument(
        "--dp-noise-multipliers",
        default=",".join(map(str, DP_NOISE_MULTIPLIERS)),
        help="dp_fedrecon's noise multipliers (0: clipping only)",
    )
    parser.add_argument(
        "--secure-bits", type=int, default=SECURE_BITS, help="secure_fedrecon's modulus 2^bits"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        import json

        from android_sim.simulation.rounds import Rounds
        from benchmarks.quality_methods import BETTER, FedReconSettings
        from benchmarks.quality_study import QualityOptions, run_quality
        from benchmarks.staleness import StalenessOptions

        better = BETTER
        if args.better_settings is not None:
            try:
                better = FedReconSettings.from_json(json.loads(args.better_settings.read_text()))
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"cannot read settings {args.better_settings}: {e}") from None
        options = QualityOptions(
            ratings=args.ratings,
            out=args.out or Path("runs") / time.strftime("quality-%Y%m%d-%H%M%S"),
            models_dir=args.models_dir,
            methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
            rounds=Rounds(args.rounds, args.clients_per_round, args.evaluate_every, args.sampling_seed),
            workers=args.workers,
            better=better,
            split_seeds=tuple(int(s) for s in args.split_seeds.split(",") if s.strip()),
            centralized_epochs=args.centralized_epochs,
            staleness=StalenessOptions(
                participations=args.staleness_participations,
                scale_server_learning_rate=args.staleness_scale_server_rate,
            ),
            dp_clip_norm=args.dp_clip_norm,
            dp_noise_multipliers=tuple(float(z) for z in args.dp_noise_multipliers.split(",") if z.strip()),
            secure_bits=args.secure_bits,
        )
        report = run_quality(options)
        print(f"wrote {options.out / 'quality.json'} and {options.out / 'learning_curves.png'}")
        if "staleness" in report:
            print(f"wrote {options.out / 'staleness.png'}")
        if report["targets"].get("applies") is False:
            print(f"targets: set on {report['targets']['set_on']}, not on this data: none checked")
        for name, target in report["targets"].items():
            if isinstance(target, dict):
                verdict = "met" if target["met"] else "NOT met"
                print(f"target {name}: {target['measured']:.4g} ({target['target']}) {verdict}")
        return 0
    except (DataFormatError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
