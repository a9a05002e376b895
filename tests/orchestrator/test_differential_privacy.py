"""DP-FedAvg's server step and accountant, against hand-computed values and dp_accounting itself."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import RdpAccountant
from orchestrator.aggregation.differential_privacy import (
    DPConfig,
    adapt_clip_norm,
    epsilon,
    noised_mean,
    population_size_for,
    privacy_spent,
    rounds_within_budget,
    secure_rng,
)


def config(noise_multiplier: float = 1.0, clip_norm: float = 2.0, **overrides: object) -> DPConfig:
    return DPConfig.from_json(
        {"clip_norm": clip_norm, "noise_multiplier": noise_multiplier, "population_size": 1000, **overrides}
    )


# Two reports' clipped deltas, summed: [1, 2] + [3, 0] on a 2 x 2 tensor whose second row nobody touched.
UPDATE_SUM = {"rows": np.array([[4.0, 2.0], [0.0, 0.0]]), "scalar": np.array([6.0])}


def test_without_noise_the_noised_mean_is_the_plain_mean_of_the_clipped_updates() -> None:
    mean = noised_mean(UPDATE_SUM, 2, config(noise_multiplier=0.0), np.random.default_rng(0))

    np.testing.assert_array_equal(mean["rows"], [[2.0, 1.0], [0.0, 0.0]])
    np.testing.assert_array_equal(mean["scalar"], [3.0])
    assert mean["rows"].dtype == np.float32


def test_the_noise_is_centred_on_the_mean_with_stddev_z_c_over_n_on_every_coordinate() -> None:
    dp = config(noise_multiplier=1.5, clip_norm=2.0)  # noise on the sum: stddev 3; on the mean of 2: 1.5
    rng = np.random.default_rng(7)

    draws = [noised_mean(UPDATE_SUM, 2, dp, rng) for _ in range(20_000)]

    rows = np.stack([d["rows"] for d in draws])
    scalar = np.stack([d["scalar"] for d in draws])
    # 20,000 draws: the mean's standard error is 1.5 / sqrt(20000) ~ 0.011, the stddev's ~ 0.0075.
    np.testing.assert_allclose(rows.mean(axis=0), [[2.0, 1.0], [0.0, 0.0]], atol=0.05)
    np.testing.assert_allclose(scalar.mean(axis=0), [3.0], atol=0.05)
    np.testing.assert_allclose(rows.std(axis=0), np.full((2, 2), 1.5), rtol=0.03)
    np.testing.assert_allclose(scalar.std(axis=0), [1.5], rtol=0.03)
    # The coordinates' noise is independent (the untouched row included).
    assert abs(np.corrcoef(rows[:, 0, 0], rows[:, 1, 1])[0, 1]) < 0.05


def test_a_seeded_generator_repeats_its_noise_and_the_production_one_does_not() -> None:
    dp = config()

    same = [noised_mean(UPDATE_SUM, 2, dp, np.random.default_rng(3))["rows"] for _ in range(2)]
    fresh = [noised_mean(UPDATE_SUM, 2, dp, secure_rng())["rows"] for _ in range(2)]

    np.testing.assert_array_equal(same[0], same[1])
    assert not np.array_equal(fresh[0], fresh[1])


def test_noised_mean_refuses_a_round_without_reports() -> None:
    with pytest.raises(ValueError, match="num_reports must be an integer >= 1"):
        noised_mean(UPDATE_SUM, 0, config(), np.random.default_rng(0))


def test_epsilon_grows_with_rounds_and_matches_dp_accounting_composed_directly() -> None:
    z, q, delta = 1.1, 100 / 754, 1e-5

    ours = [epsilon(z, q, k, delta) for k in (1, 10, 100, 500)]

    for k, mine in zip((1, 10, 100, 500), ours, strict=True):
        accountant = RdpAccountant()
        accountant.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z)), k)
        assert mine == pytest.approx(accountant.get_epsilon(delta), rel=1e-9)
    assert ours == sorted(ours) and ours[0] < ours[-1]
    assert epsilon(z, q, 0, delta) == 0.0
    assert epsilon(0.0, q, 1, delta) == math.inf


def test_rounds_within_budget_is_the_last_round_whose_epsilon_fits() -> None:
    z, q, delta, budget = 1.0, 0.01, 1e-5, 2.0

    allowed = rounds_within_budget(z, q, delta, budget)

    assert allowed > 1
    assert epsilon(z, q, allowed, delta) <= budget < epsilon(z, q, allowed + 1, delta)


def test_privacy_spent_says_when_the_budget_is_spent() -> None:
    dp = config(epsilon_budget=2.0)  # sampling rate 10 / 1000
    allowed = rounds_within_budget(1.0, 0.01, 1e-5, 2.0)

    before, at = privacy_spent(dp, 10, allowed - 1), privacy_spent(dp, 10, allowed)

    assert not before.budget_spent and "1 more rounds within the budget" in before.message()
    assert at.budget_spent and "privacy budget spent" in at.message()
    assert "no differential privacy guarantee" in privacy_spent(config(0.0), 10, 3).message()


def test_population_size_for_a_target_epsilon_is_the_smallest_that_reaches_it() -> None:
    z, per_round, rounds, delta = 1.0, 100, 50, 1e-5

    size = population_size_for(5.0, z, per_round, rounds, delta)

    assert (
        epsilon(z, per_round / size, rounds, delta) <= 5.0 < epsilon(z, per_round / (size - 1), rounds, delta)
    )
    with pytest.raises(ValueError, match="without noise"):
        population_size_for(5.0, 0.0, per_round, rounds, delta)


def test_adaptive_clipping_moves_the_clip_norm_towards_the_target_quantile() -> None:
    exact = config(0.0, target_unclipped_quantile=0.5, clip_learning_rate=0.2, clipped_count_stddev=0.0)
    rng = np.random.default_rng(0)

    shrunk, share = adapt_clip_norm(2.0, 8, 10, exact, rng)  # 80% unclipped: the norm is too large
    grown, none = adapt_clip_norm(2.0, 0, 10, exact, rng)

    assert share == pytest.approx(0.8) and shrunk == pytest.approx(2.0 * math.exp(-0.2 * 0.3))
    assert none == pytest.approx(0.0) and grown == pytest.approx(2.0 * math.exp(0.2 * 0.5))


def test_adaptive_clipping_pays_for_the_count_out_of_the_deltas_noise() -> None:
    dp = config(1.0, target_unclipped_quantile=0.5, clipped_count_stddev=5.0)
    rng = np.random.default_rng(1)

    shares = [adapt_clip_norm(2.0, 5, 10, dp, rng)[1] for _ in range(20_000)]

    # (z^-2 - (2 sigma_b)^-2)^-1/2 with z = 1, sigma_b = 5; the two together cost what z alone does.
    assert dp.delta_noise_multiplier == pytest.approx((1 - 1 / 100) ** -0.5)
    assert dp.noise_stddev(3.0) == pytest.approx(3.0 * (1 - 1 / 100) ** -0.5)
    # The share's noise: sigma_b / reports.
    assert np.mean(shares) == pytest.approx(0.5, abs=0.01) and np.std(shares) == pytest.approx(0.5, rel=0.03)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"clip_norm": 0, "noise_multiplier": 1, "population_size": 100}, "clip_norm must be > 0"),
        ({"clip_norm": 1, "noise_multiplier": -1, "population_size": 100}, "noise_multiplier must be >= 0"),
        ({"clip_norm": 1, "noise_multiplier": 1, "population_size": 1.5}, "population_size must be"),
        (
            {"clip_norm": 1, "noise_multiplier": 1, "population_size": 10, "target_delta": 0.2},
            "must be < 1 / population_size",
        ),
        (
            {"clip_norm": 1, "noise_multiplier": 0, "population_size": 100, "epsilon_budget": 3},
            "needs noise_multiplier > 0",
        ),
        ({"clip_norm": 1, "noise_multiplier": 1}, r"need \['population_size'\]"),
        ({"clip_norm": 1, "noise_multiplier": 1, "population_size": 100, "sigma": 2}, "unknown"),
        ({"clip_norm": float("nan"), "noise_multiplier": 1, "population_size": 100}, "finite number"),
        (
            {"clip_norm": 1, "noise_multiplier": 1, "population_size": 100, "target_unclipped_quantile": 0.5},
            "adaptive clipping needs clipped_count_stddev",
        ),
        (
            {
                "clip_norm": 1,
                "noise_multiplier": 1,
                "population_size": 100,
                "target_unclipped_quantile": 0.5,
                "clipped_count_stddev": 0.5,
            },
            r"clipped_count_stddev \(0.5\) must be > noise_multiplier / 2",
        ),
        (
            {
                "clip_norm": 1,
                "noise_multiplier": 1,
                "population_size": 100,
                "target_unclipped_quantile": 1.5,
                "clipped_count_stddev": 5,
            },
            r"target_unclipped_quantile must be in \(0, 1\)",
        ),
    ],
)
def test_bad_settings_are_refused_with_what_was_expected(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DPConfig.from_json(settings)
