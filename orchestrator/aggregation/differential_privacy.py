"""DP-FedAvg (McMahan et al., ICLR 2018): the server's noised mean and the privacy accountant.

Pure functions and values, numpy and `dp_accounting` only: no HTTP, no database, and no
knowledge of how the sum of the round's updates was formed (plaintext reports added by the
round logic, or the unmasked sum of a secure aggregation).

- Devices clip their whole delta (every global tensor together) to L2 <= `clip_norm`, so one
  device moves the round's sum by at most `clip_norm` (add/remove-one-device adjacency).
- `noised_mean`: the sum plus Gaussian noise N(0, (noise_multiplier * clip_norm)^2) on every
  coordinate of every tensor, divided by the number of reports (uniform weights: an example
  count would make one device's influence unbounded). The count is treated as public: the
  server sees who reported anyway.
- Adaptive clipping (Andrew et al., NeurIPS 2021), optional: each device also says whether its
  delta was within the round's clip norm; `adapt_clip_norm` noises that count and moves the
  clip norm geometrically towards the `target_unclipped_quantile` of the norms. The delta's
  noise multiplier is raised so that both Gaussian mechanisms together cost exactly what one
  with `noise_multiplier` does (their Theorem 1), so the accounting below is unchanged.
- Accounting: each round is a Poisson-sampled Gaussian mechanism with sampling rate
  reports per round / population size, composed over the rounds with Renyi DP
  (`dp_accounting`), converted to epsilon at the population's delta.
"""

from __future__ import annotations

import functools
import logging
import math
import secrets
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

import numpy as np

from contracts.params import Params
from orchestrator.setting_ranges import Range, check


