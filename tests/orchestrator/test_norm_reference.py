"""Hostile rounds cannot ratchet the learnt reference norm up: over any window of
`reference_window_rounds` rounds it grows at most `reference_window_growth`, and a run of
hostile-only rounds shorter than half the history does not raise it at all."""

from __future__ import annotations

import numpy as np

from contracts.params import SparseTensor
from orchestrator.aggregation.assemble import Pipeline, RoundInputs
from orchestrator.aggregation.norm_reference import NormReference
from orchestrator.aggregation.registry import RobustAggregation

RULE = RobustAggregation()  # the server's defaults
SHAPES = {"bias": (1,)}


def bias_delta(value: float) -> dict[str, SparseTensor]:
    return {"bias": SparseTensor((1,), np.array([0], np.int32), np.array([value], np.float32))}


def run(rounds: list[list[float]], rule: RobustAggregation = RULE) -> tuple[list[float], float]:
    """The reference in force at each round, and how far the rounds moved the bias."""
    pipeline = Pipeline(SHAPES, rule)  # the server's plaintext rounds: clipped, capped, averaged
    state: NormReference | None = None
    references, moved = [], 0.0
    for values in rounds:
        weights = [10.0] * len(values)
        result = pipeline.aggregate(
            RoundInputs(0, weights=weights, reference=state),
            zip(map(bias_delta, values), weights, strict=True),
        )
        state = result.norm_reference
        assert state is not None
        references.append(state.reference["bias"])
        moved += float(result.mean_delta["bias"][0])
    return references, moved


def honest(rounds: int, seed: int = 0) -> list[list[float]]:
    rng = np.random.default_rng(seed)
    return [list(rng.normal(0.0, 0.02, 20)) for _ in range(rounds)]


def test_hostile_only_rounds_grow_the_reference_at_most_by_the_window_bound() -> None:
    before = honest(50)
    hostile = [[1000.0] * 20 for _ in range(300)]

    references, _ = run(before + hostile)

    window, growth = RULE.reference_window_rounds, RULE.reference_window_growth
    for t in range(len(references)):
        for later in references[t + 1 : t + 1 + window]:
            assert later <= growth * references[t] * (1 + 1e-9)
    start = references[len(before) - 1]
    assert references[-1] <= start * growth ** (1 + len(hostile) / window) * (1 + 1e-9)


def test_a_hostile_run_shorter_than_half_the_history_does_not_raise_it() -> None:
    before = honest(RULE.reference_history_rounds)
    hostile = [[1000.0] * 20 for _ in range(RULE.reference_history_rounds // 2)]

    references, _ = run(before + hostile)

    # The median of the history stays one of the honest rounds' median norms.
    largest_honest = max(float(np.median(np.abs(values))) for values in before)
    assert max(references[len(before) :]) <= largest_honest * (1 + 1e-6)


def test_how_far_k_hostile_rounds_move_the_model_is_bounded() -> None:
    before = honest(50)
    start, moved_before = run(before)
    for k in (1, 10, 100):
        _, moved = run(before + [[1000.0] * 20 for _ in range(k)])
        reference = start[-1]
        # Each round moves it by at most the clip bound, norm_clip_multiple x the reference in
        # force, which the window bound keeps within growth^(1 + k / window) of where it was.
        bound = k * RULE.norm_clip_multiple * reference * RULE.reference_window_growth ** (1 + k / 100)
        assert 0 < moved - moved_before <= bound


def test_honest_rounds_keep_a_reference_near_their_median_norm() -> None:
    references, _ = run(honest(200, seed=3))

    # |N(0, 0.02)| has median 0.0135: the reference tracks it, not a multiple of it.
    assert 0.009 < references[-1] < 0.02


def test_the_earlier_per_round_rule_compounds_which_the_window_bound_stops() -> None:
    earlier = RobustAggregation(reference_history_rounds=1, reference_window_rounds=0)
    rounds = honest(50) + [[1000.0] * 20 for _ in range(30)]

    then, _ = run(rounds, earlier)
    now, _ = run(rounds, RULE)

    assert then[-1] / then[49] > 1.25**29  # 1.25 a round, compounded
    assert now[-1] / now[49] <= RULE.reference_window_growth
