"""How far rounds made only of hostile devices move the model, under the reference-norm rule
before issue 26 (at most 1.25x a round) and the current one (orchestrator/aggregation/norm_reference.py).

    python -m benchmarks.norm_bound [--honest-rounds 200] [--reports 20] [--seed 0]

The server's own aggregation (orchestrator.aggregation.assemble.Pipeline, as the commit runs it:
per-tensor clipping to norm_clip_multiple x the reference, weights capped, the weighted mean) on a
MovieLens-shaped model's global tensors (global_mean (1,), item_bias (200,), item_embeddings
(200, 16)) with the server optimizer SGD
at learning rate 1. First `--honest-rounds` rounds of honest-looking reports: each device
changes 10 item rows and the global mean by N(0, s) with s shrinking as training converges
(0.02 -> 0.005). Then k = 1, 10, 100 rounds in a row where every report is hostile (+1000 on
every coordinate it touches: the global mean and 10 item rows). Prints, per rule and k: how far
the global mean moved (the issue's "bias") and the item table's L2 change, and the reference
norm of the global mean after the k rounds as a multiple of its value before them; and the share
of honest reports clipped during the honest phase (what a tighter rule costs honest devices).

Deterministic (no timing): one run per rule, machine load does not matter.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from contracts.params import Params, SparseTensor
from orchestrator.aggregation.assemble import Pipeline, RoundInputs
from orchestrator.aggregation.norm_reference import NormReference
from orchestrator.aggregation.registry import RobustAggregation
from orchestrator.aggregation.robust import plan_round, tensor_norms

ITEMS, DIM, ROWS = 200, 16, 10
SHAPES = {"global_mean": (1,), "item_bias": (ITEMS,), "item_embeddings": (ITEMS, DIM)}
RULES = {
    "before (1.25x a round)": RobustAggregation(reference_history_rounds=1, reference_window_rounds=0),
    "now (median of 25, 2x per 100)": RobustAggregation(),
}
HOSTILE_RUNS = (1, 10, 100)


def report(rng: np.random.Generator, scale: float | None) -> dict[str, SparseTensor]:
    """An honest-looking delta with noise `scale`, or (None) a hostile one: +1000 everywhere."""
    rows = np.sort(rng.choice(ITEMS, ROWS, replace=False)).astype(np.int32)

    def values(shape: tuple[int, ...]) -> np.ndarray:
        if scale is None:
            return np.full(shape, 1000.0, np.float32)
        return rng.normal(0.0, scale, shape).astype(np.float32)

    return {
        "global_mean": SparseTensor((1,), np.array([0], np.int32), values((1,))),
        "item_bias": SparseTensor((ITEMS,), rows, values((ROWS,))),
        "item_embeddings": SparseTensor((ITEMS, DIM), rows, values((ROWS, DIM))),
    }


def play(
    rule: RobustAggregation, honest_rounds: int, hostile_rounds: int, reports: int, seed: int
) -> tuple[Params, Params, float, float, float]:
    """(params before the hostile rounds, after them, the global mean's reference before and
    after them, the share of honest reports clipped)."""
    rng = np.random.default_rng(seed)
    pipeline = Pipeline(SHAPES, rule)
    params: Params = {name: np.zeros(shape, np.float64) for name, shape in SHAPES.items()}
    state: NormReference | None = None
    clipped = total = 0
    before: Params = {}
    reference_before = 0.0
    for r in range(honest_rounds + hostile_rounds):
        hostile = r >= honest_rounds
        if r == honest_rounds:
            before = {name: value.copy() for name, value in params.items()}
            reference_before = state.reference["global_mean"] if state else 0.0
        scale = None if hostile else 0.005 + 0.015 * 0.98**r
        deltas = [report(rng, scale) for _ in range(reports)]
        weights = [float(rng.integers(5, 50)) for _ in range(reports)]
        if not hostile:
            bounds = plan_round(weights, [tensor_norms(d) for d in deltas], state, rule).bounds
            clipped += sum(any(norm > bounds[name] for name, norm in tensor_norms(d).items()) for d in deltas)
            total += reports
        result = pipeline.aggregate(
            RoundInputs(0, weights=weights, reference=state), zip(deltas, weights, strict=True)
        )
        state = result.norm_reference
        for name in params:
            params[name] += result.mean_delta[name]
    assert state is not None
    return before, params, reference_before, state.reference["global_mean"], clipped / max(total, 1)


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.norm_bound",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--honest-rounds", type=int, default=200)
    parser.add_argument("--reports", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.honest_rounds < 1 or args.reports < 1:
        print("error: --honest-rounds and --reports must be >= 1", file=sys.stderr)
        return 2

    print(
        f"{args.honest_rounds} honest rounds, then k hostile-only rounds; {args.reports} reports a round; "
        f"seed {args.seed}"
    )
    print(
        "| rule | k | global mean moved | item table moved (L2) | reference after / before | "
        "honest reports clipped |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, rule in RULES.items():
        for k in HOSTILE_RUNS:
            before, after, ref_before, ref_after, honest_clipped = play(
                rule, args.honest_rounds, k, args.reports, args.seed
            )
            mean_moved = float(abs(after["global_mean"][0] - before["global_mean"][0]))
            table_moved = float(np.linalg.norm(after["item_embeddings"] - before["item_embeddings"]))
            print(
                f"| {name} | {k} | {mean_moved:.3g} | {table_moved:.3g} | {ref_after / ref_before:.3g} | "
                f"{honest_clipped:.1%} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
