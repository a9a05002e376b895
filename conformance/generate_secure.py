"""Secure aggregation vectors from fixed seeds: the primitives, then one whole round of four
devices (device 4 drops after sharing its keys) with the checks a device must refuse."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from conformance.port import of_bytes, to_bytes
from conformance.secure_ops import SECURE_OPS
from secure_aggregation import crypto, shamir
from secure_aggregation.config import RoundParameters
from secure_aggregation.device import SHARE_ENCRYPTION, share_aad
from secure_aggregation.identity import SigningKey
from secure_aggregation.messages import b64

Case = dict[str, Any]
PARAMS = RoundParameters(
    context="conformance/population-movies/round-7/5eed",
    vector_length=8,
    bits=24,
    clip_norm=1.0,
    max_summands=4,
    neighbours=0,
    threshold=0.5,
    min_survivors=3,
)
COHORT = (1, 2, 3, 4)
SURVIVORS = [1, 2, 3]


def secret(label: str) -> bytes:
    """32 fixed bytes per label: the kit's stand-in for a device's random draws."""
    return hashlib.sha256(f"conformance/{label}".encode()).digest()


def field_element(label: str) -> int:
    return int.from_bytes(hashlib.sha512(f"conformance/{label}".encode()).digest(), "big") % shamir.PRIME


def answer(op: str, args: dict[str, Any]) -> dict[str, Any]:
    """The reference device's answer (secure_aggregation's functions)."""
    return SECURE_OPS[op](args)


def case(name: str, op: str, args: dict[str, Any], expect: dict[str, Any] | None = None) -> Case:
    return {"name": name, "op": op, "args": args, "expect": answer(op, args) if expect is None else expect}


def refused(name: str, op: str, args: dict[str, Any]) -> Case:
    return {"name": name, "op": op, "args": args, "expect": {"error": "protocol"}}


def primitive_cases() -> list[Case]:
    params = PARAMS.to_json()
    alice, bob = secret("x25519/alice"), secret("x25519/bob")
    bob_public = answer("x25519.public", {"private": of_bytes(bob)})["public"]
    shamir_args = {
        "secret": str(int.from_bytes(secret("shamir/secret"), "big")),
        "coefficients": [str(field_element("shamir/c1")), str(field_element("shamir/c2"))],
        "holders": [2, 5, 7, 9],
    }
    shares = answer("shamir.shares", shamir_args)["shares"]
    return [
        case("x25519: a public key from its private key", "x25519.public", {"private": of_bytes(alice)}),
        case(
            "x25519 + HKDF: a pair's agreed share-encryption key",
            "x25519.agree",
            {
                "private": of_bytes(alice),
                "peer_public": bob_public,
                "purpose": "share-encryption",
                "context": PARAMS.context,
            },
        ),
        case(
            "x25519 + HKDF: a pair's agreed pairwise-mask seed",
            "x25519.agree",
            {
                "private": of_bytes(alice),
                "peer_public": bob_public,
                "purpose": "pairwise-mask/2/5",
                "context": PARAMS.context,
            },
        ),
        refused(
            "x25519: a low-order public key (all zeros)",
            "x25519.agree",
            {
                "private": of_bytes(alice),
                "peer_public": of_bytes(bytes(32)),
                "purpose": "share-encryption",
                "context": PARAMS.context,
            },
        ),
        case(
            "HKDF: the self-mask seed's key",
            "hkdf.derive",
            {"secret": of_bytes(secret("seed/1")), "purpose": "self-mask", "context": PARAMS.context},
        ),
        case(
            "mask: a seed expanded (ChaCha20, 4 bytes a coordinate)",
            "mask.expand",
            {"seed": of_bytes(secret("mask-seed")), "params": params},
        ),
        case(
            "mask: 8 bytes a coordinate when bits > 32",
            "mask.expand",
            {"seed": of_bytes(secret("mask-seed")), "params": {**params, "bits": 40}},
        ),
        case("shamir: shares of a secret for holders 2, 5, 7, 9 (threshold 3)", "shamir.shares", shamir_args),
        case(
            "shamir: any 3 shares reconstruct the secret",
            "shamir.reconstruct",
            {"shares": {k: shares[k] for k in ("2", "7", "9")}},
            {"secret": shamir_args["secret"]},
        ),
        {
            "name": "shamir: a share above the field",
            "op": "shamir.reconstruct",
            "args": {"shares": {"2": of_bytes(b"\xff" * shamir.SHARE_BYTES), "5": shares["5"]}},
            "expect": {"error": "shamir"},
        },
        {
            "name": "shamir: a holder 0 (the secret itself)",
            "op": "shamir.reconstruct",
            "args": {"shares": {"0": shares["2"], "5": shares["5"]}},
            "expect": {"error": "shamir"},
        },
        case(
            "quantize: clip to clip_norm, scale to levels, round with the given uniform draws",
            "quantize",
            {
                "vector": [0.5, -0.25, 0.125, 0.0, -0.75, 0.25, 0.1, -0.1],
                "params": params,
                "uniforms": [0.0, 0.5, 0.999, 0.25, 0.75, 0.1, 0.9, 0.3],
            },
        ),
        case(
            "quantize: a vector longer than clip_norm is scaled down first",
            "quantize",
            {"vector": [3.0, -4.0, 0, 0, 0, 0, 0, 0], "params": params, "uniforms": [0.5] * 8},
        ),
        case(
            "neighbours: a SecAgg+ graph of 8 devices, k = 4",
            "neighbours.graph",
            {"members": [1, 2, 3, 4, 5, 6, 7, 8], "k": 4, "context": PARAMS.context},
        ),
        case(
            "digest: the task inputs",
            "secure.inputs_digest",
            {
                "inputs": {
                    "artifact_sha256": "ab" * 32,
                    "task_config": {"max_examples": 50},
                    "model_version": 2,
                    "globals_sha256": secret("globals").hex(),
                    "parameters": params,
                    "manifest_sha256": secret("manifest").hex(),
                }
            },
        ),
    ]


def sealed(key: bytes, plaintext: bytes, aad: bytes, label: str) -> str:
    """A share ciphertext with a fixed nonce, so that the vectors are reproducible."""
    nonce = secret(f"nonce/{label}")[: crypto.NONCE_BYTES]
    return b64(nonce + AESGCM(key).encrypt(nonce, plaintext, aad))


def round_cases() -> list[Case]:
    params = PARAMS.to_json()
    context = PARAMS.context
    device = {
        i: {
            "encryption_private": of_bytes(secret(f"encryption/{i}")),
            "mask_private": of_bytes(secret(f"mask/{i}")),
            "self_mask_seed": of_bytes(secret(f"seed/{i}")),
            "signing_private": of_bytes(secret(f"signing/{i}")),
        }
        for i in COHORT
    }
    cases: list[Case] = []
    adverts = {}
    for i in COHORT:
        cases.append(
            case(
                f"round: device {i} advertises its keys, signed",
                "secure.advertise",
                {"params": params, **device[i]},
            )
        )
        adverts[i] = cases[-1]["expect"]["keys"]
    roster = {str(i): adverts[i] for i in COHORT}
    cases.append(
        case("round: the roster's digest", "secure.roster_digest", {"context": context, "roster": roster})
    )
    digest = cases[-1]["expect"]["digest"]
    t = PARAMS.shamir_threshold(len(COHORT) - 1)
    shares: dict[int, dict[str, dict[int, bytes]]] = {}
    for i in COHORT:
        holders = [h for h in COHORT if h != i]
        seed = int.from_bytes(to_bytes(device[i]["self_mask_seed"]), "big")
        key = int.from_bytes(to_bytes(device[i]["mask_private"]), "big")
        shares[i] = {
            kind: {
                h: shamir.share_to_bytes(s)
                for h, s in shamir.shares_from_coefficients(
                    value, [field_element(f"round/{kind}/{i}/{j}") for j in range(1, t)], holders
                ).items()
            }
            for kind, value in (("self_mask", seed), ("mask_key", key))
        }
    raw_digest = to_bytes({"$bytes": digest})

    def agreed(owner: int, holder: int) -> bytes:
        private = crypto.private_from_bytes(to_bytes(device[owner]["encryption_private"]))
        return crypto.agree(
            private, to_bytes({"$bytes": adverts[holder]["encryption_key"]}), SHARE_ENCRYPTION, context
        )

    def plaintext(owner: int, holder: int) -> bytes:
        return (
            owner.to_bytes(4, "big")
            + holder.to_bytes(4, "big")
            + shares[owner]["self_mask"][holder]
            + shares[owner]["mask_key"][holder]
        )

    for i in COHORT:
        args = {
            "params": params,
            "index": i,
            "roster": roster,
            "encryption_private": device[i]["encryption_private"],
            "self_mask_shares": {str(h): of_bytes(s) for h, s in shares[i]["self_mask"].items()},
            "mask_key_shares": {str(h): of_bytes(s) for h, s in shares[i]["mask_key"].items()},
        }
        ok = answer("secure.share_keys", args)["shares"]
        expect = {
            "shares": {
                h: {
                    **ok[h],
                    "ciphertext": {
                        "$decrypts": {
                            "key": b64(agreed(i, int(h))),
                            "aad": b64(share_aad(context, raw_digest, i, int(h))),
                            "plaintext": b64(plaintext(i, int(h))),
                        }
                    },
                }
                for h in ok
            }
        }
        cases.append(
            {
                "name": f"round: device {i}'s shares, each encrypted to its holder",
                "op": "secure.share_keys",
                "args": args,
                "expect": expect,
            }
        )
        if i == 1:
            small = {k: v for k, v in roster.items() if k in ("1", "2")}
            cases.append(
                refused(
                    "round: a roster of 2 is too small to share in",
                    "secure.share_keys",
                    {**args, "roster": small},
                )
            )
            cases.append(
                refused(
                    "round: a roster whose entry 1 holds another device's keys",
                    "secure.share_keys",
                    {**args, "roster": {**roster, "1": adverts[2]}},
                )
            )
    me = 1
    ciphertexts = {
        str(o): sealed(agreed(o, me), plaintext(o, me), share_aad(context, raw_digest, o, me), f"{o}/{me}")
        for o in COHORT
        if o != me
    }
    open_args = {
        "params": params,
        "index": me,
        "roster": roster,
        "encryption_private": device[me]["encryption_private"],
        "ciphertexts": ciphertexts,
    }
    cases.append(case("round: device 1 opens its neighbours' shares", "secure.open_shares", open_args))
    held = cases[-1]["expect"]["held"]
    for_3 = sealed(agreed(2, 3), plaintext(2, 3), share_aad(context, raw_digest, 2, 3), "2/3")
    relabelled = sealed(
        agreed(2, me), plaintext(2, 3), share_aad(context, raw_digest, 2, me), "2/1-labelled-3"
    )
    other_roster = sealed(
        agreed(2, me), plaintext(2, me), share_aad(context, bytes(32), 2, me), "2/1-other-roster"
    )
    for why, text in (
        ("shares of 2 meant for device 3", for_3),
        ("shares of 2 labelled for device 3", relabelled),
        ("shares of 2 under another roster", other_roster),
    ):
        cases.append(
            case(
                f"round: {why} count as 2 not sharing",
                "secure.open_shares",
                {**open_args, "ciphertexts": {**ciphertexts, "2": text}},
            )
        )
        assert cases[-1]["expect"]["missing"] == [2], cases[-1]
    cases.append(
        refused(
            "round: shares from a device outside the neighbourhood",
            "secure.open_shares",
            {**open_args, "ciphertexts": {**ciphertexts, "9": ciphertexts["2"]}},
        )
    )
    quantized = {
        i: [(97 * i + 31 * j) % (1 << PARAMS.bits) for j in range(PARAMS.vector_length)] for i in COHORT
    }
    for i in SURVIVORS:
        cases.append(
            case(
                f"round: device {i}'s masked input (self mask, pairwise masks of 2, 3, 4)",
                "secure.masked_input",
                {
                    "params": params,
                    "index": i,
                    "roster": roster,
                    "mask_private": device[i]["mask_private"],
                    "self_mask_seed": device[i]["self_mask_seed"],
                    "quantized": quantized[i],
                    "shared": [v for v in COHORT if v != i],
                },
            )
        )
    cases.append(
        case(
            "round: device 1's masked input when 4 did not share (no pair mask with 4)",
            "secure.masked_input",
            {**cases[-3]["args"], "shared": [2, 3]},
        )
    )
    cases.append(
        refused(
            "round: fewer neighbours shared than the threshold",
            "secure.masked_input",
            {**cases[-4]["args"], "shared": [2]},
        )
    )
    inputs = b64(secret("inputs"))
    statements, confirmations = {}, {}
    for i in SURVIVORS:
        base = {
            "context": context,
            "roster_digest": {"$bytes": digest},
            "inputs_sha256": {"$bytes": inputs},
            "signing_private": device[i]["signing_private"],
        }
        cases.append(
            case(
                f"round: device {i}'s partner statement (missing none)",
                "secure.partner_statement",
                {**base, "missing": []},
            )
        )
        statements[str(i)] = cases[-1]["expect"]["statement"]
        cases.append(
            case(
                f"round: device {i}'s confirmation of survivors 1, 2, 3",
                "secure.confirmation",
                {**base, "survivors": SURVIVORS},
            )
        )
        confirmations[str(i)] = cases[-1]["expect"]["confirmation"]
    # Each device's certified Ed25519 key (the certificates are checked when the roster arrives).
    signing_keys = {
        str(i): of_bytes(SigningKey(Ed25519PrivateKey.from_private_bytes(secret(f"signing/{i}"))).public)
        for i in COHORT
    }
    unmask = {
        "params": params,
        "index": me,
        "roster_digest": {"$bytes": digest},
        "signing_keys": signing_keys,
        "held": held,
        "inputs_sha256": {"$bytes": inputs},
        "survivors": SURVIVORS,
        "confirmations": confirmations,
        "statements": statements,
    }
    cases.append(
        case("round: device 1 reveals survivors' seed shares and 4's mask key share", "secure.unmask", unmask)
    )
    assert sorted(cases[-1]["expect"]["unmasking"]["mask_key_shares"]) == ["4"], cases[-1]
    everyone = answer(
        "secure.confirmation",
        {
            "context": context,
            "roster_digest": {"$bytes": digest},
            "inputs_sha256": {"$bytes": inputs},
            "survivors": [1, 2, 3, 4],
            "signing_private": device[2]["signing_private"],
        },
    )["confirmation"]
    other_inputs = answer(
        "secure.partner_statement",
        {
            "context": context,
            "roster_digest": {"$bytes": digest},
            "inputs_sha256": {"$bytes": b64(secret("other"))},
            "signing_private": device[2]["signing_private"],
            "missing": [],
        },
    )["statement"]
    not_masked = answer(
        "secure.partner_statement",
        {
            "context": context,
            "roster_digest": {"$bytes": digest},
            "inputs_sha256": {"$bytes": inputs},
            "signing_private": device[2]["signing_private"],
            "missing": [1],
        },
    )["statement"]
    forged = answer(
        "secure.partner_statement",
        {
            "context": context,
            "roster_digest": {"$bytes": digest},
            "inputs_sha256": {"$bytes": inputs},
            "signing_private": device[3]["signing_private"],
            "missing": [],
        },
    )["statement"]
    without_3 = {k: v for k, v in statements.items() if k != "3"}
    refusals: list[tuple[str, dict[str, Any]]] = [
        (
            "only 2 confirmations, a quorum is 3 of 4",
            {"confirmations": {k: confirmations[k] for k in ("1", "2")}},
        ),
        ("device 2 confirmed another survivor set", {"confirmations": {**confirmations, "2": everyone}}),
        ("survivor 2 trained on other inputs", {"statements": {**statements, "2": other_inputs}}),
        ("survivor 3 sent no partner statement", {"statements": without_3}),
        ("survivor 2's statement signed by device 3's key", {"statements": {**statements, "2": forged}}),
        (
            "survivor 2 says it did not mask with device 1, which holds its shares",
            {"statements": {**statements, "2": not_masked}},
        ),
        ("device 1 is not among the survivors", {"survivors": [2, 3, 4]}),
        ("2 survivors, fewer than min_survivors", {"survivors": [1, 2]}),
    ]
    for why, change in refusals:
        cases.append(
            refused(f"round: refuse to unmask: {why}", "secure.unmask", {**copy.deepcopy(unmask), **change})
        )
    return cases


def generate(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "cases.json").write_text(json.dumps([*primitive_cases(), *round_cases()], indent=1) + "\n")
