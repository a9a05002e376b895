"""The server's pure side of a secure round: checks, routing, and unmasking the sum.

No state of its own and no I/O: the caller (the orchestrator's round state machine) keeps the
round's messages wherever it likes and hands them in. The server sees public keys, ciphertexts it
cannot read, commitments, masked inputs and, after the survivors are fixed, exactly one kind of
share per device: what reveals the survivors' sum and nothing more.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet

import numpy as np

from secure_aggregation import crypto, masks, shamir
from secure_aggregation.config import ProtocolError, RoundParameters
from secure_aggregation.device import (
    SELF_MASK,
    pairwise_purpose,
    pairwise_sign,
    self_mask_commitment,
    share_commitment,
)
from secure_aggregation.messages import AdvertisedKeys, EncryptedShares, UnmaskingShares


class CannotUnmask(RuntimeError):
    """Too few survivors, or shares that do not reconstruct what their owner committed to: the
    round must be abandoned, and nothing about its inputs is revealed."""


def check_advertisement(keys: AdvertisedKeys, others: Iterable[AdvertisedKeys]) -> None:
    """A device's keys must be its own: none may repeat a key another device of the round sent."""
    if keys.encryption_key == keys.mask_key:
        raise ProtocolError("the encryption key and the mask key must differ")
    for other in others:
        mine = {keys.encryption_key, keys.mask_key, keys.self_mask_commitment}
        if mine & {other.encryption_key, other.mask_key, other.self_mask_commitment}:
            raise ProtocolError("these keys were already advertised by another device of this round")


def check_shares(
    sender: int, graph: Mapping[int, Sequence[int]], shares: Mapping[int, EncryptedShares]
) -> None:
    """A device's phase-2 message must hold shares for exactly its neighbours."""
    expected = set(graph[sender])
    if set(shares) != expected:
        missing, extra = sorted(expected - set(shares)), sorted(set(shares) - expected)
        raise ProtocolError(
            f"device {sender} must send shares to exactly its neighbours {sorted(expected)}"
            + (f"; missing {missing}" if missing else "")
            + (f"; not neighbours {extra}" if extra else "")
        )


def ciphertexts_for(
    recipient: int,
    graph: Mapping[int, Sequence[int]],
    shares_by_sender: Mapping[int, Mapping[int, EncryptedShares]],
) -> dict[int, bytes]:
    """What the server routes to `recipient`: the shares its neighbours in U2 encrypted to it."""
    return {
        sender: shares_by_sender[sender][recipient].ciphertext
        for sender in graph[recipient]
        if sender in shares_by_sender
    }


def check_unmasking(
    params: RoundParameters,
    holder: int,
    graph: Mapping[int, Sequence[int]],
    shared: Iterable[int],
    survivors: Iterable[int],
    message: UnmaskingShares,
    commitments: Mapping[int, Mapping[int, EncryptedShares]],
    refused: Iterable[int] = (),
) -> None:
    """A survivor's phase-4 message: self-mask shares for exactly its surviving neighbours in U2,
    mask-key shares for exactly its dropped ones, each matching what the owner committed to (none
    for the neighbours whose shares it `refused`: they failed authentication)."""
    u2, u3 = set(shared), set(survivors)
    neighbours = (set(graph[holder]) & u2) - set(refused)
    expected = {"self_mask_shares": neighbours & u3, "mask_key_shares": neighbours - u3}
    got = {"self_mask_shares": message.self_mask_shares, "mask_key_shares": message.mask_key_shares}
    for key, owners in expected.items():
        if set(got[key]) != owners:
            raise ProtocolError(f"{key} must be for exactly devices {sorted(owners)}, got {sorted(got[key])}")
    kinds = {"self_mask_shares": b"self-mask", "mask_key_shares": b"mask-key"}
    for key, shares in got.items():
        for owner, share in shares.items():
            committed = commitments[owner][holder]
            expected_commitment = (
                committed.self_mask_share_commitment
                if key == "self_mask_shares"
                else committed.mask_key_share_commitment
            )
            if share_commitment(kinds[key], params.context, owner, holder, share) != expected_commitment:
                raise ProtocolError(
                    f"the share of device {owner} in {key} is not the one device {owner} sent"
                )


