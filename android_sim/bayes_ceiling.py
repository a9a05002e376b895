"""The Bayes ceiling: the best top-10 any model could serve a device from its history alone.

The synthetic generator (`android_sim.expressions`) draws each user's taste from a known prior
(1-3 liked topics' centroids summed, plus Gaussian noise) and each share independently from the
taste's softmax. Knowing all of it (the prior, the item vectors, the popularity), the best a
model can do with a device's history is to rank by the posterior predictive

    p(next = i | history) = E[ p(i | taste) | history ],

the average of the share probabilities over the tastes the history leaves plausible. Its
expected hit rate is what the oracle's would be for a model that is only short of the user's
true taste, not of anything it could learn: the ceiling a personalized model can reach.

The estimator is self-normalised importance sampling over the taste's unnormalised vector x
(the liked centroids' sum plus noise; the taste is x made a unit vector):
- every device starts from one shared pool of draws from the prior, weighted by its history's
  likelihood; a device whose effective sample size (ESS) is already `min_ess` is done (most
  devices with few examples are);
- a device with more examples has a narrow posterior the prior rarely hits: the likelihood is
  tempered (raised to a power b from the prior's pool up to 1), a multivariate t fitted to the
  weighted draws at each b and sampled afresh, until at b = 1 its own draws, weighted by
  prior x likelihood / proposal, have an ESS of at least `min_ess`.
The ESS is that of the final weights, (sum w)^2 / sum w^2, reported per device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations
from math import comb, lgamma, log, pi

import numpy as np

from android_sim.ceilings import top_k
from android_sim.expressions import MAX_LIKED_TOPICS, TASTE_NOISE, SyntheticExpressions, share_logits

MIN_ESS = 500
POOL = 40_000  # prior draws shared by every device
DRAWS = 2_000  # a narrow posterior's draws per adaptation step
FINAL_BATCHES = 4  # at the full likelihood, at most this many batches of draws pooled
STEP_ESS = 0.1  # each step tempers as far as keeps this fraction of its draws effective
CHUNK = 5_000  # draws whose (draws, items) probabilities are held at once
DEVICE_BLOCK = 250  # devices whose (pool, devices) log-likelihoods are held at once
# A fleet's held-out devices beyond this get no Bayes row (a minute or so of one core at this size).
MAX_DEVICES = 2_000
T_DEGREES = 5.0  # the proposal's tails: heavier than a Gaussian's, so the weights stay bounded
MAX_STEPS = 30


@dataclass(frozen=True)
class BayesCeiling:
    """Each device's top-10 by its posterior predictive, and how well that was estimated."""

    tops: np.ndarray  # (devices, 10)
    predictive: np.ndarray  # (devices, items): p(next share | history)
    ess: np.ndarray  # (devices,): each device's effective sample size
    draws: np.ndarray  # (devices,): the draws its estimate averages (the pool's or its own)

    def to_json(self) -> dict[str, object]:
        return {
            "estimator": "self-normalised importance sampling from the generator's prior (tempered "
            "to an adapted multivariate t for narrow posteriors)",
            "min_ess": float(self.ess.min()),
            "median_ess": float(np.median(self.ess)),
            "devices": len(self.ess),
        }


@dataclass(frozen=True)
class TastePrior:
    """The generator's prior over x: a mixture, over every set of liked topics (its probability:
    uniform in size, then uniform among the sets of that size), of N(sum of their centroids, noise^2 I)."""

    means: np.ndarray  # (sets, dim)
    log_weights: np.ndarray  # (sets,)
    noise: float

    @classmethod
    def of(cls, data: SyntheticExpressions) -> TastePrior:
        centroids = data.topic_centroids
        topics = len(centroids)
        sizes = range(1, min(MAX_LIKED_TOPICS, topics) + 1)
        sets = [list(s) for k in sizes for s in combinations(range(topics), k)]
        weights = [-log(len(sizes)) - log(comb(topics, len(s))) for s in sets]
        means = np.stack([centroids[s].sum(axis=0) for s in sets])
        return cls(means, np.array(weights), TASTE_NOISE)

    def sample(self, count: int, rng: np.random.Generator) -> np.ndarray:
        chosen = rng.choice(len(self.means), size=count, p=np.exp(self.log_weights))
        return np.asarray(self.means[chosen] + self.noise * rng.normal(size=(count, self.means.shape[1])))

    def log_density(self, x: np.ndarray) -> np.ndarray:
        # -|x - m|^2 / 2s^2 with the |x|^2 term, the same for every set, outside the sum over sets.
        var = self.noise**2
        each = x @ (self.means.T / var) + (self.log_weights - (self.means * self.means).sum(1) / (2 * var))
        dim = x.shape[1]
        return np.asarray(_logsumexp(each, axis=1) - (x * x).sum(1) / (2 * var) - dim / 2 * log(2 * pi * var))


