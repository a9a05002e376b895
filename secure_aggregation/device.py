"""A device's side of one secure round: its secrets and what it may send in each phase.

The object holds the round's secrets (two X25519 private keys, the self-mask seed, the shares it
received) and moves through the phases in order; calling a phase twice or out of order raises, so
that a device can never answer both "reveal the seed of u" and "reveal the mask key of u" for one u.
It is dropped when the round ends, and the secrets with it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence

import numpy as np

from secure_aggregation import crypto, masks, shamir
from secure_aggregation.config import ProtocolError, RoundParameters
from secure_aggregation.draws import SessionDraws
from secure_aggregation.messages import (
    INDEX_BYTES,
    SHARES_PLAINTEXT_BYTES,
    AdvertisedKeys,
    EncryptedShares,
    UnmaskingShares,
)
from secure_aggregation.neighbours import neighbour_graph
from secure_aggregation.view import roster_digest

SHARE_ENCRYPTION = b"share-encryption"
SELF_MASK = b"self-mask"


def pairwise_purpose(u: int, v: int) -> bytes:
    low, high = sorted((u, v))
    return f"pairwise-mask/{low}/{high}".encode()


def pairwise_sign(u: int, v: int) -> int:
    """u adds the pair's mask when u < v and subtracts it otherwise, so the pair cancels in a sum."""
    return 1 if u < v else -1


def self_mask_commitment(seed: bytes, context: str) -> bytes:
    return crypto.commitment(b"self-mask-seed", context.encode(), seed)


def share_commitment(kind: bytes, context: str, owner: int, holder: int, share: bytes) -> bytes:
    return crypto.commitment(
        b"share", kind, context.encode(), str(owner).encode(), str(holder).encode(), share
    )


def share_aad(context: str, roster: bytes, owner: int, holder: int) -> bytes:
    """Bound to the roster digest: shares decrypt only for a holder shown the sender's roster."""
    return crypto.commitment(
        b"shares-aad", context.encode(), roster, str(owner).encode(), str(holder).encode()
    )


def effective_neighbours(params: RoundParameters, roster_size: int) -> int:
    return 0 if params.neighbours >= roster_size - 1 else params.neighbours


def round_graph(params: RoundParameters, roster: Sequence[int]) -> dict[int, list[int]]:
    """The round's neighbour graph over the devices that advertised keys (U1). Shared between
    callers (read it, never change it): the server needs it for nearly every message of a round,
    and building it is O(n k) (8.6 ms at 1,000 devices), which made a round's server time grow
    as n^2 k."""
    members = tuple(sorted(roster))
    return _graph(members, effective_neighbours(params, len(members)), params.context)


@functools.lru_cache(maxsize=32)
def _graph(roster: tuple[int, ...], k: int, context: str) -> dict[int, list[int]]:
    return neighbour_graph(roster, k, context)


