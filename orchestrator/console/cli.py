"""The console's commands on `python -m orchestrator`, derived from their declarations
(`console.commands.COMMANDS`): the parser of each, the server and token it calls with, and its
output."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from orchestrator.console.client import AdminClient, ConsoleError
from orchestrator.console.commands import COMMANDS

DEFAULT_URL = "http://127.0.0.1:8700"
BY_NAME = {command.name: command for command in COMMANDS}


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
    for command in COMMANDS:
        parser = sub.add_parser(command.name, parents=[server], help=command.help)
        for argument in command.arguments:
            parser.add_argument(*argument.flags, **argument.options)


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
    command, now = BY_NAME[args.command], time.time()
    try:
        client = AdminClient(server_url(args.url), _token(args))
        try:
            answer = command.answer(client, args)
        finally:
            client.close()
    except ConsoleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if e.bad_input else 1
    print(json.dumps(answer, indent=2) if args.json else command.render(answer, args, now))
    return 0