class _FractionalOrderNoise(logging.Filter):
    """dp_accounting warns through absl for every fractional Renyi order whose series does not
    converge (it then leaves that order out, which only makes epsilon larger, i.e. safe): dozens
    of lines per round at sampling rates like ours. Those lines, and only those, are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("_compute_log_a_frac failed to converge")


logging.getLogger("absl").addFilter(_FractionalOrderNoise())


@dataclass(frozen=True)
class DPConfig:
    """A population's DP-FedAvg settings (set by the operator at creation, never changed)."""

    clip_norm: float  # L2 bound on a device's whole delta
    noise_multiplier: float  # z: noise stddev on the sum is z * clip_norm; 0 = clipping only, no guarantee
    population_size: int  # devices that could take part (the operator's statement); sets the sampling rate
    target_delta: float = 1e-5  # from_json: target_delta_for(population_size) when not given
    # Stop committing training rounds before epsilon would exceed it; training check-ins are then
    # answered 200 with the budget's message and Retry-After 86400 (rounds.checkin).
    epsilon_budget: float | None = None
    # Adaptive clipping (None: the clip norm stays fixed); clip_norm is then the first round's.
    target_unclipped_quantile: float | None = None  # gamma: the share of devices left unclipped
    clip_learning_rate: float = 0.2  # eta_C of the geometric update
    clipped_count_stddev: float | None = None  # sigma_b; the paper suggests reports per round / 20
    # rounds: buffered only: the most buffers one device's reports may enter; the bound its epsilon
    # is computed from (aggregation.buffered_privacy), since nothing samples devices there.
    max_participations: int | None = None

    # Every number's range (setting_ranges): wide enough for any deployment, and finite so that
    # the noise, the sampling rate and the accountant's epsilon stay finite.
    RANGES: ClassVar[dict[str, Range]] = {
        "clip_norm": Range(0, 1e6, low_open=True),
        "noise_multiplier": Range(0, 1e3),
        "population_size": Range(1, 1e10, integer=True),
        "target_delta": Range(0, 1, low_open=True, high_open=True),
        "epsilon_budget": Range(0, 1e6, low_open=True),
        "target_unclipped_quantile": Range(0, 1, low_open=True, high_open=True),
        "clip_learning_rate": Range(0, 10, low_open=True),
        "clipped_count_stddev": Range(0, 1e6),
        "max_participations": Range(1, 1e9, integer=True),
    }

    def __post_init__(self) -> None:
        problems = []

        def number(name: str, kinds: tuple[type, ...] = (int, float)) -> bool:
            value = getattr(self, name)
            # An int is finite; math.isfinite would overflow converting 10**400 to a float.
            finite = isinstance(value, kinds) and not (isinstance(value, float) and not math.isfinite(value))
            if isinstance(value, bool) or not finite:
                kind = "an integer" if kinds == (int,) else "a finite number"
                problems.append(f"{name} must be {kind}, got {value!r}")
                return False
            return True

        # Types first, so that no rule below compares text or null with a number.
        for f in fields(self):
            if getattr(self, f.name) is not None or "None" not in str(f.type):
                integer = f.name in ("population_size", "max_participations")
                number(f.name, (int,) if integer else (int, float))
        if problems:
            raise ValueError("invalid differential_privacy settings: " + "; ".join(problems))
        if number("clip_norm") and self.clip_norm <= 0:
            problems.append(f"clip_norm must be > 0, got {self.clip_norm}")
        if number("noise_multiplier") and self.noise_multiplier < 0:
            problems.append(f"noise_multiplier must be >= 0, got {self.noise_multiplier}")
        if number("population_size", (int,)) and self.population_size < 1:
            problems.append(f"population_size must be an integer >= 1, got {self.population_size}")
        if number("target_delta") and not 0 < self.target_delta < 1:
            problems.append(f"target_delta must be in (0, 1), got {self.target_delta}")
        elif not problems and self.target_delta >= 1 / self.population_size:
            # delta is the chance that the guarantee fails outright; at >= 1/N it may fail for someone.
            problems.append(
                f"target_delta ({self.target_delta:g}) must be < 1 / population_size "
                f"({1 / self.population_size:g}); 1e-5 or less is usual"
            )
        if self.epsilon_budget is not None and number("epsilon_budget"):
            if self.epsilon_budget <= 0:
                problems.append(f"epsilon_budget must be > 0, got {self.epsilon_budget}")
            elif number("noise_multiplier") and self.noise_multiplier == 0:
                problems.append(
                    "an epsilon_budget needs noise_multiplier > 0: without noise epsilon is infinite"
                )
        if self.target_unclipped_quantile is not None and not problems:
            self._check_adaptive(problems, number)
        if not problems:
            for name, allowed in self.RANGES.items():
                value = getattr(self, name)
                problem = None if value is None else check("", name, value, allowed)
                if problem:
                    problems.append(problem)
        if problems:
            raise ValueError("invalid differential_privacy settings: " + "; ".join(problems))

    def _check_adaptive(self, problems: list[str], number: Callable[[str], bool]) -> None:
        quantile = self.target_unclipped_quantile
        if number("target_unclipped_quantile") and quantile is not None and not 0 < quantile < 1:
            problems.append(
                f"target_unclipped_quantile must be in (0, 1), got {self.target_unclipped_quantile}"
            )
        if number("clip_learning_rate") and self.clip_learning_rate <= 0:
            problems.append(f"clip_learning_rate must be > 0, got {self.clip_learning_rate}")
        if self.clipped_count_stddev is None:
            problems.append(
                "adaptive clipping needs clipped_count_stddev (the noise on the count of unclipped "
                "devices; Andrew et al. suggest reports per round / 20)"
            )
        elif number("clipped_count_stddev") and self.noise_multiplier > 0:
            if not 2 * self.clipped_count_stddev > self.noise_multiplier:
                problems.append(
                    f"clipped_count_stddev ({self.clipped_count_stddev:g}) must be > noise_multiplier / 2 "
                    f"({self.noise_multiplier / 2:g}): the count's noise is paid for out of the "
                    "noise_multiplier's privacy"
                )
        elif self.clipped_count_stddev < 0:
            problems.append(f"clipped_count_stddev must be >= 0, got {self.clipped_count_stddev}")

    @property
    def adaptive(self) -> bool:
        return self.target_unclipped_quantile is not None

    @property
    def delta_noise_multiplier(self) -> float:
        """The noise multiplier on the deltas' sum: `noise_multiplier` itself with a fixed clip norm;
        with adaptive clipping, (z^-2 - (2 sigma_b)^-2)^-1/2, so that the two Gaussian mechanisms
        (deltas, sensitivity C; centred count, sensitivity 1/2) compose to one of multiplier z."""
        z = self.noise_multiplier
        if not self.adaptive or z == 0:
            return z
        assert self.clipped_count_stddev is not None  # checked at construction
        return float((z**-2 - (2 * self.clipped_count_stddev) ** -2) ** -0.5)

    def noise_stddev(self, clip_norm: float | None = None) -> float:
        """Standard deviation of the noise on each coordinate of the round's sum, for the round's
        clip norm (with a fixed one: `clip_norm`)."""
        return self.delta_noise_multiplier * (self.clip_norm if clip_norm is None else clip_norm)

    def sampling_rate(self, reports_per_round: int) -> float:
        if not 1 <= reports_per_round <= self.population_size:
            raise ValueError(
                f"reports per round ({reports_per_round}) must be in [1, population_size "
                f"({self.population_size})]: the sampling rate is their ratio"
            )
        return reports_per_round / self.population_size

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DPConfig:
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"unknown differential_privacy fields {unknown}; known: {known}")
        missing = [name for name in ("clip_norm", "noise_multiplier", "population_size") if name not in data]
        if missing:
            raise ValueError(
                f"differential_privacy settings need {missing} (e.g. clip_norm 1.0, "
                "noise_multiplier 1.0, population_size 100000)"
            )
        if "target_delta" not in data and data["population_size"] in cls.RANGES["population_size"]:
            data = {**data, "target_delta": target_delta_for(data["population_size"])}
        return cls(**data)


