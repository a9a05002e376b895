"""The device's privacy policy: the rounds it agrees to join, set by the app and never by the server.

Everything a secure round's privacy rests on (the mode, how many devices' inputs a sum holds, how
many shares reconstruct a device's secrets) is announced by the server. A malicious server can
announce a round of 1, a threshold of 2 shares, or plaintext. The device compares each with its
own floors first and refuses a round below them before it sends anything of that round (keys,
shares, an update). The defaults are the production ones (docs/concepts/device-privacy-policy.md
says why they are large); a harness of a few devices lowers them (`android_sim/small_cohorts.py`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from contracts.protocol import Assignment
from device_runtime.task_environment import KeptState
from secure_aggregation.config import RoundParameters

AGGREGATIONS = ("plaintext", "secure")
_COUNT_PREFIX = "participations/"
DAY_SECONDS = 86_400


class PolicyRefusal(Exception):
    """A round below the device's floors: the message names the floor and what the server offered."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"privacy policy: {reason}")


@dataclass(frozen=True)
class PrivacyPolicy:
    """- `aggregation`: the modes a training round may use ("secure" only by default: a plaintext
      training assignment is refused).
    - `plaintext_evaluation`: whether the device reports evaluation metrics in plaintext (they are
      one device's figures; off by default).
    - `min_summands`: the fewest devices' inputs a secure sum it joins may contain: the round's
      announced minimum of survivors, its roster and the survivors it is asked to unmask for.
    - `min_threshold`: the lowest share of its neighbours that may reconstruct its secrets.
    - `max_participations_per_day`: assignments it takes per population and UTC day.
    - `max_device_participations_per_day`: assignments it takes per UTC day over all the
      populations that share its example store (each participation spends privacy budget in its
      population, and a user's budgets add up across populations: this bounds the sum).
    - `certified_roster`: join a secure round only with an identity certified by the enrollment
      authority, and only with rosters whose every entry is certified by it and signed for the
      round, and unmask only after its neighbours signed the same survivors, globals and task.
      Without it the device trusts the server's roster, as against an honest-but-curious server.
    - `secure_mixing`: whether a secure training round may mix centralized data into the update
      (example or gradient transfer). What a device downloads is in the digest its neighbours sign
      (secure_aggregation.view), so a server that gives one device other central data than the
      rest is caught; a device that wants no server-chosen data in its update turns this off.
    - `max_central_gradient_weight`: the largest weight a central gradient may have in an update
      step (a server-chosen gradient with a large weight makes the update mostly the server's).
    """

    aggregation: frozenset[str] = field(default_factory=lambda: frozenset({"secure"}))
    plaintext_evaluation: bool = False
    min_summands: int = 1_000
    min_threshold: float = 2 / 3
    max_participations_per_day: int = 1
    max_device_participations_per_day: int = 2
    certified_roster: bool = True
    secure_mixing: bool = True
    max_central_gradient_weight: float = 1.0

    def __post_init__(self) -> None:
        problems = []
        unknown = sorted(set(self.aggregation) - set(AGGREGATIONS))
        if not self.aggregation or unknown:
            problems.append(
                f"aggregation must be a non-empty subset of {AGGREGATIONS}, got {sorted(self.aggregation)}"
            )
        if self.min_summands < 2:
            problems.append(
                f"min_summands must be >= 2 (a sum of one is that device's input), got {self.min_summands}"
            )
        if not 0 < self.min_threshold <= 1:
            problems.append(f"min_threshold must be a fraction in (0, 1], got {self.min_threshold}")
        if self.max_participations_per_day < 1:
            problems.append(f"max_participations_per_day must be >= 1, got {self.max_participations_per_day}")
        device_cap = self.max_device_participations_per_day
        if device_cap < 1:
            problems.append(f"max_device_participations_per_day must be >= 1, got {device_cap}")
        weight = self.max_central_gradient_weight
        if not 0 <= weight <= 100:
            problems.append(f"max_central_gradient_weight must be in [0, 100], got {weight}")
        if problems:
            raise ValueError("invalid privacy policy: " + "; ".join(problems))

    def check_assignment(self, assignment: Assignment) -> None:
        """Raises PolicyRefusal for an assignment in a mode the device does not accept."""
        if assignment.kind == "evaluation":
            if not self.plaintext_evaluation:
                raise PolicyRefusal("this device does not report evaluation metrics in plaintext")
            return
        if assignment.aggregation not in self.aggregation:
            raise PolicyRefusal(
                f"the assignment asks for {assignment.aggregation!r} aggregation; this device accepts "
                f"only {sorted(self.aggregation)}"
            )
        mixes = assignment.central_examples_url is not None or assignment.central_gradient_url is not None
        if assignment.aggregation == "secure" and mixes and not self.secure_mixing:
            raise PolicyRefusal("this device mixes no centralized data into a secure round's update")
        weight = assignment.central_gradient_weight
        if weight is not None and weight > self.max_central_gradient_weight:
            raise PolicyRefusal(
                f"the central gradient's weight {weight:g} is above this device's limit of "
                f"{self.max_central_gradient_weight:g}"
            )

    def check_parameters(self, params: RoundParameters) -> None:
        """Raises PolicyRefusal for secure round parameters below the floors (before the keys go out)."""
        if params.min_survivors < self.min_summands:
            raise PolicyRefusal(
                f"the round would unmask a sum of {params.min_survivors} devices' inputs; this device "
                f"joins only sums of at least {self.min_summands}"
            )
        if params.threshold < self.min_threshold - 1e-9:
            raise PolicyRefusal(
                f"a secret-sharing threshold of {params.threshold:g} of the neighbours is below this "
                f"device's floor of {self.min_threshold:g}"
            )

    def check_identity(self, has_identity: bool) -> None:
        if self.certified_roster and not has_identity:
            raise PolicyRefusal(
                "this device joins secure rounds only with a key certified by the enrollment authority, "
                "and it has none"
            )

    def check_roster(self, size: int) -> None:
        if size < self.min_summands:
            raise PolicyRefusal(
                f"the roster holds {size} devices; this device joins only rounds of at least "
                f"{self.min_summands}"
            )

    def check_survivors(self, count: int) -> None:
        if count < self.min_summands:
            raise PolicyRefusal(
                f"the server asks to unmask a sum of {count} devices' inputs; this device reveals "
                f"shares only for sums of at least {self.min_summands}"
            )


