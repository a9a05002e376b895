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
from collections.abc import Collection, Mapping
from typing import Annotated, Any, Literal

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


# ---- what the OpenAPI document says beyond the JSON messages ----------------------------------


class ValidationIssue(BaseModel):
    """One part of a request that failed validation, as pydantic names it."""

    loc: list[str | int] = Field(description="where: 'body', 'path', 'query' or 'header', then the field")
    msg: str
    type: str
    input: Any = Field(None, description="the value sent (NaN and infinities as strings)")


class Error(BaseModel):
    """The body of every refusal (4xx, 5xx): one line in `detail`; a request that failed
    validation also lists each failing field in `errors`."""

    detail: str = Field(description="one line: what was wrong and what was expected")
    errors: list[ValidationIssue] | None = Field(
        None, description="request validation (422) only: each part of the request that failed"
    )


class EvaluationReport(BaseModel):
    """An evaluation task's report (`Content-Type: application/json`): metric sums over the
    device's examples, exactly the names the manifest's evaluation asks for, with
    `weight_sum` equal to `num_examples`."""

    model_config = ConfigDict(extra="forbid")

    num_examples: int = Field(ge=1, description="examples evaluated (at most what the check-in said)")
    metrics: dict[str, float] = Field(
        description="'loss_sum', 'weight_sum' and '<metric>_sum' for each of the manifest's metrics"
    )


# Why each status is answered, when a route says no more. Bodies are `Error`.
REFUSALS: dict[int, str] = {
    400: "the multipart form cannot be parsed",
    401: "no 'Authorization: Bearer <token>' header, or a token no device holds (WWW-Authenticate: Bearer)",
    403: "the token is valid but not allowed here",
    404: "no such resource",
    409: "the request conflicts with the state of the round or the assignment",
    413: "the body exceeds this route's size limit (checked before the body is read)",
    415: "the body's Content-Type is not one this route takes",
    422: "the request is well-formed HTTP but its content is invalid",
    429: "too many requests from this caller; Retry-After says when to come back",
    503: "the database is busy or unavailable, or a resource cannot be served now; retry after Retry-After",
}


RETRY_AFTER = {
    "Retry-After": {"description": "seconds to wait before trying again", "schema": {"type": "integer"}}
}


