"""Checks of secure aggregation: each primitive against its vector, then one device of a six-device
round at a time, through every phase, and the steps a device must refuse."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from conformance.outcome import Outcome, differs, refused, run
from conformance.port import Port, SecureDevice
from conformance.vectors import read_json
from secure_aggregation import shamir
from secure_aggregation.config import RoundParameters
from secure_aggregation.device import share_commitment

H = bytes.fromhex


def _u64(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.uint64)


def _same_ints(what: str, got: Any, expected: list[int]) -> str | None:
    return differs(what, [int(v) for v in np.asarray(got).ravel()], expected)


def primitives(port: Port, root: Path) -> list[Outcome]:
    v = read_json(root / "secure_aggregation" / "primitives.json")
    out = [
        run(
            f"x25519/{i}",
            lambda c=c: differs("public key", port.x25519_public(H(c["private"])).hex(), c["public"]),
        )
        for i, c in enumerate(v["x25519"])
    ]
    for i, c in enumerate(v["agree"]):

        def agree(c: dict[str, Any] = c) -> bytes:
            return port.agree(H(c["private"]), H(c["peer_public"]), H(c["purpose"]), c["context"])

        out.append(
            refused(f"agree/{i}", c["error"], agree)
            if "error" in c
            else run(f"agree/{i}", lambda c=c, f=agree: differs("key", f(c).hex(), c["key"]))
        )
    out += [
        run(
            f"derive_key/{i}",
            lambda c=c: differs(
                "key", port.derive_key(H(c["secret"]), H(c["purpose"]), c["context"]).hex(), c["key"]
            ),
        )
        for i, c in enumerate(v["derive_key"])
    ]
    for i, c in enumerate(v["decrypt"]):

        def decrypt(c: dict[str, Any] = c) -> bytes:
            return port.decrypt(H(c["key"]), H(c["ciphertext"]), H(c["associated"]))

        out.append(
            refused(f"decrypt/{i}", c["error"], decrypt)
            if "error" in c
            else run(f"decrypt/{i}", lambda c=c, f=decrypt: differs("plaintext", f(c).hex(), c["plaintext"]))
        )
    for i, c in enumerate(v["encrypt"]):

        def encrypted(c: dict[str, Any] = c) -> str | None:
            sealed = port.encrypt(H(c["key"]), H(c["plaintext"]), H(c["associated"]))
            try:  # random nonces: the kit checks that its own decryption gives the plaintext back
                opened = AESGCM(H(c["key"])).decrypt(sealed[:12], sealed[12:], H(c["associated"]))
            except InvalidTag:
                return "the ciphertext (nonce || AES-256-GCM ciphertext and tag) does not decrypt"
            return differs("decrypted plaintext", opened.hex(), c["plaintext"])

        out.append(run(f"encrypt/{i}", encrypted))
    out += [
        run(
            f"commitment/{i}",
            lambda c=c: differs("digest", port.commitment([H(p) for p in c["parts"]]).hex(), c["digest"]),
        )
        for i, c in enumerate(v["commitment"])
    ]
    for i, c in enumerate(v["shamir"]):
        holders = [int(x) for x in c["shares"]]
        out.append(
            run(
                f"shamir_shares/{i}",
                lambda c=c, h=holders: differs(
                    "shares",
                    {
                        str(x): str(y)
                        for x, y in port.shamir_shares(
                            int(c["secret"]), [int(k) for k in c["coefficients"]], h
                        ).items()
                    },
                    c["shares"],
                ),
            )
        )
        subset = {x: int(c["shares"][str(x)]) for x in c["reconstruct_from"]}
        out.append(
            run(
                f"shamir_reconstruct/{i}",
                lambda c=c, s=subset: differs("secret", str(port.shamir_reconstruct(s)), c["secret"]),
            )
        )
    out += [
        run(
            f"expand_mask/{i}",
            lambda c=c: _same_ints("mask", port.expand_mask(H(c["seed"]), c["params"]), c["mask"]),
        )
        for i, c in enumerate(v["expand_mask"])
    ]
    out += [
        run(
            f"quantize/{c['name']}",
            lambda c=c: _same_ints(
                "quantized",
                port.quantize(
                    np.asarray(c["vector"], dtype=np.float64), c["params"], np.asarray(c["uniforms"])
                ),
                c["quantized"],
            ),
        )
        for c in v["quantize"]
    ]
    out += [
        run(
            f"neighbour_graph/k{c['k']}",
            lambda c=c: differs(
                "graph",
                {
                    str(u): list(vs)
                    for u, vs in port.neighbour_graph(c["roster"], c["k"], c["context"]).items()
                },
                c["graph"],
            ),
        )
        for c in v["neighbour_graph"]
    ]
    out += [
        run(
            f"sign/{i}",
            lambda c=c: differs(
                "signature", port.sign(H(c["private"]), H(c["message"])).hex(), c["signature"]
            ),
        )
        for i, c in enumerate(v["sign"])
    ]
    out += [
        run(
            f"advertisement_message/{i}",
            lambda c=c: differs(
                "message", port.advertisement_message(c["context"], c["keys"]).hex(), c["message"]
            ),
        )
        for i, c in enumerate(v["advertisement_message"])
    ]
    out += [
        run(
            f"roster_digest/{i}",
            lambda c=c: differs("digest", port.roster_digest(c["context"], c["roster"]).hex(), c["digest"]),
        )
        for i, c in enumerate(v["roster_digest"])
    ]
    out += [
        run(
            f"statement_message/{i}",
            lambda c=c: differs(
                "message",
                port.statement_message(
                    c["context"], H(c["roster"]), H(c["inputs_sha256"]), c["missing"]
                ).hex(),
                c["message"],
            ),
        )
        for i, c in enumerate(v["statement_message"])
    ]
    out += [
        run(
            f"view_message/{i}",
            lambda c=c: differs(
                "message",
                port.view_message(c["context"], H(c["roster"]), c["survivors"], H(c["inputs_sha256"])).hex(),
                c["message"],
            ),
        )
        for i, c in enumerate(v["view_message"])
    ]
    out += [
        run(
            f"task_inputs_digest/{i}",
            lambda c=c: differs("digest", port.task_inputs_digest(c["inputs"]).hex(), c["digest"]),
        )
        for i, c in enumerate(v["task_inputs_digest"])
    ]
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
            return f"the shares for {v} do not decrypt under the key {u} and {v} agree, with their associated data"
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
