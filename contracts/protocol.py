"""The JSON messages of the HTTP protocol (DESIGN.md, "Protocol"), declared once for both sides.

Each message is a frozen dataclass whose fields declare their bounds and descriptions as
`Annotated[type, Spec(...)]`. The device reads every answer through `parse`, which checks each
field against its declaration, so that a hostile server gets nothing past it; the server derives
its pydantic models, and with them its request validation and its OpenAPI description, from the
same dataclasses (orchestrator/api/schemas.py). Tensors never travel as JSON (see the parameter
wire format).

Beyond what a field declares: every integer is a 64-bit integer, every number is finite, and
every string is bounded (by its pattern, its max_length, or else MAX_TEXT).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

# Counts a device or an admin may state (examples, reports, versions): well inside the
# database's signed 64-bit integers and exact as float64.
MAX_COUNT = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_TEXT = 2_000  # a string that declares no other bound (a reason, a URL)
MAX_RETRY_AFTER_SECONDS = 30 * 86_400.0
# The longest `wait` a request may ask to be held for (a check-in, a secure round's state or message).
MAX_WAIT_SECONDS = 120.0
MAX_CONDITIONS = 32  # training conditions a device states (idle, charging, unmetered, ...)
MAX_CONDITION_NAME = 64
ID_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"  # ids go into URL paths: nothing that could change one
SHA256_PATTERN = r"^[0-9a-f]{64}$"  # names a cache directory: nothing that could leave it
TOKEN_PATTERN = r"^[\x21-\x7e]{1,4096}$"  # goes into a header


@dataclass(frozen=True)
class Spec:
    """A field's description and bounds: `ge`/`le` for numbers, `pattern` (matched whole) or
    `max_length` for strings, `max_length` (entries) for objects and arrays."""

    description: str = ""
    ge: float | None = None
    le: float | None = None
    pattern: str | None = None
    max_length: int | None = None


class InvalidMessage(ValueError):
    """A message that breaks its declaration; says which field, what it held and what was expected."""


TaskKind = Literal["training", "evaluation"]
# A round's kind: a task's, or a buffered secure population's cohort (its devices train in it).
RoundKind = Literal["training", "evaluation", "cohort"]
Aggregation = Literal["plaintext", "secure"]
Id = Annotated[str, Spec(pattern=ID_PATTERN)]
NonNegative = Annotated[int, Spec(ge=0)]
# Every URL an assignment carries is a path on the orchestrator ("/v1/..."), appended to the base URL
# the device checked in at (with any path prefix a proxy adds): the server need not know its public name.
SERVER_PATH = "a path on this orchestrator ('/v1/...'), appended to the base URL the device checked in at"
ServerPath = Annotated[str, Spec(SERVER_PATH)]


@dataclass(frozen=True)
class Enrolled:
    """A new device's identity: the answer to an enrolment."""

    device_id: Id
    token: Annotated[str, Spec("send as 'Authorization: Bearer <token>'; shown once", pattern=TOKEN_PATTERN)]


@dataclass(frozen=True)
class CheckIn:
    """A device asks for a task: how many examples it holds, never the examples."""

    example_count: Annotated[int, Spec("how many examples the device holds", ge=0, le=MAX_COUNT)]
    task: TaskKind = "training"
    conditions: Annotated[
        dict[Annotated[str, Spec(max_length=MAX_CONDITION_NAME)], bool],
        Spec(f"e.g. idle, charging, unmetered (at most {MAX_CONDITIONS})", max_length=MAX_CONDITIONS),
    ] = field(default_factory=dict)


