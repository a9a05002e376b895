"""The server's choice of survivors from the senders' partner statements (pure)."""

from __future__ import annotations

from secure_aggregation.survivors import choose
from secure_aggregation.view import PartnerStatement

SAME, OTHER = bytes(32), bytes([1]) * 32


def full_graph(n: int) -> dict[int, list[int]]:
    return {i: [j for j in range(1, n + 1) if j != i] for i in range(1, n + 1)}


def statements(
    n: int, missing: dict[int, tuple[int, ...]] | None = None, inputs: dict[int, bytes] | None = None
) -> dict[int, PartnerStatement]:
    missing, inputs = missing or {}, inputs or {}
    return {i: PartnerStatement(inputs.get(i, SAME), missing.get(i, ()), None) for i in range(1, n + 1)}


def test_honest_senders_all_survive() -> None:
    assert choose(full_graph(5), statements(5)).survivors == frozenset(range(1, 6))


def test_the_most_common_inputs_win() -> None:
    chosen = choose(full_graph(5), statements(5, inputs={2: OTHER}))
    assert chosen.survivors == frozenset({1, 3, 4, 5})
    assert "other inputs" in chosen.left_out[2]


def test_an_accusation_costs_the_accuser() -> None:
    # device 1 says it did not mask with 2 and 3 (their shares "failed"); they masked with it
    chosen = choose(full_graph(5), statements(5, missing={1: (2, 3)}))
    assert chosen.survivors == frozenset({2, 3, 4, 5}) and 1 in chosen.left_out


def test_an_accuser_of_everyone_is_not_believed() -> None:
    chosen = choose(full_graph(6), statements(6, missing={1: (2, 3, 4, 5, 6)}))
    assert chosen.survivors == frozenset({2, 3, 4, 5, 6})


def test_a_device_two_neighbours_could_not_authenticate_leaves_instead_of_them() -> None:
    # device 4 sent garbage to 1 and 2 (or the server corrupted its shares): both name it
    chosen = choose(full_graph(5), statements(5, missing={1: (4,), 2: (4,)}))
    assert chosen.survivors == frozenset({1, 2, 3, 5}) and "could not authenticate" in chosen.left_out[4]


def test_two_colluding_accusers_drop_few() -> None:
    # 1 and 2 both accuse 3: 3 leaves, the round goes on with the rest
    chosen = choose(full_graph(6), statements(6, missing={1: (3,), 2: (3,)}))
    assert chosen.survivors == frozenset({1, 2, 4, 5, 6})


def test_a_device_whose_masks_connect_it_to_no_survivor_leaves() -> None:
    # 5 and everyone else agree they did not mask with each other (5 never got or sent shares)
    missing = {5: (1, 2, 3, 4), **{i: (5,) for i in range(1, 5)}}
    chosen = choose(full_graph(5), statements(5, missing=missing))
    assert chosen.survivors == frozenset({1, 2, 3, 4}) and "connect" in chosen.left_out[5]
