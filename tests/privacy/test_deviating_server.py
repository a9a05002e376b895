"""Three deviations that used to work against certified devices, over the devices' real HTTP bytes.

1. Hidden confirmations: every device is shown the same survivor set but lacks a different one of
   the genuine confirmations, and the target gets only a threshold's worth of its neighbours'
   shares (so it treats the others as dropped, and they reveal its secrets one way or the other).
2. Model inconsistency through mixing: every device but the target gets a huge central gradient
   the server knows, so that their clipped updates are known vectors and the sum minus them is
   the target's update.
3. One device accuses its neighbours of sending shares that failed authentication, to stop the
   round.

The server is the real orchestrator on loopback, its answers rewritten at the devices' transport;
what the attacker holds is what the devices sent (`adversary.server_knowledge` reads it).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from contracts.features import Examples
from contracts.manifest import load_manifest
from contracts.mixing import encode_examples
from contracts.params import SparseTensor, decode_sparse_delta, encode_sparse_delta
from device_runtime import secure_round
from model_export.config import ModelConfig
from secure_aggregation.config import RoundParameters
from secure_aggregation.device import DeviceSession
from secure_aggregation.draws import SessionDraws
from secure_aggregation.messages import AdvertisedKeys, UnmaskingShares
from secure_aggregation.view import PartnerStatement
from tests.orchestrator.conftest import ADMIN_TOKEN, Server
from tests.orchestrator.test_end_to_end import UserData, admin
from tests.privacy.adversary import Reading, server_knowledge
from tests.privacy.test_malicious_server import DEVICES, MaliciousTransport, run_devices
from tests.privacy.test_malicious_server import server as server  # the fixture


def knowledge(transport: MaliciousTransport) -> dict[int, Reading]:
    """What the attacker can read of each masked input from what the devices sent it."""
    assert transport.parameters is not None
    params = RoundParameters.from_json(transport.parameters)
    at = transport.index

    def by_index(suffix: str) -> dict[int, bytes]:
        return {at[s.path.split("/")[3]]: s.body for s in transport.posted(suffix)}

    advertised = {
        i: AdvertisedKeys.from_json(json.loads(b)["keys"]) for i, b in by_index("/secure/keys").items()
    }
    return server_knowledge(
        params,
        advertised,
        lambda owner: sorted(advertised),
        {i: UnmaskingShares.from_json(json.loads(b), 64) for i, b in by_index("/secure/unmasking").items()},
        {i: PartnerStatement.from_json(json.loads(b)) for i, b in by_index("/secure/partners").items()},
        by_index("/masked-input"),
    )


def training_round(url: str) -> dict[str, Any]:
    """The population's first training round (the one the devices took part in)."""
    history = admin(url, "/v1/admin/populations/movies/rounds?kind=training&limit=10")
    first: dict[str, Any] = history[-1]
    return first


def test_hidden_confirmations_and_withheld_shares_read_no_input(
    server: Server, export: Callable[[ModelConfig], Path], movielens_users: UserData, tmp_path: Path
) -> None:
    # Prepare: the target (index 1) gets the ciphertexts of two of its four neighbours only (its
    # threshold); at the unmasking each device lacks one other device's confirmation, a different one
    def hide(path: str, answer: dict[str, Any], index: dict[str, int]) -> dict[str, Any]:
        if not path.endswith("/secure"):
            return answer
        me = index[path.split("/")[3]]
        if "ciphertexts" in answer and me == 1:
            kept = sorted(answer["ciphertexts"])[:2]
            return {**answer, "ciphertexts": {k: answer["ciphertexts"][k] for k in kept}}
        if "confirmations" in answer:
            hidden = str(me % DEVICES + 1)
            shown = {k: v for k, v in answer["confirmations"].items() if k != hidden}
            return {**answer, "confirmations": shown, "confirmed": sorted(int(k) for k in shown)}
        return answer

    # Execute
    participations, transport = run_devices(server, export, movielens_users, tmp_path, DEVICES, hide)

    # Assert: the target's statement names the two it could not mask with, which had masked with
    # it: the server left the target out (an accusation costs the accuser) and it refused, naming
    # why; the other four unmasked their sum, and no input can be read alone
    details = [p.detail for p in participations]
    target = [p for p in participations if p.assignment and transport.index[p.assignment.assignment_id] == 1]
    assert target[0].status == "refused" and "not among the survivors" in target[0].detail, details
    assert sorted(p.status for p in participations) == ["refused"] + ["reported"] * 4, details
    assert training_round(server.url)["status"] == "committed"
    read = knowledge(transport)
    assert len(read) == DEVICES and all(r.unmasked is None for r in read.values()), read


