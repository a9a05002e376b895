"""Secure aggregation's HTTP messages from devices that lie: each gets a clear 4xx, and the round's
other devices finish it as if nothing happened."""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from contracts.manifest import load_manifest
from contracts.params import decode_params, encode_sparse_delta
from model_export.config import ModelConfig
from secure_aggregation.config import RoundParameters
from secure_aggregation.device import DeviceSession
from secure_aggregation.messages import (
    AdvertisedKeys,
    UnmaskingShares,
    ciphertexts_from_json,
    encode_vector,
    shares_to_json,
)
from secure_aggregation.quantization import Layout, dequantize_sum, quantize
from secure_aggregation.view import Confirmation, PartnerStatement
from tests.conftest import BIASED
from tests.orchestrator.conftest import ADMIN_TOKEN, Server, admin_create_population

SETTINGS = {
    "target_reports": 5,
    "oversampling": 1.0,
    "min_reports": 3,
    "min_examples": 3,
    "aggregation": "secure",
    "secure": {
        "clip_norm": 1.0,
        "neighbours": 0,
        "threshold": 0.5,
        "share_keys_seconds": 30,
        "masked_input_seconds": 30,
        "unmasking_seconds": 30,
        # Each device here sends when the test says, not at a fleet's pace.
        "straggler_wait": None,
    },
}

# The consistency check of a device without an identity: the hashes of what it trained on, unsigned.
UNSIGNED = Confirmation(bytes(32), None).to_json()


