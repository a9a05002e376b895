"""Serving with few examples: the reconstructed locals pulled toward where reconstruction starts.

A device with one or two shares reconstructs its user vector from almost nothing; ranking with it
as is trusts those shares as much as a heavy user's hundreds. With `serving_shrinkage` k the
device serves with

    initial + n / (n + k) x (reconstructed - initial),

n its examples and `initial` the model's initial locals (what a device with no data is shown):
the posterior mean's shape for a Gaussian prior around the initial locals, whatever the model.
Serving only: a training round's reconstruction is never shrunk.
"""

from __future__ import annotations

from contracts.params import Params


def shrunk_locals(reconstructed: Params, initial: Params, examples: int, strength: float) -> Params:
    """`reconstructed` pulled toward `initial` by strength / (examples + strength); unchanged for 0."""
    if strength <= 0:
        return reconstructed
    keep = examples / (examples + strength)
    return {name: initial[name] + keep * (value - initial[name]) for name, value in reconstructed.items()}
