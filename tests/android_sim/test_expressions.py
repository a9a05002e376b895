import numpy as np
import pytest

from android_sim.expressions import ExpressionKind, SyntheticConfig, generate_expressions


def test_generation_is_deterministic_in_the_seed() -> None:
    a = generate_expressions(SyntheticConfig(num_users=50, seed=3))
    b = generate_expressions(SyntheticConfig(num_users=50, seed=3))
    c = generate_expressions(SyntheticConfig(num_users=50, seed=4))

    assert [u.item_ids.tolist() for u in a.users] == [u.item_ids.tolist() for u in b.users]
    assert [u.item_ids.tolist() for u in a.users] != [u.item_ids.tolist() for u in c.users]


def test_activity_is_heavy_tailed_and_shares_are_valid() -> None:
    config = SyntheticConfig(num_expressions=300, num_users=1500, seed=1)

    data = generate_expressions(config)

    counts = np.array([len(u) for u in data.users])
    assert (counts <= 2).mean() > 0.25  # many devices with one or two shares
    assert counts.max() >= 100  # a few with hundreds
    for user in data.users:
        assert ((user.item_ids >= 0) & (user.item_ids < 300)).all()
        assert (np.diff(user.timestamps) >= 0).all()
        assert user.timestamps.min() >= config.start_time
    assert {e.kind for e in data.catalog.expressions} == set(ExpressionKind)
    assert len({e.name for e in data.catalog.expressions}) == 300


def test_popularity_is_zipf_and_tastes_personalize() -> None:
    data = generate_expressions(SyntheticConfig(num_expressions=500, num_users=2000, seed=2))

    shares = np.bincount(np.concatenate([u.item_ids for u in data.users]), minlength=500)
    ranked = np.sort(shares)[::-1]
    assert ranked[0] > 10 * ranked[50]  # a head and a long tail
    # Tastes: a user's shares concentrate on few topics, far more than the popularity prior would.
    topic_of = np.array([e.topic for e in data.catalog.expressions])
    heavy = [u for u in data.users if len(u) >= 30]
    top_topic_share = np.mean(
        [np.unique(topic_of[u.item_ids], return_counts=True)[1].max() / len(u) for u in heavy]
    )
    prior = np.unique(topic_of, return_counts=True)
    assert top_topic_share > 2 * prior[1].max() / 500


def test_invalid_config_says_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="num_topics must be <= 20"):
        SyntheticConfig(num_topics=40)