class Device:
    """An enrolled device with one assignment in the open secure round."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.token = httpx.post(f"{url}/v1/devices", timeout=10).json()["token"]
        checkin = self.call("POST", "/v1/populations/p/checkin", json={"example_count": 50})
        assert checkin.status_code == 200 and checkin.json()["aggregation"] == "secure", checkin.text
        self.checkin = checkin.json()
        self.assignment = checkin.json()["assignment_id"]
        self.secure = checkin.json()["secure_url"]
        self.session: DeviceSession | None = None
        self.stated = False  # sent its partner statement

    def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token}", **kwargs.pop("headers", {})}
        return httpx.request(method, f"{self.url}{path}", headers=headers, timeout=30, **kwargs)

    def send(self, phase: str, body: Any, assignment_url: str | None = None) -> httpx.Response:
        url = f"{assignment_url or self.secure}/{phase}"
        if phase == "masked-input" and self.session is not None and not self.stated:
            # A masked input comes after the device's partner statement (unsigned: no identity).
            statement = PartnerStatement(bytes(32), self.session.missing, None).to_json()
            self.stated = self.call("POST", f"{self.secure}/partners", json=statement).status_code == 200
        if isinstance(body, bytes):
            return self.call("POST", url, content=body, headers={"Content-Type": "application/octet-stream"})
        return self.call("POST", url, json=body)

    def state(self) -> dict[str, Any]:
        response = self.call("GET", self.secure)
        assert response.status_code == 200, response.text
        return dict(response.json())


def _refused(response: httpx.Response, status: int, words: str) -> None:
    assert response.status_code == status, response.text
    assert words in response.json()["detail"], response.text


def test_lying_messages_are_refused_and_the_round_commits_without_harm(
    server: Server, export: Callable[[ModelConfig], Path]
) -> None:
    # Prepare: four honest devices and a liar (device 4) in one secure round
    model_dir = export(BIASED)
    created = admin_create_population(server.url, model_dir, "p", json.dumps(SETTINGS))
    assert created.status_code == 201, created.text
    devices = [Device(server.url) for _ in range(5)]
    honest, liar = devices[:4], devices[4]
    params = RoundParameters.from_json(devices[0].state()["parameters"])
    manifest = load_manifest(model_dir)
    layout = Layout.of(manifest.global_params)
    rng = np.random.default_rng(0)
    inputs = [quantize(rng.normal(0, 0.01, layout.length), params, rng) for _ in devices]
    for device in devices:
        device.session = DeviceSession(params)
    keys = [d.session.advertise().to_json() for d in devices if d.session]

    # Execute / Assert, phase by phase
    zero = {s.name: np.zeros(s.shape, np.float32) for s in manifest.global_params}
    report = honest[0].call(
        "POST", f"/v1/assignments/{honest[0].assignment}/report", content=encode_sparse_delta(zero)
    )
    _refused(report, 409, "secure aggregation")
    for device, mine in zip(honest, keys, strict=False):
        assert device.send("keys", mine).status_code == 200
    _refused(honest[0].send("keys", keys[0]), 409, "already advertised")  # replayed
    _refused(liar.send("keys", keys[0]), 422, "another device")  # someone else's keys
    _refused(liar.send("keys", {**keys[4], "mask_key": "AAAA"}), 422, "32 bytes")
    _refused(liar.send("keys", keys[4], honest[0].secure), 403, "another device")  # not its assignment
    assert liar.send("keys", keys[4]).status_code == 200  # the fifth: the roster closes

    stranger = httpx.get(f"{server.url}{liar.secure}", headers={"Authorization": "Bearer x.y"}, timeout=30)
    assert stranger.status_code == 401 and stranger.headers["WWW-Authenticate"] == "Bearer", stranger.text
    roster_json = liar.state()["roster"]
    roster = {int(i): AdvertisedKeys.from_json(k) for i, k in roster_json.items()}
    index = {
        d: next(i for i, k in roster.items() if k.to_json() == key)
        for d, key in zip(devices, keys, strict=True)
    }
    shares = {d: d.session.share_keys(index[d], roster) for d in devices if d.session}
    for device in honest:
        assert device.send("shares", shares_to_json(shares[device])).status_code == 200
    partial = dict(list(shares[liar].items())[:2])
    _refused(liar.send("shares", shares_to_json(partial)), 422, "exactly its neighbours")
    _refused(liar.send("masked-input", b"\0" * 16), 409, "'share_keys' phase, not 'masked_input'")
    assert liar.send("shares", shares_to_json(shares[liar])).status_code == 200

    for device, vector in zip(devices, inputs, strict=True):
        assert device.session is not None
        ciphertexts = ciphertexts_from_json(device.state()["ciphertexts"], len(roster))
        masked = encode_vector(device.session.masked_input(vector, ciphertexts), params)
        if device is liar:
            _refused(liar.send("masked-input", masked[:-4]), 422, "bytes")  # wrong size
        assert device.send("masked-input", masked).status_code == 200
        if device is honest[1]:
            _refused(device.send("masked-input", masked), 409, "already sent")  # replayed

    survivors = honest[0].state()["survivors"]
    _refused(liar.send("consistency", {"globals_sha256": "AA=="}), 422, "confirmation")
    for device in devices:
        assert device.send("consistency", UNSIGNED).status_code == 200
    answers = {d: d.session.unmask(survivors) for d in devices if d.session}
    forged = UnmaskingShares(
        dict(answers[honest[0]].self_mask_shares), dict(answers[honest[0]].mask_key_shares)
    )
    del forged.self_mask_shares[index[liar]]
    forged.self_mask_shares[index[honest[0]]] = answers[liar].self_mask_shares[index[honest[1]]]
    _refused(liar.send("unmasking", forged.to_json()), 422, "is not the one device")
    # The server unmasks as soon as it has enough shares (here two); later answers are not needed.
    replies = [device.send("unmasking", answers[device].to_json()) for device in honest]
    assert [r.status_code for r in replies[:2]] == [200, 200]
    assert all(r.status_code == 200 or "committed" in r.json()["detail"] for r in replies), replies

    # The round committed: base + mean of all five quantized inputs (server SGD, rate 1)
    status = httpx.get(
        f"{server.url}/v1/admin/populations/p",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=10,
    ).json()
    assert status["current_version"] == 1
    blob = honest[0].call("GET", "/v1/populations/p/models/1/global").content
    base = decode_params(
        (model_dir / "global_params.safetensors").read_bytes(), manifest.global_params, "base"
    )
    new = decode_params(blob, manifest.global_params, "version 1")
    total = np.sum(inputs, axis=0, dtype=np.uint64)
    expected = layout.flatten(base) + dequantize_sum(total, params) / 5
    assert np.allclose(layout.flatten(new), expected, atol=1e-6)


def test_a_round_whose_mean_is_longer_than_the_clip_norm_is_abandoned(
    server: Server, export: Callable[[ModelConfig], Path]
) -> None:
    # Prepare: three devices; one skips clipping and sends 2 x clip_norm in every coordinate
    model_dir = export(BIASED)
    settings = {**SETTINGS, "target_reports": 3}
    created = admin_create_population(server.url, model_dir, "p", json.dumps(settings))
    assert created.status_code == 201, created.text
    devices = [Device(server.url) for _ in range(3)]
    params = RoundParameters.from_json(devices[0].state()["parameters"])
    sessions = [DeviceSession(params) for _ in devices]
    inputs = [np.zeros(params.vector_length, np.uint64) for _ in devices]
    inputs[0][:] = np.uint64(2 * params.levels)

    # Execute: the protocol, followed honestly otherwise
    indices = [
        d.send("keys", s.advertise().to_json()).json()["index"]
        for d, s in zip(devices, sessions, strict=True)
    ]
    roster = {int(i): AdvertisedKeys.from_json(k) for i, k in devices[0].state()["roster"].items()}
    for device, session, index in zip(devices, sessions, indices, strict=True):
        assert device.send("shares", shares_to_json(session.share_keys(index, roster))).status_code == 200
    for device, session, vector in zip(devices, sessions, inputs, strict=True):
        ciphertexts = ciphertexts_from_json(device.state()["ciphertexts"], len(roster))
        device.session = session
        assert (
            device.send(
                "masked-input", encode_vector(session.masked_input(vector, ciphertexts), params)
            ).status_code
            == 200
        )
    survivors = devices[0].state()["survivors"]
    for device in devices:
        assert device.send("consistency", UNSIGNED).status_code == 200
    for device, session in zip(devices, sessions, strict=True):
        device.send("unmasking", session.unmask(survivors).to_json())

    # Assert: the server refuses to commit a mean no honest round can produce
    state = devices[0].state()
    assert state["phase"] == "done" and state["round_status"] == "abandoned"
    assert "norm" in state["outcome"] and "clip_norm" in state["outcome"]


def test_a_device_waiting_for_the_next_phase_is_answered_when_it_opens(
    server: Server, export: Callable[[ModelConfig], Path]
) -> None:
    # Prepare: a round of three devices, two of which advertised their keys
    model_dir = export(BIASED)
    created = admin_create_population(
        server.url, model_dir, "p", json.dumps({**SETTINGS, "target_reports": 3})
    )
    assert created.status_code == 201, created.text
    devices = [Device(server.url) for _ in range(3)]
    params = RoundParameters.from_json(devices[0].state()["parameters"])
    for device in devices[:2]:
        assert device.send("keys", DeviceSession(params).advertise().to_json()).status_code == 200

    # Execute: the first device asks for the state once the roster is out; the third advertises
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(devices[0].call, "GET", devices[0].secure, params={"until": "share_keys"})
        time.sleep(0.5)
        held = not waiting.done()
        assert devices[2].send("keys", DeviceSession(params).advertise().to_json()).status_code == 200
        answer = waiting.result(timeout=30)
    unknown = devices[0].call("GET", devices[0].secure, params={"until": "tomorrow"})
    round_parameters = answer.json()["parameters"]

    # Assert: the answer waited for the phase and then brought the roster; a phase that does not
    # exist is refused
    assert held
    assert answer.status_code == 200 and answer.json()["phase"] == "share_keys", answer.text
    assert len(answer.json()["roster"]) == 3
    _refused(unknown, 422, "until must be one of the phases")
    # Each check-in's answer carried the round's parameters (the device needs no state before its keys)
    assert [d.checkin["secure_parameters"] for d in devices] == [round_parameters] * 3


def test_a_message_with_until_is_answered_with_the_next_phase_once_it_opens(
    server: Server, export: Callable[[ModelConfig], Path]
) -> None:
    # Prepare: a round of three devices
    created = admin_create_population(
        server.url, export(BIASED), "p", json.dumps({**SETTINGS, "target_reports": 3})
    )
    assert created.status_code == 201, created.text
    devices = [Device(server.url) for _ in range(3)]
    params = RoundParameters.from_json(devices[0].checkin["secure_parameters"])
    keys = [DeviceSession(params).advertise().to_json() for _ in devices]
    until = {"until": "share_keys"}

    # Execute: a phase that does not exist is refused before the message counts; then the first
    # device advertises and waits for the roster, and the last device's keys complete it
    unknown = devices[0].call("POST", f"{devices[0].secure}/keys", json=keys[0], params={"until": "later"})
    too_long = devices[0].call("GET", devices[0].secure, params={"until": "share_keys", "wait": 1000})
    asked = time.monotonic()
    short = devices[0].call("GET", devices[0].secure, params={"until": "share_keys", "wait": 0.5})
    short_seconds = time.monotonic() - asked
    assert devices[1].send("keys", keys[1]).status_code == 200
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(
            devices[0].call, "POST", f"{devices[0].secure}/keys", json=keys[0], params=until
        )
        time.sleep(0.5)
        held = not waiting.done()
        last = devices[2].call("POST", f"{devices[2].secure}/keys", json=keys[2], params=until)
        first = waiting.result(timeout=30)

    # Assert: each answer has the device's index and the roster's state; the first was held until
    # the roster was out, the last one completed it and was answered at once
    _refused(unknown, 422, "until must be one of the phases")
    assert too_long.status_code == 422 and "wait" in too_long.text, too_long.text
    # A hold as short as the device asked for, answered with the phase it is still in
    assert short.status_code == 200 and short.json()["phase"] == "advertise" and 0.5 <= short_seconds < 5
    assert held
    for device, answer in ((devices[0], first), (devices[2], last)):
        assert answer.status_code == 200, answer.text
        state = answer.json()["state"]
        assert state["phase"] == "share_keys" and len(state["roster"]) == 3
        assert state["index"] == answer.json()["index"]
        assert state == {**device.state(), "seconds_left": state["seconds_left"]}


def _upload_half_and_hang_up(url: str, path: str, token: str, body: bytes) -> None:
    """A phone that loses its network mid-upload: the headers and half the body, then the
    connection closes."""
    address = httpx.URL(url)
    assert address.host and address.port
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {address.host}:{address.port}\r\n"
        f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((address.host, address.port), timeout=10) as connection:
        connection.sendall(head + body[: len(body) // 2])
        time.sleep(0.3)  # the server has started reading the body


def test_a_device_that_goes_away_while_uploading_its_shares_leaves_nothing_behind(
    tmp_path: Path, export: Callable[[ModelConfig], Path]
) -> None:
    # Prepare: a round of three devices in the share-keys phase; the server logs at DEBUG
    model_dir = export(BIASED)
    log_path = tmp_path / "orchestrator.log"
    server = Server(tmp_path / "orchestrator.sqlite", settings={"log_level": "debug"}, log_path=log_path)
    server.start()
    try:
        created = admin_create_population(
            server.url, model_dir, "p", json.dumps({**SETTINGS, "target_reports": 3})
        )
        assert created.status_code == 201, created.text
        devices = [Device(server.url) for _ in range(3)]
        params = RoundParameters.from_json(devices[0].state()["parameters"])
        sessions = [DeviceSession(params) for _ in devices]
        keys = [s.advertise().to_json() for s in sessions]
        for device, mine in zip(devices, keys, strict=True):
            assert device.send("keys", mine).status_code == 200
        roster = {int(i): AdvertisedKeys.from_json(k) for i, k in devices[0].state()["roster"].items()}
        index = [next(i for i, k in roster.items() if k.to_json() == mine) for mine in keys]
        shares = [shares_to_json(s.share_keys(i, roster)) for s, i in zip(sessions, index, strict=True)]

        # Execute: the first device's upload of its shares breaks off half-way, then it sends them
        # again; the others send theirs
        body = json.dumps(shares[0]).encode()
        _upload_half_and_hang_up(server.url, f"{devices[0].secure}/shares", devices[0].token, body)
        time.sleep(0.5)
        between = devices[0].state()
        again = devices[0].send("shares", shares[0])
        others = [d.send("shares", s) for d, s in zip(devices[1:], shares[1:], strict=True)]
        after = devices[0].state()
        metrics = httpx.get(
            f"{server.url}/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10
        ).text
    finally:
        server.stop()

    # Assert: nothing of the broken upload was stored (the round still waits for the device's
    # shares, which it then takes), the round went on, and the server neither answered nor
    # logged a server error: a client that went away is a 499 in the metrics and an INFO line
    assert between["phase"] == "share_keys"
    assert again.status_code == 200, again.text
    assert all(r.status_code == 200 for r in others), [r.text for r in others]
    assert after["phase"] == "masked_input"
    route = 'route="/v1/assignments/{assignment_id}/secure/shares"'
    counted = [line for line in metrics.splitlines() if line.startswith("orchestrator_http_requests_total{")]
    assert any(route in line and 'status="499"' in line for line in counted), counted
    assert not any('status="500"' in line for line in counted), counted
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    assert not [line for line in lines if line["level"] in ("error", "critical")], lines
    went_away = [line for line in lines if line["message"] == "client went away before its request was read"]
    assert [line["path"] for line in went_away] == [f"{devices[0].secure}/shares"]


def test_stopping_the_server_answers_the_devices_it_holds_and_exits_at_once(
    server: Server, export: Callable[[ModelConfig], Path]
) -> None:
    # Prepare: a round of three devices; the first waits (up to 100 s) for the roster
    created = admin_create_population(
        server.url, export(BIASED), "p", json.dumps({**SETTINGS, "target_reports": 3})
    )
    assert created.status_code == 201, created.text
    devices = [Device(server.url) for _ in range(3)]
    assert server.process is not None
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(
            devices[0].call, "GET", devices[0].secure, params={"until": "share_keys", "wait": 100}
        )
        time.sleep(0.5)
        held = not waiting.done()

        # Execute: the operator stops the server (SIGTERM, as systemd or `kill` does)
        stopping = time.monotonic()
        server.process.terminate()
        exit_code = server.process.wait(timeout=60)
        stopped_in = time.monotonic() - stopping
        answer = waiting.result(timeout=30)

    # Assert: the held device got the phase it is still in rather than a cut connection, and the
    # server did not wait out the device's hold before exiting
    assert held
    assert answer.status_code == 200 and answer.json()["phase"] == "advertise", answer.text
    assert stopped_in < 10, stopped_in
    # uvicorn re-raises the signal once it has shut down gracefully: killed by SIGTERM, not an error
    assert exit_code in (0, -signal.SIGTERM), exit_code
