"""`simulate --tune` keeps what holds up with a second seed, not the luckiest trial."""

from __future__ import annotations

import numpy as np

from android_sim.simulation.tune import Trial, confirm


def trial(number: int, per_device: list[float]) -> Trial:
    return Trial(
        number, {"l2_local": number}, {"name": "sgd"}, float(np.mean(per_device)), 1.0, tuple(per_device)
    )


def test_a_trial_lucky_once_loses_to_one_that_holds_up() -> None:
    plain = trial(0, [0.4, 0.4, 0.4, 0.4])
    lucky = trial(1, [0.9, 0.9, 0.5, 0.5])  # the best single run
    steady = trial(2, [0.6, 0.6, 0.6, 0.6])
    second = {0: [0.4] * 4, 1: [0.1, 0.1, 0.1, 0.1], 2: [0.6, 0.5, 0.6, 0.5]}
    asked: list[int] = []

    def again(t: Trial) -> np.ndarray:
        asked.append(t.number)
        return np.array(second[t.number])

    kept, trials = confirm([plain, lucky, steady], again, lambda line: None)

    assert asked == [0, 1, 2]  # the plain settings, then the best single runs first
    assert kept.number == 2 and kept.confirmed == np.mean([0.6, 0.55, 0.6, 0.55])
    assert [t.confirmed for t in trials] == [0.4, np.mean([0.5, 0.5, 0.3, 0.3]), kept.confirmed]


def test_the_plain_settings_stay_unless_another_trial_beats_them() -> None:
    plain = trial(0, [0.5, 0.5])
    worse = trial(1, [0.7, 0.3])

    kept, _ = confirm([plain, worse], lambda t: np.array([0.5, 0.5] if t.number == 0 else [0.3, 0.3]), print)

    assert kept.number == 0
