"""Shamir sharing against its definition: any t shares recover the secret, t-1 reveal nothing."""

from __future__ import annotations

import itertools
import secrets
from collections import Counter

import pytest

from secure_aggregation import shamir


def test_any_threshold_shares_reconstruct_the_secret():
    # Prepare
    secret = secrets.randbits(256)
    holders = [1, 2, 3, 5, 8, 13]
    shares = shamir.split(secret, 4, holders)

    # Execute / Assert: every subset of 4 (and more) recovers it
    for size in (4, 5, 6):
        for subset in itertools.combinations(holders, size):
            assert shamir.reconstruct({x: shares[x] for x in subset}) == secret


def test_fewer_than_threshold_shares_do_not_reconstruct_the_secret():
    secret = secrets.randbits(256)
    shares = shamir.split(secret, 4, [1, 2, 3, 4, 5])

    assert shamir.reconstruct({x: shares[x] for x in (1, 2, 3)}) != secret


def test_threshold_minus_one_shares_are_uniform_whatever_the_secret():
    # Prepare: a small field so that every polynomial can be enumerated; t = 3, holders 1, 2
    prime, holders = 11, [1, 2]

    # Execute: the joint distribution of the two shares over all random coefficients
    def distribution(secret: int) -> Counter[tuple[int, ...]]:
        return Counter(
            tuple(shamir.shares_from_coefficients(secret, list(c), holders, prime).values())
            for c in itertools.product(range(prime), repeat=2)
        )

    # Assert: for every secret, each pair of share values occurs exactly once (uniform on GF(11)^2)
    for secret in range(prime):
        counts = distribution(secret)
        assert len(counts) == prime**2 and set(counts.values()) == {1}


def test_shares_round_trip_through_bytes_and_bad_input_is_refused():
    share = shamir.split(12345, 2, [1, 2])[1]
    assert shamir.share_from_bytes(shamir.share_to_bytes(share)) == share
    with pytest.raises(shamir.ShamirError, match="66 bytes"):
        shamir.share_from_bytes(b"\x00" * 10)
    with pytest.raises(shamir.ShamirError, match="distinct"):
        shamir.split(1, 2, [1, 1, 2])
    with pytest.raises(shamir.ShamirError, match="threshold"):
        shamir.split(1, 4, [1, 2, 3])
