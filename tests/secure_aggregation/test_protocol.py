"""A whole secure round in memory, devices and server as the protocol has them, with dropouts."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from secure_aggregation import server
from secure_aggregation.config import ProtocolError, RoundParameters
from secure_aggregation.device import DeviceSession, round_graph
from secure_aggregation.messages import AdvertisedKeys, EncryptedShares, UnmaskingShares
from secure_aggregation.quantization import quantize

LENGTH = 64


def _params(
    n: int, *, neighbours: int = 0, threshold: float = 0.5, min_survivors: int = 3
) -> RoundParameters:
    return RoundParameters(f"test/{n}/{neighbours}", LENGTH, 32, 1.0, n, neighbours, threshold, min_survivors)


@dataclasses.dataclass
class Round:
    """The messages of one round, the devices' quantized inputs, and the sets of each phase."""

    params: RoundParameters
    devices: dict[int, DeviceSession]
    inputs: dict[int, np.ndarray]
    roster: dict[int, AdvertisedKeys]
    graph: dict[int, list[int]]
    shares: dict[int, dict[int, EncryptedShares]]
    masked: dict[int, np.ndarray]
    responses: dict[int, UnmaskingShares]


def _run(
    params: RoundParameters,
    n: int,
    drop: dict[str, set[int]],
    seed: int = 0,
    prepare: bool = False,
    length: int = LENGTH,
) -> Round:
    """Devices 1..n; `drop[phase]` are the devices that vanish before sending that phase's message;
    with `prepare` each sharer sums its masks before it learns which neighbours shared."""
    rng = np.random.default_rng(seed)
    devices = {i: DeviceSession(params) for i in range(1, n + 1)}
    inputs = {i: quantize(rng.normal(0, 0.05, length), params, rng) for i in devices}
    roster = {i: d.advertise() for i, d in devices.items() if i not in drop.get("advertise", set())}
    graph = round_graph(params, sorted(roster))
    shares = {}
    for i in roster:
        if i not in drop.get("share_keys", set()):
            shares[i] = devices[i].share_keys(i, roster)
            server.check_shares(i, graph, shares[i])
    if prepare:
        for i in shares:
            devices[i].prepare_masks()
    masked = {}
    for i in shares:
        if i not in drop.get("masked_input", set()):
            masked[i] = devices[i].masked_input(inputs[i], server.ciphertexts_for(i, graph, shares))
    responses = {}
    for i in masked:
        if i not in drop.get("unmasking", set()):
            responses[i] = devices[i].unmask(sorted(masked))
            server.check_unmasking(params, i, graph, shares, masked, responses[i], shares)
    return Round(params, devices, inputs, roster, graph, shares, masked, responses)


def _unmask(r: Round) -> np.ndarray:
    total = server.MaskedSum(r.params)
    for vector in r.masked.values():
        total.add(vector)
    return server.unmask(r.params, total.total, r.roster, r.graph, r.shares, r.masked, r.responses)


def _plain_sum(r: Round) -> np.ndarray:
    return sum((r.inputs[i] for i in r.masked), np.zeros(LENGTH, np.uint64)) & np.uint64(
        r.params.modulus_mask
    )


@pytest.mark.parametrize("prepare", [False, True], ids=["masks at input", "masks prepared"])
@pytest.mark.parametrize(("neighbours", "threshold"), [(0, 0.25), (16, 0.125)], ids=["full graph", "k=16"])
def test_with_30_percent_dropping_at_each_phase_the_sum_of_the_survivors_is_exact(
    neighbours, threshold, prepare
):
    # Prepare: 40 devices; about 30% of those left vanish before each phase's message; with
    # `prepare`, each sharer's masks include the 12 neighbours that never shared, taken out later
    n = 40
    params = _params(n, neighbours=neighbours, threshold=threshold)
    ids = np.random.default_rng(3).permutation(np.arange(1, n + 1)).tolist()
    drop = {"share_keys": set(ids[:12]), "masked_input": set(ids[12:20]), "unmasking": set(ids[20:26])}

    # Execute
    r = _run(params, n, drop, prepare=prepare)
    unmasked = _unmask(r)

    # Assert: dropouts at every phase while every neighbourhood kept its threshold, and the unmasked
    # sum is exactly the survivors' plain sum
    assert len(r.shares) == 28 and len(r.masked) == 20 and len(r.responses) == 14
    assert server.unmask_problem(params, r.graph, r.shares, r.masked, r.responses) is None
    assert np.array_equal(unmasked, _plain_sum(r))


