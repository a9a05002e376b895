"""The secure round's device side as the kit's operations, from secure_aggregation's pure functions.

Secrets a device draws at random (its X25519 keys, its self-mask seed, the Shamir polynomials,
quantization's uniform draws) come in as arguments, so that every answer is fixed by the vectors."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, cast

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from conformance.port import of_bytes, refusal, to_bytes
from secure_aggregation import crypto, masks, quantization, shamir
from secure_aggregation.config import ProtocolError, RoundParameters
from secure_aggregation.device import (
    SELF_MASK,
    SHARE_ENCRYPTION,
    pairwise_purpose,
    pairwise_sign,
    round_graph,
    self_mask_commitment,
    share_aad,
    share_commitment,
)
from secure_aggregation.draws import GivenUniforms
from secure_aggregation.identity import SigningKey, advertisement_message
from secure_aggregation.messages import (
    INDEX_BYTES,
    SHARES_PLAINTEXT_BYTES,
    AdvertisedKeys,
    EncryptedShares,
    UnmaskingShares,
    b64,
    ciphertexts_from_json,
    encode_vector,
    shares_to_json,
)
from secure_aggregation.neighbours import neighbour_graph
from secure_aggregation.view import (
    Confirmation,
    PartnerStatement,
    TaskInputs,
    View,
    check_view,
    roster_digest,
)

Op = Callable[[dict[str, Any]], dict[str, Any]]


def _params(args: dict[str, Any]) -> RoundParameters:
    return RoundParameters.from_json(args["params"])


def _roster(args: dict[str, Any]) -> dict[int, AdvertisedKeys]:
    return {int(i): AdvertisedKeys.from_json(keys) for i, keys in args["roster"].items()}


def _signing_key(data: Any) -> SigningKey:
    return SigningKey(Ed25519PrivateKey.from_private_bytes(to_bytes(data)))


def x25519_public(args: dict[str, Any]) -> dict[str, Any]:
    return {"public": of_bytes(crypto.public_bytes(crypto.private_from_bytes(to_bytes(args["private"]))))}


def x25519_agree(args: dict[str, Any]) -> dict[str, Any]:
    private = crypto.private_from_bytes(to_bytes(args["private"]))
    try:
        key = crypto.agree(private, to_bytes(args["peer_public"]), args["purpose"].encode(), args["context"])
    except ProtocolError as e:
        return refusal("protocol", str(e))
    return {"key": of_bytes(key)}


def derive(args: dict[str, Any]) -> dict[str, Any]:
    return {
        "key": of_bytes(
            crypto.derive_key(to_bytes(args["secret"]), args["purpose"].encode(), args["context"])
        )
    }


def expand_mask(args: dict[str, Any]) -> dict[str, Any]:
    return {"mask": masks.expand(to_bytes(args["seed"]), _params(args)).tolist()}


def shamir_shares(args: dict[str, Any]) -> dict[str, Any]:
    shares = shamir.shares_from_coefficients(
        int(args["secret"]), [int(c) for c in args["coefficients"]], args["holders"]
    )
    return {"shares": {str(x): of_bytes(shamir.share_to_bytes(y)) for x, y in sorted(shares.items())}}


def shamir_reconstruct(args: dict[str, Any]) -> dict[str, Any]:
    try:
        shares = {int(x): shamir.share_from_bytes(to_bytes(y)) for x, y in args["shares"].items()}
        return {"secret": str(shamir.reconstruct(shares))}
    except shamir.ShamirError as e:
        return refusal("shamir", str(e))


def quantize(args: dict[str, Any]) -> dict[str, Any]:
    vector = np.asarray(args["vector"], dtype=np.float64)
    try:
        got = quantization.quantize(
            vector, _params(args), cast(np.random.Generator, GivenUniforms(args["uniforms"]))
        )
    except ProtocolError as e:
        return refusal("protocol", str(e))
    return {"quantized": [int(v) for v in got]}


def graph(args: dict[str, Any]) -> dict[str, Any]:
    found = neighbour_graph(args["members"], args["k"], args["context"])
    return {"graph": {str(u): vs for u, vs in sorted(found.items())}}


def advertise(args: dict[str, Any]) -> dict[str, Any]:
    params = _params(args)
    keys = AdvertisedKeys(
        crypto.public_bytes(crypto.private_from_bytes(to_bytes(args["encryption_private"]))),
        crypto.public_bytes(crypto.private_from_bytes(to_bytes(args["mask_private"]))),
        self_mask_commitment(to_bytes(args["self_mask_seed"]), params.context),
    )
    signature = _signing_key(args["signing_private"]).sign(advertisement_message(params.context, keys))
    return {"keys": keys.to_json(), "signature": b64(signature)}


def digest_roster(args: dict[str, Any]) -> dict[str, Any]:
    return {"digest": b64(roster_digest(args["context"], _roster(args)))}


def digest_inputs(args: dict[str, Any]) -> dict[str, Any]:
    data = dict(args["inputs"])
    for name in ("globals_sha256", "central_examples_sha256", "central_gradient_sha256", "manifest_sha256"):
        if data.get(name) is not None:
            data[name] = bytes.fromhex(data[name])
    return {"digest": b64(TaskInputs(**data).digest())}


def share_keys(args: dict[str, Any]) -> dict[str, Any]:
    """Phase 2: the device's shares of its seed and mask key for each neighbour, encrypted to it."""
    params, roster, index = _params(args), _roster(args), int(args["index"])
    private = crypto.private_from_bytes(to_bytes(args["encryption_private"]))
    mine = roster.get(index)
    if mine is None or mine.encryption_key != crypto.public_bytes(private):
        return refusal("protocol", f"the roster does not hold this device's keys at index {index}")
    smallest = max(3, params.min_survivors)
    if len(roster) < smallest:
        return refusal("protocol", f"a roster of {len(roster)} devices is too small (at least {smallest})")
    digest = roster_digest(params.context, roster)
    out: dict[int, EncryptedShares] = {}
    for holder in round_graph(params, sorted(roster))[index]:
        seed_share = to_bytes(args["self_mask_shares"][str(holder)])
        key_share = to_bytes(args["mask_key_shares"][str(holder)])
        plaintext = (
            index.to_bytes(INDEX_BYTES, "big") + holder.to_bytes(INDEX_BYTES, "big") + seed_share + key_share
        )
        key = crypto.agree(private, roster[holder].encryption_key, SHARE_ENCRYPTION, params.context)
        out[holder] = EncryptedShares(
            crypto.encrypt(key, plaintext, share_aad(params.context, digest, index, holder)),
            share_commitment(b"self-mask", params.context, index, holder, seed_share),
            share_commitment(b"mask-key", params.context, index, holder, key_share),
        )
    return {"shares": shares_to_json(out)}


