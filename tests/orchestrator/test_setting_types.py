"""Every population setting, walked through values of the wrong JSON type (text, null, bool,
nested) and extreme numbers (inf, NaN, 2^63, 2^64, -0, a subnormal, 10^400) at creation and in
settings changes, over real HTTP: never a 5xx, and a value of a type the setting does not take is
a 422 that names the setting. The settings and their types come from the settings' own schema
(PopulationSettings' JSON schema, the task, DP and optimizer dataclasses), not from a hand list."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from contracts.task_config import TaskConfig
from model_export.config import ModelConfig
from orchestrator.aggregation.differential_privacy import DPConfig
from orchestrator.aggregation.server_optimizer import ServerOptimizerConfig
from orchestrator.populations.settings import PopulationSettings
from orchestrator.populations.settings_changes import SAFE_TO_CHANGE
from tests.conftest import BIASED
from tests.orchestrator.conftest import ADMIN_TOKEN, Server, admin_create_population

# The nested settings objects that are dataclasses, not pydantic models, by the setting holding them.
DATACLASS_GROUPS: dict[str, Any] = {
    "task_config": TaskConfig,
    "differential_privacy": DPConfig,
    "server_optimizer": ServerOptimizerConfig,
}
# What a group's other fields are while one of its fields is walked (the rest at their defaults).
GROUP_BASES: dict[str, dict[str, Any]] = {
    "differential_privacy": {"clip_norm": 1.0, "noise_multiplier": 1.0, "population_size": 1000},
    "server_optimizer": {"name": "adam"},
}
TOP_BASE = {"target_reports": 1}


def _json_types_of_annotation(annotation: str) -> set[str]:
    types: set[str] = set()
    for part in annotation.replace(" ", "").split("|"):
        if part == "None":
            types.add("null")
        elif part == "bool":
            types.add("boolean")
        elif part == "int":
            types.add("integer")
        elif part == "float":
            types.update({"number", "integer"})
        elif part == "str" or part in ("SplitPolicy", "LocalState"):
            types.add("string")
        elif part.startswith(("tuple", "list")):
            types.add("array")
        else:
            raise AssertionError(f"a setting of type {annotation} this walk does not know")
    return types


def _json_types_of_schema(schema: dict[str, Any], definitions: dict[str, Any]) -> set[str]:
    if "$ref" in schema:
        return {"object"}
    if "anyOf" in schema:
        return set().union(*(_json_types_of_schema(s, definitions) for s in schema["anyOf"]))
    kind = schema.get("type")
    if kind is None and "enum" in schema:
        kind = "string"
    assert kind is not None, f"a setting schema without a type: {schema}"
    return {"number", "integer"} if kind == "number" else {kind}


def settings_and_types() -> dict[str, set[str]]:
    """Every setting by dotted name with the JSON types it takes."""
    schema = PopulationSettings.model_json_schema()
    definitions = schema.get("$defs", {})
    found: dict[str, set[str]] = {}
    for name, field in schema["properties"].items():
        if name in DATACLASS_GROUPS or "$ref" in field:
            # The group itself, as a whole, as well as each of its fields.
            found[name] = _json_types_of_schema(field, definitions)
        if name in DATACLASS_GROUPS:
            for f in dataclasses.fields(DATACLASS_GROUPS[name]):
                found[f"{name}.{f.name}"] = _json_types_of_annotation(str(f.type))
            continue
        if "$ref" in field:
            nested = definitions[field["$ref"].rsplit("/", 1)[1]]
            for inner, inner_field in nested["properties"].items():
                found[f"{name}.{inner}"] = _json_types_of_schema(inner_field, definitions)
            continue
        found[name] = _json_types_of_schema(field, definitions)
    return found


SETTINGS = settings_and_types()

# JSON text with the value spelled out: Python's json module writes inf and NaN as the
# non-standard Infinity and NaN, which a client may send as well.
HOSTILE_VALUES: dict[str, str] = {
    "text": '"1"',
    "text-float": '"0.5"',
    "null": "null",
    "true": "true",
    "false": "false",
    "object": '{"value": 1}',
    "list": "[1]",
    "inf": "Infinity",
    "-inf": "-Infinity",
    "nan": "NaN",
    "2^63": str(2**63),
    "2^64": str(2**64),
    "10^400": "1" + "0" * 400,
    "-0": "-0.0",
    "subnormal": "5e-324",
}
JSON_TYPE = {
    "text": "string",
    "text-float": "string",
    "null": "null",
    "true": "boolean",
    "false": "boolean",
    "object": "object",
    "list": "array",
}


def settings_text(name: str, value: str) -> str:
    """The settings JSON text with `name` set to the raw JSON `value`."""
    group, _, field = name.rpartition(".")
    marker = "__walked_value__"
    settings: dict[str, Any] = dict(TOP_BASE)
    if group:
        settings[group] = {**GROUP_BASES.get(group, {}), field: marker}
    else:
        settings[field] = marker
    return json.dumps(settings).replace(json.dumps(marker), value)


CASES = [
    pytest.param(name, kind, id=f"{name}-{kind}")
    for name in SETTINGS
    for kind in HOSTILE_VALUES
    # A type the setting takes is left to the range walk (test_setting_ranges).
    if JSON_TYPE.get(kind, "number") not in SETTINGS[name] or kind in ("text", "null")
]


def test_the_walk_covers_every_setting() -> None:
    assert len(SETTINGS) > 50
    assert {
        "min_examples",
        "secure.bits",
        "task_config.max_examples",
        "differential_privacy.clip_norm",
    } <= set(SETTINGS)


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with Server(tmp_path_factory.mktemp("types") / "orchestrator.sqlite").start() as server:
        yield server


def _assert_answered(response: httpx.Response, name: str, kind: str) -> None:
    assert response.status_code < 500, response.text
    wrong_type = JSON_TYPE.get(kind, "number") not in SETTINGS[name]
    if wrong_type:
        assert response.status_code == 422, (name, kind, response.text)
    if response.status_code == 422:
        detail = response.json()["detail"]
        assert isinstance(detail, str) and "\n" not in detail, detail
        assert name.rpartition(".")[2] in detail, detail
        # Text where a number belongs is refused for its type, not compared with the number.
        assert "differs from" not in detail, detail


@pytest.mark.parametrize(("name", "kind"), CASES)
def test_a_setting_of_the_wrong_type_or_an_extreme_is_a_422_that_names_it_never_a_5xx(
    running: Server, export: Callable[[ModelConfig], Path], name: str, kind: str
) -> None:
    population = f"t-{name.replace('.', '-')}-{kind.replace('^', '')}"

    created = admin_create_population(
        running.url, export(BIASED), population, settings_text(name, HOSTILE_VALUES[kind])
    )

    _assert_answered(created, name, kind)


@pytest.fixture(scope="module")
def changed_population(running: Server, export: Callable[[ModelConfig], Path]) -> str:
    created = admin_create_population(running.url, export(BIASED), "changes", "{}")
    assert created.status_code == 201, created.text
    return "changes"


@pytest.mark.parametrize(("name", "kind"), [c for c in CASES if c.values[0] in SAFE_TO_CHANGE])
def test_a_settings_change_of_the_wrong_type_or_an_extreme_is_a_422_that_names_it(
    running: Server, changed_population: str, name: str, kind: str
) -> None:
    body = '{"settings": {"%s": %s}, "operator": "walk"}' % (name, HOSTILE_VALUES[kind])  # noqa: UP031

    changed = httpx.patch(
        f"{running.url}/v1/admin/populations/{changed_population}/settings",
        content=body,
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"},
        timeout=30,
    )

    _assert_answered(changed, name, kind)


def test_task_config_min_examples_as_text_is_refused_for_its_type(
    running: Server, export: Callable[[ModelConfig], Path]
) -> None:
    settings = '{"task_config": {"min_examples": "1"}}'

    created = admin_create_population(running.url, export(BIASED), "min-examples-text", settings)

    assert created.status_code == 422, created.text
    assert created.json()["detail"] == (
        "invalid settings: invalid task config: min_examples must be int, got '1'"
    ), created.text


def test_task_config_min_examples_that_differs_says_both_values(
    running: Server, export: Callable[[ModelConfig], Path]
) -> None:
    settings = '{"min_examples": 1, "task_config": {"min_examples": 2}}'

    created = admin_create_population(running.url, export(BIASED), "min-examples-differs", settings)

    assert created.status_code == 422, created.text
    assert "task_config.min_examples (2) differs from the population's min_examples (1)" in created.text