def bayes_ceiling(
    data: SyntheticExpressions,
    histories: Sequence[np.ndarray],
    min_ess: int = MIN_ESS,
    pool: int = POOL,
    seed: int = 0,
) -> BayesCeiling:
    """The posterior predictive top-10 of each device holding `histories` (its shares' item ids)."""
    if not histories:
        raise ValueError("no device history to rank for")
    rng = np.random.default_rng(seed)
    prior = TastePrior.of(data)
    model = _Likelihood(data)
    x0 = prior.sample(pool, rng)
    found = [
        _block(prior, model, histories[i : i + DEVICE_BLOCK], x0, min_ess, rng)
        for i in range(0, len(histories), DEVICE_BLOCK)
    ]
    predictive = np.concatenate([f[0] for f in found])
    ess, draws = np.concatenate([f[1] for f in found]), np.concatenate([f[2] for f in found])
    return BayesCeiling(top_k(predictive), predictive, ess, draws)


def _block(
    prior: TastePrior,
    model: _Likelihood,
    histories: Sequence[np.ndarray],
    x0: np.ndarray,
    min_ess: int,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A block of devices' posterior predictives, ESS and draws (the pool's weights held for it alone)."""
    counts = np.zeros((len(histories), model.items), np.float32)
    for row, history in enumerate(histories):
        np.add.at(counts[row], np.asarray(history, np.int64), 1.0)
    chunks = range(0, len(x0), CHUNK)
    # float32 sums: a 400-share history's log-likelihood (about -3,000) is off by 1e-3 at most.
    ll0 = np.concatenate([model.log_probabilities(x0[i : i + CHUNK]) @ counts.T for i in chunks]).astype(
        np.float64
    )
    ess = _ess(ll0)
    predictive = np.zeros(counts.shape)
    done = ess >= min_ess
    weights = _normalised(ll0[:, done]).astype(np.float32)
    for i in chunks:  # the pool's devices: a chunk's probabilities at a time
        predictive[done] += weights[i : i + CHUNK].T @ np.exp(model.log_probabilities(x0[i : i + CHUNK]))
    draws = np.where(done, len(x0), 0)
    for row in np.flatnonzero(~done):
        shares = _Shares(np.flatnonzero(counts[row]), counts[row][counts[row] > 0])
        predictive[row], ess[row], draws[row] = _tempered(prior, model, shares, x0, ll0[:, row], min_ess, rng)
    return predictive, ess, draws


class _Likelihood:
    """log p(item | x) under the generator, for many x at once."""

    def __init__(self, data: SyntheticExpressions) -> None:
        self.data = data
        # float32: the (draws, items) logits are the sampler's whole cost (sums over shares in float64).
        self.log_popularity = np.log(data.catalog.popularity).astype(np.float32)
        self.item_vectors = data.item_vectors.astype(np.float32)
        self.items = len(self.log_popularity)

    def log_probabilities(self, x: np.ndarray) -> np.ndarray:
        tastes = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
        logits = share_logits(self.log_popularity, self.item_vectors, tastes, self.data.config)
        # No max to subtract: popularity's logs are <= 0 and the taste term within +-taste_strength.
        return np.asarray(logits - np.log(np.exp(logits).sum(axis=1, keepdims=True)))


@dataclass(frozen=True)
class _Shares:
    items: np.ndarray  # the distinct items of a history
    counts: np.ndarray  # how often each was shared

    def log_likelihood(self, log_p: np.ndarray) -> np.ndarray:
        return np.asarray(log_p[:, self.items].astype(np.float64) @ self.counts)


def _tempered(
    prior: TastePrior,
    model: _Likelihood,
    shares: _Shares,
    x0: np.ndarray,
    ll0: np.ndarray,
    min_ess: int,
    rng: np.random.Generator,
) -> tuple[np.ndarray, float, int]:
    """One device's posterior predictive, its ESS and draws, from the tempered path described above."""
    # The prior's pool at the largest power its weights carry with a useful ESS.
    power = _power(np.zeros_like(ll0), ll0, STEP_ESS * DRAWS)
    x, log_weights = x0, power * ll0
    for _ in range(MAX_STEPS):
        proposal = _StudentT.fit(x, _normalised(log_weights))
        # At the full likelihood, batches from one proposal until their pooled ESS is enough.
        batches = FINAL_BATCHES if power >= 1.0 else 1
        xs, log_ps, log_bases, lls = [], [], [], []
        for _ in range(batches):
            xs.append(proposal.sample(DRAWS, rng))
            log_ps.append(model.log_probabilities(xs[-1]))
            log_bases.append(prior.log_density(xs[-1]) - proposal.log_density(xs[-1]))
            lls.append(shares.log_likelihood(log_ps[-1]))
            full = np.concatenate(log_bases) + np.concatenate(lls)
            ess = float(_ess(full))
            if power >= 1.0 and ess >= min_ess:
                weights = _normalised(full).astype(np.float32)
                return weights @ np.exp(np.concatenate(log_ps)), ess, len(full)
        x, log_base, ll = np.concatenate(xs), np.concatenate(log_bases), np.concatenate(lls)
        # Never back down: a proposal short of the target at the same power improves by a refit.
        power = max(power, _power(log_base, ll, STEP_ESS * len(x)))
        log_weights = log_base + power * ll
    raise RuntimeError(f"the Bayes ceiling's sampler did not reach an ESS of {min_ess} in {MAX_STEPS} steps")


