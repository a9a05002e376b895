"""The benchmarks' 95% intervals and ceilings: every figure beside its interval over the evaluated
users (or devices, or roles), combined figures resampled in pairs, each row naming its ceiling."""

from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks.figures import (
    draws,
    mean_over_runs_interval,
    paired_interval,
    total,
    user_intervals,
    with_intervals,
)
from benchmarks.implicit import TopK, lift, score
from benchmarks.mixing_study import CEILING, StrategyResult, ceiling_share, table_line
from benchmarks.nextword_study import CEILING as NEXTWORD_CEILING
from benchmarks.nextword_study import Row, rows_json, share_interval, share_of_the_way, table
from benchmarks.quality_report import CEILINGS, MethodResult, quality_table
from model_runtime.tflite_model import EvaluationSums


def _users(n: int, seed: int = 0, skill: float = 0.4) -> list[EvaluationSums]:
    """`n` users' evaluation sums: 5-60 ratings each, squared errors about 1, right about `skill`."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        weight = float(rng.integers(5, 60))
        out.append(
            EvaluationSums(
                {
                    "weight_sum": weight,
                    "squared_error_sum": float(rng.gamma(2.0, 0.5, int(weight)).sum()),
                    "correct_sum": float(rng.binomial(int(weight), skill)),
                    "loss_sum": weight,
                }
            )
        )
    return out


def test_each_figure_lies_in_its_interval_and_the_interval_narrows_with_more_users() -> None:
    few, many = with_intervals(_users(40)), with_intervals(_users(640))

    for figures in (few, many):
        for metric in ("rmse", "accuracy"):
            low, high = figures["intervals"][metric]
            assert low < figures[metric] < high, metric
    assert (few["users"], many["users"]) == (40, 640)
    for metric in ("rmse", "accuracy"):
        narrow = np.diff(many["intervals"][metric])[0]
        wide = np.diff(few["intervals"][metric])[0]
        assert narrow < wide / 2.5, metric  # 16x the users: about a quarter of the width


def test_the_figure_is_the_example_weighted_one_over_all_users() -> None:
    users = _users(30)
    everyone = total(users).metrics()

    assert with_intervals(users)["rmse"] == everyone["rmse"]
    assert with_intervals(users)["accuracy"] == everyone["accuracy"]
    # Resampling every user once (the identity) gives the figure back.
    identity = np.arange(len(users))[None, :]
    assert draws(users, "rmse", identity)[0] == pytest.approx(everyone["rmse"])
    assert user_intervals([]) == {}


def test_a_run_against_itself_differs_by_nothing_in_every_paired_resample() -> None:
    users = _users(50)

    assert paired_interval(users, users, "rmse", np.subtract) == [0.0, 0.0]
    assert paired_interval(users, users, "accuracy", np.divide) == [1.0, 1.0]
    with pytest.raises(ValueError, match="same users"):
        paired_interval(users, users[:-1], "rmse", np.subtract)


def test_a_paired_difference_is_narrower_than_the_runs_own_intervals() -> None:
    # Two runs on the same users: the second a little better on each user, so the users' own
    # spread (most of each interval) cancels in the difference.
    users = _users(80)
    better = [
        EvaluationSums({**u.sums, "correct_sum": min(u.weight_sum, u.sums["correct_sum"] + 2)}) for u in users
    ]
    own = user_intervals(users)["accuracy"]
    gap = paired_interval(better, users, "accuracy", np.subtract)

    assert 0 < gap[0] <= gap[1]  # resolved: every resample has the second run ahead
    assert gap[1] - gap[0] < (own[1] - own[0]) / 2


def test_a_mean_over_user_splits_lies_in_its_interval() -> None:
    runs = [_users(40, seed) for seed in range(5)]
    mean = float(np.mean([total(r).metrics()["accuracy"] for r in runs]))

    low, high = mean_over_runs_interval(runs, "accuracy")

    assert low < mean < high
    alone = user_intervals(runs[0])["accuracy"]
    assert high - low < alone[1] - alone[0]  # five splits' users: narrower than one split's


def _result(method: str, users: list[EvaluationSums]) -> MethodResult:
    figures = with_intervals(users)
    test = {k: v for k, v in figures.items() if k != "intervals"}
    return MethodResult(
        method, "held-out test users, ReconEval", test, [], 1.0, {}, figures["intervals"], users
    )


def test_the_quality_table_sets_each_row_beside_its_ceiling_and_the_paired_gap() -> None:
    users = _users(60)
    results = {
        "fedrecon": _result("fedrecon", _users(60, seed=1)),
        "centralized_recon_eval": _result("centralized_recon_eval", users),
        "better": _result("better", users),
    }

    lines = quality_table(results).splitlines()

    fedrecon, central, better = lines[2:]
    ceiling_rmse = results["centralized_recon_eval"].test["rmse"]
    assert f"| centralized_recon_eval | {ceiling_rmse:.4f} [" in fedrecon
    assert "the ceiling of fedavg_recon_eval, fedavg_shared_user, fedrecon" in central
    assert "centralized_better_recon_eval (not run)" in better
    assert results["fedrecon"].to_json()["ceiling"] == CEILINGS["fedrecon"] == "centralized_recon_eval"
    assert results["centralized_recon_eval"].to_json()["ceiling"] is None
    assert "per_user" not in results["fedrecon"].to_json()


def test_implicit_scores_carry_intervals_for_both_figures_and_a_paired_lift() -> None:
    rng = np.random.default_rng(0)
    targets = list(range(200))
    # The target within the top 10 for about a third of the devices, at varying positions.
    ranked = [np.roll(np.arange(500), -(t - int(rng.integers(0, 30)))) for t in targets]
    popular = [np.arange(500) for _ in targets]

    mine, floor = score(ranked, targets), score(popular, targets)
    found = lift(mine, floor)

    for top in (mine, floor):
        assert top.hit_rate_interval[0] <= top.hit_rate <= top.hit_rate_interval[1]
        assert top.ndcg_interval[0] <= top.ndcg <= top.ndcg_interval[1]
        assert set(top.to_json()) == {"hit_rate@10", "ndcg@10", "hit_rate@10_95", "ndcg@10_95"}
    for name in ("hit_rate@10", "ndcg@10"):
        low, high = found[f"{name}_95"]
        assert low <= found[name] <= high, name
        low, high = found["difference"][f"{name}_95"]
        assert 0 < low <= found["difference"][name] <= high, name  # resolved: the target is often top-10
    assert "hit_rate@10_95" not in lift(mine, TopK(0.0, 0.0))  # unpaired: nothing to resample


def _strategy(name: str, hits: list[float]) -> StrategyResult:
    top = TopK(float(np.mean(hits)), 0.1, (0.0, 1.0), (0.0, 1.0), tuple(hits), tuple(0.5 * h for h in hits))
    return StrategyResult(name, None, top, top, 0.0, 1.0)


def test_mixing_rows_name_the_all_data_ceiling_and_their_share_of_it() -> None:
    rng = np.random.default_rng(1)
    ceiling_hits = (rng.random(90) < 0.3).astype(float)
    half = ceiling_hits * (rng.random(90) < 0.5)
    top, row = _strategy(CEILING, ceiling_hits.tolist()), _strategy("example_transfer", half.tolist())

    shared = ceiling_share(row, top)

    assert shared["ceiling"] == "all_data"
    low, high = shared["share_of_ceiling_new_items_95"]
    assert low <= shared["share_of_ceiling_new_items"] <= high < 1.0
    assert ceiling_share(top, top) == {"ceiling": None, "is_ceiling": True}
    assert "share_of_ceiling_new_items" not in ceiling_share(row, None)
    line = table_line({"data": "d", **row.to_json(), **shared})
    assert f"{shared['share_of_ceiling_new_items']:.2f} [{low:.2f}, {high:.2f}]" in line
    assert "(the ceiling)" in table_line({"data": "d", **top.to_json(), **ceiling_share(top, top)})


def _nextword_row(method: str, right: list[float], total_: list[float], floor: list[float]) -> Row:
    accuracy = sum(right) / sum(total_)
    return Row(
        1000,
        method,
        accuracy,
        accuracy,
        0,
        0.0,
        (sum(floor) / sum(total_), math.nan),
        (accuracy - 0.01, accuracy + 0.01),
        (accuracy - 0.01, accuracy + 0.01),
        ((0.0, 1.0), (math.nan, math.nan)),
        (tuple(right), tuple(total_)),
        (tuple(floor), tuple(total_)),
    )


def test_nextword_share_of_the_way_carries_a_paired_interval_and_the_json_names_the_ceiling() -> None:
    rng = np.random.default_rng(2)
    tokens = rng.integers(100, 400, 18).astype(float)
    floor = np.round(tokens * 0.07)
    top = _nextword_row(
        NEXTWORD_CEILING,
        np.round(tokens * rng.uniform(0.11, 0.15, 18)).tolist(),
        tokens.tolist(),
        floor.tolist(),
    )
    row = _nextword_row(
        "FedRecon", np.round(tokens * rng.uniform(0.08, 0.13, 18)).tolist(), tokens.tolist(), floor.tolist()
    )

    low, high = share_interval(row, top)

    assert low <= share_of_the_way(row, top) <= high
    found = rows_json([row, top])
    assert found[0]["ceiling"] == NEXTWORD_CEILING and found[1]["ceiling"] is None
    assert found[0]["share_of_the_way_95"] == [low, high]
    assert "(the ceiling)" in table([row, top])
    # Rows measured without per-role counts have no interval to give.
    bare = Row(1000, "m", 0.1, 0.1, 0, 0.0, (0.06, 0.05))
    assert all(math.isnan(x) for x in share_interval(bare, top))