def open_shares(args: dict[str, Any]) -> dict[str, Any]:
    """The shares the device's neighbours sent it; a sender whose ciphertext fails is missing."""
    params, roster, index = _params(args), _roster(args), int(args["index"])
    private = crypto.private_from_bytes(to_bytes(args["encryption_private"]))
    digest = roster_digest(params.context, roster)
    neighbours = round_graph(params, sorted(roster))[index]
    held: dict[str, dict[str, Any]] = {}
    try:
        received = ciphertexts_from_json(args["ciphertexts"], len(roster))
    except ProtocolError as e:
        return refusal("protocol", str(e))
    for owner, ciphertext in sorted(received.items()):
        if owner not in neighbours:
            return refusal("protocol", f"shares from device {owner}, which is not this device's neighbour")
        key = crypto.agree(private, roster[owner].encryption_key, SHARE_ENCRYPTION, params.context)
        try:
            plaintext = crypto.decrypt(key, ciphertext, share_aad(params.context, digest, owner, index))
        except ProtocolError:
            continue
        labels = (
            int.from_bytes(plaintext[:INDEX_BYTES], "big"),
            int.from_bytes(plaintext[INDEX_BYTES:8], "big"),
        )
        if labels != (owner, index) or len(plaintext) != SHARES_PLAINTEXT_BYTES:
            continue
        body = plaintext[2 * INDEX_BYTES :]
        held[str(owner)] = {
            "self_mask_share": of_bytes(body[: shamir.SHARE_BYTES]),
            "mask_key_share": of_bytes(body[shamir.SHARE_BYTES :]),
        }
    missing = sorted(set(neighbours) - {int(o) for o in held})
    return {"held": held, "missing": missing}


