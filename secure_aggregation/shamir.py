"""Shamir secret sharing over a prime field (Shamir, CACM 1979).

A secret s is the constant term of a random polynomial f of degree t-1 over GF(p); the share for
holder x (x >= 1) is f(x). Any t shares determine f, hence s = f(0) by Lagrange interpolation, and
any t-1 shares are uniformly distributed whatever s is (the t-1 random coefficients make them so),
so they reveal nothing. The default field is GF(2^521 - 1), a Mersenne prime larger than any
256-bit secret this package shares.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence

PRIME = 2**521 - 1
SHARE_BYTES = 66  # a field element of GF(2^521 - 1), big-endian


class ShamirError(ValueError):
    """Shares that cannot be made or combined as asked."""


def evaluate(coefficients: Sequence[int], x: int, prime: int = PRIME) -> int:
    """f(x) for f = coefficients[0] + coefficients[1] x + ..., modulo `prime` (Horner)."""
    value = 0
    for c in reversed(coefficients):
        value = (value * x + c) % prime
    return value


def shares_from_coefficients(
    secret: int, coefficients: Sequence[int], holders: Sequence[int], prime: int = PRIME
) -> dict[int, int]:
    """Shares of `secret` for each holder x with the given higher coefficients (degree t-1 = len)."""
    _check_holders(holders, prime)
    if not 0 <= secret < prime:
        raise ShamirError(f"the secret must be in [0, {prime}), got {secret}")
    polynomial = [secret, *coefficients]
    return {x: evaluate(polynomial, x, prime) for x in holders}


def split(secret: int, threshold: int, holders: Sequence[int], prime: int = PRIME) -> dict[int, int]:
    """Shares of `secret` for `holders` (distinct x in [1, prime)), any `threshold` of which recover it."""
    if not 1 <= threshold <= len(holders):
        raise ShamirError(
            f"threshold must be in [1, {len(holders)}] for {len(holders)} holders, got {threshold}"
        )
    coefficients = [secrets.randbelow(prime) for _ in range(threshold - 1)]
    return shares_from_coefficients(secret, coefficients, holders, prime)


def reconstruct(shares: Mapping[int, int], prime: int = PRIME) -> int:
    """f(0) from shares {x: f(x)} by Lagrange interpolation; pass exactly the t shares to use."""
    if not shares:
        raise ShamirError("no shares to reconstruct from")
    _check_holders(list(shares), prime)
    secret = 0
    for x_i, y_i in shares.items():
        numerator, denominator = 1, 1
        for x_j in shares:
            if x_j != x_i:
                numerator = numerator * x_j % prime
                denominator = denominator * (x_j - x_i) % prime
        secret = (secret + y_i * numerator * pow(denominator, -1, prime)) % prime
    return secret


def _check_holders(holders: Sequence[int], prime: int) -> None:
    if len(set(holders)) != len(holders) or any(not 1 <= x < prime for x in holders):
        raise ShamirError(f"holders must be distinct integers in [1, {prime}), got {list(holders)}")


def share_to_bytes(share: int) -> bytes:
    return share.to_bytes(SHARE_BYTES, "big")


def share_from_bytes(data: bytes) -> int:
    if len(data) != SHARE_BYTES:
        raise ShamirError(f"a share is {SHARE_BYTES} bytes, got {len(data)}")
    value = int.from_bytes(data, "big")
    if value >= PRIME:
        raise ShamirError("a share must be a field element below 2^521 - 1")
    return value