def test_a_known_central_gradient_for_all_but_the_target_reads_nothing_of_its_update(
    server: Server, export: Callable[[ModelConfig], Path], movielens_users: UserData, tmp_path: Path
) -> None:
    # Prepare: a secure population with gradient transfer; every device but the first to download
    # it gets the genuine central gradient times 10^4 (their clipped updates become nearly the
    # known direction of that gradient)
    def gradient_transfer(model_dir: Path) -> None:
        items = np.arange(1500, 1560, dtype=np.int32)
        central = Examples({"item": items, "label": np.full(len(items), 5.0, np.float32)})
        mixing = {
            "strategy": "gradient_transfer",
            "weight": 0.3,
            "central_steps": 8,
            "examples_per_assignment": 16,
        }
        attached = httpx.put(
            f"{server.url}/v1/admin/populations/movies/mixing",
            data={"mixing": json.dumps(mixing)},
            files={
                "examples": ("e.safetensors", encode_examples(central, load_manifest(model_dir).features))
            },
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            timeout=30,
        )
        assert attached.status_code == 200, attached.text

    class KnownGradients(MaliciousTransport):
        def __init__(self) -> None:
            super().__init__(lambda path, answer, index: answer)
            self.target: str | None = None

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            response = await super().handle_async_request(request)
            if request.url.path.endswith("/central-gradient") and response.status_code == 200:
                assignment = request.url.path.split("/")[3]
                self.target = self.target or assignment
                if assignment != self.target:
                    tensors = decode_sparse_delta(await response.aread())
                    huge = {n: SparseTensor(t.shape, t.rows, t.values * 1e4) for n, t in tensors.items()}
                    return httpx.Response(200, content=encode_sparse_delta(huge), headers=response.headers)
            return response

    attacker = KnownGradients()

    # Execute
    participations, _ = run_devices(
        server, export, movielens_users, tmp_path, DEVICES, lambda p, a, i: a, attacker, gradient_transfer
    )

    # Assert: the target's partner statement named other inputs than the rest: the server left it
    # out of the sum and it refused; its masked input stays masked: as for any device left out, its
    # mask key was reconstructed (so the pairwise masks of all its partners), its seed never
    details = [p.detail for p in participations]
    target = [p for p in participations if p.assignment and p.assignment.assignment_id == attacker.target]
    assert target[0].status == "refused" and "not among the survivors" in target[0].detail, details
    read = knowledge(attacker)
    target_index = attacker.index[target[0].assignment.assignment_id]  # type: ignore[union-attr]
    assert read[target_index].unmasked is None, read
    assert read[target_index].secrets == read[target_index].partners, read  # pairwise seeds, no seed
    assert all(r.unmasked is None for r in read.values()), read
    # (and the sum the others unmasked does not hold the target's input)
    round_ = training_round(server.url)
    assert round_["status"] == "committed" and round_["counters"]["reported"] == DEVICES - 1, round_


class _Accuser(DeviceSession):
    """A device whose partner statement names `accused` of its neighbours (the first ones) as having
    sent shares that failed, though it holds and masked with them: a liar."""

    accused = 2

    @property
    def missing(self) -> tuple[int, ...]:
        return tuple(sorted(self.neighbours)[: self.accused])


@pytest.fixture
def one_accuser(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[_Accuser]]:
    made: list[DeviceSession] = []

    def session(params: RoundParameters, draws: SessionDraws | None = None) -> DeviceSession:
        made.append(_Accuser(params, draws) if not made else DeviceSession(params, draws))
        return made[-1]

    monkeypatch.setattr(secure_round, "DeviceSession", session)
    yield _Accuser


@pytest.mark.parametrize("accused", [2, 4], ids=["two neighbours", "every neighbour"])
def test_one_accusing_device_cannot_stop_the_round(
    server: Server,
    export: Callable[[ModelConfig], Path],
    movielens_users: UserData,
    tmp_path: Path,
    one_accuser: type[_Accuser],
    accused: int,
) -> None:
    # Prepare: the first device to join accuses two of its neighbours, or all four
    one_accuser.accused = accused

    # Execute
    participations, transport = run_devices(
        server, export, movielens_users, tmp_path, DEVICES, lambda p, a, i: a
    )

    # Assert: the accuser is out (left out of the sum, or its statement refused: masking with none
    # of its neighbours it could not have sent an input); the other four committed their sum
    details = [p.detail for p in participations]
    assert sorted(p.status for p in participations) == ["refused"] + ["reported"] * 4, details
    round_ = training_round(server.url)
    assert round_["status"] == "committed" and round_["counters"]["reported"] == 4, round_
    assert all(r.unmasked is None for r in knowledge(transport).values())
