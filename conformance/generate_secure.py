"""The secure-aggregation vectors from fixed seeds: each primitive with its inputs and outputs,
and one whole round of six devices (one leaves before sharing keys, one after its masked input)
with what each device must send and what it must refuse.

The round's expected messages are computed here from the primitives, not by `DeviceSession`,
so the Python device is checked against an independent composition of the same maths."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from secure_aggregation import crypto, masks, quantization, shamir
from secure_aggregation.config import RoundParameters
from secure_aggregation.device import (
    SELF_MASK,
    SHARE_ENCRYPTION,
    pairwise_purpose,
    pairwise_sign,
    round_graph,
    self_mask_commitment,
    share_aad,
)
from secure_aggregation.identity import SigningKey, advertisement_message
from secure_aggregation.identity import public_bytes as signing_public
from secure_aggregation.messages import INDEX_BYTES, AdvertisedKeys, b64, encode_vector
from secure_aggregation.neighbours import neighbour_graph
from secure_aggregation.view import (
    Confirmation,
    PartnerStatement,
    TaskInputs,
    roster_digest,
    statement_message,
    view_message,
)

PARAMS = RoundParameters(
    context="conformance-kit/round-1",
    vector_length=8,
    bits=16,
    clip_norm=1.0,
    max_summands=6,
    neighbours=4,
    threshold=0.5,
    min_survivors=3,
)
DEVICES = (1, 2, 3, 4, 5, 6)
LEAVES_BEFORE_SHARING = 6
LEAVES_AFTER_MASKING = 5
INPUTS = TaskInputs(
    artifact_sha256="ab" * 32,
    task_config={"max_examples": 50},
    model_version=3,
    globals_sha256=hashlib.sha256(b"globals").digest(),
    parameters=PARAMS.to_json(),
)


def _rng_bytes(rng: np.random.Generator, size: int) -> bytes:
    return rng.bytes(size)


def _field(rng: np.random.Generator) -> int:
    return int.from_bytes(rng.bytes(shamir.SHARE_BYTES), "big") % shamir.PRIME


def _encrypt(key: bytes, nonce: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """crypto.encrypt's format (nonce || ciphertext and tag) with the nonce fixed by the kit."""
    return nonce + AESGCM(key).encrypt(nonce, plaintext, associated)


def device_secrets() -> dict[int, dict[str, bytes]]:
    out = {}
    for u in DEVICES:
        rng = np.random.default_rng(5000 + u)
        out[u] = {
            name: _rng_bytes(rng, 32)
            for name in ("encryption_private", "mask_private", "self_mask_seed", "signing_private")
        }
    return out


def _keys(secrets: dict[str, bytes]) -> AdvertisedKeys:
    return AdvertisedKeys(
        crypto.public_bytes(crypto.private_from_bytes(secrets["encryption_private"])),
        crypto.public_bytes(crypto.private_from_bytes(secrets["mask_private"])),
        self_mask_commitment(secrets["self_mask_seed"], PARAMS.context),
    )


def _masked(
    u: int,
    secrets: dict[str, bytes],
    roster: dict[int, AdvertisedKeys],
    quantized: np.ndarray,
    partners: list[int],
) -> np.ndarray:
    context = PARAMS.context
    total = quantized.copy()
    seed = crypto.derive_key(secrets["self_mask_seed"], SELF_MASK, context)
    masks.add_into(total, masks.expand(seed, PARAMS).astype(np.uint64), 1)
    mask_key = crypto.private_from_bytes(secrets["mask_private"])
    for v in sorted(partners):
        pair = crypto.agree(mask_key, roster[v].mask_key, pairwise_purpose(u, v), context)
        masks.add_into(total, masks.expand(pair, PARAMS).astype(np.uint64), pairwise_sign(u, v))
    return total & np.uint64(PARAMS.modulus_mask)


def _shares(u: int, secrets: dict[str, bytes], holders: list[int]) -> tuple[dict[int, int], dict[int, int]]:
    rng = np.random.default_rng(6000 + u)
    t = PARAMS.shamir_threshold(len(holders))
    seed = int.from_bytes(secrets["self_mask_seed"], "big")
    key = int.from_bytes(secrets["mask_private"], "big")
    seed_coefficients = [_field(rng) for _ in range(t - 1)]
    key_coefficients = [_field(rng) for _ in range(t - 1)]
    return (
        shamir.shares_from_coefficients(seed, seed_coefficients, holders),
        shamir.shares_from_coefficients(key, key_coefficients, holders),
    )