def masked_input(args: dict[str, Any], sign: Callable[[int, int], int] = pairwise_sign) -> dict[str, Any]:
    """Phase 3: the quantized update plus the self mask and, per neighbour that shared, the pair's mask."""
    params, roster, index = _params(args), _roster(args), int(args["index"])
    shared = sorted(args["shared"])
    needed = params.shamir_threshold(len(round_graph(params, sorted(roster))[index]))
    if len(shared) < needed:
        return refusal("protocol", f"{len(shared)} neighbours shared keys; the device needs {needed}")
    mask_private = crypto.private_from_bytes(to_bytes(args["mask_private"]))
    total = np.asarray(args["quantized"], dtype=np.uint64)
    seed = to_bytes(args["self_mask_seed"])
    masks.add_into(total, masks.expand(crypto.derive_key(seed, SELF_MASK, params.context), params), 1)
    for v in shared:
        pair = crypto.agree(mask_private, roster[v].mask_key, pairwise_purpose(index, v), params.context)
        masks.add_into(total, masks.expand(pair, params), sign(index, v))
    return {"masked_input": of_bytes(encode_vector(total & np.uint64(params.modulus_mask), params))}


def partner_statement(args: dict[str, Any]) -> dict[str, Any]:
    statement = PartnerStatement.sign(
        _signing_key(args["signing_private"]),
        args["context"],
        to_bytes(args["roster_digest"]),
        to_bytes(args["inputs_sha256"]),
        args["missing"],
    )
    return {"statement": statement.to_json()}


def confirmation(args: dict[str, Any]) -> dict[str, Any]:
    confirmed = Confirmation.sign(
        _signing_key(args["signing_private"]),
        args["context"],
        to_bytes(args["roster_digest"]),
        args["survivors"],
        to_bytes(args["inputs_sha256"]),
    )
    return {"confirmation": confirmed.to_json()}


def unmask(args: dict[str, Any]) -> dict[str, Any]:
    """Phase 4, once the view checks: seeds of surviving neighbours, mask keys of dropped ones."""
    params = _params(args)
    view = View(
        params=params,
        graph=round_graph(params, sorted(int(i) for i in args["signing_keys"])),
        roster=to_bytes(args["roster_digest"]),
        signing_keys={int(i): to_bytes(k) for i, k in args["signing_keys"].items()},
        index=int(args["index"]),
        holds=frozenset(int(o) for o in args["held"]),
        inputs_sha256=to_bytes(args["inputs_sha256"]),
        survivors=frozenset(args["survivors"]),
    )
    if len(view.survivors) < params.min_survivors:
        return refusal("protocol", f"{len(view.survivors)} survivors; unmasking needs {params.min_survivors}")
    try:
        check_view(
            view,
            {int(i): Confirmation.from_json(c) for i, c in args["confirmations"].items()},
            {int(i): PartnerStatement.from_json(s) for i, s in args["statements"].items()},
        )
    except ProtocolError as e:
        return refusal("protocol", str(e))
    seeds = {
        int(u): to_bytes(s["self_mask_share"]) for u, s in args["held"].items() if int(u) in view.survivors
    }
    keys = {
        int(u): to_bytes(s["mask_key_share"]) for u, s in args["held"].items() if int(u) not in view.survivors
    }
    return {"unmasking": UnmaskingShares(seeds, keys).to_json()}


SECURE_OPS: dict[str, Op] = {
    "x25519.public": x25519_public,
    "x25519.agree": x25519_agree,
    "hkdf.derive": derive,
    "mask.expand": expand_mask,
    "shamir.shares": shamir_shares,
    "shamir.reconstruct": shamir_reconstruct,
    "quantize": quantize,
    "neighbours.graph": graph,
    "secure.advertise": advertise,
    "secure.roster_digest": digest_roster,
    "secure.inputs_digest": digest_inputs,
    "secure.share_keys": share_keys,
    "secure.open_shares": open_shares,
    "secure.masked_input": partial(masked_input),
    "secure.partner_statement": partner_statement,
    "secure.confirmation": confirmation,
    "secure.unmask": unmask,
}
