"""How often a secure round can still be unmasked, by secret-sharing threshold and dropout rate.

    python -m benchmarks.secure_threshold [--trials 300]

A round of n devices with the SecAgg+ graph of `suggested_neighbours(n)` neighbours (and twice as
many); each device leaves independently with probability `dropout`, a third of those before each
of the three phases after advertising (shares, masked input, unmasking answer). Prints the share of
rounds that the server's own check (`server.unmask_problem`) finds unmaskable: every secret it
needs has its threshold of holders among the devices that answered. A threshold above 1/2 is what
makes the consistency check hold in full (two disjoint sets of a device's neighbours can never
both reach it); the device policy's production floor is 2/3.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from secure_aggregation import server
from secure_aggregation.config import RoundParameters
from secure_aggregation.device import round_graph
from secure_aggregation.neighbours import suggested_neighbours

THRESHOLDS = (0.4, 0.5, 2 / 3)
DROPOUTS = (0.05, 0.1, 0.2, 0.3)


def unmaskable_share(n: int, k: int, threshold: float, dropout: float, trials: int, seed: int) -> float:
    params = RoundParameters("bench/threshold", 1, 32, 1.0, n, k, threshold, n // 2)
    graph = round_graph(params, list(range(1, n + 1)))
    rng = np.random.default_rng(seed)
    ok = 0
    for _ in range(trials):
        # the phase each device leaves before: 0 shares, 1 masked input, 2 unmasking, 3 stays
        leaves = np.where(rng.random(n) < dropout, rng.integers(0, 3, n), 3)
        shared = {i + 1 for i in range(n) if leaves[i] >= 1}
        survivors = {i + 1 for i in range(n) if leaves[i] >= 2}
        responders = {i + 1 for i in range(n) if leaves[i] >= 3}
        ok += server.unmask_problem(params, graph, shared, survivors, responders) is None
    return ok / trials


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.secure_threshold",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--trials", type=int, default=300)
    parser.add_argument("--devices", type=int, nargs="+", default=[100, 1000])
    args = parser.parse_args()
    print("share of rounds that can be unmasked (rows: devices, neighbours, threshold; columns: dropout)")
    print("devices  k    threshold  " + "  ".join(f"{d:>5.0%}" for d in DROPOUTS))
    for n in args.devices:
        base = suggested_neighbours(n)
        for k in (base, 2 * base):
            for threshold in THRESHOLDS:
                shares = [unmaskable_share(n, k, threshold, d, args.trials, 0) for d in DROPOUTS]
                print(f"{n:>7}  {k:<4} {threshold:>9.2f}  " + "  ".join(f"{s:>5.0%}" for s in shares))
    return 0


if __name__ == "__main__":
    sys.exit(main())