def refusals(
    described: Mapping[int, str | None], retry_after: Collection[int] = ()
) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses` for a route's own refusals: each status with the `Error` body and the
    route's reason (None: the usual one), and a `Retry-After` header on the statuses in
    `retry_after`. The refusals every route of its kind can answer (401, 413, 429, 503...) are
    added from the edge's gates (api/openapi.py)."""
    return {
        status: {
            "model": Error,
            "description": reason or REFUSALS[status],
            **({"headers": dict(RETRY_AFTER)} if status in retry_after else {}),
        }
        for status, reason in described.items()
    }


def binary(
    description: str, headers: Mapping[str, Any] | None = None, media: Mapping[str, Any] | None = None
) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses` for a 200 whose body is bytes (`application/octet-stream`), with the
    `headers` it carries and its `media` type object (default: plain binary)."""
    content = dict(media or {"schema": {"type": "string", "format": "binary"}})
    answer = {"description": description, "content": {"application/octet-stream": content}}
    return {200: {**answer, **({"headers": dict(headers)} if headers else {})}}


def binary_body(description: str) -> dict[str, Any]:
    """`openapi_extra` for a route whose request body is bytes (`application/octet-stream`)."""
    return {
        "requestBody": {
            "required": True,
            "description": description,
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        }
    }


def json_body(description: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """`openapi_extra` for a route that reads its JSON body itself (FastAPI does not see it)."""
    return {
        "requestBody": {
            "required": True,
            "description": description,
            "content": {"application/json": {"schema": schema or {"type": "object"}}},
        }
    }


# ---- the manifest (contracts/manifest.py), as `GET .../manifest` answers it ----------------------
# Documentation of the JSON the exporter wrote (the route returns it as stored); the device reads
# it with contracts.manifest.Manifest.from_json, which is the authority on what is valid.


class ManifestTensor(BaseModel):
    """A named tensor."""

    name: str
    shape: list[int] = Field(description="dense shape; [] is a scalar (0-D)")
    dtype: Literal["float32", "int32"]
    row_sparse: str | None = Field(
        None, description="the feature that indexes its rows: reports carry only the rows a task touched"
    )


class ManifestFeature(BaseModel):
    """One feature of an example."""

    name: str
    dtype: Literal["float32", "int32"]
    shape: list[int] = Field(description="per example; [] is a scalar")
    role: str = Field(description="'input' or 'label'")
    range: list[float] | None = Field(None, description="[low, high], inclusive", min_length=2, max_length=2)
    discrete: bool = False
    tables: list[str] = Field(default_factory=list, description="global tensors whose rows it indexes")


class ManifestMetric(BaseModel):
    """A metric `evaluate` sums over examples, reported as `<name>_sum`."""

    name: str
    range: list[float] | None = Field(
        None, description="bounds one example's value", min_length=2, max_length=2
    )


class ManifestModel(BaseModel):
    file: str = Field(description="always 'model.tflite'")
    sha256: str = Field(pattern=protocol.SHA256_PATTERN, description="the artifact's content address")
    bytes: int = Field(ge=0)


class ManifestTask(BaseModel):
    """What `infer` does; the other fields depend on `kind`."""

    kind: Literal["ranking", "classification", "regression"]
    top_k: int | None = None
    catalog_feature: str | None = None
    negative_sampling: bool | None = None
    popularity: str | None = None
    num_classes: int | None = None


class ManifestOut(BaseModel):
    """`manifest.json`, format 2: the contract between the exported model, the server and devices."""

    format_version: Literal[2]
    model: ManifestModel
    features: list[ManifestFeature]
    batch_size: int = Field(ge=1)
    max_batches: int = Field(ge=1)
    global_params: list[ManifestTensor] = Field(
        description="what the server aggregates: `/global` sends them, a report's delta covers them"
    )
    local_params: list[ManifestTensor] = Field(description="the device's own; never leave it")
    metrics: list[ManifestMetric]
    task: ManifestTask
    signatures: dict[str, dict[str, list[ManifestTensor]]] = Field(
        description="the TFLite signatures: name -> {'inputs': [...], 'outputs': [...]}"
    )
    training_defaults: dict[str, float] = Field(description="hyperparameters a task_config may override")
    config: dict[str, Any] = Field(default_factory=dict, description="the model's configuration, as exported")
    exported_with: dict[str, str] = Field(default_factory=dict, description="library versions")
    task_row_features: list[str] = Field(
        default_factory=list,
        description="row-sparse features whose task rows' catalog values the training signatures "
        "also take (`<feature>_task_rows`), for the model's per-row constants such as an item's topic",
    )


# ---- secure aggregation's messages (secure_aggregation/messages.py), as documentation ----------
# The routes parse these bodies with secure_aggregation's own decoders, which say what is wrong;
# base64 is standard base64 with padding; device indices are decimal strings as JSON keys.

Base64 = Annotated[str, Field(description="standard base64")]


class AdvertisedKeys(BaseModel):
    """Phase 1 (`POST .../secure/keys`): two X25519 public keys and a commitment to the self-mask seed."""

    model_config = ConfigDict(extra="forbid")

    encryption_key: Base64 = Field(description="X25519 public key (32 bytes) neighbours encrypt shares to")
    mask_key: Base64 = Field(description="X25519 public key (32 bytes) pairwise masks are agreed from")
    self_mask_commitment: Base64 = Field(description="32 bytes")


class DeviceCertificate(BaseModel):
    """The enrollment authority's Ed25519 signature on a device's signing key."""

    model_config = ConfigDict(extra="forbid")

    device_key: Base64 = Field(description="the device's Ed25519 public key (32 bytes)")
    not_after: int = Field(description="unix seconds after which the certificate is not valid")
    signature: Base64 = Field(description="the authority's Ed25519 signature (64 bytes)")


class SignedAdvertisement(BaseModel):
    """Phase 1 from a device with an identity: its keys, its certificate, and its signature over
    the round's context and the keys. The server relays it unchanged in the roster; devices check
    the certificate against the authority they trust."""

    model_config = ConfigDict(extra="forbid")

    keys: AdvertisedKeys
    certificate: DeviceCertificate
    signature: Base64 = Field(description="Ed25519 (64 bytes), by the certificate's key")


class EncryptedShares(BaseModel):
    """Phase 2: one neighbour's shares, encrypted to it (AES-GCM: nonce, ciphertext, tag), and
    commitments the server keeps to check the shares it is later given in the clear."""

    model_config = ConfigDict(extra="forbid")

    ciphertext: Base64
    self_mask_share_commitment: Base64 = Field(description="32 bytes")
    mask_key_share_commitment: Base64 = Field(description="32 bytes")


_INPUTS = (
    "SHA-256 of everything that shaped the update (secure_aggregation.view.TaskInputs, canonical JSON): "
    "artifact, task config, model version, globals and central data as downloaded, gradient weight, "
    "round parameters"
)


class PartnerStatement(BaseModel):
    """Before the masked input (`POST .../secure/partners`): the digest of what the device trained
    on and the neighbours it masked nothing with, signed over the round's context and roster
    digest (secure_aggregation.view)."""

    model_config = ConfigDict(extra="forbid")

    inputs_sha256: Base64 = Field(description=_INPUTS)
    missing: list[int] = Field(
        description="neighbours whose shares it does not hold (they did not share, or failed authentication)"
    )
    signature: Base64 | None = Field(description="Ed25519 by its certified key; null without an identity")


class SurvivorConfirmation(BaseModel):
    """The consistency check (`POST .../secure/consistency`): the digest of what the survivor
    trained on, and its signature over the round's context, the roster digest, the survivor set
    and that digest."""

    model_config = ConfigDict(extra="forbid")

    inputs_sha256: Base64 = Field(description=_INPUTS)
    signature: Base64 | None = Field(description="Ed25519 by its certified key; null without an identity")


class UnmaskingShares(BaseModel):
    """Phase 4 (`POST .../secure/unmasking`): a survivor's shares of its surviving neighbours'
    self-mask seeds and of its dropped neighbours' mask keys, by owner index."""

    model_config = ConfigDict(extra="forbid")

    self_mask_shares: dict[str, Base64]
    mask_key_shares: dict[str, Base64]


