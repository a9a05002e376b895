"""Synthetic expression sharing: a catalog of GIFs, stickers and emoji, and users who share them.

What it imitates, and why each part is there:
- **Zipf popularity**: a few expressions (the thumbs-up, the laughing face) are shared by
  everyone, the long tail rarely; a global top-10 is a strong baseline to beat.
- **Latent tastes**: each expression belongs to a topic (cats, football, ...) and has a
  vector near its topic's; each user cares about one to three topics. This is the signal a
  personalized model can learn and a popularity ranking cannot.
- **Heavy-tailed activity**: shares per user are log-normal, so many devices hold one or two
  examples and a few hold hundreds (the deployment lesson behind `min_examples` and reusing
  examples for support and query).
- **Timestamps** over a window of days with a daily rhythm, so "newest" and time-based
  splits mean something.
Implicit feedback: every share is a positive; what a user did not share is unlabelled.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

TOPICS = (
    "cat", "dog", "football", "pizza", "heart", "party", "coffee", "rain", "dance", "music",
    "beach", "robot", "birthday", "sleepy", "money", "ghost", "rocket", "taco", "yoga", "panda",
)  # fmt: skip
MOODS = (
    "happy", "sad", "angry", "dancing", "laughing", "crying", "surprised", "cool", "sleepy",
    "excited", "confused", "proud", "shy", "silly", "tired", "grateful",
)  # fmt: skip


# A user's taste (the prior `android_sim.bayes_ceiling` integrates over): 1 to MAX_LIKED_TOPICS
# distinct topics, uniform in number then in which, their centroids summed plus Gaussian noise of
# this scale in every dimension, made a unit vector.
MAX_LIKED_TOPICS = 3
TASTE_NOISE = 0.3


class ExpressionKind(enum.StrEnum):
    GIF = "gif"
    STICKER = "sticker"
    EMOJI = "emoji"


KIND_SHARES = {ExpressionKind.GIF: 0.45, ExpressionKind.STICKER: 0.35, ExpressionKind.EMOJI: 0.20}


@dataclass(frozen=True)
class Expression:
    expression_id: int  # the model's item index
    name: str
    kind: ExpressionKind
    topic: str


@dataclass(frozen=True)
class ExpressionCatalog:
    expressions: tuple[Expression, ...]
    popularity: np.ndarray  # float64, sums to 1: the Zipf prior over expressions

    def __len__(self) -> int:
        return len(self.expressions)

    def label(self, expression_id: int) -> str:
        e = self.expressions[expression_id]
        return f"{e.name} ({e.kind.value})"


@dataclass(frozen=True)
class UserShares:
    """One user's shares, oldest first; each is a positive example for its expression."""

    user_id: int
    item_ids: np.ndarray  # int64
    timestamps: np.ndarray  # int64, unix seconds, non-decreasing
    taste: np.ndarray  # float64 unit vector: with the catalog's vectors, the user's share probabilities

    def __len__(self) -> int:
        return len(self.item_ids)


