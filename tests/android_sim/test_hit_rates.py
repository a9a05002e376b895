"""The held-out evaluation's figures: expected hit rate, newest-share hit rate, intervals, ceilings."""

import numpy as np
import pytest

from android_sim.ceilings import SoftmaxMF, TopicRule, ceiling_tops, mf_training_sample, oracle_tops, top_k
from android_sim.expressions import SyntheticConfig, generate_expressions
from android_sim.hit_rates import ScoredDevice, evaluate, expected_hit_rate, future_hit_rate, history_bucket
from android_sim.intervals import bootstrap_means, bootstrap_ratio, per_device_sums_interval, resample_rows
from android_sim.run import future_count


def test_expected_hit_rate_of_the_oracle_is_the_mass_of_its_ten_most_probable_items() -> None:
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.full(200, 0.3))
    top = oracle_tops(p[None, :])[0]
    assert expected_hit_rate(top, p) == pytest.approx(np.sort(p)[-10:].sum())
    for _ in range(50):  # no other top-10 holds more of the mass
        other = rng.choice(200, 10, replace=False)
        assert expected_hit_rate(other, p) <= expected_hit_rate(top, p) + 1e-12
    assert expected_hit_rate(np.array([top[0], top[0]]), p) == pytest.approx(p[top[0]])  # counted once


def test_expected_hit_rate_is_the_long_run_hit_rate_of_draws() -> None:
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.full(100, 0.5))
    top = rng.choice(100, 10, replace=False)
    draws = rng.choice(100, size=40_000, p=p)
    assert future_hit_rate(top, draws) == pytest.approx(expected_hit_rate(top, p), abs=0.01)


def test_future_hit_rate_counts_each_kept_share() -> None:
    assert future_hit_rate(np.array([1, 2, 3]), np.array([1, 5, 3, 9])) == 0.5
    with pytest.raises(ValueError, match="no kept-aside share"):
        future_hit_rate(np.array([1]), np.zeros(0, np.int64))


def test_bootstrap_interval_covers_the_true_mean_about_95_percent_of_the_time() -> None:
    rng = np.random.default_rng(2)
    true_mean, trials, covered = 0.3, 300, 0
    for _ in range(trials):
        values = (rng.random(150) < true_mean).astype(np.float64)
        found = bootstrap_means(values, resample_rows(150, rng, 1000))
        assert found.low <= found.value <= found.high and found.devices == 150
        covered += found.low <= true_mean <= found.high
    assert 0.90 <= covered / trials <= 0.99  # 95% nominal; 300 trials put it within about +-3 points


def test_ratio_interval_is_the_example_weighted_figure_and_covers_it() -> None:
    rng = np.random.default_rng(4)
    weights = rng.integers(1, 50, 300).astype(np.float64)
    squared = np.array([rng.normal(0, 1.0, int(w)).__pow__(2).sum() for w in weights])
    sums = [{"squared_error_sum": s, "weight_sum": w} for s, w in zip(squared, weights, strict=True)]
    rmse = per_device_sums_interval(sums, "squared_error", root=True)
    assert rmse.value == pytest.approx(np.sqrt(squared.sum() / weights.sum()))
    assert rmse.low < 1.0 < rmse.high and rmse.high - rmse.low < 0.1  # the true RMSE is 1
    with pytest.raises(ValueError, match="no device with examples"):
        bootstrap_ratio(np.zeros(2), np.zeros(2), resample_rows(2, rng))


def test_history_buckets() -> None:
    assert [history_bucket(n) for n in (1, 2, 4, 5, 300)] == ["1", "2-4", "2-4", "5+", "5+"]
    with pytest.raises(ValueError, match="at least one example"):
        history_bucket(0)


def test_future_count_keeps_a_fifth_aside_and_never_all() -> None:
    assert [future_count(n) for n in (1, 2, 4, 10, 12, 100)] == [0, 1, 1, 2, 2, 20]


