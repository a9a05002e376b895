"""Run every check of the kit against a port and report what failed."""

from __future__ import annotations

from pathlib import Path

from conformance import check_secure, check_task, check_wire
from conformance.outcome import Outcome
from conformance.port import Port
from conformance.vectors import VECTORS


def run_kit(port: Port, root: Path = VECTORS) -> list[Outcome]:
    return check_wire.checks(port, root) + check_task.checks(port, root) + check_secure.checks(port, root)


def failures(outcomes: list[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if not o.passed]
