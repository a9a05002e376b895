"""The signed view's rules: what a device needs before it reveals anything (secure_aggregation.view)."""

from __future__ import annotations

import dataclasses

import pytest

from secure_aggregation.config import ProtocolError, RoundParameters
from secure_aggregation.device import round_graph
from secure_aggregation.identity import SigningKey
from secure_aggregation.view import Confirmation, PartnerStatement, TaskInputs, View, check_view, quorum

N = 5
CONTEXT = "view/1"
ROSTER = bytes([7]) * 32
INPUTS = TaskInputs("0" * 64, {}, 0, bytes(32)).digest()
PARAMS = RoundParameters(CONTEXT, 8, 32, 1.0, N, 0, 0.5, 3)
KEYS = {i: SigningKey() for i in range(1, N + 1)}
GRAPH = round_graph(PARAMS, list(KEYS))
ALL = frozenset(KEYS)


def view(me: int = 1, survivors: frozenset[int] = ALL, holds: frozenset[int] | None = None) -> View:
    held = frozenset(GRAPH[me]) if holds is None else holds
    return View(PARAMS, GRAPH, ROSTER, {i: k.public for i, k in KEYS.items()}, me, held, INPUTS, survivors)


def confirmations(survivors: frozenset[int] = ALL, who: frozenset[int] = ALL) -> dict[int, Confirmation]:
    return {i: Confirmation.sign(KEYS[i], CONTEXT, ROSTER, survivors, INPUTS) for i in who}


def statements(
    missing: dict[int, tuple[int, ...]] | None = None, inputs: bytes = INPUTS
) -> dict[int, PartnerStatement]:
    missing = missing or {}
    return {i: PartnerStatement.sign(KEYS[i], CONTEXT, ROSTER, inputs, missing.get(i, ())) for i in KEYS}


def test_an_honest_view_passes() -> None:
    check_view(view(), confirmations(), statements())


def test_the_quorum_is_more_than_half_the_roster() -> None:
    assert [quorum(n) for n in (3, 4, 5, 1000)] == [2, 3, 3, 501]
    check_view(view(), confirmations(who=frozenset({1, 2, 3})), statements())
    with pytest.raises(ProtocolError, match="2 devices of the roster of 5 signed"):
        check_view(view(), confirmations(who=frozenset({1, 2})), statements())


def test_confirmations_of_another_view_do_not_count() -> None:
    other = confirmations(survivors=frozenset({1, 2, 3, 4}))
    with pytest.raises(ProtocolError, match="0 devices of the roster"):
        check_view(view(), other, statements())


def test_a_survivor_without_a_statement_is_a_reason_to_refuse_not_a_dropout() -> None:
    shown = statements()
    del shown[3]
    with pytest.raises(ProtocolError, match="survivor 3 has no partner statement"):
        check_view(view(), confirmations(), shown)


def test_a_statement_under_another_index_does_not_verify() -> None:
    shown = statements()
    shown[2], shown[3] = shown[3], shown[2]
    with pytest.raises(ProtocolError, match="not signed by its certified key"):
        check_view(view(), confirmations(), shown)


def test_a_survivor_on_other_inputs_is_refused() -> None:
    shown = statements()
    shown[4] = PartnerStatement.sign(KEYS[4], CONTEXT, ROSTER, bytes([9]) * 32, ())
    with pytest.raises(ProtocolError, match="survivor 4 trained on other inputs"):
        check_view(view(), confirmations(), shown)


def test_a_neighbour_that_disagrees_about_their_masks_is_refused() -> None:
    # device 2 says it did not mask with 1, but 1 holds 2's shares (and masked with it)
    with pytest.raises(ProtocolError, match="survivor 2 and this device disagree"):
        check_view(view(), confirmations(), statements({2: (1,)}))


def test_survivors_whose_masks_split_them_are_refused() -> None:
    # {1, 2} and {3, 4, 5} masked only among themselves: each part's sum could be unmasked
    parts = {1: (3, 4, 5), 2: (3, 4, 5), 3: (1, 2), 4: (1, 2), 5: (1, 2)}
    me = dataclasses.replace(view(), holds=frozenset({2}))
    with pytest.raises(ProtocolError, match="do not connect them all"):
        check_view(me, confirmations(), statements(parts))


def test_a_device_not_among_the_survivors_reveals_nothing() -> None:
    with pytest.raises(ProtocolError, match="not among the survivors"):
        check_view(view(me=1, survivors=frozenset({2, 3, 4, 5})), confirmations(), statements())


def test_the_inputs_digest_covers_the_central_data_and_its_weight() -> None:
    base = TaskInputs("0" * 64, {"a": 1}, 3, bytes(32), None, bytes(32), 0.1, {"context": "x"})
    changed = [
        dataclasses.replace(base, central_gradient_sha256=bytes([1]) * 32),
        dataclasses.replace(base, central_gradient_weight=0.2),
        dataclasses.replace(base, central_examples_sha256=bytes(32)),
        dataclasses.replace(base, model_version=4),
        dataclasses.replace(base, parameters={"context": "y"}),
        dataclasses.replace(base, globals_sha256=bytes([2]) * 32),
        dataclasses.replace(base, manifest_sha256=bytes([3]) * 32),
    ]
    assert len({base.digest(), *(c.digest() for c in changed)}) == 1 + len(changed)