@dataclass(frozen=True)
class Assignment:
    """An accepted check-in: the task, where its model is, and where to report."""

    assignment_id: Id
    round_id: NonNegative
    kind: TaskKind
    deadline: Annotated[float, Spec("server time (unix seconds) by which to report")]
    seconds_left: float
    model_version: NonNegative
    artifact_sha256: Annotated[str, Spec("the model's content address", pattern=SHA256_PATTERN)]
    artifact_url: Annotated[str, Spec(f"the model file (no token needed); {SERVER_PATH}")]
    params_url: Annotated[str, Spec(f"the round's global parameters (safetensors); {SERVER_PATH}")]
    manifest_url: ServerPath
    report_url: Annotated[str, Spec(f"where the result goes (plaintext rounds); {SERVER_PATH}")]
    abort_url: ServerPath
    task_config: dict[str, Any]
    aggregation: Annotated[
        Aggregation, Spec("secure: take part through secure_url's phases instead of report_url")
    ] = "plaintext"
    secure_url: Annotated[str | None, Spec(f"secure: the root of the round's four phases; {SERVER_PATH}")] = (
        None
    )
    secure_parameters: Annotated[
        dict[str, Any] | None,
        Spec(
            "secure: the round's parameters (secure_aggregation.config.RoundParameters), so that the "
            "device advertises its keys without first asking for the round's state"
        ),
    ] = None
    central_examples_url: Annotated[
        str | None,
        Spec(
            "example transfer (contracts.mixing): centralized examples (safetensors) to mix into the "
            "update steps; not the device's, not counted in its weight; a path on this orchestrator"
        ),
    ] = None
    central_gradient_url: Annotated[
        str | None,
        Spec(
            "gradient transfer (contracts.mixing): the centralized loss's gradient at this round's "
            "globals (sparse safetensors), added times central_gradient_weight to each update step; a path "
            "on this orchestrator"
        ),
    ] = None
    central_gradient_weight: Annotated[
        float | None,
        Spec("gradient transfer: the central gradient's weight (contracts.mixing)", ge=0.0, le=100.0),
    ] = None
    accepted: Literal[True] = True

    def __post_init__(self) -> None:
        if self.aggregation == "secure" and self.secure_url is None:
            raise InvalidMessage(
                "secure_url is None; expected a URL on the orchestrator's origin when aggregation is 'secure'"
            )
        if self.aggregation != "secure" and self.secure_parameters is not None:
            raise InvalidMessage("secure_parameters come only with aggregation 'secure'")
        if (self.central_gradient_url is None) != (self.central_gradient_weight is None):
            raise InvalidMessage(
                "central_gradient_url and central_gradient_weight come together (gradient transfer); "
                f"got {self.central_gradient_url!r} and {self.central_gradient_weight!r}"
            )


@dataclass(frozen=True)
class Rejection:
    """A check-in that gets no task now, why, and when to come back: answered 200 with this body
    and a `Retry-After` header (seconds), whatever the reason (no round open, the round full,
    this device already took part, too few examples, a secure round's roster closed). Once a
    population's DP privacy budget is spent, a training check-in gets this too, with the
    budget's message and `Retry-After: 86400` (the budget never comes back; not a 409)."""

    reason: str
    retry_after_seconds: Annotated[float, Spec(ge=0.0, le=MAX_RETRY_AFTER_SECONDS)]
    accepted: Literal[False] = False


@dataclass(frozen=True)
class ReportAccepted:
    """A report (or an abort) taken, and where its round stands."""

    round_id: NonNegative
    round_status: str
    reported: NonNegative
    target: NonNegative


@dataclass(frozen=True)
class RoundView:
    """A round as the admin API shows it."""

    id: NonNegative
    kind: RoundKind
    status: str
    base_version: NonNegative
    result_version: NonNegative | None
    target: NonNegative
    capacity: NonNegative
    min_reports: NonNegative
    opened_at: float
    deadline: float
    closed_at: float | None
    counters: dict[str, int]
    total_weight: float
    metrics: dict[str, float]
    close_reason: Annotated[str, Spec("why it closed; empty while open")] = ""
    stopped_phase: Annotated[
        str | None, Spec("a round that did not commit: the phase it stopped in (reporting, or secure)")
    ] = None
    devices_had: Annotated[NonNegative | None, Spec("devices that answered in that phase")] = None
    devices_needed: Annotated[NonNegative | None, Spec("devices it needed there")] = None
    ended_by: Annotated[
        str | None, Spec("a round that did not commit: deadline, dropouts, refusals or failed_check")
    ] = None
    checkin_window: Annotated[
        float | None,
        Spec("pace steering: a device turned away as the round is full comes back within this many seconds"),
    ] = None