ALL_POPULATIONS = None


class ParticipationLog:
    """How many assignments the device took per population (or, for ALL_POPULATIONS, in all the
    populations that share its store) and UTC day, in its own example store (a key of its private
    local_state table; never uploaded)."""

    def __init__(self, store: KeptState, population: str | None) -> None:
        self.store = store
        self.population = population
        self._key = _COUNT_PREFIX + ("*" if population is None else population)

    def today(self, now: float | None = None) -> int:
        day, count = self._read()
        return count if day == _day(now) else 0

    def record(self, now: float | None = None) -> None:
        today = _day(now)
        day, count = self._read()
        count = count + 1 if day == today else 1
        self.store.save_local_state(self._key, json.dumps({"day": today, "count": count}).encode())

    def check(self, policy: PrivacyPolicy, now: float | None = None) -> None:
        taken = self.today(now)
        if self.population is None:
            cap, where = policy.max_device_participations_per_day, "in all its populations"
        else:
            cap, where = policy.max_participations_per_day, "in this population"
        if taken >= cap:
            raise PolicyRefusal(
                f"{taken} participations {where} today; this device takes at most {cap} a day"
            )

    def _read(self) -> tuple[int, int]:
        blob = self.store.load_local_state(self._key)
        if blob is None:
            return -1, 0
        try:
            data = json.loads(blob)
            return int(data["day"]), int(data["count"])
        except (ValueError, KeyError, TypeError):
            # An unreadable count errs on the safe side: today's cap is taken as reached (and
            # written so, so that tomorrow counts afresh).
            today, reached = _day(None), 1 << 30
            self.store.save_local_state(self._key, json.dumps({"day": today, "count": reached}).encode())
            return today, reached


def _day(now: float | None) -> int:
    return int((time.time() if now is None else now) // DAY_SECONDS)