def round_vectors() -> dict[str, Any]:
    secrets = device_secrets()
    context = PARAMS.context
    roster = {u: _keys(secrets[u]) for u in DEVICES}
    digest = roster_digest(context, roster)
    graph = round_graph(PARAMS, list(DEVICES))
    sharing = [u for u in DEVICES if u != LEAVES_BEFORE_SHARING]
    # ciphertexts[v][u]: what u sent for v; received[v][u]: the shares v holds of u.
    ciphertexts: dict[int, dict[int, bytes]] = {v: {} for v in DEVICES}
    received: dict[int, dict[int, tuple[int, int]]] = {v: {} for v in DEVICES}
    for u in sharing:
        seed_shares, key_shares = _shares(u, secrets[u], graph[u])
        private = crypto.private_from_bytes(secrets[u]["encryption_private"])
        for v in graph[u]:
            plaintext = (
                u.to_bytes(INDEX_BYTES, "big")
                + v.to_bytes(INDEX_BYTES, "big")
                + shamir.share_to_bytes(seed_shares[v])
                + shamir.share_to_bytes(key_shares[v])
            )
            key = crypto.agree(private, roster[v].encryption_key, SHARE_ENCRYPTION, context)
            nonce = hashlib.sha256(f"nonce/{u}/{v}".encode()).digest()[: crypto.NONCE_BYTES]
            ciphertexts[v][u] = _encrypt(key, nonce, plaintext, share_aad(context, digest, u, v))
            received[v][u] = (seed_shares[v], key_shares[v])
    rng = np.random.default_rng(7000)
    survivors = [u for u in sharing if u != LEAVES_AFTER_MASKING]
    devices = {}
    for u in sharing:
        update = rng.normal(scale=0.3, size=PARAMS.vector_length)
        uniforms = rng.random(PARAMS.vector_length)
        quantized = quantization.quantize(update, PARAMS, _Fixed(uniforms))  # type: ignore[arg-type]
        partners = sorted(received[u])
        entry: dict[str, Any] = {
            "secrets": {k: v.hex() for k, v in secrets[u].items() if k != "signing_private"},
            "advertisement": roster[u].to_json(),
            "neighbours": graph[u],
            "share_keys": {
                str(v): crypto.agree(
                    crypto.private_from_bytes(secrets[u]["encryption_private"]),
                    roster[v].encryption_key,
                    SHARE_ENCRYPTION,
                    context,
                ).hex()
                for v in graph[u]
            },
            "share_aad": {str(v): share_aad(context, digest, u, v).hex() for v in graph[u]},
            "ciphertexts_received": {str(w): b64(c) for w, c in sorted(ciphertexts[u].items())},
            "quantized": quantized.tolist(),
            "masked_input": b64(encode_vector(_masked(u, secrets[u], roster, quantized, partners), PARAMS)),
        }
        if u in survivors:
            alive = set(survivors)
            entry["unmask"] = {
                "self_mask_shares": {
                    str(w): b64(shamir.share_to_bytes(s))
                    for w, (s, _) in sorted(received[u].items())
                    if w in alive
                },
                "mask_key_shares": {
                    str(w): b64(shamir.share_to_bytes(k))
                    for w, (_, k) in sorted(received[u].items())
                    if w not in alive
                },
            }
        devices[str(u)] = entry
    # One ciphertext tampered with: the device masks as if that neighbour had not shared.
    victim = 2
    owner = sorted(ciphertexts[victim])[0]
    tampered = dict(ciphertexts[victim])
    tampered[owner] = tampered[owner][:-1] + bytes([tampered[owner][-1] ^ 1])
    quantized = np.asarray(devices[str(victim)]["quantized"], dtype=np.uint64)
    partners = sorted(set(received[victim]) - {owner})
    tampered_case = {
        "device": victim,
        "ciphertexts": {str(w): b64(c) for w, c in sorted(tampered.items())},
        "masked_input": b64(
            encode_vector(_masked(victim, secrets[victim], roster, quantized, partners), PARAMS)
        ),
    }
    return {
        "params": PARAMS.to_json(),
        "roster": {str(u): k.to_json() for u, k in roster.items()},
        "roster_digest": digest.hex(),
        "graph": {str(u): vs for u, vs in graph.items()},
        "sharing": sharing,
        "survivors": survivors,
        "devices": devices,
        "tampered_share": tampered_case,
        "view": view_cases(secrets, roster, digest, graph, received, survivors),
    }


class _Fixed:
    def __init__(self, uniforms: np.ndarray) -> None:
        self.uniforms = uniforms

    def random(self, shape: tuple[int, ...]) -> np.ndarray:
        return self.uniforms.reshape(shape)


