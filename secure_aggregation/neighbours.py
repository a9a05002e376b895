"""The SecAgg+ neighbour graph (Bell et al. 2020): who shares secrets and masks with whom.

A device masks its input with, and hands shares of its secrets to, only its k neighbours instead of
the whole round, so its cost grows with k = O(log n) rather than n. The graph is a random Harary
graph: the roster is placed on a ring in an order drawn from the round's public seed, and each
device is joined to the k/2 nearest on either side. Every device and the server derive the same
graph from the same roster and seed. With k >= n - 1 (or k = 0) it is the full graph of the
original protocol.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np


def suggested_neighbours(roster_size: int) -> int:
    """An even k of about 6 log2(n) (40 for 100 devices, 60 for 1,000): with 30% of a round
    leaving across the phases independently and a threshold of 0.4 k, a neighbourhood falls below
    its threshold with probability ~1e-5 (binomial tail), while a device's cost stays logarithmic
    in n. Dropouts that come together break that bound: in the fleet's secure main job, whose
    phones leave with the hour of the day, 1-6 of ~70 rounds a run end at the unmasking with a
    seed one or two shares short (README, "Privacy")."""
    if roster_size <= 2:
        return 0
    k = 2 * math.ceil(3 * math.log2(roster_size))
    return 0 if k >= roster_size - 1 else k


def neighbour_graph(roster: Sequence[int], k: int, context: str) -> dict[int, list[int]]:
    """Each roster index -> its neighbours (sorted, never itself)."""
    members = sorted(set(roster))
    if len(members) != len(roster):
        raise ValueError("the roster has repeated indices")
    n = len(members)
    if k == 0 or k >= n - 1:
        return {u: [v for v in members if v != u] for u in members}
    seed = int.from_bytes(hashlib.sha256(b"secure-aggregation/graph/" + context.encode()).digest()[:8], "big")
    ring = [members[i] for i in np.random.default_rng(seed).permutation(n)]
    graph: dict[int, list[int]] = {}
    for position, u in enumerate(ring):
        near = {ring[(position + step) % n] for step in range(-(k // 2), k // 2 + 1) if step}
        graph[u] = sorted(near)
    return graph