# Chi-square over 16 bins of the word's top 4 bits: 73.6 is where a uniform sample exceeds it with
# probability 1e-9 (15 degrees of freedom), so a truly masked input fails this about never.
UNIFORM_CHI2_LIMIT = 73.6


def uniformity_chi2(words: np.ndarray, bits: int) -> float:
    """How far the words' top 4 bits are from uniform over 16 bins. A small quantized input (even
    one whose negative coordinates wrap near 2^bits) sits in the first and last bins only."""
    counts = np.bincount((words >> np.uint64(bits - 4)).astype(np.int64), minlength=16)
    expected = len(words) / 16
    return float(((counts - expected) ** 2 / expected).sum())


def _signed(words: np.ndarray) -> np.ndarray:
    return np.where(words >= 2**31, words.astype(np.float64) - 2**32, words.astype(np.float64))


def test_a_masked_input_alone_is_uniform_noise_unrelated_to_the_input():
    # Prepare: 4,096 coordinates (256 a bin), small inputs of both signs
    params = dataclasses.replace(_params(5), vector_length=4096)
    r = _run(params, 5, {}, length=4096)

    # Execute: what the server holds from device 1, and the same test on the unmasked input
    masked, unmasked = uniformity_chi2(r.masked[1], 32), uniformity_chi2(r.inputs[1], 32)

    # Assert: the masked input is spread over the whole modulus; the unmasked input, whose words
    # also scale to a mean near 0.5 and a spread near 0.5, is not (the check can fail)
    assert masked < UNIFORM_CHI2_LIMIT, masked
    assert unmasked > 100 * UNIFORM_CHI2_LIMIT, unmasked
    scaled = r.inputs[1].astype(np.float64) / 2**32
    assert scaled.std() > 0.2 and abs(scaled.mean() - 0.5) < 0.15  # what the old check took as masked
    # and unrelated to it: the signed words correlate with the input at chance (+-0.05 at 4,096)
    assert abs(np.corrcoef(_signed(r.masked[1]), _signed(r.inputs[1]))[0, 1]) < 0.08


def test_below_the_threshold_nothing_can_be_unmasked():
    # Prepare: 10 devices, full graph, threshold 60% of 9 neighbours = 6 shares; only 5 answer
    params = _params(10, threshold=0.6)
    r = _run(params, 10, {"unmasking": {1, 2, 3, 4, 5}})

    # Execute / Assert
    with pytest.raises(server.CannotUnmask, match="needs 6 shares"):
        _unmask(r)


def test_too_few_masked_inputs_are_never_unmasked():
    # Prepare: 3 of 6 devices drop before masking; the round needs 4 inputs
    params = _params(6, min_survivors=4)
    r = _run(params, 6, {"masked_input": {1, 2, 3}, "unmasking": {4, 5, 6}})

    # Execute / Assert: the server cannot, and a device will not help it
    with pytest.raises(server.CannotUnmask, match="at least 4"):
        _unmask(r)
    with pytest.raises(ProtocolError, match="at least 4"):
        r.devices[4].unmask([4, 5, 6])


