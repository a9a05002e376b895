"""What the held-out devices' top-10 could be, scored beside the federated model's on the same split.

- **oracle**: the generator's own probabilities (synthetic data only): the best any model could
  do knowing each user's true taste.
- **Bayes**: the generator's prior and items, the user's taste inferred from the history alone
  (`android_sim.bayes_ceiling`): the best any model can do from the device's data.
- **topic rule**: no training; the popularity counted over the training devices, weighted by how
  often the device's own history touches each expression's topic (public catalog metadata), with
  a bonus for what the device already shared (expressions are re-shared).
- **centralized MF**: softmax matrix factorization trained on every training device's shares
  pooled on one server (what federated training gives up by not seeing them); a held-out
  device's user vector is fitted to its history with the items fixed, as reconstruction does.
- **item co-occurrence**: no training; an item scores by its cosine similarity (over which
  training devices shared it) to each item of the device's history, with the same re-share bonus.

On a user's own table (no generator) the oracle is gone and the topic rule is a **group rule**
over the catalog's grouping feature, when the user names one (`table_ceiling_tops`).

All but the oracle need a server that saw every share: they are ceilings, not deployable baselines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

K = 10


def top_k(scores: np.ndarray, k: int = K) -> np.ndarray:
    """The `k` highest-scoring columns of each row, best first (ties by lower index)."""
    scores = np.atleast_2d(scores)
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def oracle_tops(probabilities: np.ndarray) -> np.ndarray:
    """(devices, k): each device's k most probable next shares."""
    return top_k(probabilities)


@dataclass(frozen=True)
class TopicRule:
    """score(item) = popularity(item) x (shares of the item's topic in the history + prior)
    x (1 + bonus x shares of the item itself in the history)."""

    topic_prior: float = 0.05  # a topic the device never touched still counts a little
    reshare_bonus: float = 1.0

    def tops(
        self, histories: Sequence[np.ndarray], popularity: np.ndarray, item_topics: np.ndarray
    ) -> np.ndarray:
        num_topics = int(item_topics.max()) + 1
        num_items = len(popularity)
        out = np.zeros((len(histories), K), np.int64)
        for row, history in enumerate(histories):
            per_topic = np.bincount(item_topics[history], minlength=num_topics) / max(1, len(history))
            own = np.bincount(history, minlength=num_items)
            score = popularity * (per_topic[item_topics] + self.topic_prior) * (1 + self.reshare_bonus * own)
            out[row] = top_k(score)[0]
        return out


@dataclass(frozen=True)
class Cooccurrence:
    """score(item) = sum over the history's shares h of cosine(h, item) + bonus x own shares of
    the item, the cosine between two items' columns of the training devices' (device, item) 0/1
    table; a tiny popularity term breaks ties among items no history item co-occurs with."""

    reshare_bonus: float = 1.0

    def tops(
        self, histories: Sequence[np.ndarray], training: Sequence[np.ndarray], num_items: int
    ) -> np.ndarray:
        shared = (_counts(training, num_items) > 0).astype(np.float64)
        together = shared.T @ shared
        popularity = np.diag(together).copy()
        norm = np.sqrt(np.maximum(popularity, 1.0))
        cosine = together / norm[:, None] / norm[None, :]
        np.fill_diagonal(cosine, 0.0)
        counts = _counts(histories, num_items)
        scores = (
            counts @ cosine + self.reshare_bonus * counts + 1e-6 * popularity / max(1.0, popularity.max())
        )
        return top_k(scores)


@dataclass(frozen=True)
class SoftmaxMF:
    """Full-softmax MF: P(item | user) = softmax(V u + b), trained with Adam on the pooled shares
    (the loss grouped by user, so a step costs one users x items product)."""

    dim: int = 8
    steps: int = 200
    learning_rate: float = 0.05
    l2: float = 3.0  # on each user and item vector (a MAP prior), against the sum of log-likelihoods
    fold_in_steps: int = 150
    seed: int = 0

    def fit(self, histories: Sequence[np.ndarray], num_items: int) -> tuple[np.ndarray, np.ndarray]:
        """(item vectors, item biases) from the training devices' histories."""
        rng = np.random.default_rng(self.seed)
        counts = _counts(histories, num_items)
        users = rng.normal(0, 0.1, (len(histories), self.dim))
        items = rng.normal(0, 0.1, (num_items, self.dim))
        bias = np.log(counts.sum(axis=0) + 1.0)
        bias -= bias.mean()
        params = [users, items, bias]
        adam = _Adam(params, self.learning_rate)
        total = counts.sum()
        for _ in range(self.steps):
            grad_logits = _softmax_grad(users @ items.T + bias, counts) / total
            adam.step(
                [
                    grad_logits @ items + self.l2 * users / total,
                    grad_logits.T @ users + self.l2 * items / total,
                    grad_logits.sum(axis=0),
                ]
            )
        return items, bias

    def tops(self, items: np.ndarray, bias: np.ndarray, histories: Sequence[np.ndarray]) -> np.ndarray:
        """Each device's top-k after fitting its user vector to its history, items fixed."""
        counts = _counts(histories, len(bias))
        users = np.zeros((len(histories), self.dim))
        adam = _Adam([users], self.learning_rate)
        shares = counts.sum(axis=1, keepdims=True)
        for _ in range(self.fold_in_steps):
            grad = _softmax_grad(users @ items.T + bias, counts) @ items + self.l2 * users
            adam.step([grad / np.maximum(shares, 1)])
        return top_k(users @ items.T + bias)


