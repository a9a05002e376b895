"""The Bayes ceiling: the posterior predictive top-10 under the generator's prior, and its ESS."""

from dataclasses import dataclass

import numpy as np
import pytest
from rich.console import Console

from android_sim import bayes_ceiling as bayes_ceiling_module
from android_sim.bayes_ceiling import BayesCeiling, TastePrior, _ess, _Likelihood, bayes_ceiling
from android_sim.ceilings import oracle_tops, top_k
from android_sim.expressions import SyntheticConfig, SyntheticExpressions, generate_expressions
from android_sim.hit_rates import ScoredDevice, evaluate, expected_hit_rate
from android_sim.recommendations import HitRates
from android_sim.run_report import history_table, hit_rate_table

CONFIG = SyntheticConfig(num_expressions=150, num_users=160, num_topics=6, taste_dim=8, seed=3)


@dataclass(frozen=True)
class Fleet:
    data: SyntheticExpressions
    histories: list[np.ndarray]
    truth: np.ndarray  # (users, items): the true share probabilities
    ceiling: BayesCeiling


@pytest.fixture(scope="module")
def fleet() -> Fleet:
    data = generate_expressions(CONFIG)
    # Each user's past (all but the newest fifth) is its history; the truth scores the next share.
    histories = [u.item_ids[: max(1, len(u) - len(u) // 5)] for u in data.users]
    truth = np.stack([data.share_probabilities(u) for u in data.users])
    return Fleet(data, histories, truth, bayes_ceiling(data, histories, min_ess=300, pool=8_000))


def test_the_ceiling_sits_between_the_prior_s_top_10_and_the_oracle(fleet: Fleet) -> None:
    data, truth, ceiling = fleet.data, fleet.truth, fleet.ceiling
    prior = TastePrior.of(data)
    draws = prior.sample(20_000, np.random.default_rng(7))
    prior_top = top_k(np.exp(_Likelihood(data).log_probabilities(draws)).mean(axis=0))[0]

    def mean_expected(tops: np.ndarray) -> float:
        return float(np.mean([expected_hit_rate(top, p) for top, p in zip(tops, truth, strict=True)]))

    bayes, oracle = mean_expected(ceiling.tops), mean_expected(oracle_tops(truth))
    no_history = mean_expected(np.tile(prior_top, (len(truth), 1)))
    assert no_history + 0.05 < bayes < oracle  # the history is worth much, the true taste more
    assert np.allclose(ceiling.predictive.sum(axis=1), 1.0)


def test_every_device_s_estimate_has_the_effective_samples_asked_for(fleet: Fleet) -> None:
    histories, ceiling = fleet.histories, fleet.ceiling
    assert ceiling.ess.shape == (len(histories),) and (ceiling.ess >= 300).all()
    assert (ceiling.ess <= ceiling.draws).all()
    sizes = np.array([len(h) for h in histories])
    # Light devices are served by the prior's shared pool; the heaviest need draws of their own.
    assert (ceiling.draws[sizes == 1] == 8_000).all() and (ceiling.draws[sizes >= 30] < 8_000).all()
    summary = ceiling.to_json()
    assert summary["min_ess"] == pytest.approx(ceiling.ess.min())
    assert summary["median_ess"] == pytest.approx(np.median(ceiling.ess))
    # The ESS is (sum w)^2 / sum w^2: all draws for equal weights, one for a single one.
    assert _ess(np.zeros(40)) == pytest.approx(40)
    assert _ess(np.array([0.0, -800.0, -900.0])) == pytest.approx(1)


def test_the_adapted_sampler_agrees_with_plain_sampling_from_the_prior(fleet: Fleet) -> None:
    data, histories = fleet.data, fleet.histories
    # A device of a few examples: many prior draws estimate its posterior predictive directly.
    device = next(i for i, h in enumerate(histories) if 6 <= len(h) <= 9)
    adapted = bayes_ceiling(data, [histories[device]], min_ess=400, pool=500)  # too few: it adapts
    assert adapted.draws[0] != 500 and adapted.ess[0] >= 400
    plain = bayes_ceiling(data, [histories[device]], min_ess=400, pool=200_000, seed=1)
    assert plain.draws[0] == 200_000
    assert 0.5 * np.abs(adapted.predictive[0] - plain.predictive[0]).sum() < 0.05


def test_the_prior_is_the_generator_s(fleet: Fleet) -> None:
    data = fleet.data
    prior = TastePrior.of(data)
    assert len(prior.means) == 6 + 15 + 20 and np.exp(prior.log_weights).sum() == pytest.approx(1.0)
    draws = prior.sample(20_000, np.random.default_rng(0))
    tastes = draws / np.linalg.norm(draws, axis=1, keepdims=True)
    users = np.stack([u.taste for u in data.users])
    # Each taste's closeness to its nearest topic: the same distribution for users and the prior.
    nearest = [np.sort((t @ data.topic_centroids.T).max(axis=1)) for t in (users, tastes)]
    assert abs(nearest[0].mean() - nearest[1].mean()) < 0.03
    # The mixture's density, term by term.
    x = draws[:3]
    direct = [
        np.log(
            sum(
                np.exp(w)
                * np.exp(-((xi - m) ** 2).sum() / (2 * 0.09))
                / (2 * np.pi * 0.09) ** (x.shape[1] / 2)
                for w, m in zip(prior.log_weights, prior.means, strict=True)
            )
        )
        for xi in x
    ]
    assert np.allclose(prior.log_density(x), direct)


def test_the_tables_show_the_bayes_row_and_its_effective_samples_and_the_report_carries_them(
    fleet: Fleet,
) -> None:
    data, histories, truth, ceiling = fleet.data, fleet.histories, fleet.truth, fleet.ceiling
    scored = [
        ScoredDevice(
            i,
            len(h),
            data.users[i].item_ids[len(h) :],
            truth[i],
            {
                "personalized": ceiling.tops[i][::-1],
                "most_shared": top_k(truth.mean(0))[0],
                "bayes": ceiling.tops[i],
            },
        )
        for i, h in enumerate(histories)
    ]
    rates = HitRates(evaluate(scored), scored, bayes=ceiling)
    console = Console(width=250, record=True)
    console.print(hit_rate_table(rates))
    console.print(history_table(rates))
    text = " ".join(console.export_text().split())  # the caption wraps at the table's width
    assert text.count("Bayes *") == 2
    assert f"effective sample size min {ceiling.ess.min():,.0f}, median {np.median(ceiling.ess):,.0f}" in text
    found = rates.to_json()
    assert found["bayes_ceiling"]["min_ess"] == pytest.approx(ceiling.ess.min())
    assert "bayes" in found["methods"] and "bayes" in found["differences"]
    assert found["differences"]["bayes"]["expected"]["value"] == pytest.approx(0.0, abs=1e-12)  # same items


def test_devices_in_blocks_get_the_same_estimates(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    # The blocks bound the memory of a large fleet's (pool, devices) weights; they change nothing.
    monkeypatch.setattr(bayes_ceiling_module, "DEVICE_BLOCK", 7)
    blocked = bayes_ceiling(fleet.data, fleet.histories, min_ess=300, pool=8_000)
    np.testing.assert_array_equal(blocked.tops, fleet.ceiling.tops)
    np.testing.assert_allclose(blocked.ess, fleet.ceiling.ess)
