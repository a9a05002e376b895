"""The device's side of the HTTP protocol (DESIGN.md, "Protocol").

Control messages are JSON; tensors are safetensors. What goes up: the example *count*, the
device's conditions, the delta of the global parameters (the rows it changed) with its
weight, and aggregate metrics. Never local parameters, never examples. Transport errors and 5xx answers are
retried with backoff (a 503's Retry-After at least), so a server that restarts or is slow does not lose the
device; a 429 (or a 503 whose window is longer than a request waits) is `RetryLater`: come back after
its window, not a refusal.

The device trusts nothing it is told: requests (and the bearer token) go only to the
orchestrator's own origin, every answer is bounded in size and checked field by field before
use, and the model cache is checked against its content address each time it is used. Whatever is
wrong surfaces as one of three errors: `ProtocolError` (the server refused, 4xx),
`InvalidAnswer` (the answer breaks the protocol) or `ServerUnavailable` (no answer); `RetryLater`
is the `ProtocolError` that carries the server's retry window.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import random
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from contracts.manifest import MANIFEST_FILE, MODEL_FILE
from contracts.params import Params, encode_sparse_delta
from contracts.protocol import (
    ID_PATTERN,
    MAX_WAIT_SECONDS,
    SHA256_PATTERN,
    Assignment,
    Enrolled,
    Rejection,
    ReportAccepted,
)
from contracts.task_config import TaskConfig
from device_runtime.model_cache import (
    cached_manifest,
    cached_model_intact,
    model_manifest,
    remember_intact,
    write_atomically,
)
from device_runtime.protocol_errors import InvalidAnswer, ProtocolError, RetryLater, ServerUnavailable
from device_runtime.server_answers import (
    MAX_ANSWER_BYTES,
    MAX_JSON_BYTES,
    detail,
    parsed,
    read_bounded,
    read_prefix,
    require_content_type,
    retry_after,
)

MAX_WAIT_IN_REQUEST_SECONDS = 60.0  # a longer 503 window ends the request: the device comes back later
# A held (long-polled) answer is asked for this much inside the request's read timeout, and at
# most the server's bound: fewer, longer holds are fewer requests for the device and the server.
HOLD_MARGIN_SECONDS = 5.0
ABORT_ATTEMPTS = 2  # the round's deadline covers an abort that never arrives; do not stall on it
_ID = re.compile(ID_PATTERN)
_SHA256 = re.compile(SHA256_PATTERN)
_URLS = tuple(f.name for f in dataclasses.fields(Assignment) if f.name.endswith("_url"))
_DEFAULT_PORTS = {"http": 80, "https": 443}


class OrchestratorClient:
    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        http: httpx.AsyncClient | None = None,
        attempts: int = 8,
        backoff_seconds: float = 0.25,
        timeout_seconds: float = 30.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.origin = _origin(httpx.URL(self.base_url))
        self.token = token
        self._http = http or httpx.AsyncClient(timeout=timeout_seconds)
        self._owns_http = http is None
        self.attempts = attempts
        self.backoff_seconds = backoff_seconds
        # The JSON answers' bytes as received: what a caller counts as downloaded (re-encoding an
        # answer to measure it cost a thousand simulated devices O(n^2) for a secure round's roster).
        self.received_json_bytes = 0

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    def url_of(self, path: str, what: str) -> str:
        """`path` (a path on the orchestrator, or a URL from its answers) as a URL on the
        orchestrator's own origin; an `InvalidAnswer` for anything else, so that no request, and
        so never the token, goes to another scheme, host or port."""
        candidate = f"{self.base_url}{path}" if path.startswith("/") and not path.startswith("//") else path
        try:
            url = httpx.URL(candidate)
        except (httpx.InvalidURL, TypeError) as e:
            raise InvalidAnswer(
                f"{what} {path!r} is not a URL ({e}); expected a path on the orchestrator"
            ) from None
        if _origin(url) != self.origin:
            raise InvalidAnswer(
                f"{what} {path!r} points at {_shown_origin(_origin(url))}, not at this device's "
                f"orchestrator {_shown_origin(self.origin)}; a device sends requests and its token "
                "only to its own orchestrator"
            )
        return str(url)

    async def _request(
        self,
        method: str,
        path: str,
        *,
        max_bytes: int = MAX_ANSWER_BYTES,
        attempts: int | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """The 2xx answer, read whole only if at most `max_bytes` long; a 429 raises `RetryLater`,
        other 4xx `ProtocolError`; transport errors and 5xx are retried, and then raise
        `ServerUnavailable`."""
        url = self.url_of(path, f"{method} target")
        headers = dict(kwargs.pop("headers", {}))
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        attempts = attempts or self.attempts
        last: str = ""
        for attempt in range(attempts):
            wait_at_least = 0.0  # a 503's Retry-After
            try:
                streamed, detail = await self._cancellable_exchange(method, url, headers, max_bytes, kwargs)
                status = streamed.status_code
                if 200 <= status < 300:
                    return streamed
            except httpx.TransportError as e:  # connection refused or reset, timeouts, broken framing
                last = f"{type(e).__name__}: {e}"
            except httpx.HTTPError as e:  # e.g. a body that does not decode as its Content-Encoding says
                raise InvalidAnswer(
                    f"{method} {url}: the answer is unreadable ({type(e).__name__}: {e})"
                ) from None
            else:
                if 300 <= status < 400:
                    raise InvalidAnswer(
                        f"{method} {url} answered {status} (a redirect to "
                        f"{streamed.headers.get('location', 'nowhere')!r}); the protocol has no redirects"
                    )
                window = retry_after(streamed.headers)
                if status == 429 or (status == 503 and (window or 0.0) > MAX_WAIT_IN_REQUEST_SECONDS):
                    raise RetryLater(status, detail, window if window is not None else self.backoff_seconds)
                if 400 <= status < 500:
                    raise ProtocolError(status, detail)
                last = f"{status}: {detail}"
                if status == 503:
                    wait_at_least = window or 0.0
            if attempt + 1 == attempts:
                break
            # Exponential backoff with jitter, so a restarting server is not hit by the whole fleet at
            # once; never sooner than a 503's Retry-After.
            backoff = self.backoff_seconds * (2 ** min(attempt, 6)) * (0.5 + random.random())
            await _wait_before_retry(max(backoff, wait_at_least), last)
        raise ServerUnavailable(f"{method} {url} failed after {attempts} attempts ({last})")

    async def _cancellable_exchange(
        self, method: str, url: str, headers: dict[str, str], max_bytes: int, kwargs: dict[str, Any]
    ) -> tuple[httpx.Response, str]:
        """`_exchange`; a cancel stops the caller at once but reaches the request only where
        httpcore can let go of it. httpcore 1.0.9 loses a connection for good when a request is
        cancelled after its pool gave it a new connection and before the request used it, e.g.
        while the pool closes the connection whose keep-alive expired (encode/httpcore#1093), or
        when a cancel lands in the clean-up of a connection: each such cancel takes a slot, and a
        device with one connection then waits out every request's pool timeout (a simulated
        phone's secure-round messages are cancelled when it leaves the round). So the request is
        cancelled once, while it connects or while it is sent and waits for its answer's headers
        (a long-poll: httpcore then closes the connection), else at its next such stretch, or
        left to finish on its own, as an answer being read does within moments."""
        safe, wanted = False, False

        async def trace(event: str, info: dict[str, Any]) -> None:
            nonlocal safe, wanted
            if event in _SAFE_FROM:
                safe = True
            elif event in _SAFE_UNTIL:
                safe = False
            if safe and wanted:
                wanted = False
                exchange.cancel()

        extensions = {**kwargs.pop("extensions", {}), "trace": trace}
        exchange = asyncio.ensure_future(
            self._exchange(method, url, headers, max_bytes, {**kwargs, "extensions": extensions})
        )
        try:
            return await asyncio.shield(exchange)
        except asyncio.CancelledError:
            if safe:
                exchange.cancel()
            else:
                wanted = True
            _CANCELLED.add(exchange)
            exchange.add_done_callback(_forget)
            raise

    async def _exchange(
        self, method: str, url: str, headers: dict[str, str], max_bytes: int, kwargs: dict[str, Any]
    ) -> tuple[httpx.Response, str]:
        """One request and its answer, closed: a 2xx read whole (at most `max_bytes`), else the
        answer's headers and the reason it gives."""
        async with self._http.stream(method, url, headers=headers, **kwargs) as streamed:
            status = streamed.status_code
            if 200 <= status < 300:
                content = await read_bounded(streamed, max_bytes, f"{method} {url}")
                # Decoded already: the copy must not claim an encoding or the wire length.
                kept = [(k, v) for k, v in streamed.headers.multi_items() if k.lower() not in _WIRE]
                return httpx.Response(status, headers=kept, content=content, request=streamed.request), ""
            return streamed, detail(streamed.headers, await read_prefix(streamed, 2_000))

    async def _json(self, method: str, path: str, what: str, **kwargs: Any) -> dict[str, Any]:
        """A JSON object answer (at most `MAX_JSON_BYTES`)."""
        response = await self._request(method, path, max_bytes=MAX_JSON_BYTES, **kwargs)
        require_content_type(response, "application/json", what)
        self.received_json_bytes += len(response.content)
        try:
            data = json.loads(response.content)
        except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, or nested beyond the parser
            raise InvalidAnswer(
                f"{what} is not JSON ({type(e).__name__}: {e}); expected a JSON object"
            ) from None
        if not isinstance(data, dict):
            raise InvalidAnswer(f"{what} is a JSON {type(data).__name__}; expected a JSON object")
        return data

    async def _binary(self, path: str, what: str, max_bytes: int = MAX_ANSWER_BYTES) -> bytes:
        response = await self._request("GET", path, max_bytes=max_bytes)
        require_content_type(response, "application/octet-stream", what)
        return response.content

    async def enroll(self) -> str:
        data = await self._json("POST", "/v1/devices", "the enrollment answer")
        enrolled = parsed(Enrolled, data, "the enrollment answer")
        self.token = enrolled.token
        return enrolled.device_id

    async def checkin(
        self,
        population: str,
        example_count: int,
        task: str = "training",
        conditions: Mapping[str, bool] | None = None,
    ) -> Assignment | Rejection:
        body = {"example_count": int(example_count), "task": task, "conditions": dict(conditions or {})}
        # As long as this client waits for an answer: a check-in that finds a secure round's roster
        # closed may then be held for the next round instead of refused.
        wait = self._wait()
        data = await self._json(
            "POST",
            f"/v1/populations/{population}/checkin",
            "the check-in answer",
            json=body,
            params=None if wait is None else {"wait": wait},
        )
        accepted = data.get("accepted")
        if accepted is True:
            return self._assignment(data)
        if accepted is False:
            return parsed(Rejection, data, "the check-in rejection")
        raise InvalidAnswer(
            f"the check-in answer has accepted={accepted!r}; expected true (an assignment) or false "
            "(a rejection)"
        )

    def _assignment(self, data: dict[str, Any]) -> Assignment:
        """An accepted check-in, every field checked; an `InvalidAnswer` names the assignment when
        its id is usable, so that it can be aborted."""
        given = data.get("assignment_id")
        held = given if isinstance(given, str) and _ID.fullmatch(given) else None
        try:
            assignment = parsed(Assignment, data, "the assignment")
            for name in _URLS:
                url = getattr(assignment, name)
                if url is not None:  # secure_url of a plaintext round
                    self.url_of(url, f"the assignment's {name}")
            try:
                TaskConfig.from_json(assignment.task_config)
            except ValueError as e:
                raise InvalidAnswer(f"the assignment's task_config is not usable: {e}") from None
            return assignment
        except InvalidAnswer as e:
            raise InvalidAnswer(e.message, assignment_id=held) from None

    async def model_dir(self, assignment: Assignment, cache_dir: Path) -> Path:
        """The assignment's model, from the cache when intact there, else downloaded."""
        return await self.fetch_model(
            assignment.artifact_sha256, assignment.artifact_url, assignment.manifest_url, cache_dir
        )

    async def fetch_model(self, sha256: str, artifact_url: str, manifest_url: str, cache_dir: Path) -> Path:
        """The model whose content address is `sha256`, with its manifest, in `cache_dir/sha256`.

        Every use checks the cached files against the address (the model's sha256, and the
        manifest's record of it): a corrupt or truncated file is deleted and downloaded again,
        never used. A download that does not match is refused and not cached. Files are written
        under a temporary name and renamed, so no reader ever sees half a file."""
        if not _SHA256.fullmatch(sha256):
            raise InvalidAnswer(f"model address {sha256!r}: expected 64 lowercase hexadecimal digits")
        target = Path(cache_dir) / sha256
        manifest = await asyncio.to_thread(cached_manifest, target / MANIFEST_FILE, sha256)
        if manifest is None:
            data = await self._json("GET", manifest_url, "the model's manifest")
            manifest = model_manifest(data, sha256)
            await asyncio.to_thread(write_atomically, target / MANIFEST_FILE, json.dumps(data).encode())
        if not await asyncio.to_thread(cached_model_intact, target / MODEL_FILE, sha256):
            blob = await self._binary(artifact_url, "the model", max_bytes=manifest.model_bytes)
            actual = hashlib.sha256(blob).hexdigest()
            if actual != sha256:
                raise InvalidAnswer(
                    f"the model from {artifact_url} has sha256 {actual[:12]}..., expected "
                    f"{sha256[:12]}... (its address); not cached"
                )
            await asyncio.to_thread(write_atomically, target / MODEL_FILE, blob)
            remember_intact(target / MODEL_FILE)
        return target

    async def population_model(self, population: str, sha256: str, cache_dir: Path) -> Path:
        """A population's model outside any assignment (e.g. to serve recommendations)."""
        return await self.fetch_model(
            sha256, f"/v1/artifacts/{sha256}", f"/v1/populations/{population}/manifest", cache_dir
        )

    async def task_config(self, population: str) -> TaskConfig:
        """The population's current task config: what to reconstruct with when serving outside a
        round, as training does."""
        data = await self._json("GET", f"/v1/populations/{population}/task-config", "the task config")
        try:
            return TaskConfig.from_json(data)
        except ValueError as e:
            raise InvalidAnswer(f"the population's task config is not usable: {e}") from None

    async def global_params_at(self, population: str, version: int) -> bytes:
        return await self._binary(
            f"/v1/populations/{population}/models/{int(version)}/global", "the global parameters"
        )

    async def global_params(self, assignment: Assignment) -> bytes:
        """The safetensors bytes; the task checks them against the manifest before use."""
        return await self._binary(assignment.params_url, "the global parameters")

    async def central_examples(self, assignment: Assignment, max_bytes: int) -> bytes:
        """Example transfer: the assignment's centralized examples (safetensors), at most `max_bytes`."""
        if assignment.central_examples_url is None:
            raise InvalidAnswer("the assignment carries no central_examples_url")
        return await self._binary(
            assignment.central_examples_url, "the centralized examples", max_bytes=max_bytes
        )

    async def central_gradient(self, assignment: Assignment, max_bytes: int) -> bytes:
        """Gradient transfer: the assignment's central gradient (sparse safetensors), at most `max_bytes`."""
        if assignment.central_gradient_url is None:
            raise InvalidAnswer("the assignment carries no central_gradient_url")
        return await self._binary(
            assignment.central_gradient_url, "the central gradient", max_bytes=max_bytes
        )

    async def report_training(
        self, assignment: Assignment, delta: Params, num_examples: int, metrics: Mapping[str, float]
    ) -> ReportAccepted:
        # Sparse: the rows the task changed (~150 of thousands), not the dense tensors, so an upload
        # is ~20x smaller and the server validates and stores it without scanning the whole model.
        body = encode_sparse_delta(
            delta, {"num_examples": str(int(num_examples)), "metrics": json.dumps(dict(metrics))}
        )
        data = await self._json(
            "POST",
            assignment.report_url,
            "the report answer",
            content=body,
            headers={"Content-Type": "application/octet-stream"},
        )
        return parsed(ReportAccepted, data, "the report answer")

    async def report_evaluation(
        self, assignment: Assignment, num_examples: int, metrics: Mapping[str, float]
    ) -> ReportAccepted:
        body = {"num_examples": int(num_examples), "metrics": dict(metrics)}
        data = await self._json("POST", assignment.report_url, "the report answer", json=body)
        return parsed(ReportAccepted, data, "the report answer")

    async def abort(self, assignment: Assignment) -> None:
        await self._request("POST", assignment.abort_url, max_bytes=MAX_JSON_BYTES, attempts=ABORT_ATTEMPTS)

    async def abort_assignment(self, assignment_id: str) -> None:
        """Abort by id on the orchestrator's own abort route: for an assignment whose answer was
        unusable (its own abort URL included)."""
        if not _ID.fullmatch(assignment_id):
            raise InvalidAnswer(f"assignment id {assignment_id!r}: expected {_ID.pattern}")
        await self._request(
            "POST",
            f"/v1/assignments/{assignment_id}/abort",
            max_bytes=MAX_JSON_BYTES,
            attempts=ABORT_ATTEMPTS,
        )

    # ---- secure aggregation: one message per phase (secure_aggregation package) ----

    def _secure_url(self, assignment: Assignment) -> str:
        if assignment.secure_url is None:
            raise ProtocolError(200, "this assignment's round does not use secure aggregation")
        return assignment.secure_url

    async def secure_state(self, assignment: Assignment, until: str | None = None) -> dict[str, Any]:
        """The secure round's phase and what this device needs for it; with `until`, the server
        holds the answer (for some seconds at most) until the round reaches that phase or a later one."""
        return await self._json(
            "GET", self._secure_url(assignment), "the secure round's state", params=self._hold(until)
        )

    def _hold(self, until: str | None) -> dict[str, str] | None:
        """The query that asks the server to hold an answer until `until`, as long as this client's
        read timeout allows (the server's default hold when it has none)."""
        if until is None:
            return None
        wait = self._wait()
        return {"until": until} if wait is None else {"until": until, "wait": wait}

    def _wait(self) -> str | None:
        """How long the server may hold an answer, inside this client's read timeout (None: too
        short a timeout to say; the server's default hold)."""
        read = self._http.timeout.read
        if read is None or read <= HOLD_MARGIN_SECONDS + 1:
            return None
        return f"{min(MAX_WAIT_SECONDS, read - HOLD_MARGIN_SECONDS):g}"

    async def secure_message(
        self, assignment: Assignment, phase: str, body: Any, until: str | None = None
    ) -> dict[str, Any]:
        """A JSON message of the `keys`, `shares`, `consistency` or `unmasking` phase; with `until`,
        the answer also holds the round's `state` once it reached that phase (as `secure_state`)."""
        return await self._json(
            "POST",
            f"{self._secure_url(assignment)}/{phase}",
            f"the answer to the {phase} message",
            json=body,
            params=self._hold(until),
        )

    async def secure_masked_input(
        self, assignment: Assignment, body: bytes, until: str | None = None
    ) -> dict[str, Any]:
        return await self._json(
            "POST",
            f"{self._secure_url(assignment)}/masked-input",
            "the answer to the masked input",
            content=body,
            headers={"Content-Type": "application/octet-stream"},
            params=self._hold(until),
        )


_WIRE = {"content-encoding", "content-length", "transfer-encoding"}


# httpcore's trace events that open and close the stretches where a cancel is safe (see
# `_cancellable_exchange`): connecting, and sending the request until its answer's headers are in.
# A transport of another make reports the same events for the same stretches (the fleet's does).
# In between (the new connection made, the request not yet started on it) a cancel loses the
# connection too.
_SAFE_FROM = frozenset({"connection.connect_tcp.started", "http11.send_request_headers.started"})
_SAFE_UNTIL = frozenset(
    {
        "connection.connect_tcp.complete",
        "connection.connect_tcp.failed",
        "http11.receive_response_headers.complete",
        "http11.receive_response_headers.failed",
    }
)
# Exchanges whose callers were cancelled, until they end (see `_cancellable_exchange`): the event
# loop keeps only weak references to tasks.
_CANCELLED: set[asyncio.Future[Any]] = set()


def _forget(exchange: asyncio.Future[Any]) -> None:
    _CANCELLED.discard(exchange)
    if not exchange.cancelled():
        exchange.exception()  # its answer (or failure) is not wanted: retrieved so it is not reported


async def _wait_before_retry(seconds: float, reason: str) -> None:
    """The pause before a request is tried again after `reason` (kept apart so that tests can see
    the device's retries)."""
    await asyncio.sleep(seconds)


def _origin(url: httpx.URL) -> tuple[str, str, int | None]:
    return url.scheme, url.host, url.port or _DEFAULT_PORTS.get(url.scheme)


def _shown_origin(origin: tuple[str, str, int | None]) -> str:
    scheme, host, port = origin
    return f"{scheme}://{host}:{port}"