class DeviceSession:
    """One device in one secure round; call the phases in order."""

    def __init__(self, params: RoundParameters, draws: SessionDraws | None = None) -> None:
        """`draws`: the secrets given instead of drawn (the conformance kit's fixed ones only)."""
        self.params = params
        self._draws = draws
        if draws is None:
            self._encryption_key = crypto.new_private_key()
            self._mask_key = crypto.new_private_key()
            self._seed = os.urandom(crypto.KEY_BYTES)
        else:
            self._encryption_key = crypto.private_from_bytes(draws.encryption_private)
            self._mask_key = crypto.private_from_bytes(draws.mask_private)
            self._seed = draws.self_mask_seed
        self._phase = "advertise"
        self.index = 0
        self._roster: dict[int, AdvertisedKeys] = {}
        self._neighbours: list[int] = []
        self._received: dict[int, tuple[int, int]] = {}  # owner -> (self-mask share, mask key share)
        # The share-encryption key of each neighbour (X25519 is symmetric: the same key decrypts
        # what that neighbour sent), and the masks prepared while the device trains.
        self._share_keys: dict[int, bytes] = {}
        self._prepared: np.ndarray | None = None
        # The digest of the roster this device shared under (secure_aggregation.view).
        self.roster_digest = b""

    @property
    def neighbours(self) -> list[int]:
        """The roster indices this device shares secrets and masks with (after `share_keys`)."""
        return list(self._neighbours)

    @property
    def holds(self) -> frozenset[int]:
        """The neighbours whose shares this device holds and masked with (after `masked_input`)."""
        return frozenset(self._received)

    @property
    def missing(self) -> tuple[int, ...]:
        """The neighbours it masked nothing with: its partner statement names them."""
        return tuple(sorted(set(self._neighbours) - set(self._received)))

    def _enter(self, phase: str, next_phase: str) -> None:
        if self._phase != phase:
            raise ProtocolError(f"this device is at phase {self._phase!r}, not {phase!r}")
        self._phase = next_phase

    def advertise(self) -> AdvertisedKeys:
        self._enter("advertise", "share_keys")
        return AdvertisedKeys(
            crypto.public_bytes(self._encryption_key),
            crypto.public_bytes(self._mask_key),
            self_mask_commitment(self._seed, self.params.context),
        )

    def share_keys(self, index: int, roster: Mapping[int, AdvertisedKeys]) -> dict[int, EncryptedShares]:
        """Shares of the self-mask seed and the mask key for each neighbour, encrypted to it."""
        mine = roster.get(index)
        if mine is None or mine.encryption_key != crypto.public_bytes(self._encryption_key):
            raise ProtocolError(f"the roster does not hold this device's keys at index {index}")
        smallest = max(3, self.params.min_survivors)
        if len(roster) < smallest:
            raise ProtocolError(f"a roster of {len(roster)} devices is too small (at least {smallest})")
        self._enter("share_keys", "masked_input")
        self.index, self._roster = index, dict(roster)
        self.roster_digest = roster_digest(self.params.context, roster)
        self._neighbours = list(round_graph(self.params, sorted(roster))[index])
        t = self.params.shamir_threshold(len(self._neighbours))
        seed_shares = self._split("self_mask", int.from_bytes(self._seed, "big"), t)
        key_shares = self._split("mask_key", int.from_bytes(crypto.private_bytes(self._mask_key), "big"), t)
        context = self.params.context
        out: dict[int, EncryptedShares] = {}
        for holder in self._neighbours:
            seed_share = shamir.share_to_bytes(seed_shares[holder])
            key_share = shamir.share_to_bytes(key_shares[holder])
            plaintext = (
                index.to_bytes(INDEX_BYTES, "big")
                + holder.to_bytes(INDEX_BYTES, "big")
                + seed_share
                + key_share
            )
            key = crypto.agree(self._encryption_key, roster[holder].encryption_key, SHARE_ENCRYPTION, context)
            self._share_keys[holder] = key
            out[holder] = EncryptedShares(
                crypto.encrypt(key, plaintext, share_aad(context, self.roster_digest, index, holder)),
                share_commitment(b"self-mask", context, index, holder, seed_share),
                share_commitment(b"mask-key", context, index, holder, key_share),
            )
        return out

    def _split(self, kind: str, secret: int, threshold: int) -> dict[int, int]:
        if self._draws is None:
            return shamir.split(secret, threshold, self._neighbours)
        coefficients = self._draws.coefficients(kind, threshold - 1)
        return shamir.shares_from_coefficients(secret, coefficients, self._neighbours)

    def _pairwise_mask(self, v: int) -> np.ndarray:
        seed = crypto.agree(
            self._mask_key, self._roster[v].mask_key, pairwise_purpose(self.index, v), self.params.context
        )
        return masks.expand(seed, self.params)

    def prepare_masks(self) -> None:
        """Sum the self mask and the pairwise masks of every neighbour ahead of the masked input (they
        do not depend on the update; a device computes them while it trains). `masked_input` then
        only takes out the masks of the neighbours that did not share keys. Optional."""
        if self._phase != "masked_input":
            raise ProtocolError(f"masks are prepared after sharing keys; this device is at {self._phase!r}")
        if self._prepared is not None:
            return
        total = np.zeros(self.params.vector_length, dtype=masks.sum_dtype(self.params))
        masks.add_into(
            total, masks.expand(crypto.derive_key(self._seed, SELF_MASK, self.params.context), self.params), 1
        )
        for v in self._neighbours:
            masks.add_into(total, self._pairwise_mask(v), pairwise_sign(self.index, v))
        self._prepared = total

    def masked_input(self, quantized: np.ndarray, ciphertexts: Mapping[int, bytes]) -> np.ndarray:
        """The quantized update plus the self mask and a pairwise mask per neighbour that shared
        keys (the senders of `ciphertexts`, which the device decrypts and keeps for unmasking)."""
        if quantized.shape != (self.params.vector_length,) or quantized.dtype != np.uint64:
            raise ProtocolError(
                f"the quantized update must be uint64 of shape ({self.params.vector_length},)"
            )
        strangers = sorted(set(ciphertexts) - set(self._neighbours))
        if strangers:
            raise ProtocolError(f"shares from devices {strangers}, which are not this device's neighbours")
        if self._phase != "masked_input":
            raise ProtocolError(f"this device is at phase {self._phase!r}, not 'masked_input'")
        context = self.params.context
        for owner, ciphertext in ciphertexts.items():
            key = self._share_keys[owner]
            try:
                plaintext = crypto.decrypt(
                    key, ciphertext, share_aad(context, self.roster_digest, owner, self.index)
                )
                claimed = (
                    int.from_bytes(plaintext[:INDEX_BYTES], "big"),
                    int.from_bytes(plaintext[INDEX_BYTES : 2 * INDEX_BYTES], "big"),
                )
                if claimed != (owner, self.index) or len(plaintext) != SHARES_PLAINTEXT_BYTES:
                    raise ProtocolError(f"shares from {owner} are labelled {claimed[0]} -> {claimed[1]}")
            except ProtocolError:
                # A sender whose shares fail is treated as one that did not share: no pairwise mask
                # with it, and the partner statement says so (`missing`); the server then leaves
                # one of the two out of the sum (secure_aggregation.survivors).
                continue
            body = plaintext[2 * INDEX_BYTES :]
            self._received[owner] = (
                shamir.share_from_bytes(body[: shamir.SHARE_BYTES]),
                shamir.share_from_bytes(body[shamir.SHARE_BYTES :]),
            )
        shared = {owner: c for owner, c in ciphertexts.items() if owner in self._received}
        # Fewer and the server, holding this device's self-mask seed, would need few pairwise masks
        # (none, if it claims no neighbour shared) to read its input; such a round cannot be
        # unmasked honestly either (Bonawitz et al.: |U2| >= t).
        needed = self.params.shamir_threshold(len(self._neighbours))
        if len(shared) < needed:
            self._received.clear()
            raise ProtocolError(
                f"{len(shared)} of this device's neighbours shared keys that it could read; it sends its "
                f"masked input only when at least {needed} did"
            )
        self._enter("masked_input", "unmasking")
        ciphertexts = shared
        total = quantized.copy()
        if self._prepared is not None:
            # Every neighbour's mask is in the prepared sum: take out those that did not share.
            masks.add_into(total, self._prepared, 1)
            for v in sorted(set(self._neighbours) - set(ciphertexts)):
                masks.add_into(total, self._pairwise_mask(v), -pairwise_sign(self.index, v))
            self._prepared = None
        else:
            masks.add_into(
                total, masks.expand(crypto.derive_key(self._seed, SELF_MASK, context), self.params), 1
            )
            for v in sorted(ciphertexts):
                masks.add_into(total, self._pairwise_mask(v), pairwise_sign(self.index, v))
        return total & np.uint64(self.params.modulus_mask)

    def unmask(self, survivors: Sequence[int]) -> UnmaskingShares:
        """Shares of the surviving neighbours' self-mask seeds and the dropped neighbours' mask keys."""
        alive = set(survivors)
        if self.index not in alive:
            raise ProtocolError("this device sent its masked input but is not among the survivors")
        if len(alive) < self.params.min_survivors:
            raise ProtocolError(
                f"{len(alive)} survivors; unmasking needs at least {self.params.min_survivors}, "
                "so that no sum of too few inputs is revealed"
            )
        self._enter("unmasking", "done")
        seeds = {u: shamir.share_to_bytes(s) for u, (s, _) in self._received.items() if u in alive}
        keys = {u: shamir.share_to_bytes(k) for u, (_, k) in self._received.items() if u not in alive}
        return UnmaskingShares(seeds, keys)