class SecureState(BaseModel):
    """`GET .../secure`: the round's phase and what this device needs in it."""

    assignment_status: str
    phase: Literal["advertise", "share_keys", "masked_input", "consistency", "unmasking", "done"]
    phase_deadline: float = Field(description="server time (unix seconds)")
    seconds_left: float
    round_status: str
    outcome: str | None
    parameters: dict[str, Any] = Field(description="secure_aggregation.config.RoundParameters")
    index: int | None = Field(description="this device's index once it advertised its keys")
    roster: dict[str, SignedAdvertisement | AdvertisedKeys] | None = Field(
        None,
        description="share_keys, until this device sent its shares: index -> the advertisement as sent",
    )
    ciphertexts: dict[str, Base64] | None = Field(
        None, description="masked_input, once this device sent its shares: sender index -> ciphertext"
    )
    survivors: list[int] | None = Field(
        None,
        description="consistency, unmasking: the survivors chosen among the masked inputs' senders "
        "(the set signed; their inputs are summed)",
    )
    confirmed: list[int] | None = Field(None, description="unmasking: the survivors that confirmed")
    confirmations: dict[str, SurvivorConfirmation] | None = Field(
        None, description="unmasking: the survivors' confirmations, by index"
    )
    statements: dict[str, PartnerStatement] | None = Field(
        None, description="unmasking: the survivors' partner statements, by index"
    )


_HELD_STATE = (
    "with `?until=<phase>`: the round's state once it reached that phase, as `GET .../secure` holds it"
)


class _HeldState(BaseModel):
    state: SecureState | None = Field(None, description=_HELD_STATE)


class Advertised(_HeldState):
    index: int = Field(description="this device's index in the round")


class Shared(_HeldState):
    shared_with: list[int]


class MaskedInputReceived(_HeldState):
    received_bytes: int


class UnmaskingAccepted(_HeldState):
    accepted: Literal[True]


class ConfirmationAccepted(_HeldState):
    accepted: Literal[True]


class StatementAccepted(_HeldState):
    accepted: Literal[True]


# Bodies the routes read themselves, added to the document's components (api/openapi.py).
REQUEST_BODIES: tuple[type[BaseModel], ...] = (
    EvaluationReport,
    AdvertisedKeys,
    SignedAdvertisement,
    EncryptedShares,
    PartnerStatement,
    SurvivorConfirmation,
    UnmaskingShares,
)
