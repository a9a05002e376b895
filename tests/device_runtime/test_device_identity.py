"""The device's identity: a signing key kept in its own store, certified once, renewed near expiry."""

from __future__ import annotations

from pathlib import Path

import pytest

from device_runtime.device_identity import RENEW_SECONDS, DeviceIdentity
from device_runtime.example_store import ExampleStore
from enrollment_authority.authority import EnrollmentAuthority
from secure_aggregation.config import ProtocolError
from secure_aggregation.identity import Certificate
from tests.conftest import MOVIELENS

NOW = 1_800_000_000.0


def test_the_identity_is_kept_in_the_store_and_renewed_before_its_certificate_expires(tmp_path: Path) -> None:
    authority = EnrollmentAuthority(validity_seconds=10 * 86_400)
    asked: list[bytes] = []

    def certify(key: bytes) -> Certificate:
        asked.append(key)
        return authority.certify(key, NOW)

    with ExampleStore(tmp_path / "device.sqlite", MOVIELENS.features()) as store:
        first = DeviceIdentity.load_or_enroll(store, certify, authority.public_key, NOW)
        again = DeviceIdentity.load_or_enroll(store, certify, authority.public_key, NOW + 86_400)
        late = NOW + 10 * 86_400 - RENEW_SECONDS + 1
        renewed = DeviceIdentity.load_or_enroll(store, certify, authority.public_key, late)

    assert again.signing_key.public == first.signing_key.public and len(asked) == 2
    assert renewed.signing_key.public != first.signing_key.public


def test_a_certificate_from_another_authority_is_refused_at_enrollment() -> None:
    trusted, other = EnrollmentAuthority(), EnrollmentAuthority()

    with pytest.raises(ProtocolError, match="not signed by the enrollment authority this device trusts"):
        DeviceIdentity.enroll(other.certify, trusted.public_key)
