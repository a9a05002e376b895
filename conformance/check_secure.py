"""Checks of secure aggregation: each primitive against its vector, then one device of a six-device
round at a time, through every phase, and the steps a device must refuse."""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from conformance.outcome import Outcome, differs, refused, run
from conformance.port import Json, Port, SecureDevice
from conformance.vectors import read_json
from secure_aggregation import shamir
from secure_aggregation.config import RoundParameters
from secure_aggregation.device import share_commitment

H = bytes.fromhex


def _u64(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.uint64)


def _agree(port: Port, c: Json) -> bytes:
    return port.agree(H(c["private"]), H(c["peer_public"]), H(c["purpose"]), c["context"])


def _decrypt(port: Port, c: Json) -> bytes:
    return port.decrypt(H(c["key"]), H(c["ciphertext"]), H(c["associated"]))


def _encrypted(port: Port, c: Json) -> str | None:
    sealed = port.encrypt(H(c["key"]), H(c["plaintext"]), H(c["associated"]))
    try:  # random nonces: the kit checks that its own decryption gives the plaintext back
        opened = AESGCM(H(c["key"])).decrypt(sealed[:12], sealed[12:], H(c["associated"]))
    except InvalidTag:
        return "the ciphertext (nonce || AES-256-GCM ciphertext and tag) does not decrypt"
    return differs("decrypted plaintext", opened.hex(), c["plaintext"])


def _shares(port: Port, c: Json) -> str | None:
    holders = [int(x) for x in c["shares"]]
    got = port.shamir_shares(int(c["secret"]), [int(k) for k in c["coefficients"]], holders)
    return differs("shares", {str(x): str(y) for x, y in got.items()}, c["shares"])


def _reconstructed(port: Port, c: Json) -> str | None:
    subset = {x: int(c["shares"][str(x)]) for x in c["reconstruct_from"]}
    return differs("secret", str(port.shamir_reconstruct(subset)), c["secret"])


def _graph(port: Port, c: Json) -> str | None:
    got = port.neighbour_graph(c["roster"], c["k"], c["context"])
    return differs("graph", {str(u): list(vs) for u, vs in got.items()}, c["graph"])


# Each primitive: (what the port computes from a case, as hex or a list, and the case's field it must equal).
ANSWERS: dict[str, tuple[Callable[[Port, Json], Any], str]] = {
    "x25519": (lambda port, c: port.x25519_public(H(c["private"])).hex(), "public"),
    "agree": (lambda port, c: _agree(port, c).hex(), "key"),
    "derive_key": (
        lambda port, c: port.derive_key(H(c["secret"]), H(c["purpose"]), c["context"]).hex(),
        "key",
    ),
    "decrypt": (lambda port, c: _decrypt(port, c).hex(), "plaintext"),
    "commitment": (lambda port, c: port.commitment([H(p) for p in c["parts"]]).hex(), "digest"),
    "expand_mask": (lambda port, c: _ints(port.expand_mask(H(c["seed"]), c["params"])), "mask"),
    "quantize": (
        lambda port, c: _ints(
            port.quantize(np.asarray(c["vector"], dtype=np.float64), c["params"], np.asarray(c["uniforms"]))
        ),
        "quantized",
    ),
    "sign": (lambda port, c: port.sign(H(c["private"]), H(c["message"])).hex(), "signature"),
    "advertisement_message": (
        lambda port, c: port.advertisement_message(c["context"], c["keys"]).hex(),
        "message",
    ),
    "roster_digest": (lambda port, c: port.roster_digest(c["context"], c["roster"]).hex(), "digest"),
    "statement_message": (
        lambda port, c: port.statement_message(
            c["context"], H(c["roster"]), H(c["inputs_sha256"]), c["missing"]
        ).hex(),
        "message",
    ),
    "view_message": (
        lambda port, c: port.view_message(
            c["context"], H(c["roster"]), c["survivors"], H(c["inputs_sha256"])
        ).hex(),
        "message",
    ),
    "task_inputs_digest": (lambda port, c: port.task_inputs_digest(c["inputs"]).hex(), "digest"),
}
REFUSALS: dict[str, Callable[[Port, Json], Any]] = {"agree": _agree, "decrypt": _decrypt}
CHECKS: dict[str, list[Callable[[Port, Json], str | None]]] = {
    "encrypt": [_encrypted],
    "shamir": [_shares, _reconstructed],
    "neighbour_graph": [_graph],
}


