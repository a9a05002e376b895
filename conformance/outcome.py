"""One check's outcome, and the helpers every check uses to call a port and compare."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from conformance.port import Refused


@dataclass(frozen=True)
class Outcome:
    name: str
    problem: str | None  # None: passed

    @property
    def passed(self) -> bool:
        return self.problem is None


def run(name: str, check: Callable[..., str | None], *args: Any) -> Outcome:
    """`check(*args)`'s problem, or the port's refusal or error as one; a port that crashes fails the
    check (it does not stop the run)."""
    try:
        return Outcome(name, check(*args))
    except Refused as refusal:
        return Outcome(name, f"the port refused ({refusal}) where the kit expects an answer")
    except Exception as error:  # a broken port must fail this check only, whatever it raises
        return Outcome(name, f"the port raised {type(error).__name__}: {error}")


def refused(name: str, kind: str, call: Callable[..., Any], *args: Any) -> Outcome:
    """Passes when `call` raises Refused(kind)."""
    try:
        call(*args)
    except Refused as refusal:
        if refusal.kind != kind:
            return Outcome(name, f"refused as {refusal.kind!r}, expected {kind!r} ({refusal})")
        return Outcome(name, None)
    except Exception as error:
        return Outcome(name, f"expected a {kind!r} refusal, the port raised {type(error).__name__}: {error}")
    return Outcome(name, f"accepted; a port must refuse it as {kind!r}")


def differs(what: str, got: Any, expected: Any) -> str | None:
    return None if got == expected else f"{what}: got {got!r}, expected {expected!r}"