@dataclass(frozen=True)
class PrivacyView:
    """A DP population's privacy spent so far (Renyi DP accounting: Poisson-sampled Gaussian rounds,
    or in buffered rounds one Gaussian release per buffer a device is in, up to max_participations)."""

    epsilon: Annotated[
        float | None, Spec("at delta after the committed rounds; null: no noise, no guarantee")
    ]
    delta: float
    sampling_rate: Annotated[
        float, Spec("target_reports / population_size; 1 in buffered rounds (nothing is sampled)")
    ]
    training_rounds: NonNegative
    epsilon_budget: float | None
    rounds_within_budget: NonNegative | None
    budget_spent: Annotated[bool, Spec("true: no more training rounds are opened or committed")]
    message: str


@dataclass(frozen=True)
class ModelVersionView:
    """A model version the server keeps (older ones are pruned past `keep_model_versions`)."""

    version: NonNegative
    round_id: Annotated[NonNegative | None, Spec("the training round that committed it; null: the export")]
    created_at: float


@dataclass(frozen=True)
class DevicesSeenView:
    """The devices that took part in a population's rounds (had an assignment): counts only."""

    total: Annotated[NonNegative, Spec("devices assigned to at least one of its rounds")] = 0
    last_day: Annotated[NonNegative, Spec("of them, devices assigned in the last 24 hours")] = 0
    last_seen_at: Annotated[float | None, Spec("the latest assignment's time; null: none yet")] = None


@dataclass(frozen=True)
class BufferView:
    """A buffered population's training (`rounds: buffered`): its open buffer, how stale the
    reports counted lately were, how many finished participations counted, versions per hour."""

    buffer_size: Annotated[NonNegative, Spec("reports a buffer commits at (buffered.buffer_size)")] = 0
    open_round_id: Annotated[int | None, Spec("the open buffer's round; null: none open")] = None
    open_reports: Annotated[NonNegative, Spec("reports in the open buffer")] = 0
    open_since: Annotated[float | None, Spec("when the open buffer opened; null: none open")] = None
    window_versions: Annotated[
        NonNegative, Spec("committed buffers the window covers (the newest, with the open one)")
    ] = 0
    window_start: Annotated[float | None, Spec("the oldest buffer of the window's opening")] = None
    staleness_counts: Annotated[
        list[NonNegative], Spec("item s: reports counted into the window's buffers s versions stale")
    ] = field(default_factory=list)
    counted: Annotated[NonNegative, Spec("participations finished in the window that counted")] = 0
    refused_stale: Annotated[
        NonNegative, Spec("finished in the window: refused as too stale (dropped before their deadline)")
    ] = 0
    expired: Annotated[NonNegative, Spec("finished in the window: dropped at their own deadline")] = 0
    invalid: Annotated[NonNegative, Spec("finished in the window: refused as invalid or aborted")] = 0
    hours_start: Annotated[float | None, Spec("the start of versions_per_hour's first hour (UTC)")] = None
    versions_per_hour: Annotated[
        list[NonNegative], Spec("versions committed in each hour of the last 24, oldest first")
    ] = field(default_factory=list)


@dataclass(frozen=True)
class PopulationView:
    """A population as the admin API shows it: its model, settings, open rounds and privacy."""

    name: str
    current_version: NonNegative
    training_rounds_committed: NonNegative
    artifact_sha256: Annotated[str, Spec(pattern=SHA256_PATTERN)]
    settings: dict[str, Any]
    open_rounds: list[RoundView]
    privacy: Annotated[PrivacyView | None, Spec("only for populations with differential_privacy")] = None
    recent_rounds: Annotated[
        list[RoundView], Spec("the last closed rounds, newest first, with why each closed")
    ] = field(default_factory=list)
    idle_rounds: Annotated[
        NonNegative, Spec("training rounds in a row that closed without a device checking in")
    ] = 0
    next_round_at: Annotated[
        float | None,
        Spec("backing off: no training round opens before this time unless a device checks in"),
    ] = None
    backing_off: Annotated[str, Spec("why no training round is open, when backing off; else empty")] = ""
    paused_at: Annotated[float | None, Spec("paused since (no new rounds open); null: running")] = None
    settings_version: Annotated[NonNegative, Spec("moved by each change of the settings")] = 0
    archived_at: Annotated[float | None, Spec("archived since (paused for good); null: not archived")] = None
    devices_seen: Annotated[DevicesSeenView, Spec("the devices that took part in its rounds")] = field(
        default_factory=DevicesSeenView
    )
    model_versions: Annotated[list[ModelVersionView], Spec("the model versions kept, newest first")] = field(
        default_factory=list
    )
    buffer: Annotated[BufferView | None, Spec("only for populations with rounds: buffered")] = None