def _ints(values: Any) -> list[int]:
    return [int(v) for v in np.asarray(values).ravel()]


def _answer(port: Port, kind: str, c: Json) -> str | None:
    compute, field = ANSWERS[kind]
    return differs(field, compute(port, c), c[field])


def primitives(port: Port, root: Path) -> list[Outcome]:
    vectors = read_json(root / "secure_aggregation" / "primitives.json")
    out = []
    for kind, cases in vectors.items():
        for i, c in enumerate(cases):
            name = f"{kind}/{c.get('name', i)}"
            if "error" in c:
                out.append(refused(name, c["error"], REFUSALS[kind], port, c))
            elif kind in ANSWERS:
                out.append(run(name, _answer, port, kind, c))
            else:
                out += [run(f"{name}/{check.__name__.strip('_')}", check, port, c) for check in CHECKS[kind]]
    return out


def _check_shares(u: int, sent: dict[str, Any], device: dict[str, Any], params: dict[str, Any]) -> str | None:
    """Shares are random: each must decrypt for its holder, carry the right labels and commitments,
    and any threshold of them must give back the device's own secrets."""
    expected = [str(v) for v in device["neighbours"]]
    if sorted(sent, key=int) != expected:
        return f"shares for {sorted(sent, key=int)}, expected one for each neighbour {expected}"
    context, seeds, keys = params["context"], {}, {}
    for holder, message in sent.items():
        v = int(holder)
        ciphertext = base64.b64decode(message["ciphertext"])
        try:
            plaintext = AESGCM(H(device["share_keys"][holder])).decrypt(
                ciphertext[:12], ciphertext[12:], H(device["share_aad"][holder])
            )
        except InvalidTag:
            return f"the shares for {v} do not decrypt under the key {u} and {v} agree (with their AAD)"
        labels = (int.from_bytes(plaintext[:4], "big"), int.from_bytes(plaintext[4:8], "big"))
        if labels != (u, v):
            return f"the shares for {v} are labelled {labels[0]} -> {labels[1]}, expected {u} -> {v}"
        seed_share, key_share = plaintext[8 : 8 + shamir.SHARE_BYTES], plaintext[8 + shamir.SHARE_BYTES :]
        for kind, share, field in (
            (b"self-mask", seed_share, "self_mask_share_commitment"),
            (b"mask-key", key_share, "mask_key_share_commitment"),
        ):
            if base64.b64decode(message[field]) != share_commitment(kind, context, u, v, share):
                return f"the {field} for {v} does not commit to the share sent"
        seeds[v], keys[v] = shamir.share_from_bytes(seed_share), shamir.share_from_bytes(key_share)
    threshold = RoundParameters.from_json(params).shamir_threshold(len(expected))
    chosen = sorted(seeds)[-threshold:]
    seed = shamir.reconstruct({v: seeds[v] for v in chosen}).to_bytes(32, "big").hex()
    key = shamir.reconstruct({v: keys[v] for v in chosen}).to_bytes(32, "big").hex()
    return differs("the reconstructed self-mask seed", seed, device["secrets"]["self_mask_seed"]) or differs(
        "the reconstructed mask key", key, device["secrets"]["mask_private"]
    )


def _through(port: Port, vectors: dict[str, Any], u: int, phase: str) -> SecureDevice:
    """A fresh device for `u` taken through the phases before `phase`."""
    device = vectors["devices"][str(u)]
    session = port.secure_device(vectors["params"], device["secrets"])
    session.advertise()
    if phase in ("masked_input", "unmask"):
        session.share_keys(u, vectors["roster"])
    if phase == "unmask":
        session.masked_input(_u64(device["quantized"]), device["ciphertexts_received"])
    return session


