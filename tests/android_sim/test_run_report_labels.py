"""The run report's tables name what ran (FedRecon, FURL, a model without locals) and print the
ceilings' footnote only under ceiling rows."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable
from pathlib import Path

import numpy as np
from rich.console import Console

from android_sim.hit_rates import ScoredDevice, evaluate
from android_sim.recommendations import HitRates, model_label
from android_sim.run_report import CEILINGS, history_table, hit_rate_table
from contracts.manifest import load_manifest
from contracts.task_config import LocalState, TaskConfig
from model_export.config import ModelConfig
from tests.conftest import BIASED


def rendered(*tables: object) -> str:
    out = io.StringIO()
    console = Console(file=out, width=200)
    for table in tables:
        console.print(table)
    return out.getvalue()


def hit_rates(methods: list[str], label: str) -> HitRates:
    rng = np.random.default_rng(0)
    scored = [
        ScoredDevice(
            i,
            5 + i,
            np.array([i % 20]),
            rng.dirichlet(np.ones(20)),
            {m: rng.permutation(20)[:10] for m in methods},
        )
        for i in range(30)
    ]
    return HitRates(evaluate(scored), scored, label)


def test_the_label_follows_the_model_and_its_local_state(export: Callable[[ModelConfig], Path]) -> None:
    manifest = load_manifest(export(BIASED))
    kept = TaskConfig(local_state=LocalState.KEEP, local_learning_rate=0.1)

    assert model_label(manifest, TaskConfig()) == "FedRecon"
    assert model_label(manifest, kept) == "FURL"
    assert model_label(dataclasses.replace(manifest, local_params=()), TaskConfig()) == "model (no locals)"


def test_a_run_without_locals_or_ceilings_is_not_labelled_fedrecon_nor_footnoted() -> None:
    rates = hit_rates(["personalized", "global", "most_shared"], "model (no locals)")

    text = rendered(hit_rate_table(rates), history_table(rates))

    assert "FedRecon" not in text and "model (no locals) minus" in text
    assert CEILINGS.split(":")[0] not in text
    assert rates.to_json()["model_label"] == "model (no locals)"


def test_ceiling_rows_bring_their_footnote() -> None:
    rates = hit_rates(["personalized", "global", "most_shared", "oracle"], "FURL")

    text = rendered(hit_rate_table(rates))

    assert "FURL minus" in text and "oracle *" in text and "* ceilings:" in text
