"""The protocol's JSON messages (contracts.protocol) as FastAPI validates and documents them.

The pydantic models here are derived from the contract dataclasses field by field, so that names,
types, bounds and descriptions have one source, the one the device checks answers against.
Routes build and return the dataclasses; FastAPI validates and serializes them through these
models, and a request body arrives as the dataclass (`CheckInBody`).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    FiniteFloat,
    GetCoreSchemaHandler,
    TypeAdapter,
    create_model,
)
from pydantic_core import core_schema

from contracts import protocol


@functools.cache
def model_of(message: type) -> type[BaseModel]:
    """The pydantic model of a contract dataclass: its name, fields, defaults, bounds and
    descriptions; no extra fields, and strict types as the device reads them (no "5" for 5). It
    validates the dataclass too (`from_attributes`), so that a route may return one."""
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(message):
        annotation = protocol.field_types(message)[f.name]
        description = protocol.declared(annotation)[1].description or None
        if f.default_factory is not dataclasses.MISSING:
            default = Field(default_factory=f.default_factory, description=description)
        else:
            default = Field(
                f.default if f.default is not dataclasses.MISSING else ..., description=description
            )
        fields[f.name] = (_pydantic_type(annotation), default)
    return create_model(
        message.__name__,
        __config__=ConfigDict(extra="forbid", strict=True, from_attributes=True),
        __doc__=message.__doc__,
        **fields,
    )


def _pydantic_type(annotation: Any) -> Any:
    """A field's annotation with its Spec as pydantic constraints (descriptions stay at the field)."""
    kind, spec, nullable = protocol.declared(annotation)
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if dataclasses.is_dataclass(kind):
        inner: Any = model_of(typing.cast(type, kind))
    elif kind is float:
        inner = FiniteFloat
    elif origin in (dict, list):
        inner = types.GenericAlias(origin, tuple(_pydantic_type(a) for a in args))
    else:  # bool, int, str, a Literal, Any
        inner = kind
    # Spec's bounds are named as pydantic names them; a number is a 64-bit one, as the device reads it.
    bounds = {k: v for k, v in dataclasses.asdict(spec).items() if k != "description" and v is not None}
    if kind in (int, float):
        bounds = {"ge": -protocol.INT64_MAX, "le": protocol.INT64_MAX, **bounds}
    if bounds:
        inner = typing.cast(Any, Annotated)[inner, Field(**bounds)]
    return inner | None if nullable else inner


class _AsModel:
    """Pydantic metadata for a contract dataclass in a request: validated and documented as its
    derived model, then handed to the route as the dataclass. A request message is flat (no
    field holds another message), so the model's fields are the dataclass's values as they are."""

    def __get_pydantic_core_schema__(
        self, source: type, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        kinds = [protocol.declared(a)[0] for a in protocol.field_types(source).values()]
        if any(dataclasses.is_dataclass(kind) for kind in kinds):
            raise TypeError(f"{source.__name__} nests a message; a request message is flat")
        return core_schema.no_info_after_validator_function(
            lambda model: source(**vars(model)), handler(model_of(source))
        )


CheckInBody = Annotated[protocol.CheckIn, _AsModel()]
CHECK_IN = TypeAdapter(CheckInBody)  # for the check-in route's shortcut

Enrolled = model_of(protocol.Enrolled)
AssignmentOut = model_of(protocol.Assignment)
RejectionOut = model_of(protocol.Rejection)
ReportAccepted = model_of(protocol.ReportAccepted)
RoundOut = model_of(protocol.RoundView)
PopulationOut = model_of(protocol.PopulationView)
# As values, so that a type checker does not take them for annotations.
RoundsOut = types.GenericAlias(list, (RoundOut,))
PopulationsOut = types.GenericAlias(list, (PopulationOut,))