def unmask_problem(
    params: RoundParameters,
    graph: Mapping[int, Sequence[int]],
    shared: Iterable[int],
    survivors: Iterable[int],
    responders: Iterable[int],
    refused: Mapping[int, AbstractSet[int]] | None = None,
    settled: AbstractSet[int] = frozenset(),
    newly_settled: set[int] | None = None,
) -> str | None:
    """Why the sum cannot be unmasked with these sets (U2, U3, U4), or None when it can.
    `refused`: owner -> the survivors that refused its shares (they hold none, and masked nothing
    with it).

    While answers come in, U2, U3 and `refused` are fixed and U4 only grows, so an owner whose
    secret had enough holders keeps them: the caller may pass the owners found so before as
    `settled` (skipped) and collect the ones found now in `newly_settled`. Checking every owner at
    every answer made a round's unmasking O(n^2 k)."""
    u2, u3, u4 = set(shared), set(survivors), set(responders)
    refused = refused or {}
    if len(u3) < params.min_survivors:
        return f"{len(u3)} masked inputs; the round needs at least {params.min_survivors}"
    for owner in sorted(u2 - set(settled)):
        refusers = refused.get(owner, set())
        if owner in u3 or (set(graph[owner]) & u3) - refusers:
            t = params.shamir_threshold(len(graph[owner]))
            holders = len((set(graph[owner]) & u4) - refusers)
            if holders < t:
                what = "self-mask seed" if owner in u3 else "mask key"
                return f"only {holders} of device {owner}'s neighbours answered; its {what} needs {t} shares"
        # (else no survivor masked anything with it: nothing of it to remove)
        if newly_settled is not None:
            newly_settled.add(owner)
    return None


def _reconstruct(shares: Mapping[int, bytes], threshold: int) -> bytes:
    chosen = dict(sorted(shares.items())[:threshold])
    value = shamir.reconstruct({x: shamir.share_from_bytes(s) for x, s in chosen.items()})
    if value >= 1 << (8 * crypto.KEY_BYTES):
        raise CannotUnmask("the shares reconstruct a value too large to be a 32-byte secret")
    return value.to_bytes(crypto.KEY_BYTES, "big")


def unmask(
    params: RoundParameters,
    masked_sum: np.ndarray,
    roster: Mapping[int, AdvertisedKeys],
    graph: Mapping[int, Sequence[int]],
    shared: Iterable[int],
    survivors: Iterable[int],
    responses: Mapping[int, UnmaskingShares],
    refused: Mapping[int, AbstractSet[int]] | None = None,
) -> np.ndarray:
    """The sum of the survivors' quantized inputs (uint64 modulo 2^bits) from the sum of their
    masked inputs: remove each survivor's self mask and each pairwise mask a survivor shares with
    a device that dropped after sharing keys (pairs of survivors cancel by themselves)."""
    u2, u3 = set(shared), set(survivors)
    refused = refused or {}
    problem = unmask_problem(params, graph, u2, u3, responses, refused)
    if problem is not None:
        raise CannotUnmask(problem)
    # Reduced to the masks' dtype first (its modulus is a multiple of 2^bits): same-dtype adds.
    total = np.asarray(masked_sum).astype(masks.sum_dtype(params))
    context = params.context
    for owner in sorted(u2):
        t = params.shamir_threshold(len(graph[owner]))
        if owner in u3:
            shares = {
                h: r.self_mask_shares[owner] for h, r in responses.items() if owner in r.self_mask_shares
            }
            seed = _reconstruct(shares, t)
            if self_mask_commitment(seed, context) != roster[owner].self_mask_commitment:
                raise CannotUnmask(f"device {owner}'s shares do not reconstruct the seed it committed to")
            masks.add_into(total, masks.expand(crypto.derive_key(seed, SELF_MASK, context), params), -1)
        else:
            masked_with = sorted((set(graph[owner]) & u3) - refused.get(owner, set()))
            if not masked_with:
                continue
            shares = {h: r.mask_key_shares[owner] for h, r in responses.items() if owner in r.mask_key_shares}
            private = crypto.private_from_bytes(_reconstruct(shares, t))
            if crypto.public_bytes(private) != roster[owner].mask_key:
                raise CannotUnmask(f"device {owner}'s shares do not reconstruct the mask key it advertised")
            for survivor in masked_with:
                seed = crypto.agree(
                    private, roster[survivor].mask_key, pairwise_purpose(owner, survivor), context
                )
                # The survivor added sign(survivor, owner) x mask; take it away.
                masks.add_into(total, masks.expand(seed, params), -pairwise_sign(survivor, owner))
    return total.astype(np.uint64) & np.uint64(params.modulus_mask)


class MaskedSum:
    """The running sum of masked inputs modulo 2^bits: memory O(model) however many devices send."""

    def __init__(self, params: RoundParameters) -> None:
        self.params = params
        self.total = np.zeros(params.vector_length, dtype=np.uint64)
        self.count = 0

    def add(self, masked_input: np.ndarray) -> None:
        if masked_input.shape != self.total.shape:
            raise ProtocolError(f"a masked input has shape {masked_input.shape}, expected {self.total.shape}")
        np.add(self.total, masked_input, out=self.total)  # wraps modulo 2^64, a multiple of 2^bits
        self.count += 1