def test_a_device_reveals_one_kind_of_share_per_neighbour_and_answers_once():
    # Prepare: device 4 drops after sharing keys
    params = _params(6)
    r = _run(params, 6, {"masked_input": {4}})
    answer = r.responses[1]

    # Assert: seed shares of survivors, mask-key shares of the dropped device, never both
    assert set(answer.self_mask_shares) == {2, 3, 5, 6}
    assert set(answer.mask_key_shares) == {4}
    with pytest.raises(ProtocolError, match="phase"):
        r.devices[1].unmask([1, 2, 3, 5, 6])


def test_a_wrong_share_is_refused_against_its_owners_commitment():
    # Prepare: device 2 answers with the shares device 1 holds instead of its own
    params = _params(6)
    r = _run(params, 6, {"unmasking": {2}})
    forged = UnmaskingShares(dict(r.responses[1].self_mask_shares), {})
    forged.self_mask_shares.pop(2)
    forged.self_mask_shares[1] = forged.self_mask_shares[3]

    # Execute / Assert
    with pytest.raises(ProtocolError, match="not the one device"):
        server.check_unmasking(params, 2, r.graph, r.shares, r.masked, forged, r.shares)


def test_shares_replayed_into_another_round_or_pair_do_not_decrypt_and_their_sender_is_refused():
    # Prepare: two rounds over the same devices' keys would differ by context; here: route device 2's
    # ciphertext for device 3 to device 4 instead
    params = _params(5)
    devices = {i: DeviceSession(params) for i in range(1, 6)}
    roster = {i: d.advertise() for i, d in devices.items()}
    shares = {i: d.share_keys(i, roster) for i, d in devices.items()}
    ciphertexts = {owner: shares[owner][4].ciphertext for owner in (1, 3, 5)}
    ciphertexts[2] = shares[2][3].ciphertext

    # Execute
    devices[4].masked_input(np.zeros(LENGTH, np.uint64), ciphertexts)
    answer = devices[4].unmask([1, 3, 4, 5])

    # Assert: device 2 is reported and treated as not having shared: no share of it is revealed
    assert devices[4].missing == (2,)
    assert set(answer.self_mask_shares) == {1, 3, 5} and answer.mask_key_shares == {}


def test_another_devices_keys_are_refused():
    params = _params(3)
    a, b = DeviceSession(params).advertise(), DeviceSession(params).advertise()
    server.check_advertisement(a, [b])
    with pytest.raises(ProtocolError, match="another device"):
        server.check_advertisement(AdvertisedKeys(b.encryption_key, a.mask_key, a.self_mask_commitment), [b])


def test_shares_to_the_wrong_devices_are_refused():
    params = _params(5)
    devices = {i: DeviceSession(params) for i in range(1, 6)}
    roster = {i: d.advertise() for i, d in devices.items()}
    graph = round_graph(params, sorted(roster))
    shares = devices[1].share_keys(1, roster)
    shares.pop(2)
    with pytest.raises(ProtocolError, match="missing \\[2\\]"):
        server.check_shares(1, graph, shares)


def test_prepared_masks_hide_the_input_and_come_only_after_sharing_keys():
    # Prepare: 6 devices; device 6 never shares, so the others' prepared sums hold a mask for it
    params = _params(6)
    r = _run(params, 6, {"share_keys": {6}}, prepare=True)

    # Assert: the input is masked as without preparing (uniform over the modulus), and the sum exact
    assert uniformity_chi2(r.masked[1], 32) < UNIFORM_CHI2_LIMIT * 4  # 64 coordinates, 4 a bin
    assert uniformity_chi2(r.inputs[1], 32) > UNIFORM_CHI2_LIMIT * 4
    assert np.array_equal(_unmask(r), _plain_sum(r))
    # A device cannot prepare masks before it knows its neighbours, nor after its masked input
    fresh = DeviceSession(params)
    with pytest.raises(ProtocolError, match="after sharing keys"):
        fresh.prepare_masks()
    with pytest.raises(ProtocolError, match="after sharing keys"):
        r.devices[1].prepare_masks()