# ---- reading a message -------------------------------------------------------------------------

M = TypeVar("M")
Reader = Callable[[Any, str, str], Any]  # (a JSON value, what is read, the field's path) -> the value


def parse(message: type[M], data: object, what: str) -> M:
    """`data` (parsed JSON) as a `message`, each field checked against its declaration; extra and
    missing fields are refused, fields with a default may be left out. An `InvalidMessage` names
    `what` was read, the field, what it held and what was expected."""
    return typing.cast(M, _message_reader(typing.cast(type, message))(data, what, ""))


@functools.cache
def field_types(message: type) -> dict[str, Any]:
    """The annotation of each field of a message dataclass, with its `Annotated` metadata."""
    return typing.get_type_hints(message, include_extras=True)


@functools.cache
def declared(annotation: Any) -> tuple[Any, Spec, bool]:
    """An annotation as (the type it declares, its bounds, whether null is allowed): `Annotated`
    and `| None` taken apart, the Specs merged (the outer one wins), and a string without
    another bound bounded by MAX_TEXT."""
    specs: list[Spec] = []
    nullable = False
    while True:
        if typing.get_origin(annotation) is Annotated:
            annotation, *metadata = typing.get_args(annotation)
            specs[:0] = [m for m in metadata if isinstance(m, Spec)]
        elif typing.get_origin(annotation) in (typing.Union, types.UnionType):
            rest = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(rest) != 1 or len(rest) == len(typing.get_args(annotation)):
                raise TypeError(f"a message field is one type or null, not {annotation!r}")
            annotation, nullable = rest[0], True
        else:
            break
    spec = Spec()
    for inner in specs:  # innermost first: the outer declaration refines it
        given = {f.name: getattr(inner, f.name) for f in dataclasses.fields(inner)}
        spec = dataclasses.replace(spec, **{k: v for k, v in given.items() if v not in (None, "")})
    if annotation is str and spec.pattern is None and spec.max_length is None:
        spec = dataclasses.replace(spec, max_length=MAX_TEXT)
    return annotation, spec, nullable


@functools.cache
def _message_reader(message: type) -> Reader:
    """The reader of a message dataclass, built once from its declaration."""
    fields = dataclasses.fields(message)
    optional = {f.name for f in fields if (f.default, f.default_factory) != (dataclasses.MISSING,) * 2}
    required = {f.name for f in fields} - optional
    also = f", and optionally {sorted(optional)}" if optional else ""
    expected = f"expected exactly {sorted(required)}{also}"
    readers = [(name, _reader(annotation)) for name, annotation in field_types(message).items()]

    def read(value: Any, what: str, path: str) -> Any:
        where = f"{what}'s {path}" if path else what
        if not isinstance(value, dict):
            raise InvalidMessage(f"{where} is {_json_type(value)}; expected a JSON object")
        missing, extra = required - value.keys(), value.keys() - required - optional
        if missing or extra:
            raise InvalidMessage(
                f"{where} lacks fields {sorted(missing)} and has unexpected fields "
                f"{sorted(map(str, extra))}; {expected}"
            )
        values = {
            name: reader(value[name], what, f"{path}.{name}" if path else name)
            for name, reader in readers
            if name in value
        }
        try:
            return message(**values)
        except InvalidMessage as e:  # a rule across fields (__post_init__)
            raise InvalidMessage(f"{where}: {e}") from None

    return read


def _reader(annotation: Any) -> Reader:
    kind, spec, nullable = declared(annotation)
    read = _kind_reader(kind, spec)
    if not nullable:
        return read
    return lambda value, what, path: None if value is None else read(value, what, path)


