"""The server's choice of a secure round's survivors once the masked inputs are in (pure).

Every sender's partner statement says which of its neighbours it masked nothing with. Two senders
that disagree (one masked with the other, which did not: its shares failed authentication, or so it
says) cannot both be in the sum, so one of them leaves it. Which one follows from who can be
believed: an honest device's neighbours never send it shares that fail, so an accusation is either
a faulty sender, a server that tampered with the ciphertext, or a lying accuser. An accusation
costs the accuser: it leaves the sum, unless at least `CORROBORATION` believable accusers name the
same device (then that device leaves instead); an accuser that names more than `BELIEVABLE`
devices is not believed at all. One device cannot abandon a round by accusing everyone, nor by
sending every neighbour garbage, and a few colluding devices can drop only a few others.

Then the senders must have trained on the same inputs (the most common digest wins: devices check
it themselves and refuse otherwise), and the survivors' mutual masks must connect them (devices
refuse a set that they do not): the largest connected part is kept.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from secure_aggregation.view import PartnerStatement, partners

# An accuser naming more of its neighbours than this is not believed (an honest one names none
# unless a neighbour is faulty or the server tampered).
BELIEVABLE = 2
# Believable accusers of one device that make it, and not them, leave the sum.
CORROBORATION = 2


@dataclass(frozen=True)
class Survivors:
    survivors: frozenset[int]
    left_out: Mapping[int, str]  # sender -> why its input is not in the sum


def choose(graph: Mapping[int, Sequence[int]], statements: Mapping[int, PartnerStatement]) -> Survivors:
    """The survivors among the senders of `statements` (every masked input came with one)."""
    left_out: dict[int, str] = {}
    by_inputs: dict[bytes, set[int]] = {}
    for sender, statement in statements.items():
        by_inputs.setdefault(statement.inputs_sha256, set()).add(sender)
    if not by_inputs:
        return Survivors(frozenset(), {})
    common = max(by_inputs.values(), key=lambda members: (len(members), -min(members)))
    for sender in set(statements) - common:
        left_out[sender] = "it trained on other inputs than most survivors"
    masked = {u: partners(graph, u, statements[u].missing) for u in common}
    # u accuses v: v masked with u, u did not mask with v.
    accused = {
        u: {v for v in set(graph[u]) & common if v not in masked[u] and u in masked[v]} for u in common
    }
    believable = {u for u in common if len(accused[u]) <= BELIEVABLE}
    out: set[int] = set()
    for v in sorted(common):
        accusers = {u for u in common if v in accused[u]}
        if len(accusers & believable) >= CORROBORATION:
            out.add(v)
            left_out[v] = f"{len(accusers & believable)} neighbours could not authenticate its shares"
    for u in sorted(common):
        if accused[u] - out:
            out.add(u)
            left_out.setdefault(u, "it could not authenticate shares that its other neighbours could")
    kept = common - out
    mutual = {v: {w for w in masked[v] & kept if v in masked[w]} for v in kept}
    largest = _largest_component(kept, mutual)
    for v in kept - largest:
        left_out[v] = "its masks do not connect it to most survivors"
    return Survivors(frozenset(largest), left_out)


def _largest_component(members: set[int], edges: Mapping[int, set[int]]) -> set[int]:
    best: set[int] = set()
    unseen = set(members)
    while unseen:
        start = min(unseen)
        seen, frontier = {start}, [start]
        while frontier:
            for v in edges[frontier.pop()]:
                if v not in seen:
                    seen.add(v)
                    frontier.append(v)
        unseen -= seen
        if len(seen) > len(best):
            best = seen
    return best
