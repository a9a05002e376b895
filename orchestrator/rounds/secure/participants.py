"""A secure round's participants as its phases read them, at a small cost per message.

- The open phase's conditions are not counted here: counters on the secure round's row say them
  (`secure_round_state`), moved by one statement per message, so a message costs the same however
  many devices the round has. The flags below are read once per phase's close (`indices_where`,
  from a covering index, never a row of shares).
- What a closed phase fixed (the roster, who shared keys, who sent a masked input, who confirmed,
  whose shares were refused, the roster's keys as devices download them) never changes again, so
  each server process reads it once per round (`closed`) instead of on every message.
- A key may be advertised once in a round: an indexed lookup (`taken_kinds`), not a comparison
  with every earlier advertisement.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import InstrumentedAttribute, Session
from sqlalchemy.sql import ColumnElement

from orchestrator.db import SecureParticipant, SecureRound, SecureRoundKey
from orchestrator.observability.on_commit import on_commit
from secure_aggregation.identity import SignedAdvertisement, keys_of, parse_advertisement
from secure_aggregation.messages import AdvertisedKeys
from secure_aggregation.view import roster_digest

# A participant's flag (a boolean column), or a condition on its row.
Flag = ColumnElement[bool] | InstrumentedAttribute[bool]
# The phases in order (secure_phases' names): a phase's facts are fixed once a later one opened.
_ORDER = ("advertise", "share_keys", "masked_input", "consistency", "unmasking", "done")


def indices_where(session: Session, round_id: int, flag: Flag) -> frozenset[int]:
    rows = session.execute(
        select(SecureParticipant.device_index).where(SecureParticipant.round_id == round_id, flag)
    )
    return frozenset(index for (index,) in rows)


def advertised_keys(session: Session, round_id: int) -> dict[int, dict[str, Any]]:
    """Every participant's advertisement (JSON, as its device sent it), by roster index."""
    rows = session.execute(
        select(SecureParticipant.device_index, SecureParticipant.keys).where(
            SecureParticipant.round_id == round_id
        )
    )
    return {index: keys for index, keys in rows}


def roster_of(session: Session, round_id: int) -> dict[int, AdvertisedKeys]:
    """Every participant's keys, by roster index (parsed: for the unmasking, once a round)."""
    return _keys(advertised_keys(session, round_id))


def _keys(advertised: dict[int, dict[str, Any]]) -> dict[int, AdvertisedKeys]:
    return {i: keys_of(parse_advertisement(k)) for i, k in advertised.items()}


def _claims(advertisement: AdvertisedKeys | SignedAdvertisement) -> set[tuple[str, bytes]]:
    keys = keys_of(advertisement)
    claims = {("agreement", k) for k in (keys.encryption_key, keys.mask_key, keys.self_mask_commitment)}
    if isinstance(advertisement, SignedAdvertisement):
        claims.add(("device", advertisement.certificate.device_key))
    return claims


def taken_kinds(
    session: Session, round_id: int, advertisement: AdvertisedKeys | SignedAdvertisement
) -> set[str]:
    """Which kinds of the advertisement's keys ("agreement", "device") another device of the
    round already advertised: an indexed lookup of at most four keys."""
    claims = _claims(advertisement)
    return set(
        session.scalars(
            select(SecureRoundKey.kind).where(
                SecureRoundKey.round_id == round_id,
                or_(*(and_(SecureRoundKey.kind == kind, SecureRoundKey.key == key) for kind, key in claims)),
            )
        )
    )


def record_keys(session: Session, round_id: int, advertisement: AdvertisedKeys | SignedAdvertisement) -> None:
    """The advertisement's keys are taken in this round (its primary key refuses a second claim)."""
    session.add_all(
        SecureRoundKey(round_id=round_id, kind=k, key=v) for k, v in sorted(_claims(advertisement))
    )


def next_index(session: Session, round_id: int) -> int:
    """The roster index of the round's next participant (from 1)."""
    last = session.scalar(
        select(func.max(SecureParticipant.device_index)).where(SecureParticipant.round_id == round_id)
    )
    return int(last or 0) + 1


@dataclass(frozen=True)
class Closed:
    """What a round's closed phases fixed; None for what a phase still open may change."""

    roster: tuple[int, ...] | None  # every participant's index, sorted (past the advertisements)
    roster_json: dict[str, Any] | None  # the advertisements as devices download them
    roster_digest: bytes | None  # what devices sign it as (secure_aggregation.view)
    sharers: frozenset[int] | None  # sent shares (past share_keys)
    survivors: frozenset[int] | None  # chosen among the senders: the unmasked inputs (past masked_input)
    statements: dict[str, Any] | None  # the survivors' partner statements, as sent (past masked_input)
    refused: dict[int, frozenset[int]] | None  # owner -> survivors that hold none of its shares
    signers: frozenset[int] | None  # survivors that confirmed the survivor set (past consistency)
    confirmations: dict[str, Any] | None  # their confirmations, as sent (past consistency)


