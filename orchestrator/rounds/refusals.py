"""The protocol's answer to a request it will not honour, shared by the round state machines."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Refused:
    """An HTTP status and why; returned, not raised, so that counters bumped on the way are
    committed with the answer."""

    status: int
    message: str
    retry_after: float | None = None
    # A short class of the refusal for metrics and logs (the message may quote the request).
    reason: str = ""
    # How many check-ins refused like this one the server may hold for the round that opens next
    # (service.waiting_room); 0: none.
    waiting_places: int = 0
