"""The fast simulation's buffered rounds (FedBuff): which reports count, how stale, what commits.

The clients here are a plain function of the server's parameters (each reports +1 on one tensor),
so that what the buffers took can be worked out by hand; the server is the orchestrator's
pipeline and optimizer (`rounds.Server`), as in every simulation."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest

from android_sim.simulation.buffered import Buffering, train_buffered
from android_sim.simulation.rounds import Report, Rounds, Server, whole
from contracts.params import Params
from orchestrator.aggregation.server_optimizer import ServerOptimizerConfig
from orchestrator.aggregation.staleness import staleness_weight

Work = Callable[[Params, int], Report]


class Pool:
    """Runs each task at once with the parameters last set, and keeps which version each saw."""

    def __init__(self) -> None:
        self.params: Params = {}
        self.seen: list[float] = []

    def set_global(self, params: Params) -> None:
        self.params = params

    def map(self, work: Work, users: Sequence[int]) -> list[Report]:
        self.seen += [float(self.params["w"][0])] * len(users)
        return [work(self.params, u) for u in users]


def plus_one(params: Params, user: int) -> Report:
    return {"w": whole(np.ones(1, np.float32))}, 1.0


def run(buffering: Buffering, versions: int) -> tuple[Server, dict[str, object], Pool]:
    server = Server({"w": np.zeros(1, np.float32)}, ServerOptimizerConfig("sgd", 1.0))
    pool = Pool()
    rounds = Rounds(versions, 1, versions)
    trained, stats = train_buffered(pool, server, list(range(20)), plus_one, rounds, buffering, lambda p: {})
    assert len(trained.curve) == 2  # before the first version and after the last
    return server, stats.to_json(), pool


def test_equal_device_times_give_the_staleness_worked_out_by_hand() -> None:
    # 4 devices, a version every 2 reports, every task takes 1: at t=1 the first two commit
    # version 1, and the next two (trained on 0) are one version stale, refused at max 0; each
    # finisher's place goes at once to a device on the version then current; and so on.
    server, stats, _ = run(Buffering(2, 4, "constant", 0, duration_sigma=0.0), versions=3)
    assert server.params["w"][0] == pytest.approx(3.0)  # three commits of mean delta 1
    assert stats["counted"] == 6
    assert stats["refused_stale"] == 6
    assert stats["counted_share"] == 0.5
    assert stats["staleness_histogram"] == {"0": 6}


def test_stale_reports_count_when_allowed() -> None:
    # t=1: #0, #1 (version 0) commit 1; #2, #3 (0, one stale) commit 2; t=2: #4 (started on 0
    # when #0 finished: two stale) and #5 (started on 1 when #1 committed it: one stale) commit 3.
    _, stats, pool = run(Buffering(2, 4, "inverse_sqrt", 5, duration_sigma=0.0), versions=3)
    assert stats["refused_stale"] == 0
    assert stats["counted"] == 6
    assert stats["staleness_histogram"] == {"0": 2, "1": 3, "2": 1}
    assert set(pool.seen) == {0.0, 1.0, 2.0}  # each device trained on the version of its start


def test_the_weights_are_the_orchestrators() -> None:
    assert staleness_weight("inverse_sqrt", 3) == pytest.approx(0.5)
    assert staleness_weight("inverse", 1) == pytest.approx(0.5)
    assert staleness_weight("constant", 7) == 1.0
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        staleness_weight("inverse", -1)


def test_bad_buffering_is_refused_in_one_line() -> None:
    with pytest.raises(
        ValueError, match="staleness_weighting must be one of inverse_sqrt, inverse, constant"
    ):
        Buffering(staleness_weighting="1/s")
    with pytest.raises(ValueError, match="concurrency 30 exceeds the 20 training devices"):
        run(Buffering(2, 30), versions=1)
