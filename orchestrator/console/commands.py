"""The admin commands, each declared once: the route it calls (`console.routes`: method, path, the
contract view it answers with, its query and body), its command-line arguments and how its answer
reads. The
console's parser, its client calls and its output come from these declarations (`console.cli`),
`android_sim.admin` calls the same routes, and tests/orchestrator/test_admin_commands.py checks
them against the server's routes (orchestrator/api/routes/admin.py), both ways.

Only the standard library and the contracts here: the console runs without the server's parts."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.console import render
from orchestrator.console.routes import (
    ARCHIVE,
    CHANGE_SETTINGS,
    EVALUATE,
    PAUSE,
    POPULATION,
    POPULATIONS,
    RESUME,
    ROUNDS,
    SETTINGS_CHANGES,
    AdminRoute,
)

if TYPE_CHECKING:
    from orchestrator.console.client import AdminClient


@dataclass(frozen=True)
class Argument:
    """One `add_argument` of a command, as argparse takes it."""

    flags: tuple[str, ...]
    options: Mapping[str, Any] = field(default_factory=dict)


def arg(*flags: str, **options: Any) -> Argument:
    return Argument(flags, options)


Call = Callable[["AdminClient", argparse.Namespace], Any]
Render = Callable[[Any, argparse.Namespace, float], str]


@dataclass(frozen=True)
class Command:
    """A console command: `python -m orchestrator NAME ARGUMENTS...` calls `route` (by default with
    the population in the `name` argument; `call` when it asks more) and prints `render`'s text of
    the answer, or the answer as JSON with --json."""

    name: str
    help: str
    arguments: tuple[Argument, ...]
    route: AdminRoute | None
    render: Render
    call: Call | None = None

    def answer(self, client: AdminClient, args: argparse.Namespace) -> Any:
        if self.call is not None:
            return self.call(client, args)
        assert self.route is not None  # a command without a route says how it calls
        return (
            client.call(self.route, name=args.name)
            if "{name}" in self.route.path
            else client.call(self.route)
        )


def _positive(text: str) -> int:
    value = _non_negative(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def _assignment(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. target_reports=50), got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{key}'s value must be a JSON value (a number...), got {value!r}"
        ) from None


def _listed(client: AdminClient, args: argparse.Namespace) -> list[dict[str, Any]]:
    return [p for p in client.call(POPULATIONS) if args.all or p.get("archived_at") is None]


def _shown(client: AdminClient, args: argparse.Namespace) -> dict[str, Any]:
    population: dict[str, Any] = client.call(POPULATION, name=args.name)
    return {**population, "rounds": client.call(ROUNDS, name=args.name, params={"limit": args.rounds})}


def _changed(client: AdminClient, args: argparse.Namespace) -> dict[str, Any]:
    operator = args.operator or os.environ.get("USER") or "unknown"
    body = {"settings": dict(args.assignments), "operator": operator}
    changed: dict[str, Any] = client.call(CHANGE_SETTINGS, name=args.name, json=body)
    return changed


NAME = arg("name")
COMMANDS = (
    Command(
        "populations",
        "list the populations (admin API)",
        (arg("--all", action="store_true", help="archived populations too"),),
        POPULATIONS,
        lambda found, args, now: render.populations(found, now),
        call=_listed,
    ),
    Command(
        "show",
        "a population: model, privacy, settings, and its recent rounds with why each closed (admin API)",
        (NAME, arg("--rounds", type=_positive, default=10, help="how many recent rounds (default 10)")),
        POPULATION,
        lambda shown, args, now: render.population(shown, shown["rounds"], now),
        call=_shown,
    ),
    Command(
        "evaluate",
        "open an evaluation round (admin API)",
        (NAME,),
        EVALUATE,
        lambda opened, args, now: render.evaluation(opened, args.name),
    ),
    Command(
        "pause",
        "pause a population: no new rounds, the open ones finish (admin API)",
        (NAME,),
        PAUSE,
        lambda changed, args, now: render.pause_state(changed, now),
    ),
    Command(
        "resume",
        "resume a paused population (admin API)",
        (NAME,),
        RESUME,
        lambda changed, args, now: render.pause_state(changed, now),
    ),
    Command(
        "archive",
        "archive a population: paused for good, kept readable (admin API)",
        (NAME,),
        ARCHIVE,
        lambda changed, args, now: render.pause_state(changed, now),
    ),
    Command(
        "change-settings",
        "change settings that are safe mid-flight, from the next round on (admin API)",
        (
            NAME,
            arg("assignments", nargs="+", metavar="KEY=VALUE", type=_assignment),
            arg("--operator", help="who makes the change (default: $USER)"),
        ),
        CHANGE_SETTINGS,
        lambda changed, args, now: render.settings_changed(changed, dict(args.assignments)),
        call=_changed,
    ),
    Command(
        "settings-history",
        "a population's settings changes",
        (NAME,),
        SETTINGS_CHANGES,
        lambda changes, args, now: render.settings_history(changes),
    ),
    Command(
        "download",
        "download a population's model, manifest and global parameters with the admin token",
        (
            NAME,
            arg("--out", type=Path, required=True, help="the folder to write them to"),
            arg("--version", type=_non_negative, help="a model version (default: the current one)"),
        ),
        None,  # the device's routes, which take the admin token too (AdminClient.download)
        lambda written, args, now: render.download(written),
        call=lambda client, args: client.download(args.name, args.version, args.out),
    ),
)
