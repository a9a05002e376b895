"""The buffered-rounds accountant: m Gaussian releases, no amplification, checked against the
closed form and against the synchronous (Poisson-amplified) accountant."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant

from orchestrator.aggregation.buffered_privacy import (
    buffered_dp_problems,
    buffered_epsilon,
    closed_form_epsilon,
    replace_one_noise_multiplier,
)
from orchestrator.aggregation.differential_privacy import epsilon as poisson_epsilon

ORDERS = np.asarray(rdp_privacy_accountant.DEFAULT_RDP_ORDERS, dtype=np.float64)


@pytest.mark.parametrize(
    ("z", "m", "delta"), [(1.0, 10, 1e-5), (0.7, 3, 1e-6), (2.5, 100, 1e-5), (5.0, 1, 1e-4)]
)
def test_equals_closed_form_gaussian_composition(z: float, m: int, delta: float) -> None:
    assert buffered_epsilon(z, m, delta) == pytest.approx(closed_form_epsilon(z, m, delta, ORDERS), rel=1e-9)


def test_closed_form_is_below_the_basic_conversion() -> None:
    # The basic RDP -> (eps, delta) conversion, min over alpha of m*alpha/(2 z^2) + log(1/delta)/(alpha-1),
    # is looser than the one used, so it bounds the result from above.
    z, m, delta = 1.2, 20, 1e-5
    basic = float(np.min(m * ORDERS / (2 * z**2) + math.log(1 / delta) / (ORDERS - 1)))
    assert buffered_epsilon(z, m, delta) <= basic
    assert buffered_epsilon(z, m, delta) > 0.8 * basic


def test_larger_than_poisson_amplified_for_the_same_noise() -> None:
    z, m, delta = 1.0, 10, 1e-5
    # Synchronous rounds sampling 10 of 1000 devices: m expected participations take 1000 rounds.
    amplified = poisson_epsilon(z, 10 / 1000, 1000, delta)
    assert buffered_epsilon(z, m, delta) > amplified


def test_grows_with_participations_and_without_noise_is_infinite() -> None:
    values = [buffered_epsilon(1.0, m, 1e-5) for m in (1, 2, 5, 10)]
    assert values == sorted(values) and len(set(values)) == 4
    assert buffered_epsilon(1.0, 0, 1e-5) == 0.0
    assert buffered_epsilon(0.0, 3, 1e-5) == math.inf


def test_replace_one_halves_the_multiplier() -> None:
    assert replace_one_noise_multiplier(2.0) == 1.0
    assert buffered_epsilon(replace_one_noise_multiplier(2.0), 5, 1e-5) > buffered_epsilon(2.0, 5, 1e-5)


def test_unsound_settings_have_reasons() -> None:
    assert buffered_dp_problems(10, adaptive_clipping=False) == []
    (missing,) = buffered_dp_problems(None, adaptive_clipping=False)
    assert "max_participations is required" in missing
    (bad,) = buffered_dp_problems(0, adaptive_clipping=False)
    assert "integer >= 1, got 0" in bad
    (adaptive,) = buffered_dp_problems(5, adaptive_clipping=True)
    assert "adaptive clipping" in adaptive
