"""A malicious server that puts its own keys in a secure round's roster, against certified devices.

Each device (the real runtime, over real HTTP to the real orchestrator) has a signing key certified
by the enrollment authority it trusts, and the server's roster answers are rewritten at the devices'
transport: neighbours the server made (with a certificate from an authority of its own, or none),
real devices' certificates over keys the server substituted, one device's advertisement twice.
With such a roster the server could decrypt the shares sent to "its" neighbours and unmask the
device's input. Each device refuses the roster before it sends a share, naming the entry and why,
so the attacker holds nothing but the device's public keys.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from enrollment_authority.authority import EnrollmentAuthority
from model_export.config import ModelConfig
from secure_aggregation.config import RoundParameters
from secure_aggregation.device import DeviceSession
from secure_aggregation.identity import SignedAdvertisement, SigningKey
from tests.orchestrator.conftest import Server
from tests.orchestrator.test_end_to_end import UserData
from tests.privacy.test_malicious_server import DEVICES, Rewrite, run_devices
from tests.privacy.test_malicious_server import server as server  # the fixture

# An authority of the server's own: it certifies whatever the server asks, and no device trusts it.
SERVERS_AUTHORITY = EnrollmentAuthority()

# (the round's parameters, a real entry as relayed, its roster index) -> the entry the device sees
Substitute = Callable[[RoundParameters, dict[str, Any], str], dict[str, Any]]


def server_made(certificate_from: EnrollmentAuthority | None) -> Substitute:
    """A neighbour the server made: keys whose private halves it holds, signed by a key it holds."""

    def substitute(params: RoundParameters, entry: dict[str, Any], index: str) -> dict[str, Any]:
        keys = DeviceSession(params).advertise()
        if certificate_from is None:
            return keys.to_json()
        key = SigningKey()
        certificate = certificate_from.certify(key.public)
        return SignedAdvertisement.sign(key, certificate, params.context, keys).to_json()

    return substitute


def substituted_keys(params: RoundParameters, entry: dict[str, Any], index: str) -> dict[str, Any]:
    """A real device's certificate and signature, over keys the server put in its place."""
    servers = DeviceSession(params).advertise().to_json()
    return {**entry, "keys": servers}


def every_other_entry(substitute: Substitute) -> Rewrite:
    def rewrite(path: str, answer: dict[str, Any], index: dict[str, int]) -> dict[str, Any]:
        if not (path.endswith("/secure") and "roster" in answer):
            return answer
        own = str(index[path.split("/")[3]])
        params = RoundParameters.from_json(answer["parameters"])
        roster = {
            i: entry if i == own else substitute(params, entry, i) for i, entry in answer["roster"].items()
        }
        return {**answer, "roster": roster}

    return rewrite


def one_device_twice(path: str, answer: dict[str, Any], index: dict[str, int]) -> dict[str, Any]:
    """Another device's certified advertisement in place of a third's (one device counted twice)."""
    if not (path.endswith("/secure") and "roster" in answer):
        return answer
    own = str(index[path.split("/")[3]])
    others = sorted((i for i in answer["roster"] if i != own), key=int)
    return {**answer, "roster": {**answer["roster"], others[1]: answer["roster"][others[0]]}}


@pytest.mark.parametrize(
    ("rewrite", "reason"),
    [
        (
            every_other_entry(server_made(SERVERS_AUTHORITY)),
            "its certificate is not signed by the enrollment authority this device trusts",
        ),
        (every_other_entry(server_made(None)), "advertise keys without a certificate"),
        (
            every_other_entry(substituted_keys),
            "its advertisement is not signed by its certified key for this round",
        ),
        (one_device_twice, "its device key is also device"),
    ],
    ids=[
        "server-made neighbours certified by the server",
        "server-made neighbours without certificates",
        "substituted keys",
        "one device twice",
    ],
)
def test_a_roster_of_keys_the_server_holds_gets_no_shares_and_no_input(
    server: Server,
    export: Callable[[ModelConfig], Path],
    movielens_users: UserData,
    tmp_path: Path,
    rewrite: Rewrite,
    reason: str,
) -> None:
    # Execute: every device sees a roster whose other entries (or one of them) are the server's
    participations, transport = run_devices(server, export, movielens_users, tmp_path, DEVICES, rewrite)

    # Assert: each device named the entry it refused and why, after its keys and before its shares;
    # the attacker holds their public keys and nothing that depends on their updates
    assert [p.status for p in participations] == ["refused"] * DEVICES, [p.detail for p in participations]
    for p in participations:
        assert p.detail.startswith("share_keys: the roster is refused: device"), p.detail
        assert reason in p.detail, p.detail
    assert len(transport.posted("/secure/keys")) == DEVICES
    assert transport.posted("/secure/shares") == [] and transport.posted("/masked-input") == []
    assert transport.posted("/secure/unmasking") == []