def view_cases(
    secrets: dict[int, dict[str, bytes]],
    roster: dict[int, AdvertisedKeys],
    digest: bytes,
    graph: dict[int, list[int]],
    received: dict[int, dict[int, tuple[int, int]]],
    survivors: list[int],
) -> list[dict[str, Any]]:
    context = PARAMS.context
    keys = {
        u: SigningKey(Ed25519PrivateKey.from_private_bytes(secrets[u]["signing_private"])) for u in roster
    }
    inputs = INPUTS.digest()
    me = survivors[0]

    def statement(
        v: int, signer: int | None = None, other_inputs: bool = False, extra_missing: tuple[int, ...] = ()
    ) -> dict[str, Any]:
        missing = sorted((set(graph[v]) - set(received[v])) | set(extra_missing))
        digest_used = hashlib.sha256(b"other").digest() if other_inputs else inputs
        return PartnerStatement.sign(keys[signer or v], context, digest, digest_used, missing).to_json()

    def confirmation(v: int, shown: list[int]) -> dict[str, Any]:
        return Confirmation.sign(keys[v], context, digest, shown, inputs).to_json()

    base: dict[str, Any] = {
        "params": PARAMS.to_json(),
        "graph": {str(u): vs for u, vs in graph.items()},
        "roster_digest": digest.hex(),
        "signing_keys": {str(u): b64(k.public) for u, k in keys.items()},
        "index": me,
        "holds": sorted(received[me]),
        "inputs_sha256": inputs.hex(),
        "survivors": survivors,
        "confirmations": {str(v): confirmation(v, survivors) for v in survivors},
        "statements": {str(v): statement(v) for v in survivors},
    }
    partner = next(v for v in graph[me] if v in survivors and v in received[me])
    refusals: dict[str, dict[str, Any]] = {
        "not_a_survivor": {"survivors": [v for v in survivors if v != me] + [LEAVES_AFTER_MASKING]},
        "no_quorum": {"confirmations": {str(v): confirmation(v, survivors) for v in survivors[:-1]}},
        "confirmed_other_survivors": {
            "confirmations": {str(v): confirmation(v, [*survivors, LEAVES_AFTER_MASKING]) for v in survivors}
        },
        "statement_missing": {"statements": {str(v): statement(v) for v in survivors[:-1]}},
        "statement_forged": {
            "statements": {**base["statements"], str(partner): statement(partner, signer=me)}
        },
        "other_inputs": {
            "statements": {**base["statements"], str(partner): statement(partner, other_inputs=True)}
        },
        "disagree_on_masking": {
            "statements": {**base["statements"], str(partner): statement(partner, extra_missing=(me,))}
        },
    }
    cases = [{"name": "consistent", "case": base, "error": None}]
    cases += [{"name": n, "case": {**base, **change}, "error": "protocol"} for n, change in refusals.items()]
    return cases


