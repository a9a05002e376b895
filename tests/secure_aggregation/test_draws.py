"""A session given its draws (the conformance kit's fixed secrets) sends what they determine, and
still makes a round whose sum unmasks; draws that do not fit the round are refused by name."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from secure_aggregation import server
from secure_aggregation.config import ProtocolError, RoundParameters
from secure_aggregation.device import DeviceSession, round_graph
from secure_aggregation.draws import SessionDraws
from secure_aggregation.quantization import quantize

PARAMS = RoundParameters("test/draws", 8, 24, 1.0, 4, 0, 0.5, 3)


def draws(device: int, coefficients: int = 1) -> SessionDraws:
    def fixed(label: str) -> bytes:
        return hashlib.sha256(f"test/{device}/{label}".encode()).digest()

    return SessionDraws(
        fixed("encryption"),
        fixed("mask"),
        fixed("seed"),
        tuple(int.from_bytes(fixed(f"c/{j}"), "big") for j in range(coefficients)),
        tuple(int.from_bytes(fixed(f"k/{j}"), "big") for j in range(coefficients)),
        tuple((j + device) / 16 for j in range(PARAMS.vector_length)),
    )


def test_given_draws_fix_the_keys_and_the_masked_inputs_and_the_sum_still_unmasks() -> None:
    def run() -> tuple[dict[int, object], dict[int, bytes], np.ndarray, np.ndarray]:
        devices = {i: DeviceSession(PARAMS, draws(i)) for i in range(1, 5)}
        roster = {i: d.advertise() for i, d in devices.items()}
        graph = round_graph(PARAMS, sorted(roster))
        shares = {i: d.share_keys(i, roster) for i, d in devices.items()}
        inputs = {i: quantize(np.full(8, 0.01 * i), PARAMS, draws(i).uniforms()) for i in devices}
        masked = {
            i: d.masked_input(inputs[i], server.ciphertexts_for(i, graph, shares)) for i, d in devices.items()
        }
        responses = {i: d.unmask(sorted(masked)) for i, d in devices.items()}
        total = server.MaskedSum(PARAMS)
        for vector in masked.values():
            total.add(vector)
        unmasked = server.unmask(PARAMS, total.total, roster, graph, shares, masked, responses)
        plain = sum(inputs.values(), np.zeros(8, np.uint64)) & np.uint64(PARAMS.modulus_mask)
        return dict(roster), {i: m.tobytes() for i, m in masked.items()}, unmasked, plain

    roster, masked, unmasked, plain = run()
    again_roster, again_masked, _, _ = run()
    assert roster == again_roster and masked == again_masked
    np.testing.assert_array_equal(unmasked, plain)


def test_draws_with_the_wrong_number_of_coefficients_are_refused_by_name() -> None:
    devices = {i: DeviceSession(PARAMS, draws(i, coefficients=2)) for i in range(1, 5)}
    roster = {i: d.advertise() for i, d in devices.items()}
    with pytest.raises(ProtocolError, match="2 self_mask coefficients given, the round's threshold needs 1"):
        devices[1].share_keys(1, roster)


def test_a_key_of_the_wrong_length_is_refused() -> None:
    with pytest.raises(ProtocolError, match="encryption_private must be 32 bytes"):
        SessionDraws(b"short", bytes(32), bytes(32), (), (), ())
