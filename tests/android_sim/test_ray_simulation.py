"""`simulate --backend ray`: the clients sharded over two local Ray worker processes give the
single-process run's results (same sampling, the same reports summed: in each worker for the plain
weighted mean, one by one in the server where the aggregation needs each report)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from android_sim.__main__ import main
from android_sim.simulation.rounds import Rounds, Server
from android_sim.simulation.simulate import SimulationOptions, SimulationResult, simulate
from benchmarks.model_cache import ModelCache
from benchmarks.quality_methods import load_dataset, protocol_model
from contracts.task_config import LocalState, TaskConfig
from orchestrator.aggregation.registry import RobustAggregation
from orchestrator.aggregation.weighted_mean import PartialSum
from tests.benchmarks.test_quality import _write_ratings


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """Two worker CPUs on this machine, shut down after the module (no Ray process is left)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=100 * 1024**2)
    try:
        yield
    finally:
        ray.shutdown()


def _assert_same(ray_run: SimulationResult, one_process: SimulationResult) -> None:
    assert ray_run.split.train == one_process.split.train
    assert [p["round"] for p in ray_run.curve] == [p["round"] for p in one_process.curve]
    for mine, theirs in zip(ray_run.curve, one_process.curve, strict=True):
        assert mine == pytest.approx(theirs, rel=1e-6)
    assert ray_run.held_out == pytest.approx(one_process.held_out, rel=1e-6)
    assert (ray_run.seen is None) == (one_process.seen is None)
    if one_process.seen is not None:
        assert ray_run.seen == pytest.approx(one_process.seen, rel=1e-6)
    assert ray_run.refused == one_process.refused
    for name, value in one_process.params.items():
        np.testing.assert_allclose(ray_run.params[name], value, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("task", "aggregation"),
    [
        (TaskConfig(), None),  # FedRecon: fresh locals at each task
        # FURL: each device's locals stay in the worker that holds its examples
        (TaskConfig(local_state=LocalState.KEEP, local_learning_rate=0.1), None),
        # Clipping needs each report: they come back to the server one by one
        (TaskConfig(), RobustAggregation()),
    ],
    ids=["reconstruct", "keep", "robust"],
)
def test_two_ray_workers_give_the_single_process_run(
    local_ray: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    task: TaskConfig,
    aggregation: RobustAggregation | None,
) -> None:
    data = load_dataset(_write_ratings(tmp_path / "u.data"))
    model_dir = ModelCache(tmp_path / "models").get(protocol_model(data.num_items, embedding_dim=4))
    options = SimulationOptions(Rounds(6, 10, evaluate_every=3), task, workers=2, aggregation=aggregation)

    one_process = simulate(model_dir, data.examples, options)
    partial_rounds: list[int] = []
    commit_partials = Server.commit_partials

    def counted(self: Server, partials: Sequence[PartialSum], refused: int) -> int:
        partial_rounds.append(len(partials))
        return commit_partials(self, partials, refused)

    monkeypatch.setattr(Server, "commit_partials", counted)
    on_ray = simulate(model_dir, data.examples, replace(options, backend="ray"))

    _assert_same(on_ray, one_process)
    # The plain weighted mean gets a partial sum from each worker (both hold sampled devices in
    # every round here); clipping gets the reports.
    assert partial_rounds == ([] if aggregation else [2] * 6)
    # The run trained: the globals moved and the curve changed.
    assert one_process.curve[-1]["loss"] != one_process.curve[0]["loss"]
    # Ray is still up (the fixture's): a simulation shuts down only the Ray it started.
    assert pytest.importorskip("ray").is_initialized()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "--address", "head:6379"], "--address is a Ray cluster's: give it with --backend ray"),
        (["run", "--address", "head:6379"], "--address is the Ray cluster of a sharded fleet"),
        (["run", "--shards", "0"], "shards must be >= 1, got 0"),
    ],
)
def test_ray_options_that_do_not_fit_are_one_line(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main([*argv, "--out" if argv[0] == "simulate" else "--work-dir", str(tmp_path / "out")])

    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "Traceback" not in err