def target_delta_for(population_size: int) -> float:
    """The default delta of a population of N devices: min(1e-5, N^-1.1). Delta is the chance
    that the guarantee fails outright, so it must stay well below 1/N (at 1/N, one device's
    data may leak); N^-1.1 is the usual "o(1/N)" choice, and 1e-5 the usual ceiling for the
    small populations where N^-1.1 would be larger. 100,000 devices: 3.2e-6."""
    return min(1e-5, math.pow(population_size, -1.1))


# ---- the server's step -------------------------------------------------------------------


def secure_rng() -> np.random.Generator:
    """A generator seeded from the operating system's CSPRNG, anew for each round: nobody can
    predict (or replay) the noise from a seed. numpy's PCG64 itself is not a CSPRNG."""
    return np.random.default_rng(secrets.randbits(256))


def _check_count(num_reports: int) -> None:
    if isinstance(num_reports, bool) or not isinstance(num_reports, int | np.integer) or num_reports < 1:
        raise ValueError(f"num_reports must be an integer >= 1, got {num_reports!r}")


def noised_mean(
    update_sum: Params,
    num_reports: int,
    config: DPConfig,
    rng: np.random.Generator,
    clip_norm: float | None = None,
) -> Params:
    """(sum of the clipped updates + N(0, (z C)^2) on every coordinate) / number of reports.

    `clip_norm` is the round's C under adaptive clipping (default: the configured one). Every
    coordinate gets noise, including rows no device touched: noise only on the touched rows
    would tell which rows those are. Computed in float64, returned as float32.
    """
    _check_count(num_reports)
    stddev = config.noise_stddev(clip_norm)
    out: Params = {}
    for name, total in update_sum.items():
        noisy = np.asarray(total, dtype=np.float64)
        if stddev > 0:
            noisy = noisy + rng.normal(0.0, stddev, size=noisy.shape)
        out[name] = (noisy / num_reports).astype(np.float32)
    return out


def adapt_clip_norm(
    clip_norm: float, unclipped: int, num_reports: int, config: DPConfig, rng: np.random.Generator
) -> tuple[float, float]:
    """The next round's clip norm from this round's count of devices whose delta was within
    `clip_norm` (Andrew et al. 2021, Algorithm 1): (new clip norm, the noised unclipped share).

    The count is centred (each device adds b - 1/2, sensitivity 1/2), noised with
    N(0, sigma_b^2), and the clip norm moves as C exp(-eta (share - gamma)): down when more than
    the target share was left unclipped, up when fewer."""
    _check_count(num_reports)
    if not config.adaptive or config.target_unclipped_quantile is None:
        raise ValueError("adapt_clip_norm needs differential_privacy.target_unclipped_quantile")
    if not 0 <= unclipped <= num_reports:
        raise ValueError(f"unclipped count {unclipped} must be in [0, {num_reports}]")
    noise = rng.normal(0.0, config.clipped_count_stddev) if config.clipped_count_stddev else 0.0
    share = (unclipped - num_reports / 2 + noise) / num_reports + 0.5
    return clip_norm * math.exp(
        -config.clip_learning_rate * (share - config.target_unclipped_quantile)
    ), share


# ---- accounting ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _round_rdp(sampling_rate: float, noise_multiplier: float) -> tuple[np.ndarray, np.ndarray]:
    """Renyi DP of one round at each order: (orders, rdp). Computing it costs ~0.1 s, so it is
    done once per setting; RDP adds up over rounds, so k rounds cost nothing more."""
    # Imported here: dp_accounting pulls in scipy, ~2 s of every server start that no
    # population without DP needs.
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant

    accountant = rdp_privacy_accountant.RdpAccountant()
    gaussian = dp_event.GaussianDpEvent(noise_multiplier)
    accountant.compose(dp_event.PoissonSampledDpEvent(sampling_rate, gaussian))
    # dp_accounting has no public getter for the per-order RDP; the tests check that k times it
    # gives the same epsilon as composing k rounds with its public API.
    return np.asarray(accountant._orders, dtype=np.float64), np.asarray(accountant._rdp, dtype=np.float64)


