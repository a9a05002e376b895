"""The SecAgg+ neighbour graph: symmetric, k neighbours each, the same for everyone with the seed."""

from __future__ import annotations

from secure_aggregation.neighbours import neighbour_graph, suggested_neighbours


def test_graph_is_symmetric_with_k_neighbours_and_derived_from_the_round_seed():
    # Prepare
    roster = list(range(1, 101))
    k = suggested_neighbours(len(roster))

    # Execute
    graph = neighbour_graph(roster, k, "population/round 7/abcd")

    # Assert
    assert k == 40
    assert all(len(near) == k and u not in near for u, near in graph.items())
    assert all(u in graph[v] for u, near in graph.items() for v in near)
    assert graph == neighbour_graph(list(reversed(roster)), k, "population/round 7/abcd")
    assert graph != neighbour_graph(roster, k, "population/round 8/abcd")


def test_small_rounds_use_the_full_graph():
    graph = neighbour_graph([1, 2, 3, 4], suggested_neighbours(4), "ctx")
    assert suggested_neighbours(30) == 0 and suggested_neighbours(40) == 32
    assert graph == {1: [2, 3, 4], 2: [1, 3, 4], 3: [1, 2, 4], 4: [1, 2, 3]}
