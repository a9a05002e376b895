"""The one signed view that decides everything a device reveals in a secure round.

What a device reveals at the unmasking is, for each neighbour whose shares it holds, exactly one of
that neighbour's two secrets: the self-mask seed if the neighbour is a survivor, the mask key if it
is not. A server that shows different devices different survivor sets gets some to reveal a
device's seed and others its mask key (or its partners' mask keys), and strips every mask from that
device's input. So the survivor set a device acts on must be the same for every device that
reveals anything, and the rules below make it so (docs/concepts/threat-model.md has the argument):

- The roster digest binds everything to one roster: it is in the associated data of every share
  ciphertext (a share decrypts only for a holder that saw the sender's roster) and in every
  signature below.
- A partner statement, sent (signed) with the masked input: the digest of everything that shaped
  the device's update (`TaskInputs`) and the neighbours it masked nothing with (`missing`: those
  whose shares it does not hold). It signs one, once.
- A confirmation, signed once: the roster digest, the survivor set and the inputs digest.
- A device reveals only when it holds confirmations of that same view from a quorum of the roster
  (more than half: two different views cannot both have one, since an honest device signs one),
  every survivor among its neighbours stated the same inputs and agrees with it on whether the two
  masked with each other, and the survivors' partner graph is connected (so that the only sum the
  masks let out is the survivors' whole sum). Anything else is a reason to refuse, never to treat
  a neighbour as dropped.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from secure_aggregation.config import ProtocolError, RoundParameters
from secure_aggregation.identity import DIGEST_BYTES, SIGNATURE_BYTES, SigningKey, _framed, verify
from secure_aggregation.messages import AdvertisedKeys, _object, b64, unb64

VIEW_PURPOSE = b"secure-aggregation/survivor-view/v2"
PARTNERS_PURPOSE = b"secure-aggregation/partner-statement/v1"
ROSTER_PURPOSE = b"secure-aggregation/roster/v1"
# A statement names at most this many neighbours it did not mask with (a neighbourhood is about
# 6 log2 n devices; the full graph of a round is at most its roster).
MAX_MISSING = 4096


def quorum(roster_size: int) -> int:
    """Confirmations of one view a device needs before it reveals: more than half the roster."""
    return roster_size // 2 + 1


def roster_digest(context: str, roster: Mapping[int, AdvertisedKeys]) -> bytes:
    """SHA-256 of the round and every roster entry's keys, in index order."""
    parts = [ROSTER_PURPOSE, context.encode()]
    for index in sorted(roster):
        keys = roster[index]
        parts += [str(index).encode(), keys.encryption_key, keys.mask_key, keys.self_mask_commitment]
    return hashlib.sha256(_framed(*parts)).digest()


@dataclass(frozen=True)
class TaskInputs:
    """Everything that shapes a device's update, by content: what its neighbours must have used
    too (a server that gives one device other globals, other central data or another weight than
    the rest could read that device's update off the others')."""

    artifact_sha256: str
    task_config: Mapping[str, Any]
    model_version: int
    globals_sha256: bytes  # the global parameters as downloaded
    central_examples_sha256: bytes | None = None  # example transfer's download, if it had one
    central_gradient_sha256: bytes | None = None  # gradient transfer's download, if it had one
    central_gradient_weight: float | None = None
    parameters: Mapping[str, Any] | None = None  # the round's secure parameters
    manifest_sha256: bytes | None = None  # the model's manifest (canonical JSON), as downloaded

    def digest(self) -> bytes:
        def hex_or_none(value: bytes | None) -> str | None:
            return None if value is None else value.hex()

        canonical = json.dumps(
            {
                "artifact_sha256": self.artifact_sha256,
                "task_config": self.task_config,
                "model_version": self.model_version,
                "globals_sha256": self.globals_sha256.hex(),
                "central_examples_sha256": hex_or_none(self.central_examples_sha256),
                "central_gradient_sha256": hex_or_none(self.central_gradient_sha256),
                "central_gradient_weight": self.central_gradient_weight,
                "parameters": self.parameters,
                "manifest_sha256": hex_or_none(self.manifest_sha256),
            },
            sort_keys=True,
            separators=(",", ":"),
        )
        return hashlib.sha256(canonical.encode()).digest()


def _indices(value: Any, what: str, limit: int) -> tuple[int, ...]:
    if (
        not isinstance(value, list)
        or len(value) > limit
        or not all(isinstance(i, int) and not isinstance(i, bool) and 1 <= i < 2**31 for i in value)
    ):
        raise ProtocolError(f"{what} must be a list of at most {limit} device indices (integers >= 1)")
    return tuple(sorted(set(value)))


def _members(indices: Iterable[int]) -> bytes:
    return ",".join(str(i) for i in sorted(set(indices))).encode()


def statement_message(context: str, roster: bytes, inputs_sha256: bytes, missing: Iterable[int]) -> bytes:
    return _framed(PARTNERS_PURPOSE, context.encode(), roster, inputs_sha256, _members(missing))


def view_message(context: str, roster: bytes, survivors: Iterable[int], inputs_sha256: bytes) -> bytes:
    return _framed(VIEW_PURPOSE, context.encode(), roster, _members(survivors), inputs_sha256)