def _kind_reader(kind: Any, spec: Spec) -> Reader:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is Any:  # a free-form JSON value (population settings, a task config)
        return lambda value, what, path: value
    if dataclasses.is_dataclass(kind):
        return _message_reader(typing.cast(type, kind))
    if kind is bool:
        return _checked(lambda v: isinstance(v, bool), "true or false")
    if kind is int:
        return _integer_reader(spec)
    if kind is float:
        return _number_reader(spec)
    if kind is str:
        return _text_reader(spec)
    if origin is Literal:
        expected = " or ".join(_literal(a) for a in args)
        return _checked(lambda v: any(type(v) is type(a) and v == a for a in args), expected)
    if origin in (dict, list):
        limit = spec.max_length
        container = "a JSON object" if origin is dict else "a JSON array"
        unit = "entries" if origin is dict else "items"
        check = _checked(
            lambda v: isinstance(v, origin) and (limit is None or len(v) <= limit),
            container if limit is None else f"{container} of at most {limit} {unit}",
        )
        if origin is list:
            items = _reader(args[0])
            return lambda value, what, path: [
                items(v, what, f"{path}[{i}]") for i, v in enumerate(check(value, what, path))
            ]
        keys, values = _reader(args[0]), _reader(args[1])
        return lambda value, what, path: {
            keys(k, what, f"a key of {path}"): values(v, what, f"{path}[{k!r}]")
            for k, v in check(value, what, path).items()
        }
    raise TypeError(f"no JSON reading for {kind!r}")


def _checked(ok: Callable[[Any], bool], expected: str) -> Reader:
    """A reader that passes a value on as it is when `ok(value)`."""

    def read(value: Any, what: str, path: str) -> Any:
        if not ok(value):
            raise InvalidMessage(f"{what}: {path} is {_shown(value)}; expected {expected}")
        return value

    return read


def _integer_reader(spec: Spec) -> Reader:
    low, high = spec.ge, spec.le
    is_integer = _checked(
        lambda v: isinstance(v, int) and not isinstance(v, bool) and -INT64_MAX <= v <= INT64_MAX,
        "a 64-bit integer",
    )
    if low is None and high is None:
        return lambda value, what, path: int(is_integer(value, what, path))
    if low is not None and high is not None:
        expected = f"an integer in [{low:.0f}, {high:.0f}]"
    else:
        expected = f"an integer >= {low:.0f}" if low is not None else f"an integer <= {high:.0f}"
    in_range = _checked(lambda v: (low is None or v >= low) and (high is None or v <= high), expected)
    return lambda value, what, path: int(in_range(is_integer(value, what, path), what, path))


def _number_reader(spec: Spec) -> Reader:
    low, high = spec.ge, spec.le
    if low is not None and high is not None:
        expected = f"a finite number in [{low:g}, {high:g}]"
    elif low is not None or high is not None:
        expected = f"a finite number >= {low:g}" if low is not None else f"a finite number <= {high:g}"
    else:
        expected = "a finite number"
    check = _checked(
        lambda v: (
            isinstance(v, int | float)
            and not isinstance(v, bool)
            and -INT64_MAX <= v <= INT64_MAX  # an int beyond this is no float either
            and math.isfinite(v)
            and (low is None or v >= low)
            and (high is None or v <= high)
        ),
        expected,
    )
    return lambda value, what, path: float(check(value, what, path))


def _text_reader(spec: Spec) -> Reader:
    if spec.pattern is not None:
        matches = re.compile(spec.pattern).fullmatch
        return _checked(
            lambda v: isinstance(v, str) and matches(v) is not None, f"a string matching {spec.pattern}"
        )
    limit = spec.max_length
    return _checked(
        lambda v: isinstance(v, str) and (limit is None or len(v) <= limit),
        f"a string of at most {limit} characters",
    )


def _literal(value: object) -> str:
    return repr(value) if isinstance(value, str) else "null" if value is None else str(value).lower()


def _json_type(value: Any) -> str:
    return "null" if value is None else f"a JSON {type(value).__name__}"


def _shown(value: Any) -> str:
    """A value from a message for an error message, cut short."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
