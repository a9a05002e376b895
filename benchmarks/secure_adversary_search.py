"""The server adversary that searches (tests/privacy/adversary.py), at a longer budget than CI's.

    python -m benchmarks.secure_adversary_search [--devices 4,6,8] [--random 1000] [--guided 500]

For each cohort size: every split of the survivor view around each device (exhaustive), then
`--random` strategies drawn at random, then `--guided` mutations of those that got the most secrets
of one device; each against the device runtime's real secure-round code. Prints, per size, how many
strategies ran, how many rounds committed, the most secrets of one device the server held, and
every leak (a masked input read alone), which must be none.
"""

from __future__ import annotations

import argparse
import sys
import time

from tests.privacy.adversary import search


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.secure_adversary_search",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--devices", default="4,6,8", help="cohort sizes, comma-separated (each >= 4)")
    parser.add_argument("--random", type=int, default=1000, help="random strategies per size")
    parser.add_argument("--guided", type=int, default=500, help="guided mutations per size")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        sizes = [int(n) for n in args.devices.split(",")]
    except ValueError:
        parser.error(f"--devices must be integers separated by commas, got {args.devices!r}")
    if any(n < 4 for n in sizes) or args.random < 0 or args.guided < 0:
        parser.error("--devices must each be >= 4, --random and --guided >= 0")
    leaks = 0
    print(
        "| devices | strategies (exhaustive / random / guided) | rounds committed "
        "| most secrets of one device | leaks | seconds |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for n in sizes:
        started = time.perf_counter()
        report = search(n=n, random_budget=args.random, guided_budget=args.guided, seed=args.seed)
        seconds = time.perf_counter() - started
        leaks += len(report.leaks)
        print(
            f"| {n} | {report.strategies} ({report.exhaustive} / {report.random} / {report.guided}) "
            f"| {report.committed} | {report.most_secrets} of {n} | {len(report.leaks)} | {seconds:.0f} |",
            flush=True,
        )
        for strategy, outcome in report.leaks[:5]:
            print(f"  leak: {outcome.leaked} with {strategy.describe()}")
    return 1 if leaks else 0


if __name__ == "__main__":
    sys.exit(main())