@dataclass(frozen=True)
class PartnerStatement:
    """Sent before the masked input: the inputs digest, and the neighbours the device masked
    nothing with (it holds none of their shares: they did not share, or their shares failed
    authentication). Signed by a device with an identity; bare from one without."""

    inputs_sha256: bytes
    missing: tuple[int, ...]
    signature: bytes | None

    @classmethod
    def sign(
        cls, key: SigningKey, context: str, roster: bytes, inputs_sha256: bytes, missing: Iterable[int]
    ) -> PartnerStatement:
        missing = tuple(sorted(set(missing)))
        return cls(
            inputs_sha256, missing, key.sign(statement_message(context, roster, inputs_sha256, missing))
        )

    def verifies(self, device_key: bytes, context: str, roster: bytes) -> bool:
        if self.signature is None:
            return False
        message = statement_message(context, roster, self.inputs_sha256, self.missing)
        return verify(device_key, self.signature, message)

    def to_json(self) -> dict[str, Any]:
        return {
            "inputs_sha256": b64(self.inputs_sha256),
            "missing": list(self.missing),
            "signature": None if self.signature is None else b64(self.signature),
        }

    @classmethod
    def from_json(cls, data: Any) -> PartnerStatement:
        data = _object(data, {"inputs_sha256", "missing", "signature"}, "a partner statement")
        signature = data["signature"]
        return cls(
            unb64(data["inputs_sha256"], DIGEST_BYTES, "inputs_sha256"),
            _indices(data["missing"], "missing", MAX_MISSING),
            None if signature is None else unb64(signature, SIGNATURE_BYTES, "signature"),
        )


@dataclass(frozen=True)
class Confirmation:
    """The consistency check: the survivor set as the device was told it, over its roster and its
    inputs digest, signed by its certified key (bare hashes from a device without an identity)."""

    inputs_sha256: bytes
    signature: bytes | None

    @classmethod
    def sign(
        cls, key: SigningKey, context: str, roster: bytes, survivors: Iterable[int], inputs_sha256: bytes
    ) -> Confirmation:
        return cls(inputs_sha256, key.sign(view_message(context, roster, survivors, inputs_sha256)))

    def verifies(self, device_key: bytes, context: str, roster: bytes, survivors: Iterable[int]) -> bool:
        if self.signature is None:
            return False
        return verify(
            device_key, self.signature, view_message(context, roster, survivors, self.inputs_sha256)
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "inputs_sha256": b64(self.inputs_sha256),
            "signature": None if self.signature is None else b64(self.signature),
        }

    @classmethod
    def from_json(cls, data: Any) -> Confirmation:
        data = _object(data, {"inputs_sha256", "signature"}, "a survivor-set confirmation")
        signature = data["signature"]
        return cls(
            unb64(data["inputs_sha256"], DIGEST_BYTES, "inputs_sha256"),
            None if signature is None else unb64(signature, SIGNATURE_BYTES, "signature"),
        )


def partners(graph: Mapping[int, Sequence[int]], owner: int, missing: Iterable[int]) -> set[int]:
    """The neighbours `owner` masked with: all of them but those its statement names."""
    return set(graph[owner]) - set(missing)


def connected(members: set[int], edges: Mapping[int, set[int]]) -> bool:
    """Whether `members` form one component of the graph `edges` restricted to them."""
    if not members:
        return True
    start = min(members)
    seen, frontier = {start}, [start]
    while frontier:
        for v in edges.get(frontier.pop(), set()) & members:
            if v not in seen:
                seen.add(v)
                frontier.append(v)
    return seen == members


@dataclass(frozen=True)
class View:
    """What a device was shown at the unmasking, with what it knows itself."""

    params: RoundParameters
    graph: Mapping[int, Sequence[int]]
    roster: bytes  # the digest of the roster this device verified
    signing_keys: Mapping[int, bytes]  # each roster index's certified key
    index: int
    holds: frozenset[int]  # the neighbours whose shares this device holds (it masked with them)
    inputs_sha256: bytes
    survivors: frozenset[int]


def check_view(
    view: View, confirmations: Mapping[int, Confirmation], statements: Mapping[int, PartnerStatement]
) -> None:
    """ProtocolError, naming the first rule broken, unless this device may reveal by `survivors`:
    seeds of the survivors it holds shares of, mask keys of the others it holds shares of."""
    context, survivors, me = view.params.context, view.survivors, view.index
    if me not in survivors:
        raise ProtocolError("this device sent its masked input but is not among the survivors")
    needed = quorum(len(view.signing_keys))
    signed = 0
    for v, confirmation in confirmations.items():
        if signed >= needed:
            break  # a quorum is all it takes: the other signatures are not checked
        if (
            v in view.signing_keys
            and confirmation.inputs_sha256 == view.inputs_sha256
            and confirmation.verifies(view.signing_keys[v], context, view.roster, survivors)
        ):
            signed += 1
    if signed < needed:
        raise ProtocolError(
            f"{signed} devices of the roster of {len(view.signing_keys)} signed this survivor set, roster "
            f"and inputs; this device reveals only when {needed} (more than half) did"
        )
    edges: dict[int, set[int]] = {}
    for v in sorted(survivors):
        statement = statements.get(v)
        if statement is None or v not in view.signing_keys:
            raise ProtocolError(
                f"survivor {v} has no partner statement; this device reveals nothing without one"
            )
        if not statement.verifies(view.signing_keys[v], context, view.roster):
            raise ProtocolError(f"survivor {v}'s partner statement is not signed by its certified key")
        if statement.inputs_sha256 != view.inputs_sha256:
            raise ProtocolError(f"survivor {v} trained on other inputs (globals, task or central data)")
        edges[v] = partners(view.graph, v, statement.missing) & survivors
    for v in sorted(set(view.graph[me]) & survivors):
        if (v in view.holds) != (me in edges[v]):
            raise ProtocolError(
                f"survivor {v} and this device disagree on whether they masked with each other"
            )
    # A pair counts only if both masked with it (else the sum cannot be unmasked, whatever it shows).
    mutual = {v: {w for w in edges[v] if v in edges.get(w, set())} for v in edges}
    if not connected(set(survivors), mutual):
        raise ProtocolError(
            "the survivors' masks do not connect them all; a sum of part of them could be unmasked"
        )
