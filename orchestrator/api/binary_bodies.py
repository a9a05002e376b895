"""What the OpenAPI document says of the bytes a client sends and receives, where JSON Schema alone
cannot: the safetensors layouts (docs/reference/wire-formats.md), the string metadata inside a
training report, and how long a download may be cached.

A generator reads `format: binary` (not `contentMediaType` alone) as "send a file", so every
multipart file part carries it; the safetensors parts and bodies name their layout in
`x-safetensors` and the report's metadata is a schema of its own (`TrainingReportMetadata`), so a
client can build it from the document rather than from prose.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

IMMUTABLE = "public, max-age=31536000, immutable"
CACHE_CONTROL = {
    "Cache-Control": {
        "description": f"`{IMMUTABLE}`: the bytes at this URL never change",
        "schema": {"type": "string"},
    }
}

SPARSE_DELTA = (
    "the sparse delta of each manifest `global_params` tensor NAME: `NAME/rows` int32, increasing; "
    "`NAME/values` float32 `[len(rows), ...]`; `NAME/shape` int64, the dense shape"
)
DENSE_GLOBALS = "one float32 tensor per manifest `global_params` entry, under its name and with its shape"
CENTRAL_EXAMPLES = (
    "one tensor per manifest feature, under the feature's name, first dimension the example count; "
    "optionally `@group`, int64, which examples belong together"
)


class TrainingReportMetadata(BaseModel):
    """The `__metadata__` of a training report's safetensors header: strings, as safetensors has
    them."""

    model_config = ConfigDict(extra="forbid")

    num_examples: Annotated[
        str,
        Field(
            pattern=r"^[0-9]+$",
            description="the examples the task trained on, as a decimal integer string",
            examples=["5"],
        ),
    ]
    metrics: Annotated[
        str | None,
        Field(
            description="the task's metrics, a JSON object of numbers serialized as a string",
            examples=['{"loss": 0.71}'],
            json_schema_extra={
                "contentMediaType": "application/json",
                "contentSchema": {"type": "object", "additionalProperties": {"type": "number"}},
            },
        ),
    ] = None


def safetensors(description: str, tensors: str, metadata: str | None = None) -> dict[str, Any]:
    """An `application/octet-stream` media type whose bytes are safetensors laid out as `tensors`,
    with `metadata` the component schema of its string metadata."""
    layout: dict[str, Any] = {"tensors": tensors}
    if metadata:
        layout["metadata"] = {"$ref": f"#/components/schemas/{metadata}"}
    return {
        "schema": {"type": "string", "format": "binary", "description": description},
        "x-safetensors": layout,
    }


# The multipart forms' file parts: what each holds.
_PARTS: dict[str, dict[str, Any]] = {
    "model": {"contentType": "application/octet-stream"},
    "manifest": {"contentType": "application/json"},
    "global_params": {"contentType": "application/octet-stream", "x-safetensors": {"tensors": DENSE_GLOBALS}},
    "examples": {"contentType": "application/octet-stream", "x-safetensors": {"tensors": CENTRAL_EXAMPLES}},
}


# The forms' text parts that hold JSON (PopulationSettings, MixingConfig), sent as strings.
JSON_PARTS = frozenset({"settings", "mixing"})
_JSON_PART = {"contentType": "application/json"}


def complete_multipart(schema: dict[str, Any]) -> None:
    """`format: binary` on every multipart file part (FastAPI writes `contentMediaType` only) and
    each part's content type and layout as the form's `encoding`."""
    components = schema.get("components", {}).get("schemas", {})
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            form = operation.get("requestBody", {}).get("content", {}).get("multipart/form-data")
            if form is None:
                continue
            body = components[form["schema"]["$ref"].rsplit("/", 1)[1]]
            files = [name for name, prop in body["properties"].items() if _mark_binary(prop)]
            form["encoding"] = {name: _PARTS[name] for name in files}
            form["encoding"] |= {name: _JSON_PART for name in body["properties"] if name in JSON_PARTS}


def _mark_binary(prop: dict[str, Any]) -> bool:
    """Mark a file part (or a nullable one's file branch) `format: binary`; whether it is one."""
    found = False
    for branch in [prop, *prop.get("anyOf", [])]:
        if branch.get("contentMediaType") == "application/octet-stream":
            branch["format"] = "binary"
            found = True
    return found