def epsilon(noise_multiplier: float, sampling_rate: float, rounds: int, delta: float) -> float:
    """Epsilon at `delta` after `rounds` Poisson-sampled Gaussian rounds (inf without noise)."""
    if rounds <= 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    from dp_accounting.rdp import rdp_privacy_accountant

    orders, rdp = _round_rdp(float(sampling_rate), float(noise_multiplier))
    eps, _ = rdp_privacy_accountant.compute_epsilon(orders, rdp * rounds, delta)
    return float(eps)


@dataclass(frozen=True)
class PrivacySpent:
    """Where a population stands: what it has spent and what it may still spend."""

    rounds: int  # training rounds committed
    epsilon: float  # at delta, after those rounds; inf without noise
    delta: float
    sampling_rate: float
    epsilon_budget: float | None
    rounds_within_budget: int | None  # the most rounds whose epsilon stays within the budget
    # Buffered rounds: the cap on one device's buffers that bounds epsilon (sampling_rate is then 1).
    max_participations: int | None = None

    @property
    def budget_spent(self) -> bool:
        """True when one more training round would take epsilon past the budget."""
        return self.rounds_within_budget is not None and self.rounds >= self.rounds_within_budget

    def message(self) -> str:
        if math.isinf(self.epsilon):
            return "noise_multiplier is 0: updates are clipped but there is no differential privacy guarantee"
        spent = f"epsilon {self.epsilon:.3g} at delta {self.delta:g} after {self.rounds} training rounds"
        if self.max_participations is not None:
            most = min(self.rounds, self.max_participations)
            return (
                f"epsilon {self.epsilon:.3g} at delta {self.delta:g} for a device in {most} of the "
                f"{self.rounds} buffers committed (at most {self.max_participations}: max_participations)"
            )
        if self.epsilon_budget is None:
            return spent + " (no budget set)"
        if self.budget_spent:
            return (
                f"privacy budget spent: {spent}; another round would exceed the budget "
                f"epsilon {self.epsilon_budget:g}, so no more training rounds are committed"
            )
        left = (self.rounds_within_budget or 0) - self.rounds
        return f"{spent}; {left} more rounds within the budget epsilon {self.epsilon_budget:g}"


@functools.lru_cache(maxsize=64)
def rounds_within_budget(noise_multiplier: float, sampling_rate: float, delta: float, budget: float) -> int:
    """The most rounds whose epsilon at `delta` is <= `budget` (epsilon grows with rounds)."""
    if epsilon(noise_multiplier, sampling_rate, 1, delta) > budget:
        return 0
    low, high = 1, 2
    while epsilon(noise_multiplier, sampling_rate, high, delta) <= budget:
        low, high = high, high * 2
        if high > 2**40:  # so little privacy spent per round that the budget never runs out in practice
            return high
    while high - low > 1:  # epsilon(low) <= budget < epsilon(high)
        middle = (low + high) // 2
        if epsilon(noise_multiplier, sampling_rate, middle, delta) <= budget:
            low = middle
        else:
            high = middle
    return low


def privacy_spent(config: DPConfig, reports_per_round: int, rounds: int) -> PrivacySpent:
    rate = config.sampling_rate(reports_per_round)
    allowed = (
        None
        if config.epsilon_budget is None
        else rounds_within_budget(config.noise_multiplier, rate, config.target_delta, config.epsilon_budget)
    )
    return PrivacySpent(
        rounds=rounds,
        epsilon=epsilon(config.noise_multiplier, rate, rounds, config.target_delta),
        delta=config.target_delta,
        sampling_rate=rate,
        epsilon_budget=config.epsilon_budget,
        rounds_within_budget=allowed,
    )


def population_size_for(
    target_epsilon: float, noise_multiplier: float, reports_per_round: int, rounds: int, delta: float
) -> int:
    """The smallest population for which `rounds` rounds of `reports_per_round` reports at this
    noise stay within `target_epsilon` at `delta` (a larger population means a lower sampling
    rate). For planning: how many devices a deployment needs for a given guarantee."""
    if noise_multiplier <= 0:
        raise ValueError("without noise (noise_multiplier 0) no population size gives a finite epsilon")

    def within(size: int) -> bool:
        return epsilon(noise_multiplier, reports_per_round / size, rounds, delta) <= target_epsilon

    low, high = reports_per_round, reports_per_round * 2
    if within(low):
        return low
    while not within(high):
        low, high = high, high * 2
        if high > 2**50:
            raise ValueError(f"no population up to 2^50 devices reaches epsilon {target_epsilon}")
    while high - low > 1:  # not within(low), within(high)
        middle = (low + high) // 2
        if within(middle):
            high = middle
        else:
            low = middle
    return high