@dataclass(frozen=True)
class SyntheticConfig:
    num_expressions: int = 1000
    num_users: int = 2000
    num_topics: int = 12  # at most len(TOPICS)
    taste_dim: int = 16
    zipf_exponent: float = 0.8
    taste_strength: float = 8.0  # how much tastes outweigh popularity (0: everyone samples the Zipf prior)
    activity_log_mean: float = 1.3  # shares per user ~ ceil(LogNormal(mean, sigma))
    activity_log_sigma: float = 1.3
    max_shares: int = 400
    days: int = 28
    start_time: int = 1_767_225_600  # 2026-01-01 UTC
    seed: int = 0

    def __post_init__(self) -> None:
        problems = []
        for name in ("num_expressions", "num_users", "num_topics", "taste_dim", "max_shares", "days"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_topics > len(TOPICS):
            problems.append(f"num_topics must be <= {len(TOPICS)}, got {self.num_topics}")
        if self.zipf_exponent < 0 or self.taste_strength < 0 or self.activity_log_sigma < 0:
            problems.append("zipf_exponent, taste_strength and activity_log_sigma must be >= 0")
        if problems:
            raise ValueError("invalid synthetic config: " + "; ".join(problems))


@dataclass(frozen=True)
class SyntheticExpressions:
    catalog: ExpressionCatalog
    users: tuple[UserShares, ...]
    config: SyntheticConfig
    item_vectors: np.ndarray  # float64 (num_expressions, taste_dim), unit rows
    topic_centroids: np.ndarray  # float64 (num_topics, taste_dim), unit rows: the tastes' prior

    @property
    def item_topics(self) -> np.ndarray:
        """Each expression's topic as an index into TOPICS (public catalog metadata)."""
        return np.array([TOPICS.index(e.topic) for e in self.catalog.expressions], np.int64)

    def share_probabilities(self, user: UserShares) -> np.ndarray:
        """The probability of each expression being the user's next share: every share is an
        independent draw from this (the ground truth the evaluation's expected hit rate uses)."""
        return _share_probabilities(
            np.log(self.catalog.popularity), self.item_vectors, user.taste, self.config
        )


def _catalog(config: SyntheticConfig, rng: np.random.Generator) -> tuple[ExpressionCatalog, np.ndarray]:
    n = config.num_expressions
    topics = rng.integers(0, config.num_topics, n)
    kinds = rng.choice(list(KIND_SHARES), size=n, p=list(KIND_SHARES.values()))
    moods = rng.integers(0, len(MOODS), n)
    seen: dict[str, int] = {}
    expressions = []
    for i in range(n):
        base = f"{MOODS[moods[i]]} {TOPICS[topics[i]]}"
        seen[base] = seen.get(base, 0) + 1
        name = base if seen[base] == 1 else f"{base} {seen[base]}"
        expressions.append(Expression(i, name, ExpressionKind(kinds[i]), TOPICS[topics[i]]))
    # Zipf over a random order, so popularity is independent of id and topic.
    ranks = rng.permutation(n) + 1
    weights = 1.0 / ranks.astype(np.float64) ** config.zipf_exponent
    centroids = _unit(rng.normal(size=(config.num_topics, config.taste_dim)))
    vectors = _unit(
        centroids[topics] + 0.35 * rng.normal(size=(n, config.taste_dim)) / np.sqrt(config.taste_dim)
    )
    return ExpressionCatalog(tuple(expressions), weights / weights.sum()), np.concatenate(
        [vectors, centroids]
    )


def _unit(x: np.ndarray) -> np.ndarray:
    return np.asarray(x / np.linalg.norm(x, axis=-1, keepdims=True))


def _timestamps(count: int, config: SyntheticConfig, rng: np.random.Generator) -> np.ndarray:
    days = rng.integers(0, config.days, count)
    # A daily rhythm: most shares in the afternoon and evening, few at night.
    hours = np.clip(rng.normal(16.0, 4.0, count), 0.0, 23.99)
    seconds = days * 86_400 + (hours * 3_600).astype(np.int64)
    return np.sort(config.start_time + seconds).astype(np.int64)


def generate_expressions(config: SyntheticConfig = SyntheticConfig()) -> SyntheticExpressions:
    """The catalog and every user's shares; deterministic in `config.seed`."""
    rng = np.random.default_rng(config.seed)
    catalog, vectors = _catalog(config, rng)
    item_vectors, centroids = vectors[: config.num_expressions], vectors[config.num_expressions :]
    log_popularity = np.log(catalog.popularity)
    users = []
    for user_id in range(config.num_users):
        liked = rng.choice(config.num_topics, size=int(rng.integers(1, MAX_LIKED_TOPICS + 1)), replace=False)
        taste = _unit(centroids[liked].sum(axis=0) + TASTE_NOISE * rng.normal(size=config.taste_dim))
        p = _share_probabilities(log_popularity, item_vectors, taste, config)
        count = min(
            config.max_shares,
            int(np.ceil(rng.lognormal(config.activity_log_mean, config.activity_log_sigma))),
        )
        items = rng.choice(config.num_expressions, size=count, p=p).astype(np.int64)
        users.append(UserShares(user_id, items, _timestamps(count, config, rng), taste))
    return SyntheticExpressions(catalog, tuple(users), config, item_vectors, centroids)


def share_logits(
    log_popularity: np.ndarray, item_vectors: np.ndarray, tastes: np.ndarray, config: SyntheticConfig
) -> np.ndarray:
    """The unnormalised log share probabilities of one taste (taste_dim,) or of each row (n, taste_dim)."""
    # One taste as the generator has always computed it (its draws depend on these very bits).
    affinity = item_vectors @ tastes if tastes.ndim == 1 else tastes @ item_vectors.T
    return np.asarray(log_popularity + config.taste_strength * affinity)


def _share_probabilities(
    log_popularity: np.ndarray, item_vectors: np.ndarray, taste: np.ndarray, config: SyntheticConfig
) -> np.ndarray:
    logits = share_logits(log_popularity, item_vectors, taste, config)
    p = np.exp(logits - logits.max())
    return np.asarray(p / p.sum())
