"""What can go wrong between a device and its orchestrator, as the device sees it: the server
refused (`ProtocolError`, and `RetryLater` when it gave a window), it broke the protocol
(`InvalidAnswer`), or it did not answer (`ServerUnavailable`)."""

from __future__ import annotations


class ProtocolError(RuntimeError):
    """The server refused a request (4xx); `status` and the server's reason are kept."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class RetryLater(ProtocolError):
    """The server asked the device to come back after `retry_after_seconds` (429, or a 503 with a
    window too long to wait inside one request): not a refusal of the device or its request."""

    def __init__(self, status: int, message: str, retry_after_seconds: float) -> None:
        super().__init__(status, message)
        self.retry_after_seconds = retry_after_seconds


class ServerUnavailable(RuntimeError):
    """No answer after all retries."""


class InvalidAnswer(RuntimeError):
    """The server's answer breaks the protocol; the message says what was wrong and what was expected.

    `assignment_id` is the assignment a malformed check-in answer named, when it named one in a
    usable form, so that the device can still abort it on its own orchestrator."""

    def __init__(self, message: str, *, assignment_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.assignment_id = assignment_id
