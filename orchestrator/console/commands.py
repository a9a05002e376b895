"""The console's commands in `python -m orchestrator`: parsing, the call, the output."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from orchestrator.console import render
from orchestrator.console.client import AdminClient, ConsoleError

DEFAULT_URL = "http://127.0.0.1:8700"
COMMANDS = (
    "populations",
    "show",
    "evaluate",
    "pause",
    "resume",
    "archive",
    "change-settings",
    "settings-history",
    "download",
)


def add_commands(sub: Any) -> None:
    """The console's subcommands, on `python -m orchestrator`'s subparsers."""
    server = argparse.ArgumentParser(add_help=False)
    server.add_argument(
        "--url",
        help="the orchestrator's base URL (default: $ORCHESTRATOR_URL, else http://127.0.0.1:"
        f"$ORCHESTRATOR_PORT, else {DEFAULT_URL})",
    )
    server.add_argument(
        "--admin-token-file",
        type=Path,
        help="a file holding the admin token (default: $ORCHESTRATOR_ADMIN_TOKEN; never on the command line)",
    )
    server.add_argument("--json", action="store_true", help="print the server's answer as JSON, for scripts")
    listing = sub.add_parser("populations", parents=[server], help="list the populations (admin API)")
    listing.add_argument("--all", action="store_true", help="archived populations too")
    show = sub.add_parser(
        "show",
        parents=[server],
        help="a population: model, privacy, settings, and its recent rounds with why each closed (admin API)",
    )
    show.add_argument("name")
    show.add_argument("--rounds", type=_positive, default=10, help="how many recent rounds (default 10)")
    evaluate = sub.add_parser("evaluate", parents=[server], help="open an evaluation round (admin API)")
    evaluate.add_argument("name")
    pause = sub.add_parser(
        "pause", parents=[server], help="pause a population: no new rounds, the open ones finish (admin API)"
    )
    pause.add_argument("name")
    resume = sub.add_parser("resume", parents=[server], help="resume a paused population (admin API)")
    resume.add_argument("name")
    archive = sub.add_parser(
        "archive", parents=[server], help="archive a population: paused for good, kept readable (admin API)"
    )
    archive.add_argument("name")
    change = sub.add_parser(
        "change-settings",
        parents=[server],
        help="change settings that are safe mid-flight, from the next round on (admin API)",
    )
    change.add_argument("name")
    change.add_argument("assignments", nargs="+", metavar="KEY=VALUE", type=_assignment)
    change.add_argument("--operator", help="who makes the change (default: $USER)")
    history = sub.add_parser("settings-history", parents=[server], help="a population's settings changes")
    history.add_argument("name")
    download = sub.add_parser(
        "download",
        parents=[server],
        help="download a population's model, manifest and global parameters with the admin token",
    )
    download.add_argument("name")
    download.add_argument("--out", type=Path, required=True, help="the folder to write them to")
    download.add_argument("--version", type=_non_negative, help="a model version (default: the current one)")


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


def server_url(given: str | None) -> str:
    """--url, else $ORCHESTRATOR_URL, else this host at $ORCHESTRATOR_PORT (the port `serve`
    listens on), else DEFAULT_URL."""
    if given or os.environ.get("ORCHESTRATOR_URL"):
        return str(given or os.environ["ORCHESTRATOR_URL"])
    port = os.environ.get("ORCHESTRATOR_PORT", "").strip()
    if not port:
        return DEFAULT_URL
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConsoleError(f"ORCHESTRATOR_PORT must be a port number (1-65535), got {port!r}", bad_input=True)
    return f"http://127.0.0.1:{int(port)}"


def _token(args: argparse.Namespace) -> str:
    path: Path | None = args.admin_token_file
    token: str
    if path is not None:
        try:
            token = path.read_text().strip()
        except OSError as e:
            raise ConsoleError(f"cannot read the admin token file: {e}", bad_input=True) from None
    else:
        token = os.environ.get("ORCHESTRATOR_ADMIN_TOKEN", "")
    token = token.strip()
    if not token:
        raise ConsoleError(
            "no admin token: set ORCHESTRATOR_ADMIN_TOKEN or pass --admin-token-file", bad_input=True
        )
    return token


def run(args: argparse.Namespace) -> int:
    """Run a console command; 0 done, 2 bad input or refused, 1 the server could not be reached."""
    try:
        client = AdminClient(server_url(args.url), _token(args))
        try:
            answer, text = _call(client, args, time.time())
        finally:
            client.close()
    except ConsoleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if e.bad_input else 1
    print(json.dumps(answer, indent=2) if args.json else text)
    return 0


def _call(client: AdminClient, args: argparse.Namespace, now: float) -> tuple[Any, str]:
    if args.command == "populations":
        found = [p for p in client.populations() if args.all or p.get("archived_at") is None]
        return found, render.populations(found, now)
    if args.command == "show":
        population = client.population(args.name)
        rounds = client.rounds(args.name, args.rounds)
        return {**population, "rounds": rounds}, render.population(population, rounds, now)
    if args.command == "evaluate":
        opened = client.open_evaluation(args.name)
        return opened, render.evaluation(opened, args.name)
    if args.command in ("pause", "resume", "archive"):
        call = {"pause": client.pause, "resume": client.resume, "archive": client.archive}[args.command]
        changed = call(args.name)
        return changed, render.pause_state(changed, now)
    if args.command == "change-settings":
        operator = args.operator or os.environ.get("USER") or "unknown"
        changed = client.change_settings(args.name, dict(args.assignments), operator)
        return changed, render.settings_changed(changed, dict(args.assignments))
    if args.command == "settings-history":
        changes = client.settings_changes(args.name)
        return changes, render.settings_history(changes)
    written = client.download(args.name, args.version, args.out)
    return written, render.download(written)
