"""Certified device keys and signed key advertisements, tried as a malicious server would: keys it
made itself, a certificate from another authority, a substituted key, a replay from another round,
a device or a key twice. Real Ed25519 (from `cryptography`) throughout."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from enrollment_authority.authority import EnrollmentAuthority, EnrollmentError
from secure_aggregation.config import ProtocolError, RoundParameters
from secure_aggregation.device import DeviceSession
from secure_aggregation.identity import (
    Certificate,
    SignedAdvertisement,
    SigningKey,
    check_signed_advertisement,
    verified_roster,
    verify,
)

CONTEXT = "movies/7/00ff"
NOW = 1_800_000_000.0


def _params() -> RoundParameters:
    return RoundParameters(CONTEXT, 16, 32, 1.0, 10, 0, 0.5, 3)


def _device(authority: EnrollmentAuthority, context: str = CONTEXT) -> tuple[SigningKey, SignedAdvertisement]:
    key = SigningKey()
    certificate = authority.certify(key.public, NOW)
    keys = DeviceSession(dataclasses.replace(_params(), context=context)).advertise()
    return key, SignedAdvertisement.sign(key, certificate, context, keys)


def _roster(authority: EnrollmentAuthority, n: int = 4) -> dict[int, SignedAdvertisement]:
    return {i: _device(authority)[1] for i in range(1, n + 1)}


def test_a_roster_of_certified_signed_advertisements_is_accepted_and_survives_the_wire() -> None:
    authority = EnrollmentAuthority()
    roster = {i: SignedAdvertisement.from_json(a.to_json()) for i, a in _roster(authority).items()}

    keys = verified_roster(roster, authority.public_key, CONTEXT, NOW)

    assert keys == {i: a.keys for i, a in roster.items()}


def test_keys_the_server_made_itself_are_refused() -> None:
    # The server cannot certify: a certificate from its own authority-like key does not verify
    trusted, servers_own = EnrollmentAuthority(), EnrollmentAuthority()
    roster = _roster(trusted)
    roster[3] = _device(servers_own)[1]

    with pytest.raises(
        ProtocolError, match="device 3: its certificate is not signed by the enrollment authority"
    ):
        verified_roster(roster, trusted.public_key, CONTEXT, NOW)


def test_a_substituted_key_under_a_real_certificate_is_refused() -> None:
    # The server keeps device 2's certificate and signature but puts its own mask key in
    authority = EnrollmentAuthority()
    roster = _roster(authority)
    forged = DeviceSession(_params()).advertise()
    roster[2] = dataclasses.replace(
        roster[2], keys=dataclasses.replace(roster[2].keys, mask_key=forged.mask_key)
    )

    with pytest.raises(ProtocolError, match="device 2: its advertisement is not signed by its certified key"):
        verified_roster(roster, authority.public_key, CONTEXT, NOW)


def test_an_advertisement_replayed_from_another_round_is_refused() -> None:
    authority = EnrollmentAuthority()
    roster = _roster(authority)
    roster[4] = _device(authority, context="movies/6/00ee")[1]

    with pytest.raises(ProtocolError, match="device 4: its advertisement is not signed"):
        verified_roster(roster, authority.public_key, CONTEXT, NOW)


def test_one_device_twice_or_one_key_twice_is_refused() -> None:
    authority = EnrollmentAuthority()
    key, first = _device(authority)
    again = SignedAdvertisement.sign(key, first.certificate, CONTEXT, DeviceSession(_params()).advertise())
    roster = {1: first, 2: _device(authority)[1], 3: again}

    with pytest.raises(ProtocolError, match="device 3: its device key is also device 1's"):
        verified_roster(roster, authority.public_key, CONTEXT, NOW)

    # Another certified device that advertises device 1's encryption key (to receive its shares)
    other_key = SigningKey()
    copied = dataclasses.replace(
        DeviceSession(_params()).advertise(), encryption_key=first.keys.encryption_key
    )
    thief = SignedAdvertisement.sign(other_key, authority.certify(other_key.public, NOW), CONTEXT, copied)
    with pytest.raises(ProtocolError, match="device 3: it reuses a key that device 1 advertised"):
        verified_roster({1: first, 2: _device(authority)[1], 3: thief}, authority.public_key, CONTEXT, NOW)


def test_an_expired_certificate_is_refused() -> None:
    authority = EnrollmentAuthority(validity_seconds=60)
    roster = _roster(authority)

    with pytest.raises(ProtocolError, match="certificate expired"):
        verified_roster(roster, authority.public_key, CONTEXT, NOW + 61)


def test_a_device_signs_only_with_its_own_certificate() -> None:
    authority = EnrollmentAuthority()
    key, other = SigningKey(), SigningKey()

    with pytest.raises(ProtocolError, match="certificate is for another signing key"):
        SignedAdvertisement.sign(
            key, authority.certify(other.public, NOW), CONTEXT, DeviceSession(_params()).advertise()
        )


def test_the_authority_refuses_what_is_not_a_device_key_and_keeps_its_key(tmp_path: Path) -> None:
    path = tmp_path / "authority.pem"
    authority = EnrollmentAuthority.load_or_create(path)

    reloaded = EnrollmentAuthority.load_or_create(path)

    assert reloaded.public_key == authority.public_key and path.stat().st_mode & 0o777 == 0o600
    with pytest.raises(EnrollmentError, match="raw Ed25519 public key of 32 bytes, got 31"):
        authority.certify(b"x" * 31)
    certificate = reloaded.certify(SigningKey().public, NOW)
    assert certificate.problem(authority.public_key, NOW) is None
    assert Certificate.from_json(certificate.to_json()) == certificate


def test_the_server_refuses_an_advertisement_signed_for_another_round_or_a_device_key_twice() -> None:
    authority = EnrollmentAuthority()
    key, signed = _device(authority)
    other_round = _device(authority, context="movies/8/00ff")[1]
    again = SignedAdvertisement.sign(key, signed.certificate, CONTEXT, DeviceSession(_params()).advertise())

    check_signed_advertisement(signed, CONTEXT, [])
    with pytest.raises(ProtocolError, match="not signed by its certificate's key for this round"):
        check_signed_advertisement(other_round, CONTEXT, [])
    with pytest.raises(ProtocolError, match="this device key already advertised keys in this round"):
        check_signed_advertisement(again, CONTEXT, [signed])


def test_a_remembered_verdict_is_for_the_same_bytes_only() -> None:
    """Verdicts are memoized (a simulated fleet checks one roster once per phone): a signature that
    verified must not make a forged one over the same message, or the same one over another, pass."""
    key = SigningKey()
    message = b"the survivors of round 7"
    signature = key.sign(message)
    forged = bytes([signature[0] ^ 1]) + signature[1:]

    assert verify(key.public, signature, message)
    assert verify(key.public, signature, message)  # remembered
    assert not verify(key.public, forged, message)
    assert not verify(key.public, signature, message + b".")
    assert not verify(SigningKey().public, signature, message)
    assert not verify(b"\x00" * 31, signature, message)  # not a key at all: False, not an error
