"""`task_config.negative_popularity`: taken for a model that samples negatives and has a popularity
global (item biases), refused in one line for any other, and sent to devices with the task."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from orchestrator.service.population_creation import ExportedModel, PopulationError
from sqlalchemy.orm import Session, sessionmaker

from model_export.config import ModelConfig
from orchestrator.db import Population
from tests.conftest import IMPLICIT
from tests.orchestrator.conftest import make_population


def test_an_implicit_model_with_item_biases_takes_it(
    db: sessionmaker[Session], export: Callable[[ModelConfig], Path]
) -> None:
    make_population(db, ExportedModel.from_dir(export(IMPLICIT)), task_config={"negative_popularity": 2.0})

    with db() as session:
        population = session.query(Population).one()
        assert population.settings["task_config"]["negative_popularity"] == 2.0


def test_a_model_without_sampled_negatives_refuses_it_in_one_line(
    db: sessionmaker[Session], biased_model: ExportedModel
) -> None:
    with pytest.raises(PopulationError, match="samples no negatives") as refused:
        make_population(db, biased_model, task_config={"negative_popularity": 0.5})

    assert "\n" not in str(refused.value)
    make_population(db, biased_model, task_config={"negative_popularity": 0.0})  # 0: as before


def test_central_only_items_are_taken_within_the_catalog_and_refused_outside_it(
    db: sessionmaker[Session], export: Callable[[ModelConfig], Path], biased_model: ExportedModel
) -> None:
    implicit = ExportedModel.from_dir(export(IMPLICIT))
    with pytest.raises(PopulationError, match="catalog has rows 0-149") as refused:
        make_population(db, implicit, task_config={"central_only_items": [3, 150]})
    assert "\n" not in str(refused.value)
    with pytest.raises(PopulationError, match="samples no negatives"):
        make_population(db, biased_model, task_config={"central_only_items": [3]})

    make_population(db, implicit, task_config={"central_only_items": [9, 3]})

    with db() as session:
        population = session.query(Population).one()
        assert population.settings["task_config"]["central_only_items"] == [3, 9]