_CACHE: OrderedDict[tuple[int, str, str], Closed] = OrderedDict()
_CACHE_ROUNDS = 8  # a server has a few secure rounds open at a time (one per population)
_LOCK = threading.Lock()  # with PostgreSQL the transactions run on a thread pool


def closed(session: Session, secure_round: SecureRound) -> Closed:
    """The facts of the round's closed phases, read from the database once per phase and server
    process once committed (keyed by the round's random context too: a round id may come back in
    another database)."""
    phase = secure_round.phase
    key = (secure_round.round_id, str(secure_round.parameters.get("context", "")), phase)
    # Devices read together in one transaction (service.secure_states) share its facts before it
    # commits.
    in_transaction = _facts_of_this_transaction(session)
    with _LOCK:
        found = _CACHE.get(key) or in_transaction.get(key)
    if found is not None:
        return found
    past = _ORDER.index(phase)
    round_id = secure_round.round_id
    advertised = advertised_keys(session, round_id) if past > 0 else None
    statements = _messages(session, round_id, SecureParticipant.partners) if past > 2 else None
    confirmations = _messages(session, round_id, SecureParticipant.consistency) if past > 3 else None
    roster = None if advertised is None else _keys(advertised)
    context = str(secure_round.parameters.get("context", ""))
    facts = Closed(
        roster=None if advertised is None else tuple(sorted(advertised)),
        roster_json=None if advertised is None else {str(i): advertised[i] for i in sorted(advertised)},
        roster_digest=None if roster is None else roster_digest(context, roster),
        sharers=indices_where(session, round_id, SecureParticipant.sent_shares) if past > 1 else None,
        survivors=None if statements is None else frozenset(int(i) for i in statements),
        statements=statements,
        refused=None if statements is None else _holding_none(statements),
        signers=None if confirmations is None else frozenset(int(i) for i in confirmations),
        confirmations=confirmations,
    )

    def keep() -> None:
        with _LOCK:
            _CACHE[key] = facts
            while len(_CACHE) > _CACHE_ROUNDS * len(_ORDER):
                _CACHE.popitem(last=False)

    # Kept once this transaction commits: a phase closed in a transaction that rolls back may
    # close again later with other members.
    on_commit(session, keep)
    in_transaction[key] = facts
    return facts


_FACTS = "secure rounds' closed facts read in this transaction"


def _facts_of_this_transaction(session: Session) -> dict[tuple[int, str, str], Closed]:
    """The facts read so far in the session's current transaction (none from an earlier one: a
    transaction that rolled back may have closed a phase that closes again with other members)."""
    transaction = session.get_transaction()
    held = session.info.get(_FACTS)
    if held is None or held[0] is not transaction:
        held = session.info[_FACTS] = (transaction, {})
    facts: dict[tuple[int, str, str], Closed] = held[1]
    return facts


# Per round (id, context): the owners whose secrets already have enough holders among the
# unmasking answers. Answers only add holders, so each is checked until it has them, not at
# every answer (which made the unmasking phase O(n^2 k)). Kept once its transaction commits.
_SETTLED: OrderedDict[tuple[int, str], frozenset[int]] = OrderedDict()


def settled_owners(secure_round: SecureRound) -> frozenset[int]:
    with _LOCK:
        return _SETTLED.get(_round_key(secure_round), frozenset())


def settle(session: Session, secure_round: SecureRound, owners: set[int]) -> None:
    """`owners` have enough holders among the unmasking answers, once this transaction commits."""
    key = _round_key(secure_round)

    def keep() -> None:
        with _LOCK:
            _SETTLED[key] = _SETTLED.get(key, frozenset()) | owners
            _SETTLED.move_to_end(key)
            while len(_SETTLED) > _CACHE_ROUNDS:
                _SETTLED.popitem(last=False)

    if owners:
        on_commit(session, keep)


def _round_key(secure_round: SecureRound) -> tuple[int, str]:
    return secure_round.round_id, str(secure_round.parameters.get("context", ""))


def _messages(session: Session, round_id: int, column: InstrumentedAttribute[Any]) -> dict[str, Any]:
    """The survivors' messages in `column` (JSON, as sent), by roster index."""
    rows = session.execute(
        select(SecureParticipant.device_index, column).where(
            SecureParticipant.round_id == round_id, SecureParticipant.confirmed, column.is_not(None)
        )
    )
    return {str(index): message for index, message in sorted(rows)}


def _holding_none(statements: dict[str, Any]) -> dict[int, frozenset[int]]:
    """Owner -> the survivors whose statements say they hold none of its shares."""
    holding_none: dict[int, set[int]] = {}
    for holder, statement in statements.items():
        for owner in statement["missing"]:
            holding_none.setdefault(int(owner), set()).add(int(holder))
    return {owner: frozenset(holders) for owner, holders in holding_none.items()}
