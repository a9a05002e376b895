"""The device's identity: a signing key kept in its key store (not with its examples), certified once,
renewed near expiry."""

from __future__ import annotations

from pathlib import Path

import pytest

from device_runtime.device_identity import RENEW_SECONDS, DeviceIdentity
from device_runtime.key_store import KeyDirectory
from enrollment_authority.authority import EnrollmentAuthority
from secure_aggregation.config import ProtocolError
from secure_aggregation.identity import Certificate

NOW = 1_800_000_000.0


def test_the_identity_is_kept_in_the_key_store_and_renewed_before_its_certificate_expires(
    tmp_path: Path,
) -> None:
    authority = EnrollmentAuthority(validity_seconds=10 * 86_400)
    asked: list[bytes] = []

    def certify(key: bytes) -> Certificate:
        asked.append(key)
        return authority.certify(key, NOW)

    first = DeviceIdentity.load_or_enroll(KeyDirectory(tmp_path / "keys"), certify, authority.public_key, NOW)
    # A restarted app: a new KeyDirectory object on the same directory.
    keys = KeyDirectory(tmp_path / "keys")
    again = DeviceIdentity.load_or_enroll(keys, certify, authority.public_key, NOW + 86_400)
    late = NOW + 10 * 86_400 - RENEW_SECONDS + 1
    renewed = DeviceIdentity.load_or_enroll(keys, certify, authority.public_key, late)

    assert again.signing_key.public == first.signing_key.public and len(asked) == 2
    assert renewed.signing_key.public != first.signing_key.public
    (key_file,) = (tmp_path / "keys").iterdir()
    assert key_file.stat().st_mode & 0o077 == 0  # the owner's only


def test_a_key_name_outside_the_alphabet_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"a key's name is 1 to 64 of a-z.*got '../x'"):
        KeyDirectory(tmp_path).save_key("../x", b"k")


def test_a_certificate_from_another_authority_is_refused_at_enrollment() -> None:
    trusted, other = EnrollmentAuthority(), EnrollmentAuthority()

    with pytest.raises(ProtocolError, match="not signed by the enrollment authority this device trusts"):
        DeviceIdentity.enroll(other.certify, trusted.public_key)
