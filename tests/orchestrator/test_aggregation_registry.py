"""The robust rules' registry is the one place a rule is named: the pipeline builds each rule's
stage from it, the settings accept exactly its names, and the contributor page's example stage,
registered as the page says, runs in the pipeline."""

from __future__ import annotations

import re
import types

import numpy as np
import pytest

from contracts.params import SparseTensor
from orchestrator.aggregation.assemble import Pipeline, RoundInputs
from orchestrator.aggregation.registry import ROBUST_RULES, RobustAggregation, RobustRule
from orchestrator.populations.settings import PopulationSettings
from tests.conftest import ROOT

SHAPES = {"g": (1,)}


def one(value: float) -> dict[str, SparseTensor]:
    return {"g": SparseTensor((1,), np.array([0], np.int32), np.array([value], np.float32))}


def mean_of(rule: RobustAggregation, values: list[float], weights: list[float]) -> float:
    deltas = [one(v) for v in values]
    result = Pipeline(SHAPES, rule).aggregate(
        RoundInputs(0, weights=weights), zip(deltas, weights, strict=True)
    )
    assert result.count == len(values) and result.norm_reference is not None  # clipped by ClipAndCap
    return float(result.mean_delta["g"][0])


def test_the_settings_accept_exactly_the_registry_s_names() -> None:
    schema = PopulationSettings.model_json_schema()["properties"]["robust_aggregation"]

    assert schema["enum"] == list(ROBUST_RULES) == ["none", "trimmed_mean", "median"]
    for name, rule in ROBUST_RULES.items():  # the settings page says what each does
        assert f"{name}: {rule.what}" in schema["description"]
    for name in ROBUST_RULES:
        assert PopulationSettings.model_validate({"robust_aggregation": name}).robust() == RobustAggregation(
            method=name
        )
    with pytest.raises(ValueError, match="'none', 'trimmed_mean' or 'median'"):
        PopulationSettings.model_validate({"robust_aggregation": "mean"})


def test_each_registered_rule_combines_a_round_through_the_pipeline() -> None:
    # Five reports weighing 1 each; none is clipped (bound 3 x median norm 3 = 9) or capped.
    values, weights = [1.0, 2.0, 3.0, 4.0, 8.0], [1.0] * 5
    expected = {"none": 18 / 5, "trimmed_mean": (2 + 3 + 4) / 3, "median": 3.0}

    means = {
        name: mean_of(RobustAggregation(method=name, trim_fraction=0.2), values, weights)
        for name in ROBUST_RULES
    }

    assert means == pytest.approx(expected)


def _contributor_example() -> tuple[str, str, str]:
    """The module, the registry entry and the rule's name, as docs/contributing.md writes them."""
    page = (ROOT / "docs" / "contributing.md").read_text()
    section = page.split("## Adding an aggregation stage")[1].split("\n## ")[0]
    module, entry = re.findall(r"```python\n(.*?)```", section, re.DOTALL)[:2]
    found = re.fullmatch(r'\s*"(\w+)": (RobustRule\(.*\)),\s*', entry, re.DOTALL)
    assert found is not None, entry
    return module, found[2], found[1]


def test_the_contributor_page_s_stage_is_one_module_and_one_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    module_source, entry_source, name = _contributor_example()
    module = types.ModuleType("unweighted_mean")
    exec(compile(module_source, "docs/contributing.md", "exec"), module.__dict__)
    entry = eval(entry_source, {**module.__dict__, "RobustRule": RobustRule})
    assert isinstance(entry, RobustRule)
    monkeypatch.setitem(ROBUST_RULES, name, entry)

    rule = RobustAggregation(method=name)

    # Not clipped (bound 3 x median norm 2 = 6) nor capped (5 x median weight 2 = 10): each report
    # counts once, (1 + 3) / 2, where the weighted mean gives (1 x 1 + 3 x 3) / 4.
    assert mean_of(rule, [1.0, 3.0], [1.0, 3.0]) == pytest.approx(2.0)
    assert mean_of(RobustAggregation(), [1.0, 3.0], [1.0, 3.0]) == pytest.approx(2.5)