def _counts(histories: Sequence[np.ndarray], num_items: int) -> np.ndarray:
    counts = np.zeros((len(histories), num_items))
    for row, history in enumerate(histories):
        np.add.at(counts[row], np.asarray(history, np.int64), 1.0)
    return counts


def _softmax_grad(logits: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """d/dlogits of -sum(counts * log softmax(logits)) per row."""
    logits = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    return np.asarray(p * counts.sum(axis=1, keepdims=True) - counts)


class _Adam:
    def __init__(self, params: list[np.ndarray], learning_rate: float) -> None:
        self.params, self.lr, self.t = params, learning_rate, 0
        self.m = [np.zeros_like(p) for p in params]
        self.v = [np.zeros_like(p) for p in params]

    def step(self, grads: list[np.ndarray]) -> None:
        self.t += 1
        for p, g, m, v in zip(self.params, grads, self.m, self.v, strict=True):
            m *= 0.9
            m += 0.1 * g
            v *= 0.999
            v += 0.001 * g * g
            p -= self.lr * (m / (1 - 0.9**self.t)) / (np.sqrt(v / (1 - 0.999**self.t)) + 1e-8)


# The centralized MF's every step is a (training devices x items) product: fitted on all of a
# 100,000-device fleet's 85,000 training devices it took most of the ~10 minutes of the run's
# held-out evaluation.
# A seeded sample of this many still holds hundreds of shares of every item worth ranking.
MF_TRAINING_DEVICES = 10_000


def mf_training_sample(training: Sequence[np.ndarray], limit: int = MF_TRAINING_DEVICES) -> list[np.ndarray]:
    """The training devices the centralized MF is fitted on: all of them up to `limit`, else a
    seeded sample of `limit` (in their order)."""
    if len(training) <= limit:
        return list(training)
    chosen = np.sort(np.random.default_rng(0).choice(len(training), limit, replace=False))
    return [training[i] for i in chosen]


def ceiling_tops(
    histories: Sequence[np.ndarray],
    probabilities: np.ndarray,
    item_topics: np.ndarray,
    training: Sequence[np.ndarray],
    mf_devices: int = MF_TRAINING_DEVICES,
    bayes: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Each ceiling's (devices, k) top-k for the devices holding `histories`, their true share
    probabilities (devices, items) and the training devices' shares `training` (the centralized
    MF's on at most `mf_devices` of them; the topic rule's popularity on all); `bayes`, the Bayes
    ceiling's top-k (`android_sim.bayes_ceiling`), goes beside the oracle."""
    num_items = probabilities.shape[1]
    popularity = np.bincount(np.concatenate([*training, np.zeros(0, np.int64)]), minlength=num_items)
    mf = SoftmaxMF()
    items, bias = mf.fit(mf_training_sample(training, mf_devices), num_items)
    return {
        "topic_rule": TopicRule().tops(histories, popularity.astype(np.float64), item_topics),
        "central_mf": mf.tops(items, bias, histories),
        **({} if bayes is None else {"bayes": bayes}),
        "oracle": oracle_tops(probabilities),
    }


def table_ceiling_tops(
    histories: Sequence[np.ndarray],
    training: Sequence[np.ndarray],
    num_items: int,
    item_groups: np.ndarray | None = None,
    mf_devices: int = MF_TRAINING_DEVICES,
) -> dict[str, np.ndarray]:
    """The ceilings a user's own table gives, without a generator's truth: item co-occurrence,
    the centralized MF, and the group rule when `item_groups` (each item's group) is given."""
    popularity = np.bincount(np.concatenate([*training, np.zeros(0, np.int64)]), minlength=num_items)
    mf = SoftmaxMF()
    items, bias = mf.fit(mf_training_sample(training, mf_devices), num_items)
    out = {"cooccurrence": Cooccurrence().tops(histories, training, num_items)}
    if item_groups is not None:
        out["group_rule"] = TopicRule().tops(histories, popularity.astype(np.float64), item_groups)
    out["central_mf"] = mf.tops(items, bias, histories)
    return out