def _device(
    index: int, history: int, future: list[int], p: np.ndarray | None, **tops: list[int]
) -> ScoredDevice:
    return ScoredDevice(
        index, history, np.array(future, np.int64), p, {k: np.array(v) for k, v in tops.items()}
    )


def test_evaluate_scores_every_device_and_pairs_the_differences() -> None:
    p = np.full(20, 0.05)
    devices = [
        _device(0, 1, [], p, personalized=[0, 1], other=[0, 1]),  # one share: expected only
        _device(1, 3, [0, 5], p, personalized=[0, 1], other=[0, 1]),
        _device(2, 7, [1], p, personalized=[0, 1], other=[0, 1]),
    ]
    found = evaluate(devices)
    assert found.devices == 3 and found.devices_with_future == 2
    mine = found.methods["personalized"]
    assert mine.expected is not None and mine.expected.value == pytest.approx(0.1)
    assert mine.expected.devices == 3
    assert mine.newest is not None and mine.newest.value == pytest.approx(0.75)  # (1/2 + 1) / 2
    assert mine.by_history["1"]["newest"] is None  # the one-share device has nothing kept aside
    assert mine.by_history["5+"]["newest"] is not None and mine.by_history["5+"]["newest"].devices == 1
    same = found.differences["other"]["expected"]
    assert same is not None and (same.value, same.low, same.high) == (0.0, 0.0, 0.0)


def test_evaluate_without_ground_truth_has_no_expected_hit_rate() -> None:
    found = evaluate([_device(0, 2, [3], None, personalized=[3])])
    assert found.methods["personalized"].expected is None
    assert found.methods["personalized"].newest is not None


def test_topic_rule_ranks_the_history_s_topic_and_what_was_shared() -> None:
    topics = np.array([0, 0, 0, 1, 1, 1] * 5)
    popularity = np.arange(30, 0, -1).astype(np.float64)  # item 0 the most shared
    history = np.array([4, 4])  # topic 1, twice the same item
    top = TopicRule().tops([history], popularity, topics)[0]
    assert top[0] == 4  # the re-share bonus puts it first
    assert set(topics[top]) == {1}  # the ten best all of the history's topic


def test_centralized_mf_learns_planted_groups_better_than_popularity() -> None:
    rng = np.random.default_rng(3)
    num_items, groups = 60, 3
    group_of = np.arange(num_items) % groups
    weights = np.where(np.arange(num_items) < 30, 2.0, 1.0)  # a popular half

    def user(g: int, n: int) -> np.ndarray:
        p = weights * np.where(group_of == g, 20.0, 1.0)
        return rng.choice(num_items, size=n, p=p / p.sum())

    training = [user(i % groups, 15) for i in range(150)]
    mf = SoftmaxMF(dim=4, steps=150, fold_in_steps=100)
    items, bias = mf.fit(training, num_items)
    held = [user(g, 3) for g in range(groups)]
    tops = mf.tops(items, bias, held)
    for g, top in enumerate(tops):
        assert np.mean(group_of[top] == g) >= 0.8  # the device's group, not the popular items


def test_generator_probabilities_are_what_the_shares_were_drawn_from() -> None:
    data = generate_expressions(SyntheticConfig(num_expressions=100, num_users=300, seed=5))
    assert data.item_topics.shape == (100,)
    p = np.stack([data.share_probabilities(u) for u in data.users])
    assert np.allclose(p.sum(axis=1), 1.0)
    items = np.concatenate([u.item_ids for u in data.users])
    rows = np.concatenate([np.full(len(u), i) for i, u in enumerate(data.users)])
    # The drawn shares sit where the probability is: far above a uniform guess on average.
    assert p[rows, items].mean() > 5 / 100
    assert top_k(p).shape == (300, 10)