def primitive_vectors() -> dict[str, Any]:
    rng = np.random.default_rng(8000)
    context = PARAMS.context
    privates = [_rng_bytes(rng, 32) for _ in range(2)]
    publics = [crypto.public_bytes(crypto.private_from_bytes(p)) for p in privates]
    purpose = b"share-encryption"
    key = crypto.agree(crypto.private_from_bytes(privates[0]), publics[1], purpose, context)
    plaintext, aad = b"the shares of one device", b"associated data"
    ciphertext = _encrypt(key, bytes(range(12)), plaintext, aad)
    tampered = ciphertext[:-1] + bytes([ciphertext[-1] ^ 0x80])
    secret = int.from_bytes(_rng_bytes(rng, 32), "big")
    coefficients = [_field(rng) for _ in range(2)]
    shares = shamir.shares_from_coefficients(secret, coefficients, [1, 2, 3, 5, 8])
    wide = RoundParameters(**{**PARAMS.to_json(), "bits": 40, "vector_length": 6})
    seed = _rng_bytes(rng, 32)
    signing = _rng_bytes(rng, 32)
    message = b"a message a device signs"
    keys = AdvertisedKeys(publics[0], publics[1], hashlib.sha256(b"c").digest())
    roster = {3: keys, 7: AdvertisedKeys(publics[1], publics[0], hashlib.sha256(b"d").digest())}
    roster_hash = roster_digest(context, roster)
    quantize_cases = []
    for name, scale in (("within_clip", 0.2), ("clipped", 2.0)):
        vector = rng.normal(scale=scale, size=PARAMS.vector_length)
        uniforms = rng.random(PARAMS.vector_length)
        quantize_cases.append(
            {
                "name": name,
                "params": PARAMS.to_json(),
                "vector": vector.tolist(),
                "uniforms": uniforms.tolist(),
                "quantized": quantization.quantize(vector, PARAMS, _Fixed(uniforms)).tolist(),  # type: ignore[arg-type]
            }
        )
    return {
        "x25519": [{"private": p.hex(), "public": q.hex()} for p, q in zip(privates, publics, strict=True)],
        "agree": [
            {
                "private": privates[0].hex(),
                "peer_public": publics[1].hex(),
                "purpose": purpose.hex(),
                "context": context,
                "key": key.hex(),
            },
            {
                "private": privates[1].hex(),
                "peer_public": publics[0].hex(),
                "purpose": purpose.hex(),
                "context": context,
                "key": key.hex(),
            },
            {
                "private": privates[0].hex(),
                "peer_public": bytes(32).hex(),
                "purpose": purpose.hex(),
                "context": context,
                "error": "protocol",
            },
        ],
        "derive_key": [
            {
                "secret": seed.hex(),
                "purpose": SELF_MASK.hex(),
                "context": context,
                "key": crypto.derive_key(seed, SELF_MASK, context).hex(),
            }
        ],
        "decrypt": [
            {
                "key": key.hex(),
                "ciphertext": ciphertext.hex(),
                "associated": aad.hex(),
                "plaintext": plaintext.hex(),
            },
            {"key": key.hex(), "ciphertext": tampered.hex(), "associated": aad.hex(), "error": "protocol"},
            {
                "key": key.hex(),
                "ciphertext": ciphertext.hex(),
                "associated": b"other".hex(),
                "error": "protocol",
            },
            {
                "key": key.hex(),
                "ciphertext": ciphertext[:20].hex(),
                "associated": aad.hex(),
                "error": "protocol",
            },
        ],
        "encrypt": [{"key": key.hex(), "plaintext": plaintext.hex(), "associated": aad.hex()}],
        "commitment": [
            {
                "parts": [b"share".hex(), b"".hex(), seed.hex()],
                "digest": crypto.commitment(b"share", b"", seed).hex(),
            }
        ],
        "shamir": [
            {
                "secret": str(secret),
                "coefficients": [str(c) for c in coefficients],
                "shares": {str(x): str(y) for x, y in shares.items()},
                "reconstruct_from": [2, 5, 8],
            }
        ],
        "expand_mask": [
            {
                "seed": seed.hex(),
                "params": p.to_json(),
                "mask": (masks.expand(seed, p).astype(np.uint64) & np.uint64(p.modulus_mask)).tolist(),
            }
            for p in (PARAMS, wide)
        ],
        "quantize": quantize_cases,
        "neighbour_graph": [
            {
                "roster": list(range(1, 11)),
                "k": k,
                "context": context,
                "graph": {str(u): vs for u, vs in neighbour_graph(list(range(1, 11)), k, context).items()},
            }
            for k in (4, 0)
        ],
        "sign": [
            {
                "private": signing.hex(),
                "public": signing_public(Ed25519PrivateKey.from_private_bytes(signing)).hex(),
                "message": message.hex(),
                "signature": SigningKey(Ed25519PrivateKey.from_private_bytes(signing)).sign(message).hex(),
            }
        ],
        "advertisement_message": [
            {
                "context": context,
                "keys": keys.to_json(),
                "message": advertisement_message(context, keys).hex(),
            }
        ],
        "roster_digest": [
            {
                "context": context,
                "roster": {str(u): k.to_json() for u, k in roster.items()},
                "digest": roster_hash.hex(),
            }
        ],
        "statement_message": [
            {
                "context": context,
                "roster": roster_hash.hex(),
                "inputs_sha256": seed.hex(),
                "missing": [7, 3],
                "message": statement_message(context, roster_hash, seed, [7, 3]).hex(),
            }
        ],
        "view_message": [
            {
                "context": context,
                "roster": roster_hash.hex(),
                "survivors": [9, 3, 7],
                "inputs_sha256": seed.hex(),
                "message": view_message(context, roster_hash, [9, 3, 7], seed).hex(),
            }
        ],
        "task_inputs_digest": [
            {
                "inputs": {
                    "artifact_sha256": INPUTS.artifact_sha256,
                    "task_config": dict(INPUTS.task_config),
                    "model_version": INPUTS.model_version,
                    "globals_sha256": INPUTS.globals_sha256.hex(),
                    "parameters": INPUTS.parameters,
                },
                "digest": INPUTS.digest().hex(),
            }
        ],
    }


def generate(root: Any) -> None:
    from conformance.vectors import write_json

    write_json(root / "secure_aggregation" / "primitives.json", primitive_vectors())
    write_json(root / "secure_aggregation" / "round.json", round_vectors())
