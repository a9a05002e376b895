"""The `secure round` flow: one certified device's whole secure round, run by the real driver.

What the device knows beforehand comes in as the case's `inputs` (JSON): its token and check-in,
its identity (Ed25519 key, the authority's certificate and public key), its privacy floors, its
update (flattened in the manifest's order), the globals and manifest it trained on, and the
random draws a device makes (`secure_aggregation.draws`), fixed from labels. The device then
checks in and goes through every phase with `device_runtime.secure_round.SecureRoundDriver`:
the generator runs this against the real orchestrator, the Python port against the recorded
answers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from conformance.generate_secure import field_element, secret
from conformance.port import of_bytes, to_bytes
from contracts.manifest import Manifest
from contracts.protocol import Assignment
from device_runtime.device_identity import DeviceIdentity
from device_runtime.orchestrator_client import OrchestratorClient
from device_runtime.privacy_policy import PrivacyPolicy
from device_runtime.secure_round import SecureParticipation, SecureRoundDriver
from enrollment_authority.authority import EnrollmentAuthority
from secure_aggregation.draws import SessionDraws
from secure_aggregation.identity import Certificate, SigningKey

# A certificate of the kit's authority, issued at a fixed time, outlives any run of the kit.
ISSUED_AT = 1_767_225_600  # 2026-01-01 UTC
VALIDITY_SECONDS = 100 * 365 * 86_400


def authority() -> EnrollmentAuthority:
    return EnrollmentAuthority(
        Ed25519PrivateKey.from_private_bytes(secret("http/authority")), VALIDITY_SECONDS
    )


@dataclass(frozen=True)
class Device:
    """One device's fixed secrets, by name."""

    name: str
    coefficients: int  # t - 1 of the round it joins
    vector_length: int

    def identity_json(self) -> dict[str, Any]:
        key = SigningKey(Ed25519PrivateKey.from_private_bytes(secret(f"http/{self.name}/signing")))
        certificate = authority().certify(key.public, now=ISSUED_AT)
        return {
            "signing_private": of_bytes(key.private_bytes()),
            "certificate": certificate.to_json(),
            "authority_key": of_bytes(authority().public_key),
        }

    def draws_json(self) -> dict[str, Any]:
        rng = np.random.default_rng(int.from_bytes(secret(f"http/{self.name}/uniforms")[:8], "big"))
        uniforms = rng.random(self.vector_length)
        return {
            "encryption_private": of_bytes(secret(f"http/{self.name}/encryption")),
            "mask_private": of_bytes(secret(f"http/{self.name}/mask")),
            "self_mask_seed": of_bytes(secret(f"http/{self.name}/seed")),
            "self_mask_coefficients": [
                str(field_element(f"http/{self.name}/self_mask/{j}")) for j in range(self.coefficients)
            ],
            "mask_key_coefficients": [
                str(field_element(f"http/{self.name}/mask_key/{j}")) for j in range(self.coefficients)
            ],
            # Rounded to 2^-20 so that JSON carries them exactly in any language.
            "quantization_uniforms": [round(float(u) * 2**20) / 2**20 for u in uniforms],
        }

    def update(self) -> list[float]:
        """A small update (norm below the round's clip), different for each device."""
        salt = sum(self.name.encode())
        return [((salt + 7 * j) % 11 - 5) / 64 for j in range(self.vector_length)]


def identity_of(data: dict[str, Any]) -> DeviceIdentity:
    return DeviceIdentity(
        SigningKey(Ed25519PrivateKey.from_private_bytes(to_bytes(data["signing_private"]))),
        Certificate.from_json(data["certificate"]),
        to_bytes(data["authority_key"]),
    )


def draws_of(data: dict[str, Any]) -> SessionDraws:
    return SessionDraws(
        to_bytes(data["encryption_private"]),
        to_bytes(data["mask_private"]),
        to_bytes(data["self_mask_seed"]),
        tuple(int(c) for c in data["self_mask_coefficients"]),
        tuple(int(c) for c in data["mask_key_coefficients"]),
        tuple(float(u) for u in data["quantization_uniforms"]),
    )


def policy_of(data: dict[str, Any]) -> PrivacyPolicy:
    return PrivacyPolicy(
        frozenset({"secure"}),
        min_summands=int(data["min_summands"]),
        min_threshold=float(data["min_threshold"]),
        certified_roster=True,
    )


async def secure_round(client: OrchestratorClient, inputs: dict[str, Any]) -> SecureParticipation:
    """Check in, then every phase of the round (`inputs` as the module says)."""
    answer = await client.checkin(
        inputs["population"], inputs["example_count"], inputs["task"], inputs["conditions"]
    )
    if not isinstance(answer, Assignment):
        return SecureParticipation("rejected", "checkin", str(answer))
    policy = policy_of(inputs["privacy_policy"])
    policy.check_assignment(answer)
    driver = SecureRoundDriver(
        client, answer, policy, identity=identity_of(inputs["identity"]), draws=draws_of(inputs["draws"])
    )
    left = await driver.share()
    if left is not None:
        return left
    manifest = Manifest.from_json(json.loads(to_bytes(inputs["manifest"])))
    task_inputs = driver.task_inputs(to_bytes(inputs["globals"]), None, None, manifest)
    return await driver.finish_vector(np.asarray(inputs["update"], dtype=np.float64), task_inputs)
