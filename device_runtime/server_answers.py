"""Reading a server's answer as a device must: bounded in size before it is read, of the content
type the protocol says, parsed field by field into the protocol's messages; and an error answer's
reason and retry window, bounded too. Anything else is an `InvalidAnswer` that says what was wrong."""

from __future__ import annotations

import json
import math
from typing import Any, TypeVar

import httpx

from contracts.protocol import MAX_RETRY_AFTER_SECONDS, InvalidMessage, parse
from device_runtime.protocol_errors import InvalidAnswer

M = TypeVar("M")

MAX_JSON_BYTES = 1 << 20  # a control message; the largest real one (a manifest) is a few KB
MAX_ANSWER_BYTES = 256 << 20  # any other answer: a bound against an endless stream


def parsed(message: type[M], data: dict[str, Any], what: str) -> M:
    """`data` read as the protocol's `message`, or an `InvalidAnswer` that says what was wrong."""
    try:
        return parse(message, data, what)
    except InvalidMessage as e:
        raise InvalidAnswer(str(e)) from None


async def read_bounded(response: httpx.Response, max_bytes: int, what: str) -> bytes:
    """The whole body, refused as soon as it is known to exceed `max_bytes` (before reading it
    when the server declares its length)."""
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise InvalidAnswer(f"{what}: the answer declares {declared} bytes; expected at most {max_bytes}")
    chunks, size = [], 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > max_bytes:
            raise InvalidAnswer(f"{what}: the answer is longer than {max_bytes} bytes, the most expected")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_prefix(response: httpx.Response, max_bytes: int) -> bytes:
    """The start of an error answer: enough for its reason, never the whole of a huge one."""
    chunks, size = [], 0
    async for chunk in response.aiter_bytes():
        chunks.append(chunk)
        size += len(chunk)
        if size >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


def retry_after(headers: httpx.Headers) -> float | None:
    """A Retry-After in seconds, bounded; None when absent or not a number of seconds."""
    try:
        seconds = float(headers.get("retry-after", ""))
    except ValueError:
        return None
    return min(seconds, MAX_RETRY_AFTER_SECONDS) if math.isfinite(seconds) and seconds >= 0 else None


def detail(headers: httpx.Headers, body: bytes) -> str:
    """The reason of an error answer: FastAPI's `detail`, else the start of the body."""
    if headers.get("content-type", "").startswith("application/json"):
        try:
            detail = json.loads(body).get("detail")
        except (ValueError, RecursionError, AttributeError):
            detail = None
        if detail:
            return str(detail)[:2_000]
    return body[:200].decode("utf-8", errors="replace")


def require_content_type(response: httpx.Response, expected: str, what: str) -> None:
    found = response.headers.get("content-type", "")
    if found.split(";")[0].strip().lower() != expected:
        raise InvalidAnswer(f"{what} came as Content-Type {found!r}; expected {expected}")