def _power(log_base: np.ndarray, ll: np.ndarray, target: float) -> float:
    """The largest power b in [0, 1] at which log_base + b x ll has an ESS of at least `target`
    (1 when it has at b = 1), by bisection."""
    if _ess(log_base + ll) >= target:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(20):  # to within 1e-6
        middle = (low + high) / 2
        low, high = (middle, high) if _ess(log_base + middle * ll) >= target else (low, middle)
    return max(low, 1e-9)


@dataclass(frozen=True)
class _StudentT:
    mean: np.ndarray
    chol: np.ndarray  # lower Cholesky factor of the scale matrix

    @classmethod
    def fit(cls, x: np.ndarray, weights: np.ndarray) -> _StudentT:
        mean = weights @ x
        centred = x - mean
        scale = (weights[:, None] * centred).T @ centred
        scale += 1e-6 * np.trace(scale) / len(mean) * np.eye(len(mean)) + 1e-12 * np.eye(len(mean))
        return cls(mean, np.linalg.cholesky(scale))

    def sample(self, count: int, rng: np.random.Generator) -> np.ndarray:
        dim = len(self.mean)
        z = rng.normal(size=(count, dim)) / np.sqrt(rng.chisquare(T_DEGREES, count) / T_DEGREES)[:, None]
        return np.asarray(self.mean + z @ self.chol.T)

    def log_density(self, x: np.ndarray) -> np.ndarray:
        dim, nu = len(self.mean), T_DEGREES
        z = np.linalg.solve(self.chol, (x - self.mean).T).T
        norm = lgamma((nu + dim) / 2) - lgamma(nu / 2) - dim / 2 * log(nu * pi)
        norm -= float(np.log(np.diag(self.chol)).sum())
        return np.asarray(norm - (nu + dim) / 2 * np.log1p((z * z).sum(1) / nu))


def _logsumexp(x: np.ndarray, axis: int) -> np.ndarray:
    top = x.max(axis=axis, keepdims=True)
    return np.asarray(np.log(np.exp(x - top).sum(axis=axis)) + np.squeeze(top, axis=axis))


def _normalised(log_weights: np.ndarray) -> np.ndarray:
    """Self-normalised weights along the draws (axis 0)."""
    w = np.exp(log_weights - log_weights.max(axis=0))
    return np.asarray(w / w.sum(axis=0))


def _ess(log_weights: np.ndarray) -> np.ndarray:
    """(sum w)^2 / sum w^2 along the draws (axis 0)."""
    w = _normalised(log_weights)
    return np.asarray(1.0 / (w * w).sum(axis=0))