def test_the_centralized_mf_of_a_large_fleet_is_fitted_on_a_seeded_sample() -> None:
    rng = np.random.default_rng(4)
    training = [rng.integers(0, 40, size=rng.integers(1, 6)) for _ in range(30)]
    assert mf_training_sample(training, 30) == training  # a fleet under the limit: every device
    sample = mf_training_sample(training, 10)
    assert len(sample) == 10 and sample == mf_training_sample(training, 10)  # seeded
    ids = [next(i for i, t in enumerate(training) if t is s) for s in sample]
    assert ids == sorted(ids) and len(set(ids)) == 10  # distinct devices, in their order
    probabilities = np.full((2, 40), 1 / 40)
    topics = np.arange(40) % 4
    held = [np.array([1, 2]), np.array([3])]
    mf = SoftmaxMF()
    items, bias = mf.fit(sample, 40)
    capped = ceiling_tops(held, probabilities, topics, training, mf_devices=10)
    assert np.array_equal(capped["central_mf"], mf.tops(items, bias, held))


def test_a_user_table_s_hit_rate_table_has_no_expected_column_nor_true_probability() -> None:
    # Prepare: devices from a user's table (no generator's truth) and from the synthetic fleet
    from rich.console import Console

    from android_sim.recommendations import HitRates
    from android_sim.run_report import hit_rate_table

    def shown(p: np.ndarray | None) -> str:
        scored = [_device(i, 3, [i % 4], p, personalized=[0, 1], most_shared=[2, 3]) for i in range(6)]
        console = Console(width=200, record=True)
        console.print(hit_rate_table(HitRates(evaluate(scored), scored)))
        return console.export_text()

    # Execute
    users, synthetic = shown(None), shown(np.full(20, 0.05))

    # Assert
    assert "true probability" not in users and "expected" not in users and "ceilings" not in users
    assert "newest shares" in users and "FedRecon minus" in users
    assert "true probability" in synthetic and "expected" in synthetic


def test_ndcg_weighs_a_hit_by_its_rank() -> None:
    from android_sim.hit_rates import future_ndcg

    top = np.array([5, 7, 9])
    assert future_ndcg(top, np.array([5])) == 1.0
    assert future_ndcg(top, np.array([9])) == pytest.approx(1 / np.log2(4))
    assert future_ndcg(top, np.array([5, 1])) == 0.5  # a share outside the top scores 0


def test_cooccurrence_ranks_what_the_same_devices_shared() -> None:
    from android_sim.ceilings import Cooccurrence

    training = [np.array([0, 1]), np.array([0, 1]), np.array([2, 3]), np.array([2, 3, 3])]
    tops = Cooccurrence().tops([np.array([0]), np.array([3])], training, num_items=12)
    assert tops[0][:2].tolist() == [0, 1] and set(tops[1][:2].tolist()) == {2, 3}


def test_the_hit_rate_tables_show_every_figure_on_an_80_column_screen() -> None:
    # A log file or an 80-column terminal is 80 wide: the walk's simulate table cut its intervals
    # to "45.0 [39.5,…".
    from pathlib import Path

    from rich.console import Console

    from android_sim.recommendations import HitRates
    from android_sim.run_report import hit_rate_table
    from android_sim.simulation.ranking import ranking_table
    from contracts.manifest import load_manifest
    from contracts.task_config import TaskConfig

    rng = np.random.default_rng(0)
    scored = [
        _device(
            i,
            int(rng.integers(1, 9)),
            [int(rng.integers(0, 20))],
            np.full(20, 0.05),
            **{m: rng.permutation(20)[:10].tolist() for m in ("personalized", "most_shared", "global")},
        )
        for i in range(40)
    ]
    hit_rates = HitRates(evaluate(scored), scored)
    manifest = load_manifest(Path(__file__).parents[2] / "conformance" / "vectors" / "task" / "model")
    assert manifest.local_params  # the table has its global row, as a FedRecon model's has
    for table in (hit_rate_table(hit_rates), ranking_table(hit_rates, manifest, TaskConfig())):
        console = Console(width=80, record=True)
        console.print(table)
        shown = console.export_text()
        assert "…" not in shown and "+" in shown and "]" in shown, shown
