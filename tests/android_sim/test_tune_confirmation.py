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


def test_the_plain_settings_stay_unless_another_trial_beats_them_beyond_the_devices_luck() -> None:
    plain = trial(0, [0.5] * 6)
    worse = trial(1, [0.7, 0.3, 0.5, 0.5, 0.5, 0.5])
    mixed = trial(2, [0.9, 0.1, 0.9, 0.1, 0.9, 0.2])  # better on average, by two devices' luck
    said: list[str] = []

    kept, trials = confirm([plain, worse, mixed], lambda t: np.asarray(t.per_device), said.append)

    assert kept.number == 0
    mixed_mean, plain_mean = trials[2].confirmed, trials[0].confirmed
    assert mixed_mean is not None and plain_mean is not None and mixed_mean > plain_mean  # yet not kept
    assert any(line.startswith("trial 2 minus the plain settings, two seeds: +1.7 [") for line in said), said
