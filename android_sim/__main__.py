"""`python -m android_sim`: simulated Android devices running the device runtime."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from android_sim.movielens import DataFormatError

DEFAULT_RATINGS = (
    Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "movielens-100k" / "u.data"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m android_sim", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="export a model, fill one device from MovieLens, run a client task, show a top-10"
    )
    demo.add_argument(
        "--ratings",
        type=Path,
        default=DEFAULT_RATINGS,
        help="MovieLens u.data or ratings.dat (default: %(default)s)",
    )
    demo.add_argument(
        "--work-dir", type=Path, default=None, help="where to write the model and the device store"
    )
    demo.add_argument("--user", type=int, default=0, help="which MovieLens user is the device (dense index)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        if args.command == "demo":
            from android_sim.demo import run_demo

            return run_demo(args.ratings, args.work_dir, args.user)
    except DataFormatError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