def secure_round(port: Port, root: Path) -> list[Outcome]:
    vectors = read_json(root / "secure_aggregation" / "round.json")
    params, roster = vectors["params"], vectors["roster"]
    out = []
    for name, device in vectors["devices"].items():
        u = int(name)
        session = port.secure_device(params, device["secrets"])
        out.append(
            run(
                f"round/{u}/advertise",
                lambda s=session, d=device: differs("advertised keys", s.advertise(), d["advertisement"]),
            )
        )
        out.append(
            run(
                f"round/{u}/share_keys",
                lambda s=session, d=device, u=u: _check_shares(u, s.share_keys(u, roster), d, params),
            )
        )
        out.append(
            run(
                f"round/{u}/masked_input",
                lambda s=session, d=device: differs(
                    "masked input (base64)",
                    base64.b64encode(
                        s.masked_input(_u64(d["quantized"]), d["ciphertexts_received"])
                    ).decode(),
                    d["masked_input"],
                ),
            )
        )
        if "unmask" in device:
            out.append(
                run(
                    f"round/{u}/unmask",
                    lambda s=session, d=device: differs(
                        "unmasking shares", s.unmask(vectors["survivors"]), d["unmask"]
                    ),
                )
            )
    out += refusals(port, vectors)
    for case in vectors["view"]:
        name = f"view/{case['name']}"
        out.append(
            refused(name, case["error"], lambda c=case: port.check_view(c["case"]))
            if case["error"]
            else run(name, lambda c=case: port.check_view(c["case"]))
        )
    return out


def refusals(port: Port, vectors: dict[str, Any]) -> list[Outcome]:
    roster, u = vectors["roster"], vectors["sharing"][0]
    device = vectors["devices"][str(u)]
    received = device["ciphertexts_received"]
    neighbours = set(device["neighbours"])
    stranger = next(int(w) for w in roster if int(w) != u and int(w) not in neighbours)
    first = next(iter(received))
    tampered = vectors["tampered_share"]
    victim = vectors["devices"][str(tampered["device"])]
    quantized = _u64(device["quantized"])
    return [
        refused(
            "refuse/share_keys_roster_without_me",
            "protocol",
            lambda: _through(port, vectors, u, "share_keys").share_keys(
                u, {w: k for w, k in roster.items() if int(w) != u}
            ),
        ),
        refused(
            "refuse/share_keys_roster_too_small",
            "protocol",
            lambda: _through(port, vectors, u, "share_keys").share_keys(
                u, {w: k for w, k in roster.items() if int(w) in (u, stranger)}
            ),
        ),
        refused(
            "refuse/masked_input_share_from_a_stranger",
            "protocol",
            lambda: _through(port, vectors, u, "masked_input").masked_input(
                quantized, {**received, str(stranger): received[first]}
            ),
        ),
        refused(
            "refuse/masked_input_too_few_shares",
            "protocol",
            lambda: _through(port, vectors, u, "masked_input").masked_input(
                quantized, {first: received[first]}
            ),
        ),
        refused(
            "refuse/unmask_not_a_survivor",
            "protocol",
            lambda: _through(port, vectors, u, "unmask").unmask([w for w in vectors["survivors"] if w != u]),
        ),
        refused(
            "refuse/unmask_too_few_survivors",
            "protocol",
            lambda: _through(port, vectors, u, "unmask").unmask([u, stranger]),
        ),
        run(
            "round/tampered_share_masks_without_it",
            lambda: differs(
                "masked input (base64)",
                base64.b64encode(
                    _through(port, vectors, tampered["device"], "masked_input").masked_input(
                        _u64(victim["quantized"]), tampered["ciphertexts"]
                    )
                ).decode(),
                tampered["masked_input"],
            ),
        ),
    ]


def checks(port: Port, root: Path) -> list[Outcome]:
    return primitives(port, root) + secure_round(port, root)
